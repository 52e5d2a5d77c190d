"""Kog: an LLM inference engine for AI agents."""

from __future__ import annotations

from kog.errors import (
    BackendError,
    InvalidOperation,
    InvalidRequest,
    KogError,
    KVCacheFull,
    ModelLoadError,
    UnknownSequence,
)
from kog.info import backend_info

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "InvalidOperation",
    "InvalidRequest",
    "KVCacheFull",
    "KogError",
    "ModelLoadError",
    "UnknownSequence",
    "__version__",
    "backend_info",
]
