"""The decode instruction schedule: C++/Python numbering agree, structure, dependency soundness."""

import itertools

import pytest

from kog import _C
from kog.program import Buffer, Opcode, DecoderSpec, decoder_program


def test_python_enums_mirror_the_cpp_header():
    assert {op.name: int(op) for op in Opcode} == dict(_C.SCHEDULE_OPCODES)
    assert len(Opcode) == _C.SCHEDULE_NUM_OPCODES
    assert {b.name: int(b) for b in Buffer} == dict(_C.SCHEDULE_BUFFERS)
    assert len(Buffer) == _C.SCHEDULE_NUM_BUFFERS


@pytest.mark.parametrize("qk_norm, per_layer", [(False, 10), (True, 11)])
def test_shape_of_the_schedule(qk_norm, per_layer):
    sched = decoder_program(DecoderSpec(n_layers=3, qk_norm=qk_norm))
    assert len(sched) == 1 + 3 * per_layer + 3
    assert sched[0].opcode == Opcode.EMBED and sched[-1].opcode == Opcode.SAMPLE
    assert [i.opcode for i in sched[-3:]] == [Opcode.RMS_NORM, Opcode.LINEAR, Opcode.SAMPLE]
    assert sum(i.opcode == Opcode.ATTN_DECODE for i in sched) == 3
    assert sum(i.opcode == Opcode.QK_NORM for i in sched) == (3 if qk_norm else 0)
    assert all(i.layer == 1 for i in sched[1 + per_layer : 1 + 2 * per_layer])


def test_weights_named_per_layer_and_tied_head():
    untied = decoder_program(DecoderSpec(n_layers=2, qkv_bias=True))
    tied = decoder_program(DecoderSpec(n_layers=2, tie_word_embeddings=True))
    assert untied[-2].weights == ("lm_head.weight",)
    assert tied[-2].weights == ("model.embed_tokens.weight",)
    qkv = [i for i in untied if i.opcode == Opcode.LINEAR and i.writes == (Buffer.QKV,)]
    assert qkv[1].weights == ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.qkv_proj.bias")


def transitive_deps(sched):
    closure = []
    for ins in sched:
        s = set(ins.deps)
        for d in ins.deps:
            s |= closure[d]
        closure.append(s)
    return closure


@pytest.mark.parametrize("spec", [DecoderSpec(n_layers=1), DecoderSpec(n_layers=4, qk_norm=True, qkv_bias=True)])
def test_every_conflicting_pair_is_ordered_by_dependencies(spec):
    # Two instructions conflict when one writes what the other reads or writes. For any parallel
    # executor honouring deps to match the sequential order, the later one of every conflicting
    # pair must (transitively) depend on the earlier one.
    sched = decoder_program(spec)
    closure = transitive_deps(sched)
    for i, j in itertools.combinations(range(len(sched)), 2):
        a, b = sched[i], sched[j]
        conflict = set(a.writes) & set(b.reads + b.writes) or set(a.reads) & set(b.writes)
        if conflict:
            assert i in closure[j], (i, a.opcode.name, j, b.opcode.name, conflict)
    for j, ins in enumerate(sched):
        assert all(d < j for d in ins.deps)


def test_attention_waits_for_its_layers_kv_append():
    sched = decoder_program(DecoderSpec(n_layers=2))
    appends = {i.layer: n for n, i in enumerate(sched) if i.opcode == Opcode.KV_APPEND}
    for n, ins in enumerate(sched):
        if ins.opcode == Opcode.ATTN_DECODE:
            assert appends[ins.layer] in ins.deps


def test_bad_spec():
    with pytest.raises(ValueError, match="n_layers"):
        decoder_program(DecoderSpec(n_layers=0))


def test_dtype_codes_are_the_ones_cpp_exports():
    import torch

    from kog.ops import DTYPE_CODE

    assert {str(t).removeprefix("torch."): code for t, code in DTYPE_CODE.items()} == dict(_C.DTYPE_CODES)
    assert {torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64} <= set(DTYPE_CODE)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_model_dims_come_from_the_config(arch):
    import torch

    import kog
    from kog.models.decode import ROPE_NEOX, model_dims
    from kog.ops import DTYPE_CODE
    from kog.testing.tiny_models import tiny_config

    c = tiny_config(arch)
    d = model_dims(c, torch.bfloat16)
    assert (d.n_layers, d.hidden, d.n_q_heads, d.n_kv_heads, d.head_dim, d.intermediate, d.vocab) == (
        c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
        c.intermediate_size, c.vocab_size)
    assert d.rope_neox == ROPE_NEOX[arch] and d.dtype == DTYPE_CODE[torch.bfloat16]
    assert d.buffer_width(Buffer.QKV) == (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    assert d.buffer_width(Buffer.LOGITS) == c.vocab_size and d.buffer_width(Buffer.TOKENS) == 1
    fields = dict(n_layers=2, hidden=64, n_q_heads=4, n_kv_heads=3, head_dim=16, intermediate=128, vocab=99,
                  rotary_dim=16, rms_eps=1e-6, attn_scale=0.25, rope_neox=True, dtype=0)
    with pytest.raises(kog.InvalidRequest, match="3 kv heads do not divide 4 query heads"):
        _C.ModelDims(**fields)
    with pytest.raises(kog.InvalidRequest, match="rotary_dim 18"):
        _C.ModelDims(**(fields | dict(n_kv_heads=2, rotary_dim=18)))
    with pytest.raises(kog.InvalidRequest, match="float type"):
        model_dims(c, torch.int32)
