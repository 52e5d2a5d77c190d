"""Tokenizers: HF `tokenizers` from a `tokenizer.json`, or built from GGUF metadata; streaming
detokenization.

A GGUF file carries its vocabulary as `tokenizer.ggml.*` arrays; `tokenizer_from_gguf` turns the
byte-level BPE ones (model "gpt2": SmolLM2, Llama 3, Qwen2/3) into the same `tokenizers` object
that the model's own `tokenizer.json` describes, so ids match HF's.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from kog.errors import ModelLoadError
from kog.valid_text import check_text

# llama.cpp token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes, by the `tokenizer.ggml.pre` names llama.cpp gives them (the split
# regexes are public: kog.loader.gguf_write recognises them in a tokenizer.json).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt-2", "gpt2", "mpt", "olmo")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_LLAMA3_PRE = ("llama-bpe", "llama3", "smaug-bpe")
_QWEN2_PRE = ("qwen2", "stablelm2", "deepseek-r1-qwen")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens a chat engine needs.

    `encode(text)` adds what the tokenizer's post-processor adds (BOS for Llama 3, nothing for
    SmolLM2); encode rendered chat prompts with add_special_tokens=False, their template
    already writes BOS.
    """

    def __init__(self, hf: HFTokenizer, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None, add_bos_token: bool = False):
        self.hf = hf
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.add_bos_token = add_bos_token
        self.bos_token_id = self._id(bos_token)
        self.eos_token_id = self._id(eos_token)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; the text of a special token (`<|im_end|>`) becomes that token.

        Raises:
            InvalidRequest: text with a lone surrogate (it has no UTF-8 form).
        """
        return self._encode(self.hf, text, add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` read as plain text: `<|im_end|>` in it is the characters, never the
        control token (untrusted message content). Adds no BOS/EOS."""
        return self._encode(self._plain_hf, text, False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """encode(text, add_special_tokens=False) plus each token's [start, end) character span."""
        enc = self._encode(self.hf, text, False)
        return enc.ids, enc.offsets

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the control tokens (added tokens marked special: `<|im_start|>`, `<s>`, ...)."""
        return frozenset(i for i, t in self.hf.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def special_token_pattern(self) -> re.Pattern[str] | None:
        """Matches the text of any control token (longest first); None when there are none."""
        texts = sorted({t.content for t in self.hf.get_added_tokens_decoder().values() if t.special}, key=len,
                       reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    @cached_property
    def prefix_stable_decode(self) -> bool:
        """Whether decode(a + b) extends decode(a) whenever decode(a) ends on a whole character:
        true of the byte-level decoder (the tokens' bytes joined, then UTF-8 with U+FFFD for
        invalid bytes); not of SentencePiece's byte fallback, which makes a run of byte tokens
        that is not valid UTF-8 one U+FFFD per token (<0x3B> is ";", <0x3B><0xBE> two U+FFFD)."""
        return isinstance(self.hf.decoder, decoders.ByteLevel)

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Loads `tokenizer.json` and the special tokens of `tokenizer_config.json` from an HF folder."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot load tokenizer: {e}") from None
        cfg = read_tokenizer_config(folder)
        return cls(hf, bos_token=_content(cfg.get("bos_token")), eos_token=_content(cfg.get("eos_token")),
                   pad_token=_content(cfg.get("pad_token")), unk_token=_content(cfg.get("unk_token")),
                   add_bos_token=bool(cfg.get("add_bos_token", False)))

    def save(self, folder: str | Path, chat_template: str | None = None, model_max_length: int | None = None) -> None:
        """Writes `tokenizer.json` and a `tokenizer_config.json` transformers' AutoTokenizer reads."""
        folder = Path(folder)
        self.hf.save(str(folder / "tokenizer.json"))
        added = {str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip, "normalized": t.normalized,
                          "single_word": t.single_word, "special": t.special}
                 for i, t in sorted(self.hf.get_added_tokens_decoder().items())}
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "pad_token": self.pad_token, "unk_token": self.unk_token,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added,
        }
        if model_max_length:
            cfg["model_max_length"] = model_max_length
        if chat_template is not None:
            cfg["chat_template"] = chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    @cached_property
    def _plain_hf(self) -> HFTokenizer:
        # NOTE: a copy, not a toggle of self.hf.encode_special_tokens: the flag belongs to the
        # tokenizer object, which several threads encode with (server routes, grammar compiles).
        plain = HFTokenizer.from_str(self.hf.to_str())
        plain.encode_special_tokens = True
        return plain

    @staticmethod
    def _encode(hf: HFTokenizer, text: str, add_special_tokens: bool):
        try:
            return hf.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            check_text(text, "text")  # the tokenizer's TypeError for a lone surrogate, made an InvalidRequest
            raise


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas that are always whole characters.

    A byte-level token may hold half of a UTF-8 character (an emoji spans up to 4 tokens); the
    delta is held back until the character completes. Only a window of recent ids is decoded:
    `prefix` ids before `read` give the context that keeps decoding stable (leading spaces).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were already emitted; decoded again as context
        self.read = 0  # ids[read:] are not emitted yet

    def step(self, token_id: int) -> str:
        """Adds one token id; returns the text it completes ("" while a character is incomplete)."""
        self.ids.append(int(token_id))
        return self._emit()

    def steps(self, token_ids: list[int]) -> str:
        """Adds several token ids; returns the text they complete: the concatenation of step()'s
        returns for each, or less while a character is incomplete at their end (held back, as
        step() would hold back its last token's part). Two decodes, whatever the count, where
        the tokenizer's decoding is prefix-stable (Tokenizer.prefix_stable_decode: the text is
        then exactly step()'s, since the window starts where step()'s would and every earlier
        emission ended on a whole character); else one step() per id.
        """
        if len(token_ids) == 1 or not getattr(self.tokenizer, "prefix_stable_decode", False):
            return "".join(self.step(t) for t in token_ids)
        self.ids.extend(token_ids)
        return self._emit()

    def flush(self) -> str:
        """Returns whatever is still held back (invalid bytes come out as U+FFFD)."""
        seen = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(seen):]

    def _emit(self) -> str:
        """The text of ids[read:] once it ends on a whole character (then read moves to the end,
        prefix to the old read); "" while it does not."""
        seen = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        # NOTE: U+FFFD at the end means the last token ends inside a UTF-8 character.
        if len(text) > len(seen) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(seen):]
        return ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


def read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """`tokenizer_config.json` as a dict ({} when absent), with `chat_template.jinja` folded in."""
    path = folder / "tokenizer_config.json"
    cfg: dict[str, Any] = {}
    if path.exists():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read: {e}") from None
    jinja = folder / "chat_template.jinja"  # where transformers >= 4.50 saves the template
    if "chat_template" not in cfg and jinja.exists():
        cfg["chat_template"] = jinja.read_text()
    return cfg


def tokenizer_from_gguf(metadata: dict[str, Any], source: str = "GGUF") -> Tokenizer:
    """Builds the tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes.

    Raises:
        ModelLoadError: a tokenizer model or pre-tokenizer Kog cannot reproduce exactly.
    """
    model = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if model == "gpt2":
        hf = _byte_level_bpe(metadata, source)
    elif model == "llama":
        from kog.loader.spm import sentencepiece_bpe

        hf = sentencepiece_bpe(metadata)
    else:
        raise ModelLoadError(f"{source}: tokenizer model {model!r} is not supported "
                             "(byte-level BPE 'gpt2' and SentencePiece 'llama' are)")
    # Control tokens (<|im_start|>, <s>) are matched whole before normalization, as in HF.
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in zip(tokens, types) if k in (_CONTROL, _UNKNOWN)])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, k in zip(tokens, types) if k == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    # llama.cpp's default: SentencePiece vocabularies start with BOS unless told otherwise.
    bos, add_bos = token("bos"), bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama"))
    if add_bos and bos is not None:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tokens.index(bos))])
    elif model == "gpt2":
        hf.post_processor = processors.ByteLevel(trim_offsets=False)
    return Tokenizer(hf, bos_token=bos, eos_token=token("eos"), pad_token=token("padding"),
                     unk_token=token("unknown"), add_bos_token=add_bos)


# ---------------------------------------------------------------------- internal helpers


def _byte_level_bpe(metadata: dict[str, Any], source: str) -> HFTokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    pre = metadata.get("tokenizer.ggml.pre", "default")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=pre in _LLAMA3_PRE, fuse_unk=False, byte_fallback=False)
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = _pre_tokenizer(pre, source)
    if pre in _QWEN2_PRE:
        hf.normalizer = normalizers.NFC()
    hf.decoder = decoders.ByteLevel()
    return hf


def _pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in _GPT2_PRE + _DIGITS_THEN_GPT2_PRE)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {**dict.fromkeys(_LLAMA3_PRE, LLAMA3_SPLIT), **dict.fromkeys(_QWEN2_PRE, QWEN2_SPLIT)}.get(pre)
    if split is None:
        raise ModelLoadError(f"{source}: pre-tokenizer {pre!r} is not supported")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False), byte_level])


def _content(token: Any) -> str | None:
    """Special tokens in tokenizer_config.json are a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token
