"""Chat templates that ignore `tools`: detected, rendered through Kog's Hermes tool template for
ChatML models (logged once), replaced by --chat-template / kog.LLM(chat_template=...); the
shipped template writes calls the Hermes parser reads back, and it ships in the wheel."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import kog
from kog.errors import ModelLoadError
from kog.loader import ChatTemplate, load_model
from kog.loader.chat_encoding import encode_conversation
from kog.loader.chat_template import HERMES_TOOLS_TEMPLATE, hermes_tool_template, read_chat_template
from kog.loader.tokenizer import tokenizer_from_gguf
from kog.server.tool_parsers import parse_tool_calls
from kog.testing.tiny_models import (CHATML_TEMPLATE, tiny_config, tiny_spm_metadata, write_gguf_model,
                                     write_hf_model)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
READS_TOOLS = ("{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}" + CHATML_TEMPLATE)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf_model(tmp_path_factory.mktemp("m") / "tiny.gguf", tiny_config("llama"))


def test_ignores_tools_compares_renders_with_and_without_a_probe_tool():
    assert ChatTemplate(CHATML_TEMPLATE).ignores_tools()
    assert not ChatTemplate(READS_TOOLS).ignores_tools()
    assert not hermes_tool_template().ignores_tools()
    assert not ChatTemplate("{{ raise_exception('no') }}").ignores_tools()  # a refused probe proves nothing


def test_a_template_that_ignores_tools_renders_them_with_its_tool_template(caplog):
    template = ChatTemplate(CHATML_TEMPLATE, tool_template=hermes_tool_template())
    with caplog.at_level(logging.WARNING, logger="kog"):
        with_tools = template.render(MSGS, TOOLS, add_generation_prompt=True)
        template.render(MSGS, TOOLS, add_generation_prompt=True)
    assert with_tools == hermes_tool_template().render(MSGS, TOOLS, add_generation_prompt=True)
    assert '"name": "get_weather"' in with_tools and "<tool_call>" in with_tools
    assert template.render(MSGS, add_generation_prompt=True) == ChatTemplate(CHATML_TEMPLATE).render(MSGS, None, True)
    [record] = [r for r in caplog.records if "ignores `tools`" in r.getMessage()]  # logged once
    assert "Kog's tool template" in record.getMessage()


def test_without_a_tool_template_the_render_is_unchanged_and_a_warning_says_why(caplog):
    template = ChatTemplate(CHATML_TEMPLATE)
    with caplog.at_level(logging.WARNING, logger="kog"):
        assert template.render(MSGS, TOOLS) == template.render(MSGS)
    assert any("--chat-template" in r.getMessage() for r in caplog.records)


def test_a_template_that_reads_tools_is_used_as_is():
    template = ChatTemplate(READS_TOOLS, tool_template=hermes_tool_template())
    assert template.render(MSGS, TOOLS) == ChatTemplate(READS_TOOLS).render(MSGS, TOOLS)


def test_chatml_models_get_the_tool_template_and_others_do_not(tiny_gguf, tmp_path):
    chatml = load_model(tiny_gguf, progress=False).chat_template
    assert chatml.tool_template is not None and chatml.render(MSGS, TOOLS) != chatml.render(MSGS)
    spm = tiny_config("llama", vocab_size=len(tiny_spm_metadata()["tokenizer.ggml.tokens"]))
    folder = write_hf_model(tmp_path / "spm", spm, tokenizer=tokenizer_from_gguf(tiny_spm_metadata()),
                            chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    assert load_model(folder, progress=False).chat_template.tool_template is None


def test_shipped_template_writes_calls_the_hermes_parser_reads_back():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
             {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    conversation = MSGS + [{"role": "assistant", "content": "", "tool_calls": calls},
                           {"role": "tool", "tool_call_id": "call_1", "content": "21 °C"}]
    text = hermes_tool_template().render(conversation, TOOLS)
    reply = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = parse_tool_calls(reply, "hermes")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"}),
                                                                         ("get_weather", {"city": "Rome"})]
    assert parsed.content is None and "<tool_response>\n21 °C\n</tool_response>" in text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and json.dumps(TOOLS[0]) in text


def test_read_chat_template_takes_a_file_or_inline_jinja(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(READS_TOOLS)
    assert read_chat_template(str(path)) == READS_TOOLS
    assert read_chat_template(CHATML_TEMPLATE) == CHATML_TEMPLATE
    with pytest.raises(ModelLoadError, match="neither a file nor a Jinja template"):
        read_chat_template("templates/missing.jinja")


def test_llm_chat_template_replaces_the_models(tiny_gguf, tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}<|im_start|>{{ m.role|upper }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    llm = kog.LLM(str(tiny_gguf), kv_cache_gib=0.01, chat_template=str(path))
    assert llm.tokenizer.decode(llm.encode_chat(MSGS)).startswith("<|im_start|>SYSTEM\nBe brief.")
    assert llm.chat_template.tool_template is None  # the user's choice is not overridden
    inline = kog.LLM(str(tiny_gguf), kv_cache_gib=0.01, chat_template=READS_TOOLS)
    assert inline.chat_template.source == READS_TOOLS
    with pytest.raises(ModelLoadError):
        kog.LLM(str(tiny_gguf), kv_cache_gib=0.01, chat_template="no-such-file.jinja")


def test_the_shipped_template_is_in_the_wheel(monkeypatch, tmp_path):
    """scikit-build-core's own file selection (wheel.packages = ["python/kog"]) maps it into kog/."""
    pytest.importorskip("scikit_build_core")
    import tomllib

    from scikit_build_core.build._editable import get_packages
    from scikit_build_core.build._pathutil import packages_to_file_mapping
    from scikit_build_core.settings.skbuild_read_settings import SettingsReader

    root = Path(__file__).resolve().parents[2]
    settings = SettingsReader(tomllib.loads((root / "pyproject.toml").read_text()), {}, state="wheel").settings
    monkeypatch.chdir(root)  # scikit-build-core resolves package paths from the project root
    mapping = packages_to_file_mapping(
        packages=get_packages(packages=settings.wheel.packages, name="kog"), platlib_dir=tmp_path,
        include=settings.sdist.include, src_exclude=settings.sdist.exclude, target_exclude=settings.wheel.exclude,
        build_dir=settings.build_dir, mode=settings.sdist.inclusion_mode)
    source = HERMES_TOOLS_TEMPLATE.relative_to(root).as_posix()
    assert mapping.get(source) == str(tmp_path / "kog" / "templates" / "hermes_tools.jinja")


@pytest.mark.slow
def test_the_default_model_is_shown_the_tools():
    model = load_model(progress=False)
    tok, template = model.tokenizer, model.chat_template
    assert template.ignores_tools()  # SmolLM2's own template drops them
    without, with_tools = encode_conversation(template, tok, MSGS), encode_conversation(template, tok, MSGS, TOOLS)
    assert with_tools != without and "get_weather" in tok.decode(with_tools)
