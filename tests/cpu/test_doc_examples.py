"""Every ```python block of README.md and docs/*.md runs, as a reader would run it (markers and
conventions: kog.testing.doc_blocks). A page's blocks run in one fresh interpreter, in an empty
temporary folder; pages with a `doc-test: server` block share one `kog serve` of the default
model. Running pages loads the real SmolLM2-135M, hence `slow`; the markers are checked fast."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kog
from kog.testing.doc_blocks import SERVER_ENV, DocBlockError, python_blocks

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
WITH_PYTHON = [p for p in PAGES if "```python" in p.read_text()]
PAGE_TIMEOUT_S = 900


@pytest.fixture(scope="session")
def doc_server():
    """The URL of one `kog serve` (default model) for every page that has server blocks."""
    from kog.testing.server_process import ServerProcess

    srv = ServerProcess(None, name="SmolLM2-135M-Instruct", startup_timeout=300)
    yield srv.url
    srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("page", WITH_PYTHON, ids=[str(p.relative_to(ROOT)) for p in WITH_PYTHON])
def test_page_python_blocks_run(page, tmp_path, request):
    blocks = [b for b in python_blocks(page) if b.skip is None]
    if not blocks:
        pytest.skip("every python block of the page is marked doc-test: skip")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(kog.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    if any(b.server for b in blocks):
        env[SERVER_ENV] = request.getfixturevalue("doc_server")
    out = subprocess.run([sys.executable, "-m", "kog.testing.doc_blocks", str(page)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-4000:]}"


def test_doc_markers_are_well_formed():
    with_blocks = {p.name for p in PAGES if python_blocks(p)}  # raises DocBlockError on a bad marker
    assert {"README.md", "SERVER.md", "SESSIONS.md"} <= with_blocks


def test_blocks_lines_and_markers():
    page = "\n".join([
        "# Title", "", "```python", "x = 1", "```", "",
        "<!-- doc-test: server -->", "```python", 'OpenAI(base_url="http://localhost:8000/v1")', "```",
        "<!-- doc-test: skip needs a GPU -->", "   ```python", "   llm = kog.LLM(device='cuda')", "   ```",
        "```bash", "kog serve", "```",
    ])
    blocks = python_blocks("PAGE.md", page)
    assert [(b.line, b.server, b.skip) for b in blocks] == [(4, False, None), (9, True, None),
                                                            (13, False, "needs a GPU")]
    assert blocks[2].source == "llm = kog.LLM(device='cuda')\n"


@pytest.mark.parametrize("marker, error", [
    ("<!-- doc-test: skip -->", "needs a reason"),
    ("<!-- doc-test: sever -->", "unknown doc-test directive"),
    ("<!-- doc-test server -->", "malformed"),
])
def test_bad_markers_name_page_and_line(marker, error):
    with pytest.raises(DocBlockError, match=rf"PAGE.md:2: .*{error}"):
        python_blocks("PAGE.md", f"text\n{marker}\n```python\nx = 1\n```\n")


def test_server_urls_markers_and_fences_are_checked():
    with pytest.raises(DocBlockError, match="PAGE.md:2: a server block must use"):
        python_blocks("PAGE.md", "<!-- doc-test: server -->\n```python\nclient = OpenAI()\n```\n")
    with pytest.raises(DocBlockError, match="PAGE.md:1: the block calls a server: mark it"):
        python_blocks("PAGE.md", '```python\nOpenAI(base_url="http://127.0.0.1:8000/v1")\n```\n')
    with pytest.raises(DocBlockError, match="PAGE.md:1: doc-test marker before a non-python block"):
        python_blocks("PAGE.md", "<!-- doc-test: skip no shell here -->\n```bash\nkog serve\n```\n")
    with pytest.raises(DocBlockError, match="PAGE.md:1: unclosed"):
        python_blocks("PAGE.md", "```python\nx = 1\n")


def test_a_failing_block_is_reported_with_its_page_line(tmp_path):
    page = tmp_path / "PAGE.md"
    page.write_text("intro\n\n```python\nx = 1\n```\n\n```python\ny = x + 1\nprint(tools)\n```\n")
    out = subprocess.run([sys.executable, "-m", "kog.testing.doc_blocks", "PAGE.md"], cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(Path(kog.__file__).parents[1])),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "PAGE.md:8: this block failed" in out.stdout
    assert 'File "PAGE.md", line 9' in out.stdout and "NameError: name 'tools'" in out.stdout
