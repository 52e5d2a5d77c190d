"""Whether GPU tests can run here; shared by every module under tests/gpu/."""

from __future__ import annotations

import os

import pytest

from kog.info import gpu_unavailable_reason


def gpu_test_marks() -> list:
    """pytestmark for a GPU test module: skip cleanly without a GPU, except under
    KOG_REQUIRE_GPU=1 (bench/device_check.sh), where all-skipped must not read as a pass."""
    reason = gpu_unavailable_reason()
    if reason is not None and os.environ.get("KOG_REQUIRE_GPU") == "1":
        raise RuntimeError(f"KOG_REQUIRE_GPU=1 but the GPU tests cannot run: {reason}")
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=reason or "")]
