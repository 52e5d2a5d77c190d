"""Server-sent events: one event is one line for every line reader, whatever the text holds."""

import json

from kog.server.responses import ErrorDetail, ErrorResponse
from kog.server.serving import sse, sse_json

# every character str.splitlines() breaks on, plus text around them
TRICKY = "a\nb\rc\x0bd\x0ce\x1cf\x1dg\x1eh\x85i\u2028j\u2029k é 🦊"


def test_sse_event_is_one_line_and_round_trips():
    event = sse(ErrorResponse(error=ErrorDetail(message=TRICKY, type="server_error")))
    assert event.startswith("data: ") and event.endswith("\n\n")
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1
    assert json.loads(lines[0][len("data: "):])["error"]["message"] == TRICKY


def test_sse_json_keeps_ordinary_non_ascii_raw():
    payload = json.dumps({"text": "é 🦊 日本"}, ensure_ascii=False)
    assert sse_json(payload) == f"data: {payload}\n\n"
