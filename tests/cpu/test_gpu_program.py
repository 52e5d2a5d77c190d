"""The GPU persistent kernel's program builder (kog._C.expand_gpu_program), on the CPU: it runs
in every build, so the schedule the GPU executes is checked here even without a GPU."""

import pytest
import torch

import kog
from kog import _C
from kog.models.decode import resolve, schedule_for
from kog.program import Buffer, Opcode
from kog.testing.tiny_models import random_weights, tiny_config
from kog.models.weights import prepare_weights


def raw_program(arch: str) -> tuple[list[tuple], int]:
    c = tiny_config(arch)
    w = prepare_weights(c, random_weights(c), torch.float32)
    return [resolve(ins, w) for ins in schedule_for(c)], c.num_hidden_layers


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_attention_gets_a_combine_phase_and_nothing_else_changes(arch):
    raw, n_layers = raw_program(arch)
    out = _C.expand_gpu_program(raw, n_layers)
    assert len(out) == len(raw) + n_layers
    it = iter(out)
    for op in raw:
        assert next(it) == op
        if op[0] == Opcode.ATTN_DECODE:
            combine = next(it)
            assert combine[0] == _C.GPU_OP_ATTN_COMBINE
            assert combine[1:5] == op[1:5]  # same layer and buffers: reads QKV, writes ATTN
            assert (combine[2], combine[4]) == (Buffer.QKV, Buffer.ATTN)
    assert out[-1][0] == Opcode.SAMPLE


def test_bad_programs_are_refused_naming_the_op():
    raw, n = raw_program("llama")
    bad_op = list(raw)
    bad_op[3] = (42,) + bad_op[3][1:]
    with pytest.raises(kog.InvalidRequest, match="op 3"):
        _C.expand_gpu_program(bad_op, n)
    no_weight = list(raw)
    i = next(i for i, r in enumerate(raw) if r[0] == Opcode.LINEAR)
    no_weight[i] = raw[i][:5] + (0, 0)
    with pytest.raises(kog.InvalidRequest, match=f"op {i} has no weight"):
        _C.expand_gpu_program(no_weight, n)
    with pytest.raises(kog.InvalidRequest, match="SAMPLE"):
        _C.expand_gpu_program(raw[:-1], n)
    bad_layer = list(raw)
    j = next(i for i, r in enumerate(raw) if r[0] == Opcode.KV_APPEND)
    bad_layer[j] = (raw[j][0], n + 3) + raw[j][2:]
    with pytest.raises(kog.InvalidRequest, match="layer"):
        _C.expand_gpu_program(bad_layer, n)
    with pytest.raises(kog.InvalidRequest, match="no ops"):
        _C.expand_gpu_program([], n)


@pytest.mark.skipif(_C.has_gpu_backend, reason="checks the CPU build's refusal")
def test_gpu_decoder_needs_a_gpu_build():
    from kog.models.gpu_decode import GpuDecoder

    c = tiny_config("llama")
    with pytest.raises(kog.BackendError, match="GPU build"):
        GpuDecoder(c, {}, torch.zeros(1), 16, torch.ones(8))


def test_sampling_row_layout_matches_the_kernel_struct():
    from kog.models.gpu_decode import SAMPLING_ROW

    # csrc/gpu/decode/params.h SamplingRow: f32, i32, f32, f32, u64 -> 24 bytes, seed at 16.
    assert SAMPLING_ROW.itemsize == 24 and SAMPLING_ROW.fields["seed"][1] == 16
