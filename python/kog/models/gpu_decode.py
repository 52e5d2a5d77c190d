"""The GPU persistent decode kernel for one model: kog._C.GpuDecodeExecutor built from the same
program and ModelDims as the CPU executor (kog.models.decode), run as ONE launch per call.

A call runs `n_steps` whole decode steps of a batch of 1..8 sequences on the device: every
layer, the final norm, the LM head and sampling; with n_steps > 1 the sampled token feeds the
next step on the device (positions, cache slots and stop ids too), so the host sees the GPU once
per n_steps tokens. Inputs and outputs are device tensors on the current stream; nothing is
synchronized here.
"""

from __future__ import annotations

import os

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kog import _C
from kog.config import ModelConfig
from kog.errors import BackendError, InvalidRequest
from kog.models.decode import lower_program, model_dims, schedule_for
from kog.fp8 import Fp8Weight
from kog.int4 import Int4Weight, to_gpu_weights
from kog.quantized import QuantizedWeight

# The field types of csrc/schedule/sampling_row.h SamplingRow; offsets and size come from C++.
SAMPLING_ROW_FORMATS = {"temperature": "<f4", "top_k": "<i4", "top_p": "<f4", "min_p": "<f4", "seed": "<u8"}


def _sampling_row_dtype() -> np.dtype:
    layout = _C.SAMPLING_ROW_LAYOUT
    names = list(layout["fields"])
    return np.dtype({"names": names, "formats": [SAMPLING_ROW_FORMATS[n] for n in names],
                     "offsets": [layout["fields"][n][0] for n in names], "itemsize": layout["itemsize"]})


SAMPLING_ROW = _sampling_row_dtype()


@dataclass(frozen=True)
class DeviceSampling:
    """Sampling the kernel does on the device (penalties and logprobs stay on the host)."""

    temperature: float = 0.0   # <= 0: greedy
    top_k: int = 0             # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


@dataclass
class GpuDecodeResult:
    tokens: torch.Tensor       # [n_steps, B] int32 sampled ids (-1 after a sequence finished)
    logits: torch.Tensor       # [B, vocab] f32 logits of the last step (computed in the run dtype)
    finished: torch.Tensor     # [B] int32, 1 once a sequence sampled a stop id


@dataclass
class StagedDecode:
    """One call's inputs on the device (GpuDecoder.stage) and the result its launch fills."""

    args: tuple                # GpuDecodeExecutor.run's arguments before the stream
    inputs: tuple              # the device tensors args points into, kept alive
    result: GpuDecodeResult


# The watchdog's bound on a tensor-parallel rank's waits (ms; KOG_GPU_WAIT_TIMEOUT_MS overrides it).
RANK_WAIT_TIMEOUT_MS = 10_000.0


def kernel_runs(config: ModelConfig, weights: dict | None = None) -> bool:
    """Whether the persistent decode kernel runs config's program (with `weights`, when given:
    prepared weights as GpuDecoder takes them). Not yet: lanes (Laneformer's, or a tensor-parallel
    rank's) with FP8 / 4-bit weights (the kernel runs lanes in the run dtype:
    csrc/schedule/gpu_program.cpp), mixture-of-experts layers past the kernel's router limits
    (routed + shared slots per row, router rows: csrc/schedule/moe_route.h);
    ModelRunner decodes such a model on the GPU through the program interpreter (torch and kog's
    GPU ops, one step per call)."""
    if config.shard.size > 1 or (config.lanes is not None and config.lanes.num_lanes > 1):
        quantized = (Fp8Weight, Int4Weight, QuantizedWeight)
        if weights is not None and any(isinstance(w, quantized) for w in weights.values()):
            return False
    if config.moe_layers:
        slots = config.num_experts_per_tok + config.shared_expert_slots
        router_rows = config.num_experts + (1 if config.shared_expert_slots else 0)
        return slots <= _C.GPU_MOE_MAX_SLOTS and router_rows <= _C.GPU_MOE_MAX_ROUTER_ROWS
    return True


class GpuDecoder:
    """Args:
        config: the model.
        weights: prepared weights (kog.models.weights.prepare_weights) on the GPU, contiguous.
            QuantizedWeight matrices become the kernel's 4-bit formats (Q4_0 / Q4_1 / Q4_K read
            only by LINEAR ops) or are dequantized to the run dtype (kog.int4.to_gpu_weights).
        kv: [layers, blocks, 2, kv_heads, block_size, head_dim] KV cache on the same GPU.
        block_size: tokens per KV block.
        inv_freq: [rotary_dim / 2] float32 RoPE frequencies.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], kv: torch.Tensor,
                 block_size: int, inv_freq: torch.Tensor) -> None:
        if not _C.has_gpu_backend:
            raise BackendError("the persistent decode kernel needs a GPU build of kog (KOG_BACKEND=cuda or rocm)")
        if kv.device.type != "cuda" or not kv.is_contiguous():
            raise InvalidRequest(f"kv cache must be a contiguous GPU tensor, got {kv.device}")
        program = schedule_for(config)
        weights = to_gpu_weights(program, weights, kv.dtype)
        # An expert placement (tensor-parallel MoE: "...experts.ranks") is read on the host when
        # the executor is built (it keeps its own device table): host copies.
        weights = {k: v.cpu() if k.endswith("experts.ranks") else v for k, v in weights.items()}
        self.device = kv.device
        self.vocab_size = config.vocab_size
        self._inv_freq = inv_freq.to(self.device, torch.float32).contiguous()
        self._kv = kv
        dims = model_dims(config, kv.dtype)
        if 2 * self._inv_freq.numel() != dims.rotary_dim:
            raise InvalidRequest(f"inv_freq has {self._inv_freq.numel()} frequencies, rotary_dim is {dims.rotary_dim}")
        ops = lower_program(program, weights)
        self._executor = _C.GpuDecodeExecutor(dims, kv.data_ptr(), kv.shape[1], block_size,
                                              self._inv_freq.data_ptr(), ops)
        self._weights = weights  # the executor points into them
        self.block_size = block_size
        timeout = os.environ.get("KOG_GPU_WAIT_TIMEOUT_MS")
        if timeout is None and config.shard.size > 1:
            # a rank's kernel also waits for the other ranks' launches, which other processes
            # queue after rank 0 sent them the call: host latency, not a lost signal
            timeout = RANK_WAIT_TIMEOUT_MS
        if timeout is not None:
            try:
                self._executor.set_wait_timeout_ms(float(timeout))
            except ValueError as e:
                raise InvalidRequest(f"KOG_GPU_WAIT_TIMEOUT_MS={timeout!r}: {e}") from None

    def wait_timeout(self) -> dict | None:
        """Where the kernel's watchdog fired, if it did: {block, step, op, count, target} of the
        first dependency wait that outlived its bound (KOG_GPU_WAIT_TIMEOUT_MS, default 2000 ms,
        RANK_WAIT_TIMEOUT_MS on a tensor-parallel rank;
        the launch then trapped and the GPU context is lost). None otherwise."""
        return self._executor.wait_timeout()

    @property
    def grid_size(self) -> int:
        return self._executor.grid_size

    # ---- a tensor-parallel rank (config.shard.size > 1; docs/GPU.md) ---------------------------
    @property
    def inbox_bytes(self) -> int:
        """Bytes of this rank's inbox (0 on one rank)."""
        return self._executor.inbox_bytes

    @property
    def flag_count(self) -> int:
        """uint64 flags of this rank (0 on one rank)."""
        return self._executor.flag_count

    def connect_ranks(self, inboxes: Sequence[int], flags: Sequence[int]) -> None:
        """Every rank's inbox (inbox_bytes, 256-byte aligned) and zeroed flags (flag_count
        uint64), device addresses as this process maps them, in rank order; before the first
        decode. Every rank's decoder must then run the same n_steps in every call."""
        self._executor.set_ranks([int(a) for a in inboxes], [int(a) for a in flags])

    def set_max_grid(self, max_grid: int) -> None:
        """At most this many workgroups per launch (0: as many as fit): ranks sharing one device
        must all be resident at once."""
        self._executor.set_max_grid(max_grid)

    def decode(self, tokens, positions, block_tables, sampling: Sequence[DeviceSampling] | None = None,
               n_steps: int = 1, stop_ids: Sequence[int] = (), rng_step: int = 0) -> GpuDecodeResult:
        """Runs n_steps decode steps in one launch.

        Args:
            tokens: [B] newest token of each sequence.
            positions: [B] tokens already cached (the position of the token decoded first).
            block_tables: [B, max_blocks] int32 covering positions + n_steps tokens.
            sampling: one per sequence (default greedy).
            n_steps: tokens to generate on the device before returning.
            stop_ids: ids that finish a sequence (its later tokens come back as -1).
            rng_step: counter of the first step (sampling draws depend on (seed, counter)).
        """
        staged = self.stage(tokens, positions, block_tables, sampling, n_steps, stop_ids, rng_step)
        self.launch(staged)
        return staged.result

    def stage(self, tokens, positions, block_tables, sampling: Sequence[DeviceSampling] | None = None,
              n_steps: int = 1, stop_ids: Sequence[int] = (), rng_step: int = 0) -> StagedDecode:
        """Checks a call's inputs and copies them to the device (arguments as for decode)."""
        dev = self.device
        tokens_t = torch.as_tensor(tokens).to(dev, torch.int32).contiguous()
        b = tokens_t.numel()
        if not 1 <= b <= _C.GPU_DECODE_MAX_BATCH:
            raise InvalidRequest(f"batch {b} not in [1, {_C.GPU_DECODE_MAX_BATCH}]")
        if not 1 <= n_steps <= _C.GPU_DECODE_MAX_LOOP_STEPS:
            raise InvalidRequest(f"n_steps {n_steps} not in [1, {_C.GPU_DECODE_MAX_LOOP_STEPS}]")
        pos = torch.as_tensor(positions).to(torch.int64)
        tables = torch.as_tensor(block_tables).to(torch.int32)
        if pos.shape != (b,) or tables.ndim != 2 or tables.shape[0] != b:
            raise InvalidRequest(f"positions {tuple(pos.shape)} and block_tables {tuple(tables.shape)} must have {b} rows")
        last = int(pos.max()) + n_steps  # tokens cached after the last step
        if last > tables.shape[1] * self.block_size:
            raise InvalidRequest(f"block tables hold {tables.shape[1] * self.block_size} tokens, "
                                 f"the last step needs {last}")
        pos_cpu = pos.clone()
        slot = tables.gather(1, (pos_cpu // self.block_size)[:, None].to(torch.int64))[:, 0].to(torch.int64)
        slots = slot * self.block_size + pos_cpu % self.block_size
        rows = np.zeros(b, dtype=SAMPLING_ROW)
        for i, s in enumerate(sampling or [DeviceSampling()] * b):
            rows[i] = (s.temperature, s.top_k, s.top_p, s.min_p, s.seed)
        samp = torch.from_numpy(rows.view(np.uint8).copy()).to(dev)
        stops = torch.tensor(list(stop_ids) or [0], dtype=torch.int32, device=dev)
        positions_d, seq_lens_d = pos.to(dev), (pos + 1).to(dev, torch.int32)
        slots_d, tables_d = slots.to(dev), tables.to(dev).contiguous()
        # NOTE: -1, not empty: once every sequence finished the kernel stops and writes no later step.
        out = torch.full((n_steps, b), -1, dtype=torch.int32, device=dev)
        finished = torch.zeros(b, dtype=torch.int32, device=dev)
        logits = torch.empty(b, self.vocab_size, dtype=torch.float32, device=dev)
        inputs = (tokens_t, positions_d, seq_lens_d, slots_d, tables_d, samp, stops)
        args = (b, n_steps, tokens_t.data_ptr(), positions_d.data_ptr(), seq_lens_d.data_ptr(),
                slots_d.data_ptr(), tables_d.data_ptr(), tables_d.shape[1], last,
                samp.data_ptr(), rng_step, stops.data_ptr(), len(stop_ids), out.data_ptr(),
                finished.data_ptr(), logits.data_ptr())
        return StagedDecode(args, inputs, GpuDecodeResult(out, logits, finished))

    def launch(self, staged: StagedDecode) -> None:
        """Queues the kernel over staged inputs on the current stream. A loop (n_steps > 1) moves
        the staged positions, slots and finished flags on: launch such a staging once only."""
        self._executor.run(*staged.args, torch.cuda.current_stream(self.device).cuda_stream)
        # NOTE: the inputs may be freed when decode() returns: the caching allocator is stream-ordered,
        # so their memory is reused only by work queued after this launch on the same stream.
