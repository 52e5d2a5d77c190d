"""kog.LLM and `kog generate` end to end on the real SmolLM2-135M-Instruct (fp32)."""

import re
import subprocess
import sys

import pytest

import kog
from kog.loader import load_model
from kog.models import ModelRunner
from kog.testing.greedy import runner_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", '{"name": "get_weather", "arguments": {',
           "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def llm():
    return kog.LLM(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)


def test_continuous_batching_equals_each_request_alone(llm):
    params = kog.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)  # 4 requests, 16-token budget: chunked prefill mixed with decodes
    alone = ModelRunner(load_model(dtype="float32", progress=False), num_kv_blocks=32)
    for o in outs:
        assert o.outputs[0].token_ids == runner_greedy(alone, o.prompt_token_ids, 20), o.prompt


def test_chat_answers_and_repeated_system_prompt_hits_the_prefix_cache(llm):
    system = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence. " * 4}
    first = llm.chat([system, {"role": "user", "content": "What is the capital of France?"}],
                     kog.SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in first.outputs[0].text and first.outputs[0].finish_reason == "stop"
    second = llm.chat([system, {"role": "user", "content": "And of Italy?"}], kog.SamplingParams(temperature=0, max_tokens=8))[0]
    assert second.num_cached_tokens >= 48
    assert second.prefill_tokens_computed == len(second.prompt_token_ids) - second.num_cached_tokens


def test_prompt_longer_than_the_context_names_both_numbers():
    small = kog.LLM(dtype="float32", max_model_len=64, max_num_seqs=1)
    with pytest.raises(kog.InvalidRequest, match=r"has 100 tokens but the context length is 64"):
        small.generate({"prompt_token_ids": [1] * 100})


def test_kog_generate_cli_streams_an_answer():
    out = subprocess.run([sys.executable, "-m", "kog", "generate", "--max-tokens", "12", "What is 2+2?"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "TTFT" in out.stderr and "tok/s" in out.stderr
    # The default model runs its Q4_1 blocks: about the file's bytes resident.
    resident, file_mb = re.search(r"weights: (\d+) MB resident \(file (\d+) MB\)", out.stderr).groups()
    assert int(resident) <= 1.1 * int(file_mb)
