"""Tolerances of kernel-vs-reference comparisons, one place for all tests.

fp32: both sides compute in fp32 but in different orders (vectorized sums), about 1e-5.
bf16/fp16: one rounding per stored value on each side; a result may land one ulp apart
(2^-8 relative for bf16, 2^-11 for fp16), plus what an ulp of an input shifts.
"""

import torch

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **override) -> None:
    tol = dict(TOLERANCES[expected.dtype])
    tol.update({k: v for k, v in override.items() if v is not None})
    torch.testing.assert_close(actual, expected, **tol)
