"""The engine: sequences, the continuous-batching scheduler and the step loop."""

from kog.engine.engine import EngineConfig, LLMEngine
from kog.engine.async_engine import AsyncEngine, RequestStream, RequestUpdate
from kog.engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from kog.engine.sequence import Sequence, SeqStatus

__all__ = ["AsyncEngine", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "RequestStream", "RequestUpdate", "Sequence", "SeqStatus", "StreamDelta"]
