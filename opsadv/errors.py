"""Public home of opsadv's exceptions (see opsadv.core.errors)."""
from opsadv.core.errors import (  # noqa: F401
    BackendUnavailableError,
    EnvVarError,
    InvalidArgumentError,
    NoKernelError,
    OpsadvError,
    PluginError,
    ShardingError,
    UnknownKeywordError,
    UnknownOptionError,
    UnsafeArchiveError,
    ValidationError,
)
