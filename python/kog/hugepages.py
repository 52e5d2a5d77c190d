"""CPU weights and KV pool in transparent huge pages.

A decode step streams every weight once, and decode attention reads a sequence's KV blocks
scattered over the pool. With 4 KiB pages the hardware prefetcher stops at each page boundary
and every page costs a TLB walk; 2 MiB pages remove both, which reads the same bytes ~10% faster
on the machines measured (docs/PERFORMANCE.md). Linux only: the tensors live in a private
anonymous mapping advised MADV_HUGEPAGE before it is touched. Where that is not available
(another OS, THP disabled, KOG_HUGEPAGES=0) they stay on regular pages.
"""

from __future__ import annotations

import logging
import math
import mmap
import os

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # every tensor starts on a cache line


def hugepages_enabled() -> bool:
    """True when CPU tensors should go to huge pages: Linux with THP not `never`, and KOG_HUGEPAGES is not 0."""
    if os.environ.get("KOG_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def to_hugepages(weights: dict) -> dict:
    """The same tensors (names, shapes, dtypes, values) in one huge-page-backed arena; values
    are torch tensors or kog.quantized.QuantizedWeight.

    Empties `weights` as it goes (each original is released once copied), so peak memory stays
    about one copy of the weights. Returns `weights` itself, untouched, when huge pages are not
    available.
    """
    if not weights or not hugepages_enabled() or any(t.device.type != "cpu" for t in weights.values()):
        return weights
    # Quantized matrices (kog.quantized) move as their byte tensors and are rewrapped.
    wrappers = {name: t for name, t in weights.items() if not isinstance(t, torch.Tensor)}
    for name, w in wrappers.items():
        weights[name] = w.data
    offsets, size, first_of = {}, 0, {}
    for name, t in weights.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key in first_of:  # the same tensor under two names (tied embeddings) stays one tensor
            offsets[name] = first_of[key]
            continue
        offsets[name] = size
        first_of[key] = size
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buf = _arena(size)
    if buf is None:
        weights.update(wrappers)
        return weights
    out, placed = {}, {}
    for name in list(weights):
        t = weights.pop(name)
        if offsets[name] in placed:
            out[name] = placed[offsets[name]]
            continue
        nbytes = t.numel() * t.element_size()
        view = buf[offsets[name]: offsets[name] + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[name] = placed[offsets[name]] = view
    for name, w in wrappers.items():
        out[name] = w.with_data(out[name])
    return out


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on huge pages where available (anonymous memory is zero)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = _arena(nbytes) if nbytes >= HUGE_PAGE and hugepages_enabled() else None
    if buf is None:
        return torch.zeros(shape, dtype=dtype)
    return buf[:nbytes].view(dtype).view(shape)


def _arena(size: int) -> torch.Tensor | None:
    """A uint8 tensor of `size` zero bytes starting on a huge page, in a fresh mapping advised
    MADV_HUGEPAGE (the tensor holds the mapping alive), or None if it cannot be had."""
    try:
        arena = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as e:  # no memory for the mapping, or madvise refused
        log.debug("staying on regular pages: %s", e)
        return None
    buf = torch.frombuffer(arena, dtype=torch.uint8)
    start = -buf.data_ptr() % HUGE_PAGE
    return buf[start: start + size]
