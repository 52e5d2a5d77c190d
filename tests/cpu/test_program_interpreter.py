"""The program interpreter (prefill's path) against the native decode executor, op by op, and
prefill through the program against decode through the executor.

Tolerances, relative to the largest |value| of the reference buffer:
  one op from the same inputs: fp32 1e-5, bf16 1.6e-2 (one bf16 rounding apart: torch's GEMM and
  Kog's sum in different orders); the KV cache from the same inputs: exact.
  the whole program run separately by each: fp32 1e-4, bf16 6e-2 (differences carried along).
"""

import numpy as np
import pytest
import torch

from kog.lane_config import LaneConfig
from kog.loader import LoadedModel
from kog.models import ModelRunner, PrefillChunk
from kog.models.decode import build_executor
from kog.program import Buffer, Opcode, TokenBatch
from kog.program.interpreter import ProgramInterpreter
from kog.program.program import slot_of
from kog.testing.tiny_models import random_weights, tiny_config

BS = 4  # small blocks: sequences cross block boundaries
ONE_OP_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
WHOLE_RUN_TOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2}


# Laneformer with its other reductions: layer 0 scales (no early communication), per-lane norm
# weights, the lanes summed before the final norm.
LANE_VARIANTS = {"laneformer_tp/agg": dict(lanes=LaneConfig(num_lanes=2, broadcast_delay=1, use_early_comm=False,
                                                            pre_norm_lane_agg=True, replicated_rmsn_scale=False))}


def config_of(arch: str):
    return tiny_config(arch.split("/")[0], **LANE_VARIANTS.get(arch, {}))


def tiny_runner(arch: str, dtype: torch.dtype, num_blocks: int = 64) -> ModelRunner:
    config = config_of(arch)
    weights = {k: v.to(dtype) for k, v in random_weights(config, seed=3).items()}
    model = LoadedModel(path=None, config=config, weights=weights, dtype=dtype, tokenizer=None,
                        chat_template=None, stop_token_ids=())
    return ModelRunner(model, num_kv_blocks=num_blocks, block_size=BS)


def table(i: int, n: int = 16) -> np.ndarray:
    return np.arange(n * i, n * (i + 1), dtype=np.int32)


def slots(i: int, start: int, end: int) -> np.ndarray:
    pos = np.arange(start, end)
    return table(i)[pos // BS].astype(np.int64) * BS + pos % BS


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def assert_close(got, want, tol, what, route_k=0):
    if route_k:  # ROUTE: the expert ids exactly, their f32 weights to fp32 rounding (softmax in two libraries)
        assert torch.equal(got[:, :route_k], want[:, :route_k]), f"{what}: expert ids"
        weights = [t[:, route_k:].contiguous().view(torch.float32) for t in (got, want)]
        torch.testing.assert_close(*weights, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")
        return
    if not want.dtype.is_floating_point:
        assert torch.equal(got.to(want.dtype), want), what
        return
    scale = max(want.float().abs().max().item(), 1e-6)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


class NativeStep:
    """One decode step on a fresh native executor, stopped after any number of ops."""

    def __init__(self, r: ModelRunner, tokens, positions, tables):
        self.r, self.n = r, len(tokens)
        self.ex = build_executor(r.config, r.weights, r.kv.kv, BS, r.inv_freq)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.positions = np.asarray(positions, dtype=np.int64)
        self.tables = np.ascontiguousarray(tables, dtype=np.int32)
        self.seq_lens = (self.positions + 1).astype(np.int32)
        self.slots = np.array([t[p // BS] * BS + p % BS for t, p in zip(self.tables, self.positions)], dtype=np.int64)

    def batch(self) -> TokenBatch:
        return TokenBatch.decode(torch.from_numpy(self.tokens), torch.from_numpy(self.positions),
                                 torch.from_numpy(self.tables), torch.from_numpy(self.slots))

    def run(self, stop_after: int) -> dict[Buffer, torch.Tensor]:
        """Runs ops [0, stop_after); returns the buffers the ops before stop_after wrote."""
        logits = torch.empty(self.n, self.r.vocab_size)
        t = self.tables
        self.ex.run(self.n, self.tokens.ctypes.data, self.positions.ctypes.data, t.ctypes.data, t.shape[1],
                    self.seq_lens.ctypes.data, self.slots.ctypes.data, logits.data_ptr(), 0, stop_after)
        writes = [w for ins in self.r.program[:stop_after] for w in ins.writes]
        written = {Buffer.TOKENS} | {w for w in writes if isinstance(w, Buffer)}
        if any(slot_of(w) is not None for w in writes):  # lane-history slots: slices of LANE_HIST
            written.add(Buffer.LANE_HIST)
        out = {}
        for b in written:
            buf = torch.empty((self.n, self.ex.width(int(b))) if b != Buffer.TOKENS else (self.n,),
                              dtype=torch.int32 if b in (Buffer.TOKENS, Buffer.ROUTE) else self.r.dtype)
            self.ex.read_buffer(int(b), buf.data_ptr(), buf.numel() * buf.element_size())
            out[b] = buf
        return out


def decode_step_after_prefill(r: ModelRunner) -> NativeStep:
    ps = prompts((11, 3, 1))  # mixed lengths, crossing blocks
    r.prefill([PrefillChunk(p, 0, table(i), slots(i, 0, len(p))) for i, p in enumerate(ps)])
    return NativeStep(r, [p[-1] + 7 for p in ps], [len(p) for p in ps], np.stack([table(i) for i in range(3)]))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe",
                                  "laneformer_tp", "laneformer_tp/agg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_program_op_by_op_interpreter_equals_native_executor(arch, dtype):
    r = tiny_runner(arch, dtype)
    step = decode_step_after_prefill(r)
    kv0 = r.kv.kv.clone()
    # A second interpreter on its own cache runs the whole program alongside, never reseeded.
    whole = ProgramInterpreter(r.config, r.program, r.weights, kv0.clone(), r.inv_freq)
    whole_state = whole.start(step.batch())
    native_before, kv_before = step.run(0), kv0.clone()
    for i, ins in enumerate(r.program):
        r.kv.kv.copy_(kv0)
        native = step.run(i + 1)
        native_kv = r.kv.kv.clone()
        # op i alone, from the executor's buffers and cache before it
        r.kv.kv.copy_(kv_before)
        interp = ProgramInterpreter(r.config, r.program, r.weights, r.kv.kv, r.inv_freq)
        state = interp.start(step.batch(), {b: t.clone().to(torch.int64 if b == Buffer.TOKENS else
                                                             torch.int32 if b == Buffer.ROUTE else dtype)
                                            for b, t in native_before.items()})
        interp.step(state, i)
        whole.step(whole_state, i)
        what = f"{arch} op {i} {ins.opcode.name} layer {ins.layer}"
        assert set(native) <= set(state.buffers)
        k = r.config.num_experts_per_tok + r.config.shared_expert_slots
        for b, want in native.items():
            route_k = k if b == Buffer.ROUTE else 0
            assert_close(state.buffers[b], want, ONE_OP_TOL[dtype], f"{what}, {b.name} (one op)", route_k)
            # bf16 may change the argmax of a near tie: logits, and which experts a router picks
            if b not in (Buffer.TOKENS, Buffer.ROUTE) or dtype == torch.float32:
                assert_close(whole_state.buffers[b], want, WHOLE_RUN_TOL[dtype], f"{what}, {b.name} (whole run)",
                             route_k)
        assert torch.equal(r.kv.kv, native_kv), f"{what}: KV cache"
        assert_close(whole.kv, native_kv, WHOLE_RUN_TOL[dtype], f"{what}: KV cache (whole run)")
        native_before, kv_before = native, native_kv


def test_every_opcode_is_exercised():
    # The op-by-op comparison above covers every opcode the families emit.
    from kog.program import program_for
    seen = {ins.opcode for arch in ("llama", "qwen2", "qwen3", "qwen3_moe", "laneformer_tp", "laneformer_tp/agg")
            for ins in program_for(config_of(arch))}
    # The collectives exist only in a tensor-parallel rank's program, which no native executor
    # runs yet: tests/cpu/test_tensor_parallel.py compares those ranks with one process instead.
    assert seen == set(Opcode) - {Opcode.ALL_REDUCE, Opcode.ALL_GATHER}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "laneformer_tp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunk_then_decode_equals_full_prefill(arch, dtype):
    tokens = prompts((20,), seed=4)[0]
    full = tiny_runner(arch, dtype)
    want = full.verify([PrefillChunk(tokens, 0, table(0), slots(0, 0, 20))])[0]  # [20, vocab]
    r = tiny_runner(arch, dtype)
    got = [r.prefill([PrefillChunk(tokens[:12], 0, table(0), slots(0, 0, 12))])[0]]
    for p in range(12, 20):
        got.append(r.decode(np.array([tokens[p]]), np.array([p]), table(0)[None], np.array([p + 1], np.int32),
                            slots(0, p, p + 1))[0])
    tol = {torch.float32: 1e-4, torch.bfloat16: 6e-2}[dtype]
    assert_close(torch.stack(got), want[11:], tol, "chunk + decode vs one prefill")
    if dtype == torch.float32:
        assert torch.stack(got).argmax(-1).tolist() == want[11:].argmax(-1).tolist()


def test_prefill_logits_are_the_last_rows_of_verify():
    # The head runs over the sampled rows only; they are the rows verify computes at the chunks' ends.
    r = tiny_runner("qwen2", torch.float32)
    ps = prompts((9, 1, 5))
    chunks = [PrefillChunk(p, 0, table(i), slots(i, 0, len(p))) for i, p in enumerate(ps)]
    last = r.prefill(chunks)
    r2 = tiny_runner("qwen2", torch.float32)
    every = r2.verify(chunks)
    assert last.shape == (3, r.vocab_size)
    # the same rows, up to the GEMM's blocking for 3 rows vs 15
    assert_close(last, torch.stack([rows[-1] for rows in every]), 1e-6, "last rows")
