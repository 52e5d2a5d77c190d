"""Tokenizers built from GGUF metadata: ids against an independent BPE and against transformers;
incremental detokenization."""

from __future__ import annotations

import functools
import unicodedata

import pytest
import regex

from kog.errors import ModelLoadError
from kog.loader import GGUFCheckpoint, IncrementalDetokenizer, Tokenizer, resolve_model, tokenizer_from_gguf
from kog.testing.tiny_models import TRICKY_STRINGS, tiny_tokenizer_metadata

TRICKY = TRICKY_STRINGS


@pytest.fixture(scope="module")
def smollm2_gguf():
    try:
        return GGUFCheckpoint(resolve_model(None))
    except ModelLoadError as e:  # neither installed nor downloadable (offline)
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf) -> Tokenizer:
    return tokenizer_from_gguf(smollm2_gguf.metadata)


# ---------------------------------------------------------------------- an independent reference BPE


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3 and Qwen2: case-insensitive contractions, one optional non-letter glued to a word,
# numbers in runs of at most 3 (Llama 3) or single digits (Qwen2), newlines kept with punctuation.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


def _words(text: str, pre: str) -> list[str]:
    """Pre-tokenization as llama.cpp describes each `tokenizer.ggml.pre`."""
    if pre == "smollm":  # each digit alone, then GPT-2's split
        return [w for piece in regex.split(r"(\p{N})", text) for w in regex.findall(_GPT2, piece)]
    if pre == "qwen2":
        return regex.findall(_QWEN2, unicodedata.normalize("NFC", text))
    return regex.findall({"gpt-2": _GPT2, "llama-bpe": _LLAMA3}[pre], text)


@functools.lru_cache(maxsize=8)
def _tables(merges: tuple[str, ...]) -> dict[tuple[str, str], int]:
    return {tuple(m.split(" ")): r for r, m in enumerate(merges)}


def reference_encode(text: str, metadata: dict) -> list[int]:
    """llama.cpp's BPE, written plainly: split out control tokens, pre-tokenize, map bytes to
    GPT-2's printable characters, merge the lowest-ranked pair first (Llama 3 first looks the
    whole word up), prepend BOS when the vocabulary asks for it."""
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    pre = metadata["tokenizer.ggml.pre"]
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = _tables(tuple(metadata["tokenizer.ggml.merges"]))
    specials = [t for t, k in zip(tokens, types) if k == 3]
    byte_map = _byte_to_unicode()
    ids: list[int] = [metadata["tokenizer.ggml.bos_token_id"]] if metadata.get("tokenizer.ggml.add_bos_token") else []
    pattern = "(" + "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    for chunk in regex.split(pattern, text):
        if chunk in specials:
            ids.append(vocab[chunk])
            continue
        for word in _words(chunk, pre):
            symbols = [byte_map[b] for b in word.encode("utf-8")]
            if pre == "llama-bpe" and "".join(symbols) in vocab:
                ids.append(vocab["".join(symbols)])
                continue
            while len(symbols) > 1:
                rank, i = min((ranks.get(pair, 1 << 30), i) for i, pair in enumerate(zip(symbols, symbols[1:])))
                if rank == 1 << 30:
                    break
                symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
            ids += [vocab[s] for s in symbols]
    return ids


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("text", TRICKY)
def test_smollm2_ids_match_reference_bpe(smollm2_gguf, smollm2_tokenizer, text):
    assert smollm2_tokenizer.encode(text) == reference_encode(text, smollm2_gguf.metadata)


def test_smollm2_ids_match_transformers(smollm2_tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    smollm2_tokenizer.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TRICKY:
        assert smollm2_tokenizer.encode(text) == hf(text)["input_ids"], text
        ids = smollm2_tokenizer.encode(text)
        assert smollm2_tokenizer.decode(ids) == hf.decode(ids) == text
    assert (hf.bos_token, hf.eos_token) == (smollm2_tokenizer.bos_token, smollm2_tokenizer.eos_token)


def test_smollm2_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", 1, "<|im_end|>", 2)
    assert tok.encode("<|im_start|>assistant<|im_end|>") == [1, *tok.encode("assistant"), 2]
    assert tok.decode([1, 2], skip_special_tokens=True) == ""
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS


@pytest.mark.parametrize("pre", ["smollm", "gpt-2", "llama-bpe", "qwen2"])
def test_tiny_tokenizer_matches_reference(pre):
    md = dict(tiny_tokenizer_metadata(), **{"tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": pre == "llama-bpe"})
    tok = tokenizer_from_gguf(md)
    assert len(md["tokenizer.ggml.merges"]) > 100  # the trained vocabulary really merges
    for text in TRICKY + ["Ünïcödé ＡＢＣ e\u0301 1234567 x\r\n\r\ny", "   \n\n   \t"]:
        assert tok.encode(text) == reference_encode(text, md), text


def test_add_bos_token_prepends_bos():
    md = dict(tiny_tokenizer_metadata(), **{"tokenizer.ggml.add_bos_token": True})
    tok = tokenizer_from_gguf(md)
    assert tok.encode("hi")[0] == tok.bos_token_id == 1
    assert tok.encode("hi", add_special_tokens=False) == tok.encode("hi")[1:]


@pytest.mark.parametrize("key,value,match", [
    ("tokenizer.ggml.model", "t5", "tokenizer model 't5'"),
    ("tokenizer.ggml.pre", "no-such-pre", "pre-tokenizer 'no-such-pre'"),
])
def test_unsupported_tokenizer_raises(key, value, match):
    with pytest.raises(ModelLoadError, match=match):
        tokenizer_from_gguf(dict(tiny_tokenizer_metadata(), **{key: value}), source="x.gguf")


# ---------------------------------------------------------------------- incremental detokenization

STREAMED = ["a😀中文 b🚀🚀x", "👨‍👩‍👧‍👦 family", "東京 → 北京 ✓", "tabs\tand\n\nnewlines  ", "I'm ok; café 1234"]


@pytest.mark.parametrize("text", STREAMED)
def test_detokenizer_emits_whole_characters(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    stream = IncrementalDetokenizer(tok)
    deltas = [stream.step(i) for i in ids]
    assert "".join(deltas) + stream.flush() == text
    assert not any("\ufffd" in d for d in deltas)


def assert_runs_detokenize_like_steps(tok, ids, seed, skip_special_tokens=False):
    """steps() over random runs of ids gives, after each run, a prefix of what step() gave
    after the same tokens (all of it when the run ends on a whole character), and the same
    text in the end."""
    import random

    rng = random.Random(seed)
    one, runs = tok.detokenizer(skip_special_tokens), tok.detokenizer(skip_special_tokens)
    want = got = ""
    i = 0
    while i < len(ids):
        n = rng.randint(1, 16)
        run = ids[i : i + n]
        want += "".join(one.step(t) for t in run)
        got += runs.steps(run)
        assert want.startswith(got), (i, want, got)
        i += n
    assert got + runs.flush() == want + one.flush()


@pytest.mark.parametrize("seed", range(4))
def test_detokenizer_runs_equal_steps(smollm2_tokenizer, seed):
    import random

    tok = smollm2_tokenizer
    for text in STREAMED + TRICKY:
        assert_runs_detokenize_like_steps(tok, tok.encode(text), seed)
    rng = random.Random(seed)  # any ids: bytes that never complete a character, specials
    assert_runs_detokenize_like_steps(tok, [rng.randrange(tok.vocab_size) for _ in range(300)], seed)
    assert_runs_detokenize_like_steps(tok, [rng.randrange(tok.vocab_size) for _ in range(300)], seed, True)


def test_detokenizer_holds_back_split_characters(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("😀")
    assert len(ids) > 1  # an emoji is several byte-level tokens in this vocabulary
    stream = tok.detokenizer()
    assert [stream.step(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_detokenizer_flush_and_specials(smollm2_tokenizer):
    tok = smollm2_tokenizer
    emoji = tok.encode("🚀")
    stream = tok.detokenizer()
    assert stream.step(emoji[0]) == ""
    assert stream.flush() == "\ufffd"  # an unfinished character comes out as U+FFFD at the end
    skip = tok.detokenizer(skip_special_tokens=True)
    assert "".join(skip.step(i) for i in tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
