"""Loading a draft model for speculative decoding next to an engine's target model."""

from __future__ import annotations

import os

import torch

from kog.engine.engine import LLMEngine
from kog.errors import InvalidRequest

# KV cache of the draft model: every sequence gets a slab of the full context, at most this much.
DRAFT_KV_CACHE_GIB = 0.25


def load_draft_model(engine: LLMEngine, path: str | os.PathLike[str], dtype: torch.dtype | None, context: int,
                     block_size: int, max_num_seqs: int, progress: bool | None = None) -> None:
    """Loads a small model and makes it the engine's drafter for method "draft" requests.

    Args:
        engine: the target's engine.
        path: the draft model (HF folder or .gguf); it must share the target's tokenizer.
        dtype: its compute dtype (None: from the checkpoint).
        context: the engine's context length (each draft slab holds up to this many tokens).
        block_size: tokens per draft KV block.
        max_num_seqs: sequences that may hold draft state at once.
        progress: progress bar while loading.
    """
    from kog.kvcache import KVLayout
    from kog.loader import load_model
    from kog.models.runner import ModelRunner

    draft = load_model(path, dtype, progress)
    if draft.tokenizer.vocab_size != engine.tokenizer.vocab_size:
        raise InvalidRequest(f"the draft model's tokenizer ({draft.tokenizer.vocab_size} tokens) is not the "
                             f"target's ({engine.tokenizer.vocab_size})")
    cfg = draft.config
    layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, draft.dtype)
    wanted = max_num_seqs * -(-min(context, cfg.max_position_embeddings) // block_size)
    budget = int(DRAFT_KV_CACHE_GIB * 2**30) // layout.bytes_per_block
    runner = ModelRunner(draft, num_kv_blocks=max(max_num_seqs, min(wanted, budget)), block_size=block_size)
    engine.speculator.use_draft_model(runner, max_num_seqs)
