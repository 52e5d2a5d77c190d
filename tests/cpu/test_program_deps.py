"""Dependencies are the contract: the CPU executor runs any topological order of a program's ops
to the same bits, meets at a barrier only where a dependency crosses threads, and refuses a bad
dependency list naming the op."""

import dataclasses
import random

import numpy as np
import pytest
import torch

import kog
from kog import _C
from kog.loader import LoadedModel
from kog.models import ModelRunner, PrefillChunk
from kog.models.decode import build_executor, lower_program, model_dims, schedule_for
from kog.program import Buffer, Instruction, Opcode
from kog.testing.tiny_models import random_weights, tiny_config

BS = 4


def runner(arch: str, dtype) -> ModelRunner:
    config = tiny_config(arch)
    weights = {k: v.to(dtype) for k, v in random_weights(config, seed=11).items()}
    model = LoadedModel(path=None, config=config, weights=weights, dtype=dtype, tokenizer=None,
                        chat_template=None, stop_token_ids=())
    return ModelRunner(model, num_kv_blocks=64, block_size=BS)


def with_deps(raw: list[tuple]) -> list[Instruction]:
    """deps from reads and writes: last writer of what an op reads or writes, readers since then
    of what it writes (RAW, WAW, WAR), as kog.program computes them."""
    last_writer, readers, out = {}, {}, []
    for i, (op, layer, reads, writes, weights) in enumerate(raw):
        deps = {last_writer[r] for r in reads + writes if r in last_writer}
        for w in writes:
            deps.update(readers.get(w, ()))
        deps.discard(i)
        for r in reads:
            readers.setdefault(r, []).append(i)
        for w in writes:
            last_writer[w], readers[w] = i, []
        out.append(Instruction(op, layer, reads, writes, weights, tuple(sorted(deps))))
    return out


def parallel_block_program(config) -> list[Instruction]:
    """A GPT-J style block (attention and MLP both read the same normed input), whose MLP ops are
    independent of the attention ops: x += attn(norm(x)) + mlp(norm(x)). The MLP output lands in
    NORMED and is added by an in-place fused norm; the attention output by the next layer's norm."""
    B = Buffer
    raw = [(Opcode.EMBED, -1, (B.TOKENS,), (B.RESIDUAL,), ("model.embed_tokens.weight",))]
    for layer in range(config.num_hidden_layers):
        p, kv = f"model.layers.{layer}.", f"kv.{layer}"
        norm_in, norm_out = ((B.RESIDUAL,), (B.NORMED,)) if layer == 0 else ((B.HIDDEN, B.RESIDUAL), (B.NORMED, B.RESIDUAL))
        qkv_w = (p + "self_attn.qkv_proj.weight",) + ((p + "self_attn.qkv_proj.bias",) if config.attention_bias else ())
        raw += [(Opcode.RMS_NORM, layer, norm_in, norm_out, (p + "input_layernorm.weight",)),
                (Opcode.LINEAR, layer, (B.NORMED,), (B.QKV,), qkv_w),
                (Opcode.LINEAR, layer, (B.NORMED,), (B.GATE_UP,), (p + "mlp.gate_up_proj.weight",))]
        if config.qk_norm:
            raw.append((Opcode.QK_NORM, layer, (B.QKV,), (B.QKV,),
                        (p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight")))
        raw += [(Opcode.ROPE, layer, (B.QKV,), (B.QKV,), ()),
                (Opcode.KV_APPEND, layer, (B.QKV,), (kv,), ()),
                (Opcode.ATTN_DECODE, layer, (B.QKV, kv), (B.ATTN,), ()),
                (Opcode.SILU_MUL, layer, (B.GATE_UP,), (B.ACT,), ()),
                (Opcode.LINEAR, layer, (B.ATTN,), (B.HIDDEN,), (p + "self_attn.o_proj.weight",)),
                (Opcode.LINEAR, layer, (B.ACT,), (B.NORMED,), (p + "mlp.down_proj.weight",)),
                (Opcode.RMS_NORM, layer, (B.NORMED, B.RESIDUAL), (B.NORMED, B.RESIDUAL),
                 (p + "post_attention_layernorm.weight",))]
    lm_head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    raw += [(Opcode.RMS_NORM, -1, (B.HIDDEN, B.RESIDUAL), (B.NORMED, B.RESIDUAL), ("model.norm.weight",)),
            (Opcode.LINEAR, -1, (B.NORMED,), (B.LOGITS,), (lm_head,)),
            (Opcode.SAMPLE, -1, (B.LOGITS,), (B.TOKENS,), ())]
    return with_deps(raw)


def parallel_moe_program(config) -> list[Instruction]:
    """parallel_block_program with routed experts as the MLP of config.moe_layers:
    x += attn(norm(x)) + moe(norm(x)). ROUTER and MOE_EXPERTS depend on the norm only, so they
    move freely among the attention ops; the experts' output lands in HIDDEN (added by the next
    layer's norm), the attention output in NORMED (added by an in-place fused norm)."""
    B = Buffer
    dense = parallel_block_program(config)
    raw = [(dense[0].opcode, dense[0].layer, dense[0].reads, dense[0].writes, dense[0].weights)]
    for layer in range(config.num_hidden_layers):
        block = [(i.opcode, i.layer, i.reads, i.writes, i.weights) for i in dense if i.layer == layer]
        if layer not in config.moe_layers:
            raw += block
            continue
        p = f"model.layers.{layer}."
        for op, lay, reads, writes, weights in block:
            if weights == (p + "mlp.gate_up_proj.weight",):
                raw.append((Opcode.ROUTER, lay, (B.NORMED,), (B.ROUTE,), (p + "mlp.gate.weight",)))
            elif op == Opcode.SILU_MUL:
                continue
            elif weights == (p + "mlp.down_proj.weight",):
                raw.append((Opcode.MOE_EXPERTS, lay, (B.NORMED, B.ROUTE), (B.HIDDEN,),
                            (p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj")))
            elif weights == (p + "self_attn.o_proj.weight",):
                raw.append((op, lay, reads, (B.NORMED,), weights))
            else:
                raw.append((op, lay, reads, writes, weights))
        # the experts read NORMED, which o_proj now writes: they must come first in program order
        ex = next(i for i, r in enumerate(raw) if r[0] == Opcode.MOE_EXPERTS and r[1] == layer)
        o = next(i for i, r in enumerate(raw) if r[4] == (p + "self_attn.o_proj.weight",))
        if ex > o:
            raw.insert(o, raw.pop(ex))
    raw += [(i.opcode, i.layer, i.reads, i.writes, i.weights) for i in dense[-3:]]
    return with_deps(raw)


def random_topological_order(program: list[Instruction], seed: int) -> list[Instruction]:
    """The same ops in another order that respects every dep, deps renumbered."""
    rng = random.Random(seed)
    waiting = {i: set(ins.deps) for i, ins in enumerate(program)}
    order: list[int] = []
    while waiting:
        ready = sorted(i for i, d in waiting.items() if not d)
        pick = rng.choice(ready)
        order.append(pick)
        del waiting[pick]
        for d in waiting.values():
            d.discard(pick)
    new = {old: n for n, old in enumerate(order)}
    return [dataclasses.replace(program[i], deps=tuple(sorted(new[d] for d in program[i].deps))) for i in order]


def decode_inputs(r: ModelRunner, prompts) -> dict:
    tables = np.stack([np.arange(16 * i, 16 * (i + 1), dtype=np.int32) for i in range(len(prompts))])
    slots = lambda i, s, e: tables[i][np.arange(s, e) // BS] * BS + np.arange(s, e) % BS  # noqa: E731
    r.prefill([PrefillChunk(p, 0, tables[i], slots(i, 0, len(p))) for i, p in enumerate(prompts)])
    pos = np.array([len(p) for p in prompts], dtype=np.int64)
    return dict(tokens=np.array([p[-1] + 3 for p in prompts], dtype=np.int64), positions=pos, block_tables=tables,
                seq_lens=(pos + 1).astype(np.int32), slots=np.array([slots(i, n, n + 1)[0] for i, n in enumerate(pos)]))


def run_and_read(ex, r: ModelRunner, step: dict) -> dict:
    """One step; every activation buffer, the f32 logits, the sampled ids and the KV cache."""
    n = len(step["tokens"])
    logits, sampled = torch.empty(n, r.vocab_size), np.zeros(n, dtype=np.int64)
    t = step["block_tables"]
    ex.run(n, step["tokens"].ctypes.data, step["positions"].ctypes.data, t.ctypes.data, t.shape[1],
           step["seq_lens"].ctypes.data, step["slots"].ctypes.data, logits.data_ptr(), sampled.ctypes.data)
    out = {"logits": logits, "sampled": torch.from_numpy(sampled), "kv": r.kv.kv.clone()}
    for b in Buffer:
        buf = torch.empty(n, ex.width(int(b)), dtype=torch.int32 if b in (Buffer.TOKENS, Buffer.ROUTE) else r.dtype)
        ex.read_buffer(int(b), buf.data_ptr(), buf.numel() * buf.element_size())
        out[b.name] = buf
    return out


def run_each_order(r, step, orders: list[list[Instruction]], kv0: torch.Tensor) -> list[dict]:
    """Every buffer after one step of each program in orders, each from the cache kv0."""
    results = []
    for prog in orders:
        r.kv.kv.copy_(kv0)
        results.append(run_and_read(build_executor(r.config, r.weights, r.kv.kv, BS, r.inv_freq, program=prog),
                                    r, step))
    return results


def assert_identical(results: list[dict]) -> None:
    for got in results[1:]:
        for name, want in results[0].items():
            assert torch.equal(got[name], want), name


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_topological_order_gives_identical_buffers(arch, dtype):
    r = runner(arch, dtype)
    step = decode_inputs(r, [[5, 9, 13], list(range(20, 31)), [40]])
    program = parallel_block_program(r.config)
    orders = [program] + [random_topological_order(program, seed) for seed in (1, 2, 3)]
    assert all([i.opcode for i in o] != [i.opcode for i in program] for o in orders[1:])  # really reordered
    kv0 = r.kv.kv.clone()
    results = run_each_order(r, step, orders, kv0)
    assert results[0]["logits"].abs().max() > 0 and not torch.equal(results[0]["kv"], kv0)
    assert_identical(results)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_topological_order_of_a_moe_program_gives_identical_buffers(arch, dtype):
    # The MoE ops split across the executor's threads like LINEAR; reordering them among the
    # attention ops changes where the barriers fall, never a buffer.
    r = runner(arch, dtype)
    step = decode_inputs(r, [[5, 9, 13], list(range(20, 31)), [40], [7, 7, 7, 7]])
    program = parallel_moe_program(r.config)
    orders = [program] + [random_topological_order(program, seed) for seed in (1, 2, 3, 4)]
    position = [[i for i, ins in enumerate(o) if ins.opcode == Opcode.ROUTER] for o in orders]
    assert any(p != position[0] for p in position[1:])  # the routers really moved
    kv0 = r.kv.kv.clone()
    results = run_each_order(r, step, orders, kv0)
    assert results[0]["logits"].abs().max() > 0 and results[0]["ROUTE"].abs().max() > 0
    assert_identical(results)


def barriers_by_the_rule(program: list[Instruction]) -> int:
    """A barrier before op j iff a dep ran since the last barrier and the pair is not two ops
    that both run on thread 0 (everything but LINEAR, ROUTER and MOE_EXPERTS, which the team splits)."""
    split = [i.opcode in (Opcode.LINEAR, Opcode.ROUTER, Opcode.MOE_EXPERTS) for i in program]
    since, n = 0, 0
    for j, ins in enumerate(program):
        if any(d >= since and (split[d] or split[j]) for d in ins.deps):
            since, n = j, n + 1
    return n


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_barriers_only_where_a_dependency_crosses_threads(arch):
    r = runner(arch, torch.float32)
    parallel = parallel_moe_program if r.config.is_moe else parallel_block_program
    for prog in (schedule_for(r.config), parallel(r.config)):
        ex = build_executor(r.config, r.weights, r.kv.kv, BS, r.inv_freq, program=prog)
        assert ex.num_ops == len(prog)
        assert ex.num_barriers == barriers_by_the_rule(prog) < len(prog)
    # ROPE -> KV_APPEND -> ATTN_DECODE all run on thread 0: no barrier between them.
    prog = schedule_for(r.config)
    rope = next(j for j, i in enumerate(prog) if i.opcode == Opcode.ROPE)
    assert barriers_by_the_rule(prog[:rope + 3]) == barriers_by_the_rule(prog[:rope + 1])


def replace(program: list[Instruction], i: int, deps: tuple) -> list[Instruction]:
    ins = program[i]
    return program[:i] + [Instruction(ins.opcode, ins.layer, ins.reads, ins.writes, ins.weights, deps)] + program[i + 1:]


def test_bad_dependency_lists_are_refused_naming_the_op():
    r = runner("llama", torch.float32)
    prog = schedule_for(r.config)
    build = lambda p: build_executor(r.config, r.weights, r.kv.kv, BS, r.inv_freq, program=p)  # noqa: E731
    with pytest.raises(kog.InvalidRequest, match="op 5 depends on op 6, which is not an earlier op"):
        build(replace(prog, 5, (6,)))
    with pytest.raises(kog.InvalidRequest, match="op 5 depends on op 5,"):
        build(replace(prog, 5, (5,)))
    with pytest.raises(kog.InvalidRequest, match=f"op 3 depends on op {len(prog) + 7},"):
        build(replace(prog, 3, (len(prog) + 7,)))
    with pytest.raises(kog.InvalidRequest, match="op 3 depends on op -1,"):
        build(replace(prog, 3, (-1,)))
    ops = lower_program(prog, r.weights)  # lower() sorts deps; a raw Op may still list them out of order
    o = ops[4]
    ops[4] = _C.Op(o.opcode, o.layer, o.in_, o.residual, o.out, o.w0, o.w1, [3, 1])
    with pytest.raises(kog.InvalidRequest, match="op 4 lists its deps out of order"):
        _C.validate_program(ops, model_dims(r.config, torch.float32))
    with pytest.raises(kog.InvalidRequest, match="at most"):
        build(replace(prog, 12, tuple(range(_C.PROGRAM_MAX_DEPS + 1))))
