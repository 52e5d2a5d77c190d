"""GPU decode latency at batch 1: Kog's persistent decode kernel vs torch eager and torch with
CUDA graphs on the same random bf16 weights, plus KV swap through pinned host memory.

    python bench/decode_latency.py [--out DIR] [--iters N] [--models llama-1b,llama-1b:8] [--ctx 1024]

Models: random-weight Llama-3.2-1B and a 2.3B Llama-shaped model; contexts 1k and 4k; NAME:N
keeps N of the model's layers (1, 8 and 16 layers separate the per-layer cost from the rest).
Per row: us/token p50, tok/s, and achieved bandwidth (weights + KV read per token / time) as a
fraction of a device-to-device copy measured in the same run. Kog runs one launch per token
("kog 1-step", host builds the inputs each call; "kog kernel", the same launch over inputs staged
once) and 32 tokens per launch ("kog loop32").
With --out, each row is appended to DIR/decode_latency.jsonl as soon as it is measured (a run cut
short keeps what it measured), and the table goes to DIR/decode_latency.txt at the end.
Swap: 1 GiB of KV blocks out to pinned host memory and back in through Kog's block-copy
kernel, in GB/s beside a plain pinned host<->device copy of the same bytes.
Quantized weights (--formats; the first model, after every other row): "kog kernel <format>"
rows with every linear matrix FP8 (per-channel scales, kog.fp8), 4-bit groups (an f16 scale and
min per 32: Q4_0 / Q4_1 / GPTQ / AWQ, kog.int4) or Q4_K (super-block headers), random codes drawn
on the device; "% copy bw" counts those formats' bytes (codes + scales), the embedding / tied
head staying bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kog import _C
from kog.config import ModelConfig
from kog.fp8 import gpu_format, quantize
from kog.int4 import Int4Weight
from kog.kvcache import KVCacheStorage, KVLayout
from kog.models.gpu_decode import GpuDecoder
from kog.ops import rope_inv_freq

BS = 16
SHAPES = {  # name: (hidden, layers, q heads, kv heads, head_dim, intermediate, vocab)
    "llama-1b": (2048, 16, 32, 8, 64, 8192, 128256),
    "llama-2.3b": (2560, 23, 20, 4, 128, 9216, 128256),
}


def config_for(name: str) -> ModelConfig:
    """NAME or NAME:LAYERS (the first LAYERS of the model's layers)."""
    base, _, layers = name.partition(":")
    h, n, q, kv, hd, inter, vocab = SHAPES[base]
    n = int(layers or n)
    return ModelConfig(architecture="llama", hidden_size=h, num_hidden_layers=n, num_attention_heads=q,
                       num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, vocab_size=vocab,
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                       tie_word_embeddings=True, attention_bias=False, qk_norm=False, bos_token_id=1,
                       eos_token_ids=(2,), torch_dtype="bfloat16")


def random_weights(c: ModelConfig, dev) -> dict[str, torch.Tensor]:
    """Prepared-layout weights (fused qkv_proj, gate_up_proj), bf16, drawn on the device."""
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: (torch.randn(*s, generator=g, device=dev) * 0.02).to(torch.bfloat16)  # noqa: E731
    one = lambda n: torch.ones(n, device=dev, dtype=torch.bfloat16)  # noqa: E731
    hd, q, kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    w = {"model.embed_tokens.weight": r(c.vocab_size, c.hidden_size), "model.norm.weight": one(c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = one(c.hidden_size)
        w[p + "post_attention_layernorm.weight"] = one(c.hidden_size)
        w[p + "self_attn.qkv_proj.weight"] = r((q + 2 * kv) * hd, c.hidden_size)
        w[p + "self_attn.o_proj.weight"] = r(c.hidden_size, q * hd)
        w[p + "mlp.gate_up_proj.weight"] = r(2 * c.intermediate_size, c.hidden_size)
        w[p + "mlp.down_proj.weight"] = r(c.hidden_size, c.intermediate_size)
    return w


def random_int4(w: torch.Tensor, kind: int, g: torch.Generator) -> Int4Weight:
    """A 4-bit matrix of w's shape with random codes and scales about w's (bandwidth, not values)."""
    n, k = w.shape
    dev = w.device
    codes = torch.randint(0, 256, (n, k // 2), generator=g, device=dev, dtype=torch.uint8)
    if kind == _C.WEIGHT_Q4_GROUPS:  # (scale, min) f16 pairs: w = 0.004 q - 0.03
        pairs = torch.tensor([0.004, -0.03], dtype=torch.float16, device=dev).repeat(n, k // 32)
        return Int4Weight(codes, pairs.view(torch.uint8).reshape(n, -1).contiguous(), kind, k)
    head = torch.randint(0, 64, (n, k // 256, 16), generator=g, device=dev, dtype=torch.uint8)  # 6-bit fields
    head[..., :4] = torch.tensor([1e-4, 5e-4], dtype=torch.float16, device=dev).view(torch.uint8)  # d, dmin
    return Int4Weight(codes, head.reshape(n, -1).contiguous(), kind, k)


def quantized_weights(w: dict[str, torch.Tensor], fmt: str) -> dict:
    """w with every linear matrix (qkv, o, gate_up, down) in `fmt` ("fp8", "q4", "q4_k")."""
    g = torch.Generator(device=next(iter(w.values())).device).manual_seed(1)
    out = dict(w)
    for name, t in w.items():
        if not name.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")):
            continue
        if fmt == "fp8":
            out[name] = quantize(t, gpu_format())
        elif fmt == "q4" or t.shape[1] % 256:
            out[name] = random_int4(t, _C.WEIGHT_Q4_GROUPS, g)
        else:
            out[name] = random_int4(t, _C.WEIGHT_Q4_K, g)
    return out


def timed_us(fn, iters: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return out


def copy_gbs(dev) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = statistics.median(timed_us(lambda: dst.copy_(src), 10))
    return 2 * src.numel() / us / 1e3


class TorchDecode:
    """A plain torch decode step over dense per-layer caches (the eager / CUDA-graph baseline)."""

    def __init__(self, c: ModelConfig, w: dict[str, torch.Tensor], ctx: int, dev) -> None:
        self.c, self.w, self.ctx = c, w, ctx
        hd, kv = c.head_dim, c.num_key_value_heads
        self.k = torch.randn(c.num_hidden_layers, 1, kv, ctx + 1, hd, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)
        inv = rope_inv_freq(hd, c.rope_theta, None).to(dev)
        ang = ctx * inv
        self.cos, self.sin = torch.cat([ang.cos()] * 2).to(torch.bfloat16), torch.cat([ang.sin()] * 2).to(torch.bfloat16)
        self.token = torch.zeros(1, dtype=torch.int64, device=dev)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return x * self.cos + torch.cat([-x[..., h:], x[..., :h]], -1) * self.sin

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        c, w, hd = self.c, self.w, self.c.head_dim
        q_h, kv_h = c.num_attention_heads, c.num_key_value_heads
        x = w["model.embed_tokens.weight"][self.token]  # [1, hidden]
        res = x
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = F.rms_norm(res, (c.hidden_size,), w[p + "input_layernorm.weight"], c.rms_norm_eps)
            qkv = h @ w[p + "self_attn.qkv_proj.weight"].T
            q, k, v = qkv.split([q_h * hd, kv_h * hd, kv_h * hd], -1)
            q = self.rope(q.view(1, q_h, 1, hd))
            self.k[i, :, :, self.ctx] = self.rope(k.view(1, kv_h, hd))
            self.v[i, :, :, self.ctx] = v.view(1, kv_h, hd)
            a = F.scaled_dot_product_attention(q, self.k[i], self.v[i], enable_gqa=True)
            res = res + a.reshape(1, q_h * hd) @ w[p + "self_attn.o_proj.weight"].T
            h = F.rms_norm(res, (c.hidden_size,), w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            g, u = (h @ w[p + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
            res = res + (F.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
        h = F.rms_norm(res, (c.hidden_size,), w["model.norm.weight"], c.rms_norm_eps)
        logits = h @ w["model.embed_tokens.weight"].T
        self.token.copy_(logits.argmax(-1))
        return self.token


def bench_model(name: str, ctxs: list[int], iters: int, copy_bw: float, dev, emit) -> list[dict]:
    """Rows for one model; emit(row) is called as each is measured."""
    c = config_for(name)
    w = random_weights(c, dev)
    weight_bytes = sum(t.numel() * 2 for k, t in w.items())
    rows = []
    for ctx in ctxs:
        loop = 32
        kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * ctx
        per_token = weight_bytes + kv_bytes

        def row(engine: str, us: float) -> None:
            rows.append(dict(model=name, ctx=ctx, engine=engine, us_per_token=us, tok_s=1e6 / us,
                             bw_fraction=per_token / us / 1e3 / copy_bw))
            emit(rows[-1])

        # The baselines first: a run whose kernel hangs or dies still brings them back.
        t = TorchDecode(c, w, ctx, dev)
        row("torch eager", statistics.median(timed_us(t.step, iters)))
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            t.step()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            t.step()
        row("torch cuda-graph", statistics.median(timed_us(graph.replay, iters)))
        del t, graph
        n_blocks = (ctx + loop) // BS + 2
        kv = torch.randn(c.num_hidden_layers, n_blocks, 2, c.num_key_value_heads, BS, c.head_dim,
                         device=dev, dtype=torch.bfloat16)
        dec = GpuDecoder(c, w, kv, BS, rope_inv_freq(c.head_dim, c.rope_theta, None))
        table = np.arange(n_blocks, dtype=np.int32)[None]
        row("kog 1-step", statistics.median(timed_us(lambda: dec.decode([1], [ctx], table), iters)))
        staged = dec.stage([1], [ctx], table)  # one step leaves its staged inputs as they were
        row("kog kernel", statistics.median(timed_us(lambda: dec.launch(staged), iters)))
        l32 = statistics.median(timed_us(lambda: dec.decode([1], [ctx - loop + 1], table, n_steps=loop), max(3, iters // 8)))
        row("kog loop32", l32 / loop)
        del dec, kv, staged
        torch.cuda.empty_cache()
    return rows


def bench_formats(name: str, ctxs: list[int], iters: int, copy_bw: float, dev, emit,
                  formats: tuple[str, ...]) -> list[dict]:
    """"kog kernel <format>" rows of one model: its linear matrices in each quantized format
    (measured after every bf16 row, so a failing format costs no baseline)."""
    c = config_for(name)
    w = random_weights(c, dev)
    rows = []
    for fmt in formats:
        qw = quantized_weights(w, fmt)
        weight_bytes = sum(t.numel() * 2 if isinstance(t, torch.Tensor) else t.nbytes for t in qw.values())
        for ctx in ctxs:
            kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * ctx
            n_blocks = ctx // BS + 2
            kv = torch.randn(c.num_hidden_layers, n_blocks, 2, c.num_key_value_heads, BS, c.head_dim,
                             device=dev, dtype=torch.bfloat16)
            dec = GpuDecoder(c, qw, kv, BS, rope_inv_freq(c.head_dim, c.rope_theta, None))
            staged = dec.stage([1], [ctx], np.arange(n_blocks, dtype=np.int32)[None])
            us = statistics.median(timed_us(lambda: dec.launch(staged), iters))
            rows.append(dict(model=name, ctx=ctx, engine=f"kog kernel {fmt}", us_per_token=us, tok_s=1e6 / us,
                             bw_fraction=(weight_bytes + kv_bytes) / us / 1e3 / copy_bw))
            emit(rows[-1])
            del dec, kv, staged
        del qw
        torch.cuda.empty_cache()
    return rows


def bench_swap(dev) -> list[dict]:
    layout = KVLayout(16, 8, 64, BS, torch.bfloat16)
    n = 2**30 // layout.bytes_per_block  # 1 GiB of blocks
    st = KVCacheStorage(layout, n, n, device=dev)
    pairs = np.stack([np.arange(n), np.arange(n)], 1).astype(np.int32)
    out_us = statistics.median(timed_us(lambda: st.copy_blocks(st.host, st.kv, pairs), 5))
    in_us = statistics.median(timed_us(lambda: st.copy_blocks(st.kv, st.host, pairs), 5))
    flat_d, flat_h = st.kv.view(-1), st.host.view(-1)
    d2h = statistics.median(timed_us(lambda: flat_h.copy_(flat_d, non_blocking=True), 5))
    h2d = statistics.median(timed_us(lambda: flat_d.copy_(flat_h, non_blocking=True), 5))
    nbytes = n * layout.bytes_per_block
    gbs = lambda us: nbytes / us / 1e3  # noqa: E731
    return [dict(case="swap-out 1 GiB", kog_gbs=gbs(out_us), plain_gbs=gbs(d2h)),
            dict(case="swap-in 1 GiB", kog_gbs=gbs(in_us), plain_gbs=gbs(h2d))]


ROW_HEADER = f"{'model':<14}{'ctx':>6}  {'engine':<18}{'us/token':>10}{'tok/s':>9}{'% copy bw':>11}"


def row_line(r: dict) -> str:
    return (f"{r['model']:<14}{r['ctx']:>6}  {r['engine']:<18}{r['us_per_token']:>10.1f}{r['tok_s']:>9.1f}"
            f"{100 * r['bw_fraction']:>10.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--models", default="llama-1b,llama-1b:1,llama-1b:8,llama-2.3b")
    ap.add_argument("--ctx", default="1024,4096")
    ap.add_argument("--no-swap", action="store_true", help="skip the KV swap rows")
    ap.add_argument("--formats", default="fp8,q4,q4_k",
                    help="quantized-weight rows for the first model (comma list of fp8, q4, q4_k; '' for none)")
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    jsonl = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        jsonl = open(Path(args.out, "decode_latency.jsonl"), "a", buffering=1)  # noqa: SIM115 (line-buffered)

    def emit(r: dict) -> None:
        print(row_line(r) if "engine" in r else r, flush=True)
        if jsonl:
            jsonl.write(json.dumps(r) + "\n")

    copy_bw = copy_gbs(dev)
    head = f"{torch.cuda.get_device_name(dev)}; device-to-device copy {copy_bw:.0f} GB/s; batch 1, bf16"
    print(head, ROW_HEADER, sep="\n", flush=True)
    emit(dict(device=torch.cuda.get_device_name(dev), copy_gbs=copy_bw))
    rows = []
    ctxs = [int(x) for x in args.ctx.split(",")]
    models = args.models.split(",")
    for name in models:
        rows += bench_model(name, ctxs, args.iters, copy_bw, dev, emit)
    formats = tuple(f for f in args.formats.split(",") if f)
    if formats:
        rows += bench_formats(models[0], ctxs, args.iters, copy_bw, dev, emit, formats)
    swap = [] if args.no_swap else bench_swap(dev)
    for s in swap:
        emit(s)
    lines = [head, ROW_HEADER + f"{'x graph':>9}"]
    for r in rows:
        graph = next((x for x in rows if x["model"] == r["model"] and x["ctx"] == r["ctx"]
                      and x["engine"] == "torch cuda-graph"), None)  # the bf16 baseline
        lines.append(row_line(r) + (f"{graph['us_per_token'] / r['us_per_token']:>9.2f}" if graph else ""))
    if swap:
        lines.append(f"{'swap':<20}{'kog GB/s':>10}{'plain pinned GB/s':>19}")
        lines += [f"{s['case']:<20}{s['kog_gbs']:>10.1f}{s['plain_gbs']:>19.1f}" for s in swap]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out, "decode_latency.txt").write_text(table + "\n")
        Path(args.out, "decode_latency.json").write_text(json.dumps(dict(copy_gbs=copy_bw, rows=rows, swap=swap), indent=1))


if __name__ == "__main__":
    main()
