"""SentencePiece vocabularies from GGUF (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral).

llama.cpp tokenizes them by repeatedly merging the adjacent pair whose concatenation is the
vocabulary piece with the highest score, falling back to `<0xXX>` byte tokens for characters
outside the vocabulary. A `tokenizers` BPE does the same when its merges are every split of
every piece, ranked by the piece's score, and `byte_fallback` is on.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

_NORMAL = 1
SPACE = "\u2581"  # "▁", SentencePiece's visible space


def sentencepiece_bpe(metadata: dict[str, Any]) -> HFTokenizer:
    """The `tokenizers` equivalent of a GGUF SentencePiece vocabulary (special tokens not yet added)."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores: list[float] = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = metadata.get("tokenizer.ggml.unknown_token_id")

    bpe = models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, types, vocab),
                     unk_token=tokens[unk] if unk is not None else None, byte_fallback=True, fuse_unk=True)
    hf = HFTokenizer(bpe)
    # NOTE: llama.cpp puts one space before the text and again after every special token; HF's
    # Prepend normalizer does the same, as it runs on each piece of text between added tokens.
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", SPACE)
    hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    hf.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return hf


def _merges_by_score(tokens: list[str], scores: list[float], types: list[int],
                     vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of every normal piece into two pieces, best-scored result first."""
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = vocab.get(piece[:k]), vocab.get(piece[k:])
            if left is not None and right is not None and types[left] == types[right] == _NORMAL:
                ranked.append((-scores[i], i, k, piece[:k], piece[k:]))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
