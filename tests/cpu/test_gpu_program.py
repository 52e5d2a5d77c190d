"""The GPU persistent kernel's program (kog._C.expand_gpu_program), on the CPU: it runs in every
build, so the program the GPU executes, its deps included, is checked here even without a GPU."""

import pytest
import torch

import kog
from kog import _C
from kog.models.decode import lower_program, model_dims, schedule_for
from kog.program import Buffer, Opcode
from kog.testing.programs import with_op
from kog.testing.tiny_models import random_weights, tiny_config
from kog.models.weights import prepare_weights


def lowered(arch: str):
    c = tiny_config(arch)
    w = prepare_weights(c, random_weights(c), torch.float32)
    return lower_program(schedule_for(c), w), model_dims(c, torch.float32), w


def fields(op) -> tuple:
    return (op.opcode, op.layer, op.in_, op.residual, op.out, op.w0, op.w1, op.w2)


def fused_fields(op, prev) -> tuple:
    """op's fields after fuse_residual_adds, the RMSNorm prologue and the SILU_MUL fusion, for
    the Llama-family programs: the LINEARs writing HIDDEN add into RESIDUAL, the LINEAR after an
    RMS_NORM reads RESIDUAL and normalizes it with the norm's weight (w2), the gate/up LINEAR
    writes ACT through its SiLU-mul epilogue. prev: the op before op in the program."""
    f = list(fields(op))
    if op.opcode == Opcode.LINEAR and op.out == Buffer.HIDDEN:
        f[3] = f[4] = int(Buffer.RESIDUAL)
    if op.opcode == Opcode.LINEAR and op.out == Buffer.GATE_UP:
        f[0], f[4] = _C.GPU_OP_LINEAR_SILU_MUL, int(Buffer.ACT)
    if op.opcode == Opcode.LINEAR and op.out == Buffer.LOGITS:  # the LM head: SAMPLE's first phase in its tails
        f[0] = _C.GPU_OP_LINEAR_SAMPLE_PARTIAL
    if op.opcode == Opcode.LINEAR and prev.opcode == Opcode.RMS_NORM:
        assert op.in_ == prev.out == Buffer.NORMED
        f[2], f[7] = int(Buffer.RESIDUAL), prev.w0
    return tuple(f)


def rope_kv_folded(ops, i) -> bool:
    """Whether op i is a ROPE or KV_APPEND that expand_gpu_program folds into the qkv LINEAR
    (the LINEAR, ROPE, KV_APPEND run of families without QK_NORM)."""
    o = ops[i]
    if o.opcode == Opcode.ROPE:
        return ops[i - 1].opcode == Opcode.LINEAR and i + 1 < len(ops) and ops[i + 1].opcode == Opcode.KV_APPEND
    if o.opcode == Opcode.KV_APPEND:
        return ops[i - 1].opcode == Opcode.ROPE and rope_kv_folded(ops, i - 1)
    return False


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_expanded_program_fuses_and_deps_follow_the_fusions(arch):
    ops, dims, _ = lowered(arch)
    out = _C.expand_gpu_program(ops, dims)
    folded = sum(rope_kv_folded(ops, i) for i in range(len(ops)))
    assert folded == (0 if arch == "qwen3" else 2 * dims.n_layers)  # QK_NORM needs whole heads: not fused
    norms = sum(o.opcode == Opcode.RMS_NORM for o in ops)
    assert norms == 2 * dims.n_layers + 1 and not any(o.opcode == Opcode.RMS_NORM for o in out)
    # - a SILU_MUL per layer - the folded ROPE / KV_APPEND - every RMS_NORM (in its consumer's
    # prologue); attention and the LM head keep one op each (their last item per group runs the
    # merge / the sample partial)
    assert len(out) == len(ops) - dims.n_layers - folded - norms
    new_index, produced, j = [], [], 0
    for i, op in enumerate(ops):  # the same order (residual adds, SILU_MULs fused)
        if op.opcode == Opcode.RMS_NORM:  # folded forward into the LINEAR right after it: lands at j
            assert ops[i + 1].opcode == Opcode.LINEAR and ops[i + 1].in_ == op.out
            new_index.append(j)
            produced.append(j)
            continue
        if op.opcode == Opcode.SILU_MUL:  # folded into the gate/up LINEAR just before it
            assert out[j - 1].opcode == _C.GPU_OP_LINEAR_SILU_MUL and ops[i - 1].out == op.in_ == Buffer.GATE_UP
            new_index.append(j - 1)
            produced.append(j - 1)
            continue
        if rope_kv_folded(ops, i):  # into the qkv LINEAR: its rows in RoPE pairs, the cache written
            fused = out[j - 1]
            assert fused.opcode == _C.GPU_OP_LINEAR_ROPE_KV and fused.out == Buffer.QKV
            if op.opcode == Opcode.KV_APPEND:
                assert fused.layer == op.layer
            new_index.append(j - 1)
            produced.append(j - 1)
            continue
        if op.opcode == Opcode.SAMPLE:  # its first phase in the tails of the LM head, which it waits for
            assert out[j - 1].opcode == _C.GPU_OP_LINEAR_SAMPLE_PARTIAL and out[j - 1].out == Buffer.LOGITS
            assert j - 1 in out[j].deps
        want = fused_fields(op, ops[i - 1])
        if i + 1 < len(ops) and rope_kv_folded(ops, i + 1):
            want = (_C.GPU_OP_LINEAR_ROPE_KV,) + want[1:]
        assert fields(out[j]) == want
        new_index.append(j)
        produced.append(j)
        if op.opcode == Opcode.ATTN_DECODE:
            assert (out[j].in_, out[j].out) == (Buffer.QKV, Buffer.ATTN)
        j += 1
    attentions = [k for k, o in enumerate(out) if o.opcode == Opcode.ATTN_DECODE]
    assert len(attentions) == dims.n_layers
    for i, op in enumerate(ops):
        if op.opcode in (Opcode.SILU_MUL, Opcode.RMS_NORM) or rope_kv_folded(ops, i):
            continue  # its deps are the fused op's, checked with the LINEAR
        want = {produced[d] for d in op.deps}
        if ops[i - 1].opcode == Opcode.RMS_NORM:  # the norm's deps instead of the norm
            want = {produced[d] for d in op.deps if d != i - 1} | {produced[d] for d in ops[i - 1].deps}
        if i + 1 < len(ops) and ops[i + 1].opcode == Opcode.SILU_MUL:
            want |= {produced[d] for d in ops[i + 1].deps if d != i}
        for f in (i + 1, i + 2):
            if f < len(ops) and rope_kv_folded(ops, f):
                want |= {produced[d] for d in ops[f].deps if d not in (i, i + 1)}
        earlier = [c for c in attentions if c < new_index[i]]
        if op.opcode == Opcode.ATTN_DECODE and earlier:  # the partials scratch: after the previous attention
            want.add(earlier[-1])
        got = set(out[new_index[i]].deps)
        if fused_fields(op, ops[i - 1])[3] != fields(op)[3] and op.opcode == Opcode.LINEAR:  # writes RESIDUAL too
            extra = got - want
            assert len(extra) <= 1 and all(Buffer.RESIDUAL in (out[d].in_, out[d].out) for d in extra), (i, op)
            got -= extra
        assert got == want, (i, op)
    assert out[-1].opcode == Opcode.SAMPLE
    assert _C.program_sinks(out) == [len(out) - 1]  # every op is an ancestor of SAMPLE


def run_program(program, dims, weights: dict, tokens, order) -> dict:
    """A float64 interpreter of a (GPU) program's buffer semantics, running ops in `order`.
    LINEAR, RMS_NORM (with or without a residual), EMBED, SILU_MUL and SAMPLE are exact; the
    attention-side ops are deterministic stand-ins over the same buffers (QK_NORM/ROPE rescale
    QKV in place, KV_APPEND copies it to the layer's cache, ATTN_DECODE reads QKV and that cache
    and writes ATTN); the LM head's sample tail copies LOGITS to "logits_out", which SAMPLE reads. What is checked is who reads and writes what."""
    import numpy as np

    w = {t.data_ptr(): t.double().numpy() for t in weights.values()}
    bufs, kv = {int(Buffer.TOKENS): np.asarray(tokens)}, {}
    split_sample = any(o.opcode == _C.GPU_OP_LINEAR_SAMPLE_PARTIAL for o in program)
    for i in order:
        o = program[i]
        x = bufs.get(o.in_)
        if o.w2:  # a GEMV's RMSNorm prologue: the folded RMS_NORM's math on its input
            x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w[o.w2]
        if o.opcode == Opcode.EMBED:
            bufs[o.out] = w[o.w0][x]
        elif o.opcode == Opcode.RMS_NORM:
            if o.residual >= 0:
                bufs[o.residual] = bufs[o.residual] + x
                x = bufs[o.residual]
            bufs[o.out] = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w[o.w0]
        elif o.opcode in (Opcode.LINEAR, _C.GPU_OP_LINEAR_SAMPLE_PARTIAL):
            y = x @ w[o.w0].T + (w[o.w1] if o.w1 else 0.0)
            bufs[o.out] = bufs[o.out] + y if o.residual >= 0 else y
            if o.opcode == _C.GPU_OP_LINEAR_SAMPLE_PARTIAL:
                bufs["logits_out"] = bufs[o.out].copy()
        elif o.opcode == _C.GPU_OP_LINEAR_ROPE_KV:  # the LINEAR into QKV, then ROPE's and KV_APPEND's stand-ins
            y = x @ w[o.w0].T + (w[o.w1] if o.w1 else 0.0)
            bufs[o.out] = y * 0.75 + 0.125 * int(Opcode.ROPE)
            kv[o.layer] = bufs[o.out].copy()
        elif o.opcode == _C.GPU_OP_LINEAR_SILU_MUL:  # the LINEAR into GATE_UP, then SILU_MUL, in one
            g, u = np.split(x @ w[o.w0].T + (w[o.w1] if o.w1 else 0.0), 2, axis=-1)
            bufs[o.out] = g / (1 + np.exp(-g)) * u
        elif o.opcode in (Opcode.QK_NORM, Opcode.ROPE):
            bufs[o.in_] = x * 0.75 + 0.125 * o.opcode
        elif o.opcode == Opcode.KV_APPEND:
            kv[o.layer] = x.copy()
        elif o.opcode == Opcode.ATTN_DECODE:
            width = dims.n_q_heads * dims.head_dim
            bufs[o.out] = np.tanh(x[:, :width] + kv[o.layer][:, -width:])
        elif o.opcode == Opcode.SILU_MUL:
            g, u = np.split(x, 2, axis=-1)
            bufs[o.out] = g / (1 + np.exp(-g)) * u
        elif o.opcode == Opcode.SAMPLE:
            bufs[o.out] = (bufs["logits_out"] if split_sample else x).argmax(-1)
    return bufs


def random_topological_order(program, rng) -> list[int]:
    """Ops in a random order that runs each after its deps and nothing else."""
    done, order, left = set(), [], list(range(len(program)))
    while left:
        ready = [i for i in left if set(program[i].deps) <= done]
        i = ready[rng.integers(len(ready))]
        order.append(i)
        done.add(i)
        left.remove(i)
    return order


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_residual_program_computes_what_the_program_does_in_any_dependency_order(arch):
    """The GPU program (residual adds fused into their LINEARs) leaves RESIDUAL and LOGITS exactly
    as the program does, also when its ops run in random orders its deps allow: the deps it adds
    (the LINEAR's wait on the last reader of RESIDUAL) are the ones the new writes need."""
    import numpy as np

    ops, dims, w = lowered(arch)
    gpu = _C.expand_gpu_program(ops, dims)
    assert not any(o.opcode == Opcode.RMS_NORM and o.residual >= 0 for o in gpu)  # every add was fused
    tokens = [3, 17]
    want = run_program(ops, dims, w, tokens, range(len(ops)))
    rng = np.random.default_rng(0)
    for _ in range(20):
        got = run_program(gpu, dims, w, tokens, random_topological_order(gpu, rng))
        for b in (Buffer.RESIDUAL, Buffer.LOGITS, Buffer.TOKENS):  # NORMED: only in the GEMV prologues now
            assert np.array_equal(got[int(b)], want[int(b)]), b


def test_a_dropped_dep_is_caught_by_the_order_test():
    """The order test can fail: without the gate/up GEMV's dep on the fused LINEAR that adds
    into RESIDUAL, some dependency order lets its norm prologue read RESIDUAL before the add."""
    import numpy as np

    ops, dims, w = lowered("llama")
    gpu = list(_C.expand_gpu_program(ops, dims))
    i = next(i for i, o in enumerate(gpu) if o.opcode == Opcode.LINEAR and o.residual >= 0)  # layer 0's o_proj
    n = next(k for k in range(i + 1, len(gpu)) if gpu[k].in_ == Buffer.RESIDUAL)  # the GEMV normalizing it
    o = gpu[n]
    assert o.w2 and i in o.deps
    gpu[n] = _C.Op(opcode=o.opcode, layer=o.layer, in_=o.in_, residual=o.residual, out=o.out, w0=o.w0, w1=o.w1,
                   deps=[d for d in o.deps if d != i], w2=o.w2)
    want = run_program(ops, dims, w, [3, 17], range(len(ops)))
    rng = np.random.default_rng(0)
    differs = 0
    for _ in range(50):
        got = run_program(gpu, dims, w, [3, 17], random_topological_order(gpu, rng))
        differs += not np.array_equal(got[int(Buffer.LOGITS)], want[int(Buffer.LOGITS)])
    assert differs > 0


def test_bad_programs_are_refused_naming_the_op():
    ops, dims, _ = lowered("llama")

    with pytest.raises(kog.InvalidRequest, match="op 3 has opcode 42"):
        _C.expand_gpu_program(with_op(ops, 3, opcode=42), dims)
    i = next(i for i, o in enumerate(ops) if o.opcode == Opcode.LINEAR)
    with pytest.raises(kog.InvalidRequest, match=f"op {i} has no weight"):
        _C.expand_gpu_program(with_op(ops, i, w0=0, w1=0), dims)
    with pytest.raises(kog.InvalidRequest, match="SAMPLE"):
        _C.expand_gpu_program(ops[:-1], dims)
    last = len(ops) - 1  # SAMPLE no longer waiting for the LM head: its tails could not feed it
    with pytest.raises(kog.InvalidRequest, match=f"op {last} \\(SAMPLE\\) must read the output of a LINEAR it depends on"):
        _C.expand_gpu_program(with_op(ops, last, deps=[d for d in ops[last].deps if d != last - 1]), dims)
    j = next(i for i, o in enumerate(ops) if o.opcode == Opcode.KV_APPEND)
    with pytest.raises(kog.InvalidRequest, match=f"op {j} names layer"):
        _C.expand_gpu_program(with_op(ops, j, layer=dims.n_layers + 3), dims)
    q = next(i for i, o in enumerate(ops) if o.opcode == Opcode.ROPE)
    with pytest.raises(kog.InvalidRequest, match=f"op {q} needs a layer"):  # one validator: same rule on both backends
        _C.validate_program(with_op(ops, q, opcode=int(Opcode.QK_NORM), layer=-1, w0=ops[0].w0, w1=ops[0].w0), dims)
    with pytest.raises(kog.InvalidRequest, match="no ops"):
        _C.expand_gpu_program([], dims)


@pytest.mark.skipif(_C.has_gpu_backend, reason="checks the CPU build's refusal")
def test_gpu_decoder_needs_a_gpu_build():
    from kog.models.gpu_decode import GpuDecoder

    c = tiny_config("llama")
    with pytest.raises(kog.BackendError, match="GPU build"):
        GpuDecoder(c, {}, torch.zeros(1), 16, torch.ones(8))


def test_sampling_row_dtype_is_the_cpp_struct():
    import numpy as np

    from kog.models.gpu_decode import SAMPLING_ROW, SAMPLING_ROW_FORMATS

    layout = _C.SAMPLING_ROW_LAYOUT
    assert SAMPLING_ROW.itemsize == layout["itemsize"]
    assert list(SAMPLING_ROW.names) == list(layout["fields"]) == list(SAMPLING_ROW_FORMATS)
    for name, (offset, size) in layout["fields"].items():
        dt, off = SAMPLING_ROW.fields[name][:2]
        assert (off, dt.itemsize) == (offset, size), name
    # A row written through the numpy dtype reads back field by field at the C++ offsets.
    row = np.zeros(1, dtype=SAMPLING_ROW)
    row[0] = (0.5, 7, 0.9, 0.05, 2**40 + 3)
    raw = row.view(np.uint8)
    seed_off = layout["fields"]["seed"][0]
    assert int.from_bytes(raw[seed_off:seed_off + 8].tobytes(), "little") == 2**40 + 3
