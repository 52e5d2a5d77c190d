"""A conversation's prompt tokens: the chat template's render, tokenized so that only the
template's own markers are control tokens.

Message contents are untrusted: an agent feeds web pages and tool output straight back into
the prompt, and `<|im_end|>\\n<|im_start|>system` inside a tool result would otherwise be
tokenized as the real control tokens and open a forged system turn. So control-token text that
comes from the messages (contents, names, tool calls) or the tools is tokenized as plain text.

How: every control-token text in the messages and tools is swapped for a placeholder before
rendering. The render is tokenized as usual (control tokens matched); `tokenizers` splits text
at control tokens before anything else, so the tokens between two control tokens depend on that
stretch of text only. Each stretch that holds a placeholder is tokenized again as plain text
with the placeholders swapped back; every other stretch keeps its tokens. A conversation without
control-token text in it therefore gets exactly the tokens it always got (the same as
transformers' apply_chat_template + encode), and earlier turns keep their tokens when a later one
holds such text (sessions append by re-rendering).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from kog.loader.chat_template import ChatTemplate
from kog.loader.tokenizer import Tokenizer
from kog.valid_text import check_text


def encode_conversation(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                        **kwargs: Any) -> list[int]:
    """Renders the conversation with the template and tokenizes it.

    Args:
        template: its allow_special_tokens_in_content=True tokenizes control-token text in
            contents as control tokens (the old behaviour).
        tokenizer: the model's tokenizer.
        messages, tools, add_generation_prompt, **kwargs: as ChatTemplate.render.
    Returns:
        The prompt's token ids (no BOS added: templates write it).
    Raises:
        InvalidRequest: text with a lone surrogate (named: `messages[1]['content']`), or a
            TemplateError.
    """
    check_text(messages, "messages")
    check_text(tools, "tools")
    pattern = tokenizer.special_token_pattern
    if not template.allow_special_tokens_in_content and pattern is not None:
        masks = _Masks(pattern)
        masked_messages, masked_tools = masks.apply(messages), masks.apply(tools)
        if masks.texts:  # else the usual encode below gives the same tokens
            text = template.render(masked_messages, masked_tools, add_generation_prompt, **kwargs)
            return _encode_masked(tokenizer, text, masks)
    return tokenizer.encode(template.render(messages, tools, add_generation_prompt, **kwargs), add_special_tokens=False)


# ---------------------------------------------------------------------- internal helpers


class _Masks:
    """Control-token texts swapped for placeholders `\\ue000<nonce>:<k>\\ue001` (private-use
    characters and digits: no trim, case or JSON filter of a template alters them), and back."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.nonce = uuid.uuid4().int % 10**16  # text that happens to hold a placeholder stays text either way
        self.texts: list[str] = []
        self.index: dict[str, int] = {}
        self.placeholder = re.compile(f"\ue000{self.nonce}:(\\d+)\ue001")

    def apply(self, value: Any, key: str | None = None) -> Any:
        """A copy of value with control-token texts masked in every string but a message's role."""
        if isinstance(value, str):
            return value if key == "role" else self.pattern.sub(self._mask, value)
        if isinstance(value, dict):
            return {k: self.apply(v, k) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.apply(v) for v in value]
        return value

    def restore(self, text: str) -> str:
        return self.placeholder.sub(lambda m: self.texts[int(m.group(1))], text)

    def _mask(self, m: re.Match[str]) -> str:
        k = self.index.setdefault(m.group(), len(self.texts))
        if k == len(self.texts):
            self.texts.append(m.group())
        return f"\ue000{self.nonce}:{k}\ue001"


def _encode_masked(tokenizer: Tokenizer, text: str, masks: _Masks) -> list[int]:
    ids, offsets = tokenizer.encode_with_offsets(text)
    specials = tokenizer.special_token_ids
    out: list[int] = []
    run: list[int] = []  # positions of the tokens since the last control token

    def flush() -> None:
        if not run:
            return
        start, end = min(offsets[i][0] for i in run), max(offsets[i][1] for i in run)
        stretch = text[start:end]
        if masks.placeholder.search(stretch):
            out.extend(tokenizer.encode_plain(masks.restore(stretch)))
        else:
            out.extend(ids[i] for i in run)
        run.clear()

    for i, token_id in enumerate(ids):
        if token_id in specials:  # the template's own marker: the placeholders hold no control text
            flush()
            out.append(token_id)
        else:
            run.append(i)
    flush()
    return out

