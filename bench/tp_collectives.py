"""One all-reduce between two rank processes on this host: torch.distributed (gloo over loopback)
vs Kog's shared-memory transport (kog._C.ShmTransport), the cost a decode step pays per lane
reduction (a Llama layer has two; batch 1 reduces one hidden-wide row).

    PYTHONPATH=python python bench/tp_collectives.py [--iters 2000] [--floats 1024 4096]

Prints microseconds per all-reduce (median of 5 rounds of --iters each, rank 0's clock) and the
ratio, in one run. Both ranks spin on their own core when the machine has two.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rank_main(rank: int, port: int, shm: str, iters: int, sizes: list[int]) -> None:
    import torch
    import torch.distributed as dist

    from kog import _C

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    t = _C.ShmTransport(shm, rank, 2, max(sizes), 1, 64, 60.0) if rank == 0 else None
    dist.barrier()
    t = t or _C.ShmTransport(shm, rank, 2, max(sizes), 1, 64, 60.0)
    dist.barrier()
    out = {}
    for n in sizes:
        x = torch.ones(n)
        for name, op in (("gloo", lambda: dist.all_reduce(x)), ("shm", lambda: t.all_reduce(x.data_ptr(), n))):
            rounds = []
            for _ in range(5):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    op()
                rounds.append((time.perf_counter() - t0) / iters * 1e6)
            out[f"{name}/{n}"] = statistics.median(rounds)
    dist.barrier()
    if rank == 0:
        print(json.dumps(out))
    del t
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--floats", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shm", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.shm, args.iters, args.floats)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shm = f"/kog-bench-coll-{os.getpid()}"
    env = os.environ | {"PYTHONPATH": str(ROOT / "python")}
    cmd = [sys.executable, __file__, "--port", str(port), "--shm", shm, "--iters", str(args.iters), "--floats",
           *map(str, args.floats)]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    res = json.loads(procs[0].communicate(timeout=600)[0].strip().splitlines()[-1])
    procs[1].wait(timeout=60)
    print(f"tp_collectives: all-reduce of f32 rows between 2 processes, {os.cpu_count()} cores, {args.iters} iters x 5")
    print("| floats | gloo (torch.distributed) us | shared memory us | gloo / shm |")
    print("|---|---|---|---|")
    for n in args.floats:
        g, m = res[f"gloo/{n}"], res[f"shm/{n}"]
        print(f"| {n} | {g:.1f} | {m:.2f} | {g / m:.0f}x |")


if __name__ == "__main__":
    main()
