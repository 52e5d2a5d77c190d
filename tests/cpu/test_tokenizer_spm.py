"""SentencePiece GGUF vocabularies (Llama 2, Mistral): ids against llama.cpp's algorithm written
plainly, against transformers' GGUF tokenizer, and streamed back to text."""

from __future__ import annotations

import pytest

from kog.loader import load_model, tokenizer_from_gguf
from kog.loader.convert import convert_gguf
from kog.loader.spm import SPACE
from kog.testing.tiny_models import TRICKY_STRINGS, tiny_config, tiny_spm_metadata, write_gguf_model

WITH_SPECIALS = ["[INST] hi [/INST] ok", "<s>[INST]What?[/INST]</s>", "a[INST]b", "[/INST]  two spaces"]


def reference_spm(text: str, md: dict) -> list[int]:
    """llama.cpp: split out control tokens; before the first text and after every control token
    put one space; spaces become '▁'; merge the adjacent pair whose concatenation is the
    best-scored piece (leftmost on ties); characters outside the vocabulary become byte tokens."""
    tokens, scores, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    controls = sorted((t for t, k in zip(tokens, types) if k in (2, 3)), key=len, reverse=True)
    ids = [md["tokenizer.ggml.bos_token_id"]]
    prev_special, rest = True, text
    while rest:
        starts = [(rest.find(c), -len(c), c) for c in controls if c in rest]
        at, _, control = min(starts) if starts else (len(rest), 0, None)
        if at > 0:
            ids += _spm_piece((" " if prev_special else "") + rest[:at], vocab, scores, types)
            prev_special = False
        if control is None:
            break
        ids.append(vocab[control])
        prev_special, rest = True, rest[at + len(control):]
    return ids


def _spm_piece(text: str, vocab: dict, scores: list, types: list) -> list[int]:
    symbols = list(text.replace(" ", SPACE))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            j = vocab.get(symbols[i] + symbols[i + 1])
            if j is not None and types[j] == 1 and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for s in symbols:
        out += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


@pytest.fixture(scope="module")
def spm():
    return tokenizer_from_gguf(tiny_spm_metadata(), source="spm")


@pytest.mark.parametrize("text", TRICKY_STRINGS + WITH_SPECIALS + ["Привет мир"])
def test_ids_match_llama_cpp_algorithm(spm, text):
    assert spm.encode(text) == reference_spm(text, tiny_spm_metadata())


def test_byte_fallback_and_decode(spm):
    ids = spm.encode("Привет 😀", add_special_tokens=False)
    assert spm.id_to_token(ids[1]) == "<0xD0>"  # Cyrillic is not in the tiny vocabulary
    for text in TRICKY_STRINGS:
        assert spm.decode(spm.encode(text), skip_special_tokens=True) == text


@pytest.mark.parametrize("text", ["Hello wörld, 東京 😀!", "  two  spaces\nnew line", "Привет [INST] hi"])
def test_streaming(spm, text):
    ids = spm.encode(text)
    stream = spm.detokenizer(skip_special_tokens=True)
    deltas = [stream.step(i) for i in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + stream.flush() == spm.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(3))
def test_streaming_runs_equal_steps(spm, seed):
    import random

    from test_tokenizer import assert_runs_detokenize_like_steps

    for text in ["Hello wörld, 東京 😀!", "  two  spaces\nnew line", "Привет [INST] hi", *TRICKY_STRINGS]:
        assert_runs_detokenize_like_steps(spm, spm.encode(text), seed, skip_special_tokens=True)
    rng = random.Random(seed)
    assert_runs_detokenize_like_steps(spm, [rng.randrange(spm.vocab_size) for _ in range(300)], seed)


def test_gguf_load_and_transformers_agree(tmp_path):
    """transformers' own GGUF conversion agrees wherever its space convention is llama.cpp's
    (it puts no extra '▁' before text that starts with a space or follows a control token)."""
    transformers = pytest.importorskip("transformers")
    md = tiny_spm_metadata()
    config = tiny_config("llama", vocab_size=len(md["tokenizer.ggml.tokens"]))
    path = write_gguf_model(tmp_path / "spm.gguf", config, tokenizer_metadata=md)
    model = load_model(path)
    assert (model.tokenizer.bos_token, model.tokenizer.eos_token, model.tokenizer.add_bos_token) == ("<s>", "</s>", True)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    compared = [t for t in TRICKY_STRINGS if t and not t[0].isspace()]
    assert len(compared) >= 15
    for text in compared:
        assert model.tokenizer.encode(text) == hf(text)["input_ids"], text
    # The converted folder carries Kog's pipeline, and transformers follows it everywhere.
    converted = transformers.AutoTokenizer.from_pretrained(convert_gguf(path, tmp_path / "hf", progress=False))
    for text in TRICKY_STRINGS + WITH_SPECIALS:
        assert model.tokenizer.encode(text) == converted(text)["input_ids"], text
