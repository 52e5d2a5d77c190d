"""Lowered programs (lists of kog._C.Op) in tests: a config's program over random weights, and
one op rebuilt with some fields replaced."""

from __future__ import annotations

from typing import Sequence

import torch

from kog import _C
from kog.config import ModelConfig

# The Op constructor's arguments that read back as attributes of the same name (expert_ranks does not).
_FIELDS = ("opcode", "layer", "in_", "residual", "out", "w0", "w1", "deps", "w2", "w_type", "w1_type", "lanes",
           "slot", "window", "vocab_slice", "w_scale", "comm", "comm_push")


def with_op(ops: Sequence[_C.Op], i: int, **fields) -> list[_C.Op]:
    """ops with op i rebuilt from its own fields, `fields` replacing some of them. An op with
    expert_ranks must be given them again (they cannot be read back)."""
    args = {f: getattr(ops[i], f) for f in _FIELDS} | fields
    return list(ops[:i]) + [_C.Op(**args)] + list(ops[i + 1:])


def lowered_program(config: ModelConfig, seed: int = 0) -> tuple[list[_C.Op], _C.ModelDims, dict]:
    """config's program lowered over random f32 weights (kog.testing.tiny_models.random_weights
    with `seed`), its dims, and the prepared weights the ops point into (keep them alive while
    anything reads the ops' weights)."""
    from kog.models.decode import lower_program, model_dims, schedule_for
    from kog.models.weights import prepare_weights
    from kog.testing.tiny_models import random_weights

    weights = prepare_weights(config, random_weights(config, seed=seed), torch.float32)
    return lower_program(schedule_for(config), weights), model_dims(config, torch.float32), weights
