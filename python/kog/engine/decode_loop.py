"""The native sampler and the multi-token decode loop, as the engine uses them.

Which requests: a request is *native* when no token of it needs per-token Python work beside
appending it: no logprobs (they need each token's raw logits), no grammar (the mask depends on
the previous token), no speculation (drafts are verified in Python). Stop strings do not
exclude a request: the loop's tokens are appended one by one through the engine's usual path
(detokenize, stop strings), and a stop string found mid-loop ends the sequence there, the rest
of its loop tokens dropped (at most K - 1 decode steps wasted; the tokens kept are the ones a
step at a time would have produced).

Every token of a native request, the first (from prefill logits) included, is drawn by the
native sampler (kog._C.SequenceSampling; csrc/ops/sample.h) at counter = its output index, with
seed = params.seed + completion index, or a random seed drawn at admission when the request
has none. A draw thus depends only on (logits, params, seed, output index): one step per call
and K steps per call produce the same tokens.

The loop: a step whose batch is all native decode rows (no prefill, no verification) and with
nothing waiting for admission runs K decode steps in one native call, K adaptive: the largest
power of two <= the fewest tokens any row has output, at most max_steps; a row reaching its max
tokens or a stop token leaves the batch inside the call. So the first token never waits (it
comes from the prefill step), the next come 1, 2, 4, ... at a time, and a new request waits at
most one loop call. The engine reserves the KV of each row's next min(K, tokens left) tokens
first and gives back what a row that stopped early did not use.
The reservation is a count-only append (the ids are not known yet); when a row is settled
(release_unused), the allocator is told the ids of the reserved tokens that were computed
(KVCacheManager.name_tokens), so loop-decoded blocks join the prefix cache as a step at a
time's do: a session's next turn or a retry of the same request reuses them.
On the CPU the loop is kog._C.DecodeLoop over the decode executor; on a GPU it is the persistent
kernel's loop mode (GpuDecoder.decode with n_steps, GPU_DECODE_MAX_BATCH rows per launch), for
rows without penalties and past min_tokens (the kernel samples on the device and bans nothing),
K at most any row's tokens left (the kernel has no per-row max tokens).
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Sequence as Seq

import numpy as np
import torch

from kog import _C
from kog.engine.outputs import StreamDelta
from kog.engine.sequence import Sequence
from kog.errors import KVCacheFull
from kog.kvcache import KVCacheManager, KVMoves, KVState
from kog.sampler import SampleResult, SampleRow, sample
from kog.sampling_params import SamplingParams

LOOP_MAX_STEPS = 16
# _C.SequenceSampling's constructor arguments (NativeSampler._create): picklable, so another
# process can build the same state.
SamplingArgs = tuple
_I32_MAX = (1 << 31) - 1  # min_tokens past it is the same ban: no sequence gets that long
_U64 = (1 << 64) - 1
_F32_TINY = 1.1754944e-38  # the smallest normal float32
# uniform01 hashes seed * GOLDEN + counter: a seed shifted by d * GOLDEN^-1 draws at counter + d.
_GOLDEN_INV = pow(0x9E3779B97F4A7C15, -1, 1 << 64)


def is_native(params: SamplingParams) -> bool:
    """Whether a request's tokens are all drawn by the native sampler (module docstring)."""
    return params.logprobs is None and params.structured is None and params.speculative is None


def _f32_positive(x: float) -> float:
    """x as the native float32 parameter it becomes, kept > 0: a valid top_p or repetition
    penalty below float32's range (5e-324) must not become 0, which the native side refuses."""
    return max(x, _F32_TINY)


def native_top_k(top_k: int, vocab: int) -> int:
    """top_k as the native samplers' int32 parameter: 0 (off) below 1, and at most the vocabulary
    (both samplers treat top_k >= vocab as off), so any valid request fits."""
    return min(max(top_k, 0), vocab)


def shifted_seed(seed: int, offset: int) -> int:
    """The seed whose draw at counter c is seed's draw at counter c + offset."""
    return (seed + offset * _GOLDEN_INV) & _U64


def sample_rows(native: NativeSampler, logits: torch.Tensor, seqs: Seq[Sequence],
                python_row: Callable[[Sequence], SampleRow]) -> SampleResult:
    """One token per row of logits [len(seqs), vocab]: native requests' by the native sampler,
    the others' by kog.sampler (with logprobs where asked for)."""
    n = len(seqs)
    mine = [i for i, s in enumerate(seqs) if is_native(s.params)]
    result = SampleResult([0] * n, [None] * n, [None] * n)
    if mine:
        for i, t in zip(mine, native.sample([seqs[i] for i in mine], logits[mine])):
            result.token_ids[i] = t
    if len(mine) < n:
        others = [i for i, s in enumerate(seqs) if not is_native(s.params)]
        res = sample(logits[others], [python_row(seqs[i]) for i in others])
        for j, i in enumerate(others):
            result.token_ids[i], result.logprobs[i], result.top_logprobs[i] = \
                res.token_ids[j], res.logprobs[j], res.top_logprobs[j]
    return result


def merge_deltas(first: StreamDelta | None, then: StreamDelta) -> StreamDelta:
    """One delta for a sequence's consecutive tokens of one step."""
    if first is None:
        return then
    return StreamDelta(then.request_id, then.index, first.text + then.text, first.token_ids + then.token_ids,
                       then.finish_reason)


class NativeSampler:
    """The native sampling state of every native sequence, kept in step with its output_ids.

    Args:
        vocab_size: logits width.
        eos_token_ids: end-of-turn ids (stop ids unless ignore_eos; banned before min_tokens).
        max_model_len: a sequence finishes ("length") at this many tokens.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Seq[int], max_model_len: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        # id(seq) -> (seq, its state, the state's SamplingArgs, a key unique to that state)
        self._states: dict[int, tuple[Sequence, _C.SequenceSampling, SamplingArgs, int]] = {}
        self._keys = itertools.count()

    def state(self, seq: Sequence) -> _C.SequenceSampling:
        """seq's native state, created on first use, having counted exactly seq.output_ids."""
        entry = self._states.get(id(seq))
        if entry is None or entry[0] is not seq:
            args = self._create(seq)
            entry = (seq, _C.SequenceSampling(*args), args, next(self._keys))
            self._states[id(seq)] = entry
        st = entry[1]
        if st.n_output < seq.num_output_tokens:
            st.add_outputs(np.asarray(seq.token_ids[seq.num_prompt_tokens + st.n_output:], dtype=np.int32))
        return st

    def origin(self, seq: Sequence) -> tuple[int, SamplingArgs]:
        """(key, args) of seq's current state (`state` first): a key no other state of this
        sampler had, and the arguments that built it (`_C.SequenceSampling(*args)` elsewhere
        gives an equal state, before outputs)."""
        entry = self._states[id(seq)]
        return entry[3], entry[2]

    def forget(self, seq: Sequence) -> None:
        entry = self._states.get(id(seq))
        if entry is not None and entry[0] is seq:
            del self._states[id(seq)]

    def sample(self, seqs: Seq[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per row of logits [len(seqs), vocab] (any float dtype), not yet appended."""
        x = logits.to(torch.float32).contiguous().clone()  # penalties are applied in place
        out = np.zeros(len(seqs), dtype=np.int32)
        _C.sample_sequences(x.data_ptr(), len(seqs), self.vocab_size, [self.state(s) for s in seqs], out.ctypes.data)
        return out.tolist()

    def max_output(self, seq: Sequence) -> int:
        p = seq.params
        room = self.max_model_len - seq.num_prompt_tokens
        return max(1, min(room, p.max_tokens if p.max_tokens is not None else room))

    # ---- internal helpers ---------------------------------------------------------------------
    def _create(self, seq: Sequence) -> SamplingArgs:
        p = seq.params
        if p.seed is not None:
            seed = (p.seed + seq.index) & _U64
        else:  # NOTE: from torch's generator, so torch.manual_seed still makes a run repeatable
            seed = int(torch.randint(0, 1 << 62, ())) & _U64
        stop = _stop_ids(seq, self.eos_token_ids, self.vocab_size)
        banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if 0 <= t < self.vocab_size]
        rep = p.repetition_penalty != 1.0
        prompt = np.asarray(seq.token_ids[: seq.num_prompt_tokens] if rep else [], dtype=np.int32)
        return (self.vocab_size, prompt, 0.0 if p.greedy else p.temperature, native_top_k(p.top_k, self.vocab_size),
                _f32_positive(p.top_p), p.min_p, seed, _f32_positive(p.repetition_penalty), p.presence_penalty,
                p.frequency_penalty, min(p.min_tokens, _I32_MAX), self.max_output(seq), stop, banned)


class CpuLoop:
    """K decode steps of the CPU DecodeExecutor with sampling in one native call (kog._C.DecodeLoop).

    run(seqs, states, tokens, positions, block_tables, k): tokens / positions int64 [B],
    block_tables int32 [B, width], states the rows' SequenceSampling (they count the tokens);
    returns each row's tokens (1..k, ending at a stop token or max tokens). A tensor-parallel
    rank 0 mirrors the call on the other ranks first (kog.parallel.ranks.MirroredLoop).
    """

    def __init__(self, executor: _C.DecodeExecutor, vocab_size: int, block_size: int) -> None:
        self.loop = _C.DecodeLoop(executor, vocab_size, block_size)

    def run(self, seqs: Seq[Sequence], states: Seq[_C.SequenceSampling], tokens: np.ndarray, positions: np.ndarray,
            block_tables: np.ndarray, k: int) -> list[list[int]]:
        n = len(states)
        out = np.empty((k, n), dtype=np.int64)
        n_new = np.zeros(n, dtype=np.int32)
        finish = np.zeros(n, dtype=np.int32)
        self.loop.run(n, k, tokens.ctypes.data, positions.ctypes.data, block_tables.ctypes.data, block_tables.shape[1],
                      list(states), out.ctypes.data, n_new.ctypes.data, finish.ctypes.data)
        return [out[: n_new[i], i].tolist() for i in range(n)]


class DecodeLoop:
    """Runs K decode steps of a batch of native sequences in one native call.

    Args:
        runner: the model; its `native_decoder` (the CPU DecodeExecutor or a GpuDecoder) runs
            the loop. A runner without one (a test stand-in) never loops.
        kv: the block allocator (the loop reserves K tokens per row).
        apply_moves: performs the copies an allocation returns (the scheduler's).
        sampler: the native sampling states.
        max_steps: the largest K.
    """

    def __init__(self, runner, kv: KVCacheManager, apply_moves: Callable[[KVMoves], None], sampler: NativeSampler,
                 max_steps: int = LOOP_MAX_STEPS) -> None:
        self.kv = kv
        self.apply_moves = apply_moves
        self.sampler = sampler
        self.max_steps = max_steps
        self.block_size = runner.block_size
        decoder = getattr(runner, "native_decoder", None)
        cpu = isinstance(decoder, _C.DecodeExecutor)
        self._cpu: CpuLoop | None = None
        if cpu:  # a runner may build its own (a tensor-parallel rank 0 mirrors it on every rank)
            mirrored = getattr(runner, "native_loop", None)
            self._cpu = mirrored(sampler) if mirrored is not None else CpuLoop(decoder, runner.vocab_size,
                                                                              runner.block_size)
        self._gpu = decoder if decoder is not None and not cpu else None  # a GpuDecoder (or a test's stand-in)
        self._reserved: dict[int, int] = {}  # seq_id -> first position reserved count-only, until settled

    def steps_for(self, seqs: Seq[Sequence], others_waiting: bool) -> int:
        """K for a decode-only step over seqs (1: the usual one-step path)."""
        if (self._cpu is None and self._gpu is None) or others_waiting or self.max_steps <= 1:
            return 1
        if not all(is_native(s.params) and s.num_output_tokens for s in seqs):
            return 1
        states = [self.sampler.state(s) for s in seqs]
        if self._gpu is not None and not all(self._gpu_ok(s, st) for s, st in zip(seqs, states)):
            return 1
        fewest = min(st.n_output for st in states)
        k = 1 << (min(fewest, self.max_steps).bit_length() - 1)
        if self._gpu is not None:  # the kernel has no per-row max tokens: no row may pass its own
            k = min(k, min(self._room(s) for s in seqs))
        return max(1, k)

    def reserve(self, seqs: Seq[Sequence], k: int) -> bool:
        """Appends to each row the KV of the tokens it may still compute in k steps, beyond the
        one the scheduler appended; False, having changed nothing, when they do not fit."""
        try:
            moves = self.kv.append_batch([s.seq_id for s in seqs], [min(k, self._room(s)) - 1 for s in seqs])
        except KVCacheFull:
            return False
        for s in seqs:  # the scheduler appended (with its id) the token at num_computed
            self._reserved[s.seq_id] = s.num_computed + 1
        self.apply_moves(moves)  # swaps of suspended sequences the reservation made room with
        return True

    def run(self, seqs: Seq[Sequence], k: int) -> list[list[int]]:
        """k decode steps (reserved) of seqs; returns each row's tokens (1..k, ending at a stop
        token or max tokens). The rows' native states have counted them."""
        block_tables = self.kv.block_tables([s.seq_id for s in seqs])  # [B, width] int32, filled natively
        positions = np.array([s.num_computed for s in seqs], dtype=np.int64)  # [B]
        tokens = np.array([s.token_ids[-1] for s in seqs], dtype=np.int64)  # [B]
        states = [self.sampler.state(s) for s in seqs]
        if self._gpu is not None:
            return self._run_gpu(seqs, states, tokens, positions, block_tables, k)
        return self._cpu.run(seqs, states, tokens, positions, block_tables, k)

    def release_unused(self, seq: Sequence) -> None:
        """Settles a row after a loop call (call before its KV is freed or parked): gives back
        the KV it reserved but did not compute, and names the reserved tokens it did compute
        (token_ids[p] is the token whose KV sits at position p), so their full blocks feed the
        prefix cache."""
        start = self._reserved.pop(seq.seq_id, None)
        if seq.seq_id not in self.kv or self.kv.state(seq.seq_id) != KVState.RUNNING:
            return
        if self.kv.num_tokens(seq.seq_id) > seq.num_computed:
            self.kv.truncate(seq.seq_id, seq.num_computed)
        if start is not None and start < seq.num_computed:
            self.kv.name_tokens(seq.seq_id, start, seq.token_ids[start : seq.num_computed])

    # ---- internal helpers ---------------------------------------------------------------------
    def _room(self, seq: Sequence) -> int:
        """Tokens seq may still output (>= 1 for a running sequence)."""
        return self.sampler.max_output(seq) - seq.num_output_tokens

    def _gpu_ok(self, seq: Sequence, st: _C.SequenceSampling) -> bool:
        p = seq.params
        no_penalties = p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
        return no_penalties and st.n_output >= p.min_tokens

    def _run_gpu(self, seqs, states, tokens, positions, block_tables, k) -> list[list[int]]:
        """The persistent kernel's loop mode, GPU_DECODE_MAX_BATCH rows per launch. Each row's
        draws are at counters n_output.. (its seed shifted; the launch counts from 0); stop ids
        the kernel checks are those every row of the launch stops at, each row's own stop and
        length rules are applied here."""
        from kog.models.gpu_decode import DeviceSampling

        rows: list[list[int]] = []
        group = _C.GPU_DECODE_MAX_BATCH if hasattr(_C, "GPU_DECODE_MAX_BATCH") else len(seqs)
        for a in range(0, len(seqs), group):
            z = slice(a, a + group)
            sampling = [DeviceSampling(0.0 if s.params.greedy else s.params.temperature,
                                       native_top_k(s.params.top_k, self.sampler.vocab_size),
                                       _f32_positive(s.params.top_p), s.params.min_p, shifted_seed(st.seed, st.n_output))
                        for s, st in zip(seqs[z], states[z])]
            common = set.intersection(*(set(_stop_ids(s, self.sampler.eos_token_ids, self.sampler.vocab_size))
                                        for s in seqs[z]))
            res = self._gpu.decode(tokens[z], positions[z], block_tables[z], sampling, k, sorted(common), 0)
            out = res.tokens.cpu().numpy()  # [k, rows]
            for j, st in enumerate(states[z]):
                rows.append(_take_until_finish(st, out[:, j]))
        return rows


def _stop_ids(seq: Sequence, eos: Iterable[int], vocab: int) -> list[int]:
    """The ids that end seq, those a sampler can draw (< vocab: a larger valid id never comes)."""
    p = seq.params
    return [t for t in (*p.stop_token_ids, *([] if p.ignore_eos else eos)) if t < vocab]


def _take_until_finish(st: _C.SequenceSampling, column: np.ndarray) -> list[int]:
    """A row's tokens from the kernel (-1 after a kernel-side stop) up to its own finish."""
    taken = []
    for t in column.tolist():
        if t < 0:
            break
        st.add_output(int(t))
        taken.append(int(t))
        if st.finish_after(int(t)) != 0:
            break
    return taken
