"""`kog serve` flags reach the engine they describe."""

import argparse

import pytest
import torch

from kog import SamplingParams
from kog.serve_cli import add_arguments, load_llm
from kog.testing.server_process import tiny_gguf


def parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_gguf(tmp_path_factory.mktemp("model")))


@pytest.mark.parametrize("flag, enabled", [((), True), (("--enable-prefix-caching",), True),
                                           (("--no-enable-prefix-caching",), False)])
def test_prefix_caching_flag(model, flag, enabled):
    llm = load_llm(parse(model, "--max-num-seqs", "3", "--kv-cache-gib", "0.01", *flag))
    assert llm.engine.config.enable_prefix_caching is enabled and llm.engine.config.max_num_seqs == 3
    ids = list(range(5, 45))
    for i in range(2):  # the same prompt twice: the second one hits the cache only when caching is on
        llm.engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=1))
        while llm.engine.has_unfinished():
            llm.engine.step()
    assert (llm.engine.get_output("r1").num_cached_tokens > 0) is enabled


# ---- speculative decoding ----------------------------------------------------------------------


@pytest.mark.parametrize("value, method, k", [("ngram", "ngram", 4), ("ngram:2", "ngram", 2), ("draft:16", "draft", 16)])
def test_speculative_flag_parses_method_and_k(value, method, k):
    spec = parse("--speculative", value, "--speculative-model", "d.gguf").speculative
    assert (spec.method, spec.num_tokens) == (method, k)
    assert parse().speculative is None and parse().speculative_model is None


@pytest.mark.parametrize("value", ["medusa", "ngram:0", "ngram:17", "ngram:x", "draft:", ""])
def test_bad_speculative_flag_is_an_argparse_error(value, capsys):
    with pytest.raises(SystemExit) as e:
        parse("--speculative", value)
    assert e.value.code == 2 and "--speculative" in capsys.readouterr().err


def test_draft_needs_a_speculative_model(capsys):
    from kog.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--speculative", "draft:3"])
    assert e.value.code == 2
    assert "--speculative draft needs --speculative-model" in capsys.readouterr().err


def test_speculative_model_reaches_the_engine(model):
    llm = load_llm(parse(model, "--speculative-model", model, "--max-num-seqs", "2", "--kv-cache-gib", "0.01"))
    assert llm.engine.speculator.drafter is not None
    ids = list(range(5, 25))
    for rid, spec in [("plain", None), ("draft", {"method": "draft", "num_tokens": 3})]:
        llm.engine.add_request(rid, ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, speculative=spec))
        while llm.engine.has_unfinished():
            llm.engine.step()
    assert llm.engine.get_output("draft").outputs[0].token_ids == llm.engine.get_output("plain").outputs[0].token_ids
    assert llm.engine.speculator.stats["accepted"] > 0
    assert load_llm(parse(model, "--kv-cache-gib", "0.01")).engine.speculator.drafter is None


def test_device_flag_reaches_the_runner(model):
    assert parse(model).device == "cpu"
    llm = load_llm(parse(model, "--device", "cpu", "--kv-cache-gib", "0.01"))
    assert llm.engine.runner.device.type == "cpu"


@pytest.mark.parametrize("device", ["tpu", "cuda:x"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"]))
def test_a_bad_device_is_a_clear_error_and_exit_status_1(model, device, capsys):
    from kog.serve_cli import run

    assert run(parse(model, "--device", device, "--kv-cache-gib", "0.01")) == 1
    assert "device" in capsys.readouterr().err


# ---- flags of issue 14: dtype, memory, chat template, control tokens, vLLM compatibility, port ----


@pytest.mark.parametrize("dtype", ["half", "float16"])
def test_half_dtypes_run_in_float16(model, dtype):
    llm = load_llm(parse(model, "--dtype", dtype, "--kv-cache-gib", "0.01"))
    assert llm.model.dtype == torch.float16
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_gpu_memory_utilization_sizes_the_kv_pool(model, monkeypatch):
    from kog import memory_budget

    monkeypatch.setattr(memory_budget, "device_memory", lambda device: memory_budget.DeviceMemory(total=2**30))
    small = load_llm(parse(model, "--gpu-memory-utilization", "0.01")).engine.kv.num_blocks
    large = load_llm(parse(model, "--gpu-memory-utilization", "0.02")).engine.kv.num_blocks
    assert small == int(0.01 * 2**30) // 8192 and large == int(0.02 * 2**30) // 8192  # tiny model: 8 KiB a block


@pytest.mark.parametrize("argv", [("--gpu-memory-utilization", "0"), ("--gpu-memory-utilization", "1.5"),
                                  ("--gpu-memory-utilization", "x"),
                                  ("--gpu-memory-utilization", "0.5", "--kv-cache-gib", "1")])
def test_bad_gpu_memory_utilization_is_an_argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2 and "--gpu-memory-utilization" in capsys.readouterr().err


def test_chat_template_and_special_tokens_flags_reach_the_template(model, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<|im_start|>{{ m.role }}:{{ m.content }}<|im_end|>{% endfor %}")
    llm = load_llm(parse(model, "--chat-template", str(path), "--kv-cache-gib", "0.01"))
    msgs = [{"role": "user", "content": "<|im_end|>"}]
    assert llm.tokenizer.decode(llm.encode_chat(msgs)) == "<|im_start|>user:<|im_end|><|im_end|>"
    end = llm.tokenizer.token_to_id("<|im_end|>")
    assert llm.encode_chat(msgs).count(end) == 1
    old = load_llm(parse(model, "--chat-template", str(path), "--allow-special-tokens-in-content",
                         "--kv-cache-gib", "0.01"))
    assert old.encode_chat(msgs).count(end) == 2


def test_trust_remote_code_is_accepted_and_changes_nothing(model):
    assert parse(model, "--trust-remote-code").trust_remote_code is True
    assert parse(model).trust_remote_code is False


def test_a_busy_port_fails_before_the_model_loads(model, monkeypatch, capsys):
    import socket

    import kog.serve_cli as serve_cli

    def must_not_load(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(serve_cli, "load_llm", must_not_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert serve_cli.run(parse(model, "--port", str(port))) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_tensor_parallel_size_flag_starts_the_ranks_and_serves_the_same_tokens(tmp_path):
    from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

    config = tiny_config("llama", num_hidden_layers=2)  # 2 KV heads: 2 ranks
    folder = str(write_hf_model(tmp_path / "m", config, random_weights(config, seed=1)))
    assert parse(folder).tensor_parallel_size == 1
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = load_llm(parse(folder, "--dtype", "float32", "--kv-cache-gib", "0.01")).generate("hello", greedy)
    llm = load_llm(parse(folder, "--dtype", "float32", "--kv-cache-gib", "0.01", "-tp", "2"))
    try:
        assert len(llm.engine.runner._procs) == 1
        got = llm.generate("hello", greedy)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    finally:
        llm.engine.runner.close()


def test_another_host_needs_the_rendezvous_port_and_a_split_nnodes_divides(capsys, monkeypatch):
    from kog.serve_cli import run

    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert run(parse("m", "-tp", "2", "--nnodes", "2", "--node-rank", "1")) == 1
    assert "--master-port" in capsys.readouterr().err
    assert run(parse("m", "-tp", "3", "--nnodes", "2", "--node-rank", "1", "--master-port", "1")) == 1
    assert "--nnodes 2 must divide" in capsys.readouterr().err


def test_a_server_whose_rank_dies_fails_the_request_and_exits_with_an_error(tmp_path):
    import os
    import signal
    import time

    import httpx

    from kog.testing.server_process import ServerProcess
    from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

    config = tiny_config("llama", num_hidden_layers=2)
    folder = write_hf_model(tmp_path / "m", config, random_weights(config, seed=1))
    server = ServerProcess(folder, "--dtype", "float32", "--kv-cache-gib", "0.01", "-tp", "2")
    try:
        worker = _children(server.proc.pid, "kog.parallel.worker")
        assert len(worker) == 1
        os.kill(worker[0], signal.SIGKILL)
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code >= 500 and "error" in r.json()
        t0 = time.monotonic()
        while server.proc.poll() is None and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert server.proc.returncode == 1
        assert "tensor-parallel rank failed" in server.stop()
    finally:
        server.stop()


def _children(pid: int, marker: str) -> list[int]:
    """Processes whose parent is pid and whose command line contains marker (read from /proc)."""
    from pathlib import Path

    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and marker in cmd:
            found.append(int(d.name))
    return found
