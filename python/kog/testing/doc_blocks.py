"""The ```python blocks of Kog's Markdown docs, and a runner that executes a page's blocks.

Every ```python block of README.md and docs/*.md runs in tests/cpu/test_doc_examples.py: a
page's blocks run in order in one namespace (a later block may use what an earlier one
defined), in one fresh interpreter whose working directory is an empty temporary folder.
An HTML comment on the line just before a block's fence (invisible once rendered) changes that:

    <!-- doc-test: server -->           the block talks to `kog serve`: the test starts one
                                        (default model, a free loopback port) and the block's
                                        http://127.0.0.1:8000 (or localhost:8000) is sent there
    <!-- doc-test: skip REASON -->      the block is not run; REASON (required) says why

    python -m kog.testing.doc_blocks README.md   # runs one page's blocks by hand
    (server blocks read the server's URL from $KOG_DOC_TEST_SERVER, e.g. http://127.0.0.1:8000)

A failing block is reported as `PAGE:LINE` of its first line, and the traceback's lines are
the page's lines.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

MARKER = re.compile(r"^<!--\s*doc-test:\s*(?P<directive>\S+)\s*(?P<arg>.*?)\s*-->$")
SERVER_URL = re.compile(r"http://(?:127\.0\.0\.1|localhost):8000")
SERVER_ENV = "KOG_DOC_TEST_SERVER"


class DocBlockError(ValueError):
    """A malformed doc-test marker or block, with its page and line."""


@dataclass(frozen=True)
class Block:
    page: str        # the Markdown file, as given
    line: int        # 1-based line of the block's first code line
    source: str      # the code, the fence's indentation removed
    server: bool     # marked `doc-test: server`
    skip: str | None # the reason of `doc-test: skip REASON`; None: the block runs


def python_blocks(page: str | os.PathLike[str], text: str | None = None) -> list[Block]:
    """Every ```python block of a Markdown page, with its marker.

    Raises:
        DocBlockError: an unknown directive, a skip without reason, a server block without a
            localhost:8000 URL to redirect or an unmarked block with one, a marker before a
            block that is not python, an unclosed fence.
    """
    page = str(page)
    lines = (Path(page).read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped.startswith("```"):
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise DocBlockError(f"{page}:{i + 1}: unclosed code fence")
        marker = _marker(page, lines, i)
        if stripped[3:].strip() == "python":
            source = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            skip = marker[1] if marker is not None and marker[0] == "skip" else None
            block = Block(page, i + 2, source, server=marker == ("server", ""), skip=skip)
            if block.server and not SERVER_URL.search(source):
                raise DocBlockError(f"{page}:{i + 1}: a server block must use http://127.0.0.1:8000 (it is redirected)")
            if not block.server and block.skip is None and SERVER_URL.search(source):
                raise DocBlockError(f"{page}:{i + 1}: the block calls a server: mark it <!-- doc-test: server -->")
            blocks.append(block)
        elif marker is not None:
            raise DocBlockError(f"{page}:{i}: doc-test marker before a non-python block")
        i = end + 1
    return blocks


def run_page(page: str | os.PathLike[str], server_url: str | None = None) -> int:
    """Runs a page's blocks in order in one namespace; prints and returns 1 at the first failure."""
    namespace: dict = {"__name__": "__main__"}
    for block in python_blocks(page):
        if block.skip is not None:
            continue
        source = block.source
        if block.server:
            if server_url is None:
                print(f"{block.page}:{block.line}: a server block needs ${SERVER_ENV} (a running kog serve)")
                return 1
            source = SERVER_URL.sub(server_url.rstrip("/"), source)
        code = compile("\n" * (block.line - 1) + source, block.page, "exec")  # tracebacks show page lines
        try:
            exec(code, namespace)
        except BaseException as e:
            where = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))  # from the block's frame
            print(f"{block.page}:{block.line}: this block failed\n{where}", flush=True)
            return 1
    return 0


# ---- internal helpers ---------------------------------------------------------------------------
def _marker(page: str, lines: list[str], fence: int) -> tuple[str, str] | None:
    """(directive, argument) of the doc-test marker on the line before a fence, if any."""
    if fence == 0:
        return None
    m = MARKER.match(lines[fence - 1].strip())
    if m is None:
        if "doc-test" in lines[fence - 1]:
            raise DocBlockError(f"{page}:{fence}: malformed doc-test marker {lines[fence - 1].strip()!r}")
        return None
    directive, arg = m["directive"], m["arg"]
    if directive == "server" and not arg:
        return directive, ""
    if directive == "skip" and arg:
        return directive, arg
    if directive == "skip":
        raise DocBlockError(f"{page}:{fence}: `doc-test: skip` needs a reason")
    raise DocBlockError(f"{page}:{fence}: unknown doc-test directive {lines[fence - 1].strip()!r} "
                        f"(known: `server`, `skip REASON`)")


if __name__ == "__main__":
    sys.exit(max([run_page(p, os.environ.get(SERVER_ENV)) for p in sys.argv[1:]] or [0]))
