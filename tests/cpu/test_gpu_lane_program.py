"""Laneformer lanes in the GPU persistent kernel's program, on the CPU (every build): what
kog._C.expand_gpu_program makes of a lane program (lane LINEARs and lane-wide norms kept as they
are, the LANE_* ops passed through with their deps), its refusals (lanes over tensor-parallel
ranks, FP8 / 4-bit weights), kernel_runs, and the items the synchronization model gives the
lane ops (kog.testing.sync_program mirrors persistent_kernel.cuh)."""

import sys
from pathlib import Path

import pytest
import torch

import kog
from kog import _C
from kog.fp8 import Fp8Weight
from kog.models.decode import lower_program, model_dims, schedule_for
from kog.models.gpu_decode import kernel_runs
from kog.models.weights import prepare_weights
from kog.program import Buffer, Opcode
from kog.testing.programs import lowered_program, with_op
from kog.testing.sync_model import Launch, Protocol, run_launches
from kog.testing.sync_program import LANE_OPS, lane_hist, sync_ops
from kog.testing.tiny_models import random_weights

sys.path.insert(0, str(Path(__file__).parent))
from test_laneformer import VARIANTS, lane_model_config  # noqa: E402

LANE_VARIANTS = sorted(v for v in VARIANTS if VARIANTS[v]["num_lanes"] > 1)


def lowered(variant: str):
    c = lane_model_config(**VARIANTS[variant])
    ops, dims, _ = lowered_program(c, seed=4)  # nothing here reads the weights
    return ops, dims, c


@pytest.mark.parametrize("variant", LANE_VARIANTS)
def test_lane_ops_pass_through_the_expansion_with_their_deps(variant):
    ops, dims, c = lowered(variant)
    gpu = list(_C.expand_gpu_program(ops, dims))
    # every lane op, in program order, with its operands
    lane_src = [o for o in ops if o.opcode in LANE_OPS]
    lane_gpu = [o for o in gpu if o.opcode in LANE_OPS]
    key = lambda o: (o.opcode, o.layer, o.in_, o.out, o.residual, o.slot)  # noqa: E731
    assert [key(o) for o in lane_gpu] == [key(o) for o in lane_src] and lane_src
    # lane LINEARs keep their lanes and fold no norm into their prologue (each row reads its
    # lane's slice of x; a prologue would normalize the whole row)
    lane_linears = [o for o in gpu if o.lanes > 1]
    assert len(lane_linears) == sum(o.lanes > 1 for o in ops) >= 4 * c.num_hidden_layers
    assert all(o.w2 == 0 for o in lane_linears)
    # the lane-wide norms stay ops of their own (the per-lane normalization is theirs)
    lane_wide = dims.buffer_width(Buffer.HIDDEN)
    assert lane_wide == c.lanes.num_lanes * dims.hidden

    def lane_norms(program):
        return sum(o.opcode == Opcode.RMS_NORM and dims.buffer_width(o.out) == lane_wide for o in program)

    assert lane_norms(gpu) == lane_norms(ops) >= 2 * c.num_hidden_layers
    # the fusions that keep rows in one lane still happen: gate/up with SiLU, QKV with RoPE and the cache
    assert sum(o.opcode == _C.GPU_OP_LINEAR_SILU_MUL for o in gpu) == c.num_hidden_layers
    assert sum(o.opcode == _C.GPU_OP_LINEAR_ROPE_KV for o in gpu) == c.num_hidden_layers
    # a delayed reduction waits for the gather of its slot, directly or through ops it waits for
    ancestors: list[set[int]] = []
    for o in gpu:
        ancestors.append(set(o.deps).union(*(ancestors[d] for d in o.deps)))
    for j, o in enumerate(gpu):
        if o.opcode == Opcode.LANE_ADD_PAST:
            gathers = [i for i in range(j) if gpu[i].opcode == Opcode.LANE_GATHER and gpu[i].slot == o.slot]
            assert gathers and gathers[-1] in ancestors[j], (variant, j)


def test_lanes_on_tensor_parallel_ranks_run_in_the_kernel_with_run_dtype_weights_only():
    # the expansion splits a rank's cross-rank ops into pushes and finishes
    # (tests/cpu/test_sync_ranks.py); FP8 / 4-bit lanes are the interpreter's
    from kog.parallel.shard import shard_config

    c = lane_model_config(**VARIANTS["delay1"])
    rank = shard_config(c, 1, 2)
    w = prepare_weights(rank, random_weights(rank, seed=4), torch.float32)
    assert kernel_runs(rank) and kernel_runs(rank, w)
    gpu = _C.expand_gpu_program(lower_program(schedule_for(rank), w), model_dims(rank, torch.float32))
    assert any(o.comm >= 0 and o.comm_push for o in gpu)
    fp8 = dict(w)
    fp8["lm_head.weight"] = Fp8Weight.__new__(Fp8Weight)  # only its type is looked at
    assert not kernel_runs(rank, fp8)


def test_quantized_weights_in_a_lane_program_are_refused_by_op():
    ops, dims, c = lowered("delay1")  # replicate head: a LINEAR over MERGED, not a lane LINEAR
    i = next(i for i, o in enumerate(ops) if o.opcode == Opcode.LINEAR and o.out == Buffer.LOGITS)
    assert ops[i].lanes == 1
    scales = torch.ones(c.vocab_size)
    with pytest.raises(kog.InvalidRequest, match=f"op {i} reads an FP8 or 4-bit weight in a model of 2 lanes"):
        _C.expand_gpu_program(with_op(ops, i, w_type=_C.WEIGHT_FP8, w_scale=scales.data_ptr()), dims)


def test_kernel_runs_lanes_with_run_dtype_weights_only():
    c = lane_model_config(**VARIANTS["delay1"])
    w = prepare_weights(c, random_weights(c, seed=4), torch.float32)
    assert kernel_runs(c) and kernel_runs(c, w)
    fp8 = dict(w)
    fp8["lm_head.weight"] = Fp8Weight.__new__(Fp8Weight)  # only its type is looked at
    assert not kernel_runs(c, fp8)


@pytest.mark.parametrize("batch", [1, 3])
def test_lane_items_follow_run_item(batch):
    ops, dims, c = lowered("delay2_4lanes_lane_scale_lane_head")
    gpu = list(_C.expand_gpu_program(ops, dims))
    sync = sync_ops(gpu, dims, batch, max_parts=1)
    L, h, chunks = 4, dims.hidden, -(-dims.hidden // 512)
    for o, s in zip(gpu, sync):
        if o.opcode in LANE_OPS:  # (row, chunk of hidden), every lane in one item
            assert s.n_items == batch * chunks
        if o.opcode == Opcode.RMS_NORM and dims.buffer_width(o.out) == L * h:  # (row, lane[, chunk])
            assert s.n_items == batch * L * (1 if o.residual >= 0 else chunks)
        if o.opcode == Opcode.EMBED:  # the embedding copied into every lane
            assert s.n_items == batch * -(-L * h // 512)
        if o.opcode == Opcode.LANE_GATHER:
            assert s.writes == {lane_hist(o.slot)}
        if o.opcode == Opcode.LANE_ADD_PAST:
            assert lane_hist(o.slot) in s.reads and s.writes == {"buf.HIDDEN"}


@pytest.mark.parametrize("variant", ["delay1", "delay2_4lanes_lane_scale_lane_head", "pre_norm_agg", "vocab_parallel"])
@pytest.mark.parametrize("batch", [1, 3])
def test_lane_programs_under_random_interleavings_read_only_completed_data(variant, batch):
    ops, dims, _ = lowered(variant)
    gpu = _C.expand_gpu_program(ops, dims)
    p = Protocol(tuple(sync_ops(gpu, dims, batch, max_parts=2)), tuple(_C.program_sinks(gpu)))
    for grid in (1, 3, 7):
        for seed in range(4):
            run_launches(p, Launch(grid, 2, batch), seed)  # raises on a hazard or a deadlock


@pytest.mark.parametrize("variant", ["delay1", "delay2_4lanes_lane_scale_lane_head", "vocab_parallel"])
def test_the_kernels_row_lanes_give_the_interpreters_lane_projection(variant):
    """Each lane GEMV row reads x's slice of lane schedule::LaneRows.lane_of(row) (the kernel's
    per-row offset, through kog._C.lane_of_rows): row by row, that is the program interpreter's
    lane_matmul (one bmm per segment) on the same weights, for every lane LINEAR of the program
    (QKV, gate/up, o, down; the vocabulary-parallel head)."""
    from kog.program.interpreter import lane_matmul, lane_segments

    ops, dims, c = lowered(variant)
    program = schedule_for(c)
    lane_ops = [(o, ins) for o, ins in zip(ops, program) if o.lanes > 1]
    assert {o.out for o, _ in lane_ops} >= {Buffer.QKV, Buffer.GATE_UP, Buffer.HIDDEN}
    gen = torch.Generator().manual_seed(11)
    for o, ins in lane_ops:
        n, width_in = dims.buffer_width(o.out), dims.buffer_width(o.in_)
        k = width_in // o.lanes
        lanes = _C.lane_of_rows(dims, o)
        assert len(lanes) == n and sorted(set(lanes)) == list(range(o.lanes))
        x = torch.randn(2, width_in, generator=gen)
        w = torch.randn(n, k, generator=gen)
        rows = torch.stack([x[:, lane * k:(lane + 1) * k] @ w[r] for r, lane in enumerate(lanes)], dim=1)
        expected = lane_matmul(x, w, None, o.lanes, lane_segments(c, ins.writes[0], n))
        # f32 sums in two orders (values ~10; a wrong slice is off by ~10)
        torch.testing.assert_close(rows, expected, rtol=1e-4, atol=1e-4)
