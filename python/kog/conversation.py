"""What the messages sent to a session's append add to its conversation (kog.Session.append and
POST /v1/sessions/{id}/append; docs/SESSIONS.md, "Appending messages").

A client may send either the new messages only or the whole conversation, the session's
messages followed by the new ones (what a stateless chat client keeps and resends). The list
is read as the whole conversation when its first message is the session's first message, or
when both are system messages; it must then start with every message of the session, and only
the messages after those are appended. Any other list is the new messages.

Two messages are the same when their keys (message_key) are equal: role, name, content as text
(None and "" alike, text parts joined, surrounding whitespace stripped) and tool calls as
(function name, arguments) pairs in order, arguments compared as JSON values. Ids (tool call
ids, tool_call_id) are not compared: the server makes tool call ids up.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from kog.errors import ConversationDiverged, InvalidRequest

MessageKey = tuple[Any, ...]


def message_key(message: Mapping[str, Any]) -> MessageKey:
    """The parts of a message that make it the same message (see the module docstring)."""
    calls = tuple((fn.get("name"), _json_value(fn.get("arguments")))
                  for call in message.get("tool_calls") or []
                  for fn in [call.get("function", call)])
    return (message.get("role"), message.get("name") or None, _text(message.get("content")), calls)


def appended_messages(history: Sequence[Mapping[str, Any]], sent: Sequence[Mapping[str, Any]],
                      replies: Mapping[int, Mapping[str, Any]] | None = None) -> list[Mapping[str, Any]]:
    """The messages of `sent` that the session does not have yet.

    Args:
        history: the session's conversation (at least one message).
        sent: what the client sent to append.
        replies: history index -> another form in which that message may come back (a generated
            reply as the API returned it: content and parsed tool_calls instead of raw text).
    Returns:
        sent itself (new messages), or what follows the session's messages in it.
    Raises:
        ConversationDiverged: sent is read as the whole conversation but does not start with
            the session's messages.
        InvalidRequest: sent is empty, or is the session's conversation with nothing after it.
    """
    if not sent:
        raise InvalidRequest("messages must not be empty (append)")
    replies = replies or {}
    forms = [{message_key(m)} | ({message_key(replies[i])} if i in replies else set()) for i, m in enumerate(history)]
    first = message_key(sent[0])
    if first not in forms[0] and not sent[0].get("role") == history[0].get("role") == "system":
        return list(sent)
    for i, keys in enumerate(forms):
        if i == len(sent):
            raise ConversationDiverged(
                f"append: the messages start like the session's conversation (read as the whole conversation) "
                f"but are {len(sent)}, fewer than its {len(history)}; {_HOW}")
        if message_key(sent[i]) not in keys:
            raise ConversationDiverged(
                f"append: the messages start like the session's conversation (read as the whole conversation) "
                f"but message {i} differs from the session's message {i} (role {history[i].get('role')!r}); {_HOW}")
    if len(sent) == len(history):
        raise InvalidRequest("messages are the session's conversation with no new message after it (append)")
    return list(sent[len(history):])


# ---- internal helpers -------------------------------------------------------------------------

_HOW = "send only the new messages, or the session's messages followed by the new ones"


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    return "".join(p.get("text", "") if isinstance(p, Mapping) else str(p) for p in content).strip()


def _json_value(arguments: Any) -> str:
    """Arguments as canonical JSON text (a JSON string is parsed first); other text as is."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)
