"""Each of Kog's layers imports on its own, first thing in a fresh interpreter: an import cycle
between packages (kog.program.interpreter -> kog.parallel -> kog.models -> the interpreter) shows
only when a user's first import is the module in the middle of it."""

import subprocess
import sys
from pathlib import Path

import pytest

import kog

# The kog this test process runs (a source tree's python/ or an installed package), first on the
# child's path too
PYTHON = str(Path(kog.__file__).resolve().parents[1])

FIRST_IMPORTS = ["kog.program.interpreter", "kog.program", "kog.parallel", "kog.parallel.ranks", "kog.models",
                 "kog.models.gpu_decode", "kog.engine.decode_loop", "kog.loader", "kog.testing.sync_model"]


@pytest.mark.parametrize("module", FIRST_IMPORTS)
def test_a_module_imports_first_in_a_fresh_interpreter(module):
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (PYTHON, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
