"""The persistent decode kernel's synchronization protocol, modelled on the CPU
(kog.testing.sync_model): every family's expanded program under seeded random workgroup
interleavings reads only completed data and cannot deadlock; broken protocols are caught."""

import dataclasses
import re
from functools import lru_cache

import pytest
import torch

from kog import _C
from kog.models.decode import lower_program, model_dims, schedule_for
from kog.models.weights import prepare_weights
from kog.program import Buffer, Opcode
from kog.testing.sync_model import CounterReuse, Deadlock, Hazard, Launch, Protocol, SyncViolation, run_launches
from kog.testing.sync_program import PARTIALS, SyncOp, kv_cache, sync_ops, with_dep, without_dep
from kog.testing.tiny_models import random_weights, tiny_config

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "laneformer_tp"]
# Tiny configs: 400-token vocab -> 25 LM-head items at 16 rows per item; every grid below is
# smaller, so every workgroup owns an item of some op (see the flag-check finding at the end).
GRIDS = [1, 2, 3, 7, 24]
SEEDS = range(10)
BROKEN_SEEDS = range(12)


@lru_cache(maxsize=None)
def expanded(arch: str) -> tuple[list, _C.ModelDims]:
    c = tiny_config(arch)
    w = prepare_weights(c, random_weights(c), torch.float32)
    dims = model_dims(c, torch.float32)
    return _C.expand_gpu_program(lower_program(schedule_for(c), w), dims), dims


def protocol(arch: str, batch: int, max_parts: int = 2, **kw) -> Protocol:
    ops, dims = expanded(arch)
    return Protocol(tuple(sync_ops(ops, dims, batch, max_parts)), tuple(_C.program_sinks(ops)), **kw)


def violations(p: Protocol, launch: Launch, seeds=BROKEN_SEEDS, **kw) -> list[SyncViolation]:
    out = []
    for seed in seeds:
        try:
            run_launches(p, launch, seed, **kw)
        except SyncViolation as e:
            out.append(e)
    return out


def index_of(p: Protocol, name: str) -> int:
    return next(j for j, o in enumerate(p.ops) if o.name == name)


def test_items_and_accesses_follow_run_item():
    p = protocol("qwen3", batch=3, max_parts=2)
    by_name = {o.name: o for o in p.ops}
    qkv = by_name["LINEAR L0 RESIDUAL->QKV"]  # its RMSNorm prologue reads the residual stream
    assert qkv.n_items == 128 // 16 and qkv.reads == {"buf.RESIDUAL"}  # (4 + 2 + 2) heads x 16 rows / 16
    attn = by_name["ATTN_DECODE L1 QKV->ATTN"]
    assert attn.n_items == 3 * 2 * 2  # (batch, KV head, part)
    assert attn.writes == {PARTIALS} and kv_cache(1) in attn.reads  # the partial phase never writes ATTN
    # the last of a (sequence, KV head)'s parts merges them into ATTN
    assert attn.group_items == 2 and attn.tail_reads == {PARTIALS, "seq_lens"} and attn.tail_writes == {"buf.ATTN"}
    # the LM head's last item of each vocabulary chunk summarizes it for SAMPLE (400 logits: one chunk)
    head = by_name["LINEAR_SAMPLE_PARTIAL RESIDUAL->LOGITS"]
    assert head.n_items == 400 // 16 and head.group_items == _C.SAMPLE_CHUNK // 16
    assert head.tail_reads == {"buf.LOGITS"} and head.tail_writes == {"logits_out", "sample_summaries"}
    assert head.group_counter != attn.group_counter
    assert {o.name.split()[0] for o in p.ops if o.group_items} == {"ATTN_DECODE", "LINEAR_SAMPLE_PARTIAL"}
    assert by_name["KV_APPEND L1 QKV->kv.1"].writes == {kv_cache(1)}
    # residual adds fused into the LINEARs that produced their input (schedule::fuse_residual_adds),
    # the norms then into the prologues of the GEMVs that read them: NORMED is never written
    assert not any("RMS_NORM" in o.name or "buf.NORMED" in o.reads | o.writes for o in p.ops)
    o_proj = by_name["LINEAR L1 ATTN->RESIDUAL"]
    assert o_proj.reads == {"buf.ATTN", "buf.RESIDUAL"} and o_proj.writes == {"buf.RESIDUAL"}
    assert by_name["ROPE L1 QKV->QKV"].n_items == 3 * 2  # (4 + 2) heads, 4 per item
    assert {"buf.TOKENS", "positions", "finished"} <= p.ops[-1].writes and p.ops[-1].name.startswith("SAMPLE")
    assert p.sinks == (len(p.ops) - 1,)


@pytest.mark.parametrize("n_steps", [1, 3])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", FAMILIES)
def test_random_interleavings_read_only_completed_data_and_never_deadlock(arch, batch, n_steps):
    p = protocol(arch, batch)
    assert max(GRIDS) <= max(o.n_items for o in p.ops)  # no itemless workgroup (the finding below)
    for grid in GRIDS:
        blocked = sum(run_launches(p, Launch(grid, n_steps, batch), seed).blocked_ticks for seed in SEEDS)
        # Workgroups did get ahead of what they wait for (a lockstep schedule would prove nothing);
        # one workgroup walks the program in order, so its waits always pass.
        assert (blocked > 0) == (grid > 1), (grid, blocked)


def test_dropping_the_o_proj_wait_on_the_attention_is_a_hazard():
    p = protocol("llama", batch=1)
    o_proj = index_of(p, "LINEAR L0 ATTN->RESIDUAL")  # adds into RESIDUAL (fused)
    attn = index_of(p, "ATTN_DECODE L0 QKV->ATTN")
    broken = Protocol(tuple(without_dep(p.ops, o_proj, attn)), p.sinks)
    found = violations(broken, Launch(grid=3, n_steps=1, batch=1))
    assert found and all(isinstance(e, Hazard) for e in found)
    assert all(f"RAW on buf.ATTN: step 0 op {o_proj}" in str(e) for e in found), str(found[0])
    assert not violations(broken, Launch(grid=1, n_steps=1, batch=1))  # one workgroup runs in program order


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "qwen2_moe", "laneformer_tp"])
def test_every_dep_the_model_needs_is_caught_when_dropped(arch):
    # Each dep is either implied by another dep of the same op (waits are transitive), and then
    # dropping it must change nothing, or the model must report a hazard without it.
    p = protocol(arch, batch=2)
    ancestors: list[set[int]] = []
    for o in p.ops:
        ancestors.append(set(o.deps).union(*(ancestors[d] for d in o.deps)))
    needed = 0
    for j, op in enumerate(p.ops):
        for d in op.deps:
            implied = any(d in ancestors[e] for e in op.deps if e != d)
            broken = Protocol(tuple(without_dep(p.ops, j, d)), p.sinks)
            found = violations(broken, Launch(3, 2, 2), seeds=range(6 if implied else 12))
            assert bool(found) != implied, (j, op.name, d, p.ops[d].name, found[:1])
            assert all(isinstance(e, Hazard) for e in found)
            needed += not implied
    assert needed == len(p.ops) - 1  # the expanded program is one chain: each op needs the one before


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_expert_items_are_staged_only_with_their_layers_route(arch):
    # The kernel stages an expert GEMV item's first weights once the workgroup has waited for an
    # op of the item's layer after its router (the route names the expert's matrix): the down
    # items during the gate/up op, the gate/up items after its wait. Staging them before the
    # route is complete (a kernel that ignored route_layer) reads the groups the router's tail
    # is writing.
    p = protocol(arch, batch=2)
    stats = run_launches(p, Launch(grid=3, n_steps=2, batch=2), seed=1)
    assert stats.staged_expert_items > 0
    broken = Protocol(p.ops, p.sinks, stage_any_route=True)
    found = violations(broken, Launch(grid=3, n_steps=2, batch=2), seeds=range(4))
    assert found and all(isinstance(e, Hazard) for e in found)
    assert all("RAW on moe.groups" in str(e) for e in found), str(found[0])


def test_a_step_that_does_not_wait_for_the_previous_steps_sinks_is_a_hazard():
    p = protocol("qwen2", batch=3)
    found = violations(Protocol(p.ops, sinks=()), Launch(grid=7, n_steps=3, batch=3))
    assert found and all(isinstance(e, Hazard) for e in found), found[:1]


@pytest.mark.parametrize("arch", FAMILIES)
def test_waiting_for_more_items_than_an_op_has_deadlocks(arch):
    p = protocol(arch, batch=1)
    attn = next(j for j, o in enumerate(p.ops) if o.name.startswith("ATTN_DECODE"))
    found = violations(Protocol(p.ops, p.sinks, target_bonus={attn: 1}), Launch(3, 2, 1), seeds=range(4))
    assert len(found) == 4 and all(isinstance(e, Deadlock) for e in found)
    assert f"op {attn} (ATTN_DECODE L0 QKV->ATTN): counter 3 < 4" in str(found[0]), str(found[0])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_group_tail_before_all_its_parts_is_caught(arch):
    # The last part to finish merges the group: with the count's target one short, the first
    # part to finish merges a group that still misses one.
    p = protocol(arch, batch=2)
    assert not violations(p, Launch(3, 2, 2), seeds=range(4))
    attn = next(j for j, o in enumerate(p.ops) if o.name.startswith("ATTN_DECODE"))
    found = violations(dataclasses.replace(p, group_target_bonus={attn: -1}), Launch(3, 2, 2), seeds=range(4))
    # a merge with a part missing (or, where the missing part ran just before the count, a
    # counter left set by the second merge's count)
    assert len(found) == 4 and all(isinstance(e, (Hazard, CounterReuse)) for e in found), found[:1]
    assert any(re.search(r"ATTN_DECODE L0 QKV->ATTN\) group \d+'s tail ran on workgroup \d+ with 1/2 of its items "
                         r"done", str(e)) for e in found), str(found[0])


def test_groups_of_unequal_size_wait_for_exactly_their_items():
    # A vocabulary of several chunks whose last is partial: the LM head's 25 items in groups of
    # 10, 10 and 5 (the kernel: 256 items a chunk on CUDA, the last chunk what is left).
    p = protocol("qwen2", batch=2)
    head = next(j for j, o in enumerate(p.ops) if o.name.startswith("LINEAR_SAMPLE_PARTIAL"))
    p = dataclasses.replace(p, ops=p.ops[:head] + (dataclasses.replace(p.ops[head], group_items=10),) + p.ops[head + 1:])
    assert p.ops[head].n_items == 25
    assert not violations(p, Launch(7, 2, 2), seeds=range(6))
    # (had the model waited for 10 in the last group, its tail would never run and its counter
    # would be left at 5: a CounterReuse above)
    found = violations(dataclasses.replace(p, group_target_bonus={head: -1}), Launch(7, 1, 2), seeds=range(4))
    assert found and all(isinstance(e, (Hazard, CounterReuse)) for e in found), found[:1]
    assert all("LINEAR_SAMPLE_PARTIAL" in str(e) for e in found), str(found[0])
    # one workgroup runs the items in order: the tail fires after 9 of group 0's 10
    found = violations(dataclasses.replace(p, group_target_bonus={head: -1}), Launch(1, 1, 2), seeds=range(1))
    assert len(found) == 1 and isinstance(found[0], Hazard)
    assert "group 0's tail ran on workgroup 0 with 9/10 of its items done" in str(found[0]), str(found[0])


def test_a_group_counter_left_set_is_caught():
    # Without the reset, the next layer's parts count on from where this layer's stopped.
    p = protocol("llama", batch=1, max_parts=2, reset_group_counts=False)
    found = violations(p, Launch(3, 1, 1), seeds=range(3))
    assert len(found) == 3 and all(isinstance(e, CounterReuse) for e in found)
    assert "ATTN_DECODE L1" in str(found[0]) and "attn_group_counts[0] is 3 > 2 items" in str(found[0]), str(found[0])


def test_a_workgroup_signalling_before_its_last_item_is_a_hazard():
    # One signal per workgroup and op: sent after its first item instead of its last, a waiter
    # passes while that workgroup's later items of the op are still to run.
    p = protocol("llama", batch=2)
    assert not violations(p, Launch(3, 2, 2), seeds=range(4))
    found = violations(dataclasses.replace(p, signal_after_first_item=True), Launch(3, 2, 2), seeds=range(4))
    assert len(found) == 4 and all(isinstance(e, Hazard) for e in found), found[:1]
    # one workgroup per item everywhere (the largest op has 25 items): first item = last, no hazard
    assert not violations(dataclasses.replace(p, signal_after_first_item=True), Launch(25, 2, 2), seeds=range(2))


def test_a_dep_on_a_later_op_deadlocks():
    p = protocol("qwen3", batch=3)
    qkv = index_of(p, "LINEAR L0 RESIDUAL->QKV")
    broken = Protocol(tuple(with_dep(p.ops, qkv, len(p.ops) - 1)), p.sinks)
    found = violations(broken, Launch(7, 1, 3), seeds=range(4))
    assert len(found) == 4 and all(isinstance(e, Deadlock) for e in found)
    assert "waits for step 0 op" in str(found[0]) and "SAMPLE" in str(found[0])


@pytest.mark.parametrize("grid", [2, 7])
def test_a_grid_that_is_not_co_resident_deadlocks(grid):
    p = protocol("mistral", batch=3)
    found = violations(p, Launch(grid, 2, 3, resident=grid - 1), seeds=range(4))
    assert len(found) == 4 and all(isinstance(e, Deadlock) for e in found)
    assert f"workgroups {grid - 1}..{grid - 1} never started" in str(found[0])


def test_zeroing_before_the_last_workgroup_leaves_is_caught():
    p = protocol("llama", batch=3)
    # Caught unless the schedule happens to let the first workgroup out leave last (1 seed in 8).
    found = violations(Protocol(p.ops, p.sinks, zero_at_exit=1), Launch(3, 2, 3), seeds=range(8))
    assert len(found) >= 6 and all(isinstance(e, CounterReuse) for e in found)
    never = violations(Protocol(p.ops, p.sinks, zero_at_exit=4), Launch(3, 2, 3), seeds=range(2))
    assert len(never) == 2 and all("left counters not zero" in str(e) for e in never)


# Finding (issue 16): a workgroup that owns no item of any op (grid larger than every op's item
# count: tiny models on a 132-SM H200) can reach the flag check of step s only after another
# workgroup ran SAMPLE of step s: nothing it waits for (the step s-1 sinks) orders its read of
# `finished` before SAMPLE's write, so it may see step s's stop flags instead of step s-1's.
ITEMLESS = Launch(grid=30, n_steps=3, batch=1, slow=(29,))  # workgroups 25..29 own no item


@pytest.mark.xfail(strict=True, raises=Hazard, reason="issue 16 finding: an itemless workgroup's flag check "
                   "races SAMPLE's write of `finished` (benign: see the next test)")
def test_the_flag_check_reads_only_the_previous_steps_flags():
    p = protocol("llama", batch=1, max_parts=1)
    assert max(o.n_items for o in p.ops) < ITEMLESS.grid
    for seed in SEEDS:
        run_launches(p, ITEMLESS, seed)


def test_an_itemless_workgroups_late_flag_read_is_benign():
    # The flags only go 0 -> 1 within a launch, so a late read can only leave the loop earlier,
    # and a workgroup that owns no item skips nothing by leaving: no deadlock, counters zeroed.
    p = protocol("llama", batch=1, max_parts=1)
    split = sum(run_launches(p, ITEMLESS, seed, check_flag_reads=False).split_exits for seed in BROKEN_SEEDS)
    assert split > 0  # the race did happen: workgroups left after different steps
