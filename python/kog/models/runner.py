"""ModelRunner: the forward pass of a model family over Kog's paged KV cache.

Both passes run the family's program (kog.program.program_for), the one description of the
model. Prefill interprets it in Python over a batch of chunks of different sequences
(kog.program.interpreter: torch GEMMs for the projections, Kog's kernels for everything else).
Decode runs the whole step -- every layer, the final norm and the LM head -- in one native
call: on the CPU the decode executor (kog._C.DecodeExecutor), on a GPU the persistent decode
kernel (kog.models.gpu_decode). Both write K/V into the same cache, so they mix freely.
Inputs and outputs (token ids, block tables, logits) are host objects on every device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kog import ops
from kog.errors import InvalidRequest
from kog.info import gpu_unavailable_reason
from kog.kvcache import KVCacheStorage, KVLayout
from kog.loader import LoadedModel
from kog.models.decode import build_executor
from kog.hugepages import to_hugepages
from kog.models.weights import pack_quantized, prepare_weights, weight_bytes
from kog.fp8 import Fp8Weight
from kog.int4 import to_gpu_weights
from kog.quantized import QuantizedWeight
from kog.program import Buffer, TokenBatch, program_for
from kog.program.families import WINDOWED
from kog.parallel.transport import Transport
from kog.program.interpreter import ProgramInterpreter

log = logging.getLogger(__name__)


@dataclass
class PrefillChunk:
    """One sequence's chunk of prompt (or of appended / forced / draft tokens)."""

    token_ids: Sequence[int]
    start_pos: int            # tokens already in the cache before this chunk
    block_table: np.ndarray   # int32, covers start_pos + len(token_ids) tokens
    slots: np.ndarray         # int64 [len(token_ids)] cache slots of the new tokens


def kv_cache_dtype_for(run_dtype: torch.dtype, wanted: torch.dtype | None, device: torch.device) -> torch.dtype:
    """The KV cache dtype of a runner: `wanted`, or the run dtype when None. Raises InvalidRequest
    for a cache that no kernel reads: another dtype than the run dtype on a GPU (the decode kernel
    keeps one dtype), or anything but float16 / bfloat16 under float32 activations on the CPU."""
    if wanted is None or wanted == run_dtype:
        return run_dtype
    run, want = str(run_dtype).removeprefix("torch."), str(wanted).removeprefix("torch.")
    if device.type != "cpu":
        raise InvalidRequest(f"kv_cache_dtype {want!r}: on a GPU the KV cache has the run dtype ({run})")
    if not ops.kv_cache_dtype_ok(run_dtype, wanted):
        raise InvalidRequest(f"kv_cache_dtype {want!r} with {run} activations: a KV cache may differ from the run "
                             f"dtype only as float16 or bfloat16 under float32")
    return wanted


class ModelRunner:
    """Runs one model on the CPU over a paged KV cache it owns.

    Args:
        model: a loaded checkpoint; its weights are fused and converted once here.
        num_kv_blocks: device KV blocks (give the KVCacheManager the same number).
        block_size: tokens per KV block.
        num_host_blocks: host swap-pool blocks.
        device: "cpu" or a GPU ("cuda", "cuda:1"; ROCm devices are "cuda" in torch too).
        kv_cache_dtype: the KV cache's dtype (None: the run dtype). On the CPU a float32 model may
            keep a float16 or bfloat16 cache: half the bytes each decode step's attention reads,
            values rounded once as they are appended (kv_cache_dtype_for).
    """

    def __init__(self, model: LoadedModel, num_kv_blocks: int, block_size: int = 16,
                 num_host_blocks: int = 0, device: str | torch.device = "cpu", transport: Transport | None = None,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        c = self.config = model.config
        self.dtype = model.dtype
        self.block_size = block_size
        self.vocab_size = c.vocab_size
        # Families in WINDOWED attend through their sliding window (the program's ATTN_DECODE window);
        # the others' programs have none (Qwen2's per-layer windows): cap sequences at it, results stay exact.
        window = None if c.architecture in WINDOWED else c.sliding_window
        self.max_model_len = min(c.max_position_embeddings, window or c.max_position_embeddings)
        try:
            self.device = torch.device(device)
        except RuntimeError:
            self.device = None
        if self.device is None or self.device.type not in ("cpu", "cuda"):
            raise InvalidRequest(f"device must be 'cpu' or a GPU ('cuda', 'cuda:N'), got {device!r}")
        if self.device.type == "cuda" and (reason := gpu_unavailable_reason(self.device.index)) is not None:
            raise InvalidRequest(f"device {str(self.device)!r}: {reason}")
        quantized = any(isinstance(w, (QuantizedWeight, Fp8Weight)) for w in model.weights.values())
        if self.device.type == "cuda" and quantized and self.dtype != torch.bfloat16:
            raise InvalidRequest(f"device {str(self.device)!r}: quantized weights run on the GPU with bfloat16 "
                                 f"activations, the model was loaded for {str(self.dtype).removeprefix('torch.')} "
                                 f"(load it with device={str(self.device)!r} and dtype None, or dtype=\"bfloat16\" "
                                 f"to dequantize it)")
        self.program = program_for(c)
        weights = prepare_weights(c, model.weights, self.dtype)
        if self.device.type == "cpu":
            # decode streams them: row-interleaved quants, 2 MiB pages read faster
            self.weights = to_hugepages(pack_quantized(c, weights))
        else:
            # Q4_0 / Q4_1 / Q4_K LINEAR matrices in the decode kernel's 4-bit form, FP8 as is; prefill
            # multiplies with dequantized tiles of both (kog.program.interpreter.dequant_matmul).
            self.weights = {k: v.to(self.device) for k, v in to_gpu_weights(self.program, weights, self.dtype).items()}
        self.weight_bytes = weight_bytes(self.weights)  # resident bytes of the prepared weights
        self.kv_dtype = kv_cache_dtype_for(self.dtype, kv_cache_dtype, self.device)
        layout = KVLayout(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size, self.kv_dtype)
        self.kv = KVCacheStorage(layout, num_kv_blocks, num_host_blocks, device=self.device)
        # [head_dim / 2] f32 RoPE frequencies, on the device
        self.inv_freq = ops.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(self.device)
        self._interpreter = ProgramInterpreter(c, self.program, self.weights, self.kv.kv, self.inv_freq, transport)
        self._executor = None
        self._gpu = None
        if c.shard.size > 1 and self.device.type == "cpu":
            # A tensor-parallel rank decodes natively when its transport is the shared-memory one
            # (the executor drives it), else through the interpreter.
            native = getattr(transport, "native", None)
            if native is not None:
                self._executor = build_executor(c, self.weights, self.kv.kv, block_size, self.inv_freq, dtype=self.dtype)
                self._executor.set_transport(native)
        elif self.device.type == "cuda":
            from kog.models.gpu_decode import GpuDecoder, kernel_runs

            if kernel_runs(c, self.weights):
                # NOTE: a tensor-parallel rank's decoder runs once its ranks are connected
                # (kog.parallel.ranks.build_rank_runner: connect_gpu_ranks)
                self._gpu = GpuDecoder(c, self.weights, self.kv.kv, block_size, self.inv_freq)
            else:
                log.info("%s: the persistent decode kernel does not run its program yet (mixture of experts past "
                         "its router limits, or quantized lanes): decode goes "
                         "through the program interpreter on the GPU, one step per call", c.architecture)
        else:
            self._executor = build_executor(c, self.weights, self.kv.kv, block_size, self.inv_freq, dtype=self.dtype)

    # ------------------------------------------------------------------ public API

    @property
    def native_decoder(self):
        """What runs whole decode steps natively: the CPU DecodeExecutor or the GpuDecoder
        (kog.engine.decode_loop runs K steps per call on it). None: decode goes through the
        program interpreter (a tensor-parallel rank across hosts, or a GPU model the kernel does
        not run: kog.models.gpu_decode.kernel_runs)."""
        return self._gpu if self.device.type == "cuda" else self._executor

    def prefill(self, chunks: list[PrefillChunk], all_logits: bool = False) -> torch.Tensor | list[torch.Tensor]:
        """Runs chunks of several sequences in one batch, writing their K/V into the cache.

        Args:
            chunks: one per sequence; each attends to its own cached tokens and causally to itself.
            all_logits: also return logits for every token (speculative verification).

        Returns:
            [len(chunks), vocab] f32 logits of each chunk's last token; with all_logits, a list
            of [len(chunk.token_ids), vocab] f32 tensors instead.
        """
        if not chunks:
            return [] if all_logits else torch.empty(0, self.vocab_size)
        state = self._interpreter.run(self._prefill_batch(chunks, all_logits))
        logits = state.buffers[Buffer.LOGITS].float().cpu()  # [sampled rows, vocab]
        if not all_logits:
            return logits
        return list(torch.split(logits, [len(ch.token_ids) for ch in chunks]))

    def verify(self, chunks: list[PrefillChunk]) -> list[torch.Tensor]:
        """Logits of every position of each chunk (draft tokens in, target distributions out)."""
        return self.prefill(chunks, all_logits=True)

    def decode(self, tokens, positions, block_tables, seq_lens, slots, sampled: np.ndarray | None = None) -> torch.Tensor:
        """One decode step for a batch of sequences, in a single native call.

        Args:
            tokens: [B] int, the newest token of each sequence.
            positions: [B] int, tokens already cached (the new token's position).
            block_tables: [B, max_blocks] int32, padded.
            seq_lens: [B] int32, positions + 1.
            slots: [B] int64, the new tokens' cache slots.
            sampled: optional int64 [B] array that receives the greedy (argmax) tokens.

        Returns:
            [B, vocab] f32 logits.
        """
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        seq_lens = np.ascontiguousarray(seq_lens, dtype=np.int32)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        n = tokens.shape[0]
        if tables.ndim != 2 or tables.shape[0] != n or any(a.shape != (n,) for a in (positions, seq_lens, slots)):
            raise InvalidRequest(f"decode: tokens {tokens.shape}, positions {positions.shape}, block_tables "
                                 f"{tables.shape}, seq_lens {seq_lens.shape}, slots {slots.shape} disagree on the batch")
        if n == 0:
            return torch.empty(0, self.vocab_size)
        if int(positions.max()) + 1 > self.max_model_len:
            raise InvalidRequest(f"decode: position {int(positions.max())} + 1 tokens exceeds the model's "
                                 f"max_position_embeddings {self.max_model_len}")
        if np.unique(slots).shape[0] != n:
            raise InvalidRequest("decode: two sequences write the same cache slot")
        if sampled is not None and (sampled.dtype != np.int64 or sampled.shape != (n,) or not sampled.flags.c_contiguous):
            raise InvalidRequest(f"decode: sampled must be a contiguous int64 array of shape ({n},)")
        if self.native_decoder is None:  # the program through the interpreter, on the runner's device
            dev = self.device
            batch = TokenBatch.decode(*(torch.from_numpy(a).to(dev) for a in (tokens, positions, tables, slots)))
            logits = self._interpreter.run(batch).buffers[Buffer.LOGITS].float().cpu()
            if sampled is not None:
                sampled[:] = logits.argmax(-1).numpy()
            return logits
        if self.device.type == "cuda":
            return self._decode_gpu(tokens, positions, tables, sampled)
        logits = torch.empty(n, self.vocab_size, dtype=torch.float32)
        self._executor.run(n, tokens.ctypes.data, positions.ctypes.data, tables.ctypes.data, tables.shape[1],
                           seq_lens.ctypes.data, slots.ctypes.data, logits.data_ptr(),
                           0 if sampled is None else sampled.ctypes.data)
        return logits

    # ------------------------------------------------------------------ internal helpers

    def _decode_gpu(self, tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray,
                    sampled: np.ndarray | None) -> torch.Tensor:
        """The persistent kernel, one launch per group of up to GPU_DECODE_MAX_BATCH sequences.
        Slots come from the block tables (the engine's slots are the same by construction)."""
        from kog import _C

        parts = []
        for a in range(0, tokens.shape[0], _C.GPU_DECODE_MAX_BATCH):
            z = slice(a, a + _C.GPU_DECODE_MAX_BATCH)
            res = self._gpu.decode(tokens[z], positions[z], tables[z])
            parts.append(res.logits.cpu())
            if sampled is not None:
                sampled[z] = res.tokens[0].cpu().numpy()
        return torch.cat(parts)

    def _prefill_batch(self, chunks: list[PrefillChunk], all_logits: bool) -> TokenBatch:
        """Flattens chunks into one token batch; every row yields logits with all_logits, else
        the last row of each chunk."""
        bs, lens = self.block_size, [len(ch.token_ids) for ch in chunks]
        for i, ch in enumerate(chunks):
            end = ch.start_pos + lens[i]
            if lens[i] == 0 or ch.start_pos < 0:
                raise InvalidRequest(f"chunk {i}: needs >= 1 token and start_pos >= 0, got {lens[i]} at {ch.start_pos}")
            if end > self.max_model_len:
                raise InvalidRequest(f"chunk {i}: ends at position {end}, beyond the model's "
                                     f"max_position_embeddings {self.max_model_len}")
            if end > len(ch.block_table) * bs:
                raise InvalidRequest(f"chunk {i}: ends at position {end} but its block table covers "
                                     f"{len(ch.block_table) * bs} tokens ({len(ch.block_table)} blocks of {bs})")
            if len(ch.slots) != lens[i]:
                raise InvalidRequest(f"chunk {i}: {len(ch.slots)} slots for {lens[i]} tokens")
        ids = torch.tensor([t for ch in chunks for t in ch.token_ids], dtype=torch.int64)  # [T]
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise InvalidRequest(f"token ids must be in [0, {self.vocab_size}), got {int(ids.min())}..{int(ids.max())}")
        tables = np.zeros((len(chunks), max(len(ch.block_table) for ch in chunks)), dtype=np.int32)
        for i, ch in enumerate(chunks):
            tables[i, :len(ch.block_table)] = ch.block_table
        qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)  # [n + 1]
        dev = self.device
        return TokenBatch(
            ids=ids.to(dev),
            positions=torch.cat([torch.arange(ch.start_pos, ch.start_pos + n) for ch, n in zip(chunks, lens)]).to(dev),
            slots=torch.from_numpy(np.concatenate([np.asarray(ch.slots, dtype=np.int64) for ch in chunks])).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            seq_lens=torch.tensor([ch.start_pos + n for ch, n in zip(chunks, lens)], dtype=torch.int32).to(dev),
            query_start_loc=qsl.to(dev),
            sampled_rows=None if all_logits or len(chunks) == ids.shape[0] else (qsl[1:] - 1).long().to(dev),
        )
