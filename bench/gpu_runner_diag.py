"""Where does ModelRunner on a GPU part from the CPU? (tests/gpu/test_runner_gpu.py's engine-level
tests generated other tokens on an H200 from the first token on, while one 300-token prefill and
single-sequence greedy decode matched.) Prints the max |logit difference| of each case, CPU vs
GPU, on a tiny fp32 llama: prefill of short and long chunks, alone and batched, then batched
decode. Usage: python bench/gpu_runner_diag.py [--device cuda]"""

from __future__ import annotations

import argparse

import torch

from kog.loader import LoadedModel
from kog.models import ModelRunner, PrefillChunk
from kog.testing.tiny_models import random_weights, tiny_config, tiny_tokenizer


def chunk(tokens, table, start=0):
    return PrefillChunk(tokens, start, table, [table[p // 16] * 16 + p % 16 for p in range(start, start + len(tokens))])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    c = tiny_config("llama", max_position_embeddings=1024)
    m = LoadedModel(path=None, config=c, weights=random_weights(c, seed=4), dtype=torch.float32,
                    tokenizer=tiny_tokenizer(), chat_template=None, stop_token_ids=(2,))
    g = torch.Generator().manual_seed(0)
    toks = lambda n: torch.randint(3, c.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    cases = {
        "1 chunk x3": [(toks(3), [5])],
        "1 chunk x16": [(toks(16), [6])],
        "1 chunk x17": [(toks(17), [7, 8])],
        "1 chunk x300": [(toks(300), list(range(19, 0, -1)))],
        "2 chunks x3,x4": [(toks(3), [9]), (toks(4), [10])],
        "2 chunks x20,x5": [(toks(20), [11, 12]), (toks(5), [13])],
    }
    for name, spec in cases.items():
        out = []
        for dev in ("cpu", args.device):
            r = ModelRunner(m, 64, device=dev)
            out.append(r.prefill([chunk(t, tb) for t, tb in spec]))
        d = (out[0] - out[1]).abs().max().item()
        print(f"prefill {name:18s} max|d| {d:.3e}  (max|logit| {out[0].abs().max().item():.2f})  "
              f"argmax equal {bool((out[0].argmax(-1) == out[1].argmax(-1)).all())}", flush=True)
    # batched decode after a batched prefill
    spec = [(toks(5), [20, 21]), (toks(9), [22, 23]), (toks(2), [24, 25])]
    res = []
    for dev in ("cpu", args.device):
        r = ModelRunner(m, 64, device=dev)
        first = r.prefill([chunk(t, tb) for t, tb in spec])
        nxt = first.argmax(-1).tolist()
        pos = [len(t) for t, _ in spec]
        import numpy as np
        tables = np.array([tb for _, tb in spec], dtype=np.int32)
        slots = [tb[p // 16] * 16 + p % 16 for (_, tb), p in zip(spec, pos)]
        lg = r.decode(nxt, pos, tables, [p + 1 for p in pos], slots)
        res.append((first, lg))
    print(f"batched decode step max|d| {(res[0][1] - res[1][1]).abs().max().item():.3e}; "
          f"argmax {res[0][1].argmax(-1).tolist()} vs {res[1][1].argmax(-1).tolist()}", flush=True)
    for b in range(3):  # each row alone
        r_c, r_g = ModelRunner(m, 64), ModelRunner(m, 64, device=args.device)
        t, tb = spec[b]
        for r in (r_c, r_g):
            r.prefill([chunk(t, tb)])
        import numpy as np
        pos = len(t)
        nx = [int(res[0][0][b].argmax())]
        outs = [r.decode(nx, [pos], np.array([tb], dtype=np.int32), [pos + 1], [tb[pos // 16] * 16 + pos % 16])
                for r in (r_c, r_g)]
        print(f"row {b} alone decode max|d| {(outs[0] - outs[1]).abs().max().item():.3e}", flush=True)


if __name__ == "__main__":
    main()
