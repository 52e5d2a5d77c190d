"""GPU test fixtures. Every test here needs a GPU build of kog._C and a visible device; the
modules skip themselves otherwise (see test_ops_gpu.py)."""

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
