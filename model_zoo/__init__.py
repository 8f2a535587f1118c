"""Model zoo: GPT-2 and Llama style decoders built from hybrid's tensor-parallel layers.

Names are imported on first use, so that :mod:`model_zoo.config` (plain data, the model description that the
configuration reads) imports without torch.
"""

from hybrid.lazy_exports import lazy_exports

_EXPORTS = {
    "GPTConfig": "model_zoo.config",
    "GPTModel": "model_zoo.gpt",
    "get_preset": "model_zoo.presets",
    "list_presets": "model_zoo.presets",
    "flops_per_token": "model_zoo.flops",
    "count_parameters": "model_zoo.flops",
    "count_model_parameters": "model_zoo.flops",
    "matmul_parameters": "model_zoo.flops",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
