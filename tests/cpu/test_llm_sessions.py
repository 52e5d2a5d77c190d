"""kog.LLM.session: the Python session API over the fake model (chat-mode rendering, fork,
rollback, context manager), and on a real tiny model: session output == stateless greedy."""

import pytest

import kog
from kog.engine import EngineConfig, LLMEngine
from kog.llm import LLM
from kog.loader import ChatTemplate
from kog.testing.fake_runner import FakeRunner
from kog.testing.tiny_models import CHATML_TEMPLATE, random_weights, tiny_config, tiny_tokenizer, write_hf_model

TOK = tiny_tokenizer()
CHATML = ChatTemplate(CHATML_TEMPLATE)
GREEDY = kog.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SYSTEM = [{"role": "system", "content": "You are a weather agent. Call get_weather(city)."}]


def make_llm(template=CHATML, host_blocks=0):
    runner = FakeRunner(TOK.vocab_size, 256, 4, host_blocks)
    cfg = EngineConfig(max_num_batched_tokens=32, num_host_blocks=host_blocks)
    return LLM.from_engine(LLMEngine(runner, TOK, [TOK.eos_token_id], 1024, cfg), TOK, template)


def test_chat_session_turns_equal_stateless_chat_and_render_exact_tokens():
    llm = make_llm()
    tool = [{"role": "tool", "content": '{"city": "Paris", "temp": 21}'}]
    with llm.session(messages=SYSTEM) as s:
        assert s.token_ids == llm.encode_chat(SYSTEM)
        assert s.opened.prefill_tokens_computed == len(s.token_ids) - 1
        first = s.generate(GREEDY)
        assert first.outputs[0].token_ids == llm.chat(SYSTEM, GREEDY)[0].outputs[0].token_ids
        s.append(messages=tool)
        conversation = SYSTEM + [{"role": "assistant", "content": first.outputs[0].text}] + tool
        assert s.messages == conversation
        assert s.token_ids == llm.encode_chat(conversation)  # exactly the full render
        second = s.generate(GREEDY)
        assert second.outputs[0].token_ids == llm.chat(conversation, GREEDY)[0].outputs[0].token_ids
        assert second.prefill_tokens_computed < len(s.token_ids) // 2  # only the new turn
    assert llm.engine.kv.stats()["blocks_used"] == 0 and llm.engine.kv.stats()["blocks_pinned"] == 0


def test_append_takes_the_whole_conversation_and_adds_only_the_new_messages():
    llm = make_llm()
    tool = [{"role": "tool", "content": '{"city": "Paris", "temp": 21}'}]
    with llm.session(messages=SYSTEM) as a, llm.session(messages=SYSTEM) as b:
        reply = {"role": "assistant", "content": a.generate(GREEDY).outputs[0].text}
        b.generate(GREEDY)
        a.append(messages=tool)
        b.append(messages=[{**SYSTEM[0], "content": [{"type": "text", "text": SYSTEM[0]["content"]}]}, reply] + tool)
        assert b.token_ids == a.token_ids and b.messages == a.messages == SYSTEM + [reply] + tool
        with pytest.raises(kog.ConversationDiverged, match="message 1 differs"):
            b.append(messages=SYSTEM + [{"role": "assistant", "content": "no"}] + tool)
        with pytest.raises(kog.ConversationDiverged, match="fewer"):
            b.append(messages=SYSTEM)
        with pytest.raises(kog.InvalidRequest, match="no new message"):
            b.append(messages=b.messages)
        assert b.token_ids == a.token_ids


def test_a_template_that_rewrites_earlier_tokens_is_a_clear_error():
    counting = ChatTemplate("{{ messages|length }} turns\n" + CHATML_TEMPLATE)
    llm = make_llm(counting)
    with llm.session(messages=SYSTEM) as s:
        s.generate(GREEDY)
        with pytest.raises(kog.InvalidRequest, match="cannot be rendered incrementally"):
            s.append(messages=[{"role": "user", "content": "and Rome?"}])


def test_token_sessions_fork_rollback_and_close():
    llm = make_llm(host_blocks=16)
    prefix = TOK.encode("system: tools are get_weather and get_time. " * 3)
    s = llm.session(prompt_token_ids=prefix)
    out = s.generate(GREEDY)
    context = prefix + out.outputs[0].token_ids
    branches = s.fork(3)
    assert [b.token_ids for b in branches] == [context] * 3
    seeded = [kog.SamplingParams(temperature=1.0, seed=i, max_tokens=6, ignore_eos=True) for i in range(3)]
    outs = [b.generate(p) for b, p in zip(branches, seeded)]
    for o, p in zip(outs, seeded):
        assert o.outputs[0].token_ids == llm.generate({"prompt_token_ids": context}, p)[0].outputs[0].token_ids
        assert o.prefill_tokens_computed == 1
    s.append(token_ids=TOK.encode(" tool result: 21 degrees"))
    pair = s.fork(2)  # the appended tokens are prefilled once, then shared
    assert [b.generate(GREEDY).prefill_tokens_computed for b in pair] == [1, 1]
    for b in branches[1:] + pair:
        b.close()
    keep = branches[0]
    assert keep.suspend(offload=True) == "swapped"
    keep.rollback(len(prefix) + 2)
    assert keep.token_ids == context[: len(prefix) + 2]
    again = keep.generate(GREEDY)
    assert again.outputs[0].token_ids == llm.generate({"prompt_token_ids": context[: len(prefix) + 2]}, GREEDY)[0].outputs[0].token_ids
    with pytest.raises(kog.InvalidRequest, match="chat mode|opened with messages"):
        keep.append(messages=SYSTEM)
    keep.append(token_ids=[5, 6, 7])
    assert keep.token_ids[-3:] == [5, 6, 7]
    keep.close()
    s.close()
    with pytest.raises(kog.InvalidOperation, match="closed"):
        s.generate(GREEDY)
    assert llm.engine.kv.stats()["blocks_used"] == 0 and llm.engine.kv.stats()["num_sequences"] == 0


def test_a_session_closed_in_the_engine_while_its_request_runs_reads_as_closed():
    llm = make_llm()
    s = llm.session(messages=SYSTEM)
    llm.engine.sessions.generate(s.session_id, "t", kog.SamplingParams(max_tokens=40, ignore_eos=True))
    llm.engine.step()
    llm.engine.sessions.close(s.session_id)  # e.g. the server's DELETE, between two steps
    out = llm.engine.get_output("t")
    assert out.finished and out.outputs[0].finish_reason == "abort" and not llm.engine.has_unfinished()
    for use in (lambda: s.generate(GREEDY), lambda: s.token_ids, lambda: s.append(messages=SYSTEM), lambda: s.fork(1)):
        with pytest.raises(kog.InvalidOperation, match="closed"):
            use()
    s.close()  # idempotent
    assert llm.engine.kv.stats()["blocks_used"] == 0 and llm.engine.kv.stats()["blocks_pinned"] == 0
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0].outputs[0].finish_reason == "length"


def test_session_arguments_are_checked():
    llm = make_llm()
    with pytest.raises(kog.InvalidRequest, match="exactly one"):
        llm.session()
    with llm.session(prompt_token_ids=[5, 6, 7]) as s:
        with pytest.raises(kog.InvalidRequest, match="exactly one"):
            s.append()
        with pytest.raises(kog.InvalidRequest, match="n must be"):
            s.fork(0)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "hf"
    config = tiny_config("llama")
    write_hf_model(folder, config, random_weights(config, seed=3))
    return kog.LLM(str(folder), "float32", max_num_batched_tokens=16, kv_cache_gib=0.01, block_size=4,
                   swap_space_gib=0.001)


def test_real_model_session_equals_stateless_greedy(tiny_llm):
    llm = tiny_llm
    params = kog.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prefix = TOK.encode("The quick brown fox jumps over the lazy dog. Kog serves agents: tool calls.")
    tool = TOK.encode(' {"name": "get_weather"}')
    with llm.session(prompt_token_ids=prefix) as s:
        first = s.generate(params)
        assert llm.engine.kv.num_host_blocks > 0 and s.suspend(offload=True) == "swapped"
        s.append(token_ids=tool)
        second = s.generate(params)
        context = prefix + first.outputs[0].token_ids + tool
        assert second.prefill_tokens_computed == len(tool) + 1
        [b] = s.fork(1)
        s.rollback(len(prefix) + 3)
        third = s.generate(params)
        forked = b.generate(params)
        b.close()
    stateless = llm.generate([{"prompt_token_ids": prefix}, {"prompt_token_ids": context},
                              {"prompt_token_ids": (prefix + first.outputs[0].token_ids)[: len(prefix) + 3]},
                              {"prompt_token_ids": context + second.outputs[0].token_ids}], params)
    assert first.outputs[0].token_ids == stateless[0].outputs[0].token_ids
    assert second.outputs[0].token_ids == stateless[1].outputs[0].token_ids
    assert third.outputs[0].token_ids == stateless[2].outputs[0].token_ids
    assert forked.outputs[0].token_ids == stateless[3].outputs[0].token_ids
    assert llm.engine.kv.stats()["blocks_used"] == 0
