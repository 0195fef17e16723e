"""Model conversion: `convert_model` rewrites a model (transformers or any nn.Module) to run opsadv
ops and validates it against the original; `Optimizer` compiles / exports (torch.export .pt2);
`load` loads an exported program.  Uses only opsadv's public op API and core.

The names load on first use: importing a submodule (the CLI's `opsadv.convert.cli`, to list its subcommands)
does not pull in the conversion machinery (torch._dynamo and transformers' integrations, ~1.7 s)."""
from importlib import import_module

_NAMES = {"convert_model": ".api", "Optimizer": ".export", "load": ".export", "Fp8Recipe": ".fp8",
          "ConversionReport": ".report", "ValidationError": ".validate"}


def __getattr__(name: str):
    mod = _NAMES.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_NAMES))


__all__ = ["convert_model", "Optimizer", "load", "ConversionReport", "ValidationError", "Fp8Recipe"]
