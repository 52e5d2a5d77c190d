"""gpu_memory_utilization sizes the KV pool as a fraction of the device's memory (kog.memory_budget),
checked with fake memory figures."""

from __future__ import annotations

import pytest

import kog
from kog import memory_budget
from kog.kvcache import KVLayout
from kog.memory_budget import GIB, DeviceMemory, device_memory, kv_cache_bytes
from kog.testing.server_process import tiny_gguf


def test_kv_bytes_are_the_fraction_less_what_is_in_use_and_the_weights():
    assert kv_cache_bytes(0.5, DeviceMemory(total=8 * GIB)) == 4 * GIB
    gpu = DeviceMemory(total=80 * GIB, in_use=2 * GIB)
    assert kv_cache_bytes(0.9, gpu, weight_bytes=16 * GIB) == int(0.9 * 80 * GIB) - 18 * GIB


@pytest.mark.parametrize("fraction", [0, -0.1, 1.01, float("nan"), True, "0.9"])
def test_a_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(kog.InvalidRequest, match="gpu_memory_utilization must be in"):
        kv_cache_bytes(fraction, DeviceMemory(total=GIB))


def test_a_fraction_that_leaves_nothing_for_the_kv_cache_is_refused():
    with pytest.raises(kog.InvalidRequest, match="leaves no memory for the KV cache"):
        kv_cache_bytes(0.5, DeviceMemory(total=10 * GIB, in_use=3 * GIB), weight_bytes=2 * GIB)


def test_the_cpu_figure_is_the_host_memory_available():
    memory = device_memory("cpu")
    assert memory.in_use == 0 and 0 < memory.total


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_gguf(tmp_path_factory.mktemp("model")))


def test_llm_sizes_its_kv_pool_from_the_fraction(model, monkeypatch):
    monkeypatch.setattr(memory_budget, "device_memory", lambda device: DeviceMemory(total=64 * 2**20))
    llm = kog.LLM(model, gpu_memory_utilization=0.25)
    cfg = llm.model.config
    per_block = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16, llm.model.dtype).bytes_per_block
    assert llm.engine.kv.num_blocks == (16 * 2**20) // per_block  # a quarter of the fake 64 MiB
    assert kog.LLM(model, gpu_memory_utilization=0.5).engine.kv.num_blocks == 2 * llm.engine.kv.num_blocks


def test_llm_takes_one_kv_size_only(model):
    with pytest.raises(kog.InvalidRequest, match="not both"):
        kog.LLM(model, kv_cache_gib=0.01, gpu_memory_utilization=0.5)
