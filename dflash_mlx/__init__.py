"""dflash-mlx: lossless DFlash speculative decoding for Qwen3.5 models on MLX."""

from .api import DFlashModel, GenerationResponse, generate, load, stream_generate
from .sampling import Sampler

make_sampler = Sampler

__all__ = ["load", "generate", "stream_generate", "DFlashModel", "GenerationResponse", "Sampler", "make_sampler"]
__version__ = "0.1.0"
