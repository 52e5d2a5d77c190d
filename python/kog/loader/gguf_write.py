"""Writing GGUF files in the layout llama.cpp reads, so the same weights run in Kog and in
llama.cpp: from another GGUF in another weight type (`kog convert model.gguf out.gguf --outtype
q8_0`, requantize_gguf) or from an HF folder (`kog convert hf_folder out.gguf`, hf_to_gguf). Dense families and qwen3_moe
(llama.cpp's qwen3moe: stacked blk.N.ffn_{gate,up,down}_exps, the router ffn_gate_inp in F32).

GGUF -> GGUF: the source's metadata (architecture, hyper-parameters, tokenizer, chat template) is copied
field by field with its GGUF types; `general.file_type` names the new type. Each tensor is
dequantized to f32, then written as llama.cpp's quantizer would: 2-D weight matrices in the
target type, everything else (norms, RoPE factors) as F32. Q4_K needs rows that are a multiple
of its 256-element super-block; a matrix whose rows are not (SmolLM2's hidden size is 576) is
written as Q8_0, and the result lists every such fallback. F16, BF16 and Q8_0 use gguf-py's
quantizers; gguf-py decodes Q4_K, Q5_K and Q6_K but cannot encode them, so `quantize_q4_k` (and,
for tests and future out types, `quantize_q5_k`, `quantize_q6_k`) are ours.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kog.config import ModelConfig
from kog.errors import ModelLoadError
from kog.loader.gguf import GGUF_ARCHITECTURES, gguf_name, llama3_rope_factors
from kog.loader.tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT, Tokenizer, read_tokenizer_config, tokenizer_from_gguf

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
    target = _out_type(outtype)
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
        written[t.name] = _add_tensor(writer, t.name, values, target)
    _finish(writer)
    return written


# Kog family -> GGUF architecture where the names differ (Mistral GGUFs are llama files).
GGUF_ARCH_OF = {"mistral": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
_RAW = (Q.BF16, Q.Q8_0, Q.Q4_K)  # written as uint8 blocks with their type named

# llama.cpp names of the byte-level BPE pre-tokenizers Kog reproduces (kog.loader.tokenizer), in
# the order hf_to_gguf tries them, and the texts a candidate must tokenize exactly as the
# folder's tokenizer does.
_PRE_CANDIDATES = ("smollm", "llama-bpe", "qwen2", "default")
_PROBES = ("Hello world", "naïve café 東京 😀👍🏽", "def f(x):\n    return x**2  # 1234567", "  spaces\t\ttabs\n\n",
           "I'm sure they'll say it's OK, don't you?", "12345 + 678.9 = 1e10", "ÀÉÎõü ℌ ﬁ ①", "\r\n\u00a0end")


def hf_to_gguf(folder: str | os.PathLike[str], dst: str | os.PathLike[str], outtype: str = "f16") -> dict[str, str]:
    """Writes dst, an HF folder (config, safetensors, byte-level BPE tokenizer, chat template)
    as a GGUF: llama.cpp's tensor names and metadata keys, q/k rows in its RoPE order for the
    llama architecture, the tokenizer as `tokenizer.ggml.*` with the llama.cpp pre-tokenizer
    that tokenizes like the folder's (checked on probe texts), matrices in `outtype`.

    Returns:
        {tensor name: written type name}.
    Raises:
        ModelLoadError: an unknown outtype, a model or tokenizer GGUF cannot describe.
    """
    from kog.loader import load_model

    target = _out_type(outtype)
    model = load_model(folder, dtype=torch.float32)
    config = model.config
    arch = GGUF_ARCH_OF.get(config.architecture, config.architecture)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{folder}: no GGUF architecture for {config.architecture!r}")
    writer = gguf.GGUFWriter(Path(dst), arch)
    metadata = model_metadata(config, arch) | moe_metadata(config, arch)
    for key, value in (metadata | tokenizer_metadata(model.tokenizer, config, str(folder))).items():
        add_value(writer, key, value)
    writer.add_string("general.name", Path(folder).name)
    template = read_tokenizer_config(Path(folder)).get("chat_template")
    if isinstance(template, str):
        writer.add_string("tokenizer.chat_template", template)
    writer.add_file_type(_FILE_TYPES[target])
    written = {}
    if (config.rope_scaling or {}).get("rope_type") == "llama3":  # llama.cpp stores the factors instead
        factors = llama3_rope_factors(config.rope_theta, config.head_dim, config.rope_scaling).float().numpy()
        writer.add_tensor("rope_freqs.weight", factors)
        written["rope_freqs.weight"] = "F32"
    for hf, w in split_experts(model.weights):
        name = hf if hf.startswith("blk.") else gguf_name(hf)
        if name is None:
            raise ModelLoadError(f"{folder}: no GGUF name for tensor {hf}")
        written[name] = _add_tensor(writer, name, permute_for_llama_cpp(hf, w.float(), config, arch).numpy(), target)
    _finish(writer)
    return written


def model_metadata(config: ModelConfig, arch: str) -> dict[str, Any]:
    """The `{arch}.*` hyper-parameter keys llama.cpp reads (GGUFCheckpoint.config inverts them)."""
    md: dict[str, Any] = {
        f"{arch}.block_count": config.num_hidden_layers,
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.attention.key_length": config.head_dim,
        f"{arch}.attention.value_length": config.head_dim,
        f"{arch}.rope.dimension_count": config.head_dim,
        f"{arch}.rope.freq_base": float(config.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{arch}.vocab_size": config.vocab_size,
    }
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") in ("linear", "yarn"):
        md[f"{arch}.rope.scaling.type"] = scaling["rope_type"]
        md[f"{arch}.rope.scaling.factor"] = float(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            md[f"{arch}.rope.scaling.original_context_length"] = scaling["original_max_position_embeddings"]
    return md


def moe_metadata(config: ModelConfig, arch: str) -> dict[str, Any]:
    """llama.cpp's MoE keys, as its converter writes them: expert_count, expert_used_count, and
    the experts' width -- qwen3moe's and qwen2moe's expert_feed_forward_length
    (feed_forward_length keeps the dense layers' intermediate_size), Mixtral's (llama)
    feed_forward_length; qwen2moe's expert_shared_feed_forward_length. `expert_weights_norm`
    only when the folder differs from llama.cpp's graph for the architecture (qwen3moe and
    Mixtral renormalize the top-k weights, qwen2moe does not): Kog reads it, llama.cpp's
    qwen3moe/qwen2moe graphs ignore it. {} for a dense model."""
    if not config.is_moe:
        return {}
    md: dict[str, Any] = {f"{arch}.expert_count": config.num_experts,
                          f"{arch}.expert_used_count": config.num_experts_per_tok}
    if arch in ("qwen3moe", "qwen2moe"):
        md[f"{arch}.expert_feed_forward_length"] = config.moe_intermediate_size
    else:
        md[f"{arch}.feed_forward_length"] = config.moe_intermediate_size
    if arch == "qwen2moe":
        md[f"{arch}.expert_shared_feed_forward_length"] = config.shared_expert_intermediate_size
    if config.norm_topk_prob != NORM_TOPK_DEFAULT[arch]:
        md[f"{arch}.expert_weights_norm"] = config.norm_topk_prob
    return md


# Whether llama.cpp's graph renormalizes the top-k expert weights, per GGUF architecture (what a
# file without `expert_weights_norm` means; kog.loader.gguf reads it the same way).
NORM_TOPK_DEFAULT = {"qwen3moe": True, "llama": True, "qwen2moe": False}


def split_experts(weights: dict[str, torch.Tensor]):
    """(name, tensor) pairs to write: a stacked MoE layer's tensors as llama.cpp's
    blk.N.ffn_{gate,up,down}_exps.weight (GGUF names, [E, rows, cols] in torch order), every
    other tensor as it is (its HF name)."""
    for name, w in weights.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 Ie, hidden]: gate rows, then up rows
            layer, half = name.split(".")[2], w.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", w[:, :half]
            yield f"blk.{layer}.ffn_up_exps.weight", w[:, half:]
        elif name.endswith("mlp.experts.down_proj"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.weight", w
        else:
            yield name, w


def tokenizer_metadata(tok: Tokenizer, config: ModelConfig, source: str) -> dict[str, Any]:
    """`tokenizer.ggml.*` of a byte-level BPE tokenizer: tokens by id (padded to the model's
    vocabulary as llama.cpp pads, `[PAD<id>]`), types (control for special added tokens,
    user-defined for the others), merges, special ids, and the first pre-tokenizer of
    _PRE_CANDIDATES that tokenizes _PROBES exactly as `tok` does."""
    spec = json.loads(tok.hf.to_str())
    bpe = spec.get("model") or {}
    if bpe.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ModelLoadError(f"{source}: only byte-level BPE tokenizers can be written to GGUF (this one: "
                             f"{bpe.get('type')!r})")
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    n = max([*bpe["vocab"].values(), *added, config.vocab_size - 1]) + 1
    tokens, types = [f"[PAD{i}]" for i in range(n)], [_USER_DEFINED] * n
    for t, i in bpe["vocab"].items():
        tokens[i], types[i] = t, _NORMAL
    for i, a in added.items():
        tokens[i], types[i] = a["content"], _CONTROL if a.get("special") else _USER_DEFINED
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])],
        "tokenizer.ggml.add_bos_token": bool(tok.add_bos_token),
    }
    for key, token in (("bos", tok.bos_token), ("eos", tok.eos_token), ("padding", tok.pad_token),
                       ("unknown", tok.unk_token)):
        if token is not None and tok.token_to_id(token) is not None:
            md[f"tokenizer.ggml.{key}_token_id"] = tok.token_to_id(token)
    if "tokenizer.ggml.eos_token_id" not in md and config.eos_token_ids:
        md["tokenizer.ggml.eos_token_id"] = config.eos_token_ids[0]
    if "tokenizer.ggml.bos_token_id" not in md and config.bos_token_id is not None:
        md["tokenizer.ggml.bos_token_id"] = config.bos_token_id
    want = [tok.encode(p) for p in _PROBES]
    for pre in sorted(_PRE_CANDIDATES, key=lambda c: c != _declared_pre(spec)):
        candidate = tokenizer_from_gguf(md | {"tokenizer.ggml.pre": pre}, source=source)
        if [candidate.encode(p) for p in _PROBES] == want:
            return md | {"tokenizer.ggml.pre": pre}
    raise ModelLoadError(f"{source}: no llama.cpp pre-tokenizer Kog knows ({', '.join(_PRE_CANDIDATES)}) "
                         "tokenizes like this tokenizer; it cannot be written to GGUF")


_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp's token types


def _declared_pre(spec: dict[str, Any]) -> str:
    """The candidate tokenizer.json's pre-tokenizer spells out: its split regex (Llama 3, Qwen2),
    or SmolLM2's individual digits; "default" otherwise. Tried first: two candidates can agree
    on every probe of a small vocabulary and still differ elsewhere."""
    pre = json.dumps(spec.get("pre_tokenizer"))
    if json.dumps(QWEN2_SPLIT)[1:-1] in pre:
        return "qwen2"
    if json.dumps(LLAMA3_SPLIT)[1:-1] in pre:
        return "llama-bpe"
    return "smollm" if '"Digits"' in pre else "default"


def permute_for_llama_cpp(name: str, w: torch.Tensor, config: ModelConfig, arch: str) -> torch.Tensor:
    """llama.cpp's converter interleaves the RoPE halves of each q/k head (llama arch only);
    kog.loader.gguf undoes it on load."""
    if arch != "llama" or not (".q_proj." in name or ".k_proj." in name):
        return w
    heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """A metadata value with the GGUF type llama.cpp uses for it (ints as UINT32, int lists as
    INT32 arrays, floats as FLOAT32)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif value and isinstance(value[0], int):
        writer.add_array(key, [int(v) for v in value])
    else:
        writer.add_array(key, list(value))


def _out_type(outtype: str) -> Q:
    if outtype not in OUT_TYPES:
        raise ModelLoadError(f"unknown GGUF output type {outtype!r}; choose one of {sorted(OUT_TYPES)}")
    return OUT_TYPES[outtype]


def _add_tensor(writer: gguf.GGUFWriter, name: str, values: np.ndarray, target: Q) -> str:
    """Adds tensor `name` (f32 values) in the type llama.cpp's quantizer would give it for
    `target`; returns that type's name."""
    qtype = _tensor_type(name, values, target)
    writer.add_tensor(name, _encode(values, qtype), raw_dtype=qtype if qtype in _RAW else None)
    return qtype.name


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tensor_type(name: str, values: np.ndarray, target: Q) -> Q:
    # NOTE: llama.cpp keeps the MoE router (ffn_gate_inp) in F32 in every file type, and
    # qwen2moe's shared-expert gate ffn_gate_inp_shexp ([1, hidden]: one row, not a matrix to it).
    matrix = values.ndim == 2 or (values.ndim == 3 and name.endswith("_exps.weight"))
    router = ".ffn_gate_inp." in name or ".ffn_gate_inp_shexp." in name
    if not matrix or not name.endswith(".weight") or target == Q.F32 or router:
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


def _k_affine(x: np.ndarray, name: str, qmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's fit of x [..., k] (k a multiple of 256): per 32-value sub-block x ~ d sc_j q
    - dmin m_j with q in [0, qmax], from the affine fit of its min (<= 0) and max, sc_j and m_j
    rounded to 6 bits against the super-block's fp16 d = max scale / 63 and dmin = max min / 63,
    then q rounded against those. Returns the fp16 d, dmin as bytes [n, 4], the 12 bytes of 6-bit
    scales and mins [n, 12] (sub-blocks 0-3 in the low 6 bits of bytes 0-7; 4-7 split over the
    nibbles of bytes 8-11 and the top 2 bits of bytes 0-7), and q [n, 8, 32] uint8."""
    if x.shape[-1] % gguf.QK_K:
        raise ValueError(f"{name} needs rows of a multiple of {gguf.QK_K} values, got {x.shape[-1]}")
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / float(qmax)  # [n, 8]
    mins = -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dminf > 0, np.rint(mins / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint((sub + (dminf * m)[..., None]) / step), 0)
    scales = np.empty((sub.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    halves = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)], axis=1)
    return halves, scales, q.clip(0, qmax).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """The low 4 bits of q [n, 8, 32] as Q4_K / Q5_K's qs [n, 128]: per 64 values, sub-block 2c in
    the low nibbles, 2c + 1 in the high ones."""
    pairs = (q & 15).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of x [..., k] f32 (k a multiple of 256): uint8 [..., k / 256 * 144].

    `_k_affine` with q in [0, 15]; layout (llama.cpp's block_q4_K): d, dmin (fp16), 12 bytes of
    scales and mins, 128 bytes of nibbles. Simpler than llama.cpp's iterative search of each
    sub-block's scale (make_qkx2_quants): a somewhat larger error.
    """
    halves, scales, q = _k_affine(x, "Q4_K", 15)
    return np.concatenate([halves, scales, _nibbles(q)], axis=1).reshape(*x.shape[:-1], -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """Q5_K blocks of x [..., k] f32 (k a multiple of 256): uint8 [..., k / 256 * 176]: as
    quantize_q4_k with q in [0, 31], the fifth bit of value 32 j + l as bit j of qh[l] (32 bytes
    between the scales and the nibbles)."""
    halves, scales, q = _k_affine(x, "Q5_K", 31)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    return np.concatenate([halves, scales, qh, _nibbles(q)], axis=1).reshape(*x.shape[:-1], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of x [..., k] f32 (k a multiple of 256): uint8 [..., k / 256 * 210].

    Per 16-value group j an int8 scale sc_j against the super-block's fp16 d (|x| <= 31 d sc_j),
    q = rint(x / (d sc_j)) + 32 in [0, 63]. Value 128 h + 32 t + l: low 4 bits in nibble t // 2 of
    ql[64 h + 32 (t % 2) + l], high 2 bits in bits 2 t, 2 t + 1 of qh[32 h + l]; then the scales, d
    (llama.cpp's block_q6_K)."""
    if x.shape[-1] % gguf.QK_K:
        raise ValueError(f"Q6_K needs rows of a multiple of {gguf.QK_K} values, got {x.shape[-1]}")
    groups = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(groups).max(-1) / 31.0  # [n, 16]: q - 32 in [-31, 31]
    d = (scale.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(-128, 127).astype(np.int8)
        step = (df * sc.astype(np.float32))[..., None]
        q = np.where(step != 0, np.rint(groups / step), 0) + 32
    q = q.clip(0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, h, t, l]
    ql = np.zeros((q.shape[0], 2, 2, 32), np.uint8)  # [n, h, t % 2, l]
    qh = np.zeros((q.shape[0], 2, 32), np.uint8)
    for t in range(4):
        ql[:, :, t % 2] |= (q[:, :, t] & 15) << (4 * (t // 2))
        qh |= (q[:, :, t] >> 4) << (2 * t)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
                          axis=1).reshape(*x.shape[:-1], -1)