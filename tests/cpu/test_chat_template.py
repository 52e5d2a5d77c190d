"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import pytest

from kog.errors import InvalidRequest, ModelLoadError
from kog.loader import ChatTemplate, TemplateError
from kog.testing.tiny_models import CHATML_TEMPLATE, tiny_tokenizer

transformers = pytest.importorskip("transformers")

SMOLLM2_TEMPLATE = (  # as shipped in SmolLM2-135M-Instruct's GGUF
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A tool-calling template in the style of recent instruct models: tools as JSON in the system
# turn, assistant tool calls, tool results, loop controls, namespace, tojson options, bos_token,
# whitespace control, the generation tag, and raise_exception on a bad role.
TOOLS_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif %}
{%- if tools %}
<|im_start|>system
{{ ns.system }}
# Tools
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
Reply with {{ {"name": "…", "arguments": {}} | tojson(indent=2) }}<|im_end|>
{% elif ns.system %}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif %}
{%- for m in messages %}
  {%- if m.role == 'system' %}{% continue %}{% endif %}
  {%- if m.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}
<|im_start|>{{ m.role }}
  {%- if m.role == 'assistant' %}{% generation %}
{{ m.content or '' }}
    {%- for call in m.tool_calls or [] %}
<tool_call>{{ call.function | tojson(separators=(',', ':'), sort_keys=true) }}</tool_call>
    {%- endfor %}{% endgeneration %}
  {%- else %}
{{ m.content }}
  {%- endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville — °C",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "a + b",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "number"}, "b": {"type": "number"}}}}},
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 東京 😀?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": '{"temp": 21, "sky": "clair"}'},
     {"role": "assistant", "content": "21 °C, clear."}],
    [{"role": "user", "content": "  leading and trailing spaces \n\n"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    tok = tiny_tokenizer()
    tok.save(folder)
    return transformers.AutoTokenizer.from_pretrained(folder), tok


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, CHATML_TEMPLATE, TOOLS_TEMPLATE],
                         ids=["smollm2", "chatml", "tools"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_render_matches_transformers(hf_tokenizer, template, conversation, tools, add_generation_prompt):
    hf, tok = hf_tokenizer
    messages = CONVERSATIONS[conversation]
    if template != TOOLS_TEMPLATE and any("tool_calls" in m or m["role"] == "tool" for m in messages):
        messages = [m for m in messages if m["role"] in ("user", "system")]  # these templates need content
    want = hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)
    got = ChatTemplate(template, bos_token=tok.bos_token, eos_token=tok.eos_token).render(
        messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert got == want
    if template == TOOLS_TEMPLATE and tools:
        assert "Météo" in got and '"city"' in got  # tojson kept non-ASCII text


def test_tools_template_output():
    out = ChatTemplate(TOOLS_TEMPLATE, bos_token="<s>").render(CONVERSATIONS[2], tools=TOOLS[:1])
    assert out.startswith("<s><|im_start|>system\n")
    assert '<tool_call>{"arguments":{"city":"Paris"},"name":"get_weather"}</tool_call>' in out


def test_raise_exception_becomes_template_error():
    template = ChatTemplate(TOOLS_TEMPLATE)
    with pytest.raises(TemplateError, match="unknown role robot") as info:
        template.render([{"role": "robot", "content": "beep"}])
    assert isinstance(info.value, InvalidRequest)


def test_sandbox_blocks_attribute_escape():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        ChatTemplate(evil).render([])


def test_syntax_error_is_model_load_error():
    with pytest.raises(ModelLoadError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
