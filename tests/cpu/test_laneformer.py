"""Laneformer (HF `laneformer_tp`) through Kog against a plain-torch reference written here.

The reference follows the published LaneformerTP modeling code's semantics: per-lane residual
streams, lane projections (einsum over [L, out/L, in] / [L, out, in/L] weights), interleaved-pair
RoPE, causal GQA, the three lane reductions chosen per layer from use_comm / use_early_comm /
broadcast_delay, and the four final head layouts. Tiny checkpoints are written in the exact HF
key layout and loaded through kog.LLM like any model folder.
"""

import math

import numpy as np
import pytest
import torch

import kog
from kog.errors import ModelLoadError
from kog.lane_config import LaneConfig
from kog.loader import LoadedModel
from kog.models import ModelRunner, PrefillChunk
from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

VOCAB = 400  # a multiple of 4 lanes (vocab_parallel)


def lane_model_config(n_layers: int = 4, **lanes) -> kog.config.ModelConfig:
    """hidden 128, 8 query heads over 4 KV heads (head_dim 16), ffn 256: up to 4 lanes."""
    return tiny_config("laneformer_tp", vocab_size=VOCAB, hidden_size=128, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=16, intermediate_size=256, num_hidden_layers=n_layers,
                       tie_word_embeddings=lanes.pop("tie", False), sliding_window=lanes.pop("sliding_window", None),
                       lanes=LaneConfig(**lanes))


def reference_logits(config, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """[T, vocab] logits of the whole sequence, fp32, no cache."""
    c = config.lanes
    L, h, H, KV = c.num_lanes, config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    d, n, D, eps, T = h // H, config.num_hidden_layers, c.broadcast_delay, config.rms_norm_eps, len(ids)

    def rms(x, prefix):  # x [T, L, h]; weight [h] or scale [L, h]
        wt = w.get(prefix + ".weight", w.get(prefix + ".scale"))
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wt

    def lane_proj(x, wt):  # x [T, L, i], wt [L, o, i] -> [T, L, o]
        return torch.einsum("tli,loi->tlo", x, wt)

    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(T).float()[:, None] * inv[None]  # [T, d/2]

    def rope(x):  # [T, heads, d], pairs (2i, 2i + 1)
        x2 = x.view(T, -1, d // 2, 2)
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        a, b = x2[..., 0], x2[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).view(T, -1, d)

    def mode(i):  # LaneformerTPModel's choice of reduce mode per layer
        early = "present" if c.use_early_comm else "none"
        if not c.use_comm:
            return early if i < D else "none"
        return early if i < D else "past"

    def reduce(a, i, past):
        m = mode(i)
        if m == "none":
            return a * math.sqrt(L)
        if m == "present":
            return a.sum(1, keepdim=True)
        p = past[i - D] if D > 0 else a  # delay 0: the past of layer i is its present
        return a + (p.sum(1, keepdim=True) - p)

    causal = torch.full((T, T), float("-inf")).triu(1)
    # the reference's mask choice: unclamped layers full; the first sliding_window_n_layers (or,
    # negative, the last) windowed: key j visible from query t iff t - window < j <= t
    windowed = causal.masked_fill(torch.arange(T)[None, :] <= torch.arange(T)[:, None] - (config.sliding_window or 0),
                                  float("-inf"))

    def mask(i):
        sw = c.sliding_window_n_layers
        if config.sliding_window is None or i in c.unclamped_layers or not (i < sw or i >= n + sw):
            return causal
        return windowed
    x = w["model.tok_embeddings.weight"][ids][:, None, :].expand(T, L, h)
    past_attn, past_mlp = [], []
    for i in range(n):
        p = f"model.layers.{i}."
        hn = rms(x, p + "attention_norm")
        q = rope(lane_proj(hn, w[p + "attention.wq.weight"]).reshape(T, H, d))
        k = rope(lane_proj(hn, w[p + "attention.wk.weight"]).reshape(T, KV, d))
        v = lane_proj(hn, w[p + "attention.wv.weight"]).reshape(T, KV, d)
        k, v = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
        scores = torch.einsum("thd,shd->hts", q, k) * d ** -0.5 + mask(i)
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, L, H * d // L)
        a = lane_proj(o, w[p + "attention.wo.weight"])
        past_attn.append(a)
        x = x + reduce(a, i, past_attn)
        hn = rms(x, p + "ffn_norm")
        g, u = lane_proj(hn, w[p + "feed_forward.w1.weight"]), lane_proj(hn, w[p + "feed_forward.w3.weight"])
        m = lane_proj(torch.nn.functional.silu(g) * u, w[p + "feed_forward.w2.weight"])
        past_mlp.append(m)
        x = x + reduce(m, i, past_mlp)
    head = w["model.tok_embeddings.weight"] if config.tie_word_embeddings else w.get("lm_head.weight")
    if c.pre_norm_lane_agg:
        return rms(x.sum(1, keepdim=True), "model.norm")[:, 0] @ head.T
    x = rms(x, "model.norm")
    if c.lm_head_type == "replicate":
        return x.mean(1) @ head.T
    if c.lm_head_type == "lane":
        return x.reshape(T, L * h) @ w["lm_head.linear.weight"].T
    return lane_proj(x, head).reshape(T, -1)  # vocab_parallel: head [L, V/L, h]


VARIANTS = {
    "delay1": dict(num_lanes=2, broadcast_delay=1),
    "delay2_4lanes_lane_scale_lane_head": dict(num_lanes=4, broadcast_delay=2, replicated_rmsn_scale=False,
                                               lm_head_type="lane"),
    "no_comm": dict(num_lanes=2, broadcast_delay=1, use_comm=False),
    "no_early_comm": dict(num_lanes=2, broadcast_delay=2, use_early_comm=False),
    "no_comm_no_early": dict(num_lanes=4, broadcast_delay=1, use_comm=False, use_early_comm=False),
    "pre_norm_agg": dict(num_lanes=2, broadcast_delay=1, pre_norm_lane_agg=True, replicated_rmsn_scale=False),
    "vocab_parallel": dict(num_lanes=4, broadcast_delay=1, lm_head_type="vocab_parallel"),
    "delay0_tied": dict(num_lanes=2, broadcast_delay=0, tie=True),
    "one_lane": dict(num_lanes=1, broadcast_delay=1),
    "window_first_layers": dict(num_lanes=2, broadcast_delay=1, sliding_window=8, sliding_window_n_layers=2),
    "window_last_layers_one_unclamped": dict(num_lanes=2, broadcast_delay=1, sliding_window=5,
                                             sliding_window_n_layers=-2, unclamped_layers=(3,)),
}


def runner(config, weights, dtype=torch.float32, blocks=64):
    m = LoadedModel(path=None, config=config, weights={k: v.to(dtype) for k, v in weights.items()}, dtype=dtype,
                    tokenizer=None, chat_template=None, stop_token_ids=())
    return ModelRunner(m, num_kv_blocks=blocks, block_size=16)


def test_windowed_layers_follow_the_reference_mask_choice():
    from kog.program import Opcode, program_for

    config = lane_model_config(**VARIANTS["window_last_layers_one_unclamped"])
    windows = [ins.window for ins in program_for(config) if ins.opcode == Opcode.ATTN_DECODE]
    assert windows == [0, 0, 5, 0]
    assert runner(config, random_weights(config)).max_model_len == config.max_position_embeddings  # no cap


def test_reduce_modes_follow_the_reference_layer_choice():
    c = LaneConfig(num_lanes=2, broadcast_delay=2)
    assert [c.reduce_mode(i) for i in range(4)] == ["sum", "sum", "past", "past"]
    assert [LaneConfig(2, 2, use_early_comm=False).reduce_mode(i) for i in range(4)] == ["scale", "scale", "past",
                                                                                         "past"]
    assert [LaneConfig(2, 1, use_comm=False).reduce_mode(i) for i in range(3)] == ["sum", "scale", "scale"]
    assert [LaneConfig(2, 0).reduce_mode(i) for i in range(2)] == ["sum", "sum"]
    # layer 1's outputs are kept for layer 3 (delay 2), layer 2's and 3's for nobody (4 layers)
    assert [c.keeps_output(i, 4) for i in range(4)] == [True, True, False, False]


def test_program_gathers_once_and_each_delayed_reduction_waits_for_exactly_its_gather():
    from kog.program import Opcode, program_for

    config = lane_model_config(n_layers=5, num_lanes=2, broadcast_delay=2)
    program = program_for(config)
    gathers = {ins.writes[0]: i for i, ins in enumerate(program) if ins.opcode == Opcode.LANE_GATHER}
    adds = [(i, ins) for i, ins in enumerate(program) if ins.opcode == Opcode.LANE_ADD_PAST]
    # layers 0-2 keep their attention and MLP outputs for layers 2-4; 3 slots per kind, reused
    assert len(gathers) == 6 and len(adds) == 6 and [ins.layer for _, ins in adds] == [2, 2, 3, 3, 4, 4]
    for i, ins in adds:
        slot = ins.reads[1]
        writer = max(j for j, g in enumerate(program[:i]) if g.opcode == Opcode.LANE_GATHER and g.writes[0] == slot)
        assert program[writer].layer == ins.layer - 2 and writer in ins.deps
        # nothing else of layer - 2 .. layer - 1 is a direct dependency besides HIDDEN's producer
        assert all(program[d].layer == ins.layer or d == writer for d in ins.deps)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_and_decode_match_the_reference(variant):
    config = lane_model_config(**VARIANTS[variant])
    w = random_weights(config, seed=5)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    want = reference_logits(config, w, ids)
    r = runner(config, w)
    table = np.arange(8, dtype=np.int32)
    split = 30  # prefill 30 tokens (every row's logits), then decode 10 one at a time
    got = list(r.verify([PrefillChunk(ids[:split], 0, table, np.arange(split, dtype=np.int64))])[0])
    for p in range(split, len(ids)):
        got.append(r.decode(np.array([ids[p]]), np.array([p]), table[None], np.array([p + 1], np.int32),
                            np.array([p], np.int64))[0])
    got = torch.stack(got)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * scale)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_hf_folder_loads_through_kog_llm_and_generates_the_reference_greedy_tokens(tmp_path):
    config = lane_model_config(**VARIANTS["delay2_4lanes_lane_scale_lane_head"])
    w = random_weights(config, seed=7)
    folder = write_hf_model(tmp_path / "lf", config, w)
    llm = kog.LLM(str(folder), dtype="float32")
    prompt = [5, 17, 99, 3, 250, 8, 41]
    out = llm.generate({"prompt_token_ids": prompt}, kog.SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True))
    tokens = out[0].outputs[0].token_ids
    ids = list(prompt)
    for _ in range(12):
        ids.append(int(reference_logits(config, w, ids)[-1].argmax()))
    assert list(tokens) == ids[len(prompt):]


def test_bf16_stays_close_to_the_fp32_reference():
    config = lane_model_config(**VARIANTS["delay1"])
    w = random_weights(config, seed=2)
    ids = list(range(10, 30))
    want = reference_logits(config, w, ids)
    got = runner(config, w, torch.bfloat16).verify([PrefillChunk(ids, 0, np.arange(4, dtype=np.int32),
                                                                 np.arange(20, dtype=np.int64))])[0]
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0.05 * want.abs().max().item())


@pytest.mark.parametrize("change, field", [
    (dict(num_lanes=3), "num_attention_heads"),
    (dict(lm_head_type="sideways"), "lm_head_type"),
    (dict(pre_norm_lane_agg=True, lm_head_type="lane"), "pre_norm_lane_agg"),
    (dict(broadcast_delay=-1), "broadcast_delay"),
    (dict(unclamped_layers=(9,)), "unclamped_layers"),
])
def test_bad_lane_layouts_are_model_load_errors_naming_the_field(change, field):
    with pytest.raises(ModelLoadError, match=field):
        lane_model_config(**(dict(num_lanes=2) | change))


def test_config_json_round_trip():
    config = lane_model_config(**VARIANTS["pre_norm_agg"])
    back = kog.config.ModelConfig.from_hf_dict(config.to_hf_dict())
    assert back == config
    assert back.to_hf_dict()["model_type"] == "laneformer_tp" and "norm_eps" in back.to_hf_dict()


def test_lane_ops_run_on_thread_zero_and_meet_only_where_a_dependency_crosses_threads():
    from test_program_deps import barriers_by_the_rule

    from kog.models.decode import build_executor

    config = lane_model_config(**VARIANTS["delay2_4lanes_lane_scale_lane_head"])
    r = runner(config, random_weights(config))
    ex = build_executor(config, r.weights, r.kv.kv, 16, r.inv_freq, program=r.program)
    assert ex.num_barriers == barriers_by_the_rule(r.program) < len(r.program)


@pytest.mark.parametrize("field, value, match", [("lanes", 3, "lanes=3"), ("slot", 99, "slot 99")])
def test_validate_program_refuses_a_bad_lane_field_naming_the_op(field, value, match):
    from kog import _C
    from kog.errors import InvalidRequest
    from kog.models.decode import lower_program, model_dims

    config = lane_model_config(**VARIANTS["delay1"])
    r = runner(config, random_weights(config))
    ops = lower_program(r.program, r.weights)
    i = next(j for j, ins in enumerate(r.program) if ins.opcode.name == ("LINEAR" if field == "lanes" else
                                                                          "LANE_ADD_PAST"))
    o = ops[i]
    kw = dict(w_type=o.w_type, lanes=o.lanes, slot=o.slot) | {field: value}
    ops[i] = _C.Op(o.opcode, o.layer, o.in_, o.residual, o.out, o.w0, o.w1, o.deps, **kw)
    with pytest.raises(InvalidRequest, match=match):
        _C.validate_program(ops, model_dims(config, torch.float32))
