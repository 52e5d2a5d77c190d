"""What an engine over the fake model (kog.testing.fake_runner) must generate, computed without
any KV cache: the same sampler applied to context_logits of the true token sequence."""

from __future__ import annotations

from kog.engine import EngineConfig, LLMEngine
from kog.engine.decode_loop import NativeSampler, is_native
from kog.engine.sequence import Sequence
from kog.loader.tokenizer import Tokenizer
from kog.sampler import SampleRow, make_generator, sample
from kog.sampling_params import SamplingParams
from kog.testing.fake_runner import FakeRunner, context_logits


def oracle_tokens(context: list[int], params: SamplingParams, vocab_size: int, eos: int,
                  index: int = 0) -> list[int]:
    """Token ids a stateless request with prompt `context` must produce (completion `index`).

    Args:
        context: the whole prompt.
        params: its sampling params (seeded or greedy, so the result is a function of them).
        vocab_size: the fake model's logits width.
        eos: the end-of-sequence id.
        index: which of the n completions (its generator is seeded with seed + index).
    Returns:
        the generated ids, ending where stop tokens or max_tokens end the request.
    """
    ids, out = list(context), []
    gen = make_generator(None if params.seed is None else params.seed + index)
    native = NativeSampler(vocab_size, [eos], 1 << 40) if is_native(params) else None
    seq = Sequence(0, "oracle", index, list(context), params, None)
    while True:
        logits = context_logits(ids, vocab_size)[None]
        if native is not None:  # the engine samples such requests natively (kog.engine.decode_loop)
            t = native.sample([seq], logits)[0]
        else:
            t = sample(logits, [SampleRow(params, context, out, [eos], gen)]).token_ids[0]
        out.append(t)
        ids.append(t)
        seq.append_token(t)
        if (t == eos and not params.ignore_eos and len(out) >= params.min_tokens) or len(out) >= params.max_tokens:
            return out


def fake_engine(tokenizer: Tokenizer, num_blocks: int = 64, block_size: int = 4, budget: int = 16,
                max_num_seqs: int = 8, max_model_len: int = 256, host_blocks: int = 0,
                prefix_caching: bool = True) -> tuple[LLMEngine, FakeRunner]:
    """An LLMEngine over a FakeRunner with a small KV pool (all sizes in blocks / tokens)."""
    runner = FakeRunner(tokenizer.vocab_size, num_blocks, block_size, host_blocks)
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_host_blocks=host_blocks,
                       enable_prefix_caching=prefix_caching)
    return LLMEngine(runner, tokenizer, [tokenizer.eos_token_id], max_model_len, cfg), runner


def run_until_done(engine: LLMEngine, request_ids: list[str], max_steps: int = 5000) -> None:
    """Steps the engine until every listed request is finished (asserting progress)."""
    for _ in range(max_steps):
        if all(engine.get_output(r).finished for r in request_ids):
            return
        engine.step()
    raise AssertionError("engine made no progress")
