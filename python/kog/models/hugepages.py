"""CPU weights in transparent huge pages.

A decode step streams every weight once. With 4 KiB pages the hardware prefetcher stops at each
page boundary and every page costs a TLB walk; 2 MiB pages remove both, which reads the same
bytes ~10% faster on the machines measured (docs/PERFORMANCE.md). Linux only: the weights are
copied into one private anonymous mapping advised MADV_HUGEPAGE before it is touched. Where that
is not available (another OS, THP disabled, KOG_HUGEPAGES=0) the weights stay as they are.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # every tensor starts on a cache line


def hugepages_enabled() -> bool:
    """True when weights should go to huge pages: Linux with THP not `never`, and KOG_HUGEPAGES is not 0."""
    if os.environ.get("KOG_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def to_hugepages(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors (names, shapes, dtypes, values) in one huge-page-backed arena.

    Empties `weights` as it goes (each original is released once copied), so peak memory stays
    about one copy of the weights. Returns `weights` itself, untouched, when huge pages are not
    available.
    """
    if not weights or not hugepages_enabled() or any(t.device.type != "cpu" for t in weights.values()):
        return weights
    offsets, size, first_of = {}, 0, {}
    for name, t in weights.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key in first_of:  # the same tensor under two names (tied embeddings) stays one tensor
            offsets[name] = first_of[key]
            continue
        offsets[name] = size
        first_of[key] = size
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    try:
        arena = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as e:  # no memory for the mapping, or madvise refused
        log.debug("weights stay on regular pages: %s", e)
        return weights
    buf = torch.frombuffer(arena, dtype=torch.uint8)  # holds the mapping alive
    start = -buf.data_ptr() % HUGE_PAGE
    out, placed = {}, {}
    for name in list(weights):
        t = weights.pop(name)
        if offsets[name] in placed:
            out[name] = placed[offsets[name]]
            continue
        nbytes = t.numel() * t.element_size()
        view = buf[start + offsets[name]: start + offsets[name] + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[name] = placed[offsets[name]] = view
    return out
