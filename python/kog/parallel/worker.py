"""A tensor-parallel worker rank (kog.parallel.ranks), or every rank of one host:

    python -m kog.parallel.worker --rank R --size N --addr A --port P
    python -m kog.parallel.worker --size N --nnodes H --node-rank K --addr A --port P

Rank 0 (kog.LLM(..., tensor_parallel_size=N) / kog serve -tp N on host 0) starts its host's
ranks itself and sends every rank the model to load; another host runs the second form (its
ranks), or torchrun runs the first with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
"""

from __future__ import annotations

import argparse
import os
import sys

from kog.parallel.ranks import Placement, run_node, serve_rank


def main(argv: list[str] | None = None) -> int:
    env = os.environ
    ap = argparse.ArgumentParser(prog="python -m kog.parallel.worker", description=__doc__)
    ap.add_argument("--rank", type=int, default=int(env["RANK"]) if "RANK" in env else None)
    ap.add_argument("--size", type=int, default=int(env.get("WORLD_SIZE", "0")), help="tensor_parallel_size")
    ap.add_argument("--nnodes", type=int, default=None, help="hosts (with --node-rank: run this host's ranks)")
    ap.add_argument("--node-rank", type=int, default=None)
    ap.add_argument("--addr", default=env.get("MASTER_ADDR", "127.0.0.1"), help="rank 0's host")
    ap.add_argument("--port", type=int, default=int(env.get("MASTER_PORT", "29500")), help="rank 0's rendezvous port")
    args = ap.parse_args(argv)
    if args.size < 2:
        print("kog worker: --size (or WORLD_SIZE) must be >= 2", file=sys.stderr)
        return 2
    if args.node_rank is not None:
        return run_node(args.size, Placement(args.nnodes or 1, args.node_rank, args.addr, args.port))
    if args.rank is None or args.rank < 1:
        print("kog worker: --rank (or RANK) must be >= 1; rank 0 runs the engine", file=sys.stderr)
        return 2
    serve_rank(args.rank, args.size, args.addr, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
