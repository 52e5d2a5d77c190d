"""The persistent kernel's weight staging policy (csrc/gpu/decode/weight_stage.cuh and the op
loop of persistent_kernel.cuh), modelled on the CPU for one workgroup walking real expanded
programs: every LINEAR item must find its weights staged before it runs (never the kernel's
"not reached" on-demand path), staged ahead of the op's dependency wait, and no read of a stage
may precede the completion of its cp.async group under the kernel's wait_group(0 or 1) rule.

The walk mirrors the kernel: stage_next at the top of every op with the op's first item as the
candidate; per GEMV item find -> stage_next(item + grid) -> wait(stage) -> run -> release ->
stage_next(item + grid); stage_next fills every free stage with the next items in run order
(next_linear_item from op j on, wrapping once into the next step when one follows); wait(s)
keeps in flight the groups committed after s's. A change to that order in the kernel must be
made here too."""

from dataclasses import dataclass, field

import pytest
import torch

from kog import _C
from kog.models.decode import lower_program, model_dims, schedule_for
from kog.models.weights import prepare_weights
from kog.program import Opcode
from kog.testing.sync_program import items_of
from kog.testing.tiny_models import random_weights, tiny_config

GEMV = (Opcode.LINEAR, _C.GPU_OP_LINEAR_SILU_MUL, _C.GPU_OP_LINEAR_ROPE_KV)  # schedule::is_gemv


@dataclass
class Stages:
    """WeightStages: tags per stage, and (NVIDIA) the commit groups in flight, oldest first."""
    n: int
    tags: list = field(default_factory=list)
    in_flight: list = field(default_factory=list)  # stage index per committed, unfinished group
    seq: list = field(default_factory=list)  # commit number of each stage's group
    issued: int = 0

    def __post_init__(self):
        self.tags = [None] * self.n
        self.seq = [0] * self.n

    def find(self, tag):
        return self.tags.index(tag) if tag in self.tags else -1

    def free(self):
        return self.tags.index(None) if None in self.tags else -1

    def issue(self, s, tag):
        assert self.tags[s] is None, "issue into a stage in use"
        assert s not in self.in_flight, "a stage rewritten while its copies may be in flight"
        self.tags[s] = tag
        self.in_flight.append(s)
        self.seq[s] = self.issued
        self.issued += 1

    def keep(self, s):  # cp.async.wait_group's N: the groups committed after s's
        return self.issued - 1 - self.seq[s]

    def wait(self, s):
        keep = self.keep(s)
        done = self.in_flight[:max(0, len(self.in_flight) - keep)]
        self.in_flight = self.in_flight[len(done):]
        assert s not in self.in_flight, f"stage {s} read while its group is in flight"


def walk(ops, items, grid, block, n_steps, n_stages, after_release=True, stages=Stages):
    """One workgroup's walk; returns, per LINEAR item run, how it was staged ('ahead': before
    the op's first wait or during the previous item; 'on demand': the kernel's fallback).
    after_release=False drops the kernel's stage_next after an item's release (tests)."""
    n = len(ops)
    linear = [o.opcode in GEMV for o in ops]
    next_linear = [next((l for l in range(j, n) if linear[l]), n) for j in range(n)]

    def next_linear_item(j, cand, wrap):
        this_step, l = True, next_linear[j] if j < n else n
        while True:
            if l >= n:
                if not wrap:
                    return None
                wrap = this_step = False
                l = next_linear[0]
                if l >= n:
                    return None
            c = cand if this_step and l == j else block
            if c < items[l]:
                return (l, c), not this_step
            l = next_linear[l + 1] if l + 1 < n else n

    st = stages(n_stages)

    def stage_next(j, cand, step):
        wrap = step + 1 < n_steps
        for _ in range(n_stages):
            found = next_linear_item(j, cand, wrap)
            if found is None:
                return
            t, wrapped = found
            if st.find(t) < 0:
                s = st.free()
                if s < 0:
                    return
                st.issue(s, t)
            j, cand = t[0], t[1] + grid
            wrap = wrap and not wrapped

    how = []
    for step in range(n_steps):
        for j in range(n):
            stage_next(j, block, step)
            for item in range(block, items[j], grid):  # the first waits on the op's deps
                if not linear[j]:
                    continue
                s = st.find((j, item))
                if s < 0:
                    how.append("on demand")
                    st.in_flight.clear()  # reset(): wait_group 0, every stage free
                    st.tags = [None] * n_stages
                    s = 0
                    st.issue(s, (j, item))
                else:
                    how.append("ahead")
                stage_next(j, item + grid, step)
                st.wait(s)
                st.tags[s] = None
                if after_release:
                    stage_next(j, item + grid, step)
    return how


def program(arch: str, **overrides):
    c = tiny_config(arch, **overrides)
    w = prepare_weights(c, random_weights(c), torch.float32)
    dims = model_dims(c, torch.float32)
    return _C.expand_gpu_program(lower_program(schedule_for(c), w), dims), dims


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("n_stages,rows_per_item", [(3, 16), (2, 16), (1, 8)])  # NVIDIA (cp.async), AMD (registers)
@pytest.mark.parametrize("grid", [1, 3, 7, 64])
def test_every_linear_item_runs_from_a_stage_filled_ahead(arch, n_stages, rows_per_item, grid):
    ops, dims = program(arch, hidden_size=128, intermediate_size=384)
    items = [items_of(o, dims, batch=2, max_parts=3, rows_per_item=rows_per_item) for o in ops]
    for block in sorted({0, grid // 2, grid - 1}):
        for n_steps in (1, 3):
            how = walk(ops, items, grid, block, n_steps, n_stages)
            want = n_steps * sum(len(range(block, k, grid)) for k, o in zip(items, ops) if o.opcode in GEMV)
            assert len(how) == want
            assert set(how) <= {"ahead"}, (block, n_steps, how.count("on demand"))


def test_the_model_catches_a_policy_without_look_ahead():
    """Without the stage_next after an item's release, a one-stage workgroup with several items
    in an op loads every item after its first on demand: the check above can fail."""
    ops, dims = program("llama", hidden_size=128, intermediate_size=384)
    items = [items_of(o, dims, batch=2, max_parts=3, rows_per_item=8) for o in ops]
    assert set(walk(ops, items, 1, 0, 2, 1)) == {"ahead"}
    how = walk(ops, items, 1, 0, 2, 1, after_release=False)
    assert how.count("on demand") > 0


def test_the_model_catches_a_wait_that_keeps_the_stage_in_flight():
    """A wait_group that keeps one group more in flight than were committed after the stage
    read lets the read see copies still in flight."""

    class KeepOne(Stages):
        def keep(self, s):  # as if every wait kept one more group in flight than committed after s
            return super().keep(s) + 1

    ops, dims = program("llama", hidden_size=128, intermediate_size=384)
    items = [items_of(o, dims, batch=2, max_parts=3, rows_per_item=16) for o in ops]
    with pytest.raises(AssertionError, match="in flight"):
        walk(ops, items, 3, 0, 1, 3, stages=KeepOne)
