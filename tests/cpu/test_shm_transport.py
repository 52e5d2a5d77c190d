"""kog._C.ShmTransport: shared-memory all-reduce and delayed gathers between ranks of one host
(ranks as threads here, each with its own attachment to the segment, as separate processes have)."""

import ctypes
import os
import time
from pathlib import Path

import pytest
import torch

import kog
from kog import _C
from kog.errors import TransportError
from kog.testing.threads import in_threads


def name() -> str:
    return f"/kog-test-{os.getpid()}-{time.monotonic_ns()}"


def ranks(size, reduce_floats=64, n_slots=3, slot_bytes=256, timeout_s=10.0):
    n = name()
    first = _C.ShmTransport(n, 0, size, reduce_floats, n_slots, slot_bytes, timeout_s)
    return [first] + [_C.ShmTransport(n, r, size, reduce_floats, n_slots, slot_bytes, timeout_s)
                      for r in range(1, size)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_all_reduce_sums_in_rank_order_on_every_rank_many_times(size):
    ts = ranks(size)
    g = torch.Generator().manual_seed(size)
    rounds = [[torch.randn(50, generator=g) for _ in range(size)] for _ in range(40)]

    def rank(r):
        got = []
        for k, xs in enumerate(rounds):
            x = xs[r].clone()
            ts[r].all_reduce(x.data_ptr(), 50 if k % 3 else 17)  # sizes vary between collectives
            got.append(x.clone())
        return got

    results = in_threads([lambda r=r: rank(r) for r in range(size)])
    for k, xs in enumerate(rounds):
        n = 50 if k % 3 else 17
        want = xs[0][:n].clone()
        for x in xs[1:]:
            want += x[:n]
        for r in range(size):
            assert torch.equal(results[r][k][:n], want)  # bit-identical: the same order everywhere
            assert torch.equal(results[r][k][n:], rounds[k][r][n:])  # nothing past n touched


def test_delayed_gather_publish_returns_at_once_and_wait_sees_every_part():
    # A broadcast delay of 2: publish layer j, then read layer j - 2, in a ring of 2 * 2 + 2 slots
    # (with 4 slots a rank two layers ahead overwrote what the other still read: kog.lane_config).
    ts = ranks(2, n_slots=6, slot_bytes=64)

    def rank(r):
        seen = []
        for layer in range(30):  # the ring reused 5 times
            part = torch.full((16,), float(100 * layer + r))
            ts[r].publish(layer % 6, part.data_ptr(), 64)
            if layer % 5 == 2 * r:
                time.sleep(0.002)  # each rank lags now and then, so the other runs ahead
            if layer >= 2:
                addr = ts[r].wait((layer - 2) % 6)
                parts = torch.frombuffer(bytearray((ctypes_string(addr, 2 * 64))), dtype=torch.float32)
                seen.append(parts.view(2, 16)[:, 0].tolist())
        return seen

    a, b = in_threads([lambda: rank(0), lambda: rank(1)])
    want = [[100.0 * (layer - 2), 100.0 * (layer - 2) + 1] for layer in range(2, 30)]
    assert a == want and b == want


def ctypes_string(addr, n):
    import ctypes

    return ctypes.string_at(addr, n)


def test_a_rank_that_never_arrives_is_a_transport_error_after_the_timeout():
    ts = ranks(2, timeout_s=0.3)
    x = torch.ones(8)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="rank 1"):
        ts[0].all_reduce(x.data_ptr(), 8)
    assert time.monotonic() - t0 < 5
    with pytest.raises(TransportError, match="rank 1"):
        ts[0].publish(0, x.data_ptr(), 32) or ts[0].wait(0)


def test_ranks_that_disagree_on_the_sizes_or_find_no_segment_fail_clearly():
    n = name()
    first = _C.ShmTransport(n, 0, 2, 64, 2, 128, 5.0)
    with pytest.raises(TransportError, match="sizes"):
        _C.ShmTransport(n, 1, 2, 32, 2, 128, 0.5)
    with pytest.raises(TransportError, match="no segment"):
        _C.ShmTransport(name(), 1, 2, 64, 2, 128, 0.2)
    with pytest.raises(Exception, match="rank"):
        _C.ShmTransport(name(), 2, 2, 64, 2, 128, 0.2)
    del first


def test_noop_mode_keeps_each_rank_local():
    ts = ranks(2)
    x = torch.arange(8, dtype=torch.float32)
    ts[0].set_noop(True)
    ts[0].all_reduce(x.data_ptr(), 8)  # returns at once: no peer needed
    assert torch.equal(x, torch.arange(8, dtype=torch.float32))


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_rank_whose_process_exited_fails_the_wait_at_once(tmp_path, reaped):
    """Also when the exited rank is this process's child not yet reaped (a zombie: what a worker
    that dies under rank 0, its parent, is until rank 0 waits for it)."""
    import subprocess
    import sys

    n = name()
    first = _C.ShmTransport(n, 0, 2, 64, 2, 128, 60.0)  # a long timeout: the exit must be seen first
    code = f"from kog import _C; import time; t = _C.ShmTransport({n!r}, 1, 2, 64, 2, 128, 60.0); print('up', flush=True); time.sleep(60)"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in (str(Path(_C.__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH")) if p)}
    peer = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert peer.stdout.readline().strip() == "up"
    peer.kill()
    if reaped:
        peer.wait()
    else:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{peer.pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
    x = torch.ones(8)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="exited"):
        first.all_reduce(x.data_ptr(), 8)
    assert time.monotonic() - t0 < 5
    peer.wait()


def test_simulated_link_latency_delays_the_reader_not_the_sender():
    ts = ranks(2)
    for t in ts:
        t.set_link_latency_us(30_000)  # 30 ms, far above scheduling noise
    x = torch.ones(16)
    t0 = time.monotonic()
    ts[1].publish(0, x.data_ptr(), 64)
    ts[0].publish(0, x.data_ptr(), 64)
    sent = time.monotonic() - t0
    ts[0].wait(0)
    seen = time.monotonic() - t0
    assert sent < 0.01 and seen >= 0.029


@pytest.mark.parametrize("nbytes", [4, 52, 250])  # the streaming copy's 16-byte steps and its tail
def test_publish_copies_parts_of_any_length_exactly(nbytes):
    ts = ranks(2, n_slots=1, slot_bytes=256)
    parts = [torch.randint(0, 256, (256,), dtype=torch.uint8) for _ in range(2)]
    for r in (1, 0):
        ts[r].publish(0, parts[r].data_ptr() + 3, nbytes)  # an unaligned source
    got = ctypes_string(ts[0].wait(0), 2 * 256)
    for r in range(2):
        assert got[r * 256:r * 256 + nbytes] == bytes(parts[r][3:3 + nbytes].tolist())


def test_stats_split_what_the_link_took_from_what_the_rank_waited():
    ts = ranks(2)
    for t in ts:
        t.set_link_latency_us(20_000)
    x = [torch.ones(16), torch.ones(16)]
    # A delayed gather read 30 ms after its publish: the 20 ms link is hidden.
    ts[1].publish(0, x[1].data_ptr(), 64)
    ts[0].publish(0, x[0].data_ptr(), 64)
    time.sleep(0.03)
    ts[0].wait(0)
    g = ts[0].stats()["gather"]
    assert g["count"] == 1 and g["link_s"] >= 0.02 and g["inside_s"] < 0.01 and g["wait_s"] <= g["inside_s"]
    # An all-reduce pays the link at once: inside >= the latency, most of it waiting.
    in_threads([lambda r=r: ts[r].all_reduce(x[r].data_ptr(), 16) for r in range(2)])
    for t in ts:
        a = t.stats()["all_reduce"]
        assert a["count"] == 1 and a["inside_s"] >= 0.019 and a["wait_s"] >= 0.015
        assert 0.02 <= a["link_s"] < 0.02 + a["inside_s"]
    assert torch.equal(x[0], torch.full((16,), 2.0))
    ts[0].reset_stats()
    ts[0].set_noop(True)
    ts[0].all_reduce(x[0].data_ptr(), 16)
    ts[0].publish(0, x[0].data_ptr(), 64)
    assert all(v == 0 for kind in ts[0].stats().values() for v in kind.values())


def test_a_part_written_in_place_is_published_without_a_copy():
    """publish(slot, slot_part(slot), n): the part the producer wrote in the segment is what the
    other ranks read; prefetch ahead of a wait changes nothing but timing."""
    ts = ranks(2, n_slots=2, slot_bytes=64)
    for r, t in enumerate(ts):
        addr = t.slot_part(1)
        assert addr == t.wait(1) + r * 64  # the rank's part of the slot's [size][slot_bytes]
        torch.frombuffer((ctypes.c_char * 64).from_address(addr), dtype=torch.float32).fill_(10.0 + r)
    ts[1].publish(1, ts[1].slot_part(1), 64)
    ts[0].prefetch(1, 64)
    ts[0].publish(1, ts[0].slot_part(1), 64)
    for t in ts:
        got = torch.frombuffer(bytearray(ctypes_string(t.wait(1), 128)), dtype=torch.float32).view(2, 16)
        assert got[:, 0].tolist() == [10.0, 11.0] and got[:, -1].tolist() == [10.0, 11.0]
    with pytest.raises(kog.InvalidRequest, match="slot 2 of 2"):
        ts[0].slot_part(2)
