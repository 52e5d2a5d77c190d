"""Greedy decoding loops used as ground truth: one sequence alone on a Kog runner, and
transformers' own forward with its KV cache."""

from __future__ import annotations

import numpy as np
import torch

from kog.models import ModelRunner, PrefillChunk


def runner_greedy(runner: ModelRunner, prompt: list[int], n_new: int) -> list[int]:
    """Greedy ids of one sequence with nothing else in the batch, on a fresh cache (blocks 0..)."""
    bs = runner.block_size
    table = np.arange(-(-(len(prompt) + n_new) // bs), dtype=np.int32)

    def slot(p: int) -> int:
        return int(table[p // bs]) * bs + p % bs

    logits = runner.prefill([PrefillChunk(prompt, 0, table, np.array([slot(p) for p in range(len(prompt))]))])
    out = [int(logits[0].argmax())]
    while len(out) < n_new:
        p = len(prompt) + len(out) - 1
        logits = runner.decode(np.array([out[-1]]), np.array([p]), table[None], np.array([p + 1], np.int32),
                               np.array([slot(p)]))
        out.append(int(logits[0].argmax()))
    return out


def hf_greedy(hf, prompt: list[int], n_new: int) -> list[int]:
    """transformers' own forward with its KV cache, argmax each step, never stopping at EOS."""
    out, past, ids = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n_new):
            res = hf(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out
