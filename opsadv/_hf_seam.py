"""`attn_implementation="opsadv"` in transformers without calling anything first: opsadv's attention and mask
functions are registered with transformers' AttentionInterface / AttentionMaskInterface as soon as transformers'
modeling code is loaded (or at once, where it already is).  `import opsadv` never imports transformers: a
one-shot import hook waits for `transformers.modeling_utils` and registers right after it has run."""
from __future__ import annotations

import importlib.util
import sys
import warnings

from ._import_hook import when_imported

TARGET = "transformers.modeling_utils"


def _register() -> None:
    try:
        from opsadv.convert import hf_attention
        hf_attention.register()
    except Exception as e:      # noqa: BLE001 - a transformers we cannot serve must not break its import
        warnings.warn(f"opsadv: could not register attn_implementation='opsadv' with transformers: "
                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)


def install() -> None:
    if TARGET in sys.modules or importlib.util.find_spec("transformers"):
        when_imported(TARGET, _register)
