"""docker/ cannot be built here (no Docker engine): check both files parse and agree with the README."""

import re
import shlex
from pathlib import Path

import pytest

dockerfile_parse = pytest.importorskip("dockerfile_parse")

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def stages(name: str) -> list[dict]:
    """Each build stage: its base image, ENV (accumulated) and RUN commands with the ENV at that point."""
    parser = dockerfile_parse.DockerfileParser(fileobj=open(ROOT / "docker" / name, "rb"))
    out: list[dict] = []
    for ins in parser.structure:
        kind, value = ins["instruction"], ins["value"]
        if kind == "FROM":
            out.append({"from": value.split()[0], "env": {}, "runs": [], "entrypoint": None})
        elif kind == "ENV":
            for token in shlex.split(value):
                key, _, val = token.partition("=")
                out[-1]["env"][key] = val
        elif kind == "RUN":
            out[-1]["runs"].append((value, dict(out[-1]["env"])))
        elif kind == "ENTRYPOINT":
            out[-1]["entrypoint"] = value
    return out


def readme_install(backend: str) -> str:
    """The README build-table command for a backend, e.g. 'KOG_BACKEND=rocm pip install .'."""
    m = re.search(rf"`(KOG_BACKEND={backend} pip install \.)`", README)
    assert m, f"README has no build row for {backend}"
    return m.group(1)


def installs_kog(stage: dict, backend: str) -> bool:
    return any(
        env.get("KOG_BACKEND") == backend and re.search(r"pip (install|wheel)( --no-deps)? \.( |$|&)", cmd + " ")
        for cmd, env in stage["runs"]
    )


def test_rocm_image_builds_for_mi300x_from_rocm6_like_the_readme():
    (stage,) = stages("Dockerfile.rocm")
    assert re.fullmatch(r"rocm/dev-ubuntu-\d\d\.\d\d:6\.\d+(\.\d+)?-complete", stage["from"]), stage["from"]
    readme_install("rocm")
    assert installs_kog(stage, "rocm")
    assert "gfx942" in stage["env"]["KOG_GPU_ARCHS"].split(";")
    assert stage["entrypoint"] == '["kog"]'


def test_cuda_image_builds_in_devel_and_runs_in_runtime_like_the_readme():
    build, run = stages("Dockerfile.cuda")
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-devel-ubuntu\d\d\.\d\d", build["from"])
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d\d\.\d\d", run["from"])
    assert build["from"].split(":")[1].split("-")[0] == run["from"].split(":")[1].split("-")[0]
    readme_install("cuda")
    assert installs_kog(build, "cuda")
    assert build["env"]["KOG_GPU_ARCHS"] == "90a"
    assert any("pip install /wheels/kog-" in cmd for cmd, _ in run["runs"])
    assert run["entrypoint"] == '["kog"]'


@pytest.mark.parametrize(
    "dockerfile, flags",
    [("Dockerfile.rocm", "--device /dev/kfd --device /dev/dri --group-add video"), ("Dockerfile.cuda", "--gpus all")],
)
def test_readme_shows_build_and_run_lines(dockerfile, flags):
    tag = "kog:" + dockerfile.split(".")[1]
    assert f"docker build -f docker/{dockerfile} -t {tag} ." in README
    assert re.search(rf"docker run [^\n]*{re.escape(flags)} {tag}", README)
