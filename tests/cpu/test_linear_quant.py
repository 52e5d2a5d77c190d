"""The quantized linear kernels (every GGUF type, every supported ISA) against gguf's dequantizer.

Two references per case, W = gguf.quants.dequantize(blocks):
- tight: x quantized per 32-block as the kernel does (reference.quantize_activations), then an fp64
  product; only the fp32 summation order differs: 1e-5 of sum |W| |xq|.
- true: x @ W.T in fp64; off by the activation quantization, at most sum_i |W_i| amax_block / 254
  per output (reference.linear_quant_bound), plus the fp32 slack above.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

import kog
from kog import _C, ops
from kog.loader import resolve_model
from kog.loader.gguf_file import GGUFFile
from kog.testing import reference as ref

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
GGUF_QUANTIZES = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}  # gguf.quants.quantize implements these


def random_blocks(rng: np.random.Generator, qtype: T, n: int, k: int) -> np.ndarray:
    """[n, row_bytes] uint8 blocks of qtype for an [n, k] matrix, valid and random."""
    if qtype in GGUF_QUANTIZES:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    elems, nbytes = quants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    # fp16 d (and dmin) of moderate size and either sign: random bits could be inf/nan or 6e4.
    n_halves = 1 if qtype == T.Q6_K else 2
    halves = rng.uniform(-0.05, 0.05, size=(n, k // elems, n_halves)).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        blocks[..., nbytes - 2:] = halves.reshape(n, k // elems, 2)  # d is the block's last field
    else:
        blocks[..., :4] = halves.reshape(n, k // elems, 4)  # d, dmin lead the block
    return blocks.reshape(n, -1)


def check(x: torch.Tensor, blocks: np.ndarray, qtype: T) -> None:
    w = torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float32))  # [n, k]
    out = ops.linear_quant(x, torch.from_numpy(blocks), int(qtype))
    assert out.dtype == torch.float32 and out.shape == (*x.shape[:-1], w.shape[0])
    x2 = x.reshape(-1, x.shape[-1])
    out2 = out.reshape(-1, w.shape[0]).double()
    xq, d = ref.quantize_activations(x2)
    xq_scaled = (xq.reshape(xq.shape[0], -1, 32) * d[..., None]).reshape(xq.shape).double()
    slack = 1e-5 * (xq_scaled.abs() @ w.double().abs().T) + 1e-6
    tight = xq_scaled @ w.double().T
    err = (out2 - tight).abs()
    assert bool((err <= slack).all()), f"tight: max excess {(err - slack).max().item():.3g}"
    true = x2.double() @ w.double().T
    bound = ref.linear_quant_bound(x2, w) * (1 + 1e-5) + slack
    err = (out2 - true).abs()
    assert bool((err <= bound).all()), f"true: max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 8, 33])
@pytest.mark.parametrize("n", [1, 7, 45])
@pytest.mark.parametrize("blocks_per_row", [1, 3, 7])  # the unrolled loop: 2 + 1, 4 + 2 + 1
def test_linear_quant_matches_dequantized(cpu_isa, qtype, m, n, blocks_per_row):
    rng = np.random.default_rng(hash((qtype, m, n, blocks_per_row)) % 2**32)
    k = quants.GGML_QUANT_SIZES[qtype][0] * blocks_per_row
    blocks = random_blocks(rng, qtype, n, k)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    check(x, blocks, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_quant_large_parallel(cpu_isa, qtype):
    """Many rows (the threaded path), several superblocks, odd n, x with outliers and zero blocks."""
    rng = np.random.default_rng(7)
    n, k = 1003, 768
    blocks = random_blocks(rng, qtype, n, k)
    x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))
    x[0, 100] = 40.0  # one outlier: its block's scale is large
    x[1, 64:96] = 0.0  # an all-zero block: scale 0
    check(x, blocks, qtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_quant_half_inputs_and_strided_rows(cpu_isa, dtype):
    rng = np.random.default_rng(3)
    blocks = random_blocks(rng, T.Q4_K, 33, 512)
    base = torch.from_numpy(rng.standard_normal((4, 600)).astype(np.float32)).to(dtype)
    x = base[:, :512]  # rows 600 apart
    out = ops.linear_quant(x, torch.from_numpy(blocks), "Q4_K")
    assert torch.equal(out, ops.linear_quant(x.float().contiguous(), torch.from_numpy(blocks), "Q4_K"))
    check(x.float(), blocks, T.Q4_K)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_linear_quant_non_finite_x_gives_nan(cpu_isa, bad):
    """A NaN or inf in a row of x makes that row's outputs NaN (not a silently finite number)."""
    rng = np.random.default_rng(2)
    for qtype in (T.Q4_1, T.Q5_0, T.Q4_K):
        blocks = torch.from_numpy(random_blocks(rng, qtype, 9, 512))
        x = torch.randn(3, 512)
        x[1, 300] = bad
        out = ops.linear_quant(x, blocks, int(qtype))
        assert out[1].isnan().all() and out[[0, 2]].isfinite().all()


def test_linear_quant_isas_agree(gen):
    """Every ISA gives the same result up to fp32 summation order (same integer dots)."""
    rng = np.random.default_rng(11)
    x = torch.randn(3, 512, generator=gen)
    default = _C.build_info()["cpu_isa"]
    try:
        for qtype in TYPES:
            blocks = torch.from_numpy(random_blocks(rng, qtype, 19, 512))
            outs = []
            for isa in _C.cpu_isas_supported():
                _C.set_cpu_isa(isa)
                outs.append(ops.linear_quant(x, blocks, int(qtype)))
            w = torch.from_numpy(quants.dequantize(blocks.numpy(), qtype).astype(np.float32))
            slack = 1e-5 * (x.abs() @ w.abs().T) + 1e-6  # fp32 summation order, as in check()
            for o in outs[1:]:
                assert bool(((o - outs[0]).abs() <= slack).all()), qtype.name
    finally:
        _C.set_cpu_isa(default)


@pytest.fixture(scope="module")
def smollm2_blocks() -> dict[str, tuple[np.ndarray, T]]:
    """A few tensors of the default model's GGUF (resolved as kog.LLM() does: the installed
    package, the cache, or one fetch from the package index, as the other SmolLM2 tests)."""
    f = GGUFFile(resolve_model(None))
    wanted = {"blk.0.attn_q.weight": None, "blk.0.ffn_down.weight": None, "token_embd.weight": 300}
    out = {}
    for name, rows in wanted.items():
        info = f.tensors[name]
        out[name] = (np.array(f.data(info).reshape(info.shape[-1], -1)[:rows]), info.qtype)
    return out


def test_linear_quant_real_smollm2_blocks(cpu_isa, smollm2_blocks):
    """Blocks as llama.cpp wrote them (the default model: Q4_1 layers, a Q8_0 embedding)."""
    rng = np.random.default_rng(5)
    assert {qtype for _, qtype in smollm2_blocks.values()} == {T.Q4_1, T.Q8_0}
    for blocks, qtype in smollm2_blocks.values():
        k = blocks.shape[1] // quants.GGML_QUANT_SIZES[qtype][1] * quants.GGML_QUANT_SIZES[qtype][0]
        check(torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32)), blocks, qtype)


def test_quant_types_mirror_gguf():
    """kog's type ids and block sizes are ggml's."""
    for name, (type_id, elems, nbytes) in ops.QUANT_TYPES.items():
        assert T[name] == type_id
        assert quants.GGML_QUANT_SIZES[T[name]] == (elems, nbytes)
    assert set(ops.QUANT_TYPES) == {t.name for t in TYPES}


@pytest.mark.parametrize(
    "qtype, k, match",
    [(T.Q8_0, 48, "multiple of the Q8_0 block of 32"), (T.Q4_K, 288, "multiple of the Q4_K block of 256")],
)
def test_linear_quant_bad_k(qtype, k, match):
    elems, nbytes = quants.GGML_QUANT_SIZES[qtype]
    # A row of whole blocks gives a good k through ops; the raw binding sees the caller's k.
    w = torch.zeros(4, (k + elems - 1) // elems * nbytes, dtype=torch.uint8)
    x = torch.randn(1, k)
    out = torch.empty(1, 4)
    with pytest.raises(kog.InvalidRequest, match=match):
        _C.linear_quant(out.data_ptr(), x.data_ptr(), w.data_ptr(), w.numel(), 1, 4, k, k, 4, 0, int(qtype))


def test_linear_quant_bad_input():
    w = torch.zeros(4, 34, dtype=torch.uint8)
    x = torch.randn(1, 32)
    out = torch.empty(1, 4)
    with pytest.raises(kog.InvalidRequest, match="unsupported quant type 9"):
        _C.linear_quant(out.data_ptr(), x.data_ptr(), w.data_ptr(), w.numel(), 1, 4, 32, 32, 4, 0, 9)
    with pytest.raises(kog.InvalidRequest, match="needs 136 bytes"):
        _C.linear_quant(out.data_ptr(), x.data_ptr(), w.data_ptr(), 100, 1, 4, 32, 32, 4, 0, int(T.Q8_0))
    with pytest.raises(kog.InvalidRequest, match="unsupported quant type"):
        ops.linear_quant(x, w, "Q2_K")
    with pytest.raises(kog.InvalidRequest, match="unsupported quant type 1"):
        ops.linear_quant(x, w, 1)  # F16: not a block format
    with pytest.raises(kog.InvalidRequest, match="whole 34-byte blocks"):
        ops.linear_quant(x, torch.zeros(4, 35, dtype=torch.uint8), "Q8_0")
    with pytest.raises(kog.InvalidRequest, match="last dimension 32"):
        ops.linear_quant(torch.randn(1, 64), w, "Q8_0")
    with pytest.raises(kog.InvalidRequest, match="uint8"):
        ops.linear_quant(x, w.float(), "Q8_0")
