"""The program's instruction type and its dependency rule.

A program is a list of Instructions over a token batch: every activation buffer is
[n_tokens, width] (kog.program.opcodes.Buffer), whatever n_tokens is. Decode runs it with one
token per sequence, prefill with a chunk of N tokens per sequence; the ops do not change, only
the batch (kog.program.batch.TokenBatch) they run over.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union

from kog.program.opcodes import Buffer, Opcode

# A resource is an activation buffer, a layer's KV cache ("kv.<layer>") or a slot of the lane
# history ("lanes.hist.<slot>", a slice of Buffer.LANE_HIST: one resource per slot, so a delayed
# reduction waits for the gather it reads, nothing later).
Resource = Union[Buffer, str]


class Rows(Enum):
    """Which tokens of the batch an op runs over.

    ALL: every token. SAMPLED: only the tokens whose next-token distribution is wanted (the
    last token of each prefill chunk; every token in decode and in speculative verification).
    An op over SAMPLED rows that reads a buffer holding ALL rows reads those rows only.
    """

    ALL = "all"
    SAMPLED = "sampled"


@dataclass(frozen=True)
class Instruction:
    opcode: Opcode
    layer: int                    # -1 for model-level instructions
    reads: tuple[Resource, ...]
    writes: tuple[Resource, ...]
    weights: tuple[str, ...]      # names of prepared weights (kog.models.weights: fused qkv_proj / gate_up_proj)
    deps: tuple[int, ...] = ()    # indices of earlier instructions that must complete first
    rows: Rows = Rows.ALL
    lanes: int = 1                # LINEAR: 1, or the lanes of a lane projection (csrc/schedule/program.h Op::lanes)
    window: int = 0               # ATTN_DECODE: 0, or a sliding window (the last `window` positions)
    vocab_slice: bool = False     # LINEAR into LOGITS: a tensor-parallel rank's vocabulary slice (Op::vocab_slice)


def hist_slot(slot: int) -> str:
    """The resource of a lane-history slot."""
    return f"lanes.hist.{slot}"


def slot_of(resource: Resource) -> int | None:
    """The lane-history slot a resource names, or None."""
    if isinstance(resource, str) and resource.startswith("lanes.hist."):
        return int(resource.rsplit(".", 1)[1])
    return None


class ProgramBuilder:
    """Collects ops in a valid sequential order; build() adds the dependencies."""

    def __init__(self) -> None:
        self._ops: list[tuple[Opcode, int, tuple, tuple, tuple, Rows]] = []

    def op(self, opcode: Opcode, layer: int, reads: tuple[Resource, ...], writes: tuple[Resource, ...],
           weights: tuple[str, ...] = (), rows: Rows = Rows.ALL, lanes: int = 1, window: int = 0,
           vocab_slice: bool = False) -> None:
        self._ops.append((opcode, layer, tuple(reads), tuple(writes), tuple(weights), rows, lanes, window, vocab_slice))

    def build(self) -> list[Instruction]:
        return with_dependencies(self._ops)


def with_dependencies(raw: list[tuple]) -> list[Instruction]:
    """Instructions of (opcode, layer, reads, writes, weights, rows[, lanes, window]) rows, each with its deps.

    NOTE: deps of an instruction are the last writer of everything it reads or writes (RAW,
    WAW) and every reader since that write of what it writes (WAR): enough for any executor
    that starts an instruction only after its deps complete to compute what the sequential
    order computes.
    """
    last_writer: dict[Resource, int] = {}
    readers_since_write: dict[Resource, list[int]] = {}
    out: list[Instruction] = []
    for i, (op, layer, reads, writes, weights, rows, *extra) in enumerate(raw):
        deps: set[int] = set()
        for r in reads + writes:
            if r in last_writer:
                deps.add(last_writer[r])
        for w in writes:
            deps.update(readers_since_write.get(w, ()))
        deps.discard(i)
        for r in reads:
            readers_since_write.setdefault(r, []).append(i)
        for w in writes:
            last_writer[w] = i
            readers_since_write[w] = []
        out.append(Instruction(op, layer, reads, writes, weights, tuple(sorted(deps)), rows, *extra))
    return out
