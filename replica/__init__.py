"""The replica: its engine (continuous batching over a paged KV cache with prefix caching) at
this package's root and, in the ``replica.server`` subpackage, its gRPC server.
``from replica import LLM, SamplingParams``."""

from replica.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so importing replica.sampling_params does not load torch and the model code.
    if name == "LLM":
        from replica.llm import LLM

        return LLM
    if name == "LLMEngine":
        from replica.engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from replica.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
