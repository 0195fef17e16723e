"""Model conversion: `convert_model` rewrites a model (transformers or any nn.Module) to run opsadv
ops and validates it against the original; `Optimizer` compiles / exports (torch.export .pt2);
`load` loads an exported program.  Uses only opsadv's public op API and core."""
from .api import convert_model
from .export import Optimizer, load
from .fp8 import Fp8Recipe
from .report import ConversionReport
from .validate import ValidationError

__all__ = ["convert_model", "Optimizer", "load", "ConversionReport", "ValidationError", "Fp8Recipe"]
