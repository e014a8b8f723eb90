"""Loom: continuous-batching LLM inference over a paged KV cache, in Python + PyTorch."""

from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.engine.engine import LLMEngine
from loom.engine.llm import LLM
from loom.engine.outputs import RequestOutput
from loom.sampling import SamplingParams, StructuredOutputParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "StructuredOutputParams", "EngineConfig",
           "SchedulerConfig", "CacheConfig"]
