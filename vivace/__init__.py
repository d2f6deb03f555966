"""vivace: a latency-first LLM inference server."""

import importlib.metadata

from vivace.config import EngineConfig
from vivace.engine.outputs import CompletionOutput, FinishReason, RequestOutput
from vivace.engine.sampling_params import SamplingParams

try:
    __version__ = importlib.metadata.version("vivace")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "FinishReason",
           "LLM", "AsyncEngine"]


def __getattr__(name: str):
    # Lazy so that `import vivace` (and the bench client) stays light.
    if name == "LLM":
        from vivace.engine.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from vivace.engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
