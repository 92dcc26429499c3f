"""Command line, process start-up and supervision, and the Python API."""

from launch.client.async_llm import AsyncLLM
from launch.client.beam_search import BeamSearchOutput, BeamSearchParams
from launch.client.engine_processes import EngineDeadError
from launch.client.llm import LLM, CompletionOutput, Prompt
from launch.client.request_stream import StreamOutput
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
