"""Model zoo: GPT-2 and Llama style decoders built from hybrid's tensor-parallel layers."""

from model_zoo.config import GPTConfig
from model_zoo.flops import count_model_parameters, count_parameters, flops_per_token, matmul_parameters
from model_zoo.gpt import GPTModel
from model_zoo.presets import get_preset, list_presets

__all__ = ["GPTConfig", "GPTModel", "get_preset", "list_presets", "flops_per_token", "count_parameters",
           "count_model_parameters", "matmul_parameters"]
