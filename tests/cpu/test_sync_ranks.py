"""A tensor-parallel rank's GPU program (expand_gpu_program with lane_ranks > 1): each cross-rank
op split into a push and a finish on one channel; and the ranks' protocol (epoch flags, two inbox
parities) under seeded random interleavings of every rank's workgroups (kog.testing.sync_ranks):
no rank reads an inbox before every rank's push of the step, none overwrites one before its
reader finished, no deadlock; one parity, or a finish that does not wait, is caught."""

from functools import lru_cache

import pytest

from kog import _C
from kog.errors import InvalidRequest
from kog.lane_config import LaneConfig
from kog.parallel.shard import lane_form, shard_config
from kog.program import Buffer, Opcode
from kog.testing.programs import lowered_program
from kog.testing.sync_model import Deadlock, Hazard, Launch, Protocol
from kog.testing.sync_program import sync_ops
from kog.testing.sync_ranks import run_ranks
from kog.testing.tiny_models import tiny_config

CROSS_RANK = (Opcode.LANE_SUM, Opcode.LANE_MEAN, Opcode.LANE_MERGE_SUM, Opcode.ALL_REDUCE, Opcode.ALL_GATHER)
MODELS = {  # name -> (config, ranks)
    "laneformer": (tiny_config("laneformer_tp"), 2),
    "laneformer_delay2_lane_head": (tiny_config("laneformer_tp", num_hidden_layers=4, num_key_value_heads=4, lanes=LaneConfig(
        num_lanes=4, broadcast_delay=2, lm_head_type="lane")), 2),
    "laneformer_merge_sum": (tiny_config("laneformer_tp", lanes=LaneConfig(
        num_lanes=2, broadcast_delay=1, pre_norm_lane_agg=True)), 2),
    # no lane ever combined, a "lane" head's partial logits all-reduced: one channel a step
    "laneformer_no_comm": (tiny_config("laneformer_tp", lanes=LaneConfig(
        num_lanes=2, broadcast_delay=1, use_comm=False, use_early_comm=False, lm_head_type="lane")), 2),
    "llama": (tiny_config("llama"), 2),
    "llama_4_ranks": (tiny_config("llama"), 4),  # 2 KV heads over 4 ranks: replicated
}


@lru_cache(maxsize=None)
def rank_programs(name: str):
    """[(lowered, expanded, dims)] of every rank."""
    config, size = MODELS[name]
    form = lane_form(config, size) if config.lanes is None else config
    out = []
    for r in range(size):
        ops, dims, weights = lowered_program(shard_config(form, r, size))
        out.append((ops, _C.expand_gpu_program(ops, dims), dims, weights))
    return out


def protocols(name: str, batch: int) -> list[Protocol]:
    return [Protocol(tuple(sync_ops(ex, dims, batch)), tuple(_C.program_sinks(ex)))
            for _, ex, dims, _ in rank_programs(name)]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_cross_rank_op_is_a_push_then_a_finish_on_one_channel(name):
    ops, ex, dims, _ = rank_programs(name)[0]
    pushes = [o for o in ex if o.comm >= 0 and o.comm_push]
    finishes = [o for o in ex if o.comm >= 0 and not o.comm_push]
    assert [o.comm for o in pushes] == list(range(len(pushes)))  # channels in program order
    kinds = [o.opcode for o in ops if o.opcode in (*CROSS_RANK, Opcode.LANE_GATHER)]
    assert [o.opcode for o in pushes] == kinds  # every one of them pushes, in order
    assert all(o.out == -1 for o in pushes)  # a push writes only the inboxes
    finished = sorted(o.comm for o in finishes)
    gathers = {o.comm for o in pushes if o.opcode == Opcode.LANE_GATHER}
    adds = [o for o in finishes if o.opcode == Opcode.LANE_ADD_PAST]
    assert len(adds) == len([o for o in ops if o.opcode == Opcode.LANE_ADD_PAST])
    assert {o.comm for o in adds} <= gathers  # a delayed add finishes the gather of its slot
    assert sorted(set(finished) - gathers) == sorted(o.comm for o in pushes if o.comm not in gathers)
    for j, o in enumerate(ex):
        if o.comm >= 0 and not o.comm_push:  # the finish depends on its channel's push
            push = next(k for k, p in enumerate(ex) if p.comm == o.comm and p.comm_push)
            assert push in o.deps and push < j
    sample = ex[-1]
    assert sample.opcode == Opcode.SAMPLE  # it reads the logits' finish, which carries its first phase
    head = next(o for o in reversed(ex[:-1]) if o.out == Buffer.LOGITS)
    assert head.opcode in (Opcode.ALL_GATHER, Opcode.ALL_REDUCE) and head.comm >= 0 and not head.comm_push
    assert not any(o.opcode == _C.GPU_OP_LINEAR_SAMPLE_PARTIAL for o in ex)
    layout = _C.comm_layout(ex, dims, 3)
    assert len(layout["part"]) == len(pushes) and all(p % 256 == 0 for p in layout["part"])
    assert layout["offset"][1:] == [a + p * dims.lane_ranks for a, p in zip(layout["offset"], layout["part"])][:-1]


def test_one_rank_programs_have_no_cross_rank_ops():
    ops, dims, _ = lowered_program(tiny_config("laneformer_tp"))
    ex = _C.expand_gpu_program(ops, dims)
    assert all(o.comm == -1 for o in ex) and _C.comm_layout(ex, dims, 4)["parity_bytes"] == 0
    assert any(o.opcode == _C.GPU_OP_LINEAR_SAMPLE_PARTIAL for o in ex)


def test_a_rank_program_with_gpu_quantized_weights_is_refused():
    from kog.testing.programs import with_op

    ops, ex, dims, _ = rank_programs("llama")[0]
    j = next(i for i, o in enumerate(ops) if o.opcode == Opcode.LINEAR)
    bad = with_op(ops, j, w_type=_C.WEIGHT_FP8, w_scale=ops[j].w0)
    with pytest.raises(InvalidRequest, match="run-dtype weights only"):
        _C.expand_gpu_program(bad, dims)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("grid", [1, 3, 6])
def test_ranks_read_only_complete_pushes_and_never_overwrite_unread_ones(name, grid):
    ps = protocols(name, batch=2)
    for seed in range(8):
        run_ranks(ps, Launch(grid=grid, n_steps=3, batch=2), seed)


def test_one_inbox_parity_is_overwritten_before_it_is_read():
    # With one channel a step, a rank's next push may land while another still reads the last:
    # what the second parity prevents. (With two or more channels a step, one parity would do: a
    # rank pushes step t + 1 only after finishing step t, which needed every rank's push of its
    # last channel, made after that rank's reads of every other channel of step t.)
    ex = rank_programs("laneformer_no_comm")[0][1]
    assert [o.opcode for o in ex if o.comm >= 0] == [Opcode.ALL_REDUCE, Opcode.ALL_REDUCE]
    caught = []
    for name, grid in (("laneformer_no_comm", 3), ("llama", 3)):
        for seed in range(30):
            try:
                run_ranks(protocols(name, batch=1), Launch(grid=grid, n_steps=3, batch=1), seed, parities=1)
            except Hazard as e:
                caught.append((name, str(e)))
    assert caught and all(n == "laneformer_no_comm" and c.startswith("WAR on rank") for n, c in caught), caught[:1]


def test_a_finish_that_does_not_wait_for_the_flags_is_caught(monkeypatch):
    from kog.testing import sync_ranks

    monkeypatch.setattr(sync_ranks._World, "flags_ready", lambda self, rank, channel, epoch: True)
    ps = protocols("laneformer", batch=1)
    caught = []
    for seed in range(20):
        try:
            run_ranks(ps, Launch(grid=2, n_steps=2, batch=1), seed)
        except Hazard as e:
            caught.append(str(e))
    assert caught and any(c.startswith("RAW on rank") for c in caught), caught[:1]


def test_flags_never_raised_deadlock_the_ranks(monkeypatch):
    from kog.testing import sync_ranks

    monkeypatch.setattr(sync_ranks._World, "raise_flags", lambda self, rank, channel, epoch: None)
    with pytest.raises(Deadlock, match="waits for the flags of channel 0"):
        run_ranks(protocols("llama", batch=1), Launch(grid=2, n_steps=1, batch=1), 0)


def test_connecting_gpu_ranks_needs_a_gpu_build():
    from kog.errors import BackendError
    from kog.parallel.gpu_peers import connect_gpu_ranks

    if hasattr(_C, "PeerSegment"):
        pytest.skip("a GPU build: tests/gpu/test_ranks_two_gpus.py covers it")
    with pytest.raises(BackendError, match="needs a GPU build"):
        connect_gpu_ranks(object(), 0, 2)
