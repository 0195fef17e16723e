"""The one reader of opsadv's boolean environment variables, and of TRITON_INTERPRET as Triton reads it."""
from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import EnvVarError

TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")
ACCEPTED = "1/0, true/false, on/off, yes/no (case-insensitive)"
# Triton 3.6 (knobs.env_bool -> libtriton getenv_bool): these, lowercased and unstripped, are true;
# any other value is false (no error)
TRITON_TRUE = ("1", "true", "on", "y", "yes")


def parse_bool(name: str, value: str | None, default: bool = False) -> bool:
    """value of the environment variable `name` as a bool; unset or blank: default."""
    if value is None or not value.strip():
        return default
    v = value.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise EnvVarError(name, value, ACCEPTED)


def env_bool(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """The boolean environment variable `name` (os.environ unless `environ`); EnvVarError on other values."""
    return parse_bool(name, (os.environ if environ is None else environ).get(name), default)


def triton_interpret(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Triton runs its interpreter: TRITON_INTERPRET read with Triton's own rule, so opsadv never
    claims interpreter mode where Triton compiles (TRITON_INTERPRET=2 or " 1" is off for Triton)."""
    v = (os.environ if environ is None else environ).get("TRITON_INTERPRET")
    return v is not None and v.lower() in TRITON_TRUE
