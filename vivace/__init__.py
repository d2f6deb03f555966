"""vivace: a latency-first LLM inference server."""

from vivace.config import EngineConfig
from vivace.engine.outputs import CompletionOutput, FinishReason, RequestOutput
from vivace.engine.sampling_params import SamplingParams

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
