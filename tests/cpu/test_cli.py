"""The `kog` command line: every subcommand's --help shows every option's default, and
`kog generate` takes the model positionally (like `kog serve`) or with --model."""

from __future__ import annotations

import argparse
import io
import re

import pytest

from kog.cli import build_parser, main, parse


def subcommands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def option_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's (and optional positional's) entry in the parser's --help text, by its first name."""
    text = parser.format_help()
    entries = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.default is argparse.SUPPRESS:
            continue
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            continue  # a required positional has no default
        name = action.option_strings[0] if action.option_strings else action.dest
        # the entry runs from its name at the start of a line to the next entry
        m = re.search(rf"^  {re.escape(name)}\b.*?(?=^  \S|\Z)", text, re.M | re.S)
        assert m, f"{name} missing from --help"
        entries[name] = " ".join(m.group().split())
    return entries


def test_every_subcommand_is_checked():
    assert set(subcommands()) == {"info", "convert", "generate", "serve"}


@pytest.mark.parametrize("command", ["info", "convert", "generate", "serve"])
def test_help_states_every_default(command):
    entries = option_help(subcommands()[command])
    assert entries
    missing = [name for name, entry in entries.items() if "default" not in entry]
    assert not missing, f"kog {command} --help gives no default for {missing}"


def test_help_shows_the_values_of_defaults():
    serve = option_help(subcommands()["serve"])
    assert "(default: 8000)" in serve["--port"] and "(default: 16)" in serve["--max-num-seqs"]
    assert "(default: off)" in serve["--trust-remote-code"] and "(default: auto)" in serve["--dtype"]
    assert "(default: 128)" in option_help(subcommands()["generate"])["--max-tokens"]


def test_the_api_key_default_never_prints_the_key(monkeypatch):
    monkeypatch.setenv("KOG_API_KEY", "s3cret-key")
    assert "s3cret-key" not in option_help(subcommands()["serve"])["--api-key"]


@pytest.mark.parametrize("argv, model", [
    (["generate", "hi there"], None),
    (["generate", "m.gguf", "hi there"], "m.gguf"),
    (["generate", "--model", "m.gguf", "hi there"], None),
    (["generate", "hi there", "--max-tokens", "3"], None),
    (["generate", "m.gguf", "--max-tokens", "3", "hi there"], "m.gguf"),
])
def test_generate_takes_the_model_positionally_or_as_a_flag(argv, model):
    args = parse(build_parser(), argv)
    assert args.prompt == "hi there" and args.model == model
    assert (args.model_option == "m.gguf") is ("--model" in argv)


def test_generate_refuses_two_models(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "a.gguf", "b.gguf", "hi"])
    assert e.value.code == 2 and "the model is given twice" in capsys.readouterr().err


def test_generate_loads_the_positional_model(tmp_path):
    from kog.generate_cli import run
    from kog.testing.server_process import tiny_gguf

    model = str(tiny_gguf(tmp_path))
    for argv in (["generate", model, "hello", "--max-tokens", "3", "--dtype", "half"],
                 ["generate", model, "--dtype", "half", "--max-tokens", "3", "hello"],
                 ["generate", "--model", model, "hello", "--max-tokens", "3"]):
        err = io.StringIO()
        assert run(parse(build_parser(), argv), out=io.StringIO(), err=err) == 0
        assert "[kog] loaded tiny.gguf" in err.getvalue() and "3 tokens" in err.getvalue()
        assert ("(torch.float16)" in err.getvalue()) is ("half" in argv)


def test_generate_names_the_quant_type_of_kept_blocks(tmp_path):
    """A GGUF whose blocks stay resident is reported by its quant type, not as float32 weights;
    an explicit dtype dequantizes it, and the line says so."""
    from kog.generate_cli import run
    from kog.testing.tiny_models import tiny_config, write_gguf_model

    model = str(write_gguf_model(tmp_path / "q8.gguf", tiny_config("llama"), qtype="Q8_0"))
    lines = {}
    for dtype in ("auto", "float32"):
        err = io.StringIO()
        assert run(parse(build_parser(), ["generate", model, "hi", "--max-tokens", "2", "--dtype", dtype]),
                   out=io.StringIO(), err=err) == 0
        lines[dtype] = next(line for line in err.getvalue().splitlines() if line.startswith("[kog] loaded"))
    assert "(Q8_0 blocks, torch.float32 activations, float16 KV cache)" in lines["auto"], lines
    assert "(torch.float32)" in lines["float32"] and "Q8_0" not in lines["float32"], lines


def test_generate_keeps_a_narrow_kv_cache_and_says_so(tmp_path):
    """--kv-cache-dtype reaches the runner, and the loaded line names a cache narrower than the
    activations; a combination no kernel reads is a one-line error."""
    from kog.generate_cli import run
    from kog.testing.tiny_models import tiny_config, write_gguf_model

    model = str(write_gguf_model(tmp_path / "q8.gguf", tiny_config("llama"), qtype="Q8_0"))
    # auto: float16 for a GGUF's kept blocks (llama.cpp's default cache); float32 keeps the run dtype
    for kv, note in (("auto", ", float16 KV cache)"), ("float32", None), ("float16", ", float16 KV cache)"),
                     ("bfloat16", ", bfloat16 KV cache)")):
        err = io.StringIO()
        argv = ["generate", model, "hi", "--max-tokens", "2", "--kv-cache-dtype", kv]
        assert run(parse(build_parser(), argv), out=io.StringIO(), err=err) == 0
        line = next(line for line in err.getvalue().splitlines() if line.startswith("[kog] loaded"))
        assert (note in line) if note else "KV cache" not in line, line
    err = io.StringIO()
    argv = ["generate", model, "hi", "--dtype", "bfloat16", "--kv-cache-dtype", "float16"]
    assert run(parse(build_parser(), argv), out=io.StringIO(), err=err) == 1
    assert "only as float16 or bfloat16 under float32" in err.getvalue()


def test_generate_names_the_gpu_forms_of_kept_weights():
    """On a GPU a kept model's matrices are the decode kernel's 4-bit and FP8 forms: the summary
    names those, largest first."""
    from types import SimpleNamespace

    import torch

    from kog import _C
    from kog.fp8 import quantize
    from kog.generate_cli import _weights_kind
    from kog.int4 import Int4Weight

    w4 = Int4Weight(torch.zeros(64, 128, dtype=torch.uint8), torch.zeros(64, 32, dtype=torch.uint8),
                    _C.WEIGHT_Q4_GROUPS, 256)
    llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(weights={
        "a": w4, "b": quantize(torch.randn(4, 32), "e4m3fn"), "norm": torch.ones(8, dtype=torch.bfloat16)})),
        model=SimpleNamespace(dtype=torch.bfloat16))
    assert _weights_kind(llm) == "Q4_GROUPS + FP8 e4m3fn blocks, torch.bfloat16 activations"
