"""Draft verification: greedy exactness, and rejection sampling preserving the target distribution."""

import pytest
import torch

import kog
from kog.speculation.verify import rejection_sample, target_probs, verify_greedy

# Upper 0.1% points of chi-square with df degrees of freedom.
CHI2_999 = {3: 16.27, 15: 37.70}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    assert counts[probs == 0].sum() == 0, "emitted a token of target probability 0"
    keep = probs > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# ---- greedy -----------------------------------------------------------------------------------
@pytest.mark.parametrize("agree", [0, 1, 3, 5])
def test_greedy_accepts_the_prefix_that_matches_the_argmax(gen, agree):
    k, vocab = 5, 50
    logits = torch.randn(k + 1, vocab, generator=gen)
    best = logits.argmax(-1).tolist()
    draft = best[:agree] + [(t + 1) % vocab for t in best[agree:k]]
    v = verify_greedy(logits, draft)
    assert v.num_accepted == agree
    assert v.tokens == best[:agree + 1]  # accepted drafts, then the target's own token (bonus if all)


def test_greedy_with_empty_draft_is_plain_greedy(gen):
    logits = torch.randn(1, 30, generator=gen)
    assert verify_greedy(logits, []).tokens == [int(logits[0].argmax())]


def test_shapes_are_checked(gen):
    with pytest.raises(kog.InvalidRequest, match=r"\[k \+ 1, V\]"):
        verify_greedy(torch.randn(3, 10), [1])
    with pytest.raises(kog.InvalidRequest, match="draft tokens"):
        rejection_sample(torch.full((2, 10), 0.1), [10])
    with pytest.raises(kog.InvalidRequest, match="draft_probs"):
        rejection_sample(torch.full((2, 10), 0.1), [1], torch.full((2, 10), 0.1))


# ---- rejection sampling -----------------------------------------------------------------------
VOCAB = 4


def markov(seed: int) -> torch.Tensor:
    """[V, V] transition table: row prev -> distribution of the next token (some zeros)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(VOCAB, VOCAB, generator=g) ** 2
    t[torch.arange(VOCAB), (torch.arange(VOCAB) + seed) % VOCAB] = 0.0
    return t / t.sum(-1, keepdim=True)


P, Q = markov(1), markov(2)


def generate_two(k: int, g: torch.Generator, deterministic: bool) -> tuple[int, int]:
    """First two tokens after token 0 with speculative rounds: draft from Q, verify against P."""
    out: list[int] = []
    while len(out) < 2:
        last = out[-1] if out else 0
        draft, qs = [], []
        for _ in range(k):
            q = Q[draft[-1] if draft else last]
            draft.append(int(q.argmax()) if deterministic else int(torch.multinomial(q, 1, generator=g)))
            qs.append(q)
        p = torch.stack([P[t] for t in [last] + draft])  # [k + 1, V]: the target after each prefix
        out += rejection_sample(p, draft, None if deterministic else torch.stack(qs), g).tokens
    return out[0], out[1]


@pytest.mark.parametrize("k, deterministic", [(1, False), (3, False), (2, True)])
def test_rejection_sampling_preserves_the_target_distribution(k, deterministic):
    g = torch.Generator().manual_seed(7 + k)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(6000):
        a, b = generate_two(k, g, deterministic)
        counts[a, b] += 1
    expected = P[0][:, None] * P  # p(y0) p(y1 | y0)
    assert chi_square(counts.flatten(), expected.flatten()) < CHI2_999[15]


def test_identical_draft_and_target_accept_everything(gen):
    p = torch.softmax(torch.randn(4, 20, generator=gen), -1)
    for _ in range(50):
        draft = [int(torch.multinomial(p[i], 1, generator=gen)) for i in range(3)]
        assert rejection_sample(p, draft, p[:3], gen).num_accepted == 3


def test_a_draft_token_of_target_probability_zero_is_always_rejected(gen):
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    for _ in range(50):
        v = rejection_sample(p, [0], None, gen)
        assert v.num_accepted == 0 and v.tokens[0] in (1, 2)


def test_same_seed_same_result():
    p = torch.softmax(torch.randn(5, 40), -1)
    q = torch.softmax(torch.randn(4, 40), -1)
    draft = [3, 9, 27, 1]
    runs = [rejection_sample(p, draft, q, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_target_probs_applies_the_sampling_params_and_masks(gen):
    logits = torch.randn(3, 10, generator=gen)
    allowed = torch.ones(3, 10, dtype=torch.bool)
    allowed[1, :5] = False
    probs = target_probs(logits, kog.SamplingParams(temperature=0.5, top_k=3), allowed)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert (probs > 0).sum(-1).tolist() == [3, 3, 3]
    assert probs[1, :5].sum() == 0
    assert torch.allclose(probs[0], torch.softmax(logits[0] / 0.5 + torch.where(
        logits[0] >= logits[0].topk(3).values[-1], 0.0, float("-inf")), -1))
