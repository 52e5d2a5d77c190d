"""GGUF -> GGUF in another weight type (`kog convert model.gguf out.gguf --outtype q8_0`), in the
layout llama.cpp reads, so the same weights can run in Kog and in llama.cpp.

The source's metadata (architecture, hyper-parameters, tokenizer, chat template) is copied
field by field with its GGUF types; `general.file_type` names the new type. Each tensor is
dequantized to f32, then written as llama.cpp's quantizer would: 2-D weight matrices in the
target type, everything else (norms, RoPE factors) as F32. Q4_K needs rows that are a multiple
of its 256-element super-block; a matrix whose rows are not (SmolLM2's hidden size is 576) is
written as Q8_0, and the result lists every such fallback. F16, BF16 and Q8_0 use gguf-py's
quantizers; gguf-py decodes Q4_K but cannot encode it, so `quantize_q4_k` is ours.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from kog.errors import ModelLoadError

Q = gguf.GGMLQuantizationType
OUT_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_k": Q.Q4_K}
_FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
               Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
               Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_S}
_SKIPPED_FIELDS = ("GGUF.", "general.architecture", "general.file_type")  # written by the writer


def requantize_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], outtype: str) -> dict[str, str]:
    """Writes dst, the GGUF src with its weight matrices in `outtype` (a key of OUT_TYPES).

    Returns:
        {tensor name: written type name} for every tensor.
    Raises:
        ModelLoadError: src is not a readable GGUF, or outtype is unknown.
    """
    if outtype not in OUT_TYPES:
        raise ModelLoadError(f"unknown GGUF output type {outtype!r}; choose one of {sorted(OUT_TYPES)}")
    target = OUT_TYPES[outtype]
    try:
        reader = gguf.GGUFReader(src)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{src}: not a readable GGUF file ({e})") from e
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(Path(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith(_SKIPPED_FIELDS):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(_FILE_TYPES[target])
    written = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        qtype = _tensor_type(t.name, values, target)
        writer.add_tensor(t.name, _encode(values, qtype), raw_dtype=qtype if qtype in _RAW else None)
        written[t.name] = qtype.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


_RAW = (Q.BF16, Q.Q8_0, Q.Q4_K)  # written as uint8 blocks with their type named


def _tensor_type(name: str, values: np.ndarray, target: Q) -> Q:
    if values.ndim != 2 or not name.endswith(".weight") or target == Q.F32:
        return Q.F32
    if target == Q.Q4_K and values.shape[-1] % gguf.QK_K:
        return Q.Q8_0 if values.shape[-1] % 32 == 0 else Q.F16
    if target == Q.Q8_0 and values.shape[-1] % 32:
        return Q.F16
    return target


def _encode(values: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype == Q.Q4_K:
        return quantize_q4_k(values)
    return gguf.quants.quantize(values, qtype)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of x [..., k] f32 (k a multiple of 256): uint8 [..., k / 256 * 144].

    A super-block of 256 is 8 sub-blocks of 32, each x ~ d * sc_j * q - dmin * m_j with q in
    [0, 15]: per sub-block the affine fit of its min (<= 0) and max, then sc_j and m_j rounded
    to 6 bits against the super-block's fp16 d = max scale / 63 and dmin = max min / 63, then q
    rounded against those. Layout (llama.cpp's block_q4_K): d, dmin (fp16), 12 bytes of 6-bit
    scales and mins (sub-blocks 0-3 in the low 6 bits of bytes 0-7; 4-7 split over the nibbles
    of bytes 8-11 and the top 2 bits of bytes 0-7), 128 bytes of nibbles (per 64 values, the
    first 32 in the low nibbles, the next 32 in the high ones). Simpler than llama.cpp's
    iterative search of each sub-block's scale (make_qkx2_quants): a somewhat larger error.
    """
    if x.shape[-1] % gguf.QK_K:
        raise ValueError(f"Q4_K needs rows of a multiple of {gguf.QK_K} values, got {x.shape[-1]}")
    lead = x.shape[:-1]
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 15.0  # [n, 8]
    mins = -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dminf > 0, np.rint(mins / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint((sub + (dminf * m)[..., None]) / step), 0)
    q = q.clip(0, 15).astype(np.uint8)
    scales = np.empty((sub.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # per 64 values: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return blocks.reshape(*lead, -1)
