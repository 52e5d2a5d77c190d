"""4-bit weights on the GPU (kog.int4: WEIGHT_Q4_GROUPS from Q4_0 / Q4_1, WEIGHT_Q4_K): the
standalone 4-bit GEMV against the plain reference, and whole decode steps of the persistent
kernel with Q4_0 / Q4_1 / Q4_K linear matrices against the CPU executor running the same values
dequantized. Fresh random inputs each run."""

import gguf
import pytest
import torch

import kog
from kog import ops
from kog.int4 import from_quantized
from kog.loader import LoadedModel
from kog.loader.gguf_write import quantize_q4_k
from kog.models import ModelRunner
from kog.models.gpu_decode import GpuDecoder
from kog.models.weights import prepare_weights
from kog.quantized import QuantizedWeight
from kog.testing import reference as ref
from kog.testing.gpu import gpu_test_marks
from kog.testing.tiny_models import random_weights, tiny_config

from test_persistent_decode_gpu import BS, decode_step_vs_cpu

pytestmark = gpu_test_marks()
Q = gguf.GGMLQuantizationType


def quantize(w: torch.Tensor, name: str) -> QuantizedWeight:
    x = w.float().numpy()
    blocks = quantize_q4_k(x) if name == "Q4_K" else gguf.quants.quantize(x, Q[name])
    return QuantizedWeight(torch.from_numpy(blocks), int(Q[name]), w.shape[1])


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (3, 130, 512), (8, 64, 1280), (11, 257, 768)])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("bias", [False, True])
def test_q4_gemv_matches_reference(device, dtype, rtol, m, n, k, fmt, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = from_quantized(quantize(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen), fmt))
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = ops.linear_q4(x.to(device), w.to(device), b.to(device) if bias else None).cpu()
    want = ref.linear_q4(x, w, b)
    assert (got.float() - want.float()).abs().max() <= rtol * want.float().abs().max()


def test_q4_k_groups_use_their_own_scales(device):
    """Each group's scale, not its neighbour's: zeroing one Q4_K super-block's header (d = dmin =
    0) zeroes exactly that block's 256 columns of the products."""
    gen = torch.Generator().manual_seed(4)
    w = from_quantized(quantize(torch.randn(64, 512, generator=gen), "Q4_K"))
    w.groups[:, 16:32] = 0  # super-block 1 of every row
    x = torch.zeros(1, 512)
    x[0, 256:] = torch.randn(256, generator=gen)
    got = ops.linear_q4(x.to(device), w.to(device)).cpu()
    assert got.abs().max() == 0
    x[0, :256] = 1.0
    got = ops.linear_q4(x.to(device), w.to(device)).cpu()
    torch.testing.assert_close(got, ref.linear_q4(x, w), rtol=1e-5, atol=1e-5)


LINEAR_FORMATS = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_0", "o_proj": "Q4_1", "gate_proj": "Q4_1",
                  "up_proj": "Q4_1", "down_proj": "Q4_K"}


def q4_runners(arch: str, dtype: torch.dtype, device):
    """(CPU runner over the 4-bit values dequantized, GpuDecoder weights holding the blocks) of one
    tiny model (intermediate 256, so the MLP's down matrix is whole Q4_K super-blocks)."""
    config = tiny_config(arch, max_position_embeddings=1024, intermediate_size=256)
    weights = {k: v.to(dtype) for k, v in random_weights(config, seed=11).items()}
    blocks = {k: quantize(v, LINEAR_FORMATS[k.split(".")[-2]]) if k.split(".")[-2] in LINEAR_FORMATS
              and k.endswith(".weight") else v for k, v in weights.items()}
    plain = {k: v.dequantize().to(dtype) if isinstance(v, QuantizedWeight) else v for k, v in blocks.items()}
    cpu_model = LoadedModel(path=None, config=config, weights=plain, dtype=dtype, tokenizer=None, chat_template=None,
                            stop_token_ids=())
    r = ModelRunner(cpu_model, num_kv_blocks=256, block_size=BS)
    prepared = prepare_weights(config, blocks, dtype)
    return r, {k: v.with_data(v.data.to(device)) if isinstance(v, QuantizedWeight) else v.to(device)
               for k, v in prepared.items()}


@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("lens", [[5], [300, 17, 600]])
def test_q4_decode_step_matches_cpu_executor(device, arch, dtype, rtol, lens):
    r, q4 = q4_runners(arch, dtype, device)
    got, expected = decode_step_vs_cpu(r, q4, device, lens)
    assert (got - expected).abs().max() <= rtol * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_q4_weights_need_bf16_activations(device, dtype):
    r, q4 = q4_runners("llama", dtype, device)
    with pytest.raises(kog.InvalidRequest, match="4-bit GPU weights run with bfloat16 activations"):
        GpuDecoder(r.config, q4, r.kv.kv.to(device), BS, r.inv_freq)
