"""Quantized experts run in their GGUF blocks: MOE_EXPERTS (decode executor) and the prefill
interpreter dot the chosen experts' rows with the quantized GEMV kernels, against the same model
with the stacks dequantized to f32.

Tolerances: logits within 1e-3 x max|logit| of the dequantized model (decode quantizes x in two
int8 stages, at most amax / 64516 per element; prefill keeps x in f32 from 2 rows: exact
products), and the same greedy tokens for 16 steps.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

import kog
from kog.loader import LoadedModel, load_model
from kog.models import ModelRunner
from kog.models.decode import lower_program
from kog.ops import quant_file_type
from kog.quantized import QuantizedWeight
from kog.testing.runner_seqs import RunnerSeqs
from kog.testing.tiny_models import random_weights, tiny_config, write_gguf_model

BS = 16
TOL = 1e-3
N_TOKENS = 16


def random_blocks(rng: np.random.Generator, qtype: T, n: int, k: int) -> np.ndarray:
    """[n, row_bytes] uint8 blocks of an [n, k] matrix with values of order 0.05: gguf's encoder
    where it has one, else random blocks with small fp16 scales (K-quant values d * sc * q)."""
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1):
        return quants.quantize((0.05 * rng.standard_normal((n, k))).astype(np.float32), qtype)
    elems, nbytes = quants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    n_halves = 1 if qtype == T.Q6_K else 2
    halves = (rng.choice([-1, 1], size=(n, k // elems, n_halves)) *
              rng.uniform(5e-5, 2e-4, size=(n, k // elems, n_halves))).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        blocks[..., nbytes - 2:] = halves.reshape(n, k // elems, 2)  # d is the block's last field
    else:
        blocks[..., :4] = halves.reshape(n, k // elems, 4)  # d, dmin lead the block
    return blocks.reshape(n, -1)


def quantized_pair(arch: str, gate_up: T, down: T, width: int, seed: int = 0, router_std: float = 1.0):
    """(model with quantized expert stacks, the same with them dequantized to f32)."""
    config = tiny_config(arch, hidden_size=width, moe_intermediate_size=width,
                         **({"intermediate_size": width} if arch == "mixtral" else {}))
    w = random_weights(config, seed=seed)
    rng = np.random.default_rng(seed)
    E, H, I = config.num_experts + config.shared_expert_slots, width, width
    quant, floats = dict(w), dict(w)
    for layer in config.moe_layers:
        p = f"model.layers.{layer}.mlp."
        w[p + "gate.weight"].normal_(0, router_std, generator=torch.Generator().manual_seed(seed + layer))
        if config.shared_expert_slots:  # keep the test on the routed stacks: no shared expert
            pytest.skip("qwen2_moe's shared expert: test_moe_quant_gguf")
        for name, qt, n, k in (("experts.gate_up_proj", gate_up, 2 * I, H), ("experts.down_proj", down, H, I)):
            q = QuantizedWeight(torch.from_numpy(random_blocks(rng, qt, E * n, k)), int(qt), k)
            quant[p + name], floats[p + name] = q, q.dequantize().view(E, n, k)
    model = lambda ws: LoadedModel(path=None, config=config, weights=ws, dtype=torch.float32,  # noqa: E731
                                   tokenizer=None, chat_template=None, stop_token_ids=())
    return model(quant), model(floats)


def greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens (prefill, then decode steps) and the logits of every step [n, vocab]."""
    r = ModelRunner(model, num_kv_blocks=32, block_size=BS)
    s = RunnerSeqs(r, blocks_per_seq=8)
    logits = [r.prefill([s.chunk(0, prompt)])[0]]
    out = [int(logits[0].argmax())]
    for i in range(n - 1):
        logits.append(s.decode([0], [out[-1]], [len(prompt) + i])[0])
        out.append(int(logits[-1].argmax()))
    return out, torch.stack(logits)


def assert_close_greedy(quant, floats, prompt):
    got_ids, got = greedy(quant, prompt, N_TOKENS)
    want_ids, want = greedy(floats, prompt, N_TOKENS)
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= TOL * scale, f"max error {err} vs max |logit| {scale}"
    assert got_ids == want_ids


@pytest.mark.parametrize("gate_up, down, width", [
    (T.Q8_0, T.Q8_0, 64), (T.Q4_0, T.Q4_1, 64), (T.Q4_K, T.Q6_K, 256), (T.Q5_K, T.Q4_K, 256)])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_quantized_experts_run_like_the_dequantized_stacks(arch, gate_up, down, width):
    quant, floats = quantized_pair(arch, gate_up, down, width)
    r = ModelRunner(quant, num_kv_blocks=4, block_size=BS)
    ops = lower_program(r.program, r.weights)
    moe = [o for o in ops if o.opcode == int(kog.program.Opcode.MOE_EXPERTS)]
    # (the runner holds Q4_0/Q4_1/Q8_0 in their row-interleaved forms: same blocks)
    assert moe and all((quant_file_type(o.w_type), quant_file_type(o.w1_type)) == (int(gate_up), int(down))
                       for o in moe)
    prompt = np.random.default_rng(1).integers(3, quant.config.vocab_size, 40).tolist()
    assert_close_greedy(quant, floats, prompt)


def test_batched_quantized_experts_equal_each_row_alone():
    # Rows of a batch that share an expert run as one quantized GEMM over all of them: the same
    # logits as each row alone, up to x's int8 rounding: the float ops before each expert differ
    # by ~1e-7 between batch sizes, which can move one of x's stage-2 roundings by a step of
    # amax / 16129 (measured: ~3e-5 x max|logit|; the float stacks of test_moe agree to 1e-6).
    quant, _ = quantized_pair("qwen3_moe", T.Q4_K, T.Q6_K, 256, router_std=0.3)
    r = ModelRunner(quant, num_kv_blocks=64, block_size=BS)
    s = RunnerSeqs(r, blocks_per_seq=4)
    ps = [np.random.default_rng(i).integers(3, quant.config.vocab_size, 9 + i).tolist() for i in range(4)]
    r.prefill([s.chunk(i, p) for i, p in enumerate(ps)])
    r.prefill([s.chunk(4 + i, p) for i, p in enumerate(ps)])
    tokens, lens = [3, 4, 5, 6], [len(p) for p in ps]
    for _ in range(4):
        batched = s.decode(range(4), tokens, lens)
        solo = torch.cat([s.decode([4 + i], [tokens[i]], [lens[i]]) for i in range(4)])
        assert (batched - solo).abs().max() <= 2e-4 * solo.abs().max()
        tokens, lens = batched.argmax(-1).tolist(), [n + 1 for n in lens]


def test_quantized_experts_no_row_chose_are_never_read():
    # A zero router picks the same two experts for every token; NaN scales in every other
    # expert's blocks would reach the logits if a GEMM read their rows.
    quant, floats = quantized_pair("qwen3_moe", T.Q8_0, T.Q4_K, 256, router_std=0.0)
    chosen = torch.topk(torch.full((4,), 0.25), 2).indices.tolist()
    for layer in quant.config.moe_layers:
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            q = quant.weights[f"model.layers.{layer}.mlp.{name}"]
            rows = q.shape[0] // 4
            blocks = q.data.view(q.shape[0], -1, {T.Q8_0: 34, T.Q4_K: 144}[T(q.qtype)])
            for e in set(range(4)) - set(chosen):
                blocks[e * rows:(e + 1) * rows, :, 0:2] = torch.tensor([0x00, 0x7e], dtype=torch.uint8)  # fp16 NaN d
    prompt = list(range(3, 43))
    ids, logits = greedy(quant, prompt, 4)
    assert torch.isfinite(logits).all()
    assert_close_greedy(quant, floats, prompt)


# ---------------------------------------------------------------------- GGUF files


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_quantized_gguf_keeps_expert_blocks_and_decodes_like_it_dequantized(tmp_path, arch, qtype):
    config = tiny_config(arch, max_position_embeddings=256)
    w = random_weights(config, seed=4)
    for layer in config.moe_layers:  # decisive routers
        w[f"model.layers.{layer}.mlp.gate.weight"] *= 25
    path = write_gguf_model(tmp_path / "m.gguf", config, w, qtype=qtype)
    kept = load_model(path)
    layer = config.moe_layers[0]
    for name, rows in (("gate_up_proj", 2 * 4 * 32), ("down_proj", 4 * 64)):
        t = kept.weights[f"model.layers.{layer}.mlp.experts.{name}"]
        assert isinstance(t, QuantizedWeight) and t.type_name == qtype and t.shape[0] == rows
    dequantized = load_model(path, dtype="float32")
    # both models quantize nothing else differently: dense matrices are blocks in `kept` too,
    # so the bound is the int8 x stages' error over every LINEAR (as test_moe's Q8_0 check)
    got_ids, got = greedy(kept, list(range(5, 45)), N_TOKENS)
    want_ids, want = greedy(dequantized, list(range(5, 45)), N_TOKENS)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert got_ids == want_ids


def retyped(src, dst, types: dict[str, T]):
    """dst: the GGUF src with each tensor whose name ends with a key of `types` re-encoded in that type."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            vtype = field.types[0]
            writer.add_key_value(field.name, field.contents(), vtype,
                                 sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        new = next((q for suffix, q in types.items() if t.name.endswith(suffix)), None)
        if new == T.IQ4_NL:  # gguf cannot encode it: random indices (any byte is valid) with d = 0.01
            rows, cols = int(np.prod(t.shape[1:])), int(t.shape[0])
            blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)
            blocks[..., :2] = np.full(blocks.shape[:2], 0.01, np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
            writer.add_tensor(t.name, blocks.reshape([int(x) for x in reversed(t.shape[1:])] + [-1]), raw_dtype=new)
        elif new is not None:
            values = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            writer.add_tensor(t.name, quants.quantize(values, new), raw_dtype=new)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type if t.tensor_type != T.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def q8_0_moe_file(tmp_path):
    config = tiny_config("qwen3_moe", max_position_embeddings=256)
    w = random_weights(config, seed=6)
    for layer in config.moe_layers:
        w[f"model.layers.{layer}.mlp.gate.weight"] *= 25
    return config, write_gguf_model(tmp_path / "q8.gguf", config, w, qtype="Q8_0")


def test_gate_and_up_of_different_types_run_as_one_q8_0_stack(tmp_path):
    # llama.cpp's mixes may store ffn_up_exps in another type than ffn_gate_exps; one expert GEMM
    # needs one type, so the loader re-encodes the pair as Q8_0 (adding at most amax / 254 per
    # value to the file's rounding: logits within 2e-2 x max|logit| of the file dequantized).
    config, src = q8_0_moe_file(tmp_path)
    path = retyped(src, tmp_path / "mixed.gguf", {"ffn_up_exps.weight": T.Q4_0})
    kept = load_model(path)
    stack = kept.weights[f"model.layers.{config.moe_layers[0]}.mlp.experts.gate_up_proj"]
    assert isinstance(stack, QuantizedWeight) and stack.type_name == "Q8_0"
    dequantized = load_model(path, dtype="float32")
    got_ids, got = greedy(kept, list(range(5, 45)), N_TOKENS)
    want_ids, want = greedy(dequantized, list(range(5, 45)), N_TOKENS)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert got_ids == want_ids


def test_expert_stack_of_a_type_without_kernels_is_kept_as_q8_0(tmp_path):
    # IQ4_NL has no native kernel: its stack is re-encoded as Q8_0 (the finest type with kernels)
    # and the model gives the tokens of the file dequantized.
    config, src = q8_0_moe_file(tmp_path)
    path = retyped(src, tmp_path / "iq4.gguf", {"blk.0.ffn_down_exps.weight": T.IQ4_NL})
    kept = load_model(path)
    stack = kept.weights["model.layers.0.mlp.experts.down_proj"]
    assert isinstance(stack, QuantizedWeight) and stack.type_name == "Q8_0"
    floats = load_model(path, dtype="float32")
    assert floats.weights["model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 32)
    got_ids, got = greedy(kept, list(range(5, 45)), N_TOKENS)
    want_ids, want = greedy(floats, list(range(5, 45)), N_TOKENS)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert got_ids == want_ids


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_expert_stacks_in_q5_run_natively(tmp_path, qtype):
    # Q4_K_M / Q5_K_M files of models whose widths are not whole 256-element super-blocks fall
    # back to Q5_0 / Q5_1: those stacks keep their blocks and give the dequantized model's tokens.
    config, src = q8_0_moe_file(tmp_path)
    path = retyped(src, tmp_path / "q5.gguf", {"ffn_down_exps.weight": qtype, "ffn_gate_exps.weight": qtype,
                                                "ffn_up_exps.weight": qtype})
    kept = load_model(path)
    for name in ("gate_up_proj", "down_proj"):
        stack = kept.weights[f"model.layers.{config.moe_layers[0]}.mlp.experts.{name}"]
        assert isinstance(stack, QuantizedWeight) and stack.type_name == qtype.name
    got_ids, got = greedy(kept, list(range(5, 45)), N_TOKENS)
    want_ids, want = greedy(load_model(path, dtype="float32"), list(range(5, 45)), N_TOKENS)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert got_ids == want_ids


def test_validate_program_checks_the_expert_stacks_types():
    from kog import _C
    from kog.models.decode import model_dims

    quant, _ = quantized_pair("qwen3_moe", T.Q4_K, T.Q6_K, 256)
    r = ModelRunner(quant, num_kv_blocks=4, block_size=BS)
    ops = lower_program(r.program, r.weights)
    dims = model_dims(quant.config, torch.float32)
    _C.validate_program(ops, dims)
    i = next(i for i, o in enumerate(ops) if o.opcode == int(kog.program.Opcode.MOE_EXPERTS))
    lin = next(i for i, o in enumerate(ops) if o.opcode == int(kog.program.Opcode.LINEAR))

    def with_types(k, w_type, w1_type):
        o = ops[k]
        return ops[:k] + [_C.Op(o.opcode, o.layer, o.in_, o.residual, o.out, o.w0, o.w1, o.deps, w_type=w_type,
                                w1_type=w1_type)] + ops[k + 1:]

    with pytest.raises(kog.InvalidRequest, match=f"op {lin} .* has w1 type 8: only MOE_EXPERTS' down"):
        _C.validate_program(with_types(lin, _C.WEIGHT_RUN_DTYPE, int(T.Q8_0)), dims)
    with pytest.raises(kog.InvalidRequest, match=f"has w1 type {int(T.IQ4_NL)}"):
        _C.validate_program(with_types(i, int(T.Q4_K), int(T.IQ4_NL)), dims)  # no kernels
    with pytest.raises(kog.InvalidRequest, match="run dtype is bf16|run dtype is bfloat16"):
        _C.validate_program(ops, model_dims(quant.config, torch.bfloat16))
    narrow, _ = quantized_pair("qwen3_moe", T.Q8_0, T.Q8_0, 64)  # 64-wide rows: not whole Q4_K blocks
    rn = ModelRunner(narrow, num_kv_blocks=4, block_size=BS)
    narrow_ops = lower_program(rn.program, rn.weights)
    j = next(i for i, o in enumerate(narrow_ops) if o.opcode == int(kog.program.Opcode.MOE_EXPERTS))
    o = narrow_ops[j]
    bad = narrow_ops[:j] + [_C.Op(o.opcode, o.layer, o.in_, o.residual, o.out, o.w0, o.w1, o.deps,
                                  w_type=int(T.Q8_0), w1_type=int(T.Q4_K))] + narrow_ops[j + 1:]
    with pytest.raises(kog.InvalidRequest, match="rows of 64 elements, not whole Q4_K blocks"):
        _C.validate_program(bad, model_dims(narrow.config, torch.float32))
