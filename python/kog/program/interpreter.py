"""A plain Python interpreter of the model program: the prefill path and the reference every
native executor is compared with, op by op.

    interp = ProgramInterpreter(config, program_for(config), weights, kv, inv_freq)
    state = interp.run(batch)                  # a TokenBatch of any size
    logits = state.buffers[Buffer.LOGITS]      # [R, vocab] in the run dtype, R = sampled rows

Each op runs over the whole token batch with torch (projections) and kog.ops kernels (norms,
RoPE, KV append, paged attention, SiLU-mul), on whatever device the tensors live on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import math

import torch
import torch.nn.functional as F

from kog import _C, ops
from kog.config import ModelConfig
from kog.errors import InvalidRequest
if TYPE_CHECKING:  # (an import at run time closes a cycle: kog.parallel -> kog.models -> this module)
    from kog.parallel.transport import Transport
from kog.program.batch import TokenBatch
from kog.program.families import ROPE_NEOX
from kog.program.opcodes import Buffer, Opcode
from kog.program.program import Instruction, Rows, slot_of
from kog.fp8 import Fp8Weight
from kog.int4 import Int4Weight
from kog.quantized import QuantizedWeight

# The GPU decode kernel's weight formats (kog.int4, kog.fp8): LINEAR matrices only.
GPU_FORMATS = (Int4Weight, Fp8Weight)


@dataclass
class ProgramState:
    """Buffers of one run: each [rows, width] (TOKENS: [rows] int64), rows as `rows_of` says."""

    batch: TokenBatch
    buffers: dict[Buffer, torch.Tensor]
    rows_of: dict[Buffer, Rows]
    validated: set[Opcode] = field(default_factory=set)  # ops whose index inputs were checked this run
    qkv_views: tuple[torch.Tensor, ...] = ()  # (QKV, q, k, v): the views of the QKV tensor last split

    def read(self, buf: Buffer, rows: Rows) -> torch.Tensor:
        """buf as an op over `rows` sees it: an op over the sampled rows reads only those rows
        of a buffer that holds every token."""
        t, have = self.buffers[buf], self.rows_of[buf]
        if have == rows:
            return t
        if have != Rows.ALL or rows != Rows.SAMPLED:
            raise ValueError(f"an op over {rows.value} rows reads {buf.name}, which holds {have.value} rows")
        sampled = self.batch.sampled_rows
        return t if sampled is None else t.index_select(0, sampled)

    def write(self, buf: Buffer, t: torch.Tensor, rows: Rows) -> None:
        self.buffers[buf] = t
        self.rows_of[buf] = rows

    def first_run_of(self, opcode: Opcode) -> bool:
        """True the first time an op of this kind runs in this state: the batch's slots, block
        ids and lengths are the same for every layer, so checking them once is enough."""
        first = opcode not in self.validated
        self.validated.add(opcode)
        return first


class ProgramInterpreter:
    """Runs a program over token batches.

    Args:
        config: the model (head counts and sizes split the QKV buffer; eps of the norms).
        program: the family's program (kog.program.program_for).
        weights: prepared weights (kog.models.weights.prepare_weights) on the run device
            (QuantizedWeight matrices: CPU only, f32 activations).
        kv: [num_layers, num_blocks, 2, n_kv_heads, block_size, head_dim], the paged cache.
        inv_freq: [rotary_dim / 2] float32 RoPE frequencies, on the run device.
    """

    def __init__(self, config: ModelConfig, program: Sequence[Instruction], weights: dict[str, torch.Tensor],
                 kv: torch.Tensor, inv_freq: torch.Tensor, transport: Transport | None = None) -> None:
        self.config, self.program, self.kv, self.inv_freq = config, list(program), kv, inv_freq
        self.rope_neox = ROPE_NEOX[config.architecture]
        self.n_lanes = config.lanes.num_lanes if config.lanes else 1  # this rank's lanes
        # A tensor-parallel rank (config.shard.size > 1) reduces lanes over every rank's through
        # the transport; its lanes are lanes rank n_lanes .. of all_lanes.
        if config.shard.size > 1 and (transport is None or transport.size != config.shard.size
                                      or transport.rank != config.shard.rank):
            raise InvalidRequest(f"rank {config.shard.rank} of {config.shard.size} needs that rank's transport")
        self.transport = transport if config.shard.size > 1 else None
        self.all_lanes = self.n_lanes * config.shard.size
        hd = config.head_dim
        self._q_w, self._kv_w = config.num_attention_heads * hd, config.num_key_value_heads * hd
        self._ops = [(ins, _HANDLERS[ins.opcode], tuple(weights[n] for n in ins.weights)) for ins in self.program]

    def start(self, batch: TokenBatch, buffers: dict[Buffer, torch.Tensor] | None = None) -> ProgramState:
        """The state before an op: TOKENS holds the batch's ids, and `buffers` (optional, over
        every token: [T, width]) other values, e.g. another executor's, to run one op from."""
        bufs = {Buffer.TOKENS: batch.ids} | dict(buffers or {})
        return ProgramState(batch, bufs, {b: Rows.ALL for b in bufs})

    def step(self, state: ProgramState, index: int) -> None:
        """Runs op `index` of the program on state."""
        ins, handler, weights = self._ops[index]
        handler(self, state, ins, weights)

    def run(self, batch: TokenBatch, stop_after: int | None = None) -> ProgramState:
        """Runs ops [0, stop_after) (all when None) over batch, in program order."""
        state = self.start(batch)
        for i in range(len(self._ops) if stop_after is None else stop_after):
            self.step(state, i)
        return state

    def q_k_v(self, state: ProgramState) -> tuple[torch.Tensor, ...]:
        """Views [T, heads, head_dim] of the q, k and v parts of QKV (made once per QKV tensor:
        four ops of a layer use them, and views cost microseconds each)."""
        qkv = state.buffers[Buffer.QKV]  # [T, (n_q + 2 n_kv) head_dim]
        if not state.qkv_views or state.qkv_views[0] is not qkv:
            T, hd, q_w, kv_w = qkv.shape[0], self.config.head_dim, self._q_w, self._kv_w
            state.qkv_views = (qkv, qkv[:, :q_w].view(T, -1, hd), qkv[:, q_w:q_w + kv_w].view(T, -1, hd),
                               qkv[:, q_w + kv_w:].view(T, -1, hd))
        return state.qkv_views[1:]


def _embed(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    ids = s.read(ins.reads[0], ins.rows)  # [T] int64
    if isinstance(w[0], QuantizedWeight):  # one row of blocks per token, f32 (the run dtype of quantized models)
        s.write(ins.writes[0], w[0].dequantize(ids.cpu()).to(ids.device), ins.rows)
        return
    rows = w[0][ids]
    # Laneformer: every lane of the residual stream starts from the embedding.
    s.write(ins.writes[0], rows.repeat(1, it.n_lanes) if it.n_lanes > 1 else rows, ins.rows)


def _rms_norm(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    # reads (x,) or (x, residual): with a residual, residual += x in place and the sum is normalized.
    x = s.read(ins.reads[0], ins.rows).contiguous()
    res = s.read(ins.reads[1], ins.rows).contiguous() if len(ins.reads) == 2 else None
    eps, L, h = it.config.rms_norm_eps, it.n_lanes, it.config.hidden_size
    if L > 1 and x.shape[1] == L * h:  # each lane on its own: rows of hidden
        if w[0].numel() == h:  # one weight for every lane
            out = ops.rmsnorm(x.view(-1, h), w[0], eps, residual=None if res is None else res.view(-1, h))
            out = out.view(x.shape)
        else:  # [lanes, hidden]: lane l with weight row l
            out = torch.empty_like(x)
            for lane in range(L):
                cols = slice(lane * h, (lane + 1) * h)
                r = None if res is None else res[:, cols].contiguous()
                out[:, cols] = ops.rmsnorm(x[:, cols].contiguous(), w[0].view(L, h)[lane], eps, residual=r)
                if res is not None:
                    res[:, cols] = r
    else:
        out = ops.rmsnorm(x, w[0], eps, residual=res)
    s.write(ins.writes[0], out, ins.rows)
    if res is not None:
        s.write(ins.writes[1], res, ins.rows)


def _linear(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    x = s.read(ins.reads[0], ins.rows)
    if ins.lanes > 1:
        s.write(ins.writes[0], lane_matmul(x, w[0], w[1] if len(w) > 1 else None, ins.lanes,
                                           lane_segments(it.config, ins.writes[0], w[0].shape[0])), ins.rows)
        return
    mm = quant_matmul if isinstance(w[0], QuantizedWeight) else dequant_matmul if isinstance(w[0], GPU_FORMATS) else matmul
    s.write(ins.writes[0], mm(x, w[0], w[1] if len(w) > 1 else None), ins.rows)


def _qk_norm(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    q, k, _ = it.q_k_v(s)
    eps = it.config.rms_norm_eps
    q.copy_(ops.rmsnorm(q.contiguous(), w[0], eps))
    k.copy_(ops.rmsnorm(k.contiguous(), w[1], eps))


def _rope(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    q, k, _ = it.q_k_v(s)
    ops.rope(q, k, s.batch.positions, it.inv_freq, is_neox=it.rope_neox)


def _kv_append(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    _, k, v = it.q_k_v(s)
    ops.kv_append(k, v, it.kv[ins.layer], s.batch.slots, validate_indices=s.first_run_of(ins.opcode))


def _attention(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    # Causal attention of every token over its sequence's cache: decode is q_len = 1 per sequence.
    q, _, _ = it.q_k_v(s)
    b = s.batch
    out = ops.paged_attention_prefill(q, it.kv[ins.layer], b.block_tables, b.seq_lens, b.query_start_loc,
                                      validate_indices=s.first_run_of(ins.opcode), window=ins.window)  # [T, n_q, hd]
    s.write(ins.writes[0], out.view(q.shape[0], -1), ins.rows)


def _silu_mul(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    s.write(ins.writes[0], ops.silu_and_mul(s.read(ins.reads[0], ins.rows)), ins.rows)


def _sample(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    # Greedy: the first maximum, as the native executors pick it.
    s.write(ins.writes[0], s.read(ins.reads[0], ins.rows).argmax(-1), ins.rows)


def _router(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    # transformers' router: softmax over every expert in f32, torch.topk (its tie order), then
    # renormalized over the chosen ones with norm_topk_prob. Weights stay f32 (the executor's).
    # qwen2_moe: the shared expert's slots E.. follow, weighted by sigmoid(x @ router row E).
    c = it.config
    E, S = c.num_experts, c.shared_expert_slots
    logits = matmul(s.read(ins.reads[0], ins.rows), w[0])  # [T, E (+1)] in the run dtype, as the executor rounds them
    probs = torch.softmax(logits[:, :E].float(), dim=-1)
    top, ids = torch.topk(probs, c.num_experts_per_tok, dim=-1)  # [T, k]
    if c.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    if S:
        T = logits.shape[0]
        gate = torch.sigmoid(logits[:, E:].float())  # [T, 1]
        ids = torch.cat([ids, torch.arange(E, E + S, device=ids.device).expand(T, S)], dim=1)
        top = torch.cat([top, gate.expand(T, S)], dim=1)
    # ROUTE: [T, 2k] int32 words, the executor's layout: k expert ids, then the f32 bits of their weights.
    s.write(ins.writes[0], torch.cat([ids.to(torch.int32), top.contiguous().view(torch.int32)], dim=1), ins.rows)


def _moe_experts(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    # Tokens grouped by expert: one GEMM pair per chosen expert over the rows that chose it, the
    # weighted results added back in f32 in ascending expert order (the executor's order).
    x = s.read(ins.reads[0], ins.rows)  # [T, hidden]
    route = s.read(ins.reads[1], ins.rows)  # [T, 2k] int32
    k = route.shape[1] // 2  # slots per row: routed + shared
    ids = route[:, :k].reshape(-1).long()  # [T k] expert of each (row, slot)
    weights = route[:, k:].contiguous().view(torch.float32).reshape(-1)  # [T k]
    order = torch.argsort(ids, stable=True)  # (row, slot) pairs by expert, rows ascending in each
    n_stack = it.config.num_experts + it.config.shared_expert_slots
    counts = torch.bincount(ids, minlength=n_stack).tolist()
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    # Expert parallelism: this rank's experts only, its stacks holding just them in ascending order.
    placement = w[2].tolist() if len(w) > 2 else None
    n_local = n_stack if placement is None else placement.count(it.config.shard.rank)
    local = -1  # e's place in this rank's stacks
    for e, m in enumerate(counts):
        if placement is not None and placement[e] != it.config.shard.rank:
            start += m
            continue
        local += 1
        if m == 0:
            continue
        pairs = order[start:start + m]
        rows = pairs // k
        y = _expert_mm(ops.silu_and_mul(_expert_mm(x[rows], w[0], local, n_local)), w[1], local, n_local)
        acc.index_add_(0, rows, y.float() * weights[pairs, None])  # y [m, hidden]
        start += m
    s.write(ins.writes[0], acc.to(x.dtype), ins.rows)


def _lane_scale(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    s.write(ins.writes[0], s.read(ins.reads[0], ins.rows) * math.sqrt(it.all_lanes), ins.rows)


def _over_lanes(it: ProgramInterpreter, x: torch.Tensor) -> torch.Tensor:
    """[T, lanes, hidden] -> [T, hidden]: the sum over every lane (every rank's, in lane order)."""
    if it.transport is None:
        return x.sum(1)
    return it.transport.all_reduce(x.float().sum(1)).to(x.dtype)


def _lane_sum(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    a = s.read(ins.reads[0], ins.rows)
    T = a.shape[0]
    total = _over_lanes(it, a.view(T, it.n_lanes, -1))[:, None]
    s.write(ins.writes[0], total.expand(-1, it.n_lanes, -1).reshape(T, -1), ins.rows)


def _lane_hist(it: ProgramInterpreter, s: ProgramState, like: torch.Tensor) -> torch.Tensor:
    """LANE_HIST [T, slots * lanes * hidden], made (zeros) on first use."""
    if Buffer.LANE_HIST not in s.buffers:
        lanes = it.config.lanes
        slots = 2 * lanes.hist_slots_per_kind if lanes else 0
        width = it.all_lanes * it.config.hidden_size  # every rank's lanes
        s.write(Buffer.LANE_HIST, like.new_zeros(like.shape[0], slots * width), Rows.ALL)
    return s.buffers[Buffer.LANE_HIST]


def _lane_gather(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    a = s.read(ins.reads[0], ins.rows)
    if it.transport is not None:  # every rank's lanes, in lane order
        a = it.transport.all_gather(a)
    slot, width = slot_of(ins.writes[0]), a.shape[1]
    _lane_hist(it, s, a)[:, slot * width:(slot + 1) * width] = a


def _lane_add_past(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    # The reference's rounding steps: round(sum of the past), round(that - past_l), round(a_l + that).
    a = s.read(ins.reads[0], ins.rows)
    T, width, slot = a.shape[0], it.all_lanes * it.config.hidden_size, slot_of(ins.reads[1])
    past = _lane_hist(it, s, a)[:, slot * width:(slot + 1) * width].view(T, it.all_lanes, -1)
    first = it.config.shard.rank * it.n_lanes  # this rank's lanes among all
    others = past.sum(1, keepdim=True) - past[:, first:first + it.n_lanes]
    s.write(ins.writes[0], a + others.reshape(T, -1), ins.rows)


def _lane_mean(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    x = s.read(ins.reads[0], ins.rows)
    if it.transport is None:
        s.write(ins.writes[0], x.view(x.shape[0], it.n_lanes, -1).mean(1), ins.rows)
        return
    total = _over_lanes(it, x.float().view(x.shape[0], it.n_lanes, -1))
    s.write(ins.writes[0], (total / it.all_lanes).to(x.dtype), ins.rows)


def _lane_merge_sum(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    x, res = (s.read(b, ins.rows) for b in ins.reads)
    s.write(ins.writes[0], _over_lanes(it, (res + x).view(x.shape[0], it.n_lanes, -1)), ins.rows)


def _all_reduce(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    x = s.read(ins.reads[0], ins.rows)
    s.write(ins.writes[0], it.transport.all_reduce(x.float()).to(x.dtype), ins.rows)


def _all_gather(it: ProgramInterpreter, s: ProgramState, ins: Instruction, w: tuple) -> None:
    s.write(ins.writes[0], it.transport.all_gather(s.read(ins.reads[0], ins.rows)), ins.rows)


def _expert_mm(x: torch.Tensor, stack: torch.Tensor | QuantizedWeight, e: int, n_stack: int) -> torch.Tensor:
    """x @ expert e's matrix^T: a float stack [n_stack, n, k], or a quantized one of n_stack n
    block rows (a GGUF's experts kept in blocks; run as a quantized LINEAR of the same rows)."""
    if isinstance(stack, QuantizedWeight):
        n = stack.shape[0] // n_stack
        return quant_matmul(x, stack.with_data(stack.data[e * n:(e + 1) * n]))
    return matmul(x, stack[e])


_HANDLERS: dict[Opcode, Callable[[ProgramInterpreter, ProgramState, Instruction, tuple], None]] = {
    Opcode.EMBED: _embed, Opcode.RMS_NORM: _rms_norm, Opcode.LINEAR: _linear, Opcode.QK_NORM: _qk_norm,
    Opcode.ROPE: _rope, Opcode.KV_APPEND: _kv_append, Opcode.ATTN_DECODE: _attention,
    Opcode.SILU_MUL: _silu_mul, Opcode.SAMPLE: _sample, Opcode.ROUTER: _router, Opcode.MOE_EXPERTS: _moe_experts,
    Opcode.LANE_SCALE: _lane_scale, Opcode.LANE_SUM: _lane_sum, Opcode.LANE_GATHER: _lane_gather,
    Opcode.LANE_ADD_PAST: _lane_add_past, Opcode.LANE_MEAN: _lane_mean, Opcode.LANE_MERGE_SUM: _lane_merge_sum,
    Opcode.ALL_REDUCE: _all_reduce, Opcode.ALL_GATHER: _all_gather,
}


def lane_segments(config: ModelConfig, out: Buffer, width: int) -> list[int]:
    """The output segments a lane LINEAR cuts into lanes (csrc/schedule/program.h lane_segments)."""
    hd = config.head_dim
    if out == Buffer.QKV:
        return [config.num_attention_heads * hd] + [config.num_key_value_heads * hd] * 2
    if out == Buffer.GATE_UP:
        return [config.intermediate_size] * 2
    return [width]


def lane_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, lanes: int,
                segments: list[int]) -> torch.Tensor:
    """A lane projection: x [T, lanes k], w [n, k] rows lane-major within each segment ->
    [T, n]; segment rows l n_s/lanes .. read x columns l k .. (l + 1) k. fp32 math, one rounding."""
    T = x.shape[0]
    xl = x.float().view(T, lanes, -1).transpose(0, 1)  # [lanes, T, k]
    outs, row = [], 0
    for n_s in segments:
        ws = w[row:row + n_s].float().view(lanes, n_s // lanes, -1)  # [lanes, n_s / lanes, k]
        outs.append(torch.bmm(xl, ws.transpose(1, 2)).transpose(0, 1).reshape(T, n_s))
        row += n_s
    out = torch.cat(outs, dim=1)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


# A quantized LINEAR by rows of x: one row runs the decode's int8 kernel (x in two int8 stages,
# what a decode step computes); from QUANT_F32_X_MIN_ROWS rows the kernel keeps x in f32 and
# dequantizes weight tiles in cache (x_stages 0); from QUANT_GEMM_MIN_ROWS, f32 weight tiles
# and torch's GEMM (measured on SmolLM2's matrices, 2-core AVX-512 VM: in-cache tiles 1.2-1.4x
# faster at 512-1024 rows, 0.9-1.1x at 2048; docs/PERFORMANCE.md).
QUANT_F32_X_MIN_ROWS = 2
QUANT_GEMM_MIN_ROWS = 1536
_QUANT_TILE_BYTES = 8 << 20  # f32 bytes of one dequantized weight tile: bounded, never the whole model
# x stages of the int8 kernel: as the decode executor (csrc/engine/decode_executor.h kQuantXStages).
QUANT_X_STAGES = 2


def quant_matmul(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) over a matrix kept in GGUF blocks: [T, k] f32 -> [T, n] f32.

    NOTE: one row runs the decode's kernel (x and its residual quantized per 32 to int8,
    kog.ops.linear_quant with x_stages 2), so a one-token prefill computes what decode computes.
    A few rows (a short prompt) run the same kernel with x in f32 (x_stages 0: each thread
    dequantizes 16 weight rows into its cache and multiplies them with every row of x): exact
    products, no f32 matrix in memory, no hand-over to torch's threads (which costs more than
    the product at this size). Many rows dequantize the weight a tile of rows at a time to f32
    (at most _QUANT_TILE_BYTES live) for torch's GEMM.
    """
    x = x.contiguous()
    rows = x.shape[0]
    if rows < QUANT_GEMM_MIN_ROWS:
        stages = QUANT_X_STAGES if rows < QUANT_F32_X_MIN_ROWS else 0
        out = ops.linear_quant(x, w.data, w.qtype, x_stages=stages)
    else:
        n, k = w.shape
        out = torch.empty(rows, n, dtype=torch.float32)
        step = max(1, _QUANT_TILE_BYTES // (4 * k))
        for r in range(0, n, step):
            torch.matmul(x, w.dequantize(slice(r, r + step)).T, out=out[:, r:r + step])
    return out if bias is None else out.add_(bias)


_DEQUANT_TILE_BYTES = 256 << 20  # f32 bytes of one dequantized tile of a GPU-format matrix


def dequant_matmul(x: torch.Tensor, w: Int4Weight | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) over a matrix in a GPU decode-kernel format, on its device: rows
    dequantized a tile at a time (f32, rounded to x's dtype), then `matmul`. The values are those
    of the same matrix dequantized to x's dtype at load, so prefill computes what that model
    does (bit for bit where the GEMM does not depend on the tile's rows); at most
    _DEQUANT_TILE_BYTES of f32 are live, never the whole model.

    NOTE: a GPU GEMM over dequantized tiles, not a fused 4-bit / FP8 GEMM: prefill is bound by
    its arithmetic, which the dequantization (one pass over the matrix per call) does not add to
    much from a few dozen tokens on; decode, bound by the bytes, reads the formats natively.
    """
    n, k = w.shape
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    step = max(1, _DEQUANT_TILE_BYTES // (4 * k))
    for r in range(0, n, step):
        e = min(n, r + step)
        out[:, r:e] = matmul(x, w.dequantize_rows(r, e).to(x.dtype), None if bias is None else bias[r:e])
    return out


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias): fp32 math, one rounding to x's dtype (the kernels' contract).

    NOTE: half-precision GEMMs of many rows run in fp32 on upcast copies: on CPUs without
    native bf16 matrix instructions torch's bf16 GEMM is several times slower than converting the
    weight and running the fp32 one (measured 4x on AVX2). Where the CPU has them
    (NATIVE_BF16_GEMM: AMX-BF16 tiles or AVX-512 BF16) torch's bf16 GEMM (oneDNN: bf16
    products, fp32 sums, one rounding) is faster than the upcast one: 7-8x with AMX on a Xeon
    VM, 4-6x with AVX-512 BF16 on a Zen5 VM (docs/PERFORMANCE.md).
    """
    if x.dtype == torch.float32 or x.shape[0] < 16 or x.device.type != "cpu":
        return F.linear(x, w, bias)
    if x.dtype == torch.bfloat16 and NATIVE_BF16_GEMM:
        return F.linear(x, w, bias)
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)


# Whether this CPU multiplies bf16 matrices natively (AMX-BF16 or AVX-512 BF16): matmul then
# keeps bf16 GEMMs in bf16.
NATIVE_BF16_GEMM: bool = _C.cpu_bf16_gemm() != ""
