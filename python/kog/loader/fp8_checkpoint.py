"""HF checkpoints with FP8 e4m3 weights (`quantization_config` in config.json), as common FP8
tools write them, turned into Kog's per-output-channel FP8 (kog.fp8.Fp8Weight) or dequantized.

Forms accepted (a stored float8_e4m3fn `X.weight` beside its scale tensor):
- `quant_method: "fp8"` (transformers' FineGrainedFP8, DeepSeek-V3 style): `X.weight_scale_inv`,
  multiplied in despite its name: per tensor ([] or [1]), per channel ([n] or [n, 1]) or per
  block ([ceil(n / b0), ceil(k / b1)] for `weight_block_size` [b0, b1], usually [128, 128]).
- `quant_method: "compressed-tensors"` with `format: "float-quantized"` (llm-compressor):
  `X.weight_scale` per tensor or per channel; `X.input_scale` (static activation scales) is
  dropped: Kog keeps activations in the run dtype, so weights alone define the model.
Per-tensor and per-channel scales convert exactly. Block scales are NOT run by the kernel: such
a matrix is dequantized and re-quantized per channel at load (logged once per load), one more
rounding to e4m3.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kog.errors import ModelLoadError

log = logging.getLogger("kog")

# Stored tensor suffixes that are scales of a weight, per quant_method, and those dropped.
_SCALE_SUFFIX = {"fp8": ".weight_scale_inv", "compressed-tensors": ".weight_scale"}
_DROPPED_SUFFIXES = (".input_scale", ".input_scale_inv")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """The FP8 form of a checkpoint: quant_method and, for "fp8", its weight_block_size."""

    method: str
    block: tuple[int, int] | None = None

    @property
    def scale_suffix(self) -> str:
        return _SCALE_SUFFIX[self.method]

    def is_scale(self, name: str) -> bool:
        return name.endswith(self.scale_suffix) or name.endswith(_DROPPED_SUFFIXES)


def read_fp8_checkpoint(folder: str | Path) -> Fp8Checkpoint | None:
    """The folder's FP8 form from config.json's quantization_config; None without one.

    Raises:
        ModelLoadError: a quantization_config Kog cannot load (another method or format).
    """
    path = Path(folder) / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read config: {e}") from None
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ModelLoadError(f"{path}: FP8 format {qc.get('fmt')!r} is not supported (e4m3 only)")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise ModelLoadError(f"{path}: weight_block_size {block!r} is not two positive sizes")
        return Fp8Checkpoint("fp8", tuple(block) if block is not None else None)
    if method == "compressed-tensors":
        if qc.get("format") != "float-quantized":
            raise ModelLoadError(f"{path}: compressed-tensors format {qc.get('format')!r} is not supported "
                                 "(float-quantized FP8 only)")
        return Fp8Checkpoint("compressed-tensors")
    if method in ("gptq", "awq"):  # 4-bit: kog.loader.int4_checkpoint
        return None
    raise ModelLoadError(f"{path}: quantization_config quant_method {method!r} is not supported "
                         "(supported: fp8, compressed-tensors float-quantized, 4-bit gptq and awq)")


def per_channel_scale(name: str, weight: torch.Tensor, scale: torch.Tensor, form: Fp8Checkpoint) -> torch.Tensor | None:
    """The stored scale of FP8 weight `name` [n, k] as f32 [n] (per tensor or per channel);
    None for block scales (the caller re-quantizes).

    Raises:
        ModelLoadError: a scale whose shape fits none of the forms, naming the tensor.
    """
    n, k = weight.shape
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1).expand(n).contiguous()
    if tuple(s.shape) in ((n,), (n, 1)):
        return s.reshape(n).contiguous()
    if form.block is not None:
        b0, b1 = form.block
        if tuple(s.shape) == (-(-n // b0), -(-k // b1)):
            return None
    scale_name = name[: -len(".weight")] + form.scale_suffix
    raise ModelLoadError(f"tensor {scale_name!r} has shape {list(s.shape)}, which is no per-tensor, "
                         f"per-channel ([{n}] or [{n}, 1])"
                         + (f" or [{form.block[0]}, {form.block[1]}]-block scale" if form.block else " scale")
                         + f" of the [{n}, {k}] weight")


def dequantize_stored(name: str, weight: torch.Tensor, scale: torch.Tensor, form: Fp8Checkpoint) -> torch.Tensor:
    """f32 [n, k] of a stored float8_e4m3fn weight and its scale (any accepted form)."""
    w = weight.float()
    rows = per_channel_scale(name, weight, scale, form)
    if rows is not None:
        return w * rows[:, None]
    b0, b1 = form.block
    s = scale.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)[: w.shape[0], : w.shape[1]]
    return w * s


def check_stored(name: str, weight: torch.Tensor, scale: torch.Tensor | None, form: Fp8Checkpoint) -> None:
    """Raises ModelLoadError naming `name` for an FP8 weight Kog cannot read: no scale tensor,
    a non-e4m3 dtype, not a matrix, non-finite scales or NaN codes."""
    if scale is None:
        raise ModelLoadError(f"FP8 weight {name!r} has no scale tensor {name[:-len('.weight')] + form.scale_suffix!r}")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ModelLoadError(f"FP8 weight {name!r} is {weight.dtype} {list(weight.shape)}, expected a "
                             "float8_e4m3fn matrix")
    if not torch.isfinite(scale.float()).all():
        raise ModelLoadError(f"tensor {name[:-len('.weight')] + form.scale_suffix!r} has non-finite scales")
    if torch.isnan(weight.float()).any():
        raise ModelLoadError(f"FP8 weight {name!r} holds NaN codes")


def fp8_matrix(name: str, weight: torch.Tensor, scale: torch.Tensor | None, form: Fp8Checkpoint,
               dtype: torch.dtype, keep: str | None):
    """A stored FP8 weight as Kog holds it: an Fp8Weight in encoding `keep` (per channel; block
    scales re-quantized), or with keep None a `dtype` tensor of its values.

    Raises:
        ModelLoadError: naming the tensor (check_stored, per_channel_scale).
    """
    from kog.fp8 import Fp8Weight, quantize, to_format

    check_stored(name, weight, scale, form)
    rows = per_channel_scale(name, weight, scale, form)
    if keep is None:
        return dequantize_stored(name, weight, scale, form).to(dtype)
    if rows is None:
        log.info("kog: %s has [%d, %d]-block FP8 scales; re-quantized per output channel at load (the GPU "
                 "kernel runs one scale per row)", name, *form.block)
        return quantize(dequantize_stored(name, weight, scale, form), keep)
    return to_format(Fp8Weight(weight.view(torch.uint8).contiguous(), rows, "e4m3fn"), keep)


# The per-layer matrices `quantization="fp8"` quantizes (embeddings, the LM head, norms and MoE
# experts stay in the run dtype, as FP8 tools leave lm_head out).
LINEAR_SUFFIXES = tuple(f".self_attn.{x}_proj.weight" for x in "qkvo") + tuple(
    f".mlp.{x}_proj.weight" for x in ("gate", "up", "down"))


def quantize_linears(weights: dict, dtype: torch.dtype, keep: str | None) -> dict:
    """`quantization="fp8"` at load: each float LINEAR_SUFFIXES matrix quantized per output channel
    (absmax / max of the encoding), kept as an Fp8Weight in encoding `keep`, or with keep None
    replaced by its FP8 values in `dtype` (the CPU runs the FP8 model's values dequantized).
    Fp8Weight matrices stay. A new dict.

    Raises:
        ModelLoadError: a matrix in a GGUF block format (quantized already).
    """
    from kog.fp8 import Fp8Weight, quantize
    from kog.quantized import QuantizedWeight

    out = dict(weights)
    for name, w in weights.items():
        if not name.endswith(LINEAR_SUFFIXES) or isinstance(w, Fp8Weight):
            continue
        if isinstance(w, QuantizedWeight):
            raise ModelLoadError(f"quantization=\"fp8\": {name!r} is {w.type_name} already; load the GGUF "
                                 "with dtype=\"bfloat16\" to re-quantize its matrices as FP8")
        q = quantize(w, keep or "e4m3fn")
        out[name] = q if keep is not None else q.dequantize().to(dtype)
    return out
