"""The engine's GPU loop path (kog.engine.decode_loop, GpuDecoder.decode with n_steps) through a
stand-in with the persistent kernel's contract, built from the CPU executor and the CPU
sampler: the real kernel runs in tests/gpu/test_decode_loop_gpu.py."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kog import _C
from kog.engine import EngineConfig, LLMEngine
from kog.loader import LoadedModel
from kog.models import ModelRunner
from kog.sampling_params import SamplingParams
from kog.testing.tiny_models import random_weights, tiny_config, tiny_tokenizer

TOK = tiny_tokenizer()
V = TOK.vocab_size


@dataclass
class Result:
    tokens: torch.Tensor  # [n_steps, B] int32, -1 once a row finished


class KernelStandIn:
    """GpuDecoder.decode's contract: n_steps steps of the whole batch, each row sampled at
    counter rng_step + step with its own (temperature, top_k, top_p, min_p, seed), a row that
    samples one of stop_ids finished (-1 afterwards), the call ending once every row is."""

    def __init__(self, runner: ModelRunner):
        self.r = runner
        self.calls = []

    def decode(self, tokens, positions, block_tables, sampling, n_steps, stop_ids, rng_step):
        self.calls.append(n_steps)
        bs = self.r.block_size
        tok, pos = np.asarray(tokens, np.int64).copy(), np.asarray(positions, np.int64).copy()
        tables = np.asarray(block_tables, np.int32)
        out = torch.full((n_steps, len(tok)), -1, dtype=torch.int32)
        finished = np.zeros(len(tok), bool)
        for step in range(n_steps):
            if finished.all():
                break
            slots = tables[np.arange(len(tok)), pos // bs].astype(np.int64) * bs + pos % bs
            logits = self.r.decode(tok, pos, tables, pos + 1, slots).numpy()
            for b, s in enumerate(sampling):
                t = _C.sample_row(logits[b], s.temperature, s.top_k, s.top_p, s.min_p, s.seed, rng_step + step)
                if not finished[b]:
                    out[step, b] = t
                finished[b] |= t in stop_ids
                tok[b] = t
            pos += 1
        return Result(out)


class StandInGpuRunner(ModelRunner):
    @property
    def native_decoder(self):
        if not hasattr(self, "_stand_in"):
            self._stand_in = KernelStandIn(self)
        return self._stand_in


@pytest.fixture(scope="module")
def model():
    config = tiny_config("llama", max_position_embeddings=512)
    return LoadedModel(path=None, config=config, weights=random_weights(config, seed=7), dtype=torch.float32,
                       tokenizer=TOK, chat_template=None, stop_token_ids=())


def run(model, cls, max_steps, requests):
    runner = cls(model, num_kv_blocks=96, block_size=4)
    engine = LLMEngine(runner, TOK, [TOK.eos_token_id], 512, EngineConfig(max_num_seqs=8))
    engine.decode_loop.max_steps = max_steps
    for i, (p, params) in enumerate(requests):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        engine.step()
    st = engine.kv.stats()
    assert st["num_sequences"] == 0 and st["blocks_free"] + st["blocks_cached"] == st["num_blocks"]
    outs = [[(o.token_ids, o.finish_reason) for o in engine.get_output(f"r{i}").outputs] for i in range(len(requests))]
    return outs, runner


def test_gpu_loop_path_equals_one_step(model):
    rng = np.random.default_rng(0)
    ps = [rng.integers(3, V, 6 + 4 * i).tolist() for i in range(3)]
    requests = [
        (ps[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
        (ps[1], SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=3, max_tokens=41, ignore_eos=True)),
        (ps[2], SamplingParams(temperature=1.1, min_p=0.05, seed=4, max_tokens=25)),
    ]
    got, runner = run(model, StandInGpuRunner, 16, requests)
    want, _ = run(model, ModelRunner, 1, requests)
    assert got == want
    assert max(runner.native_decoder.calls) >= 4  # the kernel's loop mode ran


def test_gpu_loop_path_stops_at_a_row_stop_token(model):
    p = np.random.default_rng(1).integers(3, V, 9).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = run(model, ModelRunner, 1, [(p, greedy)])[0][0][0][0]
    j = next(i for i in range(8, len(ref)) if ref[i] not in ref[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[ref[j]])
    other = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # not stopped by ref[j]
    got, runner = run(model, StandInGpuRunner, 16, [(p, stop), (p, other)])
    assert got[0][0] == (ref[: j + 1], "stop")
    assert got[1][0] == (ref, "length")
    assert max(runner.native_decoder.calls) >= 4


def test_gpu_loop_path_leaves_penalties_to_one_step(model):
    p = np.random.default_rng(2).integers(3, V, 9).tolist()
    params = SamplingParams(temperature=0.8, seed=5, repetition_penalty=1.2, max_tokens=20, ignore_eos=True)
    got, runner = run(model, StandInGpuRunner, 16, [(p, params)])
    assert got == run(model, ModelRunner, 1, [(p, params)])[0]
    assert runner.native_decoder.calls == []  # the kernel cannot apply penalties
