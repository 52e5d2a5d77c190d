"""GGUF checkpoints (llama.cpp's format): metadata -> ModelConfig, tensors -> HF-named weights.

Three things differ from an HF folder and are undone here:
- names: `blk.3.attn_q.weight` is HF's `model.layers.3.self_attn.q_proj.weight`;
- quantization: with keep_quantized (kog.LLM's dtype=None/"auto" on a quantized file) each
  quantized matrix stays in its blocks (kog.quantized.QuantizedWeight); otherwise blocks are
  dequantized with `gguf.quants.dequantize` to the run dtype;
- for the `llama` architecture, llama.cpp's converter reorders the rows of q and k inside each
  head (it interleaves the two RoPE halves); `_unpermute_rows` restores HF's order.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kog.config import ModelConfig
from kog.errors import InvalidRequest, ModelLoadError
from kog.loader.gguf_file import GGUFFile, TensorInfo
from kog.quantized import QuantizedWeight, block_columns, quantize_q8_0
from kog.loader.weights import Weights, check_shape, expected_shapes, progress_bar, select_names

log = logging.getLogger("kog")

# GGUF `general.architecture` -> Kog family. Mistral GGUFs are written with the llama architecture.
# A llama GGUF with llama.expert_count > 0 is Mixtral.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "qwen2moe": "qwen2_moe"}

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router [E, hidden]
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # qwen2moe's shared expert: its sigmoid gate [1, hidden]
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Stacked experts (llama.cpp's *_exps, [E, rows, cols] in torch order) -> (Kog's stacked tensor,
# part): gate and up are concatenated per expert into gate_up_proj (kog.loader.moe).
_EXPERT_NAMES = {
    "ffn_gate_exps": ("mlp.experts.gate_up_proj", 0),
    "ffn_up_exps": ("mlp.experts.gate_up_proj", 1),
    "ffn_down_exps": ("mlp.experts.down_proj", 0),
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE factors, folded into config.rope_scaling

_FILE_TYPE_DTYPE = {0: "float32", 1: "float16", 32: "bfloat16"}  # quantized files -> float32
_FLOAT_TYPES = frozenset({0, 1, 30})  # GGML F32, F16, BF16: loaded as float tensors


_HF_BLOCK_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_GGUF_TOP = {hf: g for g, hf in _TOP_NAMES.items()}
_GGUF_BLOCK = {hf: g for g, hf in _BLOCK_NAMES.items()}


def gguf_name(hf: str) -> str | None:
    """GGUF name of an HF tensor name (hf_name's inverse), None for a name GGUF has no place for."""
    if hf in _GGUF_TOP:
        return _GGUF_TOP[hf]
    m = _HF_BLOCK_RE.fullmatch(hf)
    if m and m.group(2) in _GGUF_BLOCK:
        return f"blk.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"
    return None


def hf_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor name, None when the name is not one Kog knows."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


class GGUFCheckpoint:
    """One GGUF file, memory-mapped: its metadata, config, weights and tokenizer fields."""

    def __init__(self, path: str | Path):
        self.file = GGUFFile(path)
        self.path = self.file.path
        self.metadata: dict[str, Any] = self.file.metadata
        self.tensors: dict[str, TensorInfo] = self.file.tensors

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @cached_property
    def config(self) -> ModelConfig:
        """The ModelConfig the metadata describes."""
        arch = self.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(f"{self.path}: unknown architecture {arch!r}; Kog knows {sorted(GGUF_ARCHITECTURES)}")

        def key(name: str, default: Any = None) -> Any:
            value = self.get(f"{arch}.{name}", default)
            if value is None:
                raise ModelLoadError(f"{self.path}: missing metadata key {arch}.{name}")
            return value

        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // heads))
        rope_dim = int(key("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ModelLoadError(f"{self.path}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
        tokens = self.get("tokenizer.ggml.tokens") or []
        eos = [self.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        family = GGUF_ARCHITECTURES[arch]
        if family == "llama" and int(self.get("llama.expert_count") or 0) > 0:
            family = "mixtral"
        moe: dict[str, Any] = {}
        if family in ("qwen3_moe", "mixtral", "qwen2_moe"):
            n_layers = int(key("block_count"))
            # NOTE: llama.cpp renormalizes Qwen3-MoE's and Mixtral's top-k weights, not Qwen2-MoE's,
            # unless the file says otherwise (kog.loader.gguf_write.NORM_TOPK_DEFAULT).
            moe = dict(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                       moe_intermediate_size=int(key("feed_forward_length") if family == "mixtral"
                                                 else key("expert_feed_forward_length")),
                       norm_topk_prob=bool(self.get(f"{arch}.expert_weights_norm", family != "qwen2_moe")),
                       moe_layers=tuple(n for n in range(n_layers) if f"blk.{n}.ffn_gate_exps.weight" in self.tensors))
            if family == "qwen2_moe":
                moe["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length"))
        return ModelConfig(
            architecture=family,
            hidden_size=hidden,
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            intermediate_size=int(key("feed_forward_length")),
            vocab_size=int(key("vocab_size", len(tokens) or None)),
            rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
            rope_theta=_f32(key("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(arch, head_dim),
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            torch_dtype=_FILE_TYPE_DTYPE.get(self.get("general.file_type"), "float32"),
            **moe,
        )

    @cached_property
    def is_quantized(self) -> bool:
        """True when some tensor is stored in a block-quantized type (not F32/F16/BF16)."""
        return any(t.qtype not in _FLOAT_TYPES for t in self.tensors.values())

    def load_weights(self, config: ModelConfig, dtype: torch.dtype, progress: bool | None = None,
                     keep_quantized: bool = False,
                     part: Callable[[str, int], tuple[slice, ...] | None] | None = None) -> Weights:
        """Every tensor under HF names, in HF's layout: in the run dtype, or with keep_quantized
        each block-quantized matrix as a QuantizedWeight in its file layout (rows un-permuted
        like the float ones); float tensors (norms, biases, F16 matrices) in the run dtype.

        part(name, ndim): the index of the tensor's HF form to keep (None: all of it), e.g. a
        tensor-parallel rank's share (kog.parallel.shard.shard_index): leading slices and the
        columns; only those bytes are read and decoded (columns that cut a block are decoded
        whole rows and then cut, or refused with keep_quantized).

        Raises:
            ModelLoadError: naming the file and tensor that is missing, misshapen, of a
                quantization gguf cannot decode, or unknown. With keep_quantized, a block type
                without Kog kernels is re-encoded as Q8_0 (one warning logged, with the bytes).
            InvalidRequest: with keep_quantized, a part whose columns cut a block (naming it).
        """
        by_hf: dict[str, list[str]] = {}  # HF name -> its GGUF tensors (two for gate_up_proj)
        for name in self.tensors:
            if name == _ROPE_FREQS:
                continue
            m = _BLOCK_RE.fullmatch(name)
            if m and m.group(2) in _EXPERT_NAMES:
                target, which = _EXPERT_NAMES[m.group(2)]
                parts = by_hf.setdefault(f"model.layers.{m.group(1)}.{target}", ["", ""] if "gate_up" in target else [""])
                parts[which] = name
                continue
            by_hf[hf_name(name) or f"<gguf tensor {name}>"] = [name]
        for hf, parts in by_hf.items():
            if "" in parts:
                raise ModelLoadError(f"{self.path}: {parts[0] or parts[1]!r} has no ffn_gate_exps/ffn_up_exps partner")
        names = select_names(by_hf, config, source=str(self.path))
        expected = expected_shapes(config)
        for name in names:  # every shape is checked before any tensor is dequantized
            for g in by_hf[name]:
                info = self.tensors[g]
                want = expected[name]
                if len(by_hf[name]) == 2:  # one of gate / up: [E, Ie, hidden]
                    want = (want[0], want[1] // 2, want[2])
                check_shape(name, info.torch_shape, {name: want}, f"{self.path} (GGUF tensor {info.name})")
        if keep_quantized:
            self._log_reencoded([self.tensors[g] for name in names for g in by_hf[name]])
        weights: Weights = {}
        # NOTE: numpy releases the GIL inside dequantization, so threads use every core.
        with progress_bar(len(names), f"loading {self.path.name}", progress) as bar, \
                ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            futures = {pool.submit(self._load_parts, name, by_hf[name], config, dtype, keep_quantized,
                                   None if part is None else part(name, len(expected[name]))): name
                       for name in names}
            for future in as_completed(futures):
                weights[futures[future]] = future.result()
                bar.update()
        return {name: weights[name] for name in names}

    def _log_reencoded(self, infos: list[TensorInfo]) -> None:
        """One warning for the quantized tensors of types without kernels (kept as Q8_0 instead)."""
        from kog.ops import QUANT_TYPES

        native = {v[0] for v in QUANT_TYPES.values()}
        odd = [i for i in infos if i.qtype not in _FLOAT_TYPES and int(i.qtype) not in native]
        if not odd:
            return
        types = sorted({i.qtype.name for i in odd})
        file_mb = sum(i.nbytes for i in odd) / 1e6
        _, q8_elems, q8_bytes = QUANT_TYPES["Q8_0"]
        q8_mb = sum(int(np.prod(i.torch_shape)) // q8_elems * q8_bytes for i in odd) / 1e6
        log.warning("%s: %d tensors of type %s have no native kernels: re-encoded as Q8_0 at load "
                    "(%.1f MB in the file -> %.1f MB; dtype='float32' dequantizes instead)",
                    self.path.name, len(odd), "/".join(types), file_mb, q8_mb)

    def _load_parts(self, name: str, gguf_names: list[str], config: ModelConfig, dtype: torch.dtype,
                    keep_quantized: bool, index: tuple[slice, ...] | None) -> torch.Tensor | QuantizedWeight:
        infos = [self.tensors[g] for g in gguf_names]
        try:
            if len(infos[0].torch_shape) == 3:  # stacked experts [E, rows, cols]
                if keep_quantized and all(i.qtype not in _FLOAT_TYPES for i in infos):
                    return self._quantized_experts(infos, index)
                parts = [self._load_one(name, g, config, dtype, False, index) for g in gguf_names]
                return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [E, gate; up, hidden]
            return self._load_one(name, gguf_names[0], config, dtype, keep_quantized, index)
        except InvalidRequest as e:
            cut = ", ".join(f"{s.start or 0}:{'' if s.stop is None else s.stop}" for s in index or ())
            raise InvalidRequest(f"{name}: its part [{cut}]: {e}") from None

    def _load_one(self, name: str, gguf_name: str, config: ModelConfig, dtype: torch.dtype,
                  keep_quantized: bool, index: tuple[slice, ...] | None = None) -> torch.Tensor | QuantizedWeight:
        info = self.tensors[gguf_name]
        if keep_quantized and info.qtype not in _FLOAT_TYPES:
            w: torch.Tensor | QuantizedWeight = self._quantized(info, index=index)
        else:
            w = self._dequantize(info, index).to(dtype)
        heads = {".self_attn.q_proj.": config.num_attention_heads, ".self_attn.k_proj.": config.num_key_value_heads}
        for part, n_heads in heads.items():
            if config.architecture in ("llama", "mixtral") and part in name:
                # The permutation moves whole rows within a head; a part holds whole heads.
                n_heads = n_heads * w.shape[0] // info.torch_shape[0]
                if isinstance(w, QuantizedWeight):
                    return w.with_data(_unpermute_rows(w.data, n_heads))
                return _unpermute_rows(w, n_heads)
        return w

    # ------------------------------------------------------------------ internal helpers

    def _quantized(self, info: TensorInfo, stacked: bool = False,
                   index: tuple[slice, ...] | None = None) -> QuantizedWeight:
        """A block-quantized matrix (its part `index`, see _read) as stored (a copy: the mapping
        is read-only); stacked: an [E, rows, cols] tensor as E rows block rows.

        Raises:
            InvalidRequest: columns of index that cut a block."""
        from kog.ops import QUANT_TYPES

        cols = info.torch_shape[-1]
        if len(info.torch_shape) != (3 if stacked else 2):
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} has a {len(info.torch_shape)}-D shape, which "
                                 f"Kog cannot keep quantized (2-D matrices or stacked experts); load it with "
                                 f"dtype='float32' to dequantize")
        if int(info.qtype) not in {v[0] for v in QUANT_TYPES.values()}:
            # No native kernels (IQ*, Q2_K, Q3_K, ...): re-encoded as Q8_0, the finest type that has
            # them (load_weights logs which tensors and what it costs).
            if cols % 32:
                raise ModelLoadError(f"{self.path}: tensor {info.name!r} has type {info.qtype.name}, which Kog "
                                     f"has no kernels for, and {cols} columns, not whole Q8_0 blocks of 32 to "
                                     f"re-encode it in (native types: {', '.join(sorted(QUANT_TYPES))}); load it "
                                     f"with dtype='float32' to dequantize")
            rows_only = None if index is None else index[:-1] if len(index) == len(info.torch_shape) else index
            q8 = quantize_q8_0(self._dequantize(info, rows_only).reshape(-1, cols))
            return q8 if index is None or len(index) < len(info.torch_shape) else q8.take((slice(None), index[-1]))
        raw, shape, cut = self._read(info, index)  # uint8 [rows, row_bytes]
        if cut is not None:
            block_columns(int(info.qtype), cut.start, cut.stop)  # raises: the columns cut a block
        return QuantizedWeight(torch.from_numpy(raw.copy()), int(info.qtype), int(shape[-1]))

    def _quantized_experts(self, infos: list[TensorInfo], index: tuple[slice, ...] | None = None) -> QuantizedWeight:
        """Stacked experts kept in their blocks: [E, rows, cols] (gate and up: concatenated per
        expert, [E, 2 rows, cols]) as a QuantizedWeight of E rows (2 rows) block rows, expert e's
        matrix first at row e rows (kog.models.moe_weights); index: the experts to keep (a
        slice of E), or None.

        NOTE: gate and up of different types (a mixed quantization) are re-encoded together as
        Q8_0, as kog.quantized.cat_rows does for a dense layer's fused gate/up.
        """
        parts = [self._quantized(info, stacked=True, index=index) for info in infos]
        _, rows, cols = infos[0].torch_shape
        E = parts[0].shape[0] // rows
        if len(parts) == 1 or parts[0].qtype == parts[1].qtype:
            data = torch.cat([p.data.view(E, rows, -1) for p in parts], dim=1).reshape(E * rows * len(parts), -1)
            return parts[0].with_data(data.contiguous())
        per_expert = [p.dequantize().view(E, rows, cols) for p in parts]
        return quantize_q8_0(torch.cat(per_expert, dim=1).reshape(-1, cols))

    def _dequantize(self, info: TensorInfo, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor (its part `index`, see _read) decoded, in its torch shape (f32, or the
        file's f16 / bf16)."""
        import gguf

        raw, shape, cut = self._read(info, index)
        raw = raw.copy()  # the part's bytes, contiguous: the mapping is read-only
        qtype = info.qtype
        try:
            if qtype == gguf.GGMLQuantizationType.F32:
                t = torch.from_numpy(raw.view(np.float32))
            elif qtype == gguf.GGMLQuantizationType.F16:
                t = torch.from_numpy(raw.view(np.float16))
            elif qtype == gguf.GGMLQuantizationType.BF16:
                t = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
            else:
                t = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
            t = t.reshape(shape)
            return t if cut is None else t[..., cut].contiguous()
        except NotImplementedError:
            from kog.ops import QUANT_TYPES

            raise ModelLoadError(f"{self.path}: tensor {info.name!r} uses unsupported type {qtype.name}: Kog runs "
                                 f"F32, F16, BF16 and {', '.join(sorted(QUANT_TYPES))} natively, and other block "
                                 f"types that gguf decodes (IQ*, Q2_K, Q3_K, ...) as Q8_0") from None
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} is corrupt: {e}") from None

    def _read(self, info: TensorInfo, index: tuple[slice, ...] | None) -> tuple[np.ndarray, tuple[int, ...],
                                                                                 slice | None]:
        """The stored bytes of the part of `info` that index takes on its torch shape (None:
        all; a slice of the first dim, whole in the middle ones, a slice of the columns): uint8
        [rows, row_bytes], a read-only view of the file; the part's shape when decoded; and the
        columns still to cut after decoding (None, unless they cut a block: whole rows then)."""
        import gguf

        shape = info.torch_shape
        raw = self.file.data(info).reshape(int(np.prod(shape[:-1], dtype=np.int64)), -1)
        index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
        if len(index) != len(shape) or any(s.step not in (None, 1) for s in index) or \
                any(s != slice(None) for s in index[1:-1]):
            raise ValueError(f"{info.name}: cannot read part {index} of a {shape} tensor")
        lead = shape[:-1]
        if lead:
            a, b, _ = index[0].indices(shape[0])
            per = int(np.prod(shape[1:-1], dtype=np.int64))  # byte rows per index of the first dim
            raw, lead = raw[a * per : b * per], (b - a, *shape[1:-1])
        lo, hi, _ = index[-1].indices(shape[-1])
        if (lo, hi) == (0, shape[-1]):
            return raw, (*lead, shape[-1]), None
        block, block_bytes = gguf.GGML_QUANT_SIZES[info.qtype]
        if lo % block or hi % block:
            return raw, (*lead, shape[-1]), slice(lo, hi)
        return raw[:, lo // block * block_bytes : hi // block * block_bytes], (*lead, hi - lo), None

    def _rope_scaling(self, arch: str, head_dim: int) -> dict[str, Any] | None:
        kind = self.get(f"{arch}.rope.scaling.type")
        if kind in ("linear", "yarn"):
            scaling: dict[str, Any] = {"rope_type": kind, "factor": float(self.get(f"{arch}.rope.scaling.factor"))}
            original = self.get(f"{arch}.rope.scaling.original_context_length")
            if original:
                scaling["original_max_position_embeddings"] = int(original)
            return scaling
        if _ROPE_FREQS in self.tensors:
            return _llama3_scaling_from_factors(
                self._dequantize(self.tensors[_ROPE_FREQS]).float(),
                float(self.get(f"{arch}.rope.freq_base", 10000.0)), head_dim, self.path,
            )
        if kind not in (None, "none"):
            raise ModelLoadError(f"{self.path}: unsupported RoPE scaling {kind!r}")
        return None


def _f32(value: float) -> float:
    """GGUF stores floats as f32: 1e-5 reads back as 9.99999974e-06; keep the shortest decimal."""
    return float(str(np.float32(value)))


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation.

    llama.cpp stores head rows as (head_dim/2, 2) pairs (x0, x_half, x1, x_half+1, ...); HF keeps
    (2, head_dim/2) halves. w: [n_heads * head_dim, ...] (weight) or [n_heads * head_dim] (bias).
    """
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """Per-frequency divisors llama3 RoPE scaling applies (what llama.cpp stores as rope_freqs)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen > old_ctx / low, torch.full_like(wavelen, factor), mid)
    return torch.where(wavelen < old_ctx / high, torch.ones_like(wavelen), out).float()


def _llama3_scaling_from_factors(freqs: torch.Tensor, theta: float, head_dim: int, path: Path) -> dict[str, Any]:
    """GGUF keeps only the factors of llama3 RoPE scaling; recovers the HF parameters.

    NOTE: every released Llama 3.x uses low=1, high=4, original context 8192; only `factor`
    varies (8 for 3.1, 32 for 3.2), so those are tried and checked against the stored factors.
    """
    candidate = {"rope_type": "llama3", "factor": float(freqs.max()), "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if torch.allclose(llama3_rope_factors(theta, head_dim, candidate), freqs, rtol=1e-4):
        return candidate
    raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' matches no known llama3 RoPE scaling")
