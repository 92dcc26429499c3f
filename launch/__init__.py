"""Command line, process start-up and supervision, and the Python API."""

from launch.async_llm import AsyncLLM, StreamOutput
from launch.beam_search import BeamSearchOutput, BeamSearchParams
from launch.engine import EngineDeadError
from launch.llm import LLM, CompletionOutput, Prompt
from protocol.engine import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineDeadError",
    "Prompt",
    "SamplingParams",
    "StreamOutput",
]
