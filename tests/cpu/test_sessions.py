"""Engine-level agent sessions against an oracle: the fake model reads its context back through
the paged KV, so a session's output equals a stateless request's on the same full context only
if the KV it kept, forked, truncated or swapped is exactly right."""

import itertools

import pytest
import torch

import kog
from kog.engine.scheduler import Scheduler
from kog.engine.sequence import Sequence
from kog.engine.session_manager import EngineRequests, SessionManager
from kog.kvcache import KVCacheManager
from kog.sampling_params import SamplingParams
from kog.testing.engine_oracle import fake_engine, oracle_tokens, run_until_done
from kog.testing.tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def ids(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TOK.vocab_size, (n,), generator=g).tolist()


def oracle(context, params=GREEDY, index=0):
    return oracle_tokens(context, params, TOK.vocab_size, EOS, index)


def open_session(engine, sid, prefix):
    rid = engine.sessions.open(sid, prefix)
    run_until_done(engine, [rid])
    return engine.get_output(rid)


def gen(engine, sid, rid, params=GREEDY):
    engine.sessions.generate(sid, rid, params)
    run_until_done(engine, [rid])
    return engine.get_output(rid)


def test_open_prefills_once_and_pins_the_prefix():
    engine, _ = fake_engine(TOK)
    prefix = ids(0, 18)
    opened = open_session(engine, "s", prefix)
    assert opened.finished and opened.prefill_tokens_computed == 17  # the last token stays pending
    assert engine.sessions.info("s")["pinned_tokens"] == 16 and engine.kv.stats()["blocks_pinned"] == 4
    other = open_session(engine, "t", prefix + ids(1, 5))  # a second agent on the same prefix
    assert other.num_cached_tokens == 16 and other.prefill_tokens_computed == 22 - 16
    engine.sessions.close("s")
    engine.sessions.close("t")
    st = engine.kv.stats()
    assert st["blocks_used"] == 0 and st["blocks_pinned"] == 0 and st["num_sequences"] == 0


def test_turns_equal_stateless_requests_and_prefill_only_new_tokens():
    engine, _ = fake_engine(TOK)
    prefix = ids(2, 13)
    open_session(engine, "s", prefix)
    first = gen(engine, "s", "t1")
    assert first.outputs[0].token_ids == oracle(prefix)
    assert first.prefill_tokens_computed == 1 and first.num_cached_tokens == 12
    context = prefix + first.outputs[0].token_ids
    assert engine.sessions.info("s")["token_ids"] == context
    tool = ids(3, 7)
    engine.sessions.append("s", tool)
    second = gen(engine, "s", "t2")
    assert second.outputs[0].token_ids == oracle(context + tool)
    # only the appended tokens and the last sampled one (never fed) are computed
    assert second.prefill_tokens_computed == len(tool) + 1
    assert second.num_cached_tokens == len(context) - 1
    engine.sessions.close("s")
    assert engine.kv.stats()["blocks_used"] == 0


def test_fork_shares_blocks_and_branches_match_the_oracle():
    engine, _ = fake_engine(TOK)
    prefix = ids(4, 10)
    open_session(engine, "s", prefix)
    engine.sessions.append("s", ids(5, 4))
    context = engine.sessions.info("s")["token_ids"]
    used = engine.kv.stats()["blocks_used"]
    engine.sessions.fork("s", ["a", "b", "c"])
    assert engine.kv.stats()["blocks_used"] == used  # zero copies, zero new blocks
    assert engine.kv.stats()["num_sequences"] == 4
    outs = {}
    for i, sid in enumerate(["a", "b", "c"]):
        params = SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8, ignore_eos=True)
        engine.sessions.generate(sid, f"r{sid}", params)
        outs[sid] = params
    run_until_done(engine, ["ra", "rb", "rc"])
    for sid, params in outs.items():
        assert engine.get_output(f"r{sid}").outputs[0].token_ids == oracle(context, params)
    assert engine.kv.stats()["cow_copies"] >= 2  # the shared, partly filled tail was copied on write
    parent = gen(engine, "s", "rs")  # the parent is untouched by its branches
    assert parent.outputs[0].token_ids == oracle(context)
    for sid in ["s", "a", "b", "c"]:
        engine.sessions.close(sid)
    assert engine.kv.stats()["blocks_used"] == 0 and engine.kv.stats()["blocks_pinned"] == 0


def test_rollback_then_generate_equals_a_fresh_run_on_the_truncated_context():
    engine, _ = fake_engine(TOK)
    prefix = ids(6, 9)
    open_session(engine, "s", prefix)
    out = gen(engine, "s", "t1", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    context = prefix + out.outputs[0].token_ids
    for n in (15, 9, 3):  # inside the output, at the prefix end, inside the pinned prefix
        engine.sessions.rollback("s", n)
        assert engine.sessions.info("s")["token_ids"] == context[:n]
        again = gen(engine, "s", f"r{n}")
        assert again.outputs[0].token_ids == oracle(context[:n])
        assert again.prefill_tokens_computed == 1  # the KV before the cut was kept
        context = context[:n] + again.outputs[0].token_ids
    with pytest.raises(kog.InvalidRequest, match="rollback"):
        engine.sessions.rollback("s", 0)
    engine.sessions.close("s")
    assert engine.kv.stats()["blocks_used"] == 0


def test_suspended_session_swaps_under_pressure_and_resumes_bit_exact():
    engine, _ = fake_engine(TOK, num_blocks=12, host_blocks=8, budget=32)
    prefix = ids(7, 14)
    open_session(engine, "s", prefix)
    out = gen(engine, "s", "t1", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    context = prefix + out.outputs[0].token_ids
    assert engine.sessions.suspend("s") == "suspended"
    # a stateless request that needs the session's blocks: the allocator swaps the session out
    other = ids(8, 25)
    engine.add_request("big", other, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    run_until_done(engine, ["big"])
    assert engine.get_output("big").outputs[0].token_ids == oracle(other, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert engine.sessions.info("s")["kv_state"] == "swapped"
    assert engine.kv.stats()["blocks_swapped_out"] > 0
    tool = ids(9, 3)
    engine.sessions.append("s", tool)
    back = gen(engine, "s", "t2")
    assert back.outputs[0].token_ids == oracle(context + tool)
    assert back.prefill_tokens_computed == len(tool) + 1  # swapped in, not recomputed
    engine.sessions.close("s")
    st = engine.kv.stats()
    assert st["blocks_used"] == 0 and st["blocks_swapped"] == 0


def test_suspend_offload_moves_kv_to_host_now():
    engine, _ = fake_engine(TOK, host_blocks=8)
    open_session(engine, "s", ids(10, 11))
    assert engine.sessions.suspend("s", offload=True) == "swapped"
    assert engine.kv.stats()["blocks_swapped"] > 0
    assert gen(engine, "s", "t").outputs[0].token_ids == oracle(ids(10, 11))
    no_host, _ = fake_engine(TOK)
    open_session(no_host, "s", ids(10, 11))
    with pytest.raises(kog.InvalidOperation, match="host swap pool"):
        no_host.sessions.suspend("s", offload=True)


def test_idle_sessions_are_dropped_last_and_recompute_correctly():
    engine, _ = fake_engine(TOK, num_blocks=10, budget=32)  # no host pool: nowhere to swap
    prefix = ids(11, 15)
    engine.sessions.open("s", prefix, pin=False)
    run_until_done(engine, ["session-open:s"])
    other = ids(12, 30)
    engine.add_request("big", other, GREEDY)
    run_until_done(engine, ["big"])
    assert engine.get_output("big").outputs[0].token_ids == oracle(other)
    assert engine.sessions.info("s")["kv_state"] == "dropped"
    back = gen(engine, "s", "t")
    assert back.outputs[0].token_ids == oracle(prefix)
    assert back.prefill_tokens_computed + back.num_cached_tokens == len(prefix)  # recomputation visible


def test_abort_keeps_the_session_and_restores_its_context():
    engine, _ = fake_engine(TOK)
    prefix = ids(13, 9)
    open_session(engine, "s", prefix)
    engine.sessions.generate("s", "t1", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        engine.step()
    with pytest.raises(kog.InvalidOperation, match="in flight"):
        engine.sessions.append("s", [5])
    engine.abort("t1")
    assert engine.get_output("t1").outputs[0].finish_reason == "abort"
    assert engine.sessions.info("s")["token_ids"] == prefix
    assert gen(engine, "s", "t2").outputs[0].token_ids == oracle(prefix)
    engine.sessions.close("s")
    assert engine.kv.stats()["blocks_used"] == 0


def test_close_aborts_the_request_in_flight_and_frees_everything():
    engine, _ = fake_engine(TOK)
    open_session(engine, "s", ids(14, 21))
    engine.sessions.generate("s", "t", SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.sessions.close("s")
    assert engine.get_output("t").outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished()
    st = engine.kv.stats()
    assert st["blocks_used"] == 0 and st["blocks_pinned"] == 0 and st["num_sequences"] == 0
    with pytest.raises(kog.InvalidRequest, match="unknown session"):
        engine.sessions.generate("s", "u", GREEDY)


def test_session_requests_are_validated():
    engine, _ = fake_engine(TOK, max_model_len=20)
    open_session(engine, "s", ids(15, 12))
    with pytest.raises(kog.InvalidRequest, match="use fork for branches"):
        engine.sessions.generate("s", "x", SamplingParams(n=2))
    with pytest.raises(kog.InvalidRequest, match="context length"):
        engine.sessions.append("s", ids(16, 8))
    with pytest.raises(kog.InvalidRequest, match="already in use"):
        engine.sessions.open("s", [5, 6])
    with pytest.raises(kog.InvalidRequest, match="new and distinct"):
        engine.sessions.fork("s", ["a", "a"])


def test_preemption_swaps_running_sequences_when_the_host_pool_has_room():
    engine, _ = fake_engine(TOK, num_blocks=12, host_blocks=16, budget=32)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    prompts = {f"r{i}": ids(200 + i, 6) for i in range(4)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    run_until_done(engine, list(prompts))
    for rid, p in prompts.items():
        assert engine.get_output(rid).outputs[0].token_ids == oracle(p, params), rid
    st = engine.kv.stats()
    assert st["blocks_swapped_out"] > 0 and st["blocks_used"] == 0 and st["blocks_swapped"] == 0
    # swapped, not recomputed: beyond its prompt, a request only feeds its pending sampled
    # token as a one-token chunk after each swap-in; recomputing would redo prompt and outputs
    swapped = sum(engine.get_output(r).prefill_tokens_computed for r in prompts)
    assert 4 * 6 < swapped
    recompute, _ = fake_engine(TOK, num_blocks=12, budget=32)
    for rid, p in prompts.items():
        recompute.add_request(rid, p, params)
    run_until_done(recompute, list(prompts))
    assert swapped + 10 < sum(recompute.get_output(r).prefill_tokens_computed for r in prompts)


def test_prefix_caching_can_be_turned_off():
    engine, _ = fake_engine(TOK, prefix_caching=False)
    p = ids(17, 20)
    for rid in ("a", "b"):
        engine.add_request(rid, p, GREEDY)
        run_until_done(engine, [rid])
        assert engine.get_output(rid).num_cached_tokens == 0
        assert engine.get_output(rid).prefill_tokens_computed == 20


def test_prefill_session_computes_appended_tokens_once_before_a_fork():
    engine, _ = fake_engine(TOK)
    open_session(engine, "s", ids(18, 10))
    gen(engine, "s", "t1")
    engine.sessions.append("s", ids(19, 7))
    context = engine.sessions.info("s")["token_ids"]
    engine.sessions.prefill("s", "p")
    run_until_done(engine, ["p"])
    assert engine.get_output("p").prefill_tokens_computed == 7  # pending token + 6; the last stays pending
    assert engine.get_output("p").outputs[0].token_ids == []
    engine.sessions.fork("s", ["a", "b"])
    for sid in ("a", "b"):
        out = gen(engine, sid, f"g{sid}")
        assert out.outputs[0].token_ids == oracle(context) and out.prefill_tokens_computed == 1


def test_session_manager_is_a_component_built_without_an_engine():
    """SessionManager needs an allocator, a scheduler and the request functions it is given:
    requests go through register/abort, ids are checked with is_request, nothing else."""
    kv = KVCacheManager(16, 4)
    sched = Scheduler(kv, lambda moves: None)
    registered: dict[str, Sequence] = {}
    aborted: list[str] = []
    seq_ids = itertools.count(100)

    def abort(rid):  # what the engine does: the request ends, its session parks it
        aborted.append(rid)
        registered[rid].finish_reason = "abort"
        sessions.on_done(registered[rid])

    def new_sequence(rid, index, ids, params, priority, seq_id):
        return Sequence(next(seq_ids) if seq_id is None else seq_id, rid, index, ids, params, None, priority=priority)

    requests = EngineRequests(
        validate_ids=lambda t: [int(x) for x in t], validate_prompt=lambda t: [int(x) for x in t],
        check_params=lambda p: None, new_sequence=new_sequence, admit_grammar=lambda seq: None,
        is_request=registered.__contains__, register=lambda rid, seq, text: registered.__setitem__(rid, seq),
        abort=abort)
    sessions = SessionManager(kv, lambda moves: None, sched, requests)
    rid = sessions.open("s", [5, 6, 7, 8], pin=False)
    opening = registered[rid]
    assert rid == "session-open:s" and opening.prefill_only and opening.session_id == "s"
    assert sched.waiting == [opening] and "s" in sessions and sessions.request_in_flight("s") == rid
    with pytest.raises(kog.InvalidOperation, match="in flight"):
        sessions.append("s", [9])
    abort(rid)  # the opening ends (here without KV): the session is idle, its context intact
    assert sessions.request_in_flight("s") is None and sessions.info("s")["token_ids"] == [5, 6, 7, 8]
    sessions.append("s", [9, 10])
    sessions.generate("s", "g", GREEDY)
    assert registered["g"].seq_id == opening.seq_id and registered["g"].prompt_ids == [5, 6, 7, 8, 9, 10]
    sessions.open("t", [1, 2], pin=False)
    abort("session-open:t")
    with pytest.raises(kog.InvalidRequest, match="already in use"):
        sessions.generate("t", "g", GREEDY)
    sessions.close("s")  # aborts "g" through the engine's abort
    assert aborted == ["session-open:s", "session-open:t", "g"]
    assert "s" not in sessions and list(sessions) == ["t"] and len(sessions) == 1
