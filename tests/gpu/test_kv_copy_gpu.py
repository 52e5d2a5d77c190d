"""GPU KV block copies (copy-on-write inside the device pool, swap through pinned host memory)
against the CPU copy of the same moves: bit-exact."""

import numpy as np
import pytest
import torch

from kog.kvcache import KVCacheStorage, KVLayout
from kog.testing.gpu import gpu_test_marks

pytestmark = gpu_test_marks()


class Moves:  # the fields KVCacheStorage.apply reads
    def __init__(self, swap_out=(), swap_in=(), cow=()):
        self.swap_out = np.asarray(swap_out, dtype=np.int32).reshape(-1, 2)
        self.swap_in = np.asarray(swap_in, dtype=np.int32).reshape(-1, 2)
        self.cow = np.asarray(cow, dtype=np.int32).reshape(-1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 6])  # 6: slabs not a multiple of 16 bytes (byte path)
def test_cow_and_swap_round_trip_match_cpu(device, dtype, head_dim):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype)
    gpu = KVCacheStorage(layout, num_blocks=10, num_host_blocks=6, device=device)
    cpu = KVCacheStorage(layout, num_blocks=10, num_host_blocks=6, device="cpu")
    init = torch.randn(layout.shape(10), generator=torch.Generator().manual_seed(0)).to(dtype)
    gpu.kv.copy_(init)
    cpu.kv.copy_(init)
    steps = [Moves(cow=[(1, 7), (2, 8)]), Moves(swap_out=[(3, 0), (4, 5), (7, 2)]),
             Moves(swap_in=[(5, 9), (0, 3)], cow=[(9, 4)])]
    for m in steps:
        gpu.apply(m)
        cpu.apply(m)
    torch.cuda.synchronize()
    assert torch.equal(gpu.kv.cpu(), cpu.kv)
    assert torch.equal(gpu.host, cpu.host)


def test_bad_block_ids_raise_before_any_copy(device):
    import kog

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    gpu = KVCacheStorage(layout, num_blocks=4, device=device)
    before = gpu.kv.clone()
    with pytest.raises(kog.InvalidRequest, match="out of range"):
        gpu.apply(Moves(cow=[(0, 1), (2, 9)]))
    torch.cuda.synchronize()
    assert torch.equal(gpu.kv, before)
