"""laguna-dflash: serve Poolside Laguna MoE models fast with DFlash speculative decoding."""

from .config import SamplingParams
from .engine.sampler import Logprob
from .llm import LLM, RequestOutput
from .structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "__version__"]
