"""The GPU persistent kernel's program as the synchronization model sees it: per op, its work
item count and the resources its items read and write (kog.testing.sync_model runs it).

    ops = sync_ops(_C.expand_gpu_program(lowered, dims), dims, batch=3, max_parts=2)

Hazards are per whole resource: the items of one op are assumed not to conflict with each
other (each writes its own rows or chunk; an RMS_NORM that still read-modify-writes its residual
runs as one item per row).

What an op touches is read off run_item in csrc/gpu/decode/persistent_kernel.cuh, not off the
op's buffer fields alone: an attention item writes the partials scratch, and the last item of
each (sequence, KV head) group reads the group's partials and writes ATTN (SyncOp.group_items:
the model runs that tail and its group counter), the last LM-head item of each vocabulary chunk
reads the chunk's LOGITS and writes the f32 logits and the chunk summaries that SAMPLE reads
(not LOGITS), the last router GEMV item of an MoE layer routes every row, groups the pairs and
gathers their rows into the MoE scratch that the expert GEMVs and the combine read, and SAMPLE in
loop mode writes the token, the stop flags and the next step's position, seq_len and slot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from kog import _C
from kog.program.opcodes import Buffer, Opcode

LINEAR_SAMPLE_PARTIAL = _C.GPU_OP_LINEAR_SAMPLE_PARTIAL
LINEAR_SILU_MUL = _C.GPU_OP_LINEAR_SILU_MUL
LINEAR_ROPE_KV = _C.GPU_OP_LINEAR_ROPE_KV
ROUTER_GEMV, MOE_GATE_UP, MOE_DOWN, MOE_COMBINE = (_C.GPU_OP_ROUTER_GEMV, _C.GPU_OP_MOE_GATE_UP, _C.GPU_OP_MOE_DOWN,
                                                   _C.GPU_OP_MOE_COMBINE)
GPU_OP_NAMES = {LINEAR_SAMPLE_PARTIAL: "LINEAR_SAMPLE_PARTIAL", LINEAR_SILU_MUL: "LINEAR_SILU_MUL",
                LINEAR_ROPE_KV: "LINEAR_ROPE_KV", ROUTER_GEMV: "ROUTER_GEMV", MOE_GATE_UP: "MOE_GATE_UP",
                MOE_DOWN: "MOE_DOWN", MOE_COMBINE: "MOE_COMBINE"}

# Per-sequence state outside the activation arena (PersistentDecodeParams fields).
POSITIONS, SEQ_LENS, SLOTS = "positions", "seq_lens", "slots"
FINISHED, OUT_TOKENS, LOGITS_OUT = "finished", "out_tokens", "logits_out"
PARTIALS = "attn_partials"  # the one scratch every layer's attention shares
GROUP_COUNTS = "attn_group_counts"  # partial items done per (sequence, KV head), shared by every layer
CHUNK_COUNTS = "sample_chunk_counts"  # LM-head items done per chunk of the vocabulary
SAMPLE_SUMMARIES = "sample_summaries"  # the LM head's tails' chunk summaries and candidates
# The MoE scratch (params.h MoeScratch), shared by every MoE layer: the router's logits, the
# pairs' gathered x rows, their order and groups (with their weights), act and y.
MOE_LOGITS, MOE_X, MOE_GROUPS, MOE_ACT, MOE_Y = "moe.logits", "moe.x", "moe.groups", "moe.act", "moe.y"
ROUTE_COUNT = "moe_route_count"  # router items done; the last runs the route tail

# Op index of the step's flag check (every workgroup reads `finished` at the top of a step > 0),
# modelled as an op before op 0 with one item per workgroup.
FLAG_CHECK = -1


@dataclass(frozen=True)
class SyncOp:
    """One op of the expanded program, reduced to what the protocol and its hazards need."""

    name: str                  # e.g. "LINEAR L0 NORMED->QKV", for reports
    n_items: int               # items_of(op); a wait targets min(n_items, grid) workgroup signals
    deps: tuple[int, ...]      # indices of ops of the same step it waits for
    reads: frozenset[str]
    writes: frozenset[str]
    # > 0: consecutive runs of this many items (the last group: what is left) form a group whose
    # last item to finish also runs the group's tail, counted on the group's counter in the
    # group_counter array (attention: item = group * max_parts + part, the tail merges the parts;
    # the LM head: a chunk of the vocabulary, the tail summarizes it for SAMPLE)
    group_items: int = 0
    group_counter: str = ""
    tail_reads: frozenset[str] = frozenset()
    tail_writes: frozenset[str] = frozenset()
    # A cross-rank op's half (expand_gpu_program on a tensor-parallel rank): its channel, and
    # whether it is the push (its items store into every rank's inbox; its group is the whole op,
    # whose last item raises the channel's flag on every rank) or the finish (waits for every
    # rank's flag of the step, then reads its own inbox). -1: not cross-rank.
    comm: int = -1
    comm_push: bool = False
    # An op of an MoE layer after its router: that layer (else -1). A workgroup that waited for
    # it knows the layer's route this step (persistent_kernel.cuh: route_layer).
    route_layer: int = -1
    # What staging one of its items ahead reads, before the item runs (the experts' GEMVs: the
    # route's groups, to find the expert's matrix); only a workgroup that knows the route of
    # route_layer this step stages them (persistent_kernel.cuh: next_linear_item).
    stage_reads: frozenset[str] = frozenset()

    @property
    def waits_for_ranks(self) -> bool:
        """The finish of a cross-rank op: its first item waits for every rank's flag of the step."""
        return self.comm >= 0 and not self.comm_push


def buffer(b: int) -> str:
    return f"buf.{Buffer(b).name}"


def kv_cache(layer: int) -> str:
    return f"kv.{layer}"


def inbox(channel: int) -> str:
    """A channel's inbox on this rank (kog.testing.sync_ranks checks its cross-rank uses)."""
    return f"inbox.{channel}"


def lane_hist(slot: int) -> str:
    """One LANE_HIST slot: a resource of its own (a delayed reduction reads one slot, while other
    layers write the others)."""
    return f"lane_hist.{slot}"


LANE_OPS = (Opcode.LANE_SCALE, Opcode.LANE_SUM, Opcode.LANE_GATHER, Opcode.LANE_ADD_PAST, Opcode.LANE_MEAN,
            Opcode.LANE_MERGE_SUM)


ROW_CHUNK, ROPE_HEADS = 512, 4  # kRowChunk, kRopeHeads (csrc/gpu/decode/tuning.cuh)


def items_of(op: _C.Op, dims: _C.ModelDims, batch: int, max_parts: int, rows_per_item: int, warps: int = 8) -> int:
    """Mirrors items_of and parts_per_row in persistent_kernel.cuh (rows_per_item:
    linear_rows_per_item(); warps: workgroup threads / warp size)."""
    def ceil(a, b):
        return -(-a // b)

    code = op.opcode
    if code in (Opcode.ALL_GATHER, Opcode.ALL_REDUCE) and op.comm >= 0:  # the logits' push and finish
        if not op.comm_push:  # one item per sample chunk, every row
            return ceil(dims.vocab, _C.SAMPLE_CHUNK)
        width = dims.vocab // dims.lane_ranks if code == Opcode.ALL_GATHER else dims.vocab
        return batch * ceil(width, ROW_CHUNK)
    if code in (Opcode.LINEAR, LINEAR_SAMPLE_PARTIAL):  # a rank's vocabulary-sliced head: its slice's rows
        return ceil(dims.vocab // dims.lane_ranks if op.vocab_slice else dims.buffer_width(op.out), rows_per_item)
    if code in (ROUTER_GEMV, MOE_GATE_UP, MOE_DOWN):  # schedule/moe_route.h, gpu/decode/moe_items.cuh
        slots = dims.top_k + dims.shared_slots
        groups = min(batch * slots, dims.n_experts + dims.shared_slots)
        if code == ROUTER_GEMV:
            return ceil(dims.n_experts + (1 if dims.shared_slots else 0), rows_per_item)
        if code == MOE_GATE_UP:  # one gate/up pair of rows per warp
            return groups * ceil(dims.expert_intermediate, rows_per_item // 2)
        return groups * ceil(dims.hidden, rows_per_item)
    if code == LINEAR_SILU_MUL:  # one output row (a gate row and its up row) per warp
        return ceil(dims.intermediate, rows_per_item // 2)
    if code == LINEAR_ROPE_KV:  # one RoPE pair of rows per warp
        return ceil(dims.buffer_width(op.out) // 2, rows_per_item // 2)
    if code == Opcode.ATTN_DECODE:  # (sequence, KV head, partition): the head's GQA group
        return batch * dims.n_kv_heads * max_parts
    if code == Opcode.RMS_NORM:  # a lane-wide row: each lane normalized on its own
        width = dims.buffer_width(op.out)
        rows = dims.n_lanes if dims.n_lanes > 1 and width == dims.n_lanes * dims.hidden else 1
        parts = rows * (1 if op.residual >= 0 else ceil(width // rows, ROW_CHUNK))
    elif code in (MOE_COMBINE, *LANE_OPS):  # chunks of hidden (a lane op: over every lane)
        parts = ceil(dims.hidden, ROW_CHUNK)
    elif code == Opcode.EMBED:  # chunks of its output (a lane-wide one: the row in every lane)
        parts = ceil(dims.buffer_width(op.out), ROW_CHUNK)
    else:
        parts = {Opcode.QK_NORM: ceil(dims.n_q_heads + dims.n_kv_heads, warps),
                 Opcode.ROPE: ceil(dims.n_q_heads + dims.n_kv_heads, ROPE_HEADS),
                 Opcode.KV_APPEND: dims.n_kv_heads,
                 Opcode.SILU_MUL: ceil(dims.intermediate, ROW_CHUNK)}.get(Opcode(code), 1)
    return batch * parts


def accesses(op: _C.Op) -> tuple[set[str], set[str]]:
    """(reads, writes) of one item of op, as run_item performs them. Read-only inputs (weights,
    block tables, sampling rows, stop ids) are left out: nothing writes them during a launch."""
    code, i, o = op.opcode, buffer(op.in_) if op.in_ >= 0 else None, buffer(op.out) if op.out >= 0 else None
    if op.comm >= 0 and op.comm_push:  # this rank's part of what it reads, into every rank's inbox
        return {i} | ({buffer(op.residual)} if op.residual >= 0 else set()), {inbox(op.comm)}
    if op.comm >= 0:  # the finish: every rank's parts from the inbox
        if code in (Opcode.ALL_GATHER, Opcode.ALL_REDUCE):  # LOGITS, and the chunk summaries for SAMPLE
            return {inbox(op.comm)}, {o, LOGITS_OUT, SAMPLE_SUMMARIES}
        if code == Opcode.LANE_ADD_PAST:
            return {i, inbox(op.comm)}, {i}
        return {inbox(op.comm)}, {o}  # LANE_SUM (o = in: every lane = the sum), LANE_MEAN, LANE_MERGE_SUM
    if code == Opcode.LINEAR and op.residual >= 0:  # a fused residual add: out (the residual) += x . w
        return {i, o}, {o}
    if code == LINEAR_ROPE_KV:  # QKV (q, k rotated) and the layer's cache at the row's slot
        return {i, POSITIONS, SLOTS}, {o, kv_cache(op.layer)}
    if code == ROUTER_GEMV:  # the items write the logits; the tail (sync_ops) routes and gathers
        return {i}, {MOE_LOGITS}
    if code == MOE_GATE_UP:
        return {MOE_X, MOE_GROUPS}, {MOE_ACT}
    if code == MOE_DOWN:
        return {MOE_ACT, MOE_GROUPS}, {MOE_Y}
    if code == MOE_COMBINE:
        return {MOE_Y, MOE_GROUPS}, {o}
    if code in (Opcode.EMBED, Opcode.LINEAR, Opcode.SILU_MUL, LINEAR_SILU_MUL, LINEAR_SAMPLE_PARTIAL):
        return {i}, {o}
    if code == Opcode.RMS_NORM:  # with a residual: residual += in, out = norm(residual)
        res = {buffer(op.residual)} if op.residual >= 0 else set()
        return {i} | res, {o} | res
    if code == Opcode.QK_NORM:
        return {i}, {i}
    if code == Opcode.ROPE:
        return {i, POSITIONS}, {i}
    if code == Opcode.KV_APPEND:
        return {i, SLOTS}, {kv_cache(op.layer)}
    if code == Opcode.ATTN_DECODE:  # the partial phase: q from `in`, keys and values of its layer
        return {i, kv_cache(op.layer), SEQ_LENS}, {PARTIALS}
    if code == Opcode.LANE_GATHER:  # the lanes into one LANE_HIST slot
        return {i}, {lane_hist(op.slot)}
    if code == Opcode.LANE_ADD_PAST:  # in place, plus the kept lanes of one slot
        return {i, lane_hist(op.slot)}, {i}
    if code == Opcode.LANE_MERGE_SUM:
        return {i, buffer(op.residual)}, {o}
    if code in LANE_OPS:  # SCALE, SUM (in place), MEAN
        return {i}, {o}
    if code == Opcode.SAMPLE:
        # NOTE: the position/seq_len/slot advance happens only when another step follows; the
        # model counts it as written every step, which only adds hazards to look for.
        return {LOGITS_OUT, SAMPLE_SUMMARIES, FINISHED, POSITIONS}, {o, FINISHED, POSITIONS, SEQ_LENS, SLOTS, OUT_TOKENS}
    raise ValueError(f"sync model: no access rule for opcode {code}")


def op_name(op: _C.Op) -> str:
    code = GPU_OP_NAMES.get(op.opcode) or Opcode(op.opcode).name
    if op.comm >= 0:
        code += f" {'PUSH' if op.comm_push else 'FINISH'} c{op.comm}"
    layer = f" L{op.layer}" if op.layer >= 0 else ""
    src = Buffer(op.in_).name if op.in_ >= 0 else "-"
    dst = Buffer(op.out).name if op.out >= 0 else ("-" if op.opcode in GPU_OP_NAMES else f"kv.{op.layer}")
    return f"{code}{layer} {src}->{dst}"


def sync_ops(expanded: Sequence[_C.Op], dims: _C.ModelDims, batch: int, max_parts: int = 1,
             rows_per_item: int = 16) -> list[SyncOp]:
    """The model's view of an expanded GPU program (kog._C.expand_gpu_program).

    Args:
        expanded: the program as the kernel runs it.
        dims: the model's shape (buffer widths size the LINEAR items).
        batch: sequences in the launch.
        max_parts: attention context partitions of the longest sequence.
        rows_per_item: output rows per LINEAR item (16 on CUDA: 8 warps x 2 rows; 8 on CDNA).
    Returns:
        One SyncOp per op, same indices and deps.
    """
    out = []
    for op in expanded:
        reads, writes = accesses(op)
        tail = {}
        if op.opcode == Opcode.ATTN_DECODE:  # the group's last item merges the parts into ATTN
            tail = dict(group_items=max_parts, group_counter=GROUP_COUNTS,
                        tail_reads=frozenset({PARTIALS, SEQ_LENS}), tail_writes=frozenset({buffer(op.out)}))
        if op.opcode == LINEAR_SAMPLE_PARTIAL:  # a chunk's last item summarizes its logits for SAMPLE
            tail = dict(group_items=_C.SAMPLE_CHUNK // rows_per_item, group_counter=CHUNK_COUNTS,
                        tail_reads=frozenset({buffer(op.out)}), tail_writes=frozenset({LOGITS_OUT, SAMPLE_SUMMARIES}))
        if op.opcode == ROUTER_GEMV:  # the last router item routes every row, groups the pairs, gathers x
            n = items_of(op, dims, batch, max_parts, rows_per_item)
            tail = dict(group_items=n, group_counter=ROUTE_COUNT, tail_reads=frozenset({MOE_LOGITS, buffer(op.in_)}),
                        tail_writes=frozenset({buffer(op.out), MOE_GROUPS, MOE_X}))
        n = items_of(op, dims, batch, max_parts, rows_per_item)
        if op.opcode in (MOE_GATE_UP, MOE_DOWN, MOE_COMBINE):
            tail |= dict(route_layer=op.layer)
            if op.opcode != MOE_COMBINE:
                tail |= dict(stage_reads=frozenset({MOE_GROUPS}))
        if op.comm >= 0:
            tail = dict(comm=op.comm, comm_push=bool(op.comm_push))
            if op.comm_push:  # the op's last item raises the flags
                tail |= dict(group_items=n, group_counter=f"comm_count.{op.comm}")
        out.append(SyncOp(op_name(op), n, tuple(op.deps), frozenset(reads), frozenset(writes), **tail))
    return out


def without_dep(ops: Sequence[SyncOp], j: int, dep: int) -> list[SyncOp]:
    """ops with op j's dependency on op dep removed (for tests that break the protocol)."""
    if dep not in ops[j].deps:
        raise ValueError(f"op {j} ({ops[j].name}) does not depend on op {dep}")
    return [replace(o, deps=tuple(d for d in o.deps if d != dep)) if k == j else o for k, o in enumerate(ops)]


def with_dep(ops: Sequence[SyncOp], j: int, dep: int) -> list[SyncOp]:
    """ops with op j also waiting for op dep (any index: a later one breaks the protocol)."""
    return [replace(o, deps=o.deps + (dep,)) if k == j else o for k, o in enumerate(ops)]
