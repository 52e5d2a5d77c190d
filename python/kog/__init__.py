"""Kog: an LLM inference engine for AI agents."""

from __future__ import annotations

from kog.cpu_threads import configure_openmp

configure_openmp()  # before anything imports torch (libgomp reads its wait policy once)

from kog.errors import (  # noqa: E402
    BackendError,
    ConversationDiverged,
    EngineDraining,
    EngineStepError,
    InvalidOperation,
    InvalidRequest,
    KogError,
    KVCacheFull,
    ModelLoadError,
    QueueFull,
    SessionClosed,
    UnknownSequence,
)
from kog.info import backend_info  # noqa: E402
from kog.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "ConversationDiverged",
    "EngineDraining",
    "EngineStepError",
    "InvalidOperation",
    "InvalidRequest",
    "KVCacheFull",
    "KogError",
    "ModelLoadError",
    "QueueFull",
    "SessionClosed",
    "UnknownSequence",
    "LLM",
    "SamplingParams",
    "__version__",
    "backend_info",
]


def __getattr__(name: str):
    # kog.LLM imports the loaders and the runner: only when asked for.
    if name == "LLM":
        from kog.llm import LLM

        return LLM
    if name == "_C":
        import importlib

        return importlib.import_module("kog._C")
    raise AttributeError(f"module 'kog' has no attribute {name!r}")
