"""The persistent decode kernel (one launch per step, or per n_steps tokens) against the CPU
executor on the same tiny random-weight models, fresh inputs each run."""

import dataclasses

import numpy as np
import pytest
import torch

from kog.loader import LoadedModel
from kog.models import ModelRunner, PrefillChunk
from kog.models.gpu_decode import DeviceSampling, GpuDecoder
from kog.testing.gpu import gpu_test_marks
from kog.testing.tiny_models import random_weights, tiny_config

pytestmark = gpu_test_marks()

BS = 16


def cpu_runner(arch: str, dtype: torch.dtype, num_blocks: int = 256, seed: int = 5, **overrides) -> ModelRunner:
    config = tiny_config(arch, **overrides)
    weights = {k: v.to(dtype) for k, v in random_weights(config, seed=seed).items()}
    model = LoadedModel(path=None, config=config, weights=weights, dtype=dtype, tokenizer=None,
                        chat_template=None, stop_token_ids=())
    return ModelRunner(model, num_kv_blocks=num_blocks, block_size=BS)


def prefill(r: ModelRunner, prompts: list[list[int]]) -> np.ndarray:
    """Prefills each prompt into its own run of blocks; returns the block tables [B, width]."""
    width = r.kv.kv.shape[1] // len(prompts)
    tables = np.arange(len(prompts) * width, dtype=np.int32).reshape(len(prompts), width)[:, ::-1].copy()
    for p, t in zip(prompts, tables):
        slots = t[np.arange(len(p)) // BS] * BS + np.arange(len(p)) % BS
        r.prefill([PrefillChunk(p, 0, t, slots.astype(np.int64))])
    return tables


def gpu_decoder(r: ModelRunner, device) -> GpuDecoder:
    weights = {k: v.to(device) for k, v in r.weights.items()}
    return GpuDecoder(r.config, weights, r.kv.kv.to(device), BS, r.inv_freq)


def decode_step_vs_cpu(r: ModelRunner, weights: dict, device, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(GPU logits, CPU logits) [B, vocab] of one decode step after random prompts of `lens`
    tokens: the CPU runner's executor, and a GpuDecoder over `weights` (on the device; r's
    values in another storage: FP8, 4-bit) reading the cache r prefilled."""
    gen = torch.Generator().manual_seed(sum(lens))
    prompts = [torch.randint(0, r.vocab_size, (n,), generator=gen).tolist() for n in lens]
    tables = prefill(r, prompts)
    dec = GpuDecoder(r.config, weights, r.kv.kv.to(device), BS, r.inv_freq)
    tokens = [p[-1] for p in prompts]
    positions = np.array(lens)
    slots = tables[np.arange(len(lens)), positions // BS] * BS + positions % BS
    expected = r.decode(tokens, positions, tables, positions + 1, slots)
    return dec.decode(tokens, positions, tables).logits.cpu(), expected


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("lens", [[5], [300, 17, 600]])  # 600 tokens: three attention partitions
def test_one_step_logits_match_cpu_executor(device, arch, dtype, rtol, lens):
    r = cpu_runner(arch, dtype, max_position_embeddings=1024)  # the tiny model's 256 would refuse 600
    gen = torch.Generator().manual_seed(sum(lens))
    prompts = [torch.randint(0, r.vocab_size, (n,), generator=gen).tolist() for n in lens]
    tables = prefill(r, prompts)
    dec = gpu_decoder(r, device)  # the KV cache as prefilled, before the CPU decode writes to it
    tokens = [p[-1] for p in prompts]
    positions = np.array(lens)
    slots = tables[np.arange(len(lens)), positions // BS] * BS + positions % BS
    expected = r.decode(tokens, positions, tables, positions + 1, slots)
    got = dec.decode(tokens, positions, tables).logits.cpu()
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= rtol * scale


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [7, 100, 260])  # inside a block; partitions wholly before it; across them
def test_sliding_window_logits_match_cpu_executor(device, dtype, rtol, window):
    r = cpu_runner("mistral", dtype, max_position_embeddings=1024, sliding_window=window)
    gen = torch.Generator().manual_seed(window)
    lens = [300, 17, 600]
    prompts = [torch.randint(0, r.vocab_size, (n,), generator=gen).tolist() for n in lens]
    tables = prefill(r, prompts)
    dec = gpu_decoder(r, device)
    tokens, positions = [p[-1] for p in prompts], np.array(lens)
    slots = tables[np.arange(len(lens)), positions // BS] * BS + positions % BS
    expected = r.decode(tokens, positions, tables, positions + 1, slots)
    got = dec.decode(tokens, positions, tables).logits.cpu()
    assert (got - expected).abs().max() <= rtol * expected.abs().max()


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("lens", [[5], [300, 17, 600], [9, 10, 11, 12, 13, 14, 15, 16]])
def test_moe_one_step_logits_match_cpu_executor(device, arch, dtype, rtol, lens):
    """Router GEMV + route tail, expert GEMVs over groups of rows, combine: the CPU executor's
    logits. Batch 8 over 4 experts (top 2): rows share experts, so groups hold several rows."""
    r = cpu_runner(arch, dtype, max_position_embeddings=1024)
    got, expected = decode_step_vs_cpu(r, {k: v.to(device) for k, v in r.weights.items()}, device, lens)
    assert (got - expected).abs().max() <= rtol * expected.abs().max()


def lane_runner(variant: str, dtype: torch.dtype, num_blocks: int = 256) -> ModelRunner:
    """A tiny Laneformer (tests/cpu/test_laneformer.py's variants) on the CPU."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "cpu"))
    from test_laneformer import VARIANTS, lane_model_config

    config = dataclasses.replace(lane_model_config(**VARIANTS[variant]), max_position_embeddings=1024)
    weights = {k: v.to(dtype) for k, v in random_weights(config, seed=7).items()}
    model = LoadedModel(path=None, config=config, weights=weights, dtype=dtype, tokenizer=None,
                        chat_template=None, stop_token_ids=())
    return ModelRunner(model, num_kv_blocks=num_blocks, block_size=BS)


LANE_GPU_VARIANTS = ["delay1", "delay2_4lanes_lane_scale_lane_head", "no_comm", "no_early_comm", "pre_norm_agg",
                     "vocab_parallel", "delay0_tied", "window_first_layers"]


# Every variant in f32 over three sequences (one of 5 tokens would add little); two in bf16. Few
# cases: bench/device_check.sh gives all decode tests one minute.
LANE_GPU_CASES = [(v, torch.float32, 1e-3) for v in LANE_GPU_VARIANTS] + [
    (v, torch.bfloat16, 3e-2) for v in ("delay1", "delay2_4lanes_lane_scale_lane_head")]


@pytest.mark.parametrize("variant,dtype,rtol", LANE_GPU_CASES)
@pytest.mark.parametrize("lens", [[300, 17, 600]])
def test_lane_one_step_logits_match_cpu_executor(device, variant, dtype, rtol, lens):
    """Laneformer in the persistent kernel: lane GEMVs (each row its lane's slice of x, fused
    gate/up and RoPE/cache forms), lane-wide norms, LANE_SCALE / SUM / GATHER / ADD_PAST / MEAN /
    MERGE_SUM, the four head layouts: the CPU executor's logits."""
    r = lane_runner(variant, dtype)
    got, expected = decode_step_vs_cpu(r, {k: v.to(device) for k, v in r.weights.items()}, device, lens)
    assert (got - expected).abs().max() <= rtol * expected.abs().max()


def assert_loop_mode_greedy_tokens_match_cpu(r: ModelRunner, device, seed: int, steps: int) -> None:
    """One launch of `steps` decode steps (the kernel's loop mode) after a random 40-token prompt:
    the CPU executor's greedy tokens, one step at a time."""
    prompt = torch.randint(0, r.vocab_size, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    tables = prefill(r, [prompt])
    dec = gpu_decoder(r, device)
    expected, tok = [], np.array([prompt[-1]])
    for i in range(steps):
        p = len(prompt) + i
        slot = tables[0, p // BS] * BS + p % BS
        r.decode(tok, [p], tables, [p + 1], [slot], sampled=tok)
        expected.append(int(tok[0]))
    res = dec.decode([prompt[-1]], [len(prompt)], tables, n_steps=steps)
    assert res.tokens[:, 0].cpu().tolist() == expected


@pytest.mark.parametrize("variant", ["delay1", "delay2_4lanes_lane_scale_lane_head"])
def test_lane_loop_mode_greedy_tokens_match_cpu(device, variant):
    assert_loop_mode_greedy_tokens_match_cpu(lane_runner(variant, torch.float32), device, seed=3, steps=24)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_loop_mode_greedy_tokens_match_cpu(device, arch):
    assert_loop_mode_greedy_tokens_match_cpu(cpu_runner(arch, torch.float32), device, seed=2, steps=24)


def test_loop_mode_greedy_tokens_match_cpu(device):
    assert_loop_mode_greedy_tokens_match_cpu(cpu_runner("llama", torch.float32), device, seed=1, steps=32)


def test_stop_ids_finish_a_sequence_on_the_device(device):
    r = cpu_runner("llama", torch.float32)
    prompt = list(range(1, 30))
    tables = prefill(r, [prompt])
    first = gpu_decoder(r, device).decode([prompt[-1]], [len(prompt)], tables, n_steps=8).tokens[:, 0].cpu()
    stop = int(first[2])
    # The kernel leaves the steps after the last sequence finished unwritten: the allocator may hand
    # the stop run the first run's token memory, so those steps read -1 only if decode() filled them.
    res = gpu_decoder(r, device).decode([prompt[-1]], [len(prompt)], tables, n_steps=8, stop_ids=[stop])
    toks = res.tokens[:, 0].cpu().tolist()
    k = toks.index(stop)
    assert toks[: k + 1] == first[: k + 1].tolist() and toks[k + 1 :] == [-1] * (7 - k)
    assert int(res.finished[0]) == 1


def test_finished_sequence_reads_minus_one_while_others_run(device):
    r = cpu_runner("llama", torch.float32)
    prompts = [list(range(1, 30)), list(range(40, 90))]
    tables = prefill(r, prompts)
    last, pos = [p[-1] for p in prompts], [len(p) for p in prompts]
    free = gpu_decoder(r, device).decode(last, pos, tables, n_steps=8).tokens.cpu()
    row0, row1 = free[:, 0].tolist(), free[:, 1].tolist()
    k = next((i for i in range(1, 7) if row0[i] not in row1 and row0[i] not in row0[:i]), None)
    if k is None:
        pytest.skip(f"no stop id ends row 0 alone: {row0} / {row1}")
    res = gpu_decoder(r, device).decode(last, pos, tables, n_steps=8, stop_ids=[row0[k]])
    toks = res.tokens.cpu()
    assert toks[:, 0].tolist() == row0[: k + 1] + [-1] * (7 - k)
    assert toks[:, 1].tolist() == row1  # the other row runs all 8 steps
    assert res.finished.cpu().tolist() == [1, 0]


def test_sampling_is_seeded_and_respects_top_k(device):
    r = cpu_runner("llama", torch.float32)
    prompt = list(range(3, 50))
    tables = prefill(r, [prompt])
    dec = gpu_decoder(r, device)
    pos = len(prompt)
    greedy = dec.decode([prompt[-1]], [pos], tables)
    top5 = set(greedy.logits[0].topk(5).indices.tolist())
    draws = []
    for seed in range(40):
        s = DeviceSampling(temperature=1.5, top_k=5, seed=seed)
        a = dec.decode([prompt[-1]], [pos], tables, sampling=[s]).tokens[0, 0].item()
        b = dec.decode([prompt[-1]], [pos], tables, sampling=[s]).tokens[0, 0].item()
        assert a == b  # same (seed, counter): same token
        draws.append(a)
    assert set(draws) <= top5 and len(set(draws)) > 1
    k1 = dec.decode([prompt[-1]], [pos], tables, sampling=[DeviceSampling(temperature=1.0, top_k=1, seed=3)])
    assert k1.tokens[0, 0].item() == greedy.tokens[0, 0].item()


def test_bad_batch_is_refused(device):
    r = cpu_runner("llama", torch.float32)
    dec = gpu_decoder(r, device)
    import kog

    with pytest.raises(kog.InvalidRequest):
        dec.decode(list(range(9)), list(range(9)), np.zeros((9, 4), dtype=np.int32))
    with pytest.raises(kog.InvalidRequest):
        dec.decode([1], [100], np.zeros((1, 2), dtype=np.int32))  # tables too short


_LOST_SIGNAL = r"""
import json, sys
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
from test_persistent_decode_gpu import cpu_runner, gpu_decoder, prefill
r = cpu_runner("llama", torch.float32)
tables = prefill(r, [[1, 2, 3, 4, 5]])
dec = gpu_decoder(r, torch.device("cuda"))
dec._executor.set_wait_timeout_ms(50)
dec._executor.set_debug_skip_signal_op(int(sys.argv[2]))
error = None
try:
    dec.decode([5], np.array([5]), tables)
    torch.cuda.synchronize()
except RuntimeError as e:
    error = str(e)[:300]
print(json.dumps({"error": error, "timeout": dec.wait_timeout()}))
"""


@pytest.mark.parametrize("skipped", [0, 5])
def test_a_lost_signal_traps_with_its_wait_recorded_instead_of_hanging(device, skipped, tmp_path):
    """The watchdog: op `skipped`'s items never signal, so a wait on it (or on an op after it)
    outlives its 50 ms bound, records where and traps: the launch fails instead of hanging. In a
    subprocess, since the trap loses the GPU context."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "lost_signal.py"
    script.write_text(_LOST_SIGNAL)
    done = subprocess.run([sys.executable, str(script), str(Path(__file__).parent), str(skipped)],
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert lines, done.stderr[-2000:]
    got = json.loads(lines[-1])
    assert got["error"] is not None, got  # the launch failed (the trap)
    t = got["timeout"]
    assert t is not None and t["step"] == 0 and t["op"] >= skipped and t["count"] < t["target"], t
