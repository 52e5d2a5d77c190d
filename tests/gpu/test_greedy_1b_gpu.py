"""A Llama-3.2-1B-shaped random-weight model (its hidden size, heads, MLP and 128k vocabulary;
2 of its 16 layers, KOG_GREEDY_1B_LAYERS to change), fp32: 32 greedy tokens of the persistent
kernel, one launch per token and 32 tokens in one launch, equal the CPU executor's."""

import os

import numpy as np
import pytest
import torch

from kog.loader import LoadedModel
from kog.models import ModelRunner, PrefillChunk
from kog.models.gpu_decode import GpuDecoder
from kog.testing.gpu import gpu_test_marks
from kog.testing.tiny_models import random_weights, tiny_config

pytestmark = gpu_test_marks()

BS, PROMPT, STEPS = 16, 40, 32


def llama_1b_config(layers: int):
    return tiny_config("llama", hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                       rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True)


def cpu_greedy(layers: int) -> tuple[ModelRunner, np.ndarray, list[int], list[int], list[torch.Tensor]]:
    """The CPU executor's run: (runner, block table [1, 8] with the prompt prefilled and nothing
    decoded, prompt, STEPS greedy tokens, each step's [vocab] logits)."""
    config = llama_1b_config(layers)
    model = LoadedModel(path=None, config=config, weights=random_weights(config, seed=7), dtype=torch.float32,
                        tokenizer=None, chat_template=None, stop_token_ids=())
    r = ModelRunner(model, num_kv_blocks=8, block_size=BS)
    prompt = torch.randint(0, config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
    table = np.arange(8, dtype=np.int32)[None, ::-1].copy()  # reversed: block ids != positions
    slots = table[0, np.arange(PROMPT) // BS] * BS + np.arange(PROMPT) % BS
    r.prefill([PrefillChunk(prompt, 0, table[0], slots.astype(np.int64))])
    kv_after_prefill = r.kv.kv.clone()
    tokens, logits, tok = [], [], np.array([prompt[-1]])
    for i in range(STEPS):
        p = PROMPT + i
        logits.append(r.decode(tok, [p], table, [p + 1], [table[0, p // BS] * BS + p % BS], sampled=tok)[0])
        tokens.append(int(tok[0]))
    r.kv.kv.copy_(kv_after_prefill)
    return r, table, prompt, tokens, logits


@pytest.fixture(scope="module")
def reference():
    return cpu_greedy(int(os.environ.get("KOG_GREEDY_1B_LAYERS", "2")))


@pytest.fixture(scope="module")
def gpu_weights(reference, device_module):
    return {k: v.to(device_module) for k, v in reference[0].weights.items()}


@pytest.fixture(scope="module")
def device_module() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def decoder(reference, gpu_weights, device) -> GpuDecoder:
    r = reference[0]
    return GpuDecoder(r.config, gpu_weights, r.kv.kv.to(device), BS, r.inv_freq)


def test_one_step_greedy_tokens_and_logits_match_cpu(reference, gpu_weights, device_module):
    _, table, prompt, expected, expected_logits = reference
    dec = decoder(reference, gpu_weights, device_module)
    got = []
    for i, tok in enumerate([prompt[-1]] + expected[:-1]):  # the CPU's tokens in: every step comparable
        res = dec.decode([tok], [PROMPT + i], table)
        ref = expected_logits[i]
        assert (res.logits[0].cpu() - ref).abs().max() <= 1e-3 * ref.abs().max(), f"step {i}"
        got.append(int(res.tokens[0, 0]))
    assert got == expected


def test_loop_mode_greedy_tokens_match_cpu(reference, gpu_weights, device_module):
    _, table, prompt, expected, _ = reference
    res = decoder(reference, gpu_weights, device_module).decode([prompt[-1]], [PROMPT], table, n_steps=STEPS)
    assert res.tokens[:, 0].cpu().tolist() == expected
