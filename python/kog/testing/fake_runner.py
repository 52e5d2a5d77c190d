"""A model stand-in for engine tests: its "KV cache" holds token ids in a real KVCacheStorage,
and its next-token logits are a pseudo-random function of the whole context it reads back
through the block table. Any KV bookkeeping error (wrong slot, missed copy-on-write, a stale
prefix-cache hit, a bad swap) changes what it reads and so what the engine generates, which an
oracle computing the same function on the true token sequence detects.
"""

from __future__ import annotations

import numpy as np
import torch

from kog.kvcache import KVCacheStorage, KVLayout


def context_logits(context: list[int], vocab_size: int, peak: float = 4.0) -> torch.Tensor:
    """[vocab] float32 logits determined by the exact token sequence (order-sensitive)."""
    g = torch.Generator()
    g.manual_seed(hash(tuple(context)) % (2**62))
    return torch.randn(vocab_size, generator=g) * peak


class FakeRunner:
    """Implements the runner interface (prefill/decode over paged KV) for a fake model.

    Args:
        vocab_size: logits width (use the tokenizer's vocabulary size).
        num_blocks: device KV blocks.
        block_size: tokens per block.
        num_host_blocks: host swap pool blocks.
    """

    def __init__(self, vocab_size: int, num_blocks: int, block_size: int = 4, num_host_blocks: int = 0) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size, dtype=torch.float32)
        self.kv = KVCacheStorage(layout, num_blocks, num_host_blocks)
        self.max_model_len = 1 << 20  # as a draft model (kog.speculation.draft_model): no position limit
        self.calls = {"prefill": 0, "decode": 0, "prefill_tokens": 0, "verify": 0, "verify_tokens": 0}

    def logits(self, context: list[int]) -> torch.Tensor:
        """[vocab] next-token logits of a context (subclasses make other fake models)."""
        return context_logits(context, self.vocab_size)

    def _write(self, slots: np.ndarray, ids: list[int]) -> None:
        t = torch.tensor(ids, dtype=torch.float32).view(-1, 1, 1)
        self.kv.write(0, np.asarray(slots), t, t)

    def _read(self, block_table: np.ndarray, n_tokens: int) -> list[int]:
        k = self.kv.gather(0, block_table, n_tokens)[0, :, 0, 0]
        return [int(x) for x in k.tolist()]

    def prefill(self, chunks) -> torch.Tensor:
        self.calls["prefill"] += 1
        rows = []
        for c in chunks:
            assert len(c.slots) == len(c.token_ids)
            self.calls["prefill_tokens"] += len(c.token_ids)
            self._write(c.slots, list(c.token_ids))
            rows.append(self.logits(self._read(c.block_table, c.start_pos + len(c.token_ids))))
        return torch.stack(rows)

    def verify(self, chunks) -> list[torch.Tensor]:
        """Per chunk [len(chunk), vocab]: the logits after each of its tokens (speculation)."""
        self.calls["verify"] += 1
        out = []
        for c in chunks:
            assert len(c.slots) == len(c.token_ids)
            self.calls["verify_tokens"] += len(c.token_ids)
            self._write(c.slots, list(c.token_ids))
            context = self._read(c.block_table, c.start_pos + len(c.token_ids))
            out.append(torch.stack([self.logits(context[: c.start_pos + i + 1])
                                    for i in range(len(c.token_ids))]))
        return out

    def decode(self, tokens, positions, block_tables, seq_lens, slots) -> torch.Tensor:
        self.calls["decode"] += 1
        self._write(np.asarray(slots), [int(t) for t in tokens])
        rows = [self.logits(self._read(block_tables[i], int(seq_lens[i])))
                for i in range(len(tokens))]
        return torch.stack(rows)
