"""Row-interleaved (packed) quantized matrices: Q4_0_R8, Q4_1_R8, Q5_0_R8, Q5_1_R8, Q8_0_R8, Q4_K_R8,
Q5_K_R8, Q6_K_R8 (kog.quantized.pack_rows).

The packed form holds a file form's blocks with 8 rows interleaved per 32 columns; every kernel
that reads blocks (decode GEMV, f32-x tiles, row dequantization) must give what it gives on the
file form: exactly for dequantization, within the activation-rounding bound for the GEMV.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from test_quant_model import ENCODERS, decode_logits, models

from kog import _C, ops
from kog.errors import InvalidRequest
from kog.models import ModelRunner
from kog.quantized import QuantizedWeight, can_pack, cat_rows, pack_rows, unpack_rows

PACKABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# Per-element bound of x's rounding relative to amax of its 32-element unit, by x_stages (0: f32 x).
X_ERR = {0: 0.0, 1: 1 / 254, 2: 1 / 64516}


K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)  # rows of whole 256-element super-blocks


def matrix(qtype: T, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = ENCODERS[qtype](w) if qtype in ENCODERS else quants.quantize(w, qtype)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(blocks)), int(qtype), k)


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_pack_keeps_bytes_and_rows(cpu_isa, qtype):
    for n, k in [(8, 32), (24, 96), (64, 576)]:
        k = k * 8 if qtype in K_QUANTS else k  # whole 256-element super-blocks
        w = matrix(qtype, n, k, seed=n)
        p = pack_rows(w)
        assert p.packed and p.file_type_name == qtype.name and p.type_name == qtype.name + "_R8"
        assert p.data.shape == w.data.shape and not torch.equal(p.data, w.data)
        assert torch.equal(unpack_rows(p).data, w.data)
        want = w.dequantize()
        assert torch.equal(p.dequantize(), want)  # every row, gathered from its group
        ids = torch.tensor([n - 1, 0, 5, 5, n // 2], dtype=torch.int64)
        assert torch.equal(p.dequantize(ids), want[ids])
        assert torch.equal(p.dequantize(slice(3, n - 2)), want[3:n - 2])


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("stages", [0, 1, 2])
def test_packed_linear_within_the_rounding_bound(cpu_isa, qtype, stages):
    """x @ W^T on the packed form vs the exact f64 product of the dequantized weights: within
    sum_i |W_ri| amax(unit of i) * X_ERR[stages] (+ f32 rounding), like the file form; and the
    two forms agree to that bound."""
    n, k = 40, 512 if qtype in K_QUANTS else 544
    w = matrix(qtype, n, k, seed=int(qtype))
    p = pack_rows(w)
    wf = w.dequantize().double()
    for m in (1, 2, 3, 5, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        exact = x.double() @ wf.T
        amax = x.double().view(m, k // 32, 32).abs().amax(-1)
        bound = (amax @ wf.abs().view(n, k // 32, 32).sum(-1).T) * X_ERR[stages] + 1e-5 * exact.abs().max()
        packed = ops.linear_quant(x, p.data, p.qtype, x_stages=stages).double()
        plain = ops.linear_quant(x, w.data, w.qtype, x_stages=stages).double()
        assert ((packed - exact).abs() <= bound).all(), ((packed - exact).abs() / bound).max()
        assert ((packed - plain).abs() <= 2 * bound).all()


def test_packed_linear_reads_strided_rows_of_x():
    w = pack_rows(matrix(T.Q8_0, 16, 64))
    x = torch.randn(3, 128)[:, :64]
    torch.testing.assert_close(ops.linear_quant(x, w.data, w.qtype, x_stages=2),
                               ops.linear_quant(x.contiguous(), w.data, w.qtype, x_stages=2), rtol=0, atol=0)


def test_what_cannot_be_packed_is_refused():
    odd = matrix(T.Q8_0, 12, 64)
    assert not can_pack(odd)
    # every type with kernels has a packed form
    assert {v[1] for v in ops.PACKED_QUANT_TYPES.values()} == {v[0] for v in ops.QUANT_TYPES.values()}
    with pytest.raises(InvalidRequest, match="no packed form"):
        pack_rows(odd)
    p = pack_rows(matrix(T.Q4_1, 16, 64))
    assert not can_pack(p)  # already packed
    with pytest.raises(InvalidRequest, match="packed"):
        cat_rows([p, p])
    r8 = ops.PACKED_QUANT_TYPES["Q8_0_R8"][0]
    with pytest.raises(InvalidRequest, match="8-row groups"):
        _C.linear_quant(torch.empty(1, 12).data_ptr(), torch.zeros(1, 64).data_ptr(), odd.data.data_ptr(),
                        odd.nbytes, 1, 12, 64, 64, 12, 0, r8, 2)
    with pytest.raises(InvalidRequest, match="8-row groups"):
        ops.dequantize_rows(odd.data, r8)
    # An expert stack packs only when each expert's rows are whole groups.
    assert can_pack(matrix(T.Q8_0, 32, 64), rows=16) and not can_pack(matrix(T.Q8_0, 24, 64), rows=12)


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_runner_packs_and_decodes_like_the_file_form(monkeypatch, qtype):
    """The CPU runner holds every packable matrix packed (KOG_PACK_QUANT=0: as in the file), and
    decode logits of both agree to the activation rounding (~1e-4 of the logits' scale)."""
    qm, _ = models("llama", qtype)
    prompts = [[3 + (5 * i + j) % 40 for j in range(4 + 2 * i)] for i in range(3)]
    packed = ModelRunner(qm, num_kv_blocks=64, block_size=4)
    assert {w.type_name for w in packed.weights.values() if isinstance(w, QuantizedWeight)} == {qtype.name + "_R8"}
    monkeypatch.setenv("KOG_PACK_QUANT", "0")
    plain = ModelRunner(qm, num_kv_blocks=64, block_size=4)
    assert {w.type_name for w in plain.weights.values() if isinstance(w, QuantizedWeight)} == {qtype.name}
    assert packed.weight_bytes == plain.weight_bytes
    got, want = decode_logits(packed, prompts), decode_logits(plain, prompts)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("stages", [1, 2])
def test_packed_linear_is_the_same_bits_on_every_simd_isa(qtype, stages):
    """The packed group dots sum a unit's integer products exactly (VNNI dpbusd / dpwssd in the
    AVX-512 table, maddubs / madd in the AVX2 one) and then apply the scales in the same order:
    bit-identical outputs on every SIMD table, for any rows of x (1 to 4 columns per pass and a
    remainder) and matrices that are not a multiple of a thread's share. A kernel form that
    reorders the float work shows here first."""
    simd = [isa for isa in _C.cpu_isas_supported() if isa != "generic"]
    if len(simd) < 2:
        pytest.skip(f"one SIMD kernel table on this CPU ({simd}): nothing to compare")
    n, k = 200, 1088  # 25 groups of 8 rows, 34 units of 32
    p = pack_rows(matrix(qtype, n, k, seed=7))
    default = _C.build_info()["cpu_isa"]
    try:
        for m in (1, 2, 3, 5):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m)) * 3
            outs = []
            for isa in simd:
                _C.set_cpu_isa(isa)
                outs.append(ops.linear_quant(x, p.data, p.qtype, x_stages=stages))
            for isa, out in zip(simd[1:], outs[1:]):
                assert torch.equal(out, outs[0]), (isa, m, (out - outs[0]).abs().max())
    finally:
        _C.set_cpu_isa(default)
