"""Command line, process start-up and supervision, and the Python API."""

from launch.engine import EngineDeadError
from launch.llm import LLM, CompletionOutput, Prompt
from protocol.engine import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineDeadError", "Prompt", "SamplingParams"]
