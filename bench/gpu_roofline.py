"""GPU decode roofline: a MODEL of the persistent decode kernel's step, not a measurement.

For each op of the model program (kog.program.program_for, expanded for the GPU by
kog._C.expand_gpu_program: norms, SiLU-mul, RoPE and KV append fused into GEMVs) of Llama-3.2-1B and Llama-3.1-8B
shapes on H200 and MI300X specifications: bytes moved, the bandwidth floor, work items, dependency
edges and the modeled cost of synchronization; prints predicted µs/token and the fraction of
bandwidth. It is a design target, stated as such: no number here was timed on a GPU.

Model, per op (all parameters in DEVICES and the flags; each is a lead, see ASSUMPTIONS):
    work  = max(bytes / achievable_bw, ceil(items / blocks) * (latency + item_bytes / block_bw))
    naive = sync (when the op waits on a dep) + work, summed over the program
    overlapped: during each wait, and whenever an op leaves bandwidth idle, a loader streams the
        weights of the coming ops (weights never depend on activations) into a shared-memory ring
        of ring_bytes; an op then reads only its not-yet-streamed weight bytes from memory.
Usage: python bench/gpu_roofline.py [--context 1024] [--batch 1 8] [--sync-us 0.9] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

import torch

from kog import _C
from kog.testing.sync_program import items_of
from kog.config import ModelConfig
from kog.loader.weights import expected_shapes
from kog.models.decode import lower_program, model_dims
from kog.models.weights import prepare_weights
from kog.program import Buffer, Opcode, program_for

HEADER = "GPU decode roofline -- MODEL, not a measurement (design target; no GPU was timed)"

# Mirrors of the kernel's constants (csrc/gpu/decode/tuning.cuh, csrc/ops/attention.h).
THREADS = 256                  # kThreads
LINEAR_ROWS_PER_WARP = 2       # kLinearRowsPerWarp
IN_FLIGHT_VECS = 8             # kLinearUnrollBatch1: 16-byte weight loads per lane in flight in an item
PARTITION_TOKENS = 256         # kGpuAttentionPartitionTokens
ELEM = 2                       # bf16

MODELS = {  # HF config.json values of the two shapes (meta-llama/Llama-3.2-1B, Llama-3.1-8B)
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Device:
    name: str
    spec_gbps: float         # vendor peak memory bandwidth
    achievable_gbps: float   # the ceiling the model uses (a copy's rate)
    multiprocessors: int     # SMs / CUs
    warp_size: int
    blocks_per_mp: int       # persistent workgroups per SM / CU (registers decide: tuning.cuh, GPU.md)
    stage_kib: int           # weight bytes a workgroup stages ahead of its next LINEAR item (weight_stage.cuh)
    latency_us: float        # one memory round trip: per-item floor and Little's law per block
    source: str

    @property
    def blocks(self) -> int:
        return self.multiprocessors * self.blocks_per_mp

    @property
    def rows_per_item(self) -> int:  # linear_rows_per_item() = kWarps * kLinearRowsPerWarp
        return THREADS // self.warp_size * LINEAR_ROWS_PER_WARP

    @property
    def ring_bytes(self) -> int:  # weight bytes the device holds staged ahead of use
        return self.stage_kib * 1024 * self.blocks


DEVICES = {
    # 4.8 TB/s: NVIDIA's H200 datasheet; 4.3 TB/s: a device-to-device copy measured on this
    # workplace's nvidia-h200 (device notes KINDS.md, 2026-10-28 and 2026-11-04; 4186 GB/s in
    # docs/PERFORMANCE.md's first GPU run): 0.90 of spec. 132 SMs (H200.md, HOPPER.md); one
    # workgroup per SM (the sm_90a build uses 238-255 registers a thread), staging two 64 KiB
    # stages ahead in shared memory (cp.async; the third is the item in use). Latency ~0.5 µs:
    # ~600 cycles of HBM latency on Hopper at ~1.7-2 GHz (lead, not measured here).
    "h200": Device("H200", 4800, 4300, 132, 32, 1, 128, 0.5,
                   "spec 4.8 TB/s (datasheet); ceiling 4.3 TB/s = copy measured here (KINDS.md)"),
    # 5.3 TB/s, 304 CUs, 256 MB Infinity Cache, 64-wide wavefronts, 64 KiB LDS per CU: AMD's
    # MI300X specifications (chipsandcheese.com/p/testing-amds-giant-mi300x). No copy of ours was
    # measured on it: the ceiling ASSUMES 0.90 of spec. Two workgroups per CU (<= 256 VGPRs),
    # each staging 16 KiB in registers (4 vectors a lane). Latency 0.8 µs: assumed (HBM behind
    # the Infinity Fabric and Infinity Cache is slower to reach than on Hopper).
    "mi300x": Device("MI300X", 5300, 0.90 * 5300, 304, 64, 2, 16, 0.8,
                     "spec 5.3 TB/s (AMD); ceiling ASSUMED 0.90 x spec (not measured)"),
}

ASSUMPTIONS = [
    "bf16 weights, activations and KV; decode: one new token per sequence, each at --context cached tokens.",
    "Bytes: every byte an op reads or writes is charged to device memory (activations that stay in L2 "
    "would cost less: conservative). Weights: the prepared tensors the op names, read once per step. "
    "The embedding row gather is activation bytes (it depends on the token, it cannot be prefetched).",
    "KV: attention reads each sequence's K and V once per KV head (GQA group shares it); KV_APPEND writes one row.",
    "Items as the kernel splits them (kog.testing.sync_program.items_of mirrors items_of): LINEAR "
    "ceil(out_rows / (warps * 2)); attention partial per (sequence, KV head, partition), the partition "
    "halved from 256 tokens (down to 16) until there are two items per workgroup, the last item of each "
    "(sequence, KV head) merging the group's partials (re-read from memory, charged) into ATTN; small ops split rows into 512-element chunks / 4 RoPE heads / a KV head; "
    "residual adds fused into o_proj and down_proj, every RMSNorm into the prologue of the GEMV that reads it "
    "(its weight counted with the GEMV's; each warp's re-read of the row for the scale stays in cache, not "
    "charged), SiLU-mul into gate/up (one output row a warp), RoPE "
    "and KV append into qkv (one RoPE pair a warp); SAMPLE's first phase in the tail of "
    "the LM head's last item per 4096-logit chunk (its bytes charged to the LM head, its latency after the "
    "last wave not), then one item per sequence over the chunk summaries (the full-row fallback is not "
    "modelled).",
    "Per item: latency + item_bytes / (32 KiB in flight per workgroup / latency) (Little's law, "
    "256 threads x 8 x 16-byte loads, kLinearUnrollBatch1); workgroups: 1 per SM on H200 (registers), "
    "2 per CU on MI300X.",
    "Sync: --sync-us per op that waits (its last dep; counters already complete cost nothing extra); "
    "the step-start wait on the previous step's SAMPLE counts as EMBED's. Default 0.9 µs: issue 16's "
    "figure for a grid-wide dependency through sentinel polling (others' measurement, not ours).",
    "Overlapped: each workgroup stages the first weights of its next LINEAR item ahead of use "
    "(weight_stage.cuh: two 64 KiB stages in shared memory by cp.async on H200, 16 KiB of registers "
    "on MI300X), filled during waits and idle bandwidth; nothing else is overlapped (no two "
    "activation ops at once).",
]


@dataclass
class OpCost:
    name: str
    layer: int
    weight_bytes: int
    act_bytes: int       # activations in and out, attention partials, the embedding row
    kv_read: int
    kv_write: int
    items: int
    edges: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.act_bytes + self.kv_read + self.kv_write


# ---------------------------------------------------------------------- public API


def model_config(name: str) -> ModelConfig:
    return ModelConfig(architecture="llama", torch_dtype="bfloat16", rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=131072, **MODELS[name])


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Prepared weight shapes (fused qkv / gate_up), computed on meta tensors: no memory."""
    meta = {n: torch.empty(s, device="meta", dtype=torch.bfloat16) for n, s in expected_shapes(config).items()}
    return {n: tuple(t.shape) for n, t in prepare_weights(config, meta, torch.bfloat16).items()}


def gpu_program(config: ModelConfig) -> list[tuple[_C.Op, tuple[str, ...]]]:
    """The expanded GPU program: (op, weight names) per op."""
    program = program_for(config)
    # expand_gpu_program validates but never dereferences weight addresses: placeholders do.
    fake = {n: _Address(16 * (i + 1)) for i, n in enumerate(weight_shapes(config))}
    ops = _C.expand_gpu_program(lower_program(program, fake), model_dims(config, torch.bfloat16))
    out, it = [], iter(program)
    for op in ops:
        norm = next(it).weights if op.w2 else ()  # the RMS_NORM folded into its prologue comes first
        out.append((op, next(it).weights + norm))
        if op.opcode == _C.GPU_OP_LINEAR_SILU_MUL:
            next(it)  # the SILU_MUL it absorbed
        if op.opcode == _C.GPU_OP_LINEAR_ROPE_KV:
            next(it), next(it)  # the ROPE and KV_APPEND it absorbed
    return out


def op_costs(config: ModelConfig, device: Device, batch: int, context: int) -> list[OpCost]:
    """Bytes, items and dependency edges of every op of one decode step."""
    dims, shapes = model_dims(config, torch.bfloat16), weight_shapes(config)
    width = dims.buffer_width
    h, hd, nq, nkv = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads
    partition = PARTITION_TOKENS  # halved as GpuDecodeExecutor::run does
    while partition > 16 and batch * config.num_key_value_heads * math.ceil(context / partition) < 2 * device.blocks:
        partition //= 2
    parts = math.ceil(context / partition)
    partials = batch * nq * parts * (hd + 2) * 4  # f32 scratch [B, nq, parts, hd + 2]
    # per sequence: a 24-byte summary and 128 (value, id) candidate slots per vocabulary chunk
    summaries = math.ceil(config.vocab_size / _C.SAMPLE_CHUNK) * (24 + 128 * 8)
    costs = []
    for op, names in gpu_program(config):
        code = op.opcode
        # EMBED gathers one row per token: activation bytes (below), not a weight stream.
        wbytes = 0 if code == Opcode.EMBED else sum(math.prod(shapes[n]) * ELEM for n in names)
        act, kv_r, kv_w = 0, 0, 0
        items = items_of(op, dims, batch, parts, device.rows_per_item, THREADS // device.warp_size)
        if code == Opcode.EMBED:  # token ids in, the embedding rows read, RESIDUAL written
            act = batch * (4 + 2 * h * ELEM)
        elif code == Opcode.RMS_NORM:  # each chunk item reads the whole row (its scale), writes its chunk
            act = h * ELEM * (items + batch) if op.residual < 0 else batch * h * ELEM * 4
        elif code in (Opcode.LINEAR, _C.GPU_OP_LINEAR_SAMPLE_PARTIAL):  # a fused residual add reads and
            n, k = width(op.out), width(op.in_)                           # writes the residual rows
            act = batch * (n * (2 if op.residual >= 0 else 1) + k) * ELEM
            if code == _C.GPU_OP_LINEAR_SAMPLE_PARTIAL:  # the tails: logits back in, f32 copy and summaries out
                act += batch * (config.vocab_size * (ELEM + 4) + summaries)
        elif code == _C.GPU_OP_LINEAR_SILU_MUL:  # x in, silu(gate) * up out
            act = batch * (width(op.in_) + config.intermediate_size) * ELEM
        elif code == _C.GPU_OP_LINEAR_ROPE_KV:  # x in, qkv out, k and v into the cache
            act = batch * (width(op.in_) + width(op.out)) * ELEM
            kv_w = batch * 2 * nkv * hd * ELEM
        elif code in (Opcode.QK_NORM, Opcode.ROPE):
            act = 2 * batch * (nq + nkv) * hd * ELEM
        elif code == Opcode.KV_APPEND:
            act = kv_w = batch * 2 * nkv * hd * ELEM
        elif code == Opcode.ATTN_DECODE:  # q in, partials out and back in (the merging items), ATTN out
            act, kv_r, items = 2 * batch * nq * hd * ELEM + 2 * partials, batch * context * 2 * nkv * hd * ELEM, batch * nkv * parts
        elif code == Opcode.SILU_MUL:
            act = batch * 3 * config.intermediate_size * ELEM
        elif code == Opcode.SAMPLE:  # the summaries (candidate slots included) in, the token out
            act = batch * (summaries + 4)
        edges = len(op.deps) if code != Opcode.EMBED else 1  # EMBED waits on the previous step
        costs.append(OpCost(_op_name(code, names), op.layer, wbytes, act, kv_r, kv_w, items, edges))
    return costs


def predict(costs: list[OpCost], device: Device, sync_us: float) -> tuple[list[dict], dict]:
    """Per-op and whole-step predictions (µs) of the naive and the overlapped schedule.

    The overlapped schedule is the loop's steady state: one step runs first so that the ring
    holds what the previous step's SAMPLE and waits streamed; if the measured step ends with
    fewer bytes ahead than it started with, it borrowed them, and a last row charges them.
    """
    bw = device.achievable_gbps * 1e3  # bytes per µs
    ahead = _schedule(costs, device, sync_us, 0.0)[1]
    rows, ahead_end = _schedule(costs, device, sync_us, ahead)
    if ahead_end < ahead:
        rows.append(dict(op="(loader carry)", layer=-1, bytes=0, floor_us=0.0, items=0, edges=0, naive_us=0.0,
                         overlapped_us=(ahead - ahead_end) / bw))
    total = sum(c.bytes for c in costs)
    floor, naive, over = total / bw, sum(r["naive_us"] for r in rows), sum(r["overlapped_us"] for r in rows)
    summary = dict(bytes_per_step=total, weight_bytes=sum(c.weight_bytes for c in costs),
                   kv_bytes=sum(c.kv_read + c.kv_write for c in costs), floor_us=floor,
                   spec_floor_us=total / (device.spec_gbps * 1e3), naive_us=naive, overlapped_us=over,
                   frac_naive=floor / naive, frac_overlapped=floor / over,
                   frac_spec_overlapped=total / (device.spec_gbps * 1e3) / over)
    return rows, summary


def run(model: str, device: str, batch: int, context: int, sync_us: float) -> tuple[list[dict], dict]:
    dev = DEVICES[device]
    rows, s = predict(op_costs(model_config(model), dev, batch, context), dev, sync_us)
    s = dict(model=model, device=dev.name, batch=batch, context=context, **s,
             us_per_token_naive=s["naive_us"] / batch, us_per_token_overlapped=s["overlapped_us"] / batch,
             tok_per_s_overlapped=1e6 * batch / s["overlapped_us"])
    return rows, s


# ---------------------------------------------------------------------- internal helpers


class _Address:
    """Stands in for a weight tensor where only its address is read (kog.models.decode.lower)."""

    def __init__(self, addr: int) -> None:
        self._addr = addr

    def data_ptr(self) -> int:
        return self._addr


def _schedule(costs: list[OpCost], device: Device, sync_us: float, ahead: float) -> tuple[list[dict], float]:
    """One step; ahead: weight bytes of coming ops (in program order, wrapping into the next
    step) already in the ring. Returns the rows and the bytes ahead at the end."""
    bw = device.achievable_gbps * 1e3
    rows = []
    for c in costs:
        wait = sync_us if c.edges else 0.0
        naive = wait + _work_us(c.bytes, c.items, device)
        ahead = min(device.ring_bytes, ahead + wait * bw)  # the wait's bandwidth streams coming weights
        from_ring = min(ahead, c.weight_bytes)
        ahead -= from_ring
        fresh = c.bytes - from_ring
        work = _work_us(fresh, c.items, device)
        ahead = min(device.ring_bytes, ahead + (work - fresh / bw) * bw)  # bandwidth a latency-bound op leaves
        rows.append(dict(op=c.name, layer=c.layer, bytes=c.bytes, floor_us=c.bytes / bw, items=c.items,
                         edges=c.edges, naive_us=naive, overlapped_us=wait + work))
    return rows, ahead


def _work_us(nbytes: float, items: int, device: Device) -> float:
    block_bw = THREADS * 16 * IN_FLIGHT_VECS / device.latency_us  # bytes per µs a workgroup keeps in flight
    waves = math.ceil(items / device.blocks)
    item_us = device.latency_us + nbytes / items / block_bw
    return max(nbytes / (device.achievable_gbps * 1e3), waves * item_us)


def _op_name(code: int, weights: tuple[str, ...]) -> str:
    if code == _C.GPU_OP_LINEAR_SAMPLE_PARTIAL:
        return "LINEAR lm_head+sample_partial"
    if code == _C.GPU_OP_LINEAR_SILU_MUL:
        return "LINEAR gate_up+silu_mul"
    if code == _C.GPU_OP_LINEAR_ROPE_KV:
        return "LINEAR qkv+rope+kv_append"
    if code == Opcode.ATTN_DECODE:
        return "ATTN_DECODE"
    if code == Opcode.LINEAR:
        w = weights[0]
        return "LINEAR " + ("lm_head" if "lm_head" in w or "embed" in w else w.split(".")[-2])
    if code == Opcode.RMS_NORM:
        norm = weights[0].split(".")[-2]
        return "RMS_NORM " + {"input_layernorm": "attn", "post_attention_layernorm": "mlp"}.get(norm, "final")
    return Opcode(code).name


def _by_kind(rows: list[dict]) -> list[dict]:
    """Rows summed over layers, per op name, in first-appearance order."""
    out: dict[str, dict] = {}
    for r in rows:
        a = out.setdefault(r["op"], dict(op=r["op"], count=0, bytes=0, floor_us=0.0, naive_us=0.0,
                                         overlapped_us=0.0, items=r["items"], edges=r["edges"]))
        a["count"] += 1
        for k in ("bytes", "floor_us", "naive_us", "overlapped_us"):
            a[k] += r[k]
    return list(out.values())


def _print_ops(model: str, device: str, batch: int, context: int, rows: list[dict]) -> None:
    print(f"\n{model} on {DEVICES[device].name}, batch {batch}, context {context}: per op, summed over layers (MODEL)")
    print(f"{'op':<24}{'n':>4}{'MB':>10}{'items':>7}{'edges':>6}{'floor us':>10}{'naive us':>10}{'overlap us':>11}")
    for a in _by_kind(rows):
        print(f"{a['op']:<24}{a['count']:>4}{a['bytes'] / 1e6:>10.3f}{a['items']:>7}{a['edges']:>6}"
              f"{a['floor_us']:>10.1f}{a['naive_us']:>10.1f}{a['overlapped_us']:>11.1f}")


def _print_summary(summaries: list[dict]) -> None:
    print("\nSummary (MODEL, not a measurement): fraction = bandwidth floor / predicted, floor at the ceiling "
          "bandwidth; 'of spec' against the vendor peak")
    print(f"{'model':<10}{'device':<8}{'batch':>6}{'ctx':>7}{'MB/step':>9}{'floor us':>10}{'naive us':>10}"
          f"{'overlap us':>11}{'us/token':>10}{'frac naive':>11}{'frac overlap':>13}{'of spec':>9}{'tok/s':>9}")
    for s in summaries:
        print(f"{s['model']:<10}{s['device']:<8}{s['batch']:>6}{s['context']:>7}{s['bytes_per_step'] / 1e6:>9.1f}"
              f"{s['floor_us']:>10.1f}{s['naive_us']:>10.1f}{s['overlapped_us']:>11.1f}"
              f"{s['us_per_token_overlapped']:>10.1f}{s['frac_naive']:>11.1%}{s['frac_overlapped']:>13.1%}"
              f"{s['frac_spec_overlapped']:>9.1%}{s['tok_per_s_overlapped']:>9.0f}")


def _print_target(summaries: list[dict]) -> None:
    for s in summaries:
        if (s["model"], s["device"], s["batch"]) == ("llama-1b", "H200", 1):
            verdict = "met" if s["frac_overlapped"] >= 0.85 else "NOT met"
            print(f"\nIssue 16 target, >= 85% of bandwidth for llama-1b on H200 at batch 1: the model predicts "
                  f"{s['frac_overlapped']:.1%} of the copy ceiling ({s['frac_spec_overlapped']:.1%} of spec) "
                  f"overlapped at context {s['context']}: {verdict}, under the assumptions below.")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--sync-us", type=float, default=0.9, help="cost of one dependency wait, µs")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--devices", nargs="+", default=list(DEVICES), choices=list(DEVICES))
    ap.add_argument("--ops", action="store_true", help="also print the per-op table of every batch")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = ap.parse_args(argv)
    result = dict(kind="MODEL, not a measurement", sync_us=args.sync_us, assumptions=ASSUMPTIONS,
                  devices={k: asdict(d) for k, d in DEVICES.items()}, summaries=[], ops={})
    if not args.json:
        print(HEADER)
        print(f"sync {args.sync_us} µs per dependency wait; context {args.context}; bf16")
    for model in args.models:
        for device in args.devices:
            for batch in args.batch:
                rows, s = run(model, device, batch, args.context, args.sync_us)
                result["summaries"].append(s)
                result["ops"][f"{model}/{device}/{batch}"] = _by_kind(rows)
                if not args.json and (args.ops or batch == args.batch[0]):
                    _print_ops(model, device, batch, args.context, rows)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print_summary(result["summaries"])
        _print_target(result["summaries"])
        print("\nAssumptions:")
        for a in ASSUMPTIONS:
            print(f"- {a}")
        print("Ceilings: " + "; ".join(f"{d.name}: {d.source}" for d in DEVICES.values()))
    return result


if __name__ == "__main__":
    main()
