"""A KV cache narrower than the activations (kv_cache_dtype): float16 / bfloat16 under float32, on
the CPU. kv_append rounds each value once to the cache's dtype; attention widens the cached
values to fp32 as it reads them, so it computes exactly what the float32 kernel computes over a
float32 cache holding those rounded values. Every ISA this machine supports; then the runner and
kog.LLM (the decode executor and the prefill interpreter both read the narrow cache)."""

import pytest
import torch

import kog
from kog import ops
from kog.testing.paged import random_paged_cache

NARROW = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_kv_append_rounds_once_to_the_cache_dtype(cpu_isa, gen, kv_dtype):
    cache = torch.randn(9, 2, 3, 16, 64, generator=gen).to(kv_dtype)
    kv = torch.randn(12, 2 * 3 * 64, generator=gen) * 50  # strided k and v of a fused projection
    k, v = kv[:, : 3 * 64].view(12, 3, 64), kv[:, 3 * 64 :].view(12, 3, 64)
    slots = torch.randperm(9 * 16, generator=gen)[:12]
    slots[[2, 7]] = -1  # padding tokens
    want = cache.clone()
    for t in range(12):
        if slots[t] >= 0:
            b, o = divmod(int(slots[t]), 16)
            want[b, 0, :, o], want[b, 1, :, o] = k[t].to(kv_dtype), v[t].to(kv_dtype)
    ops.kv_append(k, v, cache, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("kv_dtype", NARROW)
@pytest.mark.parametrize("hq, hk, d, bs", [(4, 4, 64, 16), (8, 2, 128, 16), (3, 1, 64, 16), (8, 2, 80, 5)])
def test_attention_over_a_narrow_cache_is_the_f32_kernel_over_its_values(cpu_isa, gen, kv_dtype, hq, hk, d, bs):
    # decode: 1 token, one block, a partition boundary and a long (split, merged) context; prefill:
    # chunks of 1 (split kernel), 5, 37 and 40 (tiled) tokens.
    seq_lens = [1, bs + 1, 37, 1100]
    narrow, table, lens = random_paged_cache(gen, seq_lens, hk, d, bs, kv_dtype, 7, spare_columns=2)
    wide = narrow.float()
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    assert torch.equal(ops.paged_attention_decode(q, narrow, table, lens),
                       ops.paged_attention_decode(q, wide, table, lens))
    q_lens = [1, 5, 37, 40]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    assert torch.equal(ops.paged_attention_prefill(q, narrow, table, lens, qsl),
                       ops.paged_attention_prefill(q, wide, table, lens, qsl))


@pytest.mark.parametrize("q_dtype, kv_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
def test_only_a_narrower_cache_under_f32_is_accepted(q_dtype, kv_dtype):
    cache = torch.randn(4, 2, 2, 16, 64).to(kv_dtype)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(kog.InvalidRequest, match="kv_cache has"):
        ops.paged_attention_decode(torch.randn(1, 4, 64).to(q_dtype), cache, tables, lens)
    with pytest.raises(kog.InvalidRequest, match="kv_cache has"):
        k = torch.randn(1, 2, 64).to(q_dtype)
        ops.kv_append(k, k, cache, torch.tensor([3]))


# ---- the runner and kog.LLM -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_f32_folder(tmp_path_factory):
    from kog.testing.tiny_models import tiny_config, write_hf_model

    return write_hf_model(tmp_path_factory.mktemp("kvdtype") / "hf", tiny_config("llama", max_position_embeddings=512))


def _last_logprobs(llm, prompt):
    out = llm.generate({"prompt_token_ids": prompt}, kog.SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))
    return out[0].outputs[0]


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_llm_with_a_narrow_kv_cache_decodes_close_to_float32(tiny_f32_folder, kv_dtype):
    wide = kog.LLM(str(tiny_f32_folder), "float32", max_num_seqs=2, enable_prefix_caching=False)
    narrow = kog.LLM(str(tiny_f32_folder), "float32", max_num_seqs=2, enable_prefix_caching=False,
                     kv_cache_dtype=kv_dtype)
    assert wide.engine.runner.kv.kv.dtype == torch.float32
    assert narrow.engine.runner.kv.kv.dtype == getattr(torch, kv_dtype)
    assert narrow.engine.runner.kv_dtype == getattr(torch, kv_dtype) and narrow.engine.runner.dtype == torch.float32
    prompt = [(11 * i) % 200 + 3 for i in range(90)]
    a, b = _last_logprobs(wide, prompt), _last_logprobs(narrow, prompt)
    # Prefill (the interpreter) and the native decode steps both read the rounded cache: the
    # first token's logprobs differ from float32's only by that rounding.
    first_a, first_b = a.logprobs[0], b.logprobs[0]
    shared = set(first_a) & set(first_b)
    assert shared and max(abs(first_a[t] - first_b[t]) for t in shared) < (2e-2 if kv_dtype == "bfloat16" else 3e-3)


def test_prefill_and_native_decode_agree_over_a_float16_cache(tiny_f32_folder):
    # The same next-token logits from the interpreter's prefill of n + 1 tokens and from a prefill
    # of n then one native decode step: both append the new K/V rounded, both attend over it.
    from kog.loader import load_model
    from kog.models import ModelRunner, PrefillChunk
    import numpy as np

    runner = ModelRunner(load_model(tiny_f32_folder, "float32", progress=False), num_kv_blocks=32, block_size=16,
                         kv_cache_dtype=torch.float16)
    ids = [(5 * i) % 200 + 3 for i in range(41)]
    table = np.arange(4, dtype=np.int32)
    whole = runner.prefill([PrefillChunk(ids, 0, table, np.arange(41, dtype=np.int64))])[0]
    runner.prefill([PrefillChunk(ids[:40], 0, table, np.arange(40, dtype=np.int64))])
    step = runner.decode(np.array([ids[40]]), np.array([40]), table[None, :], np.array([41], dtype=np.int32),
                         np.array([40], dtype=np.int64))[0]
    torch.testing.assert_close(step.float(), whole.float(), rtol=1e-4, atol=1e-4)


def test_a_narrow_cache_holds_twice_the_blocks_in_the_same_memory(tiny_f32_folder):
    wide = kog.LLM(str(tiny_f32_folder), "float32", kv_cache_gib=0.001)
    narrow = kog.LLM(str(tiny_f32_folder), "float32", kv_cache_gib=0.001, kv_cache_dtype="bfloat16")
    assert narrow.engine.runner.kv.kv.shape[1] == 2 * wide.engine.runner.kv.kv.shape[1]


@pytest.mark.parametrize("kw, match", [
    (dict(dtype="bfloat16", kv_cache_dtype="float16"), "only as float16 or bfloat16 under float32"),
    (dict(dtype="float32", kv_cache_dtype="int8"), "kv_cache_dtype must be"),
])
def test_kv_cache_dtypes_no_kernel_reads_are_refused(tiny_f32_folder, kw, match):
    with pytest.raises(kog.InvalidRequest, match=match):
        kog.LLM(str(tiny_f32_folder), **kw)


def test_auto_is_float16_for_a_ggufs_kept_blocks_and_the_run_dtype_otherwise(tmp_path, tiny_f32_folder):
    from kog.testing.tiny_models import tiny_config, write_gguf_model

    gguf = str(write_gguf_model(tmp_path / "q8.gguf", tiny_config("llama"), qtype="Q8_0"))
    assert kog.LLM(gguf).engine.runner.kv_dtype == torch.float16  # blocks kept: f32 activations
    assert kog.LLM(gguf, kv_cache_dtype="auto").engine.runner.kv_dtype == torch.float16
    assert kog.LLM(gguf, kv_cache_dtype="float32").engine.runner.kv_dtype == torch.float32
    assert kog.LLM(gguf, "float32").engine.runner.kv_dtype == torch.float32  # dequantized at load
    assert kog.LLM(str(tiny_f32_folder)).engine.runner.kv_dtype == torch.float32


def test_tensor_parallel_ranks_keep_the_same_narrow_cache(tiny_f32_folder):
    # RankSpec carries the dtype to every rank; two ranks generate what one process does with it.
    greedy = kog.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 8, 41]}, {"prompt_token_ids": list(range(30, 60))}]
    one = kog.LLM(str(tiny_f32_folder), "float32", kv_cache_dtype="bfloat16")
    want = [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
    llm = kog.LLM(str(tiny_f32_folder), "float32", kv_cache_dtype="bfloat16", tensor_parallel_size=2)
    try:
        assert llm.engine.runner.local.kv_dtype == torch.bfloat16
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    finally:
        llm.engine.runner.close()
