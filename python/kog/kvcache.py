"""Paged KV memory: the block allocator (C++, kog._C) and the KV tensors it indexes.

KVCacheManager owns block ids only: block tables, copy-on-write forks, the prefix cache, pins,
suspend/resume and swapping. It never touches KV bytes; every mutating call returns a KVMoves
whose copies the backend performs (KVCacheStorage.apply) before the step's kernels run:

    moves.swap_out  [n, 2] int32 (device block, host block)   first
    moves.swap_in   [n, 2] int32 (host block, device block)   second
    moves.cow       [n, 2] int32 (src block, dst block)       third
    moves.slots     [n]    int64 where the new tokens' K/V go  (block_id * block_size + offset)

Layout (shared with the attention kernels): one tensor for all layers,
    kv: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]  (index 0 = K, 1 = V)
token t of a sequence lives in block table[t // block_size] at offset t % block_size.

Errors: kog.KVCacheFull (nothing left to evict or swap), kog.UnknownSequence,
kog.InvalidOperation (e.g. appending to a suspended sequence), kog.InvalidRequest. A call that
raises leaves the allocator exactly as it was.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from kog import _C, hugepages
from kog.errors import InvalidRequest

KVMoves = _C.KVMoves


class KVState(str, enum.Enum):
    """Where a sequence's KV is (the allocator's _C.KVSeqState, member for member by name).

    A str enum: it compares equal to its value ("running", ...) and serializes as it.
    """

    RUNNING = "running"      # resident on the device, appendable
    SUSPENDED = "suspended"  # resident, out of the batch; pressure may swap it to the host
    SWAPPED = "swapped"      # its exclusive blocks are in the host pool

    def __str__(self) -> str:
        return self.value


_KV_STATES = {int(v): KVState[name] for name, v in _C.KVSeqState.__members__.items()}


def _ids(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    return np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)


@dataclass(frozen=True)
class KVLayout:
    """Shape of the paged KV tensors; `bytes_per_block` counts all layers, K and V."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, num_blocks, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def slab_bytes(self) -> int:
        """Bytes of one block of one layer (a contiguous slab)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.slab_bytes


@dataclass(frozen=True)
class Pin:
    """A pinned prefix: its blocks stay resident until KVCacheManager.unpin(pin)."""

    id: int
    num_tokens: int


class KVCacheManager:
    """Block tables for a scheduler, over a pool of `num_blocks` device blocks.

    Args:
        num_blocks: device blocks in the pool.
        block_size: tokens per block.
        num_host_blocks: blocks of the host swap pool (0 disables swapping).
        namespace: seeds the prefix-cache hash chain (use the model id: no cross-model hits).
        bytes_per_block: KV bytes of one block, for the bytes_swapped stats.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, num_host_blocks: int = 0,
                 namespace: str = "", bytes_per_block: int = 0) -> None:
        self._a = _C.KVCacheAllocator(num_blocks, block_size, num_host_blocks, namespace,
                                      bytes_per_block)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks

    # ---- sequences ---------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, prompt: Sequence[int] | np.ndarray) -> tuple[int, KVMoves]:
        """Creates a running sequence for `prompt`, sharing its longest cached prefix.

        Returns:
            (num_cached_tokens, moves): the first num_cached_tokens already have KV; moves.slots
            holds the slots of the remaining prompt tokens.
        """
        return self._a.add_sequence(seq_id, _ids(prompt))

    def append(self, seq_id: int, tokens: Sequence[int] | np.ndarray | None = None,
               n_tokens: int | None = None) -> KVMoves:
        """Appends tokens (ids feed the prefix cache) or just a count of tokens.

        Returns the moves; moves.cow is non-empty when the tail block was shared (copy-on-write).
        """
        if (tokens is None) == (n_tokens is None):
            raise InvalidRequest("append: pass exactly one of tokens or n_tokens")
        if tokens is not None:
            return self._a.append_tokens(seq_id, _ids(tokens))
        return self._a.append(seq_id, n_tokens)

    def append_batch(self, seq_ids: Iterable[int], counts: Iterable[int],
                     tokens: Sequence[int] | np.ndarray | None = None) -> KVMoves:
        """Appends counts[i] tokens to each of several distinct running sequences in one call
        (one reservation); all or nothing.

        Args:
            tokens: the sum(counts) token ids, sequence after sequence (they feed the prefix
                cache); None appends counts only (the sequences stop feeding it).

        Returns the moves; moves.slots holds the new tokens' slots in the same order.
        """
        return self._a.append_batch(np.asarray(seq_ids, np.int64), np.asarray(counts, np.int64),
                                    None if tokens is None else _ids(tokens))

    def name_tokens(self, seq_id: int, start: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Names tokens [start, start + len(tokens)) of a sequence appended count-only (the
        decode loop reserves KV before it knows the ids): the full blocks they complete join the
        prefix cache, and later appends with ids feed it again. start must not pass the
        sequence's named prefix (info()["named"]); tokens already named must match."""
        self._a.name_tokens(seq_id, start, _ids(tokens))

    def can_append(self, seq_id: int, n_tokens: int) -> bool:
        """Whether append(seq_id, n_tokens) would succeed now (free and cached blocks, and
        what swapping suspended sequences would free, exactly as append counts them)."""
        return self._a.can_append(seq_id, n_tokens)

    def max_appendable(self, seq_id: int) -> int:
        """The most tokens append(seq_id, ...) takes now (a shared partial tail costs a block
        for its copy-on-write)."""
        return self._a.max_appendable(seq_id)

    def max_appendable_batch(self, seq_ids: Sequence[int], counts: Sequence[int]) -> int:
        """How many leading entries of append_batch(seq_ids, counts) fit together now."""
        return self._a.max_appendable_batch(np.asarray(seq_ids, np.int64), np.asarray(counts, np.int64))

    def fork(self, parent: int, child: int) -> None:
        """`child` shares all of `parent`'s blocks: O(1), no KV bytes copied."""
        self._a.fork(parent, child)

    def fork_batch(self, parents: Iterable[int], children: Iterable[int]) -> None:
        self._a.fork_batch(np.asarray(parents, np.int64), np.asarray(children, np.int64))

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Keeps the first n_tokens (rejected speculative tokens, backtracking)."""
        self._a.truncate(seq_id, n_tokens)

    def free(self, seq_id: int) -> None:
        self._a.free(seq_id)

    def free_batch(self, seq_ids: Iterable[int]) -> None:
        self._a.free_batch(np.asarray(seq_ids, np.int64))

    def suspend(self, seq_id: int) -> None:
        """Leaves the running set (e.g. while a tool runs); blocks stay until pressure swaps them."""
        self._a.suspend(seq_id)

    def resume(self, seq_id: int) -> KVMoves:
        """Back to running; a swapped sequence is swapped in (moves.swap_in)."""
        return self._a.resume(seq_id)

    def swap_out(self, seq_id: int) -> KVMoves:
        """Swaps a suspended sequence's exclusively owned blocks to the host pool now."""
        return self._a.swap_out(seq_id)

    # ---- prefix cache ------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Number of leading tokens whose KV is cached (a multiple of block_size)."""
        return self._a.lookup(_ids(tokens))

    def pin(self, tokens: Sequence[int] | np.ndarray) -> Pin:
        """Keeps the cached prefix of `tokens` (a system prompt, tool schemas) resident."""
        pin_id, n = self._a.pin(_ids(tokens))
        return Pin(pin_id, n)

    def unpin(self, pin: Pin) -> None:
        self._a.unpin(pin.id)

    def evict(self, n_blocks: int) -> int:
        """Evicts up to n_blocks unreferenced cached blocks (LRU first); returns how many."""
        return self._a.evict(n_blocks)

    # ---- views for the scheduler and the kernels ---------------------------------------------
    def block_table(self, seq_id: int) -> np.ndarray:
        """[ceil(num_tokens / block_size)] int32 physical block ids of a resident sequence."""
        return self._a.block_table(seq_id)

    def block_tables(self, seq_ids: Sequence[int]) -> np.ndarray:
        """[len(seq_ids), longest table] int32 block tables of resident sequences, each row
        padded with 0 (filled natively, one call for the batch)."""
        return self._a.block_tables(np.asarray(seq_ids, np.int64))

    def fill_block_tables(self, seq_ids: Sequence[int], out: np.ndarray) -> None:
        """Writes block_tables(seq_ids) into out [len(seq_ids), width] int32 (C-contiguous,
        width >= the longest table), padding every row with 0."""
        self._a.fill_block_tables(np.asarray(seq_ids, np.int64), out)

    def slot_mapping(self, seq_id: int, start: int, end: int) -> np.ndarray:
        """[end - start] int64 slots of tokens start..end-1 of a resident sequence."""
        if not 0 <= start <= end <= self.num_tokens(seq_id):
            raise InvalidRequest(f"slot_mapping: bad range [{start}, {end})")
        pos = np.arange(start, end, dtype=np.int64)
        table = self.block_table(seq_id).astype(np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def num_tokens(self, seq_id: int) -> int:
        return self._a.info(seq_id)["num_tokens"]

    def info(self, seq_id: int) -> dict:
        """One sequence as the allocator holds it: state, tail block, num_tokens, named (the
        leading tokens whose ids it holds), tokens_known (whether its full blocks feed the prefix
        cache) and host_blocks (its swapped-out suffix)."""
        return self._a.info(seq_id)

    def state(self, seq_id: int) -> KVState:
        """Where seq_id's KV is: KVState.RUNNING, SUSPENDED or SWAPPED."""
        return _KV_STATES[int(self._a.info(seq_id)["state"])]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._a

    def stats(self) -> dict[str, int]:
        """Blocks used/free/cached/pinned/swapped, prefix queries and hit tokens, CoW copies,
        evictions and blocks/bytes swapped out and in."""
        return self._a.stats()

    def debug_state(self) -> dict:
        """Every block's ref/parent/hash flags, free stack, LRU order, sequences (their state a
        KVState), pins (tests)."""
        d = self._a.debug_state()
        for info in d["seqs"].values():
            info["state"] = _KV_STATES[int(info["state"])]
        return d


class KVCacheStorage:
    """The physical KV tensors: device pool and host swap pool, allocated once.

    Args:
        layout: shapes and dtype.
        num_blocks: device blocks (the manager's num_blocks).
        num_host_blocks: host blocks (pinned memory when the device is a GPU).
        device: where the device pool lives.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, num_host_blocks: int = 0,
                 device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        # kv: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]
        if self.device.type == "cpu":  # decode attention reads scattered blocks: no TLB walk per 4 KiB
            self.kv = hugepages.zeros(layout.shape(num_blocks), layout.dtype)
        else:
            self.kv = torch.zeros(layout.shape(num_blocks), dtype=layout.dtype, device=self.device)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        # host: [num_layers, num_host_blocks, 2, num_kv_heads, block_size, head_dim]
        self.host = torch.zeros(layout.shape(num_host_blocks), dtype=layout.dtype, pin_memory=pin)

    def apply(self, moves: KVMoves) -> None:
        """Performs a KVMoves' copies in the required order: swap_out, swap_in, cow."""
        self.copy_blocks(self.host, self.kv, moves.swap_out)
        self.copy_blocks(self.kv, self.host, moves.swap_in)
        self.copy_blocks(self.kv, self.kv, moves.cow)

    def write(self, layer: int, slots: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores k, v [n, num_kv_heads, head_dim] of n tokens at `slots` [n] of one layer."""
        s = torch.as_tensor(np.asarray(slots), dtype=torch.int64, device=self.device)
        bs = self.layout.block_size
        self.kv[layer, s // bs, 0, :, s % bs] = k.to(self.kv.dtype)
        self.kv[layer, s // bs, 1, :, s % bs] = v.to(self.kv.dtype)

    def gather(self, layer: int, block_table: np.ndarray, n_tokens: int) -> torch.Tensor:
        """[2, n_tokens, num_kv_heads, head_dim] K and V of a sequence's first n_tokens."""
        pos = torch.arange(n_tokens, device=self.device)
        table = torch.as_tensor(np.asarray(block_table), dtype=torch.int64, device=self.device)
        bs = self.layout.block_size
        return self.kv[layer, table[pos // bs], :, :, pos % bs].permute(1, 0, 2, 3)

    def copy_blocks(self, dst: torch.Tensor, src: torch.Tensor, pairs: np.ndarray) -> None:
        """Copies blocks pairs[i] = (dst block, src block) between self.kv and self.host (any direction)."""
        if len(pairs) == 0:
            return
        if dst.device.type == "cpu" and src.device.type == "cpu":
            _C.kv_copy_blocks(dst.data_ptr(), dst.shape[1], src.data_ptr(), src.shape[1],
                              self.layout.num_layers, self.layout.slab_bytes, pairs)
            return
        # GPU: one kernel launch on the current stream; the host pool is pinned, read and
        # written through its mapped device address.
        device = dst.device if dst.device.type == "cuda" else src.device
        pairs = np.ascontiguousarray(pairs, dtype=np.int32)
        pairs_device = torch.from_numpy(pairs).to(device, non_blocking=False)
        stream = torch.cuda.current_stream(device)
        _C.kv_copy_blocks_gpu(dst.data_ptr(), dst.shape[1], dst.device.type == "cpu",
                              src.data_ptr(), src.shape[1], src.device.type == "cpu",
                              self.layout.num_layers, self.layout.slab_bytes, pairs,
                              pairs_device.data_ptr(), stream.cuda_stream)
        pairs_device.record_stream(stream)

__all__ = ["KVCacheManager", "KVCacheStorage", "KVLayout", "KVMoves", "KVState", "Pin"]
