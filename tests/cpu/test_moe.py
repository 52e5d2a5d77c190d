"""Mixture-of-experts families (qwen3_moe, mixtral, qwen2_moe) against Hugging Face transformers, on tiny
random checkpoints that transformers itself writes (one tensor per expert, as save_pretrained
does), and the routing ops' own contract: torch.topk's tie order, rows sharing experts, only the
chosen experts' weights read, the stacked (fused) checkpoint layout, bad configs.

Tolerances: logits within 1e-3 x max|logit| of transformers in fp32 (measured ~1e-6); batched
decode equals per-sequence decode to 1e-5 relative (the same GEMMs over other row counts).
"""

import numpy as np
import pytest
import torch

import kog
from kog import _C
from kog.loader import load_model
from kog.models import ModelRunner
from kog.models.decode import lower_program, model_dims, schedule_for
from kog.models.weights import prepare_weights
from kog.program import Buffer, Opcode, TokenBatch
from kog.program.interpreter import ProgramInterpreter
from kog.testing.greedy import hf_greedy
from kog.testing.programs import with_op
from kog.testing.runner_seqs import RunnerSeqs
from kog.testing.tiny_models import random_weights, tiny_config, tiny_tokenizer, write_hf_model

transformers = pytest.importorskip("transformers")

BS = 16
VOCAB = tiny_config("llama").vocab_size
# name -> (family, transformers config overrides). 3 layers: qwen3_moe keeps layer 1 dense.
MODELS = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True)),
    # every second layer sparse (decoder_sparse_step), weights not renormalized, 3 of 8 experts
    "qwen3_moe-step2-unnormalized": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, mlp_only_layers=[],
                                                       decoder_sparse_step=2, norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a shared expert 1.5 experts wide (two slots, half of one padding), q/k/v bias
    "qwen2_moe": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False,
                                    shared_expert_intermediate_size=48)),
}


def hf_moe(folder, family: str, router_std: float = 0.5, seed: int = 0, **overrides):
    """A tiny transformers MoE model with random weights, saved to folder with a tokenizer."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-5)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, **overrides)
        model = transformers.Qwen3MoeForCausalLM(config)
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, **overrides)
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=32, **overrides)
        model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # decisive routers and gates
                p.copy_(router_std * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    tiny_tokenizer("smollm" if family == "mixtral" else "qwen2").save(folder, chat_template=None)
    return model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    family, overrides = MODELS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = hf_moe(folder, family, **overrides)
    return request.param, folder, hf


def runner_for(folder, blocks: int = 8 * 48) -> ModelRunner:
    return ModelRunner(load_model(folder, dtype=torch.float32), num_kv_blocks=blocks, block_size=BS)


def prompts(n_max: int = 700) -> list[list[int]]:
    g = np.random.default_rng(0)
    return [g.integers(3, VOCAB, n).tolist() for n in (1, 5, 17, 64, 130, n_max)]


def hf_last(hf, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


def assert_near_hf(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs().max().item()
    assert err <= 1e-3 * want.abs().max().item(), f"{what}: max error {err} vs max |logit| {want.abs().max().item()}"


# ---------------------------------------------------------------------- against transformers


def test_prefill_and_batched_decode_match_transformers(pair):
    name, folder, hf = pair
    r = runner_for(folder)
    s, ps = RunnerSeqs(r), prompts()
    got = r.prefill([s.chunk(i, p) for i, p in enumerate(ps)])  # one batch: 6 sequences, up to 700 tokens
    for i, p in enumerate(ps):
        assert_near_hf(got[i], hf_last(hf, p), f"{name} prefill of {len(p)} tokens")
    # one decode step for five sequences at once: rows route to different experts
    nxt = [7, 11, 13, 17, 19]
    dec = s.decode(range(5), nxt, [len(p) for p in ps[:5]])
    for i in range(5):
        assert_near_hf(dec[i], hf_last(hf, ps[i] + [nxt[i]]), f"{name} decode row {i}")


def test_greedy_through_kog_llm_matches_transformers(pair):
    name, folder, hf = pair
    llm = kog.LLM(str(folder), "float32", kv_cache_gib=0.02)
    ps = [prompts()[2], prompts()[4]]
    params = kog.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)  # batched decode of both
    for p, out in zip(ps, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 24), name


# ---------------------------------------------------------------------- routing edge cases


@pytest.mark.parametrize("experts, top_k", [(6, 2), (8, 3), (128, 2)])  # 128 x 2: torch.topk's partial-sort path
def test_tied_router_picks_the_experts_transformers_picks(tmp_path, experts, top_k):
    # A zero router: every expert scores 1 / E for every token, so which experts run is decided by
    # torch.topk's tie order alone -- and all rows of a batch pick the same ones.
    folder = tmp_path / "tied"
    hf = hf_moe(folder, "qwen3_moe", router_std=0.0, num_experts=experts, num_experts_per_tok=top_k,
                mlp_only_layers=[1], norm_topk_prob=False)
    r = runner_for(folder)
    want_ids = torch.topk(torch.full((experts,), 1.0 / experts), top_k).indices
    s, ps = RunnerSeqs(r), prompts(200)
    got = r.prefill([s.chunk(i, p) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert_near_hf(got[i], hf_last(hf, p), f"tied {experts}x{top_k} prefill {len(p)}")
    step = runner_step(r, s, [7, 11, 13, 17], [len(p) for p in ps[:4]], stop_after_router=True)
    ids = step[:, :top_k]
    assert (ids == want_ids.to(torch.int32)).all(), (ids, want_ids)  # the executor's ROUTE: all rows alike
    assert torch.allclose(step[:, top_k:].contiguous().view(torch.float32), torch.tensor(1.0 / experts))
    dec = s.decode(range(4), [7, 11, 13, 17], [len(p) for p in ps[:4]])
    for i in range(4):
        assert_near_hf(dec[i], hf_last(hf, ps[i] + [[7, 11, 13, 17][i]]), f"tied decode row {i}")


def runner_step(r: ModelRunner, s: RunnerSeqs, tokens, positions, stop_after_router: bool) -> torch.Tensor:
    """The ROUTE buffer of a decode step's first router, on a separate executor (the cache is
    written as far as that op, as a full step would)."""
    from kog.models.decode import build_executor

    ex = build_executor(r.config, r.weights, r.kv.kv, BS, r.inv_freq)
    stop = next(i for i, ins in enumerate(r.program) if ins.opcode == Opcode.ROUTER) + 1
    n, pos = len(tokens), np.asarray(positions, dtype=np.int64)
    t = np.stack([s.table(i) for i in range(n)])
    lens, slots = (pos + 1).astype(np.int32), np.concatenate([s.slots(i, p, p + 1) for i, p in enumerate(pos)])
    tok = np.asarray(tokens, dtype=np.int64)
    ex.run(n, tok.ctypes.data, pos.ctypes.data, t.ctypes.data, t.shape[1], lens.ctypes.data, slots.ctypes.data,
           torch.empty(n, r.vocab_size).data_ptr(), 0, stop if stop_after_router else -1)
    route = torch.empty(n, ex.width(int(Buffer.ROUTE)), dtype=torch.int32)
    ex.read_buffer(int(Buffer.ROUTE), route.data_ptr(), route.numel() * 4)
    return route


def test_router_ties_at_every_level_follow_torch_topk(tmp_path):
    # Router rows duplicated in pairs (experts 2j and 2j+1 identical): every probability is tied
    # with another, at a different value per token. The executor's ROUTE ids are torch.topk's.
    config = tiny_config("mixtral", num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)
    w = random_weights(config, seed=5)
    for layer in config.moe_layers:
        g = w[f"model.layers.{layer}.mlp.gate.weight"]
        g[1::2] = g[0::2]
        g *= 20
    model = kog.loader.LoadedModel(path=None, config=config, weights=w, dtype=torch.float32, tokenizer=None,
                                   chat_template=None, stop_token_ids=())
    r = ModelRunner(model, num_kv_blocks=64, block_size=BS)
    s = RunnerSeqs(r, blocks_per_seq=4)
    toks = [5, 9, 13, 40, 77, 120, 3, 250]
    for i, t in enumerate(toks):
        r.prefill([s.chunk(i, [t, t + 1])])
    route = runner_step(r, s, toks, [2] * len(toks), stop_after_router=True)
    interpreter = ProgramInterpreter(r.config, r.program, r.weights, r.kv.kv, r.inv_freq)
    state = interpreter.run(TokenBatch.decode(
        torch.tensor(toks), torch.full((len(toks),), 2), torch.from_numpy(np.stack([s.table(i) for i in range(8)])),
        torch.from_numpy(np.concatenate([s.slots(i, 2, 3) for i in range(8)]))),
        stop_after=next(i for i, ins in enumerate(r.program) if ins.opcode == Opcode.ROUTER) + 1)
    want = state.buffers[Buffer.ROUTE]  # torch.topk's picks
    assert len({tuple(row) for row in route[:, :3].tolist()}) > 2  # tokens really route differently
    assert torch.equal(route[:, :3], want[:, :3])
    torch.testing.assert_close(route[:, 3:].contiguous().view(torch.float32),
                               want[:, 3:].contiguous().view(torch.float32), rtol=1e-6, atol=1e-7)


def test_batch_whose_rows_all_pick_the_same_experts_equals_each_row_alone(tmp_path):
    # A zero router sends every row to the same experts: one pass per expert over all rows.
    folder = tmp_path / "same"
    hf_moe(folder, "mixtral", router_std=0.0, num_local_experts=4, num_experts_per_tok=2)
    r = runner_for(folder)
    s, ps = RunnerSeqs(r, blocks_per_seq=8), [p[:40] for p in prompts(40)[1:5]]
    r.prefill([s.chunk(i, p) for i, p in enumerate(ps)])
    r.prefill([s.chunk(4 + i, p) for i, p in enumerate(ps)])  # the same again, decoded one at a time
    tokens, lens = [3, 4, 5, 6], [len(p) for p in ps]
    for _ in range(6):
        batched = s.decode(range(4), tokens, lens)
        solo = torch.cat([s.decode([4 + i], [tokens[i]], [lens[i]]) for i in range(4)])
        torch.testing.assert_close(batched, solo, rtol=1e-5, atol=1e-5 * solo.abs().max().item())
        tokens, lens = batched.argmax(-1).tolist(), [n + 1 for n in lens]


def test_expert_merge_off_gives_the_merged_logits(tmp_path, monkeypatch):
    # KOG_MOE_MERGE=0 (bench/moe_decode.py's baseline) runs each (row, slot) pair as its own
    # GEMM; a zero router makes every row share its experts, so merging is what it changes.
    folder = tmp_path / "merge"
    hf_moe(folder, "qwen3_moe", router_std=0.0, num_experts=6, num_experts_per_tok=2, mlp_only_layers=[])
    r = runner_for(folder)
    s, ps = RunnerSeqs(r, blocks_per_seq=8), [p[:40] for p in prompts(40)[1:5]]
    r.prefill([s.chunk(i, p) for i, p in enumerate(ps)])
    r.prefill([s.chunk(4 + i, p) for i, p in enumerate(ps)])  # the same sequences again
    tokens, lens = [3, 4, 5, 6], [len(p) for p in ps]
    for _ in range(4):
        merged = s.decode(range(4), tokens, lens)
        monkeypatch.setenv("KOG_MOE_MERGE", "0")
        alone = s.decode(range(4, 8), tokens, lens)
        monkeypatch.delenv("KOG_MOE_MERGE")
        torch.testing.assert_close(alone, merged, rtol=1e-5, atol=1e-5 * merged.abs().max().item())
        tokens, lens = merged.argmax(-1).tolist(), [n + 1 for n in lens]


def test_experts_no_row_chose_are_never_read(tmp_path):
    # Zero routers pick the same experts for every token; NaN in every other expert's matrices
    # would reach the logits if prefill or decode touched them (0 x NaN is NaN).
    folder = tmp_path / "nan"
    hf = hf_moe(folder, "qwen3_moe", router_std=0.0, num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1])
    chosen = torch.topk(torch.full((6,), 1 / 6), 2).indices.tolist()
    model = load_model(folder, dtype=torch.float32)
    for layer in model.config.moe_layers:
        for kind in ("gate_up_proj", "down_proj"):
            t = model.weights[f"model.layers.{layer}.mlp.experts.{kind}"]
            for e in set(range(6)) - set(chosen):
                t[e] = float("nan")
    r = ModelRunner(model, num_kv_blocks=64, block_size=BS)
    s, p = RunnerSeqs(r, blocks_per_seq=4), prompts(40)[3][:40]
    got = [r.prefill([s.chunk(0, p)])[0], s.decode([0], [9], [len(p)])[0]]
    assert all(torch.isfinite(g).all() for g in got)
    assert_near_hf(got[0], hf_last(hf, p), "prefill with unread NaN experts")
    assert_near_hf(got[1], hf_last(hf, p + [9]), "decode with unread NaN experts")


# ---------------------------------------------------------------------- loading


def test_stacked_layout_loads_like_per_expert_tensors(pair, tmp_path):
    name, folder, hf = pair
    from safetensors import safe_open

    per_expert = load_model(folder, dtype=torch.float32)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # what transformers wrote: one tensor per expert
        stored = set(f.keys())
    assert any(".experts.1." in n for n in stored) and not any(n.endswith("gate_up_proj") for n in stored)
    # Kog's own stacked names (transformers 5.x's in-memory layout), in two shards
    fused = write_hf_model(tmp_path / "fused", per_expert.config, per_expert.weights, shards=2)
    again = load_model(fused, dtype=torch.float32)
    assert set(again.weights) == set(per_expert.weights)
    for n, t in per_expert.weights.items():
        assert torch.equal(again.weights[n], t), n
    layer = per_expert.config.moe_layers[0]
    e = per_expert.config.num_experts
    gate_up = per_expert.weights[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    hf_gate_up = dict(hf.named_parameters())[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    assert gate_up.shape[0] == e and torch.equal(gate_up, hf_gate_up.detach())


def test_missing_or_misshapen_expert_is_a_load_error(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    hf_moe(folder, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    tensors = load_file(str(folder / "model.safetensors"))
    gone = "model.layers.2.block_sparse_moe.experts.3.w3.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, str(folder / "model.safetensors"))
    with pytest.raises(kog.errors.ModelLoadError, match=gone.replace(".", r"\.")):
        load_model(folder)
    bad = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    save_file(tensors | {bad: tensors[bad][:, :-1].contiguous()}, str(folder / "model.safetensors"))
    with pytest.raises(kog.errors.ModelLoadError, match=bad.replace(".", r"\.") + r".*shape \[64, 31\], expected \[64, 32\]"):
        load_model(folder)


BASE_QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=400,
                      moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("change, field", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok=0"),
    (dict(num_experts=None), "num_experts"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    (dict(mlp_only_layers=[7]), "mlp_only_layers"),
    (dict(model_type="mixtral", num_experts=None, num_local_experts=2, num_experts_per_tok=3), "num_experts_per_tok=3"),
    (dict(model_type="qwen2_moe"), "shared_expert_intermediate_size"),
    (dict(model_type="qwen2_moe", shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
])
def test_bad_moe_config_is_a_load_error_naming_the_field(change, field):
    d = {k: v for k, v in (BASE_QWEN3_MOE | change).items() if v is not None}
    with pytest.raises(kog.errors.ModelLoadError, match=field):
        kog.config.ModelConfig.from_hf_dict(d)


def test_config_reads_the_sparse_layers_as_transformers_does():
    c = kog.config.ModelConfig.from_hf_dict(BASE_QWEN3_MOE | dict(num_hidden_layers=6, decoder_sparse_step=2,
                                                                   mlp_only_layers=[3]))
    assert c.moe_layers == (1, 5) and c.num_experts == 4 and not c.norm_topk_prob and c.qk_norm
    d = BASE_QWEN3_MOE | dict(model_type="mixtral", num_local_experts=8)
    mixtral = kog.config.ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "num_experts"})
    assert mixtral.moe_layers == (0, 1, 2) and mixtral.moe_intermediate_size == 96 and mixtral.norm_topk_prob
    back = kog.config.ModelConfig.from_hf_dict(c.to_hf_dict())
    assert back == c


# ---------------------------------------------------------------------- the program's contract


def lowered(arch: str):
    c = tiny_config(arch)
    w = prepare_weights(c, random_weights(c), torch.float32)
    return lower_program(schedule_for(c), w), model_dims(c, torch.float32), w


def test_validate_program_refuses_bad_moe_ops():
    ops, dims, _ = lowered("mixtral")
    i = next(i for i, o in enumerate(ops) if o.opcode == Opcode.MOE_EXPERTS)
    j = next(i for i, o in enumerate(ops) if o.opcode == Opcode.ROUTER)

    with pytest.raises(kog.InvalidRequest, match=f"op {i} .MOE_EXPERTS. needs gate_up and down"):
        _C.validate_program(with_op(ops, i, w1=0), dims)
    with pytest.raises(kog.InvalidRequest, match=f"op {i} .MOE_EXPERTS. must write a hidden-wide buffer other"):
        _C.validate_program(with_op(ops, i, out=int(Buffer.NORMED)), dims)
    with pytest.raises(kog.InvalidRequest, match=f"op {j} .ROUTER. must write ROUTE"):
        _C.validate_program(with_op(ops, j, out=int(Buffer.HIDDEN)), dims)
    with pytest.raises(kog.InvalidRequest, match="writes the ROUTE buffer, which only ROUTER writes"):
        _C.validate_program(with_op(ops, i - 3, out=int(Buffer.ROUTE)), dims)
    with pytest.raises(kog.InvalidRequest, match=f"op {j} needs a layer"):
        _C.validate_program(with_op(ops, j, layer=-1), dims)
    dense = model_dims(tiny_config("mistral"), torch.float32)
    with pytest.raises(kog.InvalidRequest, match="MoE op .* but the dims have no experts"):
        _C.validate_program(ops, dense)
    with pytest.raises(kog.InvalidRequest, match="top_k 5 must be in"):
        _C.ModelDims(**{k: getattr(dims, k) for k in ("n_layers", "hidden", "n_q_heads", "n_kv_heads", "head_dim",
                                                       "intermediate", "vocab", "rotary_dim", "rms_eps", "attn_scale",
                                                       "rope_neox", "dtype", "n_experts", "expert_intermediate")},
                     top_k=5)


# ---------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])  # GGUF architectures qwen3moe and llama + experts
def test_gguf_stacked_experts_load_and_run_like_the_hf_folder(tmp_path, arch):
    from kog.quantized import QuantizedWeight
    from kog.testing.tiny_models import write_gguf_model

    config = tiny_config(arch, max_position_embeddings=256)
    w = random_weights(config, seed=4)
    for layer in config.moe_layers:  # decisive routers
        w[f"model.layers.{layer}.mlp.gate.weight"] *= 25
    hf = load_model(write_hf_model(tmp_path / "hf", config, w), dtype=torch.float32)
    f32 = load_model(write_gguf_model(tmp_path / "f32.gguf", config, w, qtype="F32"))
    assert f32.config == hf.config
    for name, t in hf.weights.items():  # blk.N.ffn_{gate,up,down}_exps + ffn_gate_inp, q/k un-permuted
        assert torch.equal(f32.weights[name], t), name
    q8_path = write_gguf_model(tmp_path / "q8.gguf", config, w, qtype="Q8_0")
    q8 = load_model(q8_path)  # every matrix stays Q8_0 blocks, the stacked experts too (test_moe_quant)
    layer = config.moe_layers[0]
    assert isinstance(q8.weights[f"model.layers.{layer}.self_attn.o_proj.weight"], QuantizedWeight)
    assert isinstance(q8.weights[f"model.layers.{layer}.mlp.experts.gate_up_proj"], QuantizedWeight)
    q8_f32 = load_model(q8_path, dtype="float32")
    p = prompts(40)[3][:40]
    runs = []
    for model in (hf, f32, q8, q8_f32):
        r = ModelRunner(model, num_kv_blocks=16, block_size=BS)
        s = RunnerSeqs(r, blocks_per_seq=4)
        runs.append(torch.stack([r.prefill([s.chunk(0, p)])[0], s.decode([0], [9], [len(p)])[0]]))
    scale = runs[0].abs().max().item()
    assert (runs[1] - runs[0]).abs().max() <= 1e-5 * scale  # same weights
    # Q8_0 kept as blocks vs the same file dequantized: the int8 x stages' error only
    assert (runs[2] - runs[3]).abs().max() <= 2e-2 * runs[3].abs().max()


def kog_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after prompt through Kog's runner, and the first step's logits."""
    r = ModelRunner(model, num_kv_blocks=16, block_size=BS)
    s = RunnerSeqs(r, blocks_per_seq=4)
    logits = r.prefill([s.chunk(0, prompt)])[0]
    first, out = logits, [int(logits.argmax())]
    for i in range(n - 1):
        out.append(int(s.decode([0], [out[-1]], [len(prompt) + i])[0].argmax()))
    return out, first


@pytest.mark.parametrize("outtype, tol", [("f32", 1e-5), ("f16", 1e-2), ("bf16", 3e-2), ("q8_0", 3e-2), ("q4_k", 0.15)])
def test_kog_convert_writes_qwen3_moe_that_kog_loads_like_the_hf_folder(tmp_path, outtype, tol):
    from kog.loader.gguf import GGUFCheckpoint
    from kog.loader.gguf_write import hf_to_gguf

    folder = tmp_path / "hf"
    hf_moe(folder, "qwen3_moe", num_experts=8, num_experts_per_tok=2, mlp_only_layers=[], norm_topk_prob=True)
    written = hf_to_gguf(folder, tmp_path / "m.gguf", outtype)
    # llama.cpp's layout: stacked experts in the file type (Q4_K's 64-wide rows fall back to
    # Q8_0), the router in F32, its MoE keys
    exps = {t for n, t in written.items() if "_exps." in n}
    assert exps == {"Q8_0" if outtype == "q4_k" else outtype.upper()}
    assert {t for n, t in written.items() if ".ffn_gate_inp." in n} == {"F32"}
    ck = GGUFCheckpoint(tmp_path / "m.gguf")
    assert ck.tensors["blk.0.ffn_gate_exps.weight"].torch_shape == (8, 32, 64)
    assert ck.tensors["blk.0.ffn_down_exps.weight"].torch_shape == (8, 64, 32)
    assert (ck.get("general.architecture"), ck.get("qwen3moe.expert_count"), ck.get("qwen3moe.expert_used_count"),
            ck.get("qwen3moe.expert_feed_forward_length"), ck.get("qwen3moe.feed_forward_length")) == \
        ("qwen3moe", 8, 2, 32, 96)
    want = runner_for(folder)
    p = prompts(40)[3][:40]
    ref = want.prefill([RunnerSeqs(want).chunk(0, p)])[0]
    _, logits = kog_greedy(load_model(tmp_path / "m.gguf", dtype="float32"), p, 1)
    assert (logits - ref).abs().max() <= tol * ref.abs().max()


def test_llama_cpp_runs_the_qwen3_moe_file_kog_convert_writes(tmp_path):
    # The same F32 file in both engines: the same greedy tokens, logits within 1e-3 x max|logit|
    # (llama.cpp keeps its KV cache in F16).
    llama_cpp = pytest.importorskip("llama_cpp")
    from kog.loader.gguf_write import hf_to_gguf

    folder = tmp_path / "hf"
    hf_moe(folder, "qwen3_moe", num_experts=8, num_experts_per_tok=2, mlp_only_layers=[], norm_topk_prob=True)
    hf_to_gguf(folder, tmp_path / "m.gguf", "f32")
    p = prompts(40)[3][:40]
    want, first = kog_greedy(load_model(tmp_path / "m.gguf", dtype="float32"), p, 8)
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=128, n_threads=2, verbose=False)
    # NOTE: Llama.scores stays zero without logits_all; the context's last logits are read instead.
    last = lambda: np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()  # noqa: E731
    llm.eval(p)
    lc_first, got = torch.from_numpy(last()), []
    for _ in range(8):
        logits = last()
        assert np.isfinite(logits).all()
        got.append(int(np.argmax(logits)))
        llm.eval([got[-1]])
    assert got == want
    assert (lc_first - first).abs().max() <= 1e-3 * first.abs().max()
