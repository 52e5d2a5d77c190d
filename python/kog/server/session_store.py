"""The server's side of each open session: its conversation, for chat-mode appends.

NOTE: the KV and the tokens live in the engine; this holds only what the engine does not know,
the messages and how many context tokens came from chat-template renders (see
kog.llm_session.append_render). A session absent from the store is unknown to clients (404).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerSession:
    """Args:
        id: the engine's session id.
        messages: the conversation (chat mode), None after a token-level append or rollback.
        tools: the tools rendered into the prefix (their calls are parsed from generations).
        chat_kwargs: the chat template's extra variables.
        rendered: context tokens [0, rendered) came from chat-template renders.
        replies: index in messages -> that generated reply as the API returned it (content and
            parsed tool_calls), the form a client sending the whole conversation back has.
    """

    id: str
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    rendered: int = 0
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)

    def fork(self, child_id: str) -> ServerSession:
        """A branch with the same conversation."""
        return ServerSession(child_id, copy.deepcopy(self.messages), self.tools, self.chat_kwargs, self.rendered,
                             copy.deepcopy(self.replies))

    def leave_chat_mode(self) -> None:
        """After a token-level append or a rollback: the context is no longer a conversation."""
        self.messages = None
        self.replies = {}
