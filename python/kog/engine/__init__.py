"""The engine: sequences, the continuous-batching scheduler and the step loop."""

from kog.engine.engine import EngineConfig, LLMEngine
from kog.engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from kog.engine.sequence import Sequence, SeqStatus

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "Sequence", "SeqStatus", "StreamDelta"]
