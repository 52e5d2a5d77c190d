"""AsyncEngine over the fake model: the loop thread, cancellation, the waiting limit, drain, step errors."""

import asyncio
import time

import pytest

import kog
from kog.engine.async_engine import AsyncEngine
from server_helpers import TOK, make_engine

PROMPT = TOK.encode("the quick brown fox jumps over the lazy dog")


def params(max_tokens=8, **kw):
    return kog.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_generate_matches_the_synchronous_engine():
    expected = kog.LLM.from_engine(make_engine(), TOK).generate({"prompt_token_ids": PROMPT}, params(12))[0]

    async def main():
        engine = AsyncEngine(make_engine())
        updates = [u async for u in engine.generate(PROMPT, params(12))]
        await engine.shutdown()
        return engine, updates

    engine, updates = run(main())
    assert updates[-1].finished and not any(u.finished for u in updates[:-1])
    assert "".join(d.text for u in updates for d in u.deltas) == expected.outputs[0].text
    assert updates[-1].output.outputs[0].token_ids == expected.outputs[0].token_ids
    assert engine.stats()["kv"]["blocks_used"] == 0


def test_concurrent_requests_batch_and_n_gt_1():
    async def main():
        engine = AsyncEngine(make_engine())

        async def one(i):
            return [u async for u in engine.generate(PROMPT[: 5 + i], params(6, n=2))][-1].output

        outs = await asyncio.gather(*(one(i) for i in range(5)))
        await engine.shutdown()
        return outs

    outs = run(main())
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 6 for c in o.outputs) for o in outs)


def test_cancelled_consumer_aborts_and_frees_kv():
    async def main():
        engine = AsyncEngine(make_engine(step_delay=0.005))
        got_first = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPT, params(400)):
                got_first.set()
                await asyncio.sleep(10)

        task = asyncio.create_task(consume())
        await got_first.wait()
        await asyncio.sleep(0.05)
        assert engine.stats()["kv"]["blocks_used"] > 0 and engine.stats()["in_flight"] == 1
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the abort lands before the loop's next step
            if engine.stats()["in_flight"] == 0 and engine.stats()["kv"]["blocks_used"] == 0:
                break
            await asyncio.sleep(0.01)
        assert time.monotonic() - t0 < 1.0  # aborted, not run to its 400 tokens
        stats = engine.stats()
        await engine.shutdown()
        return stats

    stats = run(main())
    assert stats["in_flight"] == 0 and stats["kv"]["blocks_used"] == 0


def test_closing_a_session_ends_its_request_in_flight_with_session_closed():
    async def main():
        engine = AsyncEngine(make_engine(step_delay=0.005))
        async for _ in await engine.open_session("s", PROMPT):
            pass
        stream = await engine.add_session_request("s", params(200))
        first = await stream.__anext__()
        assert not first.finished and engine.stats()["kv"]["blocks_used"] > 0
        assert await engine.close_session("s") is True
        rest = []
        with pytest.raises(kog.SessionClosed, match="'s' was closed"):
            async for u in stream:
                rest.append(u)
        assert rest[-1].finished and rest[-1].output.outputs[0].finish_reason == "abort"
        assert not any(u.finished for u in rest[:-1]) and len(rest[-1].output.outputs[0].token_ids) < 200
        assert await engine.close_session("s") is False  # already gone
        stats = engine.stats()
        after = [u async for u in engine.generate(PROMPT, params(4))][-1].output  # still serving
        await engine.shutdown()
        return stats, after

    stats, after = run(main())
    assert stats["in_flight"] == 0 and stats["kv"]["blocks_used"] == 0 and stats["kv"]["blocks_pinned"] == 0
    assert len(after.outputs[0].token_ids) == 4


def test_invalid_request_raises_at_submission():
    async def main():
        engine = AsyncEngine(make_engine())
        with pytest.raises(kog.InvalidRequest, match="vocab|in \\["):
            await engine.add_request([10**6], params())
        with pytest.raises(kog.InvalidRequest, match="empty"):
            await engine.add_request([], params())
        await engine.shutdown()

    run(main())


def test_waiting_queue_limit_raises_queue_full():
    async def main():
        engine = AsyncEngine(make_engine(step_delay=0.005, max_num_seqs=1), max_waiting=2)
        streams = [await engine.add_request(PROMPT, params(64)) for _ in range(3)]  # 1 running + 2 waiting
        for _ in range(100):
            if engine.stats()["waiting"] == 2:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(kog.QueueFull):
            await engine.add_request(PROMPT, params())
        for s in streams:
            s.close()
        await engine.shutdown()

    run(main())


def test_a_batch_is_queued_whole_or_not_at_all():
    async def main():
        engine = AsyncEngine(make_engine(step_delay=0.005, max_num_seqs=1), max_waiting=2)
        with pytest.raises(kog.InvalidRequest, match="empty"):
            await engine.add_requests([PROMPT, PROMPT, []], params(64), ["a", "b", "c"])
        assert engine.stats()["in_flight"] == 0 and engine.stats()["kv"]["blocks_used"] == 0
        # checked once: a batch larger than max_waiting is queued whole while the queue has room
        streams = await engine.add_requests([PROMPT] * 4, params(64), ["a", "b", "c", "d"])
        for _ in range(100):
            if engine.stats()["waiting"] == 3:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(kog.QueueFull):
            await engine.add_requests([PROMPT], params(), ["e"])
        for s in streams:
            s.close()
        await engine.shutdown()

    run(main())


def test_drain_finishes_in_flight_and_refuses_new():
    async def main():
        engine = AsyncEngine(make_engine())
        stream = await engine.add_request(PROMPT, params(30))
        done = asyncio.create_task(engine.shutdown(drain=True))
        await asyncio.sleep(0)
        with pytest.raises(kog.EngineDraining):
            await engine.add_request(PROMPT, params())
        updates = [u async for u in stream]
        assert await done
        return updates

    updates = run(main())
    assert updates[-1].finished and len(updates[-1].output.outputs[0].token_ids) == 30


def test_shutdown_without_drain_aborts():
    async def main():
        engine = AsyncEngine(make_engine(step_delay=0.005))
        stream = await engine.add_request(PROMPT, params(400))
        assert await engine.shutdown(drain=False, timeout=10)
        updates = [u async for u in stream]
        return updates[-1].output

    out = run(main())
    assert out.finished and out.outputs[0].finish_reason == "abort"


def test_step_error_fails_requests_and_engine_recovers():
    async def main():
        inner = make_engine()
        engine = AsyncEngine(inner)
        real_step = inner.step
        calls = {"n": 0}

        def flaky():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return real_step()

        inner.step = flaky
        with pytest.raises(kog.EngineStepError, match="boom"):
            async for _ in engine.generate(PROMPT, params(20)):
                pass
        assert engine.stats()["kv"]["blocks_used"] == 0
        out = [u async for u in engine.generate(PROMPT, params(4))][-1].output
        await engine.shutdown()
        return out

    assert len(run(main()).outputs[0].token_ids) == 4


def test_a_failure_outside_step_fails_requests_and_marks_the_engine_dead():
    async def main():
        inner = make_engine()
        engine = AsyncEngine(inner)

        def broken(rid):
            raise RuntimeError("bookkeeping bug")

        inner.get_output = broken
        with pytest.raises(kog.EngineStepError, match="bookkeeping bug"):
            async for _ in engine.generate(PROMPT, params(4)):
                pass
        assert engine.stats()["dead"] and not engine.is_accepting
        with pytest.raises(kog.EngineStepError, match="earlier failure"):
            await engine.add_request(PROMPT, params())
        assert await engine.shutdown(timeout=10)

    run(main())
