"""Verifying a draft against the target model's distributions at the k + 1 positions.

One target forward over [last token, d_1 .. d_k] (`ModelRunner.verify`) gives k + 1 rows:
row i is the target's distribution for the token after d_i (row 0: after the last token). Both
verifiers return the tokens to append: the accepted draft prefix, then one token from the target
(the correction at the first rejection, or the bonus token after d_k), so every step makes at
least one token of progress.

Exactness:
- greedy: the output is token-for-token what greedy decoding of the target gives.
- rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept d_i with probability
  min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from norm(max(0, p_i - q_i)); after
  all k, draw the bonus from p_k. Each emitted token is distributed exactly as p.
  A deterministic drafter (n-gram lookup, greedy draft model) has one-hot q.
With a grammar, mask the target rows with `Constraint.draft_masks(draft)` before computing p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kog.errors import InvalidRequest
from kog.sampler import draw, filter_logits, single_threaded
from kog.sampling_params import SamplingParams


@dataclass
class Verified:
    """Outcome of one verification."""

    tokens: list[int]  # accepted draft tokens then one target token: 1 .. k + 1 tokens
    num_accepted: int  # draft tokens accepted (len(tokens) - 1)


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> Verified:
    """Accepts the longest draft prefix equal to the target's argmax, plus the target's next token.

    Args:
        target_logits: [k + 1, V] target logits (already masked by a grammar, if any).
        draft: k draft token ids.

    Returns:
        Verified: tokens == what greedy decoding of the target emits in the next k + 1 steps
        as far as the draft agrees, then the target's own argmax.
    """
    _check(target_logits, draft)
    best = target_logits.argmax(dim=-1).tolist()  # [k + 1]
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return Verified(list(draft[:n]) + [best[n]], n)


@single_threaded
def rejection_sample(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> Verified:
    """Speculative sampling: the emitted tokens are distributed exactly as the target's p.

    Args:
        target_probs: [k + 1, V] target probabilities (after temperature/top-k/top-p and any
            grammar mask: see `target_probs`).
        draft: k draft token ids.
        draft_probs: [k, V] the distributions the draft tokens were drawn from; None for a
            deterministic drafter (q one-hot at each draft token).
        generator: the request's generator (reproducible given the same draft).

    Returns:
        Verified with the accepted prefix and the correction or bonus token.
    """
    _check(target_probs, draft)
    k = len(draft)
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise InvalidRequest(f"draft_probs must be [{k}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}")
    u = torch.rand(k, generator=generator).tolist()
    for i, x in enumerate(draft):
        p = target_probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if q_x > 0 and u[i] * q_x < float(p[x]):  # u < p(x) / q(x), without dividing by q
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0  # max(0, p - onehot(x))
        else:
            residual = torch.clamp(p - draft_probs[i], min=0.0)
        # NOTE: the residual is all zero only when p == q up to rounding; then p itself is exact.
        dist = residual if float(residual.sum()) > 0 else p
        token = draw(dist, generator)
        return Verified(list(draft[:i]) + [token], i)
    bonus = draw(target_probs[k], generator)
    return Verified(list(draft) + [bonus], k)


@single_threaded
def target_probs(logits: torch.Tensor, params: SamplingParams, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[k + 1, V] target logits -> the probabilities the sampler would draw from at each row.

    Args:
        logits: [k + 1, V] raw target logits.
        params: the request's temperature / top-k / top-p / min-p (temperature > 0).
        allowed: optional bool [k + 1, V] grammar masks (`Constraint.draft_masks`).
    """
    x = logits.float()
    if allowed is not None:
        x = x.masked_fill(~allowed.to(x.device), float("-inf"))
    return torch.stack([torch.softmax(filter_logits(row, params), dim=-1) for row in x])


def _check(target: torch.Tensor, draft: list[int]) -> None:
    if target.dim() != 2 or target.shape[0] != len(draft) + 1:
        raise InvalidRequest(f"target rows must be [k + 1, V] = [{len(draft) + 1}, V], got {tuple(target.shape)}")
    if any(not 0 <= t < target.shape[1] for t in draft):
        raise InvalidRequest(f"draft tokens must be in [0, {target.shape[1]}), got {draft}")
