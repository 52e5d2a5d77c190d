"""LLMEngine: requests in, one continuous-batching step at a time, outputs out.

A step = schedule (KV allocation, copies applied) -> one batched decode call + one batched
prefill call on the runner -> sample -> detokenize and check stop conditions. A step that only
decodes native requests runs up to K decode steps in one native call instead (loop mode,
kog.engine.decode_loop).

Agent sessions (open/generate/append/fork/suspend/rollback/close) live in `engine.sessions`, a
SessionManager (kog.engine.session_manager, docs/SESSIONS.md). Nothing here is thread-safe: call
every method from the thread that runs step(), between steps.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import numpy as np
import torch

from kog.engine import prompt_logprobs, structured
from kog.engine.chunks import forward_chunks
from kog.engine.decode_loop import LOOP_MAX_STEPS, DecodeLoop, NativeSampler, is_native, merge_deltas, sample_rows
from kog.engine.outputs import CompletionOutput, FinishReason, RequestOutput, StreamDelta
from kog.engine.scheduler import PrefillWork, Scheduler, SchedulerOutput
from kog.engine.sequence import Sequence
from kog.engine.session_manager import EngineRequests, SessionManager
from kog.engine.speculative import Speculator, VerifyWork
from kog.engine.stop import apply_stop_strings, check_stop_token, streamable_text
from kog.errors import InvalidRequest
from kog.kvcache import KVCacheManager
from kog.loader.tokenizer import Tokenizer
from kog.models.runner import PrefillChunk
from kog.sampler import PenaltyCounts, SampleRow, make_generator, needs_penalties
from kog.sampling_params import SamplingParams


@dataclass
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None   # None: the model's context, capped by the KV capacity
    num_host_blocks: int = 0           # host swap pool (suspended sessions, swap preemption)
    namespace: str = ""                # seeds the prefix-cache hashes (the model id)
    enable_prefix_caching: bool = True # admit requests with their longest cached prefix
    max_loop_steps: int = LOOP_MAX_STEPS  # most decode steps one native call runs (1: no loop mode)


class Runner(Protocol):
    kv: object          # KVCacheStorage: .kv [layers, blocks, 2, heads, block_size, dim], .layout, .apply(moves)
    block_size: int
    vocab_size: int

    def prefill(self, chunks: list[PrefillChunk]) -> torch.Tensor: ...
    def verify(self, chunks: list[PrefillChunk]) -> list[torch.Tensor]: ...  # speculation only
    def decode(self, tokens, positions, block_tables, seq_lens, slots) -> torch.Tensor: ...


class LLMEngine:
    """Args:
        runner: the model (prefill/decode over the paged KV tensors it owns).
        tokenizer: for incremental detokenization and stop strings.
        eos_token_ids: end-of-turn ids (ignored by requests with ignore_eos).
        model_max_len: the model's context length.
        config: batching and memory limits.
    """

    def __init__(self, runner: Runner, tokenizer: Tokenizer, eos_token_ids: Seq[int], model_max_len: int,
                 config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        num_blocks = runner.kv.kv.shape[1]
        self.kv = KVCacheManager(num_blocks, runner.block_size, self.config.num_host_blocks,
                                 self.config.namespace, runner.kv.layout.bytes_per_block)
        self.kv_capacity_tokens = num_blocks * runner.block_size
        self.max_model_len = min(self.config.max_model_len or model_max_len, model_max_len, self.kv_capacity_tokens)
        self.scheduler = Scheduler(self.kv, runner.kv.apply, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, self.config.enable_prefix_caching)
        self._requests: dict[str, list[Sequence]] = {}
        self._prompts: dict[str, str | None] = {}
        self._prompt_ids: dict[str, list[int]] = {}  # per request, made once: every output shares it
        self._seq_ids = itertools.count()
        self.num_prefill_tokens_computed = 0  # every token run through a prefill chunk, ever (recomputation included)
        self.speculator = Speculator(runner, self.kv, runner.kv.apply, self.eos_token_ids, self.max_model_len)
        self.sessions = SessionManager(self.kv, runner.kv.apply, self.scheduler, EngineRequests(
            validate_ids=self._validate_ids, validate_prompt=self._validate_prompt,
            check_params=self.speculator.check, new_sequence=self._new_sequence,
            admit_grammar=lambda seq: structured.admit(seq, self.tokenizer, self.eos_token_ids, runner.vocab_size),
            is_request=lambda rid: rid in self._requests, register=self._register, abort=self.abort))
        self.native_sampler = NativeSampler(runner.vocab_size, self.eos_token_ids, self.max_model_len)
        self.decode_loop = DecodeLoop(runner, self.kv, runner.kv.apply, self.native_sampler,
                                      self.config.max_loop_steps)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    prompt: str | None = None, priority: int = 0) -> None:
        """Queues a request. Raises InvalidRequest for an empty or too long prompt or bad ids."""
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        ids = self._validate_prompt(prompt_token_ids)
        params.validate()
        self.speculator.check(params)
        seq = self._new_sequence(request_id, 0, ids, params, priority)
        structured.admit(seq, self.tokenizer, self.eos_token_ids, self.runner.vocab_size)
        self._register(request_id, seq, prompt)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Stops a request at once and frees its KV (unknown ids are ignored). A session's
        request keeps the session: its context goes back to what it was before the request."""
        for seq in self._requests.get(request_id, []):
            if not seq.is_finished:
                seq.finish_reason = FinishReason.ABORT
                self._done(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def is_finished(self, request_id: str) -> bool:
        """Whether every completion of the request has ended (O(n), no output built)."""
        seqs = self._requests[request_id]
        parent = seqs[0]
        return len(seqs) == parent.params.n and all(s.is_finished for s in seqs) or parent.finish_reason == FinishReason.ABORT

    def get_output(self, request_id: str) -> RequestOutput:
        """The request so far. Costs O(output tokens), not O(context): the prompt's ids are one
        list per request, shared by every output (do not modify them); step() returns the
        per-step deltas for streaming."""
        seqs = self._requests[request_id]
        parent = seqs[0]
        done = self.is_finished(request_id)
        prompt_ids = self._prompt_ids.get(request_id)
        if prompt_ids is None:
            prompt_ids = self._prompt_ids[request_id] = list(parent.prompt_ids)
        outs = [CompletionOutput(s.index, s.text, s.token_ids[s.num_prompt_tokens:],
                                 s.cumulative_logprob if s.params.logprobs is not None else None,
                                 list(s.logprobs) if s.params.logprobs is not None else None,
                                 s.finish_reason, s.stop_reason) for s in seqs]
        metrics = {"arrival_time": parent.arrival_time}
        if parent.first_token_time is not None:
            metrics["first_token_time"] = parent.first_token_time
        prompt_lps = None
        if parent.params.prompt_logprobs is not None and not parent.prompt_logprobs_pending:
            prompt_lps = list(parent.prompt_logprobs)
        return RequestOutput(request_id, self._prompts[request_id], prompt_ids, outs, done,
                             parent.num_cached_tokens, sum(s.num_prefill_computed for s in seqs), metrics,
                             sum(s.num_forward_passes for s in seqs), prompt_lps)

    def release(self, request_id: str) -> None:
        """Forgets a finished request's bookkeeping."""
        self.abort(request_id)
        self._requests.pop(request_id, None)
        self._prompts.pop(request_id, None)
        self._prompt_ids.pop(request_id, None)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Runs one engine step; returns what each sequence produced in it."""
        work = self.scheduler.schedule()
        for seq in work.prefilled:
            self._prefill_done(seq)
        if not work.decode and not work.prefill:
            return []
        verify = self.speculator.take(work.decode, work.decode_slots)  # speculating seqs leave the decode
        if work.decode and not work.prefill and not verify:  # K native decode steps in one call
            k = self.decode_loop.steps_for(work.decode, bool(self.scheduler.waiting))
            if k > 1 and self.decode_loop.reserve(work.decode, k):
                return self._loop_step(work.decode, k)
        # The grammar masks of sequences with output are computed while the forwards run (a prompt's
        # first mask is not: its constraint may be forked for n > 1 siblings meanwhile).
        masks = structured.prefetch_masks(work.decode + [w.seq for w in work.prefill if w.seq.num_output_tokens])
        try:
            return self._forward_and_sample(work, verify, masks)
        finally:
            masks.wait()  # NOTE: on every exit: the next step may touch these constraints

    def _forward_and_sample(self, work: SchedulerOutput, verify: list[VerifyWork],
                            masks: structured.MaskPrefetch) -> list[StreamDelta]:
        """The step after scheduling: forwards (decode, prefill chunks, verify chunks), then one
        token sampled for every sequence whose tokens are all computed."""
        rows: list[tuple[int, Sequence]] = []  # (row of the stacked logits, sequence to sample)
        parts: list[torch.Tensor] = []
        if work.decode:
            parts.append(self._run_decode(work.decode, work.decode_slots))
            for i, seq in enumerate(work.decode):
                seq.num_computed += 1
                seq.num_forward_passes += 1
                rows.append((i, seq))
        if work.prefill:
            base = len(work.decode)
            parts.append(self._run_prefill(work.prefill))
            for i, w in enumerate(work.prefill):
                w.seq.num_computed += w.n
                w.seq.num_forward_passes += 1
                w.seq.num_prefill_computed += w.n
                self.num_prefill_tokens_computed += w.n
                if w.seq.prefill_only:
                    if w.seq.num_to_prefill == 0:
                        self._prefill_done(w.seq)
                elif w.seq.num_to_compute == 0:
                    rows.append((base + i, w.seq))
                    rows.extend((base + i, child) for child in self._fork_children(w.seq))
        now = time.monotonic()
        deltas = self.speculator.run(verify, lambda s, t: self._append_token(s, t, None, None, now),
                                     lambda s, d: self._jump_forward(s, d, now))
        if not rows:
            return deltas
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        masks.wait()
        structured.prepare_masks([s for _, s in rows])  # the rows not prefetched
        seqs, picked = [s for _, s in rows], logits[[r for r, _ in rows]]
        structured.before_sampling(seqs, self.max_model_len)
        result = sample_rows(self.native_sampler, picked, seqs, self._sample_row)
        structured.keep_calls_in_budget(seqs, picked, result, self._sample_row, self.max_model_len)
        for k, (_, seq) in enumerate(rows):
            delta = self._append_token(seq, result.token_ids[k], result.logprobs[k], result.top_logprobs[k], now)
            deltas.append(self._jump_forward(seq, delta, now))
        return deltas

    # ---- internal helpers ---------------------------------------------------------------------
    def _validate_ids(self, token_ids: Seq[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _validate_prompt(self, token_ids: Seq[int]) -> list[int]:
        ids = self._validate_ids(token_ids)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens but the context length is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit)")
        return ids

    def _register(self, request_id: str, seq: Sequence, prompt: str | None) -> None:
        self._requests[request_id] = [seq]
        self._prompts[request_id] = prompt

    def _new_sequence(self, request_id: str, index: int, ids: list[int], params: SamplingParams,
                      priority: int, seq_id: int | None = None) -> Sequence:
        seed = None if params.seed is None else params.seed + index
        return Sequence(next(self._seq_ids) if seq_id is None else seq_id, request_id, index, list(ids),
                        params, self.tokenizer.detokenizer(params.skip_special_tokens), make_generator(seed),
                        priority=priority, penalties=PenaltyCounts() if needs_penalties(params) and not is_native(params) else None)

    def _done(self, seq: Sequence) -> None:
        """seq's request ended: a session keeps its KV (parked), any other sequence frees it."""
        self.decode_loop.release_unused(seq)
        self.native_sampler.forget(seq)
        self.speculator.finish(seq)
        if seq.session_id is not None:
            self.sessions.on_done(seq)
        else:
            self.scheduler.finish(seq)

    def _prefill_done(self, seq: Sequence) -> None:
        seq.finish_reason = FinishReason.LENGTH  # a prefill-only request: zero tokens were asked for
        self._done(seq)

    def _fork_children(self, parent: Sequence) -> list[Sequence]:
        """The n - 1 siblings of a request, forked (KV shared copy-on-write) when its prompt is done."""
        seqs = self._requests[parent.request_id]
        if parent.index != 0 or parent.num_output_tokens or len(seqs) == parent.params.n:
            return []
        children = []
        for index in range(1, parent.params.n):
            child = self._new_sequence(parent.request_id, index, parent.prompt_ids, parent.params, parent.priority)
            child.constraint = structured.fork(parent)
            self.kv.fork(parent.seq_id, child.seq_id)
            child.num_computed = parent.num_computed
            child.num_cached_tokens = parent.num_cached_tokens
            child.prompt_logprobs = parent.prompt_logprobs  # complete: the prompt is done
            self.scheduler.add_running(child)
            seqs.append(child)
            children.append(child)
        return children

    def _run_decode(self, seqs: list[Sequence], slots: list[int]) -> torch.Tensor:
        block_tables = self.kv.block_tables([s.seq_id for s in seqs])  # [B, max_blocks] int32, filled natively
        positions = np.array([s.num_computed for s in seqs], dtype=np.int64)  # [B]
        tokens = np.array([s.token_ids[-1] for s in seqs], dtype=np.int64)  # [B]
        return self.runner.decode(tokens, positions, block_tables, (positions + 1).astype(np.int32),
                                  np.asarray(slots, dtype=np.int64))

    def _loop_step(self, seqs: list[Sequence], k: int) -> list[StreamDelta]:
        """k decode steps of native seqs in one native call (kog.engine.decode_loop); each row's
        tokens appended one by one as a step at a time would, one merged delta per row."""
        rows = self.decode_loop.run(seqs, k)
        now = time.monotonic()
        deltas = []
        for seq, tokens in zip(seqs, rows):
            base, delta = seq.num_computed, None
            # The native loop ended the row at its only finishing token, the last: without stop
            # strings the ones before it need no per-token check, only their ids and text.
            head = tokens[:-1] if not seq.params.stop else []
            if head:
                seq.token_ids.extend(head)
                seq.num_computed = base + len(head)  # the tokens fed so far have KV
                seq.num_forward_passes += len(head)
                if seq.detok is not None:
                    seq.text += seq.detok.steps(head)
                delta = StreamDelta(seq.request_id, seq.index, "", head, None)
            for j in range(len(head), len(tokens)):
                seq.num_computed = base + j + 1
                seq.num_forward_passes += 1
                delta = merge_deltas(delta, self._append_token(seq, tokens[j], None, None, now))
                if seq.finish_reason is not None:
                    break
            self.decode_loop.release_unused(seq)
            deltas.append(delta)
        return deltas

    def _run_prefill(self, work: list[PrefillWork]) -> torch.Tensor:
        """[len(work), vocab] logits of each chunk's last token; prompt logprobs recorded on the way."""
        tables = self.kv.block_tables([w.seq.seq_id for w in work])  # [len(work), max_blocks], rows padded with 0
        bs = self.kv.block_size
        # Each chunk gets a view of its row cut to its own blocks (those covering start + n).
        chunks = [PrefillChunk(w.seq.token_ids[w.start : w.start + w.n], w.start,
                               tables[i, : -(-(w.start + w.n) // bs)], w.slots) for i, w in enumerate(work)]
        if not any(w.seq.prompt_logprobs_pending for w in work):
            # Jump-forward runs (sequences with output) may take the native decode path (engine/chunks.py).
            return forward_chunks(self.runner, chunks, use_decode=all(w.seq.num_output_tokens for w in work))
        # NOTE: every row of the batch gets logits then: a cost only steps that prefill a prompt
        # asking for prompt logprobs pay.
        per_chunk = forward_chunks(self.runner, chunks, all_logits=True, use_decode=False)  # [len(chunk), vocab] each
        for w, chunk_logits in zip(work, per_chunk):
            prompt_logprobs.record(w.seq, w.start, chunk_logits)
        return torch.stack([chunk_logits[-1] for chunk_logits in per_chunk])

    def _sample_row(self, seq: Sequence) -> SampleRow:
        return SampleRow(seq.params, seq.prompt_ids, seq.output_ids, self.eos_token_ids, seq.generator,
                         seq.constraint, seq.penalties)

    def _jump_forward(self, seq: Sequence, delta: StreamDelta, now: float) -> StreamDelta:
        """Appends the tokens seq's grammar forces (kog.engine.structured.jump_forward)."""
        return structured.jump_forward(seq, lambda t: self._append_token(seq, t, None, None, now), delta)

    def _append_token(self, seq: Sequence, token: int, logprob: float | None,
                      top: list[tuple[int, float]] | None, now: float) -> StreamDelta:
        seq.append_token(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprob is not None:
            entry = {token: logprob}
            entry.update({t: lp for t, lp in (top or []) if t != token})
            seq.logprobs.append(entry)
            seq.cumulative_logprob += logprob
        delta = seq.detok.step(token) if seq.detok is not None else ""
        check_stop_token(seq, token, self.eos_token_ids, self.max_model_len)
        structured.consume(seq, token, self.eos_token_ids)  # advances the grammar; stops at its EOS
        if seq.finish_reason == FinishReason.STOP and seq.stop_reason == token:
            delta = ""  # a stop token ends the text; its id stays in token_ids
        apply_stop_strings(seq, delta)
        if seq.finish_reason is not None and not isinstance(seq.stop_reason, str) and seq.detok is not None:
            apply_stop_strings(seq, seq.detok.flush())
        if seq.finish_reason is not None:
            self._done(seq)
        return StreamDelta(seq.request_id, seq.index, streamable_text(seq), [token], seq.finish_reason)
