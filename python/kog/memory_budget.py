"""`gpu_memory_utilization`: the KV pool sized as a fraction of the device's memory, as vLLM sizes it.

On a GPU the fraction is of the device's total memory, and it covers everything Kog puts there:

    kv_bytes = utilization * total - in_use - weight_bytes

where in_use is what the device already holds when the engine is built (other processes, a model
loaded before) and weight_bytes the model's weights, which the runner copies there next. On the
CPU backend the fraction is of the host memory available (Linux's MemAvailable) once the weights
are loaded (they are in memory by then, so they are not subtracted again):

    kv_bytes = utilization * available
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kog.errors import InvalidRequest

GIB = 2**30


@dataclass(frozen=True)
class DeviceMemory:
    """The memory figure a fraction applies to.

    Attributes:
        total: bytes the fraction is of (device total on a GPU, host memory available on the CPU).
        in_use: bytes already taken out of `total` before the engine allocates (0 on the CPU).
    """

    total: int
    in_use: int = 0


def device_memory(device: str | torch.device) -> DeviceMemory:
    """The memory figure of `device` now ("cpu", "cuda", "cuda:N")."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InvalidRequest(f"device must be 'cpu' or a GPU ('cuda', 'cuda:N'), got {device!r}") from None
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return DeviceMemory(total=total, in_use=total - free)
    return DeviceMemory(total=_host_available_bytes())


def kv_cache_bytes(utilization: float, memory: DeviceMemory, weight_bytes: int = 0) -> int:
    """Bytes for the KV pool (see the module docstring).

    Args:
        utilization: the fraction, in (0, 1].
        memory: the device's figure (device_memory).
        weight_bytes: weights still to be copied onto the device (0 on the CPU).
    Raises:
        InvalidRequest: a fraction out of range, or one that leaves no memory for the KV pool.
    """
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise InvalidRequest(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    budget = int(utilization * memory.total) - memory.in_use - weight_bytes
    if budget <= 0:
        raise InvalidRequest(
            f"gpu_memory_utilization {utilization} leaves no memory for the KV cache: {utilization} x "
            f"{memory.total / GIB:.2f} GiB, less {memory.in_use / GIB:.2f} GiB in use and {weight_bytes / GIB:.2f} GiB "
            "of weights; raise it or give kv_cache_gib")
    return budget


# ---------------------------------------------------------------------- internal helpers


def _host_available_bytes() -> int:
    """MemAvailable (free memory plus reclaimable caches) on Linux; free pages elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
