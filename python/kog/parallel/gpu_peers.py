"""Tensor-parallel ranks' persistent kernels on one host's GPUs: each rank's inbox and flags
(kog._C.PeerSegment), their IPC handles exchanged through torch.distributed, every rank's
mapped into every process and given to the rank's decoder (docs/GPU.md, "Tensor parallelism
inside the persistent kernel"). kog.parallel.ranks.build_rank_runner calls it on every GPU
rank whose program the kernel runs. Compile-checked only: it has not run on GPUs yet.

    segment = connect_gpu_ranks(decoder, rank, size, group)   # every rank, collectively
    # keep `segment` alive while `decoder` runs
"""

from __future__ import annotations

from kog import _C
from kog.errors import BackendError


def connect_gpu_ranks(decoder, rank: int, size: int, group=None):
    """Allocates this rank's segment (decoder.inbox_bytes, decoder.flag_count zeroed flags) on
    the decoder's device, all-gathers the ranks' handles over `group` (a collective: every rank
    calls it), maps the others' and connects the decoder. Returns the segment, which owns the
    mappings: keep it alive while the decoder runs.

    Raises:
        BackendError: a CPU build of kog.
    """
    import torch
    import torch.distributed as dist

    if not hasattr(_C, "PeerSegment"):
        raise BackendError("GPU tensor parallelism needs a GPU build of kog (KOG_BACKEND=cuda or rocm)")
    with torch.cuda.device(decoder.device):
        segment = _C.PeerSegment(decoder.inbox_bytes, decoder.flag_count)
        handles: list = [None] * size
        dist.all_gather_object(handles, segment.handle(), group=group)
        segment.open(handles, rank)
    decoder.connect_ranks(segment.inboxes, segment.flags)
    return segment
