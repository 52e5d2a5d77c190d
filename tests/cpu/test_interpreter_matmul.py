"""kog.program.interpreter.matmul, the prefill GEMM: fp32 sums, one rounding to x's dtype, through
torch's bf16 GEMM where the CPU has AMX-BF16 or AVX-512 BF16 (NATIVE_BF16_GEMM) and through an fp32 GEMM on upcast
copies elsewhere. Both paths, whichever this CPU takes by default."""

import sys

import pytest
import torch

import kog.models  # noqa: F401  (imports kog.program.interpreter in its package order)
from kog import _C
from kog.program import interpreter


def test_native_bf16_gemm_follows_the_cpus_bf16_flags():
    unit = _C.cpu_bf16_gemm()
    assert unit in ("amx_bf16", "avx512_bf16", "") and _C.build_info()["cpu_bf16_gemm"] == unit
    assert interpreter.NATIVE_BF16_GEMM == (unit != "")
    if sys.platform.startswith("linux"):
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
        want = "amx_bf16" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else ""
        assert unit == want


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("m", [3, 16, 77])
def test_bf16_matmul_is_fp32_sums_rounded_once_on_both_paths(monkeypatch, native, m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 300, generator=g).bfloat16()
    w = torch.randn(130, 300, generator=g).bfloat16()
    b = torch.randn(130, generator=g).bfloat16()
    monkeypatch.setattr(interpreter, "NATIVE_BF16_GEMM", native)
    got = interpreter.matmul(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 130)
    exact = x.double() @ w.double().T + b.double()
    # one rounding of an fp32 sum: within one bf16 ulp of the exact value, plus fp32 slack
    ulp = exact.abs().clamp_min(1e-30) * 2.0**-7
    assert ((got.double() - exact).abs() <= ulp + 1e-3).all()
    if m >= 16 and not native:  # the upcast path: bit for bit the fp32 GEMM, rounded
        assert torch.equal(got, torch.nn.functional.linear(x.float(), w.float(), b.float()).bfloat16())
