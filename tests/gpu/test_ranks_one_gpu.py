"""Tensor-parallel ranks inside the persistent kernel, on ONE GPU: each rank's decoder a launch
of its own on its own stream, the grids sized so that all are resident at once, the ranks'
inboxes and flags plain device memory (docs/GPU.md, "Tensor parallelism inside the persistent
kernel"). Every rank must produce the greedy tokens of the whole (lane-form) model decoded by
the CPU executor in one process. Needs a GPU build and a device; never run so far."""

import numpy as np
import pytest
import torch

from kog.loader import LoadedModel
from kog.models import ModelRunner
from kog.models.gpu_decode import GpuDecoder
from kog.models.weights import prepare_weights
from kog.parallel.shard import lane_form, shard_config, shard_weights
from kog.testing.gpu import gpu_test_marks
from kog.testing.tiny_models import random_weights, tiny_config

pytestmark = gpu_test_marks()

BS = 16


def models():
    from kog.lane_config import LaneConfig

    return {
        "llama": (lane_form(tiny_config("llama", max_position_embeddings=256), 2), 2),
        "laneformer_delay1": (tiny_config("laneformer_tp", max_position_embeddings=256), 2),
        # experts placed over the ranks, a shared expert's slices too (MoeScratch::expert_local)
        "qwen2_moe": (lane_form(tiny_config("qwen2_moe", max_position_embeddings=256), 2), 2),
        "qwen3_moe": (lane_form(tiny_config("qwen3_moe", max_position_embeddings=256), 2), 2),
        "laneformer_lane_head": (tiny_config("laneformer_tp", max_position_embeddings=256, num_key_value_heads=4,
                                             num_hidden_layers=4, lanes=LaneConfig(
                                                 num_lanes=4, broadcast_delay=2, lm_head_type="lane")), 2),
    }


@pytest.mark.parametrize("name", ["llama", "laneformer_delay1", "laneformer_lane_head", "qwen2_moe", "qwen3_moe"])
def test_ranks_on_one_gpu_decode_the_tokens_of_one_process(device, name):
    config, size = models()[name]
    weights = random_weights(config, seed=9)
    full = ModelRunner(LoadedModel(path=None, config=config, weights=weights, dtype=torch.float32, tokenizer=None,
                                   chat_template=None, stop_token_ids=()), num_kv_blocks=8, block_size=BS)
    steps, first = 24, 5
    table = np.arange(2, dtype=np.int32)[None]  # 32 positions
    expected, tok = [], np.array([first])
    for p in range(steps):
        full.decode(tok, [p], table, [p + 1], [int(table[0, p // BS]) * BS + p % BS], sampled=tok)
        expected.append(int(tok[0]))

    decoders = []
    for r in range(size):
        local = shard_config(config, r, size)
        w = {k: v.to(device) for k, v in prepare_weights(local, shard_weights(local, weights), torch.float32).items()}
        kv = torch.zeros(local.num_hidden_layers, 8, 2, local.num_key_value_heads, BS, local.head_dim,
                         dtype=torch.float32, device=device)
        decoders.append(GpuDecoder(local, w, kv, BS, full.inv_freq))
    inboxes = [torch.zeros(d.inbox_bytes, dtype=torch.uint8, device=device) for d in decoders]
    flags = [torch.zeros(d.flag_count, dtype=torch.int64, device=device) for d in decoders]
    for d in decoders:
        d.connect_ranks([b.data_ptr() for b in inboxes], [f.data_ptr() for f in flags])
        d.set_max_grid(d.grid_size // size)
    staged = [d.stage([first], [0], table, n_steps=steps) for d in decoders]
    streams = [torch.cuda.Stream(device) for _ in decoders]
    for d, s, stream in zip(decoders, staged, streams):
        with torch.cuda.stream(stream):
            d.launch(s)
    torch.cuda.synchronize(device)
    for r, (d, s) in enumerate(zip(decoders, staged)):
        assert d.wait_timeout() is None, (r, d.wait_timeout())
        assert s.result.tokens[:, 0].cpu().tolist() == expected, r
