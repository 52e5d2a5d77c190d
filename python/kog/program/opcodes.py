"""Opcodes and activation buffers of the model program; they mirror csrc/schedule/opcodes.h.

tests/cpu/test_schedule.py checks both against the values kog._C exports (SCHEDULE_OPCODES,
SCHEDULE_BUFFERS); buffer widths come from C++ too (kog._C.ModelDims.buffer_width).
"""

from __future__ import annotations

from enum import IntEnum


class Opcode(IntEnum):
    EMBED = 0
    RMS_NORM = 1
    LINEAR = 2
    QK_NORM = 3
    ROPE = 4
    KV_APPEND = 5
    ATTN_DECODE = 6
    SILU_MUL = 7
    SAMPLE = 8
    ROUTER = 9        # MoE: routing buffer (expert ids + weights) from the router GEMV
    MOE_EXPERTS = 10  # MoE: the routed experts' SwiGLU MLPs, weighted, summed
    # Laneformer lanes (kog.lane_config): lane-wide buffers are [rows, lanes, hidden]
    LANE_SCALE = 11      # in place: a_l * sqrt(lanes)
    LANE_SUM = 12        # in place: every lane = the sum over lanes
    LANE_GATHER = 13     # a lane-history slot = every lane of the input (an all-gather across lane ranks)
    LANE_ADD_PAST = 14   # in place: a_l + sum over lanes of a history slot - its lane l
    LANE_MEAN = 15       # MERGED = mean over the lanes
    LANE_MERGE_SUM = 16  # MERGED = sum over the lanes of (residual + in)
    # Collectives of a tensor-parallel rank's program (kog.parallel): only in a shard's program
    ALL_REDUCE = 17      # in place: the sum of the buffer over the ranks
    ALL_GATHER = 18      # the ranks' buffers side by side: rank r's columns r w .. (r + 1) w


class Buffer(IntEnum):
    TOKENS = 0
    HIDDEN = 1
    RESIDUAL = 2
    NORMED = 3
    QKV = 4
    ATTN = 5
    GATE_UP = 6
    ACT = 7
    LOGITS = 8
    ROUTE = 9  # [rows, 2 top_k] int32 words: top_k expert ids, then the f32 bits of their weights
    MERGED = 10     # [rows, hidden]: the lanes merged before the LM head (Laneformer)
    LANE_HIST = 11  # [rows, slots, lanes, hidden]: kept lane outputs; ops name a slot as "lanes.hist.<slot>"
