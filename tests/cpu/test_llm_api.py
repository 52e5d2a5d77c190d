"""kog.LLM's API surface and `kog generate`, over the fake model (no weights needed)."""

import argparse
import io

import pytest

import kog
from kog.engine import EngineConfig, LLMEngine
from kog.generate_cli import add_arguments, run
from kog.llm import LLM
from kog.loader import ChatTemplate
from kog.testing.fake_runner import FakeRunner
from kog.testing.tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()
TEMPLATE = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_llm(template=TEMPLATE):
    engine = LLMEngine(FakeRunner(TOK.vocab_size, 128, 4), TOK, [TOK.eos_token_id], 512, EngineConfig(max_num_batched_tokens=32))
    return LLM.from_engine(engine, TOK, template)


GREEDY = kog.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_generate_accepts_strings_and_token_ids_in_order():
    llm = make_llm()
    ids = TOK.encode("hello world")
    outs = llm.generate(["hello world", {"prompt_token_ids": ids}, {"prompt": "hello world"}], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [ids] * 3
    assert outs[0].prompt == "hello world" and outs[1].prompt is None
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in outs)
    assert llm.engine.kv.stats()["blocks_used"] == 0


def test_generate_per_prompt_params_and_single_prompt():
    llm = make_llm()
    outs = llm.generate(["a b", "c d"], [GREEDY, kog.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 3]
    assert len(llm.generate("just one", GREEDY)) == 1
    with pytest.raises(kog.InvalidRequest, match="2 sampling params for 1 prompts"):
        llm.generate("x", [GREEDY, GREEDY])


@pytest.mark.parametrize("bad", [3, {"prompt_token_ids": ["a"]}, {"text": "x"}])
def test_bad_prompt_types(bad):
    with pytest.raises(kog.InvalidRequest):
        make_llm().generate([bad], GREEDY)


def test_chat_renders_the_template_and_matches_generate():
    llm = make_llm()
    msgs = [{"role": "user", "content": "hi there"}]
    ids = TOK.encode("<|user|>hi there\n<|assistant|>", add_special_tokens=False)
    chat = llm.chat(msgs, GREEDY)[0]
    assert chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids
    assert len(llm.chat([msgs, msgs], GREEDY)) == 2
    with pytest.raises(kog.InvalidRequest, match="no chat template"):
        make_llm(template=None).chat(msgs)


def test_stream_yields_the_generated_text():
    llm = make_llm()
    deltas = list(llm.stream("hello", GREEDY))
    full = llm.generate("hello", GREEDY)[0].outputs[0]
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert deltas[-1].finish_reason == "length"


def test_run_finishes_and_releases_requests_added_to_the_engine():
    """LLM.run and LLM.new_request_id are the public verbs kog.Session (and callers driving
    llm.engine directly) use: fresh ids, outputs in order, requests released."""
    llm = make_llm()
    ids = TOK.encode("hello world")
    rids = [llm.new_request_id() for _ in range(3)]
    assert len(set(rids)) == 3 and llm.new_request_id() not in rids
    short = kog.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, params in zip(rids, [GREEDY, short, GREEDY]):
        llm.engine.add_request(rid, ids, params)
    outs = llm.run(rids)
    assert [o.request_id for o in outs] == rids and all(o.finished for o in outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 3, 8]
    assert outs[0].outputs[0].token_ids == llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids
    for rid in rids:
        with pytest.raises(KeyError):
            llm.engine.get_output(rid)  # released
    assert llm.engine.kv.stats()["blocks_used"] == 0
    assert llm.new_session_id() != llm.new_session_id()


def cli_args(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_kog_generate_streams_and_reports_speed():
    out, err = io.StringIO(), io.StringIO()
    assert run(cli_args("hello", "--max-tokens", "6"), llm=make_llm(), out=out, err=err) == 0
    expected = make_llm().chat([{"role": "user", "content": "hello"}], kog.SamplingParams(temperature=0, max_tokens=6))
    assert out.getvalue() == expected[0].outputs[0].text + "\n"
    assert "TTFT" in err.getvalue() and "tok/s" in err.getvalue()


def test_kog_generate_bad_sampling_value_is_a_clean_error():
    err = io.StringIO()
    assert run(cli_args("hi", "--temperature", "-1"), llm=make_llm(), out=io.StringIO(), err=err) == 1
    assert "temperature" in err.getvalue()


def test_llm_refuses_an_unknown_device(tmp_path):
    import kog
    from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

    c = tiny_config("llama")
    folder = write_hf_model(tmp_path / "m", c, random_weights(c))
    with pytest.raises(kog.InvalidRequest, match="device"):
        kog.LLM(str(folder), device="tpu")
