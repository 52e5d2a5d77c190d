"""Does the engine's host (Python) work per decoded token grow with the context?

A tiny random Llama (hidden 64, 2 layers, vocab ~400) with a 132k position range runs real
native decode steps over 1k, 32k and 128k-token contexts, batch 1 and 8, through LLMEngine.step
plus one get_output per request per step (what the AsyncEngine does). The prompts' prefill is
skipped (the runner's prefill returns zero logits and writes no KV: the KV pool's zeros stand
in for it) so that 128k contexts are set up in seconds on a laptop; the decode steps attend over
every cached token.

    host time   = step wall time (step + get_output) - time inside the native decode call
    native time = time inside the native decode call (kog._C.DecodeExecutor.run, or
                  kog._C.DecodeLoop.run in loop mode: K steps with sampling in one call)

both per decoded token (divided by the tokens the step produced; --max-loop-steps 1 measures
one decode step per engine step, logits to Python every token); host time is printed as the median and the
minimum over the measured steps (the minimum is the least disturbed on a shared machine). Sampling: temperature 0.8, top-p 0.95, a seeded
generator and repetition_penalty 1.1 (the penalties are part of the per-token host work).

    PYTHONPATH=python python bench/engine_overhead.py            # 1k/32k/128k x batch 1/8
    PYTHONPATH=python python bench/engine_overhead.py --quick    # 1k/8k x batch 1/2

Targets (issue 15): host time per token at 128k <= 1.2x at 1k (printed per batch).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kog.engine import EngineConfig, LLMEngine
from kog.engine.decode_loop import LOOP_MAX_STEPS
from kog.loader import load_model
from kog.models.runner import ModelRunner
from kog.sampling_params import SamplingParams
from kog.testing.tiny_models import tiny_config, write_hf_model

BLOCK = 16


class NativeTimer:
    """Stands in for the runner's native decode executor: forwards `run` and adds its time.

    With `flush` (a large array), every call also streams it through the CPU caches, timed as
    native: the control row that gives a short context the cold caches a long one leaves.
    """

    def __init__(self, executor, flush: np.ndarray | None = None) -> None:
        self.executor = executor
        self.flush = flush
        self.seconds = 0.0

    def run(self, *args):
        t = time.perf_counter()
        try:
            out = self.executor.run(*args)
            if self.flush is not None:
                self.flush.sum()
            return out
        finally:
            self.seconds += time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self.executor, name)


class LoopTimer:
    """Stands in for the engine's native loop (kog._C.DecodeLoop): forwards `run`, adds its time
    (and the executor timer's flush) to the executor's timer."""

    def __init__(self, loop, timer: NativeTimer) -> None:
        self.loop, self.timer = loop, timer

    def run(self, *args):
        t = time.perf_counter()
        try:
            out = self.loop.run(*args)
            if self.timer.flush is not None:
                self.timer.flush.sum()
            return out
        finally:
            self.timer.seconds += time.perf_counter() - t


class NoPrefillRunner:
    """The real runner with prefill skipped (zero logits, no KV written); decode is untouched."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def prefill(self, chunks, all_logits: bool = False):
        if all_logits:
            return [torch.zeros(len(c.token_ids), self.runner.vocab_size) for c in chunks]
        return torch.zeros(len(chunks), self.runner.vocab_size)

    def verify(self, chunks):
        return self.prefill(chunks, all_logits=True)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def build_runner(max_context: int, max_batch: int, tokens: int) -> tuple[ModelRunner, object]:
    config = tiny_config("llama", max_position_embeddings=max_context + 1024)
    folder = write_hf_model(Path(tempfile.mkdtemp(prefix="kog-overhead-")) / "hf", config)
    model = load_model(folder)
    blocks = max_batch * (-(-(max_context + tokens + 2) // BLOCK) + 1)
    runner = ModelRunner(model, num_kv_blocks=blocks, block_size=BLOCK)
    return runner, model.tokenizer


def measure(runner: ModelRunner, tokenizer, context: int, batch: int, steps: int,
            warmup: int, flush: np.ndarray | None = None, loop_steps: int = LOOP_MAX_STEPS) -> tuple[float, float, float]:
    """(host ms median, host ms min, native ms median) per decoded token over `steps` decode
    steps. The minimum is the least disturbed by other processes on a shared machine."""
    engine = LLMEngine(NoPrefillRunner(runner), tokenizer, [], runner.max_model_len,
                       EngineConfig(max_num_seqs=batch, max_num_batched_tokens=32768,
                                    enable_prefix_caching=False, max_loop_steps=loop_steps))
    timer = NativeTimer(runner._executor, flush)
    runner._executor = timer
    if engine.decode_loop._cpu is not None:
        engine.decode_loop._cpu = LoopTimer(engine.decode_loop._cpu, timer)
    try:
        vocab = runner.vocab_size
        rids = []
        for b in range(batch):
            prompt = [(7 * i + 13 * b) % (vocab - 3) + 3 for i in range(context)]
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=b, repetition_penalty=1.1,
                                    max_tokens=(steps + warmup) * loop_steps + 4, ignore_eos=True)
            rid = f"r{b}"
            engine.add_request(rid, prompt, params)
            rids.append(rid)
        while any(not s.output_ids for r in rids for s in engine._requests[r]):
            engine.step()  # the (skipped) prefill chunks, then each request's first token
        host, native = [], []
        for i in range(warmup + steps):
            timer.seconds = 0.0
            t = time.perf_counter()
            deltas = engine.step()
            for rid in {d.request_id for d in deltas}:
                engine.get_output(rid)
            wall = time.perf_counter() - t
            tokens = sum(len(d.token_ids) for d in deltas)
            if i >= warmup:
                host.append((wall - timer.seconds) / tokens)
                native.append(timer.seconds / tokens)
        for rid in rids:
            engine.abort(rid)
            engine.release(rid)
        return statistics.median(host) * 1e3, min(host) * 1e3, statistics.median(native) * 1e3
    finally:
        runner._executor = timer.executor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,32768,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=12, help="measured decode steps per cell")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="contexts 1k and 8k, batches 1 and 2")
    ap.add_argument("--flush-mb", type=int, default=64,
                    help="control row: the first context with this many MB streamed through the caches "
                         "after each native call (what a long context's attention does); 0: no control row")
    ap.add_argument("--max-loop-steps", type=int, default=LOOP_MAX_STEPS,
                    help="most decode steps per native call (1: no loop mode)")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.batches, args.steps, args.warmup = "1024,8192", "1,2", 6, 2
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    runner, tokenizer = build_runner(max(contexts), max(batches), (args.steps + args.warmup) * args.max_loop_steps)
    import kog

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(kog.__file__).parent).stdout.strip()  # the kog measured, not this script's
    print(f"engine overhead: tiny llama (hidden 64, 2 layers, vocab {runner.vocab_size}), {platform.machine()} "
          f"{torch.get_num_threads()} threads, commit {commit}; medians of {args.steps} steps; "
          f"up to {args.max_loop_steps} decode steps per native call")
    print(f"{'context':>8}{'batch':>6}{'host ms/tok':>13}{'host min':>10}{'native ms/tok':>15}{'host/native':>13}"
          f"{'host vs 1st':>13}{'min vs 1st':>12}")
    flush = np.ones(args.flush_mb << 20, dtype=np.uint8) if args.flush_mb else None
    for batch in batches:
        base = None
        rows = [(c, None) for c in contexts] + ([(contexts[0], flush)] if flush is not None else [])
        for context, flushing in rows:
            host, low, native = measure(runner, tokenizer, context, batch, args.steps, args.warmup, flushing,
                                        args.max_loop_steps)
            base = base or (host, low)
            label = f"{context}" if flushing is None else f"{context}*"
            print(f"{label:>8}{batch:>6}{host:>13.3f}{low:>10.3f}{native:>15.3f}{host / native:>13.2f}"
                  f"{host / base[0]:>12.2f}x{low / base[1]:>11.2f}x", flush=True)
    if flush is not None:
        print(f"* control: {contexts[0]} tokens, each native call followed by streaming {args.flush_mb} MB through "
              f"the caches (timed as native): the host code then runs on cold caches, as after a long context")
    print(f"targets: host time at {contexts[-1]} <= 1.2x at {contexts[0]} (last columns); host <= 0.5x native "
          f"at batch 1, {contexts[0]} (needs the native multi-token loop)")


if __name__ == "__main__":
    main()
