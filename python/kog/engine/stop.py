"""Stop conditions: stop tokens, EOS, length, and stop strings over the streamed text."""

from __future__ import annotations

from kog.engine.outputs import FinishReason
from kog.engine.sequence import Sequence


def check_stop_token(seq: Sequence, token: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
    """Sets seq.finish_reason after `token` was appended to seq.output_ids, if generation ends."""
    p = seq.params
    n_out = seq.num_output_tokens
    if n_out >= p.min_tokens:
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
            return
        if not p.ignore_eos and token in eos_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
            return
    if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= max_model_len:
        seq.finish_reason = FinishReason.LENGTH


def apply_stop_strings(seq: Sequence, delta: str) -> None:
    """Appends `delta` to seq.text and ends the sequence at the first stop string, cutting it
    (and everything after it) from the text unless include_stop_str_in_output."""
    p = seq.params
    old_len = len(seq.text)
    seq.text += delta
    if not p.stop or seq.num_text_emitted > len(seq.text):
        return
    longest = max(len(s) for s in p.stop)
    start = max(0, old_len - longest + 1)  # a match may straddle the old text's end
    best: tuple[int, str] | None = None
    for s in p.stop:
        i = seq.text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is not None:
        i, s = best
        seq.text = seq.text[: i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
        seq.finish_reason, seq.stop_reason = FinishReason.STOP, s


def streamable_text(seq: Sequence) -> str:
    """Text safe to stream now: all of it once finished; otherwise held back by the length of
    the longest stop string minus one, which could still turn into a stop string."""
    if seq.finish_reason is not None or not seq.params.stop:
        end = len(seq.text)
    else:
        end = max(seq.num_text_emitted, len(seq.text) - (max(len(s) for s in seq.params.stop) - 1))
    out = seq.text[seq.num_text_emitted : end]
    seq.num_text_emitted = end
    return out
