"""How fast is Kog's CPU decode next to transformers (and llama.cpp), and how close to the
memory bandwidth of this machine, measured in the same run?

    PYTHONPATH=python python bench/cpu_decode.py [--new-tokens 128] [--repeats 3] [--baseline DIR]

SmolLM2-135M, batch 1: decode tok/s (new tokens after a 32-token prompt) and the time of a
512-token prefill, best of N (the machine may be shared). Bandwidth: a STREAM-style triad
(a = b + s*c over 3 x 128 MB arrays, 3 arrays counted). Achieved bandwidth of an engine =
bytes of weights one decode step reads (every matrix once, the LM head included, the
embedding gather not) x tok/s. The host's bandwidth drifts by 30% within minutes when its
neighbours are busy, so every decode run also gets a triad just before and just after it:
"% adj" is the median over runs of achieved / max(adjacent triads), next to "% triad" against
the best triad of the whole run.

`--baseline DIR` (DIR holds another build's `kog` package, e.g. a copy of python/ from main)
adds a table of the 512-token prefill of this tree next to that build, f32 and bf16, and of a
4-token prefill of a tiny 8-layer model (the prefill path's per-op Python cost), measured in
child processes that alternate between the two (best of the rounds for each), in the same run;
`--prefill-only` prints only that table.

A quantized-weights table (`--quant-only` prints only it): the shipped Q4_1 GGUF run with its
blocks kept (kog's default) next to the same file dequantized to f32 and bf16, decode tok/s,
512-token prefill (each prefill path of the quantized model) and weight bytes per token.

`--ttft-only`: time to first token of short chat prompts, the Q4_1 file's blocks kept (this
tree's prefill paths and the previous ones) next to the same file in f32.

`--llama-cpp-only`: Kog next to llama.cpp (llama-cpp-python) on the same GGUF files -- Q4_1 as
shipped, Q8_0 and Q4_K written by `kog convert` -- decode tok/s, 512-token prefill, MB per token
and % of the triad, the engines alternating run by run, the same thread count.

A second table: bf16 decode after longer prompts (an agent's context: system prompt, tool
schemas, history), Kog next to llama.cpp F16 (KV cache F16), where attention reads a growing
share of each step's bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kog.loader import load_model
from kog.loader.convert import convert_gguf
from kog.models import ModelRunner, PrefillChunk


def triad_gbs(n: int = 32_000_000, repeats: int = 5) -> float:
    a, b, c = torch.empty(n), torch.randn(n), torch.randn(n)
    best = min(_timed(lambda: torch.add(b, c, alpha=3.0, out=a)) for _ in range(repeats))
    return 3 * 4 * n / best / 1e9


def read_gbs(n: int = 128_000_000, repeats: int = 5) -> float:
    """GB/s of a read-only stream (a sum over n float32, torch's threads): what a GEMV's weight
    stream can reach. On some VMs well below the triad, whose writes travel another path (a Zen5
    VM: triad 52-69 GB/s, reads 35-39), so a decode at the read rate shows as ~55% of the triad."""
    a = torch.ones(n)
    best = min(_timed(a.sum) for _ in range(repeats))
    return 4 * n / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def paired_runs(decode_run, repeats: int) -> list[tuple[float, float]]:
    """(tok/s, GB/s of the triads adjacent to the run, the better of before and after) per run."""
    runs = []
    for _ in range(repeats):
        before = triad_gbs(repeats=2)
        tps = decode_run()
        runs.append((tps, max(before, triad_gbs(repeats=2))))
    return runs


def weight_bytes_per_token(model) -> int:
    """Bytes of every matrix one decode step reads (the LM head: the embedding when tied), as
    stored: the run dtype, or a GGUF's blocks for QuantizedWeight matrices."""
    head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    return sum(t.nbytes for name, t in model.weights.items() if name != "model.embed_tokens.weight") + \
        model.weights[head].nbytes * (head == "model.embed_tokens.weight")


def quant_table(prompt: list[int], new: int, repeats: int) -> None:
    """The shipped Q4_1 GGUF with its blocks kept (dtype None), against the same file
    dequantized to f32 and bf16, in this run: decode tok/s, 512-token prefill (the quantized
    model three ways: x in f32 through in-cache weight tiles -- the default below 1536 rows --,
    f32 weight tiles + torch's GEMM, the int8 GEMV kernel), weight bytes per token."""
    from kog.program import interpreter

    rows = []
    for label, dtype in [("Q4_1 native", None), ("float32", torch.float32), ("bfloat16", torch.bfloat16)]:
        model = load_model(dtype=dtype)
        nbytes = weight_bytes_per_token(model)
        runs, pre = kog_engine(model, prompt, new, repeats)
        rows.append((label, nbytes, max(t for t, _ in runs), pre))
        if dtype is None:  # the other prefill paths of the quantized LINEAR, forced for every row count
            for path, limits in (("f32 tiles + torch GEMM", (2, 1)), ("int8 GEMV, x in 2 stages", (1 << 30,) * 2)):
                with prefill_paths(*limits):
                    runs, pre = kog_engine(load_model(dtype=None), prompt, 4, repeats)
                rows.append((f"  (prefill: {path})", nbytes, float("nan"), pre))
    f32 = next(r for r in rows if r[0] == "float32")
    print(f"\nSmolLM2-135M GGUF Q4_1, batch 1, {torch.get_num_threads()} threads: weights kept as stored vs dequantized")
    print(f"{'weights':<38}{'MB/token':>9}{'decode tok/s':>13}{'x f32':>7}{'prefill 512':>13}{'x f32':>7}")
    for label, nbytes, tps, pre in rows:
        dec = "-" if tps != tps else f"{tps:.1f}"
        ratio = "-" if tps != tps else f"{tps / f32[2]:.2f}"
        print(f"{label:<38}{nbytes / 1e6:>9.1f}{dec:>13}{ratio:>7}{pre:>12.2f}s{f32[3] / pre:>7.2f}")


def vs_llama_cpp_table(prompt: list[int], new: int, repeats: int) -> None:
    """Kog (blocks kept, dtype None) next to llama.cpp on the same GGUF files: the shipped Q4_1,
    Q8_0 and Q4_K written by `kog convert` (requantize_gguf), and Q4_K_M and Q5_K_M written by
    llama.cpp's own quantizer from the shipped file (the mixes users download: for SmolLM2's
    576-wide rows, not whole 256-element super-blocks, llama.cpp falls back to Q5_0 / Q5_1 and
    Q8_0 beside Q4_K / Q5_K / Q6_K). Per file the two engines
    alternate run by run (decode, then the 512-token prefill), each decode run between two
    triads; the same thread count for both."""
    import llama_cpp

    from kog.loader import resolve_model
    from kog.loader.gguf_write import requantize_gguf

    threads, rows = torch.get_num_threads(), []
    with tempfile.TemporaryDirectory() as tmp:
        files = {"Q4_1": resolve_model(None)}
        for outtype in ("q8_0", "q4_k"):
            files[outtype.upper()] = Path(tmp) / f"smollm2-{outtype}.gguf"
            requantize_gguf(files["Q4_1"], files[outtype.upper()], outtype)
        for name in ("Q4_K_M", "Q5_K_M"):
            files[name] = llama_cpp_quantize(files["Q4_1"], Path(tmp) / f"smollm2-{name}.gguf", name)
        for name, path in files.items():
            model = load_model(path, progress=False)
            nbytes, types = weight_bytes_per_token(model), file_matrix_types(path)
            kog_decode, kog_prefill = kog_runs(model, prompt, new)
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=threads,
                                  n_threads_batch=threads, verbose=False)
            lc_decode, lc_prefill = llama_cpp_runs(llm, prompt, new)
            runs = {"kog": [], "llama.cpp": []}
            pre = {"kog": float("inf"), "llama.cpp": float("inf")}
            for _ in range(repeats):  # alternate: a drift of the host hits both engines
                for eng, dec, prf in (("kog", kog_decode, kog_prefill), ("llama.cpp", lc_decode, lc_prefill)):
                    runs[eng] += paired_runs(dec, 1)
                    pre[eng] = min(pre[eng], _timed(prf))
            rows.append((f"{name} ({types})", nbytes, runs, pre))
            del llm
    bw = max([triad_gbs()] + [t for r in rows for e in r[2].values() for _, t in e])
    print(f"\nSmolLM2-135M GGUF, batch 1, {threads} threads, Kog vs llama.cpp {llama_cpp.__version__} on the same "
          f"files; decode {new} tokens after {len(prompt)}, best of {repeats} alternating; triad {bw:.1f} GB/s")
    print(f"{'file (matrix types, by bytes)':<30}{'MB/tok':>7}{'kog tok/s':>10}{'lcpp tok/s':>11}{'kog/lcpp':>9}{'kog %bw':>8}{'lcpp %bw':>9}"
          f"{'kog pre512':>11}{'lcpp pre512':>12}{'kog/lcpp':>9}")
    for name, nbytes, runs, pre in rows:
        k, lc = (max(t for t, _ in runs[e]) for e in ("kog", "llama.cpp"))
        pct = lambda tps: 100 * tps * nbytes / 1e9 / bw  # noqa: E731
        print(f"{name:<30}{nbytes / 1e6:>7.1f}{k:>10.1f}{lc:>11.1f}{k / lc:>8.2f}x{pct(k):>7.0f}%{pct(lc):>8.0f}%"
              f"{pre['kog']:>10.3f}s{pre['llama.cpp']:>11.3f}s{pre['llama.cpp'] / pre['kog']:>8.2f}x")
    print("MB/tok: matrix bytes of one decode step as Kog holds them (the LM head = the tied embedding), "
          "%bw = MB/tok x tok/s / triad for both engines. kog/lcpp > 1: Kog faster (prefill: time ratio "
          "llama.cpp / Kog).")


def llama_cpp_quantize(src, dst: Path, name: str) -> Path:
    """dst: src re-quantized by llama.cpp (llama_model_quantize) to its file type `name`, e.g. Q4_K_M."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
    params.allow_requantize = True  # the shipped file is already Q4_1
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {name}")
    return dst


def file_matrix_types(path) -> str:
    """The quant types of a GGUF's matrices, by bytes, largest first: 'Q8_0 71% Q4_K 29%'. NOTE:
    `kog convert --outtype q4_k` keeps 576-column matrices in Q8_0 (not a multiple of 256), as
    llama.cpp's quantize falls back on them."""
    from kog.loader.gguf import GGUFCheckpoint

    by: dict[str, int] = {}
    for t in GGUFCheckpoint(path).tensors.values():
        if len(t.torch_shape) == 2:
            by[t.qtype.name] = by.get(t.qtype.name, 0) + t.nbytes
    total = sum(by.values())
    return " ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def kog_runs(model, prompt: list[int], new: int):
    """(decode_run -> tok/s, prefill_512 -> None) over one runner of the model."""
    bs = 16
    runner = ModelRunner(model, num_kv_blocks=40, block_size=bs)
    table = np.arange(40, dtype=np.int32)
    slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731

    def decode_run() -> float:
        runner.prefill([PrefillChunk(prompt, 0, table, slot(np.arange(len(prompt))))])
        tok, start = np.array([1]), time.perf_counter()
        for i in range(new):
            p = len(prompt) + i
            runner.decode(tok, [p], table[None], [p + 1], [slot(p)], sampled=tok)
        return new / (time.perf_counter() - start)

    long = (prompt * 64)[:512]
    return decode_run, lambda: runner.prefill([PrefillChunk(long, 0, table, slot(np.arange(512)))])


def llama_cpp_next(llm) -> int:
    """llama-cpp-python's greedy next token, from the context's last logits (Llama.scores is
    only filled with logits_all: argmax over it fed token 0 every step)."""
    import llama_cpp

    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))))


def llama_cpp_runs(llm, prompt: list[int], new: int):
    """The same two measurements through llama-cpp-python (greedy next token, llama_cpp_next)."""
    def decode_run() -> float:
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(new):
            llm.eval([llama_cpp_next(llm)])
        return new / (time.perf_counter() - start)

    def prefill() -> None:
        llm.reset()
        llm.eval((prompt * 64)[:512])

    return decode_run, prefill


@contextlib.contextmanager
def prefill_paths(f32_x_min_rows: int, gemm_min_rows: int):
    """The quantized LINEAR's row thresholds (kog.program.interpreter) set for a block."""
    from kog.program import interpreter as it

    saved = it.QUANT_F32_X_MIN_ROWS, it.QUANT_GEMM_MIN_ROWS
    it.QUANT_F32_X_MIN_ROWS, it.QUANT_GEMM_MIN_ROWS = f32_x_min_rows, gemm_min_rows
    try:
        yield
    finally:
        it.QUANT_F32_X_MIN_ROWS, it.QUANT_GEMM_MIN_ROWS = saved


# The prefill policy before the f32-x kernel (commit 3e18e8b): int8 GEMV below 32 rows, f32 tiles
# and torch's GEMM from 32.
OLD_PATHS = (1 << 30, 32)


def ttft_table(repeats: int) -> None:
    """Time to first token of short chat prompts through kog.LLM (generate, max_tokens=1; the
    prompt's prefill plus one sample): the Q4_1 GGUF with its blocks kept -- this tree's prefill
    paths and the previous policy (OLD_PATHS) -- and the same file in f32, alternating, best of
    `repeats`."""
    import kog

    q, f = kog.LLM(max_num_seqs=1, max_model_len=1024), kog.LLM(None, "float32", max_num_seqs=1, max_model_len=1024)
    questions = ["Tell me about cats.", "What is the capital of France?",
                 "Explain in two sentences why the sky is blue, and mention Rayleigh scattering."]
    greedy = kog.SamplingParams(max_tokens=1, temperature=0)
    engines = {"Q4_1 (this tree)": (q, None), "Q4_1 (previous paths)": (q, OLD_PATHS), "float32": (f, None)}
    print(f"\nTTFT, SmolLM2-135M, {torch.get_num_threads()} threads, kog.LLM.generate(max_tokens=1), "
          f"prefix cache off by fresh prompts; best of {repeats} alternating, ms")
    print(f"{'prompt tokens':>14}" + "".join(f"{name:>24}" for name in engines) + f"{'f32 / this tree':>17}")
    for i, question in enumerate(questions):
        best = {name: float("inf") for name in engines}
        for r in range(repeats):
            for name, (llm, paths) in engines.items():
                # A different system line each time: no cached prefix block is reused.
                ids = llm.encode_chat([{"role": "system", "content": f"Session {r} {name}."},
                                       {"role": "user", "content": question}])
                with prefill_paths(*paths) if paths else contextlib.nullcontext():
                    best[name] = min(best[name], _timed(lambda: llm.generate({"prompt_token_ids": ids}, greedy)))
        print(f"{len(ids):>14}" + "".join(f"{best[name] * 1e3:>24.1f}" for name in engines)
              + f"{best['float32'] / best['Q4_1 (this tree)']:>16.2f}x")


def kog_engine(model, prompt: list[int], new: int, repeats: int) -> tuple[list[tuple[float, float]], float]:
    decode_run, prefill = kog_runs(model, prompt, new)
    return paired_runs(decode_run, repeats), min(_timed(prefill) for _ in range(repeats))


PREFILL_TOKENS = 512


def prefill_child(case: str, repeats: int) -> None:
    """Prints {"prefill": best seconds of `repeats` 512-token prefills} of the kog on sys.path
    (case: a dtype), or for case "tiny" the best mean of 300 4-token prefills of a tiny random
    8-layer model: the per-op Python cost of the prefill path."""
    if case == "tiny":
        return tiny_prefill_child(repeats)
    model = load_model(dtype=getattr(torch, case))
    prompt = model.tokenizer.encode("The history of the city begins in the Middle Ages, when a small " * 4)[:32]
    bs = 16
    runner = ModelRunner(model, num_kv_blocks=40, block_size=bs)
    table = np.arange(40, dtype=np.int32)
    chunk = PrefillChunk((prompt * 64)[:PREFILL_TOKENS], 0, table,
                         table[np.arange(PREFILL_TOKENS) // bs] * bs + np.arange(PREFILL_TOKENS) % bs)
    runner.prefill([chunk])  # warm-up: first-touch of weights and cache
    print(json.dumps({"prefill": min(_timed(lambda: runner.prefill([chunk])) for _ in range(repeats))}))


def tiny_prefill_child(repeats: int, calls: int = 300) -> None:
    from kog.loader import LoadedModel
    from kog.testing.tiny_models import random_weights, tiny_config

    c = tiny_config("llama", num_hidden_layers=8)
    model = LoadedModel(path=None, config=c, weights=random_weights(c), dtype=torch.float32, tokenizer=None,
                        chat_template=None, stop_token_ids=())
    runner = ModelRunner(model, num_kv_blocks=8, block_size=16)
    chunk = [PrefillChunk([5, 6, 7, 8], 0, np.arange(8, dtype=np.int32), np.arange(4))]
    for _ in range(50):
        runner.prefill(chunk)

    def many() -> None:
        for _ in range(calls):
            runner.prefill(chunk)
    print(json.dumps({"prefill": min(_timed(many) for _ in range(repeats)) / calls}))


def prefill_vs_baseline(baseline: str, rounds: int, repeats: int) -> None:
    """This tree's 512-token prefill against another build's, alternating child processes."""
    here = str(Path(__file__).resolve().parent.parent / "python")
    builds = {"this tree": here, "baseline": str(Path(baseline).resolve())}
    cases = {"float32": f"SmolLM2 f32, {PREFILL_TOKENS} tok", "bfloat16": f"SmolLM2 bf16, {PREFILL_TOKENS} tok",
             "tiny": "tiny 8-layer, 4 tok"}
    rows = []
    for case, label in cases.items():
        best = {name: float("inf") for name in builds}
        for _ in range(rounds):
            for name, path in builds.items():
                out = subprocess.run([sys.executable, __file__, "--prefill-child", case, "--repeats", str(repeats)],
                                     env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True,
                                     check=True, timeout=1800).stdout
                best[name] = min(best[name], json.loads(out.strip().splitlines()[-1])["prefill"])
        rows.append((label, best["this tree"], best["baseline"]))
    print(f"\nprefill, {torch.get_num_threads()} threads: best of {rounds} alternating rounds x {repeats} runs; "
          f"baseline = {baseline}")
    print(f"{'case':<24}{'this tree ms':>14}{'baseline ms':>13}{'baseline / this':>17}")
    for label, this, base in rows:
        print(f"{label:<24}{this * 1e3:>14.2f}{base * 1e3:>13.2f}{base / this:>16.2f}x")


def hf_engine(folder, dtype, prompt: list[int], new: int, repeats: int) -> tuple[list[tuple[float, float]], float]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    @torch.no_grad()
    def decode_run() -> float:
        res = hf(torch.tensor([prompt]), use_cache=True)
        past, tok, start = res.past_key_values, res.logits[:, -1:].argmax(-1), time.perf_counter()
        for _ in range(new):
            res = hf(tok, past_key_values=past, use_cache=True)
            past, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
        return new / (time.perf_counter() - start)

    long = torch.tensor([(prompt * 64)[:512]])
    prefill = torch.no_grad()(lambda: hf(long))
    return paired_runs(decode_run, repeats), min(_timed(prefill) for _ in range(repeats))


def llama_cpp_engine(gguf, prompt: list[int], new: int, repeats: int) -> tuple[list[tuple[float, float]], float] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, verbose=False, n_threads=torch.get_num_threads())
    decode_run, prefill = llama_cpp_runs(llm, prompt, new)
    return paired_runs(decode_run, repeats), min(_timed(prefill) for _ in range(repeats))


def long_context_prompt(n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(100, vocab, n)]


def best_rate(step, steps: int, repeats: int) -> float:
    """Best tok/s of `repeats` timed runs of `steps` calls of step() (one token each)."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = max(best, steps / (time.perf_counter() - start))
    return best


def kog_long_context(model, context: int, steps: int, repeats: int) -> float:
    """Best tok/s of `repeats` runs of `steps` decode steps after one `context`-token prefill."""
    bs = 16
    n_blocks = (context + steps * repeats) // bs + 2
    runner = ModelRunner(model, num_kv_blocks=n_blocks, block_size=bs)
    table = np.arange(n_blocks, dtype=np.int32)
    slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
    runner.prefill([PrefillChunk(long_context_prompt(context, model.config.vocab_size), 0, table,
                                 slot(np.arange(context)))])
    tok, pos = np.array([1]), [context]

    def step():
        p = pos[0]
        runner.decode(tok, [p], table[None], [p + 1], [slot(p)], sampled=tok)
        pos[0] += 1

    return best_rate(step, steps, repeats)


def llama_cpp_long_context(gguf, vocab: int, context: int, steps: int, repeats: int) -> float | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context + steps * repeats + 16, verbose=False,
                          n_threads=torch.get_num_threads())
    llm.eval(long_context_prompt(context, vocab))
    return best_rate(lambda: llm.eval([1]), steps, repeats)


def f16_gguf(model, folder: str):
    """The same weights as an F16 GGUF (what the llama.cpp comparison runs), with the shipped
    file's tokenizer and chat template."""
    from kog.loader.gguf import GGUFCheckpoint
    from kog.testing.tiny_models import write_gguf_model

    meta = GGUFCheckpoint(model.path).metadata
    tok = {k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.")}
    return write_gguf_model(f"{folder}/smollm2-f16.gguf", model.config, model.weights, qtype="F16",
                            chat_template=meta.get("tokenizer.chat_template"), tokenizer_metadata=tok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-repeats", type=int, default=1)
    ap.add_argument("--contexts", default="1024,4096", help="prompt lengths of the long-context table ('' skips it)")
    ap.add_argument("--context-steps", type=int, default=32)
    ap.add_argument("--baseline", help="a folder holding another build's kog package: adds the prefill table")
    ap.add_argument("--baseline-rounds", type=int, default=3)
    ap.add_argument("--prefill-only", action="store_true", help="with --baseline: only the prefill table")
    ap.add_argument("--prefill-child", help=argparse.SUPPRESS)
    ap.add_argument("--quant-only", action="store_true", help="only the quantized-weights table")
    ap.add_argument("--ttft-only", action="store_true", help="only the short-prompt TTFT table")
    ap.add_argument("--llama-cpp-only", action="store_true",
                    help="only the Kog vs llama.cpp table on Q4_1 / Q8_0 / Q4_K GGUF files")
    args = ap.parse_args()
    if args.prefill_child:
        prefill_child(args.prefill_child, args.repeats)
        return
    if args.prefill_only:
        if not args.baseline:
            ap.error("--prefill-only needs --baseline")
        prefill_vs_baseline(args.baseline, args.baseline_rounds, args.repeats)
        return
    f32 = load_model(dtype=torch.float32)
    prompt = f32.tokenizer.encode("The history of the city begins in the Middle Ages, when a small " * 4)[:32]
    if args.quant_only:
        quant_table(prompt, args.new_tokens, args.repeats)
        return
    if args.ttft_only:
        ttft_table(args.repeats)
        return
    if args.llama_cpp_only:
        vs_llama_cpp_table(prompt, args.new_tokens, args.repeats)
        return
    bw = triad_gbs()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = convert_gguf(f32.path, tmp)
        models = {torch.float32: f32, torch.bfloat16: load_model(dtype=torch.bfloat16)}
        for dtype, model in models.items():
            nbytes = weight_bytes_per_token(model)
            rows.append(("kog", dtype, nbytes, *kog_engine(model, prompt, args.new_tokens, args.repeats)))
            rows.append(("transformers", dtype, nbytes,
                         *hf_engine(folder, dtype, prompt, args.new_tokens, args.hf_repeats)))
        gguf = f16_gguf(f32, tmp)
        lcpp = llama_cpp_engine(gguf, prompt, args.new_tokens, args.repeats)
        long_rows = [(c, kog_long_context(models[torch.bfloat16], c, args.context_steps, args.repeats),
                      llama_cpp_long_context(gguf, f32.config.vocab_size, c, args.context_steps, args.repeats))
                     for c in (int(x) for x in args.contexts.split(",") if x)]
    all_runs = [run for r in rows for run in r[3]] + (lcpp[0] if lcpp else [])
    bw = max([bw, triad_gbs()] + [triad for _, triad in all_runs])  # best of every triad taken
    print(f"SmolLM2-135M, batch 1, {torch.get_num_threads()} threads; triad bandwidth {bw:.1f} GB/s (best of runs)")
    print(f"{'engine':<14}{'dtype':<10}{'decode tok/s':>13}{'x HF':>7}{'prefill 512':>13}{'x HF':>7}{'GB/s':>7}"
          f"{'% triad':>9}{'% adj':>7}")
    best = lambda runs: max(t for t, _ in runs)  # noqa: E731
    adj = lambda runs, nbytes: float(np.median([t * nbytes / 1e9 / bw_ for t, bw_ in runs]))  # noqa: E731
    hf = {r[1]: r for r in rows if r[0] == "transformers"}
    for name, dtype, nbytes, runs, pre in rows:
        tps, gbs = best(runs), best(runs) * nbytes / 1e9
        print(f"{name:<14}{str(dtype).split('.')[-1]:<10}{tps:>13.1f}{tps / best(hf[dtype][3]):>7.2f}"
              f"{pre:>12.2f}s{hf[dtype][4] / pre:>7.2f}{gbs:>7.1f}{100 * gbs / bw:>8.0f}%{100 * adj(runs, nbytes):>6.0f}%")
    if lcpp is None:
        print("llama.cpp: llama-cpp-python not importable, not measured")
    else:
        kog_bf16 = next(r for r in rows if r[0] == "kog" and r[1] == torch.bfloat16)
        f16_bytes = kog_bf16[2]  # F16 weights: the same bytes per token as bf16
        print(f"llama.cpp F16 GGUF: decode {best(lcpp[0]):.1f} tok/s (kog bf16 / llama.cpp = "
              f"{best(kog_bf16[3]) / best(lcpp[0]):.2f}x), {100 * adj(lcpp[0], f16_bytes):.0f}% of adjacent triads; "
              f"prefill 512 {lcpp[1]:.2f}s (llama.cpp / kog bf16 = {lcpp[1] / kog_bf16[4]:.2f}x)")

    if long_rows:
        print(f"\nbf16 decode after a long prompt ({args.context_steps} steps, best of {args.repeats}; "
              f"llama.cpp: F16 GGUF, F16 KV cache)")
        print(f"{'context':>8}{'kog tok/s':>11}{'llama.cpp':>11}{'kog / llama.cpp':>17}")
        for c, kog_tps, lcpp_tps in long_rows:
            lc = "-" if lcpp_tps is None else f"{lcpp_tps:.1f}"
            ratio = "-" if lcpp_tps is None else f"{kog_tps / lcpp_tps:.2f}x"
            print(f"{c:>8}{kog_tps:>11.1f}{lc:>11}{ratio:>17}")

    quant_table(prompt, args.new_tokens, args.repeats)
    ttft_table(args.repeats)
    try:
        vs_llama_cpp_table(prompt, args.new_tokens, args.repeats)
    except ImportError:
        print("llama.cpp: llama-cpp-python not importable, quantized comparison not measured")
    if args.baseline:
        prefill_vs_baseline(args.baseline, args.baseline_rounds, args.repeats)


if __name__ == "__main__":
    main()
