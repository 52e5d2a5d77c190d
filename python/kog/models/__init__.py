"""Model execution: the runner (prefill in Python, decode in one native call) and its weights."""

from kog.models.runner import ModelRunner, PrefillChunk

__all__ = ["ModelRunner", "PrefillChunk"]
