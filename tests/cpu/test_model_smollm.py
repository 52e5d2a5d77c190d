"""The real SmolLM2-135M (kog's default model) against transformers on the converted folder."""

import copy

import numpy as np
import pytest
import torch

from kog.loader import load_model
from kog.loader.convert import convert_gguf
from kog.models import ModelRunner, PrefillChunk
from kog.testing.greedy import hf_greedy, runner_greedy

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

BS = 16
PARAGRAPH = ("Kog is an inference engine for agents. It keeps a paged cache of keys and values, "
             "shares prefixes between requests, and runs each decode step in a single call. ")


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    model = load_model(dtype=torch.float32)
    folder = convert_gguf(model.path, tmp_path_factory.mktemp("smollm2"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, hf


def prompts(model) -> list[list[int]]:
    tok, tpl = model.tokenizer, model.chat_template
    chat = tpl.render([{"role": "system", "content": "You are a helpful assistant."},
                       {"role": "user", "content": "What is the capital of France?"},
                       {"role": "assistant", "content": "Paris."},
                       {"role": "user", "content": "And of Italy? Answer in one word."}],
                      add_generation_prompt=True)
    texts = [
        "The quick brown fox",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit":',
        "Once upon a time, in a small village by the sea,",
        "1, 2, 3, 5, 8, 13,",
        "Привет! Как дела? 🙂",
        PARAGRAPH * 24,
    ]
    ids = [tok.encode(t) for t in texts] + [tok.encode(chat, add_special_tokens=False)]
    assert len(ids[6]) >= 600
    return ids


def run_prefill(runner, ps):
    n = max(len(p) for p in ps) // BS + 4
    chunks = []
    for i, p in enumerate(ps):
        table = np.arange(i * n, (i + 1) * n, dtype=np.int32)
        pos = np.arange(len(p))
        chunks.append(PrefillChunk(p, 0, table, table[pos // BS].astype(np.int64) * BS + pos % BS))
    return runner.prefill(chunks)


def test_smollm2_fp32_matches_transformers(smollm):
    model, hf = smollm
    runner = ModelRunner(model, num_kv_blocks=8 * 50)
    ps = prompts(model)
    got = run_prefill(runner, ps)
    with torch.no_grad():
        for i, p in enumerate(ps):
            want = hf(torch.tensor([p])).logits[0, -1]
            assert (got[i] - want).abs().max() <= 1e-3 * want.abs().max(), i
    for p in ps[1], ps[7]:  # code, chat
        assert runner_greedy(runner, p, 48) == hf_greedy(hf, p, 48)


def test_smollm2_bf16_as_close_to_fp32_as_transformers_bf16(smollm):
    # Written tolerance: against the fp32 logits, centred (a shift of a whole row changes no
    # probability), Kog bf16 errs at most 1.5x transformers bf16 on the same weights (+1% of
    # max|logit|), and its top token agrees with fp32 at least as often, less one.
    model, hf = smollm
    runner = ModelRunner(load_model(dtype=torch.bfloat16), num_kv_blocks=8 * 50)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    ps = [p for p in prompts(model) if len(p) < 600]  # transformers' bf16 GEMM is slow on CPUs
    got = run_prefill(runner, ps)
    centred = lambda x: x.float() - x.float().mean()  # noqa: E731
    agree_kog = agree_hf = 0
    with torch.no_grad():
        for i, p in enumerate(ps):
            want = centred(hf(torch.tensor([p])).logits[0, -1])
            ref16 = centred(hf16(torch.tensor([p])).logits[0, -1])
            err_kog, err_hf = (centred(got[i]) - want).abs().max(), (ref16 - want).abs().max()
            assert err_kog <= 1.5 * err_hf + 1e-2 * want.abs().max(), (i, float(err_kog), float(err_hf))
            agree_kog += int(want.argmax()) == int(got[i].argmax())
            agree_hf += int(want.argmax()) == int(ref16.argmax())
    assert agree_kog >= agree_hf - 1 and agree_kog >= len(ps) - 2
