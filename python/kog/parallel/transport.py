"""Transports: how the ranks of a lane model exchange the program's collectives.

    t.all_reduce(x)   # [T, w] -> the sum over ranks, in rank order, on every rank
    t.all_gather(x)   # [T, w] -> [T, size w]: rank r's x in columns r w .. (r + 1) w

Every call is a collective: all ranks make the same calls in the same order (the program's
order). A rank that never arrives makes the others fail after `timeout_s` (TransportError),
never hang.

ThreadGroup runs the ranks as threads of one process (tests; one host without processes);
TorchDistTransport uses a torch.distributed process group (gloo on the CPU); ShmRankTransport is
the ranks of one host over shared memory (kog._C.ShmTransport), which the native decode
executor also drives directly.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Protocol

import torch

from kog.errors import BackendError, TransportError


class Transport(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...


class ThreadGroup:
    """`size` in-process ranks; transport(r) is rank r's end. Sums run in rank order, so every
    rank gets bit-identical results."""

    def __init__(self, size: int, timeout_s: float = 30.0) -> None:
        self.size, self.timeout_s = size, timeout_s
        self._slots: list[torch.Tensor | None] = [None] * size
        self._barrier = threading.Barrier(size)

    def transport(self, rank: int) -> _ThreadTransport:
        return _ThreadTransport(self, rank)

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        try:
            self._barrier.wait(self.timeout_s)  # the previous collective's readers are done
            self._slots[rank] = x
            self._barrier.wait(self.timeout_s)
            parts = list(self._slots)
        except threading.BrokenBarrierError:
            self._barrier.abort()
            raise TransportError(f"rank {rank}: a rank did not reach the collective within {self.timeout_s} s") from None
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:
            raise TransportError(f"rank {rank}: ranks sent different shapes {sorted(shapes)}")
        return parts


class _ThreadTransport:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.group._exchange(self.rank, x)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.group._exchange(self.rank, x), dim=1)


class TorchDistTransport:
    """Collectives over an initialized torch.distributed group (gloo on the CPU; NCCL/RCCL on
    GPUs). The group's timeout (init_process_group(timeout=...)) bounds every call."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise BackendError("torch.distributed is not initialized (init_process_group first)")
        self._dist, self._group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = x.contiguous().clone()
        try:
            self._dist.all_reduce(out, group=self._group)
        except RuntimeError as e:  # gloo raises on a timeout or a dead peer
            raise TransportError(f"rank {self.rank}: all_reduce failed: {e}") from None
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
            self._dist.all_gather(parts, x.contiguous(), group=self._group)
        except RuntimeError as e:
            raise TransportError(f"rank {self.rank}: all_gather failed: {e}") from None
        return torch.cat(parts, dim=1)


def init_gloo(rank: int, size: int, addr: str, port: int, timeout_s: float = 60.0) -> TorchDistTransport:
    """Joins a gloo group over TCP (loopback for one host) and returns its transport."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    return TorchDistTransport()


class ShmRankTransport:
    """A rank's end of a shared-memory segment: the interpreter's collectives here, the native
    executor's through `.native` (the same segment and sequence, so both keep the ranks in step).
    all_gather is an all-reduce of rows that are zero outside this rank's columns (exact)."""

    def __init__(self, name: str, rank: int, size: int, reduce_floats: int, n_slots: int, slot_bytes: int,
                 timeout_s: float) -> None:
        from kog import _C

        self.rank, self.size = rank, size
        self.native = _C.ShmTransport(name, rank, size, reduce_floats, max(n_slots, 1), slot_bytes, timeout_s)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float().contiguous().clone()
        self.native.all_reduce(out.data_ptr(), out.numel())
        return out.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        w = x.shape[1]
        full = x.new_zeros(x.shape[0], self.size * w, dtype=torch.float32)
        full[:, self.rank * w:(self.rank + 1) * w] = x.float()
        self.native.all_reduce(full.data_ptr(), full.numel())
        return full.to(x.dtype)
