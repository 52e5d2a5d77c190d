"""The native sampler on the device (csrc/gpu/decode/sample_item.cuh) against the CPU one
(csrc/cpu/ops/sample.cpp) on the kernel's own logits, and the engine's loop mode on a GPU
(GpuDecoder.decode with n_steps) against one step at a time."""

import numpy as np
import pytest
import torch

from kog import _C
from kog.engine import EngineConfig, LLMEngine
from kog.loader import LoadedModel
from kog.models import ModelRunner, PrefillChunk
from kog.models.gpu_decode import DeviceSampling, GpuDecoder
from kog.sampling_params import SamplingParams
from kog.testing.gpu import gpu_test_marks
from kog.testing.tiny_models import random_weights, tiny_config, tiny_tokenizer

pytestmark = gpu_test_marks()

BS = 16


def model(seed: int = 13, vocab_size: int | None = None) -> LoadedModel:
    c = tiny_config("llama", vocab_size=vocab_size, max_position_embeddings=1024)
    return LoadedModel(path=None, config=c, weights=random_weights(c, seed=seed), dtype=torch.float32,
                       tokenizer=tiny_tokenizer(), chat_template=None, stop_token_ids=(2,))


FILTERS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (1.2, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (1.5, 40, 0.8, 0.01),
]


@pytest.mark.parametrize("vocab_size", [None, 3 * _C.SAMPLE_CHUNK + 1000])
@pytest.mark.parametrize("filters", FILTERS)
def test_device_sampler_agrees_with_the_cpu_sampler(device, filters, vocab_size):
    """Same (logits, params, seed, counter) -> same token, except where float rounding of the
    masses (float sums on the device, double here) moves a draw across a boundary: rare. The
    second vocabulary spans four chunks of the kernel's sample partial, the last one short."""
    m = model(vocab_size=vocab_size)
    r = ModelRunner(m, 64)
    prompt = list(range(3, 60))
    table = np.arange(8, dtype=np.int32)
    slots = (table[np.arange(len(prompt)) // BS] * BS + np.arange(len(prompt)) % BS).astype(np.int64)
    r.prefill([PrefillChunk(prompt, 0, table, slots)])
    dec = GpuDecoder(m.config, {k: v.to(device) for k, v in r.weights.items()}, r.kv.kv.to(device), BS, r.inv_freq)
    temp, k, p, mp = filters
    agree = total = 0
    for counter in range(64):
        s = DeviceSampling(temperature=temp, top_k=k, top_p=p, min_p=mp, seed=1000 + counter)
        res = dec.decode([prompt[-1]], [len(prompt)], table[None], sampling=[s], rng_step=counter)
        logits = res.logits[0].cpu().numpy()
        want = _C.sample_row(logits, temp, k, p, mp, 1000 + counter, counter)
        agree += int(res.tokens[0, 0].item() == want)
        total += 1
    assert agree >= total - 1, f"{agree}/{total}"


def engine_tokens(dev, max_steps: int, requests) -> list:
    m = model()
    engine = LLMEngine(ModelRunner(m, 256, device=dev), m.tokenizer, (2,), 1024, EngineConfig(max_num_seqs=12))
    engine.decode_loop.max_steps = max_steps
    for i, (p, params) in enumerate(requests):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.stats()["num_sequences"] == 0
    return [[(o.token_ids, o.finish_reason) for o in engine.get_output(str(i)).outputs] for i in range(len(requests))]


def test_engine_loop_mode_on_the_gpu_equals_one_step(device):
    rng = np.random.default_rng(0)
    requests = []
    for i in range(10):  # > GPU_DECODE_MAX_BATCH rows: two launches per loop call
        p = rng.integers(3, 300, 8 + 3 * i).tolist()
        if i % 2:
            params = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, seed=i, max_tokens=20 + i, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=25 + i, ignore_eos=True)
        requests.append((p, params))
    loop = engine_tokens(device, 16, requests)
    assert loop == engine_tokens(device, 1, requests)
    greedy = [i for i in range(10) if i % 2 == 0]
    cpu = engine_tokens("cpu", 16, requests)
    assert [loop[i] for i in greedy] == [cpu[i] for i in greedy]


def test_engine_loop_mode_on_the_gpu_stops_at_a_stop_token(device):
    p = list(range(5, 40))
    ref = engine_tokens(device, 1, [(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))])[0][0][0]
    j = next(i for i in range(8, len(ref)) if ref[i] not in ref[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[ref[j]])
    assert engine_tokens(device, 16, [(p, stop)])[0][0] == (ref[: j + 1], "stop")
