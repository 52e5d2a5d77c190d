"""One tensor-parallel rank of test_tensor_parallel's gloo test, as its own process:

    python tp_rank_worker.py RANK SIZE PORT VARIANT OUT.pt

joins a gloo group on 127.0.0.1:PORT, runs the test's token sequence on its shard and saves
the logits to OUT.pt.
"""

import sys

import torch
import torch.distributed

from kog.parallel.transport import init_gloo
from kog.testing.tiny_models import random_weights
from test_laneformer import VARIANTS, lane_model_config
from test_tensor_parallel import rank_runner, run_sequence

if __name__ == "__main__":
    rank, size, port, variant, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    config = lane_model_config(**VARIANTS[variant])
    transport = init_gloo(rank, size, "127.0.0.1", port, timeout_s=60)
    torch.save(run_sequence(rank_runner(config, random_weights(config, seed=9), rank, size, transport)), out)
    torch.distributed.barrier()  # the peer is done with the group too
    torch.distributed.destroy_process_group()  # gloo's threads must not outlive the interpreter
