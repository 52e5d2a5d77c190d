"""Which software prefetch should the bf16 GEMV use on this CPU?

    PYTHONPATH=python python bench/cpu_prefetch.py [--repeats 3] [--new-tokens 128]

SmolLM2-135M-Instruct (the default model) loaded as bf16 decodes `--new-tokens` greedy tokens at
batch 1 under each weight-prefetch policy of the CPU bf16 GEMV (kog._C.set_cpu_prefetch: none =
the hardware prefetcher alone, t0 = software prefetch 1 KiB ahead into every level, nta = the
same, non-temporal), the policies alternating run by run in one process. Printed: best tok/s,
the GB/s of weights that streams, the fraction of the STREAM triad measured in the same run,
and the ratio to `none`. The default policy (by CPU vendor, csrc/cpu/dispatch.cpp) is marked;
what a new CPU measures here is what its default should be.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import kog
from kog import _C

sys.path.insert(0, str(Path(__file__).parent))
from cpu_decode import triad_gbs  # noqa: E402

POLICIES = ("none", "t0", "nta")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    default = _C.cpu_prefetch()
    llm = kog.LLM(None, dtype="bfloat16", max_num_seqs=1)
    weight_bytes = llm.engine.runner.weight_bytes
    params = kog.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    best = {p: 0.0 for p in POLICIES}
    triad = triad_gbs()
    try:
        for policy in POLICIES:  # warm-up: first-touch of the weights and the code
            _C.set_cpu_prefetch(policy)
            llm.generate(prompt, params)
        for _ in range(args.repeats):
            for policy in POLICIES:
                _C.set_cpu_prefetch(policy)
                t = time.perf_counter()
                out = llm.generate(prompt, params)
                tps = len(out[0].outputs[0].token_ids) / (time.perf_counter() - t)
                best[policy] = max(best[policy], tps)
            triad = max(triad, triad_gbs(repeats=2))
    finally:
        _C.set_cpu_prefetch(default)
    info = _C.build_info()
    print(f"SmolLM2-135M bf16 ({weight_bytes / 1e6:.0f} MB of weights a token), batch 1, {args.new_tokens} tokens, "
          f"best of {args.repeats} alternating; {info['cpu_isa']} kernels, {info['cpu_threads']} threads; "
          f"triad {triad:.1f} GB/s")
    print(f"{'prefetch':<10}{'tok/s':>9}{'GB/s':>8}{'% triad':>9}{'vs none':>9}")
    for policy in POLICIES:
        gbs = best[policy] * weight_bytes / 1e9
        mark = "  (default here)" if policy == default else ""
        print(f"{policy:<10}{best[policy]:>9.1f}{gbs:>8.1f}{100 * gbs / triad:>8.0f}%"
              f"{best[policy] / best['none']:>8.2f}x{mark}")


if __name__ == "__main__":
    main()
