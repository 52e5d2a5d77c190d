"""The engine's features on mixture-of-experts models, through kog.LLM: an agent session, forks,
the prefix cache, structured output and n-gram speculation each give what the same model gives
without the feature (fresh stateless runs of the same full context, prefix caching off, plain
greedy). Tiny random checkpoints written by transformers (test_moe.hf_moe), every MoE family, and
qwen2_moe as a Q8_0 GGUF whose experts run in their blocks.

Every comparison is exact (greedy token ids): the features change which tokens are prefilled
where -- a cached prefix, a session's parked KV, a fork's copy-on-write blocks, jump-forward runs
and draft verification as multi-token chunks -- and every path computes the same logits to
within float rounding of the same ops; a wrong slot, a stale prefix or a mis-routed chunk row
changes the tokens.
"""

import json

import numpy as np
import pytest

import kog
from test_moe import MODELS, VOCAB, hf_moe

pytest.importorskip("transformers")

GREEDY = kog.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe", "qwen2_moe-q8_0.gguf"])
def folder(request, tmp_path_factory):
    """The model to load: an HF folder, or (".gguf") that folder written by kog convert as Q8_0,
    loaded with its expert stacks (the shared expert's included) in blocks."""
    name = request.param.removesuffix("-q8_0.gguf")
    family, overrides = MODELS[name]
    path = tmp_path_factory.mktemp(name)
    hf_moe(path, family, **overrides)
    if request.param.endswith(".gguf"):
        from kog.loader.gguf_write import hf_to_gguf

        from kog.loader import load_model
        from kog.quantized import QuantizedWeight

        hf_to_gguf(path, path / "m.gguf", "q8_0")
        stack = load_model(path / "m.gguf").weights["model.layers.0.mlp.experts.gate_up_proj"]
        assert isinstance(stack, QuantizedWeight)
        return path / "m.gguf"
    return path


def make_llm(path, **kw) -> kog.LLM:
    dtype = None if str(path).endswith(".gguf") else "float32"  # GGUF: blocks kept (f32 activations)
    return kog.LLM(str(path), dtype, kv_cache_gib=0.02, block_size=16, max_num_batched_tokens=64, **kw)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


def ids(out) -> list[int]:
    return out.outputs[0].token_ids


def stateless(llm: kog.LLM, contexts: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [ids(o) for o in llm.generate([{"prompt_token_ids": c} for c in contexts], params)]


def test_session_turns_equal_stateless_greedy(folder):
    llm = make_llm(folder, swap_space_gib=0.001)
    prefix, tool = tokens(70, 1), tokens(9, 2)
    with llm.session(prompt_token_ids=prefix) as s:
        assert s.opened.prefill_tokens_computed == len(prefix) - 1  # the last token stays pending
        first = s.generate(GREEDY)
        assert s.suspend(offload=True) == "swapped"  # parked KV to the host pool and back
        s.append(token_ids=tool)
        second = s.generate(GREEDY)
        assert second.prefill_tokens_computed == len(tool) + 1  # only the new tokens and the pending one
    context = prefix + ids(first) + tool
    assert [ids(first), ids(second)] == stateless(llm, [prefix, context])
    assert llm.engine.kv.stats()["blocks_used"] == 0


def test_forked_branches_continue_like_fresh_runs_of_their_context(folder):
    llm = make_llm(folder)
    prefix = tokens(50, 3)
    with llm.session(prompt_token_ids=prefix) as s:
        context = prefix + ids(s.generate(GREEDY))
        branches = s.fork(3)  # copy-on-write: the branches share the context's blocks
        tails = [tokens(5 + i, 10 + i) for i in range(3)]
        for b, t in zip(branches[1:], tails[1:]):
            b.append(token_ids=t)
        got = [ids(b.generate(GREEDY)) for b in branches]
        trunk = ids(s.generate(GREEDY))  # the parent goes on after its branches wrote theirs
        for b in branches:
            b.close()
    want = stateless(llm, [context, context + tails[1], context + tails[2]])
    assert got == want and trunk == want[0]
    assert len({tuple(w) for w in want}) > 1  # the tails lead elsewhere: a branch reading another's KV would show


def test_prefix_cache_hit_computes_fewer_tokens_and_gives_the_uncached_tokens(folder):
    shared = tokens(100, 4)
    prompts = [shared + tokens(7, 5), shared + tokens(11, 6)]
    cached, plain = make_llm(folder), make_llm(folder, enable_prefix_caching=False)
    first = cached.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]
    second = cached.generate({"prompt_token_ids": prompts[1]}, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96  # 6 full blocks of the shared 100 tokens
    assert second.prefill_tokens_computed == len(prompts[1]) - 96
    assert [ids(first), ids(second)] == stateless(plain, prompts)


SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                         "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                  "maxItems": 4}},
          "required": ["city", "days"], "additionalProperties": False}


def structured(jump_forward: bool) -> kog.SamplingParams:
    return kog.SamplingParams(temperature=0, max_tokens=60, structured=dict(json_schema=SCHEMA,
                                                                            jump_forward=jump_forward))


def test_json_schema_output_parses_and_validates(folder):
    jsonschema = pytest.importorskip("jsonschema")
    llm = make_llm(folder)
    prompts = [tokens(30, 7), tokens(45, 8)]
    free = stateless(llm, prompts, kog.SamplingParams(temperature=0, max_tokens=60))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], structured(True))
    for o, f in zip(outs, free):
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        assert ids(o) != f  # the grammar, not the model, made it JSON
    # forced runs ("{\"city\": \"", ...) appended unsampled and computed as one multi-token chunk
    # give the tokens of one step per forced token
    assert [ids(o) for o in outs] == stateless(llm, prompts, structured(False))


def test_ngram_speculation_gives_plain_greedy_tokens(folder):
    llm = make_llm(folder)
    base = tokens(20, 9)
    prompts = [base + base + base[:6], tokens(40, 11)]  # a repetitive prompt drafts from itself
    plain = stateless(llm, prompts, kog.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    spec = kog.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                              speculative={"method": "ngram", "num_tokens": 4})
    assert stateless(llm, prompts, spec) == plain
    stats = llm.engine.speculator.stats
    assert stats["drafted"] > 0 and stats["accepted"] > 0  # drafts really ran and were verified
    assert llm.engine.kv.stats()["blocks_used"] == 0
