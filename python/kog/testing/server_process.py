"""A real `kog serve` subprocess on a loopback port (server tests, bench/load_test.py).

    srv = ServerProcess(tiny_gguf(tmp_path), "--api-key", "k")   # waits for /health
    srv.metric("kog_kv_blocks_used"); srv.terminate(); srv.stop()

Needs httpx (in the `test` extra).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import kog
from kog.testing.tiny_models import tiny_config, write_gguf_model

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_gguf(folder: Path) -> Path:
    """A tiny ChatML model with a 1024-token context: requests with tools fit, although its
    template ignores them and Kog renders them with its (longer) tool template."""
    path = folder / "tiny.gguf"
    if not path.exists():
        write_gguf_model(path, tiny_config("llama", max_position_embeddings=1024))
    return path


class ServerProcess:
    """Starts `kog serve [MODEL] --port P ...` and waits until /health answers.

    Args:
        model: the model path (None: Kog's default model).
        *flags: extra `kog serve` flags.
        name: the served model name.
        startup_timeout: seconds to wait for /health.
    """

    def __init__(self, model: Path | None, *flags: str, name: str = "tiny", startup_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(kog.__file__).parents[1]),
                                                            os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "kog", "serve", *([str(model)] if model else []), "--port", str(self.port),
               "--served-model-name", name, "--uvicorn-log-level", "warning", *flags]
        # NOTE: output goes to a file, not a pipe: nobody reads a pipe while the server runs, and a
        # full one would block the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kog serve exited {self.proc.returncode}:\n{self.stop()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("kog serve did not become healthy in time")

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> str:
        """Kills the process if still running; returns its output."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.seek(0)
        return self.log.read()
