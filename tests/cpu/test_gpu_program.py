"""The GPU persistent kernel's program (kog._C.expand_gpu_program), on the CPU: it runs in every
build, so the program the GPU executes, its deps included, is checked here even without a GPU."""

import pytest
import torch

import kog
from kog import _C
from kog.models.decode import lower_program, model_dims, schedule_for
from kog.program import Buffer, Opcode
from kog.testing.tiny_models import random_weights, tiny_config
from kog.models.weights import prepare_weights


def lowered(arch: str):
    c = tiny_config(arch)
    w = prepare_weights(c, random_weights(c), torch.float32)
    return lower_program(schedule_for(c), w), model_dims(c, torch.float32), w


def fields(op) -> tuple:
    return (op.opcode, op.layer, op.in_, op.residual, op.out, op.w0, op.w1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_attention_gets_a_combine_phase_and_deps_follow_it(arch):
    ops, dims, _ = lowered(arch)
    out = _C.expand_gpu_program(ops, dims)
    assert len(out) == len(ops) + dims.n_layers
    new_index, produced, j = [], [], 0
    for op in ops:  # the same ops in the same order, a combine after each attention
        assert fields(out[j]) == fields(op)
        new_index.append(j)
        produced.append(j)
        if op.opcode == Opcode.ATTN_DECODE:
            combine = out[j + 1]
            assert combine.opcode == _C.GPU_OP_ATTN_COMBINE
            assert fields(combine)[1:5] == fields(op)[1:5]  # same layer and buffers: reads QKV, writes ATTN
            assert (combine.in_, combine.out) == (Buffer.QKV, Buffer.ATTN)
            assert combine.deps == [j]
            produced[-1] = j + 1
            j += 1
        j += 1
    combines = [k for k, o in enumerate(out) if o.opcode == _C.GPU_OP_ATTN_COMBINE]
    for i, op in enumerate(ops):
        want = {produced[d] for d in op.deps}
        earlier = [c for c in combines if c < new_index[i]]
        if op.opcode == Opcode.ATTN_DECODE and earlier:  # the partials scratch: after the previous combine
            want.add(earlier[-1])
        assert out[new_index[i]].deps == sorted(want), (i, op)
    assert out[-1].opcode == Opcode.SAMPLE
    assert _C.program_sinks(out) == [len(out) - 1]  # every op is an ancestor of SAMPLE


def test_bad_programs_are_refused_naming_the_op():
    ops, dims, _ = lowered("llama")

    def with_op(i, **kw):
        o = ops[i]
        a = dict(opcode=o.opcode, layer=o.layer, in_=o.in_, residual=o.residual, out=o.out, w0=o.w0, w1=o.w1,
                 deps=o.deps) | kw
        return ops[:i] + [_C.Op(**a)] + ops[i + 1:]

    with pytest.raises(kog.InvalidRequest, match="op 3 has opcode 42"):
        _C.expand_gpu_program(with_op(3, opcode=42), dims)
    i = next(i for i, o in enumerate(ops) if o.opcode == Opcode.LINEAR)
    with pytest.raises(kog.InvalidRequest, match=f"op {i} has no weight"):
        _C.expand_gpu_program(with_op(i, w0=0, w1=0), dims)
    with pytest.raises(kog.InvalidRequest, match="SAMPLE"):
        _C.expand_gpu_program(ops[:-1], dims)
    j = next(i for i, o in enumerate(ops) if o.opcode == Opcode.KV_APPEND)
    with pytest.raises(kog.InvalidRequest, match=f"op {j} names layer"):
        _C.expand_gpu_program(with_op(j, layer=dims.n_layers + 3), dims)
    q = next(i for i, o in enumerate(ops) if o.opcode == Opcode.ROPE)
    with pytest.raises(kog.InvalidRequest, match=f"op {q} needs a layer"):  # one validator: same rule on both backends
        _C.validate_program(with_op(q, opcode=int(Opcode.QK_NORM), layer=-1, w0=ops[0].w0, w1=ops[0].w0), dims)
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
