"""One function per model family: the family's program, built from its config.

    program = program_for(config)   # config.architecture is the HF model_type

The program is the single description of the model: the CPU decode executor, the GPU
persistent kernel and prefill (kog.program.interpreter) all run what these functions emit. A
new family is a new function here plus its entry in FAMILIES; a new kind of layer is a new
block in kog.program.decoder.
"""

from __future__ import annotations

from typing import Callable

from kog.config import ModelConfig
from kog.errors import ModelLoadError
from kog.program.decoder import DecoderSpec, decoder_program
from kog.program.lanes import laneformer_program
from kog.program.program import Instruction

FamilyFunction = Callable[[ModelConfig], list[Instruction]]


class UnknownModelFamily(ModelLoadError):
    """No program function is registered for the config's model_type."""


def llama(config: ModelConfig) -> list[Instruction]:
    """Llama: pre-norm GQA attention (RoPE) and a SwiGLU MLP; some checkpoints bias q/k/v."""
    _check_qk_norm(config, False)
    return decoder_program(DecoderSpec(config.num_hidden_layers, qkv_bias=config.attention_bias,
                                       tie_word_embeddings=config.tie_word_embeddings, **_lanes(config)))


def mistral(config: ModelConfig) -> list[Instruction]:
    """Mistral: Llama's layers, every one attending through config.sliding_window (when set: each
    token sees its last sliding_window positions, HF's mask)."""
    _check_qk_norm(config, False)
    return decoder_program(DecoderSpec(config.num_hidden_layers, qkv_bias=config.attention_bias,
                                       tie_word_embeddings=config.tie_word_embeddings,
                                       window=config.sliding_window or 0, **_lanes(config)))


def qwen2(config: ModelConfig) -> list[Instruction]:
    """Qwen2: Llama's layers with a bias on the q/k/v projections (config.attention_bias,
    which defaults to true for qwen2)."""
    _check_qk_norm(config, False)
    return decoder_program(DecoderSpec(config.num_hidden_layers, qkv_bias=config.attention_bias,
                                       tie_word_embeddings=config.tie_word_embeddings, **_lanes(config)))


def qwen3(config: ModelConfig) -> list[Instruction]:
    """Qwen3: Llama's layers with an RMSNorm on every head of q and k before RoPE."""
    _check_qk_norm(config, True)
    return decoder_program(DecoderSpec(config.num_hidden_layers, qk_norm=True, qkv_bias=config.attention_bias,
                                       tie_word_embeddings=config.tie_word_embeddings, **_lanes(config)))


def qwen3_moe(config: ModelConfig) -> list[Instruction]:
    """Qwen3-MoE: Qwen3's attention (q/k norm); the MLP of config.moe_layers is routed experts
    (top-k of a softmax router, renormalized with norm_topk_prob), the others stay dense."""
    _check_qk_norm(config, True)
    return decoder_program(DecoderSpec(config.num_hidden_layers, qk_norm=True, qkv_bias=config.attention_bias,
                                       tie_word_embeddings=config.tie_word_embeddings,
                                       moe_layers=config.moe_layers, **_lanes(config)))


def mixtral(config: ModelConfig) -> list[Instruction]:
    """Mixtral: Mistral's attention (its sliding window too); every MLP is routed experts, weights
    renormalized over the chosen ones (a softmax over the top-k logits)."""
    _check_qk_norm(config, False)
    return decoder_program(DecoderSpec(config.num_hidden_layers, qkv_bias=config.attention_bias,
                                       tie_word_embeddings=config.tie_word_embeddings,
                                       moe_layers=config.moe_layers, window=config.sliding_window or 0,
                                       **_lanes(config)))


def qwen2_moe(config: ModelConfig) -> list[Instruction]:
    """Qwen2-MoE: Qwen2's attention (q/k/v bias); sparse layers as qwen3_moe's, plus a shared
    expert every token runs, weighted by sigmoid(x @ shared_expert_gate): the same two MoE ops,
    the shared expert being always-on slots of ROUTE (kog.models.weights)."""
    _check_qk_norm(config, False)
    return decoder_program(DecoderSpec(config.num_hidden_layers, qkv_bias=config.attention_bias,
                                       tie_word_embeddings=config.tie_word_embeddings,
                                       moe_layers=config.moe_layers, **_lanes(config)))


def laneformer_tp(config: ModelConfig) -> list[Instruction]:
    """Laneformer: Llama-like layers over config.lanes.num_lanes residual streams, combined after
    each block by a lane reduction, possibly delayed (kog.program.lanes, kog.lane_config)."""
    _check_qk_norm(config, False)
    return laneformer_program(config)


# Families whose program applies config.sliding_window itself (Op.window); ModelRunner caps the
# others' sequences at a configured window, where full and windowed attention agree.
WINDOWED: frozenset[str] = frozenset({"mistral", "mixtral", "laneformer_tp"})

# HF model_type -> the family's program function.
FAMILIES: dict[str, FamilyFunction] = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3,
                                       "qwen3_moe": qwen3_moe, "mixtral": mixtral, "qwen2_moe": qwen2_moe,
                                       "laneformer_tp": laneformer_tp}


# RoPE pairing of each family's checkpoints as Kog loads them: rotate_half, i.e. dims (i, i + R/2)
# (HF Llama, Mistral and Qwen; GGUF llama weights are permuted back to it on load).
ROPE_NEOX: dict[str, bool] = {"llama": True, "mistral": True, "qwen2": True, "qwen3": True, "qwen3_moe": True,
                              "mixtral": True, "qwen2_moe": True,
                              "laneformer_tp": False}  # Laneformer: interleaved pairs (2i, 2i + 1), as trained


def program_for(config: ModelConfig) -> list[Instruction]:
    """The program of config's family.

    Raises:
        UnknownModelFamily: config.architecture has no registered family function.
    """
    family = FAMILIES.get(config.architecture)
    if family is None:
        raise UnknownModelFamily(f"no model program for model_type {config.architecture!r}; "
                                 f"Kog has programs for {sorted(FAMILIES)}")
    return family(config)


def _lanes(config: ModelConfig) -> dict:
    """DecoderSpec's lane fields: a dense family's tensor-parallel lane form, if config has one."""
    from kog.program.lanes import splits_replicated_head

    return {} if config.lanes is None else dict(lanes=config.lanes, sharded=config.shard.size > 1,
                                                split_head=splits_replicated_head(config))


def _check_qk_norm(config: ModelConfig, family_has_it: bool) -> None:
    # The prepared weights follow config.qk_norm (kog.models.weights): it must agree with the program.
    if config.qk_norm != family_has_it:
        raise ModelLoadError(f"model_type {config.architecture!r} {'has' if family_has_it else 'has no'} "
                             f"q/k norm, but the config says qk_norm={config.qk_norm}")
