"""A model whose matrices stay in GGUF blocks (issue 17): the row dequantizer against gguf's, the
two-stage int8 GEMV, Op.w_type validation, the executor's quantized LINEAR/EMBED against
kog.ops, and tiny quantized models (Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1) against the same weights in fp32."""

import dataclasses
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from kog import _C, ops
from kog.engine import EngineConfig, LLMEngine
from kog.errors import InvalidRequest, ModelLoadError
from kog.loader import LoadedModel, load_model
from kog.loader.gguf_write import quantize_q4_k, quantize_q5_k, quantize_q6_k
from kog.models import ModelRunner
from kog.models.decode import lower_program, model_dims
from kog.program import interpreter as interp
from kog.quantized import QuantizedWeight, cat_rows
from kog.sampling_params import SamplingParams
from kog.testing.tiny_models import random_weights, tiny_config, tiny_tokenizer, write_gguf_model

ALL_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
ENCODERS = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}  # gguf cannot encode these


def random_blocks(rng: np.random.Generator, qtype: T, n: int, k: int) -> np.ndarray:
    """[n, row_bytes] valid random blocks (as tests/cpu/test_linear_quant.py makes them)."""
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    elems, nbytes = quants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    n_halves = 1 if qtype == T.Q6_K else 2
    halves = rng.uniform(-0.05, 0.05, size=(n, k // elems, n_halves)).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        blocks[..., nbytes - 2:] = halves.reshape(n, k // elems, 2)
    else:
        blocks[..., :4] = halves.reshape(n, k // elems, 4)
    return blocks.reshape(n, -1)


# ---- kernels -------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_equals_gguf(cpu_isa, qtype):
    """Every row, and rows picked by id, as gguf.quants.dequantize gives them (to 1 ulp: contraction)."""
    rng = np.random.default_rng(int(qtype))
    blocks = random_blocks(rng, qtype, 37, 512)
    want = torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float32))
    w = torch.from_numpy(blocks)
    torch.testing.assert_close(ops.dequantize_rows(w, int(qtype)), want, rtol=1e-6, atol=1e-7)
    ids = torch.tensor([36, 0, 5, 5], dtype=torch.int64)
    torch.testing.assert_close(ops.dequantize_rows(w, qtype.name, ids), want[ids], rtol=1e-6, atol=1e-7)


def test_dequantize_rows_rejects_bad_input():
    w = torch.from_numpy(random_blocks(np.random.default_rng(0), T.Q8_0, 4, 64))
    with pytest.raises(InvalidRequest, match="outside"):
        ops.dequantize_rows(w, "Q8_0", torch.tensor([4]))
    with pytest.raises(InvalidRequest, match="unsupported quant type"):
        ops.dequantize_rows(w, int(T.IQ4_NL))  # no kernels
    with pytest.raises(InvalidRequest, match="whole"):
        ops.dequantize_rows(w[:, :-1].contiguous(), "Q8_0")


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_two_stage_activations_are_near_fp32(qtype):
    """x_stages=2 dots x's int8 residual too: its error against the exact product is within the
    one-stage bound / 254 (plus fp32 rounding), where one stage alone is not."""
    rng = np.random.default_rng(1)
    blocks = random_blocks(rng, qtype, 64, 512)
    w = torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float32)).double()
    x = torch.randn(3, 512) * torch.linspace(0.1, 4, 512)  # uneven magnitudes inside blocks
    exact = x.double() @ w.T
    amax = x.abs().view(3, -1, 32).amax(-1).repeat_interleave(32, -1).double()  # [3, 512]
    bound1 = (amax / 254) @ w.abs().T
    one = ops.linear_quant(x, torch.from_numpy(blocks), int(qtype)).double()
    two = ops.linear_quant(x, torch.from_numpy(blocks), int(qtype), x_stages=2).double()
    fp32 = 1e-5 * (x.double().abs() @ w.abs().T)
    assert bool(((two - exact).abs() <= bound1 / 254 * 1.01 + fp32).all())
    assert (one - exact).abs().max() > 20 * (two - exact).abs().max()


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 5, 7, 33])
def test_f32_x_equals_the_dequantized_product(cpu_isa, qtype, m):
    """x_stages=0 (x kept in f32, weight tiles dequantized in cache) is the exact product with the
    dequantized matrix to fp32 rounding, bias added, for tails of rows and weight rows (n = 37:
    two full 16-row tiles and 5 rows), strided x and out."""
    rng = np.random.default_rng(10 + m)
    blocks = random_blocks(rng, qtype, 37, 512)
    w = torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float32)).double()
    x = (torch.randn(m, 600) * torch.linspace(0.1, 4, 600))[:, :512]  # rows 600 apart
    bias = torch.randn(37)
    out = torch.full((m, 50), float("nan"))[:, :37]
    got = ops.linear_quant(x, torch.from_numpy(blocks), int(qtype), out=out, x_stages=0)
    exact = x.double() @ w.T
    assert got.data_ptr() == out.data_ptr()
    tol = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-30
    assert bool(((got.double() - exact).abs() <= tol).all())
    contiguous = ops.linear_quant(x.contiguous(), torch.from_numpy(blocks), int(qtype), x_stages=0)
    assert torch.equal(contiguous, got)  # strides change nothing
    from kog.program.interpreter import quant_matmul

    if m >= interp.QUANT_F32_X_MIN_ROWS:  # the interpreter's path for this m, bias included
        qw = QuantizedWeight(torch.from_numpy(blocks), int(qtype), 512)
        assert torch.equal(quant_matmul(x, qw, bias), got + bias)


def test_f32_x_needs_float32_x():
    blocks = torch.from_numpy(random_blocks(np.random.default_rng(0), T.Q8_0, 4, 64))
    with pytest.raises(InvalidRequest, match="float32"):
        ops.linear_quant(torch.randn(2, 64).bfloat16(), blocks, "Q8_0", x_stages=0)
    with pytest.raises(InvalidRequest, match="x_stages"):
        ops.linear_quant(torch.randn(2, 64), blocks, "Q8_0", x_stages=3)


def test_cat_rows_keeps_blocks_of_one_type_and_requantizes_mixed_ones():
    rng = np.random.default_rng(2)
    a = QuantizedWeight(torch.from_numpy(random_blocks(rng, T.Q4_K, 8, 256)), int(T.Q4_K), 256)
    b = QuantizedWeight(torch.from_numpy(random_blocks(rng, T.Q4_K, 4, 256)), int(T.Q4_K), 256)
    c = QuantizedWeight(torch.from_numpy(random_blocks(rng, T.Q6_K, 4, 256)), int(T.Q6_K), 256)
    same = cat_rows([a, b])
    assert same.qtype == int(T.Q4_K) and torch.equal(same.data, torch.cat([a.data, b.data]))
    mixed = cat_rows([a, c])
    want = torch.cat([a.dequantize(), c.dequantize()])
    assert mixed.qtype == int(T.Q8_0) and mixed.shape == (12, 256)
    amax = want.abs().view(12, -1, 32).amax(-1).repeat_interleave(32, -1)
    # Q8_0: half a step (amax / 254) plus the fp16 rounding of d (127 d 2^-11 = amax / 2048).
    assert bool(((mixed.dequantize() - want).abs() <= amax * (1 / 254 + 1 / 2048) + 1e-7).all())


# ---- tiny quantized models -----------------------------------------------------------------------

TOK = tiny_tokenizer()


def quantize_model(weights: dict, qtype: T) -> dict:
    """The matrices of a float weight dict as QuantizedWeight (norms and biases stay f32)."""
    out = {}
    for name, w in weights.items():
        if w.dim() != 2:
            out[name] = w
            continue
        a = w.float().numpy()
        blocks = ENCODERS[qtype](a) if qtype in ENCODERS else quants.quantize(a, qtype)
        out[name] = QuantizedWeight(torch.from_numpy(np.ascontiguousarray(blocks)), int(qtype), w.shape[1])
    return out


def models(family: str, qtype: T) -> tuple[LoadedModel, LoadedModel]:
    """(quantized, the same weights dequantized to fp32)."""
    big = qtype in (T.Q4_K, T.Q5_K, T.Q6_K)  # K-quants need rows of whole 256-element super-blocks
    config = tiny_config(family, **(dict(hidden_size=256, intermediate_size=512, head_dim=64) if big else {}))
    q = quantize_model(random_weights(config, seed=7), qtype)
    f = {n: w.dequantize() if isinstance(w, QuantizedWeight) else w for n, w in q.items()}
    mk = lambda w: LoadedModel(path=None, config=config, weights=w, dtype=torch.float32, tokenizer=TOK,  # noqa: E731
                               chat_template=None, stop_token_ids=())
    return mk(q), mk(f)


def decode_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill each prompt but its last token, then one batched decode step of the last tokens."""
    from kog.models.runner import PrefillChunk

    bs = runner.block_size
    chunks, tables = [], []
    for i, p in enumerate(prompts):
        table = np.arange(i * 8, i * 8 + 8, dtype=np.int32)
        tables.append(table)
        chunks.append(PrefillChunk(p[:-1], 0, table, (table[np.arange(len(p) - 1) // bs] * bs
                                                      + np.arange(len(p) - 1) % bs).astype(np.int64)))
    runner.prefill(chunks)
    pos = np.array([len(p) - 1 for p in prompts])
    tables = np.stack(tables)
    slots = tables[np.arange(len(prompts)), pos // bs].astype(np.int64) * bs + pos % bs
    return runner.decode([p[-1] for p in prompts], pos, tables, pos + 1, slots)


CASES = [("llama", T.Q8_0), ("qwen2", T.Q4_0), ("qwen3", T.Q4_1), ("llama", T.Q4_K), ("qwen2", T.Q5_0),
         ("llama", T.Q5_1), ("qwen3", T.Q5_K), ("llama", T.Q6_K)]


@pytest.mark.parametrize("family,qtype", CASES, ids=lambda c: getattr(c, "name", c))
def test_executor_quant_linear_equals_ops_linear_quant(family, qtype):
    """Stopped after the first LINEAR (qkv), the executor's buffer equals kog.ops.linear_quant
    (x_stages 2) of its input (+ bias), bit for bit, for a batch of 3 rows."""
    qm, _ = models(family, qtype)
    runner = ModelRunner(qm, num_kv_blocks=32, block_size=4)
    ex = runner._executor
    i_lin = next(i for i, ins in enumerate(runner.program) if ins.opcode == 2)
    tokens = np.array([3, 9, 17], dtype=np.int64)
    pos = np.zeros(3, dtype=np.int64)
    tables = np.arange(3, dtype=np.int32).reshape(3, 1)
    slots = tables[:, 0].astype(np.int64) * 4
    logits = torch.empty(3, qm.config.vocab_size)
    ex.run(3, tokens.ctypes.data, pos.ctypes.data, tables.ctypes.data, 1, (pos + 1).astype(np.int32).ctypes.data,
           slots.ctypes.data, logits.data_ptr(), 0, i_lin + 1)
    d = model_dims(qm.config, torch.float32)
    normed = torch.empty(3, d.buffer_width(3))
    ex.read_buffer(3, normed.data_ptr(), normed.numel() * 4)
    qkv = torch.empty(3, d.buffer_width(4))
    ex.read_buffer(4, qkv.data_ptr(), qkv.numel() * 4)
    w = runner.weights["model.layers.0.self_attn.qkv_proj.weight"]
    want = ops.linear_quant(normed, w.data, w.qtype, x_stages=2)
    if qm.config.attention_bias:
        want += runner.weights["model.layers.0.self_attn.qkv_proj.bias"]
    assert torch.equal(qkv, want)
    # EMBED (into RESIDUAL, which layer 0's first norm only reads): each token's row, dequantized.
    residual = torch.empty(3, d.buffer_width(2))
    ex.read_buffer(2, residual.data_ptr(), residual.numel() * 4)
    assert torch.equal(residual, runner.weights["model.embed_tokens.weight"].dequantize(torch.from_numpy(tokens)))


@pytest.mark.parametrize("family,qtype", CASES, ids=lambda c: getattr(c, "name", c))
def test_tiny_quant_model_logits_near_fp32(family, qtype):
    """Decode (batch 4) and prefill logits of the quantized model vs the same weights in fp32:
    prefill of many rows (dequantized tiles) is exact to fp32 rounding; decode within 1e-3 of
    the logits' scale (two-stage int8 activations)."""
    qm, fm = models(family, qtype)
    prompts = [[3 + (7 * i + j) % 40 for j in range(5 + 3 * i)] for i in range(4)]
    got = decode_logits(ModelRunner(qm, num_kv_blocks=64, block_size=4), prompts)
    want = decode_logits(ModelRunner(fm, num_kv_blocks=64, block_size=4), prompts)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-3 * scale
    from kog.models.runner import PrefillChunk

    long = [3 + i % 50 for i in range(37)]
    ch = PrefillChunk(long, 0, np.arange(16, dtype=np.int32), np.arange(len(long), dtype=np.int64))
    lf = ModelRunner(fm, num_kv_blocks=64, block_size=4).prefill([ch], all_logits=True)[0]
    # f32 x through in-cache weight tiles (x_stages 0), then f32 tiles + torch's GEMM: both exact
    # products. The last row (LM head over the sampled rows) is a 1-row int8 GEMV.
    for gemm_rows in (interp.QUANT_GEMM_MIN_ROWS, 8):
        saved, interp.QUANT_GEMM_MIN_ROWS = interp.QUANT_GEMM_MIN_ROWS, gemm_rows
        try:
            lq = ModelRunner(qm, num_kv_blocks=64, block_size=4).prefill([ch], all_logits=True)[0]
        finally:
            interp.QUANT_GEMM_MIN_ROWS = saved
        torch.testing.assert_close(lq[:-1], lf[:-1], rtol=1e-4, atol=1e-4 * float(lf.abs().max()))


def test_decode_loop_and_forks_run_a_quantized_model():
    """Loop mode (16 steps per call) gives the tokens of one step at a time on a Q4_1 model,
    greedy and n=2 sampled forks of one prompt."""
    qm, _ = models("llama", T.Q4_1)

    def run(max_steps):
        runner = ModelRunner(qm, num_kv_blocks=96, block_size=4)
        engine = LLMEngine(runner, TOK, [TOK.eos_token_id], 256, EngineConfig(max_num_seqs=8))
        engine.decode_loop.max_steps = max_steps
        reqs = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)]
        for i, p in enumerate(reqs):
            engine.add_request(f"r{i}", [5, 6, 7, 8 + i], p)
        while engine.has_unfinished():
            engine.step()
        return [[o.token_ids for o in engine.get_output(f"r{i}").outputs] for i in range(2)]

    loop, one = run(16), run(1)
    assert loop == one and len(loop[1]) == 2 and all(len(t) == 30 for r in loop for t in r)


# ---- program validation and refusals ------------------------------------------------------------

def test_validate_program_checks_w_type():
    qm, fm = models("llama", T.Q8_0)
    runner = ModelRunner(qm, num_kv_blocks=8, block_size=4)
    ops_ = lower_program(runner.program, runner.weights)
    dims = model_dims(qm.config, torch.float32)
    q8_r8 = ops.PACKED_QUANT_TYPES["Q8_0_R8"][0]  # the runner's row-interleaved Q8_0
    assert {o.w_type for o in ops_} == {_C.WEIGHT_RUN_DTYPE, q8_r8}
    _C.validate_program(ops_, dims)

    def with_type(i, t):
        o = ops_[i]
        return ops_[:i] + [_C.Op(o.opcode, o.layer, o.in_, o.residual, o.out, o.w0, o.w1, o.deps, w_type=t)] + ops_[i + 1:]

    norm = next(i for i, o in enumerate(ops_) if o.opcode == 1)
    with pytest.raises(InvalidRequest, match="only EMBED, LINEAR and MOE_EXPERTS"):
        _C.validate_program(with_type(norm, int(T.Q8_0)), dims)
    lin = next(i for i, o in enumerate(ops_) if o.opcode == 2)
    with pytest.raises(InvalidRequest, match=f"weight type {int(T.IQ4_NL)} .*Q5_1=7.*Q5_1_R8=263"):
        _C.validate_program(with_type(lin, int(T.IQ4_NL)), dims)  # the message lists the supported types
    with pytest.raises(InvalidRequest, match="not whole Q4_K blocks"):
        _C.validate_program(with_type(lin, int(T.Q4_K)), dims)  # hidden 64 < 256
    with pytest.raises(InvalidRequest, match="run dtype is bf16|run dtype is bfloat16"):
        _C.validate_program(ops_, model_dims(qm.config, torch.bfloat16))
    # a packed EMBED table of vocab rows must hold whole groups of 8
    odd = model_dims(dataclasses.replace(qm.config, vocab_size=qm.config.vocab_size - 4), torch.float32)
    with pytest.raises(InvalidRequest, match="not whole groups of 8"):
        _C.validate_program(ops_, odd)
    with pytest.raises(InvalidRequest, match="not whole groups of 8"):
        _C.validate_program(with_type(lin, int(T.Q8_0)), odd)
    with pytest.raises(InvalidRequest, match="dtype=\"bfloat16\""):
        _C.expand_gpu_program(ops_, dims)


def test_gguf_quant_types_and_truncation(tmp_path, caplog):
    """dtype None keeps Q8_0 blocks; dtype float32 dequantizes; a type without kernels is kept as
    Q8_0 (one warning naming it and the bytes); a truncated file is a ModelLoadError."""
    import gguf

    config = tiny_config("llama")
    path = write_gguf_model(tmp_path / "m.gguf", config, random_weights(config), qtype="Q8_0")
    kept = load_model(path, progress=False)
    assert kept.dtype == torch.float32
    assert isinstance(kept.weights["model.layers.0.mlp.down_proj.weight"], QuantizedWeight)
    assert isinstance(kept.weights["model.norm.weight"], torch.Tensor)
    floats = load_model(path, dtype="float32", progress=False)
    assert all(isinstance(w, torch.Tensor) for w in floats.weights.values())
    # IQ4_NL (llama.cpp's 4-bit non-linear blocks: fp16 d + 16 bytes of indices, any bytes valid;
    # Kog has no kernel): re-encoded as Q8_0, within Q8_0's rounding of the values gguf decodes.
    writer = gguf.GGUFWriter(str(tmp_path / "iq4.gguf"), "llama")
    src = gguf.GGUFReader(str(path))
    for f in src.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        from kog.loader.gguf_write import add_value

        add_value(writer, f.name, f.contents())
    for t in src.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
            [int(x) for x in reversed(t.shape)])
        if t.name == "blk.1.ffn_up.weight":
            blocks = np.random.default_rng(0).integers(0, 256, (data.shape[0], data.shape[1] // 32, 18), dtype=np.uint8)
            blocks[..., :2] = np.full(blocks.shape[:2], 0.01, np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
            writer.add_tensor(t.name, blocks.reshape(data.shape[0], -1), raw_dtype=T.IQ4_NL)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with caplog.at_level(logging.WARNING, logger="kog"):
        iq4 = load_model(tmp_path / "iq4.gguf", progress=False)
    assert "1 tensors of type IQ4_NL have no native kernels: re-encoded as Q8_0" in caplog.text
    up = iq4.weights["model.layers.1.mlp.up_proj.weight"]
    assert isinstance(up, QuantizedWeight) and up.type_name == "Q8_0"
    want = load_model(tmp_path / "iq4.gguf", dtype="float32", progress=False).weights["model.layers.1.mlp.up_proj.weight"]
    amax = want.abs().view(want.shape[0], -1, 32).amax(-1).repeat_interleave(32, -1)
    assert bool(((up.dequantize() - want).abs() <= amax * (1 / 254 + 1 / 2048) + 1e-7).all())
    logits = decode_logits(ModelRunner(iq4, num_kv_blocks=64, block_size=4), [[3, 5, 7, 9]])  # and it runs
    assert logits.shape == (1, config.vocab_size) and bool(logits.isfinite().all())
    # Q8_1 (llama.cpp's activation blocks, which gguf does not decode): refused naming the tensor,
    # its type and what Kog runs, with either dtype.
    for t in src.tensors:  # the same file with blk.1.ffn_up.weight in Q8_1 this time
        if t.name == "blk.1.ffn_up.weight":
            rows, cols = int(t.shape[1]), int(t.shape[0])
            q81 = np.zeros((rows, cols // 32 * 40), np.uint8)  # d, s (f32) + 32 int8
    writer = gguf.GGUFWriter(str(tmp_path / "q81.gguf"), "llama")
    for f in src.fields.values():
        if not (f.name.startswith("GGUF.") or f.name == "general.architecture"):
            add_value(writer, f.name, f.contents())
    for t in src.tensors:
        if t.name == "blk.1.ffn_up.weight":
            writer.add_tensor(t.name, q81, raw_dtype=T.Q8_1)
        else:
            writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
                [int(x) for x in reversed(t.shape)]))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    for dtype in (None, "float32"):
        with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight.*unsupported type Q8_1.*Q4_0.*Q6_K"):
            load_model(tmp_path / "q81.gguf", dtype=dtype, progress=False)
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(tmp_path / "cut.gguf", progress=False)
