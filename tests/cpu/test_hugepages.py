"""Weights moved into the huge-page arena keep names, shapes, dtypes and values."""

import mmap

import numpy as np
import pytest
import torch

from kog.loader import load_model
from kog.models import ModelRunner, PrefillChunk

from kog import hugepages
from kog.hugepages import HUGE_PAGE, to_hugepages
from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model


def _weights():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "c": torch.randint(0, 100, (4, 4), generator=g, dtype=torch.int32),
            "d": torch.randn(6, 8, generator=g).t()}  # not contiguous


@pytest.mark.skipif(not hugepages.hugepages_enabled(), reason="no transparent huge pages here")
def test_weights_move_into_one_aligned_arena_unchanged():
    want = {k: v.clone() for k, v in _weights().items()}
    src = _weights()
    got = to_hugepages(src)
    assert src == {}  # originals released as they are copied
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(got[k], v)
        assert got[k].is_contiguous() and got[k].data_ptr() % 64 == 0
    first = got["a"].data_ptr()
    assert first % HUGE_PAGE == 0
    assert all(0 <= t.data_ptr() - first < HUGE_PAGE for t in got.values())  # one arena
    got["a"].add_(1)  # writable, and private to these tensors
    assert torch.equal(got["a"], want["a"] + 1) and torch.equal(got["b"], want["b"])


@pytest.mark.skipif(not hugepages.hugepages_enabled(), reason="no transparent huge pages here")
def test_a_tensor_under_two_names_stays_one_tensor():
    embed = torch.randn(8, 4)
    got = to_hugepages({"embed": embed, "norm": torch.ones(4), "lm_head": embed})
    assert got["lm_head"] is got["embed"] and torch.equal(got["embed"], embed)
    assert got["embed"].data_ptr() != embed.data_ptr()


def test_disabled_leaves_the_weights_as_they_are(monkeypatch):
    monkeypatch.setenv("KOG_HUGEPAGES", "0")
    assert not hugepages.hugepages_enabled()
    src = _weights()
    ptrs = {k: v.data_ptr() for k, v in src.items()}
    got = to_hugepages(src)
    assert got is src and {k: v.data_ptr() for k, v in got.items()} == ptrs


def test_a_refused_mapping_keeps_the_weights(monkeypatch):
    monkeypatch.setattr(hugepages, "hugepages_enabled", lambda: True)

    def refuse(*args, **kwargs):
        raise OSError("no memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    src = _weights()
    assert to_hugepages(src) is src and len(src) == 4


def test_model_runner_gives_the_same_logits_with_and_without(tmp_path, monkeypatch):
    config = tiny_config("llama", max_position_embeddings=256)
    model = load_model(write_hf_model(tmp_path, config, random_weights(config, seed=3)), dtype=torch.bfloat16)
    prompt = [1, 5, 9, 2, 7, 3, 8]
    table = np.arange(4, dtype=np.int32)
    logits = []
    for flag in ("0", "1"):
        monkeypatch.setenv("KOG_HUGEPAGES", flag)
        runner = ModelRunner(model, num_kv_blocks=4, block_size=16)
        first = runner.prefill([PrefillChunk(prompt, 0, table, np.arange(len(prompt)))])[0]
        p = len(prompt)
        step = runner.decode([int(first.argmax())], [p], table[None], [p + 1], [p])[0]
        logits.append(torch.cat([first, step]))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.skipif(not hugepages.hugepages_enabled(), reason="no transparent huge pages here")
def test_zeros_on_huge_pages():
    t = hugepages.zeros((3, HUGE_PAGE // 4), torch.bfloat16)  # 1.5 huge pages
    assert t.shape == (3, HUGE_PAGE // 4) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    t[2, -1] = 1.5
    assert t.sum().item() == 1.5


def test_zeros_small_disabled_or_refused_are_plain_zeros(monkeypatch):
    small = hugepages.zeros((4, 5), torch.float32)
    assert small.shape == (4, 5) and not small.any()
    monkeypatch.setenv("KOG_HUGEPAGES", "0")
    t = hugepages.zeros((HUGE_PAGE,), torch.uint8)
    assert t.shape == (HUGE_PAGE,) and not t.any()
    monkeypatch.setenv("KOG_HUGEPAGES", "1")
    monkeypatch.setattr(hugepages, "hugepages_enabled", lambda: True)
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError("no memory")))
    t = hugepages.zeros((2, HUGE_PAGE), torch.float16)
    assert t.shape == (2, HUGE_PAGE) and t.dtype == torch.float16 and not t.any()


@pytest.mark.skipif(not hugepages.hugepages_enabled(), reason="no transparent huge pages here")
def test_cpu_kv_pool_starts_on_a_huge_page():
    from kog.kvcache import KVCacheStorage, KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    store = KVCacheStorage(layout, num_blocks=512)  # 2 x 512 x 8 KiB = 8 MiB
    assert store.kv.shape == layout.shape(512) and store.kv.data_ptr() % HUGE_PAGE == 0 and not store.kv.any()
