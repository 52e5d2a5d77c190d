"""Does the native multi-token decode loop remove the per-token host work? Engine decode tok/s
at batch 1 with one decode step per engine step (K = 1: logits to Python, native sampler)
against the loop (K up to 16 steps per native call), measured in the same run.

    PYTHONPATH=python python bench/decode_loop.py [--new-tokens 128] [--repeats 3]

Models: a tiny random llama (hidden 64, 2 layers: the native step costs almost nothing, so
this is the host overhead) and SmolLM2-135M (f32 and bf16, the default checkpoint of
kog.loader.load_model, skipped when it cannot be loaded). Greedy, a 32-token prompt, time from
the first token to the last (prefill excluded), best of N repeats. Also printed: the share of
the loop's decode time spent outside native calls (host).
"""

from __future__ import annotations

import argparse
import time

import torch

from kog.engine import EngineConfig, LLMEngine
from kog.loader import LoadedModel, load_model
from kog.models import ModelRunner
from kog.sampling_params import SamplingParams
from kog.testing.tiny_models import random_weights, tiny_config, tiny_tokenizer


def decode_tok_s(model: LoadedModel, prompt: list[int], new_tokens: int, max_steps: int, repeats: int) -> tuple[float, float]:
    """(best tok/s after the first token, native share of that run's time)."""
    best, share = 0.0, 0.0
    for _ in range(repeats):
        runner = ModelRunner(model, num_kv_blocks=(len(prompt) + new_tokens) // 16 + 4, block_size=16)
        engine = LLMEngine(runner, model.tokenizer, [], len(prompt) + new_tokens + 1, EngineConfig(max_num_seqs=1))
        engine.decode_loop.max_steps = max_steps
        native = [0.0]
        for obj, name in ((engine.decode_loop, "run"), (runner, "decode")):
            inner = getattr(obj, name)

            def timed(*a, _inner=inner, **k):
                t = time.perf_counter()
                try:
                    return _inner(*a, **k)
                finally:
                    native[0] += time.perf_counter() - t

            setattr(obj, name, timed)
        engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
        while not engine.get_output("r").outputs or not engine.get_output("r").outputs[0].token_ids:
            engine.step()
        native[0] = 0.0
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        dt = time.perf_counter() - t
        n = len(engine.get_output("r").outputs[0].token_ids) - 1
        if n / dt > best:
            best, share = n / dt, native[0] / dt
    return best, share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = tiny_config("llama", max_position_embeddings=4096)
    models = {"tiny random f32": LoadedModel(path=None, config=cfg, weights=random_weights(cfg, seed=0),
                                             dtype=torch.float32, tokenizer=tiny_tokenizer(), chat_template=None,
                                             stop_token_ids=())}
    try:
        models["SmolLM2-135M f32"] = load_model(dtype=torch.float32)
        models["SmolLM2-135M bf16"] = load_model(dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - the bench still reports the tiny model
        print(f"SmolLM2-135M not loaded: {e}")
    print(f"batch 1, greedy, 32-token prompt, {args.new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"best of {args.repeats}")
    print(f"{'model':<20} {'K=1 tok/s':>10} {'loop tok/s':>11} {'ratio':>7} {'K=1 native %':>13} {'loop native %':>14}")
    for name, model in models.items():
        prompt = (list(range(3, 35)) if model.path is None
                  else model.tokenizer.encode("The history of the city begins in the Middle Ages, " * 8)[:32])
        one, one_share = decode_tok_s(model, prompt, args.new_tokens, 1, args.repeats)
        loop, loop_share = decode_tok_s(model, prompt, args.new_tokens, 16, args.repeats)
        print(f"{name:<20} {one:>10.1f} {loop:>11.1f} {loop / one:>6.2f}x {100 * one_share:>12.0f}% {100 * loop_share:>13.0f}%")


if __name__ == "__main__":
    main()
