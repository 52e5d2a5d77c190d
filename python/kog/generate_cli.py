"""`kog generate`: stream one completion to the terminal, then report TTFT and tok/s."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="run dtype")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda (a GPU build of kog)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="a system message (chat mode)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def run(args: argparse.Namespace, llm=None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    from kog.errors import KogError
    from kog.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop)
        if llm is None:
            from kog.llm import LLM

            t0 = time.perf_counter()
            llm = LLM(args.model, args.dtype, max_num_seqs=1, device=args.device)
            print(f"[kog] loaded {llm.model.path.name} ({llm.model.dtype}) in {time.perf_counter() - t0:.1f}s",
                  file=err)
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
    print(f"[kog] {n_tokens} tokens ({finish}) · TTFT {ttft * 1e3:.0f} ms · {decode_rate:.1f} tok/s", file=err)
    return 0
