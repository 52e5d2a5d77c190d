"""Logprobs in OpenAI's two formats, from the engine's per-token {token id: logprob} dicts.

The engine puts the sampled token first, then the top-k alternatives (the sampled one not
repeated), so sorting an entry by logprob and taking k gives the top k whether or not the
sampled token is among them.
"""

from __future__ import annotations

from functools import lru_cache

from kog.loader.tokenizer import Tokenizer
from kog.server.responses import ChatLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as text, special tokens included."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_bytes(tokenizer: Tokenizer, token_id: int, text: str) -> list[int]:
    """The token's own bytes. NOTE: a token holding part of a UTF-8 character decodes to U+FFFD,
    so its bytes come from the vocabulary piece: GPT-2 byte-level characters or SentencePiece
    `<0xNN>` byte tokens (clients rejoin these bytes into the character)."""
    if "\ufffd" not in text:
        return list(text.encode())
    piece = tokenizer.id_to_token(token_id) or ""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return [int(piece[3:5], 16)]
    decoder = _byte_level_decoder()
    if piece and all(ch in decoder for ch in piece):
        return [decoder[ch] for ch in piece]
    return list(text.encode())


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], entries: list[dict[int, float]],
                  k: int) -> ChatLogprobs:
    """Chat format: content = [{token, logprob, bytes, top_logprobs: [...]}] per token."""
    content = []
    for tid, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tid)
        tops = [TopLogprob(token=(t := token_text(tokenizer, i)), logprob=lp, bytes=token_bytes(tokenizer, i, t))
                for i, lp in _top(entry, k)]
        content.append(TokenLogprob(token=text, logprob=entry[tid], bytes=token_bytes(tokenizer, tid, text),
                                    top_logprobs=tops))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], entries: list[dict[int, float] | None], k: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    """Completions format: parallel lists tokens / token_logprobs / top_logprobs / text_offset.

    Args:
        entries: per token; None (an echoed prompt's first token) gives a null logprob and top.
        text_offset: characters of the choice's text before the first of these tokens.
    """
    out = CompletionLogprobs()
    offset = text_offset
    for tid, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tid)
        out.tokens.append(text)
        out.token_logprobs.append(None if entry is None else entry[tid])
        top: dict[str, float] = {}
        for i, lp in _top(entry or {}, k):  # NOTE: tokens with the same text keep the best logprob
            top.setdefault(token_text(tokenizer, i), lp)
        out.top_logprobs.append(top if k > 0 and entry is not None else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def prompt_logprobs(tokenizer: Tokenizer, token_ids: list[int], entries: list[dict[int, float] | None],
                    k: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, decoded_token}} of the
    prompt's token and the top k (the engine may hold more); None for the first token."""
    out: list[dict[str, PromptLogprob] | None] = []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        chosen = {tid: entry[tid]}  # the prompt's token first, as vLLM
        chosen.update(_top(entry, k))
        out.append({str(i): PromptLogprob(logprob=lp, decoded_token=token_text(tokenizer, i))
                    for i, lp in chosen.items()})
    return out
