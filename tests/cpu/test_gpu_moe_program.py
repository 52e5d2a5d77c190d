"""Mixture-of-experts layers in the GPU persistent kernel's program, on the CPU (every build):
the expansion of ROUTER / MOE_EXPERTS (kog._C.expand_gpu_program), its refusals, and the router
tail's pair bookkeeping (csrc/schedule/moe_route.h, through kog._C.moe_group_pairs) replayed as
the kernel's data flow against the program interpreter's MoE layer."""

import numpy as np
import pytest
import torch

import kog
from kog import _C
from kog.models.gpu_decode import kernel_runs
from kog.models.weights import prepare_weights
from kog.program import Opcode
from kog.program.interpreter import _expert_mm
from kog.testing.programs import lowered_program, with_op
from kog.testing.tiny_models import random_weights, tiny_config

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]


def lowered(arch: str, **overrides):
    c = tiny_config(arch, **overrides)
    ops, dims, _ = lowered_program(c, seed=3)  # nothing here reads the weights
    return ops, dims, c


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_router_and_experts_expand_into_a_chain_of_gpu_ops(arch):
    ops, dims, c = lowered(arch)
    gpu = list(_C.expand_gpu_program(ops, dims))
    routers = [o for o in ops if o.opcode == Opcode.ROUTER]
    experts = [o for o in ops if o.opcode == Opcode.MOE_EXPERTS]
    assert len(routers) == len(experts) == len(c.moe_layers) > 0
    assert not any(o.opcode in (Opcode.ROUTER, Opcode.MOE_EXPERTS) for o in gpu)
    gemvs = [j for j, o in enumerate(gpu) if o.opcode == _C.GPU_OP_ROUTER_GEMV]
    assert [gpu[j].w0 for j in gemvs] == [o.w0 for o in routers]
    assert [gpu[j].layer for j in gemvs] == [o.layer for o in routers]
    gate_ups = [j for j, o in enumerate(gpu) if o.opcode == _C.GPU_OP_MOE_GATE_UP]
    assert len(gate_ups) == len(experts)
    for j, src in zip(gate_ups, experts):
        up, down, comb = gpu[j], gpu[j + 1], gpu[j + 2]
        assert (down.opcode, comb.opcode) == (_C.GPU_OP_MOE_DOWN, _C.GPU_OP_MOE_COMBINE)
        assert (up.w0, up.w1, down.w0, down.w1) == (src.w0, src.w1, src.w0, src.w1)
        assert comb.out == src.out and up.out == down.out == -1 and comb.w0 == 0
        assert list(down.deps) == [j] and list(comb.deps) == [j + 1]  # a chain: waits stay transitive
        router = max(g for g in gemvs if g < j)
        assert router in up.deps  # the route tail's groups and gathered rows
        # every later op that read MOE_EXPERTS' output waits for the combine (or an op after it)
        reader = next(k for k in range(j + 3, len(gpu)) if gpu[k].in_ == src.out or gpu[k].residual == src.out)
        assert j + 2 in gpu[reader].deps or any(d > j + 2 for d in gpu[reader].deps)


def test_kernel_runs_moe_within_the_router_limits():
    assert all(kernel_runs(tiny_config(a)) for a in MOE_ARCHS)
    for overrides, message in [
        (dict(num_experts=32, num_experts_per_tok=_C.GPU_MOE_MAX_SLOTS + 1), "slots per row"),
        (dict(num_experts=_C.GPU_MOE_MAX_ROUTER_ROWS + 1, num_experts_per_tok=2), "router rows"),
    ]:
        assert not kernel_runs(tiny_config("qwen3_moe", **overrides))
        ops, dims, _ = lowered("qwen3_moe", **overrides)
        with pytest.raises(kog.InvalidRequest, match=message):
            _C.expand_gpu_program(ops, dims)
    ops, dims, _ = lowered("qwen3_moe", num_experts=32, num_experts_per_tok=_C.GPU_MOE_MAX_SLOTS)
    _C.expand_gpu_program(ops, dims)  # at the limit


def test_quantized_expert_stacks_are_refused_by_name():
    ops, dims, _ = lowered("mixtral")
    i = next(i for i, o in enumerate(ops) if o.opcode == Opcode.MOE_EXPERTS)
    with pytest.raises(kog.InvalidRequest, match=f"op {i} .*ggml type"):
        _C.expand_gpu_program(with_op(ops, i, w_type=8), dims)  # Q8_0 blocks


def reference_groups(expert: np.ndarray, width: int) -> dict:
    """The pairs' order and groups as the CPU executor's counting sort makes them."""
    P = len(expert)
    order = np.argsort(expert, kind="stable")  # by expert, pair index ascending within one
    rank = np.empty(P, np.int64)
    rank[order] = np.arange(P)
    chosen = np.unique(expert)
    first = np.array([expert[i] not in expert[:i] for i in range(P)])
    rows = expert.reshape(-1, width)
    row_rank = np.concatenate([np.argsort(np.argsort(r, kind="stable"), kind="stable") for r in rows])
    return dict(first=first.astype(int).tolist(), rank=rank.tolist(), row_rank=row_rank.tolist(),
                group=[int(np.searchsorted(chosen, e)) for e in expert])


@pytest.mark.parametrize("batch,width,n_experts", [(1, 2, 4), (1, 8, 64), (3, 2, 4), (8, 8, 16), (8, 16, 512), (5, 6, 6)])
def test_router_tail_pair_order_and_groups_match_the_cpu_executor(batch, width, n_experts):
    rng = np.random.default_rng(batch * 100 + width)
    expert = np.concatenate([rng.choice(n_experts, width, replace=False) for _ in range(batch)]).astype(np.int32)
    got = _C.moe_group_pairs(expert.tolist(), width)
    assert got == reference_groups(expert, width)
    assert sorted(got["rank"]) == list(range(len(expert)))  # a permutation


def test_moe_group_pairs_refuses_ragged_rows():
    with pytest.raises(kog.InvalidRequest, match="not rows of 3"):
        _C.moe_group_pairs([0, 1, 2, 3], 3)


@pytest.mark.parametrize("arch,batch,rank", [("qwen3_moe", 1, None), ("qwen3_moe", 5, None), ("qwen2_moe", 3, None),
                                             ("mixtral", 8, None), ("qwen3_moe", 5, 0), ("qwen3_moe", 5, 1),
                                             ("qwen2_moe", 3, 0), ("qwen2_moe", 3, 1)])
def test_kernel_data_flow_replayed_gives_the_interpreters_moe_output(arch, batch, rank):
    """The GPU MoE layer's data flow (gather by sorted pair, one GEMV pair per group over its
    rows, combine each row's pairs in row_rank order) built from moe_group_pairs, in torch: equal
    to the program interpreter's MOE_EXPERTS on the same ROUTE, bit for bit. With `rank`, rank
    `rank` of 2 with the experts placed over the ranks: the executor's expert_local table, the
    route tail's -1 groups (run nothing) and -1 row_pairs (the combine skips them)."""
    from kog import ops as kops
    from kog.parallel.ranks import rank_view
    from kog.parallel.shard import shard_weights
    from kog.program import interpreter

    c = tiny_config(arch)
    full = random_weights(c, seed=9)
    if rank is not None:
        c = rank_view(rank, 2)(c)
        full = shard_weights(c, full)
    w = prepare_weights(c, full, torch.float32)
    layer = c.moe_layers[0]
    gate_up = w[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    down = w[f"model.layers.{layer}.mlp.experts.down_proj"]
    placement = w.get(f"model.layers.{layer}.mlp.experts.ranks")
    assert (placement is None) == (rank is None)
    E, K, S = c.num_experts, c.num_experts_per_tok, c.shared_expert_slots
    W, n_stack = K + S, E + S
    # GpuDecodeExecutor's MoeScratch::expert_local: each expert's index in this rank's stacks
    local = list(range(n_stack))
    if placement is not None:
        mine = [e for e in range(n_stack) if int(placement[e]) == rank]
        local = [mine.index(e) if e in mine else -1 for e in range(n_stack)]
        assert 0 < len(mine) < n_stack
        n_stack = len(mine)
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, c.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(batch)])
    ids = torch.cat([ids, torch.arange(E, E + S).expand(batch, S)], dim=1).to(torch.int32)
    weights = torch.rand(batch, W, generator=gen)
    route = torch.cat([ids, weights.view(torch.int32)], dim=1)

    class State:  # the two buffers MOE_EXPERTS reads, the one it writes
        def __init__(self):
            self.out = None

        def read(self, name, rows):
            return {"x": x, "route": route}[name]

        def write(self, name, value, rows):
            self.out = value

    class Ins:
        reads, writes, rows = ("x", "route"), ("out",), None

    class It:
        config = c

    state = State()
    interpreter._moe_experts(It, state, Ins, (gate_up, down) + ((placement,) if placement is not None else ()))
    expected = state.out

    flat = ids.reshape(-1).tolist()
    g = _C.moe_group_pairs(flat, W)
    P = len(flat)
    pair_row, pair_weight = [0] * P, [0.0] * P
    row_pairs = [[0] * W for _ in range(batch)]
    group_expert, group_start = {}, {}
    for i in range(P):  # moe_route_tail
        q, here = g["rank"][i], local[flat[i]]
        pair_row[q], pair_weight[q] = i // W, weights.reshape(-1)[i]
        row_pairs[i // W][g["row_rank"][i]] = q if here >= 0 else -1
        if g["first"][i]:
            group_expert[g["group"][i]], group_start[g["group"][i]] = here, q
    n_groups = sum(g["first"])
    starts = [group_start[k] for k in range(n_groups)] + [P]
    gathered = x[pair_row]  # the route tail's gather: sorted pair q's row
    y = torch.full((P, c.hidden_size), float("nan"))  # another rank's pairs: never written, never read
    for k in range(n_groups):  # moe_expert_item
        lo, hi, e = starts[k], starts[k + 1], group_expert[k]
        assert sorted(set(pair_row[lo:hi])) == pair_row[lo:hi]  # rows ascending, each once
        if e < 0:
            continue
        y[lo:hi] = _expert_mm(kops.silu_and_mul(_expert_mm(gathered[lo:hi], gate_up, e, n_stack)), down, e, n_stack)
    out = torch.zeros(batch, c.hidden_size)
    for b in range(batch):  # moe_combine_item
        assert [flat[i] for i in sorted(range(b * W, (b + 1) * W), key=lambda i: g["row_rank"][i])] == sorted(flat[b * W:(b + 1) * W])
        for q in row_pairs[b]:  # ascending expert order, f32
            if q >= 0:
                out[b] += y[q] * pair_weight[q]
    assert torch.equal(out, expected)
    if rank is not None:
        assert any(e < 0 for e in group_expert.values()) or batch * K < 2  # the other rank's groups exist
