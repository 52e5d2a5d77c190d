"""SamplingParams validation and the sampler's math, distributions and reproducibility."""

import math

import pytest
import torch

import kog
from kog.sampler import SampleRow, apply_penalties, filter_logits, make_generator, sample
from kog.sampling_params import SamplingParams


def row(params, prompt=(), output=(), eos=(), seed=None):
    return SampleRow(params, list(prompt), list(output), list(eos), make_generator(seed))


def draw_counts(logits, params, n, seed=0):
    g = make_generator(seed)
    counts = torch.zeros(logits.shape[0])
    for _ in range(n):
        t = sample(logits[None], [SampleRow(params, [], [], [], g)]).token_ids[0]
        counts[t] += 1
    return counts


def chi_square(counts, probs):
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


# Upper 0.1% points of chi-square with df degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


# ---- validation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(n=0), "n"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed="x"), "seed"),
        (dict(top_k=1.5), "top_k"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(kog.InvalidRequest, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_stop_string_becomes_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


# ---- deterministic paths -------------------------------------------------------------------
def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 4.9]])
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [row(greedy), row(greedy)]).token_ids == [1, 0]


def test_penalties_math():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, row(p, prompt=[0], output=[1, 1, 3]))
    expected = torch.tensor([2.0 / 2, -1.0 * 2 - 0.5 - 0.5, 0.5, 3.0 / 2 - 0.5 - 0.25])
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0]))  # input untouched


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[10.0, 0.0, 9.0, 1.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits, [row(p, output=[3], eos=[0])]).token_ids == [3]
    assert sample(logits, [row(p, output=[3, 3], eos=[0])]).token_ids == [0]


def test_filters_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    finite = lambda p: torch.isfinite(filter_logits(logits, p)).tolist()
    assert finite(SamplingParams(top_k=2)) == [True, True, False, False]
    assert finite(SamplingParams(top_p=0.5)) == [True, False, False, False]
    assert finite(SamplingParams(top_p=0.6)) == [True, True, False, False]
    assert finite(SamplingParams(top_p=0.85)) == [True, True, True, False]
    assert finite(SamplingParams(min_p=0.35)) == [True, True, False, False]
    assert finite(SamplingParams(top_k=-1, top_p=1.0)) == [True] * 4


def test_extreme_temperature_and_top_p_never_make_nan():
    """A tiny temperature samples greedily and a top_p that underflows float32 keeps the best
    token: either would otherwise put a NaN into the step of every request in the batch."""
    logits = torch.tensor([[0.1, 3.0, 0.2, -1.0]])
    for p in (SamplingParams(temperature=1e-300), SamplingParams(top_p=5e-324), SamplingParams(top_p=1e-40)):
        assert sample(logits, [row(p)]).token_ids == [1]
    assert torch.isfinite(filter_logits(logits[0], SamplingParams(top_p=5e-324))).tolist() == [False, True, False, False]


def test_logprobs_are_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    p = SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5)
    res = sample(logits, [row(p, prompt=[2])])
    lp = torch.log_softmax(logits[0], -1)
    assert res.token_ids == [1]  # 3.0 / 1.5 = 2.0 ties 2.0; argmax takes the first
    assert math.isclose(res.logprobs[0], float(lp[1]), rel_tol=1e-6)
    assert [t for t, _ in res.top_logprobs[0]] == [2, 1]
    assert math.isclose(res.top_logprobs[0][0][1], float(lp[2]), rel_tol=1e-6)


# ---- distributions and seeds ---------------------------------------------------------------
LOGITS = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_sampling_follows_softmax_over_temperature(temperature):
    counts = draw_counts(LOGITS, SamplingParams(temperature=temperature), 6000)
    stat, df = chi_square(counts, torch.softmax(LOGITS / temperature, -1))
    assert stat < CHI2_999[df], stat


def test_top_k_and_top_p_renormalize_the_kept_tokens():
    p = SamplingParams(temperature=1.0, top_k=3)
    kept = torch.softmax(filter_logits(LOGITS, p), -1)
    assert (kept > 0).sum() == 3
    stat, df = chi_square(draw_counts(LOGITS, p, 4000), kept)
    assert stat < CHI2_999[df], stat
    p = SamplingParams(temperature=1.0, top_p=0.8)
    kept = torch.softmax(filter_logits(LOGITS, p), -1)
    stat, df = chi_square(draw_counts(LOGITS, p, 4000), kept)
    assert stat < CHI2_999[df], stat


def test_seed_reproducible_and_independent_of_batch_neighbours():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=42)

    def run(neighbour_seed):
        rows = [row(p, seed=42), row(SamplingParams(seed=neighbour_seed), seed=neighbour_seed), row(p, seed=42)]
        return [sample(logits, rows).token_ids for _ in range(5)]

    a, b = run(1), run(2)
    assert [t[0] for t in a] == [t[0] for t in b]  # row 0 ignores what row 1 draws
    seeds = {tuple(t[0] for t in run(s)) for s in range(3)}
    assert len(seeds) == 1
    assert len({tuple(sample(logits, [row(p, seed=s)] * 3).token_ids) for s in range(8)}) > 1


# ---- large vocabularies: top-p candidates, inverse-CDF draws, one thread ------------------
def full_sort_top_p(logits, top_p):
    """The definition: drop a token when the mass of the tokens before it reaches top_p."""
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    drop = (torch.cumsum(sorted_probs, 0) - sorted_probs) >= top_p
    drop[0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))


@pytest.mark.parametrize("scale, top_p", [(4.0, 0.9), (4.0, 0.5), (0.3, 0.95), (0.01, 0.999), (8.0, 1e-9)])
def test_top_p_over_a_large_vocabulary_equals_the_full_sort(scale, top_p):
    # scale 0.3/0.01: flat distributions whose cut lies beyond the first 1024 candidates.
    g = torch.Generator().manual_seed(int(scale * 100) + int(top_p * 1000))
    logits = torch.randn(50_000, generator=g) * scale
    got = filter_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
    want = full_sort_top_p(logits, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(want)])


def test_draws_from_a_large_vocabulary_follow_the_distribution_and_skip_zeros():
    vocab = 40_000
    logits = torch.full((vocab,), float("-inf"))
    hot = torch.tensor([7, 1234, 20_000, 39_999])
    logits[hot] = torch.tensor([0.0, 1.0, 2.0, 0.5])
    counts = draw_counts(logits, SamplingParams(temperature=1.0), 2000, seed=3)
    stat, df = chi_square(counts, torch.softmax(logits, -1))
    assert stat < CHI2_999[df]


def test_sampling_runs_on_one_thread_and_restores_the_setting():
    from kog import sampler

    before = torch.get_num_threads()
    seen = []
    real = sampler.filter_logits
    try:
        sampler.filter_logits = lambda x, p: (seen.append(torch.get_num_threads()), real(x, p))[1]
        sample(torch.randn(2, 100), [row(SamplingParams(temperature=1.0), seed=1)] * 2)
        with pytest.raises(ValueError):
            sample(torch.randn(3, 100), [row(SamplingParams(temperature=1.0))])
    finally:
        sampler.filter_logits = real
    assert seen == [1, 1]
    assert torch.get_num_threads() == before
