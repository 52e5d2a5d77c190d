"""Prefill over the GPU decode kernel's weight formats (kog.int4.Int4Weight, kog.fp8.Fp8Weight):
what ModelRunner on a GPU runs for a quantized model, checked here on the CPU (the interpreter
and the dequantization are torch on whatever device the tensors live on).

The contract: prefill over a matrix kept 4-bit / FP8 computes what the same model computes with
that matrix dequantized to the run dtype at load, bit for bit (same values, same GEMM)."""

import gguf
import numpy as np
import pytest
import torch

from kog import _C
from kog.fp8 import Fp8Weight, quantize
from kog.int4 import from_quantized
from kog.kvcache import KVCacheStorage, KVLayout
from kog.loader import load_model
from kog.loader.gguf_write import quantize_q4_k
from kog.models.decode import schedule_for
from kog.models.weights import prepare_weights
from kog.ops import rope_inv_freq
from kog.program import Buffer, Opcode
from kog.program.batch import TokenBatch
from kog.program.interpreter import GPU_FORMATS, ProgramInterpreter, dequant_matmul
from kog.quantized import QuantizedWeight
from kog.testing.tiny_models import random_weights, tiny_config, write_gguf_model

Q = gguf.GGMLQuantizationType


def blocks(name: str, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """A random matrix quantized to `name` by gguf's own encoder (Q4_K: Kog's, gguf has none)."""
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    data = quantize_q4_k(x) if name == "Q4_K" else gguf.quants.quantize(x, Q[name])
    return QuantizedWeight(torch.from_numpy(data), int(Q[name]), cols)


@pytest.mark.parametrize("name,rows,cols", [("Q4_0", 5, 64), ("Q4_1", 9, 96), ("Q4_K", 7, 512)])
def test_dequantize_rows_is_the_numpy_reference(name, rows, cols):
    w4 = from_quantized(blocks(name, rows, cols, seed=rows))
    assert torch.equal(w4.dequantize_rows(), w4.dequantize())
    assert torch.equal(w4.dequantize_rows(2, 5), w4.dequantize()[2:5])


def test_fp8_dequantize_rows():
    w8 = quantize(torch.randn(6, 48), "e4m3fn")
    assert torch.equal(w8.dequantize_rows(1, 4), w8.dequantize()[1:4])


@pytest.mark.parametrize("fmt", ["q4", "fp8"])
def test_dequant_matmul_tiles_rows_and_adds_the_bias(monkeypatch, fmt):
    import kog.program.interpreter as interp

    w = from_quantized(blocks("Q4_1", 37, 64, seed=1)) if fmt == "q4" else quantize(torch.randn(37, 64), "e4m3fn")
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    bias = torch.randn(37, dtype=torch.bfloat16)
    whole = dequant_matmul(x, w, bias)
    monkeypatch.setattr(interp, "_DEQUANT_TILE_BYTES", 4 * 64 * 8)  # 8 rows a tile: 5 tiles, the last short
    tiled = dequant_matmul(x, w, bias)
    want = interp.matmul(x, w.dequantize_rows().to(torch.bfloat16), bias)
    assert whole.dtype == torch.bfloat16 and torch.equal(whole, want)
    torch.testing.assert_close(tiled, want, rtol=0, atol=0)


def gpu_form(config, weights: dict, fmt: str) -> dict:
    """The prepared bf16 weights with every matrix only LINEARs read in a GPU format (as
    kog.int4.to_gpu_weights leaves them): Q4_1 / Q4_K blocks made 4-bit (kog.int4), or FP8 per-row
    (kog.fp8)."""
    program = schedule_for(config)
    others = {n for ins in program if ins.opcode != Opcode.LINEAR for n in ins.weights}  # a tied embedding
    linear = {n for ins in program if ins.opcode == Opcode.LINEAR for n in ins.weights} - others
    out = dict(weights)
    for i, name in enumerate(sorted(linear)):
        if name.endswith(".bias") or name not in weights:
            continue
        rows, cols = weights[name].shape
        if fmt == "fp8":
            out[name] = quantize(weights[name].float(), "e4m3fn")
        else:
            out[name] = from_quantized(blocks("Q4_K" if cols % 256 == 0 else "Q4_1", rows, cols, seed=i))
    return out


def prefill_logits(config, weights: dict, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt through the program interpreter (a fresh KV pool)."""
    n = len(prompt)
    layout = KVLayout(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 16, torch.bfloat16)
    kv = KVCacheStorage(layout, -(-n // 16) + 1).kv
    interp = ProgramInterpreter(config, schedule_for(config), weights, kv,
                                rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))
    table = torch.arange(1, -(-n // 16) + 1, dtype=torch.int32)[None, :]
    slots = torch.tensor([int(table[0, p // 16]) * 16 + p % 16 for p in range(n)])
    batch = TokenBatch(ids=torch.tensor(prompt), positions=torch.arange(n), slots=slots, block_tables=table,
                       seq_lens=torch.tensor([n], dtype=torch.int32),
                       query_start_loc=torch.tensor([0, n], dtype=torch.int32))
    return interp.run(batch).buffers[Buffer.LOGITS].float()


@pytest.mark.parametrize("fmt,arch", [("q4", "llama"), ("q4", "qwen2"), ("fp8", "qwen3")])
def test_prefill_over_gpu_formats_is_the_model_dequantized_at_load(fmt, arch):
    c = tiny_config(arch, intermediate_size=256)
    kept = gpu_form(c, prepare_weights(c, random_weights(c, seed=5), torch.bfloat16), fmt)
    assert any(isinstance(w, GPU_FORMATS) for w in kept.values())
    dequantized = {k: w.dequantize_rows().to(torch.bfloat16) if isinstance(w, GPU_FORMATS) else w
                   for k, w in kept.items()}
    prompt = torch.randint(3, c.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    got, want = prefill_logits(c, kept, prompt), prefill_logits(c, dequantized, prompt)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got, want)


def test_a_quantized_gguf_loads_for_the_gpu_with_bf16_activations(tmp_path):
    """dtype None keeps a GGUF's blocks: with f32 activations for the CPU, bf16 for a GPU (the
    decode kernel's quantized GEMVs run bf16); an explicit dtype still dequantizes."""
    c = tiny_config("llama", intermediate_size=256)
    path = write_gguf_model(tmp_path / "m.gguf", c, random_weights(c, seed=2), "Q4_1")
    cpu, gpu = load_model(path), load_model(path, device="cuda")
    assert cpu.dtype == torch.float32 and gpu.dtype == torch.bfloat16
    for m in (cpu, gpu):
        assert any(isinstance(w, QuantizedWeight) for w in m.weights.values())
        assert all(w.dtype == m.dtype for w in m.weights.values() if isinstance(w, torch.Tensor))
    assert not any(isinstance(w, QuantizedWeight) for w in load_model(path, "bfloat16", device="cuda").weights.values())
    # and its Q4_1 matrices become the kernel's 4-bit form, holding the file's values
    from kog.int4 import to_gpu_weights

    prepared = prepare_weights(gpu.config, gpu.weights, gpu.dtype)
    formed = to_gpu_weights(schedule_for(gpu.config), prepared, gpu.dtype)
    kinds = {w.kind for w in formed.values() if isinstance(w, GPU_FORMATS[:1])}
    assert kinds == {_C.WEIGHT_Q4_GROUPS}


def test_fp8_loads_for_the_gpu_as_fp8_with_bf16_activations(tmp_path):
    """quantization="fp8" of an f32 checkpoint: on a GPU its linears stay Fp8Weight (the kernel's
    encoding) with bf16 activations; on the CPU they are dequantized to the checkpoint's f32."""
    from kog.testing.tiny_models import write_hf_model

    c = tiny_config("llama")
    folder = write_hf_model(tmp_path / "m", c, random_weights(c, seed=3))
    gpu = load_model(folder, quantization="fp8", fp8_format="e4m3fn", device="cuda")
    cpu = load_model(folder, quantization="fp8")
    assert gpu.dtype == torch.bfloat16 and cpu.dtype == torch.float32
    assert any(isinstance(w, Fp8Weight) for w in gpu.weights.values())
    assert not any(isinstance(w, Fp8Weight) for w in cpu.weights.values())
    assert load_model(folder, "float32", quantization="fp8", fp8_format="e4m3fn", device="cuda").dtype == torch.float32


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "laneformer_tp"])
def test_kernel_runs_says_what_the_gpu_program_accepts(arch, ranks):
    """kog.models.gpu_decode.kernel_runs (ModelRunner on a GPU decodes through the interpreter
    where it is False) agrees with the C++ GPU program's own refusals, for one device and for
    tensor-parallel rank 1 of 2 (experts placed over the ranks)."""
    import kog
    from kog.models.decode import lower_program, model_dims
    from kog.models.gpu_decode import kernel_runs
    from kog.parallel.ranks import rank_view

    if arch == "laneformer_tp":
        from test_laneformer import VARIANTS, lane_model_config

        c = lane_model_config(**VARIANTS["delay1"])
    else:
        c = tiny_config(arch)
    full = random_weights(c, seed=1)
    if ranks > 1:
        from kog.parallel.shard import shard_weights

        c = rank_view(1, ranks)(c)
        full = shard_weights(c, full)
    weights = prepare_weights(c, full, torch.bfloat16)
    ops = lower_program(schedule_for(c), weights)
    try:
        _C.expand_gpu_program(ops, model_dims(c, torch.bfloat16))
        accepted = True
    except kog.InvalidRequest:
        accepted = False
    assert kernel_runs(c) == kernel_runs(c, weights) == accepted
    # every family's tiny model, Laneformer lanes and experts placed over ranks included
    assert accepted
