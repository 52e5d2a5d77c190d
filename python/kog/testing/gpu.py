"""Whether GPU tests can run here; shared by every module under tests/gpu/."""

from __future__ import annotations

import os

import pytest
import torch

from kog import _C


def gpu_skip_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    if not _C.has_gpu_backend:
        backend = _C.build_info()["backend"]
        return f"kog._C was built with KOG_BACKEND={backend}; rebuild with KOG_BACKEND=cuda or rocm"
    if not torch.cuda.is_available():
        return "no GPU visible to torch (torch.cuda.is_available() is False)"
    return None


def gpu_test_marks() -> list:
    """pytestmark for a GPU test module: skip cleanly without a GPU, except under
    KOG_REQUIRE_GPU=1 (bench/device_check.sh), where all-skipped must not read as a pass."""
    reason = gpu_skip_reason()
    if reason is not None and os.environ.get("KOG_REQUIRE_GPU") == "1":
        raise RuntimeError(f"KOG_REQUIRE_GPU=1 but the GPU tests cannot run: {reason}")
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=reason or "")]
