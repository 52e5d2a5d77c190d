"""How fast is Kog's mixture-of-experts decode on this CPU, next to llama.cpp on the same GGUF
file and next to the memory bandwidth measured in the same run?

    PYTHONPATH=python python bench/moe_decode.py [--new-tokens 32] [--repeats 3] [--cache DIR]

The model: random weights in Qwen3-MoE's shape, sized for a small machine -- hidden 1024, 12
layers, 16 query / 4 KV heads of 64, 64 experts of width 384, top-8 (renormalized), vocabulary
16384: ~0.97B parameters, ~162M active per token (attention, router, 8 experts per layer, LM
head). Written once as an HF folder (bf16 safetensors, the stacked expert layout) and as a BF16
GGUF by `kog convert` (hf_to_gguf), cached under --cache (default build/moe-bench). Both engines
run that GGUF in bf16, the same thread count.

Table 1, batch 1: decode tok/s of Kog and llama.cpp (llama-cpp-python), the engines alternating
run by run, on the BF16 file and on the same model as Q8_0 (`kog convert --outtype q8_0` of the
BF16 file, cached beside it; Kog keeps the experts' Q8_0 blocks and runs the quantized GEMV on
the chosen experts' rows); MB/tok = bytes of the weights one step reads (active only: attention, router, 8 of
the 64 experts per layer, LM head); % triad = MB/tok x tok/s over the best STREAM triad of the
run (bench/cpu_decode.py's triad_gbs), % adj against the triads just before and after each run,
% read against a read-only stream measured once (read_gbs: the rate a weight stream can reach,
below the triad on VMs whose writes take another path).

Table 2, batch 8: Kog decode tok/s (8 rows x steps / s) with the rows that chose the same expert
merged into one GEMM (the default) and with KOG_MOE_MERGE=0 (each row reads its experts
itself), alternating. With uniform-ish routing 8 rows x 8 choices hit ~42 of 64 distinct experts
per layer (64 x (1 - (56/64)^8)): merged reads ~42 experts' matrices a step instead of 64.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kog.loader import load_model
from kog.models import ModelRunner, PrefillChunk

sys.path.insert(0, str(Path(__file__).parent))
from cpu_decode import llama_cpp_runs, paired_runs, read_gbs, triad_gbs  # noqa: E402

SHAPE = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384, intermediate_size=3072,
             vocab_size=16384, max_position_embeddings=4096)
BS = 16


def model_files(cache: Path) -> Path:
    """The BF16 GGUF of the bench model (written with its HF folder on first use)."""
    from kog.loader.gguf_write import hf_to_gguf
    from kog.loader.weights import expected_shapes
    from kog.testing.tiny_models import tiny_config, write_hf_model

    gguf_path = cache / "qwen3moe-1b-a160m-bf16.gguf"
    if gguf_path.exists():
        return gguf_path
    config = tiny_config("qwen3_moe", torch_dtype="bfloat16", norm_topk_prob=True,
                         moe_layers=tuple(range(SHAPE["num_hidden_layers"])), tie_word_embeddings=False, **SHAPE)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in expected_shapes(config).items():
        std = 0.5 if name.endswith("mlp.gate.weight") else 0.02  # routers decisive enough to spread tokens
        w = 1.0 + 0.1 * torch.randn(shape, generator=g) if "norm" in name else std * torch.randn(shape, generator=g)
        weights[name] = w.to(torch.bfloat16)
    folder = write_hf_model(cache / "hf", config, weights)
    del weights
    hf_to_gguf(folder, gguf_path, "bf16")
    return gguf_path


def q8_0_file(bf16: Path) -> Path:
    """The bench model as Q8_0 (written from the BF16 file on first use)."""
    from kog.loader.gguf_write import requantize_gguf

    path = bf16.with_name(bf16.name.replace("-bf16", "-q8_0"))
    if not path.exists():
        requantize_gguf(bf16, path, "q8_0")
    return path


def active_bytes(model) -> int:
    """Bytes of weights one batch-1 decode step reads: every matrix but the embedding, the
    stacked experts scaled by top_k / experts (the chosen ones), the LM head."""
    c = model.config
    total = 0
    for name, t in model.weights.items():
        if name == "model.embed_tokens.weight" or len(t.shape) < 2:  # QuantizedWeight: shape, no dim()
            continue
        share = c.num_experts_per_tok / c.num_experts if ".mlp.experts." in name else 1
        total += int(t.nbytes * share)
    return total


def kog_decode(model, batch: int, prompt_len: int, new: int):
    """decode_run() -> tok/s: `batch` sequences prefilled with a random prompt, then `new` steps."""
    blocks = (prompt_len + new) // BS + 1
    runner = ModelRunner(model, num_kv_blocks=batch * blocks, block_size=BS)
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
    g = np.random.default_rng(1)
    prompts = [g.integers(3, 400, prompt_len).tolist() for _ in range(batch)]

    def slots(i, pos):
        pos = np.asarray(pos)
        return tables[i][pos // BS].astype(np.int64) * BS + pos % BS

    def decode_run() -> float:
        runner.prefill([PrefillChunk(p, 0, tables[i], slots(i, np.arange(prompt_len))) for i, p in enumerate(prompts)])
        tok = np.array([p[-1] for p in prompts], dtype=np.int64)
        start = time.perf_counter()
        for step in range(new):
            p = prompt_len + step
            runner.decode(tok, [p] * batch, tables, [p + 1] * batch,
                          np.concatenate([slots(i, [p]) for i in range(batch)]), sampled=tok)
        return batch * new / (time.perf_counter() - start)

    def routes() -> list[int]:
        """Distinct experts the rows choose per MoE layer in one more step (each layer's ROUTE
        buffer, read on a separate executor stopped after that layer's ROUTER)."""
        from kog.models.decode import build_executor
        from kog.program import Buffer, Opcode

        p = prompt_len + new
        pos = np.full(batch, p, dtype=np.int64)
        lens, tok = (pos + 1).astype(np.int32), np.arange(3, 3 + batch, dtype=np.int64)
        sl = np.concatenate([slots(i, [p]) for i in range(batch)])
        ex = build_executor(model.config, runner.weights, runner.kv.kv, BS, runner.inv_freq)
        counts = []
        for stop in [j + 1 for j, ins in enumerate(runner.program) if ins.opcode == Opcode.ROUTER]:
            ex.run(batch, tok.ctypes.data, pos.ctypes.data, tables.ctypes.data, tables.shape[1], lens.ctypes.data,
                   sl.ctypes.data, torch.empty(batch, runner.vocab_size).data_ptr(), 0, stop)
            route = torch.empty(batch, ex.width(int(Buffer.ROUTE)), dtype=torch.int32)
            ex.read_buffer(int(Buffer.ROUTE), route.data_ptr(), route.numel() * 4)
            counts.append(len(set(route[:, :model.config.num_experts_per_tok].flatten().tolist())))
        return counts

    decode_run.routes = routes
    return decode_run


def llama_cpp_decode(llm, prompt_len: int, new: int):
    """The same batch-1 loop through llama-cpp-python (cpu_decode.llama_cpp_runs: greedy from
    the context's last logits)."""
    prompt = np.random.default_rng(1).integers(3, 400, prompt_len).tolist()
    return llama_cpp_runs(llm, prompt, new)[0]


def merge_env(on: bool):
    if on:
        os.environ.pop("KOG_MOE_MERGE", None)
    else:
        os.environ["KOG_MOE_MERGE"] = "0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=Path(__file__).resolve().parents[1] / "build" / "moe-bench")
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    path = model_files(args.cache)
    q8_path = q8_0_file(path)
    threads = torch.get_num_threads()
    model, q8 = load_model(path, progress=False), load_model(q8_path, progress=False)
    nbytes = {"kog": active_bytes(model), "kog q8_0": active_bytes(q8)}
    engines = {"kog": kog_decode(model, 1, args.prompt, args.new_tokens),
               "kog q8_0": kog_decode(q8, 1, args.prompt, args.new_tokens)}
    if not args.no_llama_cpp:
        import llama_cpp

        for name, file in (("llama.cpp", path), ("llama.cpp q8_0", q8_path)):
            llm = llama_cpp.Llama(model_path=str(file), n_ctx=args.prompt + args.new_tokens + 8, n_batch=512,
                                  n_threads=threads, n_threads_batch=threads, verbose=False)
            engines[name] = llama_cpp_decode(llm, args.prompt, args.new_tokens)
            nbytes[name] = nbytes["kog" + name[len("llama.cpp"):]]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(args.repeats):  # alternate: a drift of the host hits every engine
        for name, run in engines.items():
            runs[name] += paired_runs(run, 1)
    b8 = {True: [], False: []}
    decode8 = kog_decode(model, 8, args.prompt, args.new_tokens // 2)
    for _ in range(args.repeats):
        for on in (True, False):
            merge_env(on)
            b8[on].append(decode8())
    merge_env(True)
    distinct = decode8.routes()
    bw = max([triad_gbs()] + [t for r in runs.values() for _, t in r])
    rd = read_gbs()

    c = model.config
    print(f"\nQwen3-MoE-shaped random model (hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_experts} "
          f"experts x {c.moe_intermediate_size}, top-{c.num_experts_per_tok}), {path.name}, bf16, {threads} threads; "
          f"decode {args.new_tokens} tokens after {args.prompt}, best of {args.repeats} alternating; "
          f"triad {bw:.1f} GB/s, read-only stream {rd:.1f} GB/s")
    print(f"{'engine':<16}{'tok/s':>8}{'MB/tok':>8}{'GB/s':>7}{'% triad':>9}{'% adj':>7}{'% read':>8}")
    best = {}
    for name, r in runs.items():
        n = nbytes[name]
        tps = best[name] = max(t for t, _ in r)
        adj = float(np.median([t * n / 1e9 / tri for t, tri in r]))
        print(f"{name:<16}{tps:>8.2f}{n / 1e6:>8.1f}{tps * n / 1e9:>7.2f}{100 * tps * n / 1e9 / bw:>8.0f}%"
              f"{100 * adj:>6.0f}%{100 * tps * n / 1e9 / rd:>7.0f}%")
    print(f"kog q8_0 / kog bf16 at batch 1: {best['kog q8_0'] / best['kog']:.2f}x")
    if "llama.cpp" in best:
        print(f"kog / llama.cpp at batch 1: bf16 {best['kog'] / best['llama.cpp']:.2f}x, q8_0 "
              f"{best['kog q8_0'] / best['llama.cpp q8_0']:.2f}x (llama.cpp {llama_cpp.__version__})")
    on, off = max(b8[True]), max(b8[False])
    per_expert = sum(t.nbytes for n, t in model.weights.items() if ".mlp.experts." in n) // (
        c.num_experts * len(distinct))
    dense = nbytes["kog"] - c.num_experts_per_tok * per_expert * len(distinct)
    reads = {True: dense + sum(distinct) * per_expert, False: dense + 8 * c.num_experts_per_tok * len(distinct) * per_expert}
    print(f"\nbatch 8, {args.new_tokens // 2} steps, Kog: rows choose {np.mean(distinct):.1f} distinct experts per layer "
          f"(of 8 x {c.num_experts_per_tok} choices; {min(distinct)}-{max(distinct)} over the layers, one step)")
    print(f"{'expert merge':<22}{'tok/s':>8}{'steps/s':>9}{'MB/step':>9}{'GB/s':>7}{'% triad':>9}{'% read':>8}")
    for flag, tps in ((True, on), (False, off)):
        label = "on (default)" if flag else "off (KOG_MOE_MERGE=0)"
        gbs = tps / 8 * reads[flag] / 1e9
        print(f"{label:<22}{tps:>8.1f}{tps / 8:>9.2f}{reads[flag] / 1e6:>9.1f}{gbs:>7.2f}{100 * gbs / bw:>8.0f}%"
              f"{100 * gbs / rd:>7.0f}%")
    print(f"merge on / off: {on / off:.2f}x. MB/step: bytes the step's GEMMs stream from the routes above (merged: "
          "each distinct expert once; off: each of the 64 row-expert pairs), not a counter.")


if __name__ == "__main__":
    main()
