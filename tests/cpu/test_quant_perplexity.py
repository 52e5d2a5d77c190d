"""Perplexity of SmolLM2-135M-Instruct on a fixed English text (tests/data/perplexity_text.txt,
408 tokens) with its GGUF blocks kept -- the shipped Q4_1 file and a Q8_0 file written by
`kog convert` -- against the same file dequantized to fp32 (issue 17): within 1%.

The prompt's log-probabilities come from SamplingParams(prompt_logprobs=0) of one 512-token
prefill step, through each path of the quantized LINEAR (kog.program.interpreter): x in f32
against in-cache weight tiles (the default under QUANT_GEMM_MIN_ROWS), f32 weight tiles with
torch's GEMM, and the int8 kernel with x quantized per 32 in two stages (what decode computes)."""

import math
from pathlib import Path

import pytest

import kog
from kog.loader import resolve_model
from kog.loader.gguf_write import requantize_gguf
from kog.program import interpreter

pytestmark = pytest.mark.slow

TEXT = Path(__file__).resolve().parent.parent / "data" / "perplexity_text.txt"
MAX_REL_DIFF = 0.01  # the bound on |ppl(quant) / ppl(fp32) - 1|
# (QUANT_F32_X_MIN_ROWS, QUANT_GEMM_MIN_ROWS) forcing each path for a 408-row prefill.
PATHS = {"f32-x tiles": (1, 1 << 30), "tiles+GEMM": (1, 1), "int8 x2": (1 << 30, 1 << 30)}


@pytest.fixture(scope="module", params=["Q4_1", "Q8_0"])
def engines(request, tmp_path_factory):
    """(name, LLM keeping the blocks, fp32 perplexity of the same file, token ids)."""
    path = resolve_model(None)
    if request.param == "Q8_0":
        path = tmp_path_factory.mktemp("q8") / "smollm2-q8_0.gguf"
        requantize_gguf(resolve_model(None), path, "q8_0")  # what `kog convert --outtype q8_0` runs
    kw = dict(max_num_seqs=1, max_model_len=512, max_num_batched_tokens=512, kv_cache_gib=0.05,
              enable_prefix_caching=False)
    quant, f32 = kog.LLM(str(path), **kw), kog.LLM(str(path), "float32", **kw)
    assert {w.file_type_name for w in quant.engine.runner.weights.values() if hasattr(w, "qtype")} >= {request.param}
    assert not any(hasattr(w, "qtype") for w in f32.engine.runner.weights.values())
    ids = quant.model.tokenizer.encode(TEXT.read_text())
    assert 300 <= len(ids) <= 512
    return request.param, quant, perplexity(f32, ids), ids


def perplexity(llm: kog.LLM, ids: list[int]) -> float:
    out = llm.generate({"prompt_token_ids": ids}, kog.SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    lps = [entry[t] for t, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    assert len(lps) == len(ids) - 1 and all(math.isfinite(v) for v in lps)
    return math.exp(-sum(lps) / len(lps))


@pytest.mark.parametrize("path", PATHS)
def test_perplexity_within_one_percent_of_fp32(engines, path, monkeypatch):
    name, quant, pf, ids = engines
    monkeypatch.setattr(interpreter, "QUANT_F32_X_MIN_ROWS", PATHS[path][0])
    monkeypatch.setattr(interpreter, "QUANT_GEMM_MIN_ROWS", PATHS[path][1])
    pq = perplexity(quant, ids)
    print(f"\n{name} {path}: {len(ids)} tokens, perplexity quant {pq:.4f}, fp32 {pf:.4f}, ratio {pq / pf:.5f}")
    assert 1.5 < pf < 100  # the model reads English: a broken forward is far above this
    assert abs(pq / pf - 1) <= MAX_REL_DIFF
