"""Decode after a long prompt with a float32 KV cache and with a float16 / bfloat16 one.

    PYTHONPATH=python python bench/kv_cache_dtype.py [--contexts 32,2048,8000] [--new-tokens 64]

The default model (SmolLM2-135M-Instruct Q4_1: float32 activations, so its KV cache is float32
unless kv_cache_dtype says otherwise) decodes --new-tokens greedy tokens after a prompt of each
context length, at batch 1, under kv_cache_dtype float32, float16 (what "auto" gives this model:
kog.llm.default_kv_cache_dtype) and bfloat16, the three
engines alternating run by run in one process. The prompt's KV comes from the prefix cache (a
one-token run first, its time subtracted), so the figure is decode only. Printed per context:
best tok/s of each, the ratio to float32, the KV bytes one decode step reads at that context,
and how many of the greedy tokens equal float32's (the narrow cache rounds K and V once).
"""

from __future__ import annotations

import argparse
import time

import kog

KINDS = ("float32", "float16", "bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="32,2048,8000")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    new = args.new_tokens
    llms = {k: kog.LLM(None, max_num_seqs=1, max_model_len=max(contexts) + new + 16, kv_cache_dtype=k) for k in KINDS}
    cfg = llms["float32"].model.config
    per_token = {k: cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim *
                 llms[k].engine.runner.kv.kv.element_size() for k in KINDS}
    print(f"SmolLM2-135M Q4_1, batch 1, {new} tokens after the prompt, best of {args.repeats} alternating; "
          f"KV per token: f32 {per_token['float32'] // 1024} KB, f16/bf16 {per_token['float16'] // 1024} KB")
    print(f"{'context':>8}{'f32 tok/s':>11}{'f16 tok/s':>11}{'bf16 tok/s':>12}{'f16/f32':>9}{'bf16/f32':>10}"
          f"{'KV MB/step f32':>16}{'same tokens f16/bf16':>22}")
    one = kog.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = kog.SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True)
    for ctx in contexts:
        prompt = {"prompt_token_ids": [(7 * i) % 40000 + 100 for i in range(ctx)]}
        for llm in llms.values():
            llm.generate(prompt, one)  # the prompt's KV into the prefix cache
        best, tokens = dict.fromkeys(KINDS, 0.0), {}
        for _ in range(args.repeats):
            for k, llm in llms.items():
                t = time.perf_counter()
                llm.generate(prompt, one)
                t1 = time.perf_counter() - t
                t = time.perf_counter()
                out = llm.generate(prompt, many)
                best[k] = max(best[k], new / (time.perf_counter() - t - t1))
                tokens[k] = out[0].outputs[0].token_ids
        same = {k: next((i for i, (a, b) in enumerate(zip(tokens[k], tokens["float32"])) if a != b), len(tokens[k]))
                for k in KINDS}
        print(f"{ctx:>8}{best['float32']:>11.1f}{best['float16']:>11.1f}{best['bfloat16']:>12.1f}"
              f"{best['float16'] / best['float32']:>8.2f}x{best['bfloat16'] / best['float32']:>9.2f}x"
              f"{ctx * per_token['float32'] / 1e6:>16.1f}{same['float16']:>11} / {same['bfloat16']:<9}")
    print("same tokens: leading greedy tokens equal to the float32 cache's (of the new tokens + 1).")


if __name__ == "__main__":
    main()
