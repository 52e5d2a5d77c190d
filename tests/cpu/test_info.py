"""kog.backend_info(), `kog info` and CPU ISA selection."""

import json
import subprocess
import sys

import pytest

import kog
from kog import _C
from kog.cli import main


def test_backend_info_reports_build_and_versions():
    info = kog.backend_info()
    assert info["backend"] in ("cpu", "cuda", "rocm")
    assert info["backend"] == "cpu" or info["gpu_archs"]
    assert info["cpu_isa"] in info["cpu_isas_supported"]
    assert info["cpu_isas_supported"][0] == "generic"
    assert info["cpu_threads"] >= 1
    assert info["device"] == ("cuda:0" if info["gpu_devices"] else "cpu")
    assert info["version"] == kog.__version__
    assert info["torch"] and info["numpy"] and info["python"]


def test_cli_info_text_and_json(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "backend" in text and "cpu_isa" in text and "gpu_devices" in text
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == kog.backend_info()["backend"]


def test_python_dash_m_kog_info_runs_in_a_subprocess():
    out = subprocess.run([sys.executable, "-m", "kog", "info"], capture_output=True, text=True, check=True)
    assert "backend" in out.stdout


def test_kog_cpu_isa_env_selects_kernels():
    code = "import kog; print(kog.backend_info()['cpu_isa'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__('os').environ, "KOG_CPU_ISA": "generic"})
    assert out.stdout.strip() == "generic"


def test_kog_cpu_prefetch_env_selects_the_policy_and_a_bad_one_fails_the_import():
    import os

    code = "import kog; print(kog.backend_info()['cpu_prefetch'])"
    for policy in ("none", "t0", "nta"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "KOG_CPU_PREFETCH": policy})
        assert out.stdout.strip() == policy
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "KOG_CPU_PREFETCH": "always"})
    assert bad.returncode != 0 and "KOG_CPU_PREFETCH=always: expected none, t0 or nta" in bad.stderr
    with pytest.raises(kog.InvalidRequest, match="expected none, t0 or nta"):
        _C.set_cpu_prefetch("always")


def test_set_cpu_isa_rejects_unknown_and_unsupported():
    with pytest.raises(kog.InvalidRequest, match="no CPU kernels named"):
        _C.set_cpu_isa("sse9")
    if "avx512" not in _C.cpu_isas_supported():
        with pytest.raises(kog.InvalidRequest, match="does not support"):
            _C.set_cpu_isa("avx512")
