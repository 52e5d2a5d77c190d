"""ModelRunner on a GPU (prefill through the GPU ops + torch GEMMs, decode through the persistent
kernel) against the same model on the CPU, and the engine on top of it."""

import pytest
import torch

from kog.engine import EngineConfig, LLMEngine
from kog.loader import LoadedModel
from kog.models import ModelRunner, PrefillChunk
from kog.sampling_params import SamplingParams
from kog.testing.gpu import gpu_test_marks
from kog.testing.greedy import runner_greedy
from kog.testing.tiny_models import random_weights, tiny_config, tiny_tokenizer

pytestmark = gpu_test_marks()


def model(arch: str, dtype=torch.float32) -> LoadedModel:
    c = tiny_config(arch, max_position_embeddings=1024)
    w = {k: v.to(dtype) for k, v in random_weights(c, seed=11).items()}
    return LoadedModel(path=None, config=c, weights=w, dtype=dtype, tokenizer=tiny_tokenizer(),
                       chat_template=None, stop_token_ids=(2,))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_logits_match_cpu(device, arch):
    m = model(arch)
    cpu, gpu = ModelRunner(m, 64), ModelRunner(m, 64, device=device)
    prompt = torch.randint(3, m.config.vocab_size, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    table = list(range(19, 0, -1))
    slots = [table[p // 16] * 16 + p % 16 for p in range(300)]
    a = cpu.prefill([PrefillChunk(prompt, 0, table, slots)])
    b = gpu.prefill([PrefillChunk(prompt, 0, table, slots)])
    assert b.device.type == "cpu" and (a - b).abs().max() <= 1e-3 * a.abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_ids_match_cpu(device, arch):
    m = model(arch)
    prompt = list(range(5, 45))
    assert runner_greedy(ModelRunner(m, 64, device=device), prompt, 32) == runner_greedy(ModelRunner(m, 64), prompt, 32)


def test_engine_batches_more_sequences_than_one_launch_holds(device):
    m = model("llama")
    outs = {}
    for dev in ("cpu", device):
        runner = ModelRunner(m, 256, device=dev)
        engine = LLMEngine(runner, m.tokenizer, (2,), 1024, EngineConfig(max_num_seqs=12))
        for i in range(11):  # > GPU_DECODE_MAX_BATCH: two launches per step
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # greedy: comparable
            engine.add_request(str(i), list(range(3 + i, 20 + 2 * i)), params)
        while engine.has_unfinished():
            engine.step()
        outs[str(dev)] = [engine.get_output(str(i)).outputs[0].token_ids for i in range(11)]
        assert engine.kv.stats()["num_sequences"] == 0
    assert outs["cpu"] == outs[str(device)]


def test_llm_on_the_gpu_generates_what_the_cpu_does(device, tmp_path):
    import kog
    from kog.testing.tiny_models import write_hf_model

    c = tiny_config("llama", max_position_embeddings=1024)
    folder = write_hf_model(tmp_path / "m", c, random_weights(c, seed=4))
    params = kog.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)  # the default samples at 1.0
    cpu = kog.LLM(str(folder), device="cpu").generate(["hello world", "one two three"], params)
    gpu = kog.LLM(str(folder), device="cuda").generate(["hello world", "one two three"], params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_runner_keeps_a_4_bit_gguf_4_bit_on_the_gpu(device, tmp_path, qtype):
    """A Q4_0 / Q4_1 GGUF on the GPU (dtype None): its matrices stay 4-bit (the decode kernel's
    4-bit GEMV; prefill multiplies dequantized tiles) with bf16 activations, and computes what
    the same file dequantized to bf16 at load does: prefill on the same values, decode within
    the rounding of the dequantized copy's bf16 weights."""
    from kog.int4 import Int4Weight
    from kog.loader import load_model
    from kog.testing.tiny_models import write_gguf_model

    c = tiny_config("llama", intermediate_size=256, max_position_embeddings=1024)
    path = write_gguf_model(tmp_path / "m.gguf", c, random_weights(c, seed=4), qtype)
    kept = ModelRunner(load_model(path, device=device), 64, device=device)
    wide = ModelRunner(load_model(path, "bfloat16", device=device), 64, device=device)
    assert kept.dtype == torch.bfloat16 and any(isinstance(w, Int4Weight) for w in kept.weights.values())
    assert kept.weight_bytes < 0.6 * wide.weight_bytes
    prompt = torch.randint(3, c.vocab_size, (70,), generator=torch.Generator().manual_seed(9)).tolist()
    table = list(range(8))
    chunk = PrefillChunk(prompt, 0, table, [table[p // 16] * 16 + p % 16 for p in range(70)])
    a, b = kept.prefill([chunk]), wide.prefill([chunk])
    assert (a - b).abs().max() <= 1e-3 * b.abs().max()
    ids_kept, ids_wide = runner_greedy(kept, prompt, 16), runner_greedy(wide, prompt, 16)
    assert ids_kept[:8] == ids_wide[:8], (ids_kept, ids_wide)


def test_llm_on_the_gpu_generates_from_a_q4_gguf(device, tmp_path):
    import kog
    from kog.testing.tiny_models import write_gguf_model

    c = tiny_config("llama", intermediate_size=256, max_position_embeddings=1024)
    path = write_gguf_model(tmp_path / "m.gguf", c, random_weights(c, seed=6), "Q4_1")
    params = kog.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = kog.LLM(str(path), device="cuda").generate(["hello world", "one two three"], params)
    assert [len(o.outputs[0].token_ids) for o in out] == [12, 12]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "laneformer_tp"])
def test_moe_and_lane_models_decode_on_the_gpu_with_the_cpus_tokens(device, arch):
    """Mixture of experts decodes in the persistent kernel (router, expert GEMVs and combine as
    its ops), and so do Laneformer lanes (lane GEMVs, lane-wide norms, the LANE_* ops). Greedy
    tokens equal the CPU's."""
    if arch == "laneformer_tp":
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parents[1] / "cpu"))
        from test_laneformer import VARIANTS, lane_model_config

        c = lane_model_config(**VARIANTS["delay1"])
    else:
        c = tiny_config(arch, max_position_embeddings=1024)
    w = random_weights(c, seed=13)
    m = LoadedModel(path=None, config=c, weights=w, dtype=torch.float32, tokenizer=tiny_tokenizer(),
                    chat_template=None, stop_token_ids=(2,))
    gpu = ModelRunner(m, 64, device=device)
    assert gpu.native_decoder is not None
    prompt = list(range(5, 45))
    assert runner_greedy(gpu, prompt, 16) == runner_greedy(ModelRunner(m, 64), prompt, 16)
