"""A tensor-parallel worker rank (kog.parallel.ranks): `python -m kog.parallel.worker --rank R
--addr A --port P --spec JSON`. Rank 0 (kog.LLM(..., tensor_parallel_size=N)) starts these on its
host; under torchrun the rank, address and port come from RANK, MASTER_ADDR and MASTER_PORT.
"""

from __future__ import annotations

import argparse
import os
import sys

from kog.parallel.ranks import decode_spec, serve_rank


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kog.parallel.worker", description=__doc__)
    ap.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "-1")))
    ap.add_argument("--addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("MASTER_PORT", "29500")))
    ap.add_argument("--spec", required=True, help="the RankSpec as JSON (what rank 0 loads)")
    args = ap.parse_args(argv)
    if args.rank < 1:
        print("kog worker: --rank (or RANK) must be >= 1; rank 0 runs the engine", file=sys.stderr)
        return 2
    serve_rank(decode_spec(args.spec), args.rank, args.addr, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
