import pytest
import torch

from kog import _C


@pytest.fixture(params=_C.cpu_isas_supported())
def cpu_isa(request):
    """Runs a test once per CPU kernel ISA this machine supports, then restores the default."""
    default = _C.build_info()["cpu_isa"]
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa(default)


@pytest.fixture
def gen():
    """A seeded generator: fresh random inputs per test, reproducible run to run."""
    g = torch.Generator()
    g.manual_seed(1234)
    return g
