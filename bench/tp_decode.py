"""Tensor-parallel CPU decode: TP=1 vs TP=2, standard TP (a Llama shape in lane form) vs delayed
TP (a Laneformer shape, broadcast_delay 1), with a simulated link latency.

    PYTHONPATH=python python bench/tp_decode.py [--steps 40] [--latencies 0 2 5 10] [--quick]

Each configuration runs as real processes (one per rank, KOG_NUM_THREADS = cores / ranks), the
ranks' collectives through kog._C.ShmTransport; batch-1 decode steps after a 64-token prefill.
Columns (rank 0, medians per step), communication split into the delayed all-gathers
(LANE_GATHER's publish + LANE_ADD_PAST's wait) and the all-reduces (lane sums of standard TP and
of the first broadcast_delay Laneformer layers, the head's LANE_MEAN and logits gathers):
- step ms: the decode step's wall time.
- comm ms: the communication time, what the collectives' data took to travel whether or not
  anyone waited for it (ShmTransport.stats() link_s: per all-reduce piece and per publish its
  copies and sums plus the simulated link latency).
- inside ms: time inside the collective calls (copies, sums, waiting for the other rank and for
  the link). A rank runs one thread per core and computes nothing while inside, so this is the
  communication the step exposes, measured directly; inside / comm is the exposed share.
- exposed ms: the issue's measure, step time minus the step time of no-op steps interleaved
  with the real ones in the same run (the transport made a no-op: every rank computes alone,
  numbers wrong, timing right; measurement only); "paired": the median over steps of (real step
  - the no-op step right after it), less sensitive to the machine's drift. Both are differences
  of two step times, so on a noisy machine they resolve only communication that is a sizeable
  part of the step; "inside" resolves microseconds.
With at least one core per rank, each rank is pinned to its own
cores. The simulated link latency makes each flag visible to the other rank only that long after
its store (the sender goes on), so a reduction whose reader arrives later than that pays
nothing: what delayed TP is built for.
Target (issue 19): with delayed TP (delay >= 1) exposed communication <= 10% of the
communication time at every latency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # sized for a 2-core, 24 GiB machine: ~0.1-0.2 B parameters in fp32
    "llama": dict(architecture="llama", hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=64, intermediate_size=2816, vocab_size=32000),
    "laneformer": dict(architecture="laneformer_tp", hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=64, intermediate_size=2816, vocab_size=32000),
}


def model_config(shape: str):
    from kog.lane_config import LaneConfig
    from kog.testing.tiny_models import tiny_config

    fields = dict(SHAPES[shape])
    arch = fields.pop("architecture")
    lanes = LaneConfig(num_lanes=2, broadcast_delay=1) if arch == "laneformer_tp" else None
    return tiny_config(arch, tie_word_embeddings=False, max_position_embeddings=4096, lanes=lanes, **fields)


def run_rank(spec: dict) -> dict:
    """One rank: build its shard, prefill, time decode steps; returns rank 0's numbers."""
    import numpy as np
    import torch

    from kog.loader import LoadedModel
    from kog.models import ModelRunner, PrefillChunk
    from kog.parallel import lane_form, shard_config, shard_weights
    from kog.parallel.transport import ShmRankTransport
    from kog.testing.tiny_models import random_weights

    torch.manual_seed(0)
    config = model_config(spec["shape"])
    size, rank = spec["size"], spec["rank"]
    cores = sorted(os.sched_getaffinity(0))
    if size > 1 and len(cores) >= size:  # each rank on its own cores: no rank migrates onto another's
        per = len(cores) // size
        os.sched_setaffinity(0, cores[rank * per:(rank + 1) * per])
    weights = random_weights(config, seed=1)
    transport = None
    if size > 1:
        form = lane_form(config, size) if config.lanes is None else config
        local = shard_config(form, rank, size)
        weights = shard_weights(local, weights)
        lanes = local.lanes
        transport = ShmRankTransport(spec["shm"], rank, size, reduce_floats=1 << 16,
                                     n_slots=2 * lanes.hist_slots_per_kind,
                                     slot_bytes=lanes.num_lanes * local.hidden_size * 4, timeout_s=120)
        transport.native.set_link_latency_us(spec["latency_us"])
    else:
        local = config
    model = LoadedModel(path=None, config=local, weights=weights, dtype=torch.float32, tokenizer=None,
                        chat_template=None, stop_token_ids=())
    r = ModelRunner(model, num_kv_blocks=64, block_size=16, transport=transport)
    table = np.arange(64, dtype=np.int32)  # 1024 positions: the prefill and up to 2 x 470 steps
    prompt = list(range(10, 74))
    r.prefill([PrefillChunk(prompt, 0, table, np.arange(64, dtype=np.int64))])
    # Real and no-op steps alternate (both ranks switch at the same step), so the machine's
    # drift during the run weighs on both alike; medians of each.
    times = {"real": [], "noop": []}
    pos = 64
    if transport is not None:
        transport.native.reset_stats()
    for i in range(2 * spec["steps"] + 4):
        mode = "noop" if transport is not None and i % 2 else "real"
        if transport is not None:
            transport.native.set_noop(mode == "noop")
        before = transport.native.stats() if transport is not None else None
        t0 = time.perf_counter()
        r.decode(np.array([7]), np.array([pos]), table[None], np.array([pos + 1], np.int32), np.array([pos], np.int64))
        if i >= 4:
            times[mode].append(time.perf_counter() - t0)
            if mode == "real" and transport is not None:
                after = transport.native.stats()
                for kind in ("all_reduce", "gather"):
                    for field in ("inside_s", "wait_s", "link_s"):
                        times.setdefault(f"{kind}.{field}", []).append(after[kind][field] - before[kind][field])
        pos += 1
    out = {"real": statistics.median(times["real"]) * 1e3}
    if transport is not None:
        out["noop"] = statistics.median(times["noop"]) * 1e3
        for key in [k for k in times if "." in k]:
            out[key] = statistics.median(times[key]) * 1e3  # ms per step
        # each real step minus the no-op step right after it: the machine's drift cancels pairwise
        out["paired_ms"] = statistics.median(a - b for a, b in zip(times["real"], times["noop"])) * 1e3
    return out


def launch(shape: str, size: int, latency_us: float, steps: int) -> dict:
    cores = os.cpu_count() or 2
    env = os.environ | {"PYTHONPATH": str(ROOT / "python"), "KOG_NUM_THREADS": str(max(1, cores // size))}
    shm = f"/kog-bench-{os.getpid()}-{time.monotonic_ns()}"
    procs = []
    for rank in range(size):
        spec = dict(shape=shape, size=size, rank=rank, latency_us=latency_us, steps=steps, shm=shm)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, text=True))
        if rank == 0:
            time.sleep(0.5)  # rank 0 creates the segment
    results = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    return results[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--latencies", type=float, nargs="+", default=[0, 2, 5, 10])
    ap.add_argument("--quick", action="store_true", help="10 steps, latencies 0 and 5")
    ap.add_argument("--engine", action="store_true",
                    help="also kog.LLM generate tok/s, TP=1 vs 2, one decode step per call vs the multi-token loop")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(run_rank(json.loads(args.worker))))
        return
    if args.quick:
        args.steps, args.latencies = 10, [0, 5]
    print(f"tp_decode: batch 1, {args.steps} steps after a 64-token prefill, fp32, {os.cpu_count()} cores")
    print("| model | TP | link us | step ms | comm ms: gathers + reduces | inside ms: gathers + reduces "
          "| inside / comm: gathers, all | exposed ms | paired ms | paired / comm |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    pct = lambda a, b: f"{100 * a / b:.0f}%" if b > 0 else "-"  # noqa: E731
    for shape in SHAPES:
        one = launch(shape, 1, 0, args.steps)
        print(f"| {shape} | 1 | - | {one['real']:.2f} | - | - | - | - | - | - |", flush=True)
        for lat in args.latencies:
            two = launch(shape, 2, lat, args.steps)
            exposed = max(0.0, two["real"] - two["noop"])
            paired = max(0.0, two["paired_ms"])
            lg, lr = two["gather.link_s"], two["all_reduce.link_s"]
            ig, ir = two["gather.inside_s"], two["all_reduce.inside_s"]
            print(f"| {shape} | 2 | {lat:g} | {two['real']:.2f} | {lg:.3f} + {lr:.3f} | {ig:.3f} + {ir:.3f} "
                  f"| {pct(ig, lg)}, {pct(ig + ir, lg + lr)} | {exposed:.3f} | {paired:.3f} | {pct(paired, lg + lr)} |",
                  flush=True)
    if args.engine:
        engine_table()


def engine_table(new_tokens: int = 64, repeats: int = 3) -> None:
    """Greedy generate of new_tokens after a 64-token prompt through kog.LLM (engine, scheduler
    and, at TP=2, rank 0 sending each call to the other rank over gloo): tokens per second with
    one decode step per native call (max_steps 1) and with the multi-token loop (up to 16 steps
    per call, on every rank: kog.parallel.ranks.MirroredLoop). Median of `repeats` runs each,
    the columns interleaved, after one warm-up run each.
    The loop's greedy rows take the distributed argmax at TP=2 (each rank's best (logit, id) of
    its vocabulary slice crosses ranks, DecodeStep::argmax_only); the baseline draws the same
    tokens by top_k=1 sampling, which gathers every rank's logits and runs the sampler."""
    import tempfile

    import kog
    from kog.testing.tiny_models import random_weights, write_hf_model

    print(f"\nengine: kog.LLM greedy, {new_tokens} tokens after a 64-token prompt, fp32")
    print("| model | TP | one step per call tok/s | loop tok/s | loop / one step | loop, logits gathered "
          "(top_k=1) tok/s | argmax / gathered | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    params = kog.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    top1 = kog.SamplingParams(max_tokens=new_tokens, temperature=1.0, top_k=1, seed=0, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(10, 74))}]
    for shape in SHAPES:
        config = model_config(shape)
        folder = write_hf_model(Path(tempfile.mkdtemp(prefix="kog-tp-")) / "m", config, random_weights(config, seed=1))
        for tp in (1, 2):
            llm = kog.LLM(str(folder), dtype="float32", tensor_parallel_size=tp, max_model_len=512)
            ids = {}
            try:
                runs = {k: [] for k in (1, 16, "top1")}
                for k, p in ((1, params), (16, params), ("top1", top1)):  # warm-up
                    llm.engine.decode_loop.max_steps = 16 if k == "top1" else k
                    llm.generate(prompt, p)
                for _ in range(repeats):  # interleaved: a slow spell of the machine hits every column
                    for k, p in ((1, params), (16, params), ("top1", top1)):
                        llm.engine.decode_loop.max_steps = 16 if k == "top1" else k
                        t = time.perf_counter()
                        ids[k] = llm.generate(prompt, p)[0].outputs[0].token_ids
                        runs[k].append(new_tokens / (time.perf_counter() - t))
                rate = {k: statistics.median(v) for k, v in runs.items()}
            finally:
                if tp > 1:
                    llm.engine.runner.close()
            same = ids[1] == ids[16] == ids["top1"]
            print(f"| {shape} | {tp} | {rate[1]:.1f} | {rate[16]:.1f} | {rate[16] / rate[1]:.2f}x | "
                  f"{rate['top1']:.1f} | {rate[16] / rate['top1']:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
