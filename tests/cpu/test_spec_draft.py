"""The draft-model drafter on a tiny random model, and whole speculative greedy loops (n-gram and
draft model) checked token for token against plain greedy decoding."""

import numpy as np
import pytest
import torch

import kog
from kog.loader import load_model
from kog.models import ModelRunner, PrefillChunk
from kog.speculation.draft_model import DraftModelDrafter
from kog.structured_output.grammar import build_constraint
from kog.speculation.ngram import NgramDrafter
from kog.structured_output.params import StructuredOutputParams
from kog.speculation.verify import verify_greedy
from kog.testing.greedy import runner_greedy
from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

BS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = tiny_config("llama")
    return load_model(write_hf_model(tmp_path_factory.mktemp("tiny"), config, random_weights(config, seed=3)))


def runner(model, blocks=64):
    return ModelRunner(model, num_kv_blocks=blocks, block_size=BS)


def prompt(model, n=20, seed=0):
    return np.random.default_rng(seed).integers(3, model.config.vocab_size, n).tolist()


def speculative_greedy(target: ModelRunner, propose, prompt_ids: list[int], n_new: int, k: int):
    """Greedy decoding by draft-and-verify; the target's cache holds one sequence at blocks 0.."""
    table = np.arange(target.max_model_len // BS, dtype=np.int32)

    def chunk(tokens, start):
        pos = np.arange(start, start + len(tokens))
        return PrefillChunk(tokens, start, table, table[pos // BS].astype(np.int64) * BS + pos % BS)

    out = [int(target.prefill([chunk(prompt_ids, 0)])[0].argmax())]
    accepted = 0
    while len(out) < n_new:
        ids = prompt_ids + out
        draft = propose(ids, min(k, n_new - len(out)))
        # The newest token's K/V is not cached yet: it leads the verification chunk.
        logits = target.verify([chunk([ids[-1]] + draft, len(ids) - 1)])[0]  # [len(draft) + 1, V]
        v = verify_greedy(logits, draft)
        out += v.tokens
        accepted += v.num_accepted
    return out[:n_new], accepted


def test_greedy_draft_is_the_draft_models_greedy_continuation(tiny):
    p = prompt(tiny)
    drafter = DraftModelDrafter(runner(tiny), max_seqs=2)
    d = drafter.propose(0, p, 6)
    assert d.probs is None
    assert d.tokens == runner_greedy(runner(tiny), p, 6)


def test_proposals_reuse_the_cache_only_where_tokens_agree(tiny):
    p = prompt(tiny, seed=1)
    drafter = DraftModelDrafter(runner(tiny), max_seqs=2)
    first = drafter.propose(5, p, 4).tokens
    # The target kept two draft tokens, then corrected the third: the rest of the slab is stale.
    ids = p + first[:2] + [(first[2] + 1) % tiny.config.vocab_size]
    again = drafter.propose(5, ids, 4).tokens
    assert again == DraftModelDrafter(runner(tiny), max_seqs=1).propose(0, ids, 4).tokens
    # A second sequence in the other slab does not disturb the first.
    drafter.propose(6, prompt(tiny, seed=2), 4)
    assert drafter.propose(5, ids, 4).tokens == again


def test_sampled_drafts_carry_their_distributions_and_follow_the_seed(tiny):
    p = prompt(tiny, seed=4)
    d = DraftModelDrafter(runner(tiny), 1).propose(0, p, 5, temperature=0.8, generator=torch.Generator().manual_seed(9))
    assert d.probs.shape == (5, tiny.config.vocab_size)
    assert torch.allclose(d.probs.sum(-1), torch.ones(5))
    assert all(float(d.probs[i, t]) > 0 for i, t in enumerate(d.tokens))
    again = DraftModelDrafter(runner(tiny), 1).propose(0, p, 5, temperature=0.8,
                                                       generator=torch.Generator().manual_seed(9))
    assert again.tokens == d.tokens and torch.equal(again.probs, d.probs)


def test_drafts_obey_a_grammar_and_leave_its_state_alone(tiny):
    c = build_constraint(tiny.tokenizer, StructuredOutputParams(regex=r"[a-z ]{1,12}!"))
    c.advance_many(tiny.tokenizer.encode("ab"))
    before = c.num_tokens
    d = DraftModelDrafter(runner(tiny), 1).propose(0, prompt(tiny), 8, temperature=1.0,
                                                   generator=torch.Generator().manual_seed(0), constraint=c)
    assert len(d.tokens) >= 1 and c.num_allowed(d.tokens) == len(d.tokens)
    assert c.num_tokens == before
    text = "ab" + tiny.tokenizer.decode(d.tokens)
    assert all(ch in "abcdefghijklmnopqrstuvwxyz !" for ch in text), text


def test_slabs_are_limited_and_released(tiny):
    drafter = DraftModelDrafter(runner(tiny, blocks=32), max_seqs=2)
    drafter.propose(1, [5, 6], 2)
    drafter.propose(2, [5, 6], 2)
    with pytest.raises(kog.InvalidOperation, match="no free draft slab"):
        drafter.propose(3, [5, 6], 2)
    drafter.release(1)
    assert len(drafter.propose(3, [5, 6], 2).tokens) == 2
    with pytest.raises(kog.InvalidOperation):
        drafter.release(1)
    # Near the slab's capacity the draft shrinks instead of overflowing.
    assert len(drafter.propose(3, [5] * (drafter.capacity - 2), 4).tokens) == 2


def test_speculative_greedy_with_the_draft_model_equals_plain_greedy(tiny):
    p = prompt(tiny, seed=5)
    drafter = DraftModelDrafter(runner(tiny), max_seqs=1)
    out, accepted = speculative_greedy(runner(tiny), lambda ids, k: drafter.propose(0, ids, k).tokens, p, 24, k=4)
    assert out == runner_greedy(runner(tiny), p, 24)
    assert accepted >= 12  # the same weights draft: nearly everything is accepted


def test_speculative_greedy_with_ngram_drafts_equals_plain_greedy(tiny):
    p = prompt(tiny, n=12, seed=6) * 3  # repetitive context: lookups find continuations
    ngram = NgramDrafter(3, 1)
    out, _ = speculative_greedy(runner(tiny), ngram.propose, p, 24, k=5)
    assert out == runner_greedy(runner(tiny), p, 24)
