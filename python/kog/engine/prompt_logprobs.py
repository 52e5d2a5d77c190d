"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's log-probability given
the tokens before it, from the logits of every row of the prompt's prefill chunks.

Row j of a chunk that starts at position `start` is the distribution of the token at position
start + j + 1, so a chunk yields the logprobs of the prompt tokens start + 1 .. start + n. The
first prompt token has none (None, as in vLLM and OpenAI's echo). Logprobs are those of the
model's raw distribution (log_softmax of the unprocessed logits), as the sampler reports.
"""

from __future__ import annotations

import torch

from kog.engine.sequence import Sequence


def record(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    """Stores the prompt logprobs a prefill chunk of seq computed.

    Args:
        seq: a sequence whose request asked for prompt logprobs.
        start: the chunk's first position.
        logits: [n, vocab] logits of every row of the chunk.

    NOTE: positions are recorded in order and once: a chunk recomputed after a preemption
    (its KV freed) finds them recorded already and adds nothing.
    """
    if not seq.prompt_logprobs_pending:
        return
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)
    first = len(seq.prompt_logprobs)  # the next position to record
    last = min(start + logits.shape[0], len(seq.prompt_ids) - 1)  # the chunk's last predicted prompt position
    if first > last:
        return
    if first - 1 < start:  # the scheduler bypasses the prefix cache while they are pending
        raise RuntimeError(f"prompt logprobs: position {first} was never computed (chunk starts at {start})")
    rows = logits[first - 1 - start : last - start].float()  # [m, vocab]: row i predicts position first + i
    lp = torch.log_softmax(rows, dim=-1)
    actual = torch.tensor(seq.prompt_ids[first : last + 1], dtype=torch.long)  # [m]
    actual_lp = lp.gather(1, actual[:, None])[:, 0].tolist()
    k = seq.params.prompt_logprobs
    top_lp, top_ids = torch.topk(lp, k, dim=-1)  # [m, k]
    for token, token_lp, ids, vals in zip(actual.tolist(), actual_lp, top_ids.tolist(), top_lp.tolist()):
        entry = {token: token_lp}
        entry.update((t, v) for t, v in zip(ids, vals) if t != token)
        seq.prompt_logprobs.append(entry)
