"""The GPU decode ops (GEMV, KV append, paged attention decode/prefill, on-device sampling)
against kog.testing.reference on fresh random inputs drawn on the CPU and moved to the device."""

import numpy as np
import pytest
import torch

from kog import _C, ops
from kog.models.gpu_decode import SAMPLING_ROW
from kog.testing import reference as ref
from kog.testing.gpu import gpu_test_marks
from kog.testing.paged import random_paged_cache
from kog.testing.tolerances import assert_close

pytestmark = gpu_test_marks()

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATTN_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
            torch.float16: dict(rtol=2e-3, atol=2e-3)}


def make_cache(gen, seq_lens, n_kv, hd, bs, dtype, spare=5):
    """One layer's cache and shuffled block tables (CPU tensors), padded with block 0."""
    return random_paged_cache(gen, seq_lens, n_kv, hd, bs, dtype, spare_blocks=spare, pad=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 11])
@pytest.mark.parametrize("n,k", [(1, 8), (7, 64), (576, 576), (3000, 1536), (50, 8192)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(gen, device, dtype, m, n, k, bias):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = ops.linear(x.to(device), w.to(device), b.to(device) if bias else None).cpu()
    assert_close(got, ref.linear(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_append_matches_reference(gen, device, dtype):
    cache, _, _ = make_cache(gen, [40], 4, 64, 16, dtype)
    k = torch.randn(6, 4, 64, generator=gen).to(dtype)
    v = torch.randn(6, 4, 64, generator=gen).to(dtype)
    slots = torch.tensor([3, -1, 17, 0, 40, 33], dtype=torch.int64)
    expected = ref.kv_append(k, v, cache, slots)
    got = cache.to(device)
    ops.kv_append(k.to(device), v.to(device), got, slots.to(device))
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,hd,bs", [(4, 4, 64, 16), (6, 2, 128, 16), (16, 2, 64, 32), (8, 1, 256, 16)])
@pytest.mark.parametrize("lens", [[1], [17, 255, 256, 257], [1500, 3]])  # partitions of 256 and their edges
def test_decode_attention_matches_reference(gen, device, dtype, hq, hk, hd, bs, lens):
    cache, table, seq_lens = make_cache(gen, lens, hk, hd, bs, dtype)
    q = torch.randn(len(lens), hq, hd, generator=gen).to(dtype)
    expected = ref.paged_attention(q, cache, table, seq_lens)
    got = ops.paged_attention_decode(q.to(device), cache.to(device), table.to(device), seq_lens.to(device)).cpu()
    assert_close(got, expected, **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,seq_lens", [([5], [5]), ([300, 1, 7], [300, 700, 20]), ([0, 4], [9, 4])])
def test_prefill_attention_matches_reference(gen, device, dtype, q_lens, seq_lens):
    hq, hk, hd, bs = 8, 2, 64, 16
    cache, table, lens = make_cache(gen, seq_lens, hk, hd, bs, dtype)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, hd, generator=gen).to(dtype)
    expected = ref.paged_attention(q, cache, table, lens, qsl)
    got = ops.paged_attention_prefill(q.to(device), cache.to(device), table.to(device), lens.to(device),
                                      qsl.to(device)).cpu()
    assert_close(got, expected, **ATTN_TOL[dtype])


def sample(logits: torch.Tensor, rows: list[tuple], counter: int) -> list[int]:
    arr = np.array(rows, dtype=SAMPLING_ROW)
    r = torch.from_numpy(arr.view(np.uint8).copy()).to(logits.device)
    out = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
    _C.sample_gpu(logits.data_ptr(), logits.shape[0], logits.shape[1], r.data_ptr(), counter, out.data_ptr(),
                  torch.cuda.current_stream().cuda_stream)
    return out.cpu().tolist()


def test_greedy_sampling_is_argmax(gen, device):
    logits = torch.randn(5, 50000, generator=gen)
    logits[2, 777] = 100.0
    got = sample(logits.to(device), [(0.0, 0, 1.0, 0.0, 0)] * 5, 0)
    assert got == logits.argmax(-1).tolist()


def test_filtered_sampling_stays_in_the_kept_set(gen, device):
    logits = torch.randn(1, 32000, generator=gen) * 3
    top10 = set(logits[0].topk(10).indices.tolist())
    p = torch.softmax(logits[0], -1)
    order = p.argsort(descending=True)
    nucleus = set(order[: int((p[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    d = logits.to(device)
    for counter in range(60):
        assert sample(d, [(1.0, 10, 1.0, 0.0, 7)], counter)[0] in top10
        assert sample(d, [(1.0, 0, 0.5, 0.0, 7)], counter)[0] in nucleus


def test_sampling_follows_the_distribution(gen, device):
    """Chi-square over 4000 seeded draws from a 6-token softmax at temperature 0.7."""
    logits = torch.full((1, 1000), -1e4)
    logits[0, :6] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    probs = torch.softmax(logits[0, :6] / 0.7, -1)
    d = logits.to(device)
    counts = np.bincount([sample(d, [(0.7, 0, 1.0, 0.0, 11)], c)[0] for c in range(4000)], minlength=6)
    expected = probs.numpy() * 4000
    chi2 = float(((counts[:6] - expected) ** 2 / expected).sum())
    assert counts[6:].sum() == 0 and chi2 < 20.5  # 5 dof, p ~ 0.001
