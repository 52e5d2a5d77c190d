"""`kog generate [MODEL] PROMPT`: stream one completion to the terminal, then report TTFT and tok/s."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`kog generate`'s flags: the model comes positionally (as `kog serve MODEL`) or with --model."""
    from kog.serve_cli import DTYPES, add_chat_arguments

    p.add_argument("model", nargs="?", default=None,
                   help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="the model, as a flag (default: the positional MODEL)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="run dtype; auto: bfloat16 for bf16 checkpoints, else float32 (half is float16)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU build of kog)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="KV cache dtype; auto: float16 for a GGUF's kept quantized blocks on the CPU (llama.cpp's "
                        "default), else the run dtype. A float32 run may keep a bfloat16 / float16 cache (CPU): half "
                        "the KV memory and bytes read per step")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N ranks (processes on this host; CPU)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: round the linear matrices to FP8 e4m3 with per-channel scales at load "
                        "(default: none, 'as stored')")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="a system message (chat mode; default: none)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0: all")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the likeliest")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable; default: none)")
    add_chat_arguments(p)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The model given both ways is an error (exits with status 2)."""
    if args.model is not None and args.model_option is not None:
        parser.error(f"the model is given twice: {args.model!r} and --model {args.model_option!r}")


def run(args: argparse.Namespace, llm=None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    from kog.errors import KogError
    from kog.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop)
        if llm is None:
            from kog.llm import LLM

            t0 = time.perf_counter()
            model = args.model if args.model is not None else args.model_option
            llm = LLM(model, None if args.dtype == "auto" else args.dtype, max_num_seqs=1, device=args.device,
                      quantization=args.quantization,
                      chat_template=args.chat_template,
                      allow_special_tokens_in_content=args.allow_special_tokens_in_content,
                      tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype)
            print(f"[kog] loaded {llm.model.path.name} ({_weights_kind(llm)}{_kv_note(llm)}) "
                  f"in {time.perf_counter() - t0:.1f}s", file=err)
        if args.raw or llm.chat_template is None:
            prompt = args.prompt
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            prompt = {"prompt_token_ids": llm.encode_chat(messages)}
        start = time.perf_counter()
        first = end = None
        n_tokens = 0
        finish = None
        for delta in llm.stream(prompt, params):
            now = time.perf_counter()
            first = first or now
            end = now
            n_tokens += len(delta.token_ids)
            finish = delta.finish_reason or finish
            out.write(delta.text)
            out.flush()
    except KogError as e:
        print(f"kog generate: {e}", file=err)
        return 1
    out.write("\n")
    ttft = (first - start) if first else float("nan")
    decode_rate = (n_tokens - 1) / (end - first) if first and end and end > first else float("nan")
    print(f"[kog] {n_tokens} tokens ({finish}) · TTFT {ttft * 1e3:.0f} ms · {decode_rate:.1f} tok/s"
          f"{_weights_note(llm)}", file=err)
    return 0


def _kv_note(llm) -> str:
    """', float16 KV cache' when the cache's dtype is not the activations' (kv_cache_dtype)."""
    runner = getattr(llm.engine, "runner", None)
    kv_dtype = getattr(runner, "kv_dtype", None)
    if kv_dtype is None or kv_dtype == llm.model.dtype:
        return ""
    return f", {str(kv_dtype).removeprefix('torch.')} KV cache"


def _weights_kind(llm) -> str:
    """'torch.float32' for float weights; for a model whose quantized matrices are kept, their
    types by bytes, largest first, and the float dtype its activations run in:
    'Q4_1 + Q8_0 blocks, torch.float32 activations' (GGUF blocks on the CPU; on a GPU the decode
    kernel's forms: 'Q4_GROUPS', 'Q4_K', 'FP8 e4m3fn')."""
    from kog.fp8 import Fp8Weight
    from kog.int4 import Int4Weight
    from kog.quantized import QuantizedWeight

    # NOTE: the runner owns the weights once built (LoadedModel.weights is emptied).
    runner = getattr(llm.engine, "runner", None)
    weights = runner.weights if runner is not None else llm.model.weights
    by_type: dict[str, int] = {}
    for w in weights.values():
        name = (w.file_type_name if isinstance(w, QuantizedWeight) else w.type_name if isinstance(w, Int4Weight)
                else f"FP8 {w.fmt}" if isinstance(w, Fp8Weight) else None)
        if name is not None:
            by_type[name] = by_type.get(name, 0) + w.nbytes
    if not by_type:
        return str(llm.model.dtype)
    types = " + ".join(sorted(by_type, key=lambda t: -by_type[t]))
    return f"{types} blocks, {llm.model.dtype} activations"


def _weights_note(llm) -> str:
    """' · weights: N MB resident (file M MB)' where the engine's runner reports its weights."""
    resident = getattr(getattr(llm.engine, "runner", None), "weight_bytes", None)
    if resident is None:
        return ""
    file_bytes = llm.model.file_weight_bytes
    return f" · weights: {resident / 1e6:.0f} MB resident" + (f" (file {file_bytes / 1e6:.0f} MB)" if file_bytes else "")
