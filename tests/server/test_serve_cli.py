"""`kog serve` flags reach the engine they describe."""

import argparse

import pytest

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
