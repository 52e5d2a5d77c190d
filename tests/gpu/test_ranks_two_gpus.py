"""Tensor-parallel ranks inside the persistent kernel across processes: rank r in its own process
on GPU r, the ranks' inboxes and flags shared through IPC handles exchanged over
torch.distributed (kog.parallel.gpu_peers.connect_gpu_ranks). Every rank must produce the greedy
tokens of the whole (lane-form) model decoded by the CPU executor in one process. Needs a GPU
build and two devices; never run so far."""

import os
import socket

import numpy as np
import pytest
import torch

from kog.testing.gpu import gpu_test_marks

pytestmark = gpu_test_marks() + [pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")]

BS, STEPS, FIRST = 16, 24, 5


def model():
    from kog.parallel.shard import lane_form
    from kog.testing.tiny_models import random_weights, tiny_config

    config = lane_form(tiny_config("llama", max_position_embeddings=256), 2)
    return config, random_weights(config, seed=9)


def cpu_tokens() -> list[int]:
    from kog.loader import LoadedModel
    from kog.models import ModelRunner

    config, weights = model()
    full = ModelRunner(LoadedModel(path=None, config=config, weights=weights, dtype=torch.float32, tokenizer=None,
                                   chat_template=None, stop_token_ids=()), num_kv_blocks=8, block_size=BS)
    table, tok, out = np.arange(2, dtype=np.int32)[None], np.array([FIRST]), []
    for p in range(STEPS):
        full.decode(tok, [p], table, [p + 1], [int(table[0, p // BS]) * BS + p % BS], sampled=tok)
        out.append(int(tok[0]))
    return out


def rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from kog import ops
    from kog.models.gpu_decode import GpuDecoder
    from kog.models.weights import prepare_weights
    from kog.parallel.gpu_peers import connect_gpu_ranks
    from kog.parallel.shard import shard_config, shard_weights

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        config, weights = model()
        local = shard_config(config, rank, 2)
        w = {k: v.to(device) for k, v in prepare_weights(local, shard_weights(local, weights), torch.float32).items()}
        kv = torch.zeros(local.num_hidden_layers, 8, 2, local.num_key_value_heads, BS, local.head_dim,
                         dtype=torch.float32, device=device)
        dec = GpuDecoder(local, w, kv, BS, ops.rope_inv_freq(local.head_dim, local.rope_theta, local.rope_scaling))
        segment = connect_gpu_ranks(dec, rank, 2)
        dist.barrier()  # every rank connected before any kernel pushes
        res = dec.decode([FIRST], [0], np.arange(2, dtype=np.int32)[None], n_steps=STEPS)
        torch.cuda.synchronize(device)
        results[rank] = (res.tokens[:, 0].cpu().tolist(), dec.wait_timeout())
        dist.barrier()  # no rank unmaps a segment another may still read
        del segment
    finally:
        dist.destroy_process_group()


def test_two_ranks_on_two_gpus_decode_the_tokens_of_one_process():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(rank_main, args=(port, results), nprocs=2, join=True)
    expected = cpu_tokens()
    for rank in range(2):
        tokens, timeout = results[rank]
        assert timeout is None, (rank, timeout)
        assert tokens == expected, rank
