"""SmolLM2-135M-Instruct with its GGUF blocks kept (the shipped Q4_1 file, and a Q8_0 copy written
by requantize_gguf) against the same weights dequantized to fp32 (issue 17): greedy tokens agree
for >= 32 tokens on most chat prompts, decode logits stay close, resident weights ~ the file."""

import numpy as np
import pytest
import torch

import kog
from kog.loader import load_model, resolve_model
from kog.loader.gguf_write import requantize_gguf
from kog.models import ModelRunner
from kog.quantized import QuantizedWeight
from kog.testing.greedy import runner_greedy

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
             "List three prime numbers.", "How do I reverse a list in Python?", "Tell me a short story about a robot.",
             "What is 12 times 7?", "Give me tips for sleeping better."]
N_NEW = 40
# Measured 2026-12-05 (2-core VM): Q4_1 and Q8_0 both 8/8 prompts identical for all 40 tokens,
# max decode logit error 0.0050 (Q4_1) and 0.0058 (Q8_0) with x quantized in two int8 stages;
# 0.0043 / 0.0045 since the prompts' prefill keeps x in f32 (interpreter.QUANT_F32_X_MIN_ROWS).
# One stage gave up to 1.6 (a 37-token prefill through the int8 kernel) and splits within the
# first 10 tokens on half of the prompts, so these bounds fail if the second stage is lost.
MAX_LOGIT_ERR = 0.05


@pytest.fixture(scope="module", params=["Q4_1", "Q8_0"])
def pair(request, tmp_path_factory):
    path = resolve_model(None)
    if request.param == "Q8_0":
        path = tmp_path_factory.mktemp("q8") / "smollm2-q8_0.gguf"
        requantize_gguf(resolve_model(None), path, "q8_0")
    quant, f32 = load_model(path, progress=False), load_model(path, dtype="float32", progress=False)
    assert any(isinstance(w, QuantizedWeight) and w.type_name == request.param for w in quant.weights.values())
    return request.param, quant, f32


def _prompts(model) -> list[list[int]]:
    tok, tpl = model.tokenizer, model.chat_template
    return [tok.encode(tpl.render([{"role": "user", "content": q}], add_generation_prompt=True),
                       add_special_tokens=False) for q in QUESTIONS]


def _teacher_forced_errors(rq: ModelRunner, rf: ModelRunner, prompt: list[int], tokens: list[int]):
    """Decode both runners over the same tokens; per step the max |logit difference| and, where the
    argmax differs, fp32's top-2 gap."""
    bs = rq.block_size
    table = np.arange(-(-(len(prompt) + len(tokens)) // bs), dtype=np.int32)
    slot = lambda p: int(table[p // bs]) * bs + p % bs  # noqa: E731
    slots = np.array([slot(p) for p in range(len(prompt))])
    from kog.models.runner import PrefillChunk

    for r in (rq, rf):
        r.prefill([PrefillChunk(prompt, 0, table, slots)])
    errs, gaps = [], []
    for i, t in enumerate(tokens[:-1]):
        p = len(prompt) + i
        args = (np.array([t]), np.array([p]), table[None], np.array([p + 1], np.int32), np.array([slot(p)]))
        lq, lf = rq.decode(*args)[0], rf.decode(*args)[0]
        errs.append(float((lq - lf).abs().max()))
        if lq.argmax() != lf.argmax():
            top = lf.topk(2).values
            gaps.append(float(top[0] - top[1]))
    return max(errs), gaps


def test_greedy_tokens_agree_with_fp32(pair):
    name, quant, f32 = pair
    rq, rf = ModelRunner(quant, num_kv_blocks=16), ModelRunner(f32, num_kv_blocks=16)
    agree, worst, flips = [], 0.0, []
    for prompt in _prompts(quant):
        a, b = runner_greedy(rq, prompt, N_NEW), runner_greedy(rf, prompt, N_NEW)
        agree.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), N_NEW))
        err, gaps = _teacher_forced_errors(rq, rf, prompt, b)
        worst, flips = max(worst, err), flips + gaps
    print(f"\n{name}: identical greedy tokens per prompt {agree} (of {N_NEW}); max decode logit error "
          f"{worst:.4f}; fp32 top-2 gaps where the argmax flips {flips}")
    assert sum(n >= 32 for n in agree) >= 6, agree
    assert worst <= MAX_LOGIT_ERR
    # A flip is only allowed at a near-tie: a gap within the logit error.
    assert all(g <= 2 * worst for g in flips), (flips, worst)


def test_default_llm_runs_the_native_q4_1_blocks_within_the_file_bytes():
    llm = kog.LLM(max_num_seqs=1)
    runner = llm.engine.runner
    types = {w.file_type_name for w in runner.weights.values() if isinstance(w, QuantizedWeight)}
    assert "Q4_1" in types and runner.dtype == torch.float32
    file_bytes = llm.model.file_weight_bytes
    assert file_bytes and runner.weight_bytes <= 1.1 * file_bytes, (runner.weight_bytes, file_bytes)
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], kog.SamplingParams(max_tokens=16, temperature=0))
    assert "4" in out[0].outputs[0].text
