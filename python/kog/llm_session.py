"""kog.Session: an agent's conversation whose KV stays in the engine between turns.

    with llm.session(messages=[{"role": "system", "content": SYSTEM}], tools=TOOLS) as s:
        out = s.generate(kog.SamplingParams(max_tokens=64))    # a tool call
        s.suspend()                                             # while the tool runs
        s.append(messages=[{"role": "tool", "content": result}])
        out = s.generate(params)                                # only the tool result is prefilled
        branches = s.fork(3)                                    # KV shared copy-on-write

A session opened with messages is in chat mode: generate() records the output as an assistant
message and append(messages=...) takes the new messages or the whole conversation
(kog.conversation) and adds exactly the tokens the chat template produces for the whole
conversation (checked against a full render every time). Token-level appends and rollbacks
leave chat mode. Semantics and memory policy: docs/SESSIONS.md.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from kog.conversation import appended_messages
from kog.engine import RequestOutput
from kog.errors import InvalidOperation, InvalidRequest
from kog.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kog.engine.session_manager import SessionManager
    from kog.llm import LLM


class Session:
    """One open session of an LLM (create it with LLM.session, not directly).

    Attributes:
        session_id: the engine's id for it.
        opened: the RequestOutput of the prefix prefill (prefill_tokens_computed, num_cached_tokens).
    """

    def __init__(self, llm: LLM, session_id: str, messages: list[dict[str, Any]] | None = None,
                 tools: list[dict[str, Any]] | None = None, chat_kwargs: dict[str, Any] | None = None) -> None:
        self.llm = llm
        self.session_id = session_id
        self.opened: RequestOutput | None = None
        self._messages = copy.deepcopy(messages) if messages is not None else None
        self._tools = tools
        self._chat_kwargs = dict(chat_kwargs or {})
        self._closed = False
        # NOTE: tokens [0, _rendered) came from chat-template renders; a later render that
        # changes one of them means the template is not incremental (an error, not a fix-up).
        self._rendered = len(self.token_ids)

    # ---- public API ---------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        """The session's whole context."""
        self._check_open()
        return self.llm.engine.sessions.info(self.session_id)["token_ids"]

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        """The conversation (chat mode), or None after a token-level append or rollback."""
        return copy.deepcopy(self._messages)

    def generate(self, sampling_params: SamplingParams | None = None) -> RequestOutput:
        """Continues the context; the output tokens join it (chat mode: as an assistant message).

        Returns:
            the RequestOutput: prefill_tokens_computed counts the tokens computed for this
            turn (the appended ones plus the previous turn's last token), num_cached_tokens
            those whose KV the session already held.
        """
        self._check_open()
        rid = self.llm.new_request_id()
        self.llm.engine.sessions.generate(self.session_id, rid, sampling_params or SamplingParams())
        out = self.llm.run([rid])[0]
        if self._messages is not None and out.outputs[0].finish_reason != "abort":
            self._messages.append({"role": "assistant", "content": out.outputs[0].text})
        return out

    def append(self, messages: list[dict[str, Any]] | None = None, token_ids: list[int] | None = None) -> None:
        """Adds a tool result / the next turn: messages (chat mode) or raw token ids.

        Args:
            messages: the new messages, or the whole conversation (s.messages followed by the
                new ones; only those are appended). kog.conversation says which is which.
            token_ids: raw tokens (leaves chat mode).
        Raises:
            InvalidRequest: both or neither given; messages outside chat mode; no new message;
                a chat template whose render of the whole conversation changes tokens already
                in the context.
            ConversationDiverged: messages read as the whole conversation differ from s.messages.
        """
        self._check_open()
        if (messages is None) == (token_ids is None):
            raise InvalidRequest("append: pass exactly one of messages or token_ids")
        if token_ids is not None:
            self.llm.engine.sessions.append(self.session_id, list(token_ids))
            self._messages = None
            return
        if self._messages is None:
            raise InvalidRequest("append(messages=...) needs a session opened with messages "
                                 "(and no token-level append or rollback since)")
        conversation = self._messages + copy.deepcopy(appended_messages(self._messages, list(messages)))
        full = self.llm.encode_chat(conversation, self._tools, True, self._chat_kwargs)
        append_render(self.llm.engine.sessions, self.session_id, full, self._rendered)
        self._messages = conversation
        self._rendered = len(full)

    def fork(self, n: int) -> list[Session]:
        """n new sessions with this context, sharing its KV copy-on-write (no copies). Tokens
        appended since the last generation are prefilled first, once for all branches."""
        self._check_open()
        if n < 1:
            raise InvalidRequest(f"fork: n must be >= 1, got {n}")
        sessions = self.llm.engine.sessions
        info = sessions.info(self.session_id)
        if info["num_computed"] < len(info["token_ids"]) - 1:  # compute appended tokens once, not per branch
            rid = self.llm.new_request_id()
            sessions.prefill(self.session_id, rid)
            self.llm.run([rid])
        ids = [self.llm.new_session_id() for _ in range(n)]
        sessions.fork(self.session_id, ids)
        children = []
        for sid in ids:
            child = Session(self.llm, sid, self._messages, self._tools, self._chat_kwargs)
            child._rendered = self._rendered
            children.append(child)
        return children

    def suspend(self, offload: bool = False) -> str:
        """Marks the session waiting (a tool runs): its KV is out of the batch and swappable
        under memory pressure; offload=True swaps it to the host pool now.

        Returns:
            "suspended" (KV on the device), "swapped" (host pool) or "dropped" (recomputed later).
        """
        self._check_open()
        return self.llm.engine.sessions.suspend(self.session_id, offload)

    def rollback(self, n_tokens: int) -> None:
        """Keeps the first n_tokens of the context (backtracking); leaves chat mode."""
        self._check_open()
        self.llm.engine.sessions.rollback(self.session_id, n_tokens)
        self._messages = None
        self._rendered = min(self._rendered, n_tokens)

    def close(self) -> None:
        """Frees the session's KV and unpins its prefix (idempotent)."""
        if not self._closed:
            self.llm.engine.sessions.close(self.session_id)
            self._closed = True

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internal helpers ---------------------------------------------------------------------
    def _check_open(self) -> None:
        """Raises InvalidOperation once the session is closed, here or directly in the engine
        (engine.sessions.close, which also aborts its request in flight)."""
        if not self._closed and self.session_id not in self.llm.engine.sessions:
            self._closed = True
        if self._closed:
            raise InvalidOperation(f"session {self.session_id!r} is closed")


def append_render(sessions: SessionManager, session_id: str, full: list[int], rendered: int) -> None:
    """Brings an idle session's context to `full` (a render of its whole conversation) by
    appending what the render adds; shared by Session and the server's /v1/sessions.

    Args:
        sessions: the engine's sessions; call it on the thread that runs the engine's step().
        full: the tokens of the whole conversation rendered through the chat template.
        rendered: how many of the context's tokens came from earlier renders.
    Raises:
        InvalidRequest: the render adds nothing, or changes a token of an earlier render (the
            template is not incremental). A difference inside the model's own output is not an
            error: the context is rolled back to it and the render appended from there.
    """
    have = sessions.info(session_id)["token_ids"]
    k = _common_prefix(full, have)
    if k == len(full):
        raise InvalidRequest("append: the messages add no tokens to the rendered conversation")
    if k < rendered:
        raise InvalidRequest(
            f"the chat template cannot be rendered incrementally: rendering the whole conversation "
            f"changes token {k} of the {len(have)} already in the session (the first {rendered} "
            f"came from the template); open a new session with the full conversation instead")
    if k < len(have):  # the model's own output re-tokenizes differently: align with the render
        sessions.rollback(session_id, k)
    sessions.append(session_id, full[k:])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
