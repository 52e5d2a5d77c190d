"""FP8 e4m3 weights on the GPU (kog._C.WEIGHT_FP8): the standalone FP8 GEMV against the plain
reference, and whole decode steps of the persistent kernel with FP8 linear matrices against the
CPU executor running the same FP8 values dequantized. Fresh random inputs each run."""

import pytest
import torch

from kog import ops
from kog.fp8 import gpu_format, quantize
from kog.loader import LoadedModel
from kog.loader.fp8_checkpoint import quantize_linears
from kog.models import ModelRunner
from kog.models.gpu_decode import GpuDecoder
from kog.models.weights import prepare_weights
from kog.testing import reference as ref
from kog.testing.gpu import gpu_test_marks
from kog.testing.tiny_models import random_weights, tiny_config

from test_persistent_decode_gpu import BS, decode_step_vs_cpu

pytestmark = gpu_test_marks()


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (3, 130, 256), (8, 64, 1040), (11, 257, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_matches_reference(device, dtype, rtol, m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = quantize(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen), gpu_format())
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = ops.linear_fp8(x.to(device), w.to(device), b.to(device) if bias else None).cpu()
    want = ref.linear_fp8(x, w.data, w.scale, w.fmt, b)
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= rtol * scale


def test_fp8_gemv_reads_the_targets_encoding(device):
    """The kernel's decode is the vendor's encoding: the same bits read in the other encoding
    are off by a factor 2, so a wrong bias in gpu/vendor/*.h fails here."""
    gen = torch.Generator().manual_seed(9)
    w = quantize(torch.randn(64, 128, generator=gen), gpu_format())
    x = torch.randn(2, 128, generator=gen)
    got = ops.linear_fp8(x.to(device), w.to(device)).cpu()
    other = "e4m3fnuz" if w.fmt == "e4m3fn" else "e4m3fn"
    torch.testing.assert_close(got, ref.linear_fp8(x, w.data, w.scale, w.fmt), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, ref.linear_fp8(x, w.data, w.scale, other), rtol=0.1)


def fp8_runners(arch: str, dtype: torch.dtype, device):
    """(CPU runner over the FP8 values dequantized, GpuDecoder over the FP8 matrices) of one tiny
    model: quantize_linears is deterministic, so both hold the same values."""
    config = tiny_config(arch, max_position_embeddings=1024)
    weights = {k: v.to(dtype) for k, v in random_weights(config, seed=11).items()}
    cpu_model = LoadedModel(path=None, config=config, weights=quantize_linears(weights, dtype, None), dtype=dtype,
                            tokenizer=None, chat_template=None, stop_token_ids=())
    r = ModelRunner(cpu_model, num_kv_blocks=256, block_size=BS)
    fp8 = prepare_weights(config, quantize_linears(weights, dtype, gpu_format()), dtype)
    return r, {k: v.to(device) for k, v in fp8.items()}


@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("lens", [[5], [300, 17, 600]])
def test_fp8_decode_step_matches_cpu_executor(device, arch, dtype, rtol, lens):
    r, fp8 = fp8_runners(arch, dtype, device)
    got, expected = decode_step_vs_cpu(r, fp8, device, lens)
    assert (got - expected).abs().max() <= rtol * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_weights_need_bf16_activations(device, dtype):
    """The kernel has one instantiation with the quantized GEMVs, for bf16 runs (persistent_kernel_quant.cu)."""
    import kog

    r, fp8 = fp8_runners("llama", dtype, device)
    with pytest.raises(kog.InvalidRequest, match="FP8 and 4-bit weights run with bfloat16 activations"):
        GpuDecoder(r.config, fp8, r.kv.kv.to(device), BS, r.inv_freq)
