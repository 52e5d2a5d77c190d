"""Kog's CPU worker pool (csrc/cpu/thread_pool.h): barriers order every thread's writes, waits
spin briefly and then sleep (so Kog yields the CPU when another process holds a core), errors
reach the caller, and a forked child gets a working pool."""

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import kog
from kog import _C

from test_decode_executor import fill, run_schedule_in_python, tiny_runner


@pytest.fixture
def pool_threads():
    """Sets the pool size for one test, then restores it. The contention back-off is off (a
    loaded test machine must not turn the team these tests check into a team of one), but for
    the test of the back-off itself."""
    before = _C.cpu_num_threads()
    _C._thread_pool_reset_contention()
    _C._thread_pool_set_backoff(False)
    yield _C.set_cpu_num_threads
    _C.set_cpu_num_threads(before)
    _C._thread_pool_set_backoff(True)
    _C._thread_pool_reset_contention()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_a_barrier_orders_every_threads_writes(pool_threads, n):
    pool_threads(4)  # more threads than cores on a 2-core machine: waits must still be exact
    for _ in range(20):
        team, violations = _C._thread_pool_barrier_check(n, 200)
        assert (team, violations) == (n, 0)


def test_a_region_never_has_more_threads_than_the_pool(pool_threads):
    pool_threads(3)
    assert _C._thread_pool_barrier_check(8, 10) == (3, 0)


def test_waiting_threads_sleep_instead_of_spinning(pool_threads):
    # Thread 0 holds the region for 300 ms while the others wait at a barrier, then the caller
    # sleeps 300 ms with the workers parked. Spinning waiters (libgomp's default policy) would
    # burn about a core each for the whole 300 ms: the CPU time of Kog's process next to a busy
    # compiler is exactly what made it 35x slower.
    pool_threads(3)
    team, in_region, parked = _C._thread_pool_wait_cpu(3, 300)
    assert team == 3
    assert in_region < 0.06, f"{in_region:.3f} s of CPU while two threads waited 0.3 s"
    assert parked < 0.03, f"{parked:.3f} s of CPU while the pool was parked 0.3 s"


def test_barrier_waits_of_a_time_slice_make_regions_run_on_one_thread_for_a_while(pool_threads):
    # A thread kept off its core (simulated: it sleeps 3 ms before each barrier) makes every
    # barrier cost a time slice; then one thread is faster than the team, so the pool backs
    # off to the caller alone (100 ms at first), and probes the whole team again after.
    pool_threads(2)
    _C._thread_pool_set_backoff(True)
    backoffs, _ = _C._thread_pool_contention()
    assert _C._thread_pool_slow_barriers(2, 4, 3000) == 2
    assert _C._thread_pool_contention() == (backoffs + 1, True)
    assert _C._thread_pool_barrier_check(2, 50) == (1, 0)  # backing off: a team of one
    time.sleep(0.25)
    assert _C._thread_pool_barrier_check(2, 50) == (2, 0)  # probed again with the whole team


@pytest.mark.parametrize("thrower", [0, 1])
def test_an_error_in_any_thread_reaches_the_caller_and_the_pool_goes_on(pool_threads, thrower):
    pool_threads(2)
    with pytest.raises(kog.KogError, match=f"thread {thrower} of the region failed"):
        _C._thread_pool_throw_check(2, thrower)
    assert _C._thread_pool_barrier_check(2, 50) == (2, 0)


def test_a_region_inside_a_region_runs_on_its_own_thread(pool_threads):
    pool_threads(2)
    assert _C._thread_pool_throw_check(2, -1, nested=True) == 2  # each thread ran its nested region inline


def test_two_callers_at_once_both_get_correct_regions(pool_threads):
    # One region at a time: the second caller runs its region on its own thread (a team of 1).
    pool_threads(2)
    results, errors = [], []

    def call():
        try:
            for _ in range(100):
                results.append(_C._thread_pool_barrier_check(2, 20))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 200
    assert all(v == 0 and team in (1, 2) for team, v in results)


def _child_region(q):
    q.put(_C._thread_pool_barrier_check(2, 20))


def test_a_forked_child_has_a_working_pool(pool_threads):
    pool_threads(2)
    assert _C._thread_pool_barrier_check(2, 5) == (2, 0)  # the parent's workers exist
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_region, args=(q,))
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 0
    assert q.get(timeout=5) == (2, 0)


@pytest.mark.parametrize("var", ["KOG_NUM_THREADS", "OMP_NUM_THREADS"])
def test_the_pool_size_comes_from_the_environment(var):
    env = {k: v for k, v in os.environ.items() if k not in ("KOG_NUM_THREADS", "OMP_NUM_THREADS")}
    code = "from kog import _C; import kog; print(_C.cpu_num_threads(), kog.backend_info()['cpu_threads'])"
    out = subprocess.run([sys.executable, "-c", code], env={**env, var: "3"}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["3", "3"]


def test_bad_pool_size_is_refused():
    with pytest.raises(kog.KogError, match="must be >= 1"):
        _C.set_cpu_num_threads(0)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_decode_executor_gives_the_same_logits_with_any_number_of_threads(pool_threads, n):
    pool_threads(n)
    r = tiny_runner("llama", torch.float32)
    step = fill(r, [[5, 9, 13], list(range(20, 31)), [40]])
    kv_before = r.kv.kv.clone()
    want = run_schedule_in_python(r, step["tokens"], step["positions"], step["block_tables"],
                                  step["seq_lens"], step["slots"])
    r.kv.kv.copy_(kv_before)
    sampled = np.zeros(3, dtype=np.int64)
    got = r.decode(**step, sampled=sampled)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
