"""bench/gpu_roofline.py, the GPU decode roofline MODEL: its byte counts agree with the model's
parameter count computed independently from the config, KV bytes grow linearly with context, the
overlapped prediction never beats the bandwidth floor, and the script runs with --json."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kog

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("gpu_roofline", ROOT / "bench" / "gpu_roofline.py")
roofline = importlib.util.module_from_spec(spec)
sys.modules["gpu_roofline"] = roofline  # dataclasses look their module up
spec.loader.exec_module(roofline)


def run_script(*args: str) -> str:
    """The script in a subprocess that imports the same kog as this test."""
    env = {**os.environ, "PYTHONPATH": str(Path(kog.__file__).parents[1])}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_roofline.py"), *args], env=env,
                          capture_output=True, text=True, check=True, cwd=ROOT).stdout


def parameter_count(c) -> int:
    """Llama parameters from the config alone: embeddings once when tied, else plus the LM head."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h  # q,k,v, o, gate/up/down, two norms
    embeddings = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_hidden_layers * per_layer + h  # + final norm


def test_1b_weight_bytes_per_token_are_two_bytes_per_parameter():
    c = roofline.model_config("llama-1b")
    assert c.tie_word_embeddings
    costs = roofline.op_costs(c, roofline.DEVICES["h200"], batch=1, context=1024)
    # Tied: the LM head streams the embedding matrix every token; EMBED only gathers one row.
    assert sum(x.weight_bytes for x in costs) == 2 * parameter_count(c)
    assert 1.2e9 < parameter_count(c) < 1.3e9  # Llama-3.2-1B: 1.24B parameters


def test_8b_streams_the_lm_head_but_not_the_embedding_table():
    c = roofline.model_config("llama-8b")
    costs = roofline.op_costs(c, roofline.DEVICES["h200"], batch=1, context=1024)
    table = c.vocab_size * c.hidden_size
    assert sum(x.weight_bytes for x in costs) == 2 * (parameter_count(c) - table)
    assert 8.0e9 < parameter_count(c) < 8.1e9  # Llama-3.1-8B: 8.03B parameters


@pytest.mark.parametrize("batch", [1, 8])
def test_kv_bytes_grow_linearly_with_context(batch):
    c = roofline.model_config("llama-1b")

    def kv(context):
        return sum(x.kv_read + x.kv_write for x in roofline.op_costs(c, roofline.DEVICES["h200"], batch, context))

    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2  # K and V, bf16
    for context in (256, 1024, 4096):
        # read `context` cached tokens, append one row, per sequence
        assert kv(context) == batch * per_token * (context + 1)
    assert kv(2048) - kv(1024) == kv(4096) - kv(3072)


@pytest.mark.parametrize("model", ["llama-1b", "llama-8b"])
@pytest.mark.parametrize("device", ["h200", "mi300x"])
@pytest.mark.parametrize("sync_us", [0.0, 0.9, 5.0])
def test_overlapped_prediction_never_beats_the_floor(model, device, sync_us):
    for batch, context in [(1, 1024), (8, 128), (8, 16384)]:
        _, s = roofline.run(model, device, batch, context, sync_us)
        assert s["floor_us"] <= s["overlapped_us"] * (1 + 1e-9)
        assert s["overlapped_us"] <= s["naive_us"] * (1 + 1e-9)
        assert s["frac_overlapped"] <= 1.0 + 1e-9


def test_attention_items_are_kv_heads_times_partitions():
    c = roofline.model_config("llama-8b")
    costs = roofline.op_costs(c, roofline.DEVICES["h200"], batch=2, context=1000)
    attn = [x for x in costs if x.name == "ATTN_DECODE"]
    assert len(attn) == c.num_hidden_layers
    # partitions halved until 2 items per workgroup (2 x 132 workgroups on H200, one per SM): 256 -> 32
    assert {x.items for x in attn} == {2 * c.num_key_value_heads * 32}  # ceil(1000 / 32)
    long = roofline.op_costs(c, roofline.DEVICES["h200"], batch=2, context=100_000)
    assert {x.items for x in long if x.name == "ATTN_DECODE"} == {2 * c.num_key_value_heads * 391}  # 256-token
    assert not any("COMBINE" in x.name for x in costs)  # merged by each group's last item
    head = [x for x in costs if x.name == "LINEAR lm_head+sample_partial"]  # SAMPLE's first phase in its tails
    assert len(head) == 1 and head[0].items == -(-c.vocab_size // 16) and head[0].weight_bytes > 0
    assert [x.name for x in costs[-2:]] == ["LINEAR lm_head+sample_partial", "SAMPLE"]
    qkv = next(x for x in costs if x.name == "LINEAR qkv+rope+kv_append")
    assert qkv.items == (32 + 2 * 8) * 128 // 2 // 8  # H200: 8 warps x one RoPE pair (2 rows) per item


def test_script_runs_with_json():
    result = json.loads(run_script("--json", "--batch", "1", "--context", "512", "--sync-us", "1.0"))
    assert result["kind"] == "MODEL, not a measurement"
    assert result["sync_us"] == 1.0
    assert {(s["model"], s["device"]) for s in result["summaries"]} == {
        (m, d) for m in ("llama-1b", "llama-8b") for d in ("H200", "MI300X")}
    assert all(s["context"] == 512 and s["batch"] == 1 for s in result["summaries"])


def test_tables_say_model_not_measurement():
    out = run_script("--models", "llama-1b", "--devices", "h200", "--batch", "1")
    assert out.splitlines()[0].startswith("GPU decode roofline -- MODEL, not a measurement")
