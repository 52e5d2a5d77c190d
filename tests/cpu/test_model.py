"""ModelRunner against Hugging Face transformers on the same weights, per family, and its own
invariants: chunked == one-shot prefill, batched == per-sequence decode, errors."""

import numpy as np
import pytest
import torch

import kog
from kog.loader import load_model
from kog.models import ModelRunner, PrefillChunk
from kog.testing.greedy import hf_greedy
from kog.testing.runner_seqs import RunnerSeqs
from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

transformers = pytest.importorskip("transformers")

BS = 16
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
FAMILIES = {
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral"),
    "qwen2-bias": dict(arch="qwen2"),
    "qwen3-qknorm": dict(arch="qwen3"),
    "llama3-rope-scaling": dict(arch="llama", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0),
    "llama-untied-mha": dict(arch="llama", num_key_value_heads=4, tie_word_embeddings=False),
    # every layer through a 24-token window: prompts and greedy runs reach far past it
    "mistral-sliding-window": dict(arch="mistral", sliding_window=24),
}


def greedy(runner: ModelRunner, prompt: list[int], n_new: int, seq: int = 0) -> list[int]:
    s = RunnerSeqs(runner, blocks_per_seq=(len(prompt) + n_new) // BS + 1)
    out = [int(runner.prefill([s.chunk(seq, prompt)])[0].argmax())]
    for i in range(n_new - 1):
        out.append(int(s.decode([seq], [out[-1]], [len(prompt) + i])[0].argmax()))
    return out


def tiny_pair(tmp_path_factory, name: str, dtype=torch.float32):
    spec = dict(FAMILIES[name])
    config = tiny_config(spec.pop("arch"), max_position_embeddings=1024, **spec)
    folder = write_hf_model(tmp_path_factory.mktemp(name), config, random_weights(config, seed=11))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ModelRunner(load_model(folder, dtype=dtype), num_kv_blocks=8 * 70, block_size=BS), hf


def tiny_prompts(vocab: int) -> list[list[int]]:
    g = np.random.default_rng(0)
    return [g.integers(3, vocab, n).tolist() for n in (1, 5, 16, 17, 33, 64, 130, 700)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_family_matches_transformers(tmp_path_factory, name):
    runner, hf = tiny_pair(tmp_path_factory, name)
    prompts = tiny_prompts(runner.vocab_size)
    s = RunnerSeqs(runner, blocks_per_seq=70)
    got = runner.prefill([s.chunk(i, p) for i, p in enumerate(prompts)])  # one batch, 8 sequences
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = hf(torch.tensor([p])).logits[0, -1]
            assert (got[i] - want).abs().max() <= 1e-3 * want.abs().max(), (name, len(p))
        full = hf(torch.tensor([prompts[4]])).logits[0]
    all_logits = runner.prefill([s.chunk(7, prompts[4])], all_logits=True)[0]
    assert (all_logits - full).abs().max() <= 1e-3 * full.abs().max()
    for p in prompts[1], prompts[5]:
        assert greedy(runner, p, 48, seq=6) == hf_greedy(hf, p, 48), name


def test_tiny_bf16_close_to_fp32_transformers(tmp_path_factory):
    runner, hf = tiny_pair(tmp_path_factory, "qwen3-qknorm", dtype=torch.bfloat16)
    prompts = tiny_prompts(runner.vocab_size)
    s = RunnerSeqs(runner, blocks_per_seq=70)
    got = runner.prefill([s.chunk(i, p) for i, p in enumerate(prompts)])
    dec = s.decode([0, 5], [9, 9], [len(prompts[0]), len(prompts[5])])
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = hf(torch.tensor([p])).logits[0, -1]
            # bf16 weights and activations (8 mantissa bits) through 2 layers: written tolerance 3%.
            assert (got[i] - want).abs().max() <= 3e-2 * want.abs().max()
        for row, i in enumerate([0, 5]):
            want = hf(torch.tensor([prompts[i] + [9]])).logits[0, -1]
            assert (dec[row] - want).abs().max() <= 3e-2 * want.abs().max()


def test_chunked_prefill_equals_one_shot(tmp_path_factory):
    runner, _ = tiny_pair(tmp_path_factory, "qwen2-bias")
    prompt = tiny_prompts(runner.vocab_size)[6]  # 130 tokens
    s = RunnerSeqs(runner, blocks_per_seq=70)
    one_shot = runner.prefill([s.chunk(0, prompt)], all_logits=True)[0]
    pieces, start = [], 0
    for n in (7, 50, 73):  # chunk edges inside blocks, batched with another sequence's chunk
        pieces.append(runner.prefill([s.chunk(1, prompt[start:start + n], start), s.chunk(2, prompt[:n])],
                                     all_logits=True)[0])
        start += n
    torch.testing.assert_close(torch.cat(pieces), one_shot, rtol=1e-5, atol=1e-5 * one_shot.abs().max().item())


def test_batched_decode_equals_per_sequence(tmp_path_factory):
    runner, _ = tiny_pair(tmp_path_factory, "llama")
    prompts = tiny_prompts(runner.vocab_size)[1:5]  # 5, 16, 17, 33 tokens
    s = RunnerSeqs(runner, blocks_per_seq=70)
    runner.prefill([s.chunk(i, p) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):  # the same prompts again, as sequences 4..7, for solo decoding
        runner.prefill([s.chunk(4 + i, p)])
    lens = [len(p) for p in prompts]
    tokens = [3, 4, 5, 6]
    for step in range(20):
        batched = s.decode([0, 1, 2, 3], tokens, lens)
        solo = torch.cat([s.decode([4 + i], [tokens[i]], [lens[i]]) for i in range(4)])
        torch.testing.assert_close(batched, solo, rtol=1e-5, atol=1e-5 * solo.abs().max().item())
        tokens = batched.argmax(-1).tolist()
        lens = [n + 1 for n in lens]


def test_requests_beyond_the_model_or_the_block_table(tmp_path_factory):
    runner, _ = tiny_pair(tmp_path_factory, "llama")
    s = RunnerSeqs(runner, blocks_per_seq=70)
    with pytest.raises(kog.InvalidRequest, match=r"1030.*1024"):
        runner.prefill([s.chunk(0, [5] * 30, start=1000)])
    short = PrefillChunk([5] * 40, 0, np.arange(2, dtype=np.int32), s.slots(0, 0, 40))
    with pytest.raises(kog.InvalidRequest, match=r"40.*32 tokens"):
        runner.prefill([short])
    with pytest.raises(kog.InvalidRequest, match="vocab|token ids"):
        runner.prefill([s.chunk(0, [runner.vocab_size])])
