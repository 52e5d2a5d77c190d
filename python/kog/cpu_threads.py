"""Thread settings for the CPU work that runs outside Kog's own worker pool.

Kog's kernels run on its own pool (csrc/cpu/thread_pool.h: waits spin at most ~50 us, then
sleep). torch's OpenMP pool runs the prefill GEMMs; by default libgomp spins ~300k iterations at
every fork/join, which, next to a busy process, stalls each GEMM by whole scheduler time slices
(a 256-token prefill: 0.7 s idle, 6.8 s beside two busy processes). libgomp reads its policy
once, when it loads, so `configure_openmp` must run before torch is imported: `import kog`
does it first thing. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept.
"""

from __future__ import annotations

import os

# libgomp spin iterations before a waiting thread sleeps: ~10-50 us on current x86 cores (the
# default, 300k, is milliseconds). Measured idle on 2 cores (docs/PERFORMANCE.md, "CPU
# contention"): 2000 gave the fastest prefill, 20000 a slower one (torch's spinning workers
# took the cores Kog's pool needed between the GEMMs).
GOMP_SPINCOUNT = "2000"


def configure_openmp() -> None:
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT


def kog_num_threads() -> int | None:
    """KOG_NUM_THREADS as a positive int, or None when unset or not one."""
    try:
        n = int(os.environ.get("KOG_NUM_THREADS", ""))
    except ValueError:
        return None
    return n if n > 0 else None


def apply_torch_threads() -> None:
    """KOG_NUM_THREADS also sizes torch's pool (the prefill GEMMs): one knob for all of Kog."""
    n = kog_num_threads()
    if n is not None:
        import torch

        torch.set_num_threads(n)
