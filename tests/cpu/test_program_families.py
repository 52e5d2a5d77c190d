"""One program function per model family: the registry, what each family's program holds, and
the typed error for a model_type without one."""

import dataclasses

import pytest

import kog
from kog.program import FAMILIES, Buffer, Opcode, Rows, UnknownModelFamily, program_for
from kog.testing.tiny_models import tiny_config


def ops_of(program, opcode):
    return [ins for ins in program if ins.opcode == opcode]


def test_registry_covers_every_architecture_the_config_accepts():
    assert set(FAMILIES) == set(kog.config.ARCHITECTURES) == {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                                              "mixtral", "qwen2_moe", "laneformer_tp"}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_family_program_shape(arch):
    c = tiny_config(arch, num_hidden_layers=3)
    program = program_for(c)
    per_layer = 11 if arch == "qwen3" else 10
    assert len(program) == 1 + 3 * per_layer + 3
    assert len(ops_of(program, Opcode.ATTN_DECODE)) == 3
    assert len(ops_of(program, Opcode.QK_NORM)) == (3 if arch == "qwen3" else 0)
    qkv = [ins for ins in ops_of(program, Opcode.LINEAR) if ins.writes == (Buffer.QKV,)]
    assert all(len(ins.weights) == (2 if arch == "qwen2" else 1) for ins in qkv)  # qwen2: the q/k/v bias
    head = program[-2]
    assert head.weights == ("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight",)


def test_only_the_head_runs_over_the_sampled_rows():
    # Prefill computes logits of the chunks' last tokens only: the final norm, LM head and sample.
    program = program_for(tiny_config("llama"))
    assert [ins.rows for ins in program[-3:]] == [Rows.SAMPLED] * 3
    assert all(ins.rows == Rows.ALL for ins in program[:-3])
    assert [ins.opcode for ins in program[-3:]] == [Opcode.RMS_NORM, Opcode.LINEAR, Opcode.SAMPLE]


def test_switches_a_family_allows_come_from_the_config():
    untied_llama_with_bias = tiny_config("llama", attention_bias=True, tie_word_embeddings=False)
    program = program_for(untied_llama_with_bias)
    assert program[2].weights == ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.bias")
    assert program[-2].weights == ("lm_head.weight",)


def test_unknown_model_type_is_a_typed_error_naming_it():
    c = tiny_config("llama")
    object.__setattr__(c, "architecture", "deepseek_v3")  # ModelConfig itself refuses it at construction
    with pytest.raises(UnknownModelFamily, match="'deepseek_v3'") as e:
        program_for(c)
    assert isinstance(e.value, kog.errors.ModelLoadError)


@pytest.mark.parametrize("arch, qk_norm", [("llama", True), ("qwen3", False)])
def test_qk_norm_disagreeing_with_the_family_is_refused(arch, qk_norm):
    with pytest.raises(kog.errors.ModelLoadError, match="qk_norm"):
        program_for(dataclasses.replace(tiny_config(arch), qk_norm=qk_norm))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_family_program_routes_its_moe_layers_and_keeps_the_dense_ones(arch):
    # qwen3_moe's tiny config keeps layer 1 dense (mlp_only_layers); mixtral routes every layer.
    c = tiny_config(arch, num_hidden_layers=3)
    program = program_for(c)
    assert c.moe_layers == ((0, 2) if arch == "qwen3_moe" else (0, 1, 2))
    routers, experts = ops_of(program, Opcode.ROUTER), ops_of(program, Opcode.MOE_EXPERTS)
    assert [ins.layer for ins in routers] == [ins.layer for ins in experts] == list(c.moe_layers)
    dense = [ins.layer for ins in ops_of(program, Opcode.SILU_MUL)]
    assert dense == [n for n in range(3) if n not in c.moe_layers]
    assert len(ops_of(program, Opcode.QK_NORM)) == (3 if arch == "qwen3_moe" else 0)
    for r, e in zip(routers, experts):
        w = f"model.layers.{r.layer}.mlp."
        assert r.reads == (Buffer.NORMED,) and r.writes == (Buffer.ROUTE,) and r.weights == (w + "gate.weight",)
        assert e.reads == (Buffer.NORMED, Buffer.ROUTE) and e.writes == (Buffer.HIDDEN,)
        assert e.weights == (w + "experts.gate_up_proj", w + "experts.down_proj")
        # the experts wait for their router (ROUTE) and the norm before it (NORMED); the router for the norm
        norm = program.index(r) - 1
        assert program[norm].opcode == Opcode.RMS_NORM and norm in r.deps
        assert {program.index(r), norm} <= set(e.deps)
    # an MoE layer is a dense one with (LINEAR, SILU_MUL, LINEAR) replaced by (ROUTER, MOE_EXPERTS)
    moe_layer = {"qwen3_moe": 11 - 1, "mixtral": 10 - 1}[arch]
    assert len(program) == 1 + 3 * moe_layer + (3 - len(c.moe_layers)) + 3
