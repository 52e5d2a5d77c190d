"""kog.LLM(..., device="cuda", tensor_parallel_size=2): rank r in its own process on GPU r,
prefill's collectives over NCCL (RCCL on ROCm), decode in every rank's persistent kernel (the
collectives peer-memory stores, kog.parallel.gpu_peers; a mixture of experts with its experts
placed over the ranks). Greedy tokens must be
the CPU's of one process in fp32. Needs a GPU build and two devices; never run so far."""

import pytest
import torch

from kog.testing.gpu import gpu_test_marks
from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

pytestmark = gpu_test_marks() + [pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")]

PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 250, 8, 41]}, {"prompt_token_ids": list(range(30, 52))}]


def config_of(arch: str):
    if arch == "laneformer_tp":
        from kog.lane_config import LaneConfig

        return tiny_config("laneformer_tp", num_key_value_heads=4, num_hidden_layers=4,
                           lanes=LaneConfig(num_lanes=4, broadcast_delay=2, lm_head_type="lane"))
    return tiny_config(arch, num_hidden_layers=3)


@pytest.mark.parametrize("arch", ["llama", "laneformer_tp", "qwen3_moe"])
def test_two_gpu_ranks_generate_what_one_cpu_process_generates(tmp_path, arch):
    import kog
    from kog.parallel.ranks import MirroredGpuDecoder

    config = config_of(arch)
    folder = write_hf_model(tmp_path / arch, config, random_weights(config, seed=6))
    greedy = kog.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in kog.LLM(str(folder), dtype="float32").generate(PROMPTS, greedy)]
    llm = kog.LLM(str(folder), dtype="float32", device="cuda", tensor_parallel_size=2, kv_cache_gib=0.05)
    try:
        decoder = llm.engine.runner.native_decoder
        # every family's rank program runs in the kernel (the experts placed over the ranks)
        assert isinstance(decoder, MirroredGpuDecoder), decoder
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        assert got == want
        if decoder is not None:
            assert decoder.wait_timeout() is None
        # the other rank followed every launch and is alive between requests
        assert llm.engine.runner._procs[0].poll() is None
    finally:
        llm.engine.runner.close()
