"""Does Kog stay fast when it does not own the machine?

    PYTHONPATH=python python bench/cpu_contention.py [--busy 0,1,2] [--repeats 3] [--baseline DIR]

SmolLM2-135M (bf16), batch 1, on the CPU. For each number of busy processes beside it (pure
Python spin loops, the stand-in for an agent's compiler or test runner) and each thread
setting (the default pool, and `KOG_NUM_THREADS=1`), a fresh process measures:
decode tok/s (64 steps after a 32-token prompt, the engine's decode call as the scheduler
makes it) and the time of a 256-token prefill. Medians over repeats: under contention the
spread is the point, not the best run.

"x 1-thread" is the row's decode rate over the `KOG_NUM_THREADS=1` rate at the same load, in
the same run (target: >= 0.8 under contention). `--baseline DIR` adds rows for another build
(DIR holds a `kog` package, e.g. a copy of python/ from an earlier commit) so that the idle
rate can be compared with it in the same run (target: >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPIN = "while True: pass"


def child(steps: int, repeats: int) -> None:
    import kog  # noqa: F401  first, as the CLI and server do (it sets torch's OpenMP wait policy)
    import numpy as np
    import torch

    from kog.loader import load_model
    from kog.models import ModelRunner, PrefillChunk

    model = load_model(dtype=torch.bfloat16)
    bs = 16
    runner = ModelRunner(model, num_kv_blocks=40, block_size=bs)
    table = np.arange(40, dtype=np.int32)
    slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
    prompt = model.tokenizer.encode("The history of the city begins in the Middle Ages, when a small " * 4)[:32]
    long = (prompt * 8)[:256]
    decode, prefill = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        runner.prefill([PrefillChunk(long, 0, table, slot(np.arange(len(long))))])
        prefill.append(time.perf_counter() - t)
        runner.prefill([PrefillChunk(prompt, 0, table, slot(np.arange(len(prompt))))])
        tok, t = np.array([1]), time.perf_counter()
        for i in range(steps):
            p = len(prompt) + i
            runner.decode(tok, [p], table[None], [p + 1], [slot(p)], sampled=tok)
        decode.append(steps / (time.perf_counter() - t))
    from kog import _C
    contention = getattr(_C, "_thread_pool_contention", None)  # absent in builds before the pool
    print(json.dumps({"decode": statistics.median(decode), "prefill": statistics.median(prefill),
                      "threads": _C.build_info()["cpu_threads"], "backoffs": contention()[0] if contention else -1}))


def measure(pythonpath: str, env_extra: dict[str, str], busy: int, steps: int, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath, **env_extra}
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    try:
        out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps), "--repeats", str(repeats)],
                             env=env, capture_output=True, text=True, timeout=1800, check=True).stdout
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", default="0,1,2", help="numbers of busy processes beside Kog")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", help="a folder holding another build's kog package (idle comparison)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.steps, args.repeats)
        return
    env = {k: v for k, v in os.environ.items() if k in ("KOG_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    for k in env:
        os.environ.pop(k)  # the rows set the thread count themselves
    here = str(ROOT / "python")
    settings = [("default", here, {}), ("KOG_NUM_THREADS=1", here, {"KOG_NUM_THREADS": "1"})]
    if args.baseline:
        settings.append(("baseline default", args.baseline, {}))
    rows = []
    for busy in (int(b) for b in args.busy.split(",")):
        res = {name: measure(path, extra, busy, args.steps, args.repeats) for name, path, extra in settings}
        one = res["KOG_NUM_THREADS=1"]["decode"]
        for name, r in res.items():
            rows.append((busy, name, r["threads"], r["decode"], r["decode"] / one, r["prefill"] * 1e3, r["backoffs"]))
    print(f"SmolLM2-135M bf16, batch 1, {os.cpu_count()} CPUs; medians of {args.repeats} runs of {args.steps} steps")
    print(f"{'busy':>4}  {'setting':<20}{'threads':>8}{'decode tok/s':>14}{'x 1-thread':>12}{'prefill 256 ms':>16}"
          f"{'back-offs':>11}")
    for busy, name, threads, tps, ratio, pre, backoffs in rows:
        print(f"{busy:>4}  {name:<20}{threads:>8}{tps:>14.1f}{ratio:>12.2f}{pre:>16.1f}"
              f"{backoffs if backoffs >= 0 else '-':>11}")
    if args.baseline:
        base = {b: r[3] for r in rows if r[1] == "baseline default" for b in [r[0]]}
        for busy, name, *_rest in rows:
            if name == "default":
                print(f"busy={busy}: default / baseline default = {_rest[1] / base[busy]:.2f}")


if __name__ == "__main__":
    main()
