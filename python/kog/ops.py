"""Typed wrappers over the native kernels of kog._C.

Every wrapper checks shapes, dtypes and devices and raises kog.InvalidRequest (or
kog.BackendError for a device this build cannot run) before any native code runs. CPU tensors
run the CPU kernels (best ISA of the running CPU); CUDA/ROCm tensors run the GPU kernels on
torch's current stream.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from kog import _C
from kog.cpu_threads import apply_torch_threads
from kog.errors import BackendError, InvalidRequest

apply_torch_threads()

# torch dtype -> kog::DType code (csrc/common/dtype.h), as kog._C exports the codes.
DTYPE_CODE: dict[torch.dtype, int] = {getattr(torch, name): code for name, code in _C.DTYPE_CODES.items()}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _float_code(name: str, t: torch.Tensor) -> int:
    if t.dtype not in FLOAT_DTYPES:
        raise InvalidRequest(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    return DTYPE_CODE[t.dtype]


def _same(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if t.dtype != ref.dtype:
        raise InvalidRequest(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")
    if t.device != ref.device:
        raise InvalidRequest(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def kv_cache_dtype_ok(act: torch.dtype, cache: torch.dtype) -> bool:
    """Whether the CPU kernels read a KV cache of dtype `cache` under activations (q, k, v) of
    dtype `act`: the same dtype, or a float16 / bfloat16 cache under float32 (values rounded once
    on append, widened to fp32 on read). The GPU's cache has the activations' dtype."""
    return cache == act or (act == torch.float32 and cache in (torch.float16, torch.bfloat16))


def _kv_dtype_code(name: str, t: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """The cache's dtype code for kernels reading t (q, k, v) against kv_cache (kv_cache_dtype_ok)."""
    if t.device != kv_cache.device:
        raise InvalidRequest(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
    if t.dtype != kv_cache.dtype and not (kv_cache.device.type == "cpu" and kv_cache_dtype_ok(t.dtype, kv_cache.dtype)):
        raise InvalidRequest(f"{name} has dtype {t.dtype} but kv_cache has {kv_cache.dtype} (a cache may differ "
                             f"only on the CPU: float16 or bfloat16 under float32 activations)")
    return DTYPE_CODE[kv_cache.dtype]


def _device_and_stream(t: torch.Tensor) -> tuple[int, int]:
    """(-1, 0) for CPU tensors; (device index, current stream handle) for GPU tensors."""
    if t.device.type == "cpu":
        return -1, 0
    if t.device.type == "cuda":
        if not _C.has_gpu_backend:
            raise BackendError(
                f"tensor is on {t.device} but this kog build has no GPU backend "
                f"(rebuild with KOG_BACKEND=cuda or KOG_BACKEND=rocm)"
            )
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if index != torch.cuda.current_device():
            raise InvalidRequest(f"tensor is on {t.device} but the current device is cuda:{torch.cuda.current_device()}")
        return index, torch.cuda.current_stream(index).cuda_stream
    raise InvalidRequest(f"unsupported device {t.device}")


def _rows(name: str, t: torch.Tensor, width: int) -> tuple[int, int]:
    """(n_rows, row stride) of t seen as [n_rows, width] with unit stride inside a row.

    Raises InvalidRequest when t cannot be viewed that way without a copy.
    """
    if t.dim() == 0 or t.shape[-1] != width:
        raise InvalidRequest(f"{name} must have last dimension {width}, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        return 0, width
    if t.stride(-1) != 1 and width > 1:
        raise InvalidRequest(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    try:
        view = t.view(-1, width)
    except RuntimeError as e:
        raise InvalidRequest(f"{name} with shape {tuple(t.shape)} and strides {t.stride()} is not a strided matrix of rows") from e
    return view.shape[0], (view.stride(0) if view.shape[0] > 1 else width)


def _output(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(out, its row stride): a new tensor like `like`, or the caller's after checking it."""
    if out is None:
        out = torch.empty(shape, dtype=like.dtype, device=like.device)
    else:
        _same("out", out, like, "x")
        if tuple(out.shape) != shape:
            raise InvalidRequest(f"out must have shape {shape}, got {tuple(out.shape)}")
    return out, _rows("out", out, shape[-1])[1]


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dimension, optionally fused with the residual add before it.

    Args:
        x: [..., hidden], float32/float16/bfloat16.
        weight: [hidden], same dtype and device.
        eps: added to the mean square.
        residual: [..., hidden] like x; when given it is updated in place to ``x + residual``
            and that sum is normalized (the decoder-layer pattern).
        out: optional output like x (may be x itself); allocated when None.

    Returns:
        out: [..., hidden], ``norm * weight``.
    """
    code = _float_code("x", x)
    hidden = x.shape[-1] if x.dim() else 0
    _same("weight", weight, x, "x")
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise InvalidRequest(f"weight must be contiguous with shape ({hidden},), got {tuple(weight.shape)}")
    if not (eps >= 0 and math.isfinite(eps)):
        raise InvalidRequest(f"eps must be a finite number >= 0, got {eps}")
    n_rows, x_stride = _rows("x", x, hidden)
    res_stride = 0
    if residual is not None:
        _same("residual", residual, x, "x")
        if residual.shape != x.shape:
            raise InvalidRequest(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        _, res_stride = _rows("residual", residual, hidden)
    out, out_stride = _output(out, tuple(x.shape), x)
    device, stream = _device_and_stream(x)
    _C.rmsnorm(
        out.data_ptr(), x.data_ptr(), residual.data_ptr() if residual is not None else 0,
        weight.data_ptr(), n_rows, hidden, x_stride, out_stride, res_stride, float(eps), code,
        device, stream,
    )
    return out


def rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    is_neox: bool = True,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary position embedding, in place on q and k.

    Args:
        q: [n_tokens, n_q_heads, head_dim]; heads contiguous, any token stride.
        k: [n_tokens, n_kv_heads, head_dim] like q, or None.
        positions: [n_tokens] int32/int64, >= 0, same device.
        inv_freq: [rotary_dim / 2] float32 (see rope_inv_freq); rotary_dim <= head_dim.
        is_neox: rotate pairs (i, i + rotary_dim/2) if True, (2i, 2i+1) if False.
        attention_scaling: multiplies cos and sin (1.0 except for YaRN-style scaling).

    Returns:
        (q, k), rotated in place.
    """
    code = _float_code("q", q)
    if q.dim() != 3:
        raise InvalidRequest(f"q must be [n_tokens, n_heads, head_dim], got shape {tuple(q.shape)}")
    n_tokens, n_q_heads, head_dim = q.shape
    if q.numel() and (q.stride(2) != 1 or q.stride(1) != head_dim):
        raise InvalidRequest(f"q heads must be contiguous, got strides {q.stride()}")
    n_kv_heads, k_stride = 0, 0
    if k is not None:
        _same("k", k, q, "q")
        if k.dim() != 3 or k.shape[0] != n_tokens or k.shape[2] != head_dim:
            raise InvalidRequest(f"k must be [{n_tokens}, n_kv_heads, {head_dim}], got {tuple(k.shape)}")
        if k.numel() and (k.stride(2) != 1 or k.stride(1) != head_dim):
            raise InvalidRequest(f"k heads must be contiguous, got strides {k.stride()}")
        n_kv_heads, k_stride = k.shape[1], k.stride(0)
    if positions.dtype not in (torch.int32, torch.int64) or positions.shape != (n_tokens,):
        raise InvalidRequest(f"positions must be int32/int64 of shape ({n_tokens},), got {positions.dtype} {tuple(positions.shape)}")
    if positions.device != q.device or inv_freq.device != q.device:
        raise InvalidRequest("positions and inv_freq must be on q's device")
    positions = positions.contiguous()
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or not inv_freq.is_contiguous():
        raise InvalidRequest("inv_freq must be a contiguous 1-D float32 tensor")
    rotary_dim = 2 * inv_freq.shape[0]
    if not 0 < rotary_dim <= min(head_dim, 512):
        raise InvalidRequest(f"rotary_dim {rotary_dim} (2 x len(inv_freq)) must be in (0, min(head_dim={head_dim}, 512)]")
    device, stream = _device_and_stream(q)
    _C.rope(
        q.data_ptr(), k.data_ptr() if k is not None else 0, positions.data_ptr(), inv_freq.data_ptr(),
        n_tokens, n_q_heads, n_kv_heads, head_dim, rotary_dim, q.stride(0) if n_tokens > 1 else n_q_heads * head_dim,
        k_stride, float(attention_scaling), bool(is_neox), code, DTYPE_CODE[positions.dtype], device, stream,
    )
    return q, k


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU gate: ``silu(x[..., :d]) * x[..., d:]``.

    Args:
        x: [..., 2 * d], float32/float16/bfloat16.
        out: optional [..., d] output like x.

    Returns:
        out: [..., d].
    """
    code = _float_code("x", x)
    if x.dim() == 0 or x.shape[-1] % 2 != 0 or x.shape[-1] == 0:
        raise InvalidRequest(f"x must have an even, non-zero last dimension, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    n_rows, x_stride = _rows("x", x, 2 * d)
    out, out_stride = _output(out, (*x.shape[:-1], d), x)
    device, stream = _device_and_stream(x)
    _C.silu_and_mul(out.data_ptr(), x.data_ptr(), n_rows, d, x_stride, out_stride, code, device, stream)
    return out


def rope_inv_freq(
    rotary_dim: int, base: float = 10000.0, scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] (float32) for rope(), with HF-style rope_scaling.

    Args:
        rotary_dim: even number of rotated dimensions per head.
        base: rope_theta.
        scaling: the ``rope_scaling`` dict of an HF config, or None. Supported ``rope_type``
            (or ``type``): ``default``, ``linear`` (factor) and ``llama3`` (factor,
            low_freq_factor, high_freq_factor, original_max_position_embeddings).

    Returns:
        inv_freq: [rotary_dim / 2] float32 on the CPU.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise InvalidRequest(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if not base > 0:
        raise InvalidRequest(f"rope base (rope_theta) must be > 0, got {base}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise InvalidRequest(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    # Wavelengths longer than original_max / low_freq_factor are slowed by `factor`, shorter
    # than original_max / high_freq_factor kept, and those between interpolated smoothly.
    try:
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original_max = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise InvalidRequest(f"llama3 rope_scaling is missing {e.args[0]!r}") from None
    if high <= low:
        raise InvalidRequest(f"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_max / low, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original_max / high) & (wavelen <= original_max / low)
    return torch.where(medium, smoothed, scaled)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with Kog's decode-batch kernel (weights streamed once for all rows).

    Args:
        x: [..., k] float32/float16/bfloat16 (few rows: a decode batch).
        weight: [n, k] contiguous, same dtype (HF nn.Linear layout).
        bias: [n] or None.
        out: optional [..., n] output.

    Returns:
        out: [..., n].
    """
    code = _float_code("x", x)
    _same("weight", weight, x, "x")
    if weight.dim() != 2 or not weight.is_contiguous():
        raise InvalidRequest(f"weight must be a contiguous [n, k] matrix, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    m, x_stride, out, out_stride = _linear_operands(x, bias, out, n, k)
    device, stream = _device_and_stream(x)
    _C.linear(out.data_ptr(), x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else 0,
              m, n, k, x_stride, out_stride, code, device, stream)
    return out


def _linear_operands(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None, n: int,
                     k: int) -> tuple[int, int, torch.Tensor, int]:
    """(rows of x, x's row stride, out, out's row stride) of a product with an [n, k] weight,
    the bias checked ([n], contiguous, x's dtype and device)."""
    m, x_stride = _rows("x", x, k)
    if bias is not None:
        _same("bias", bias, x, "x")
        if bias.shape != (n,) or not bias.is_contiguous():
            raise InvalidRequest(f"bias must be contiguous with shape ({n},), got {tuple(bias.shape)}")
    out, out_stride = _output(out, (*x.shape[:-1], n), x)
    return m, x_stride, out, out_stride


def linear_fp8(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight.scale[:, None] * e4m3(weight.data)).T (+ bias)``: the GPU decode kernel's FP8
    GEMV (kog.fp8; dequantized in registers, each row's scale applied once per output).

    Args:
        x: [..., k] float32/float16/bfloat16 on the GPU, k a multiple of 16.
        weight: FP8 matrix [n, k] on the same GPU, in the build's encoding (kog.fp8.gpu_format()).
        bias: [n] in x's dtype, or None.
        out: optional [..., n] output.
    Raises:
        InvalidRequest: bad shapes or dtypes, a CPU tensor, or the wrong encoding.
        BackendError: a build without a GPU backend.
    """
    from kog.fp8 import gpu_format

    code = _float_code("x", x)
    if weight.fmt != gpu_format():
        raise InvalidRequest(f"linear_fp8: weight is {weight.fmt}, this build's GPU kernel reads {gpu_format()}")
    if not weight.data.is_contiguous() or weight.data.device != x.device or weight.scale.device != x.device:
        raise InvalidRequest("linear_fp8: weight bits and scale must be contiguous and on x's device")
    n, k = weight.shape
    m, x_stride, out, out_stride = _linear_operands(x, bias, out, n, k)
    device, stream = _device_and_stream(x)
    if device < 0:
        raise InvalidRequest("linear_fp8 runs on the GPU only (the CPU runs FP8 models dequantized)")
    _C.linear_fp8(out.data_ptr(), x.data_ptr(), weight.data.data_ptr(), weight.scale.data_ptr(),
                  bias.data_ptr() if bias is not None else 0, m, n, k, x_stride, out_stride, code, stream)
    return out


def linear_q4(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.dequantize().T (+ bias)``: the GPU decode kernel's 4-bit GEMV (kog.int4;
    codes decoded in registers through each group's scale and min).

    Args:
        x: [..., k] float32/float16/bfloat16 on the GPU.
        weight: kog.int4.Int4Weight [n, k] on the same GPU.
        bias: [n] in x's dtype, or None.
        out: optional [..., n] output.
    Raises:
        InvalidRequest: bad shapes or dtypes, or a CPU tensor.
        BackendError: a build without a GPU backend.
    """
    code = _float_code("x", x)
    if weight.device != x.device:
        raise InvalidRequest("linear_q4: weight codes and groups must be on x's device")
    n, k = weight.shape
    m, x_stride, out, out_stride = _linear_operands(x, bias, out, n, k)
    device, stream = _device_and_stream(x)
    if device < 0:
        raise InvalidRequest("linear_q4 runs on the GPU only (the CPU runs GGUF blocks with its own kernels)")
    _C.linear_q4(out.data_ptr(), x.data_ptr(), weight.codes.data_ptr(), weight.groups.data_ptr(), weight.kind,
                 bias.data_ptr() if bias is not None else 0, m, n, k, x_stride, out_stride, code, stream)
    return out


# GGUF block formats with native CPU kernels: name -> (ggml type id, elements, bytes per block).
QUANT_TYPES: dict[str, tuple[int, int, int]] = dict(_C.quant_types())
# Kog's row-interleaved forms of them (kog.quantized.pack_rows; csrc/ops/quant.h), never in a file:
# name -> (Kog's type id, the ggml type it packs, rows per group, fp16 fields leading / ending a block).
PACKED_QUANT_TYPES: dict[str, tuple[int, int, int, int, int]] = dict(_C.packed_quant_types())
_QUANT_BY_ID = {v[0]: (name, v[1], v[2]) for name, v in QUANT_TYPES.items()}
_QUANT_BY_ID.update({v[0]: (name, *QUANT_TYPES[_QUANT_BY_ID[v[1]][0]][1:]) for name, v in PACKED_QUANT_TYPES.items()})


def linear_quant(x: torch.Tensor, weight: torch.Tensor, quant_type: int | str,
                 out: torch.Tensor | None = None, x_stages: int = 1) -> torch.Tensor:
    """``x @ W.T`` with W given as GGUF quantized blocks, never dequantized (CPU).

    x is quantized per 32-element block to int8 (scale amax / 127) inside the kernel, so the
    result differs from the dequantized-fp32 product by at most sum_i |W_i| * amax_block(i) / 254.

    Args:
        x: [..., k] float32/float16/bfloat16 on the CPU.
        weight: [n, k / block_elems * block_bytes] uint8, contiguous: each row k elements of
            GGUF blocks as stored in the file (gguf's byte shape for an [n, k] tensor).
        quant_type: a ggml type id (``gguf.GGMLQuantizationType``) or name: Q4_0, Q4_1, Q5_0,
            Q5_1, Q8_0, Q4_K, Q5_K or Q6_K (or a packed ``_R8`` form of one, PACKED_QUANT_TYPES).
        out: optional [..., n] float32 output.
        x_stages: 1, or 2 to also quantize and dot x's residual after the first int8 rounding
            (the bound above divided by 254, for twice the integer work; the model's decode
            runs 2), or 0: x stays float32 and the weight is dequantized a tile of rows at a
            time in cache, exact f32 products (the prefill of short prompts; x must be float32).

    Returns:
        out: [..., n] float32.
    """
    if x_stages not in (0, 1, 2):
        raise InvalidRequest(f"x_stages must be 0, 1 or 2, got {x_stages!r}")
    if x_stages == 0 and x.dtype != torch.float32:
        raise InvalidRequest(f"x_stages 0 (f32 x) needs a float32 x, got {x.dtype}")
    if isinstance(quant_type, str):
        if quant_type not in QUANT_TYPES:
            raise InvalidRequest(f"unsupported quant type {quant_type!r} (supported: {', '.join(QUANT_TYPES)})")
        quant_type = QUANT_TYPES[quant_type][0]
    quant_type = int(quant_type)
    if quant_type not in _QUANT_BY_ID:
        raise InvalidRequest(f"unsupported quant type {quant_type} (supported: {', '.join(QUANT_TYPES)})")
    name, elems, nbytes = _QUANT_BY_ID[quant_type]
    code = _float_code("x", x)
    if weight.dtype != torch.uint8 or weight.dim() != 2 or not weight.is_contiguous():
        raise InvalidRequest(f"weight must be a contiguous uint8 [n, row_bytes] tensor, got {weight.dtype} "
                             f"shape {tuple(weight.shape)}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise InvalidRequest("linear_quant runs on the CPU only")
    n, row_bytes = weight.shape
    if row_bytes % nbytes:
        raise InvalidRequest(f"{name} weight rows must be whole {nbytes}-byte blocks, got {row_bytes} bytes")
    k = row_bytes // nbytes * elems
    m, x_stride = _rows("x", x, k)
    shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != shape:
        raise InvalidRequest(f"out must be float32 with shape {shape}, got {out.dtype} {tuple(out.shape)}")
    out_stride = _rows("out", out, n)[1]
    _C.linear_quant(out.data_ptr(), x.data_ptr(), weight.data_ptr(), weight.numel(), m, n, k, x_stride,
                    out_stride, code, quant_type, x_stages)
    return out


def quant_file_type(quant_type: int) -> int:
    """The ggml type a packed (row-interleaved) type id holds; any other id unchanged."""
    return next((v[1] for v in PACKED_QUANT_TYPES.values() if v[0] == int(quant_type)), int(quant_type))


def quant_type_name(quant_type: int) -> str:
    """The name of a ggml type id Kog has kernels for; InvalidRequest for any other."""
    if int(quant_type) not in _QUANT_BY_ID:
        raise InvalidRequest(f"unsupported quant type {quant_type} (supported: {', '.join(QUANT_TYPES)})")
    return _QUANT_BY_ID[int(quant_type)][0]


def quant_row_bytes(quant_type: int, cols: int) -> int:
    """Bytes of one row of `cols` elements in `quant_type` blocks (InvalidRequest if they do not fill blocks)."""
    name, elems, nbytes = _QUANT_BY_ID[int(quant_type)] if int(quant_type) in _QUANT_BY_ID else (None, 0, 0)
    if name is None:
        quant_type_name(quant_type)
    if cols <= 0 or cols % elems:
        raise InvalidRequest(f"{cols} columns do not fill {name} blocks of {elems}")
    return cols // elems * nbytes


def dequantize_rows(weight: torch.Tensor, quant_type: int | str, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of a GGUF-quantized matrix as f32 (CPU), as ``gguf.quants.dequantize`` computes them.

    Args:
        weight: [rows, row_bytes] uint8, contiguous: GGUF blocks as stored.
        quant_type: ggml type id or name (QUANT_TYPES).
        ids: optional int64 [n] row indices (each in [0, rows)); None: every row.

    Returns:
        [n, k] float32 (n = len(ids) or rows; k = row_bytes / block_bytes * block_elems).
    """
    if isinstance(quant_type, str):
        if quant_type not in QUANT_TYPES:
            raise InvalidRequest(f"unsupported quant type {quant_type!r} (supported: {', '.join(QUANT_TYPES)})")
        quant_type = QUANT_TYPES[quant_type][0]
    name = quant_type_name(quant_type)
    _, elems, nbytes = _QUANT_BY_ID[int(quant_type)]
    if weight.dtype != torch.uint8 or weight.dim() != 2 or not weight.is_contiguous() or weight.device.type != "cpu":
        raise InvalidRequest(f"weight must be a contiguous CPU uint8 [rows, row_bytes] tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
    rows, row_bytes = weight.shape
    if row_bytes % nbytes or row_bytes == 0:
        raise InvalidRequest(f"{name} weight rows must be whole {nbytes}-byte blocks, got {row_bytes} bytes")
    k = row_bytes // nbytes * elems
    if ids is not None:
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.device.type != "cpu":
            raise InvalidRequest(f"ids must be a 1-D int64 CPU tensor, got {ids.dtype} {tuple(ids.shape)}")
        ids = ids.contiguous()
    n = rows if ids is None else ids.shape[0]
    out = torch.empty(n, k, dtype=torch.float32)
    _C.dequantize_rows(out.data_ptr(), weight.data_ptr(), weight.numel(), rows,
                       0 if ids is None else ids.data_ptr(), n, k, int(quant_type))
    return out


# ---- paged KV cache and attention ------------------------------------------------------------
# One layer's cache: kv_cache [num_blocks, 2, n_kv_heads, block_size, head_dim] (dim 1: 0 = K,
# 1 = V), contiguous; token t of a sequence is at block_tables[s][t // block_size], offset
# t % block_size (slot = block_id * block_size + offset).


def _heads(name: str, t: torch.Tensor, n_tokens: int | None = None) -> None:
    if t.dim() != 3:
        raise InvalidRequest(f"{name} must be [n_tokens, n_heads, head_dim], got shape {tuple(t.shape)}")
    if n_tokens is not None and t.shape[0] != n_tokens:
        raise InvalidRequest(f"{name} must have {n_tokens} tokens, got shape {tuple(t.shape)}")
    if t.numel() and (t.stride(2) != 1 or t.stride(1) != t.shape[2]):
        raise InvalidRequest(f"{name} heads must be contiguous, got strides {t.stride()}")


def _token_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1] * t.shape[2]


def _kv_cache_shape(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_blocks, n_kv_heads, block_size, head_dim) of one layer's cache."""
    _float_code("kv_cache", kv_cache)
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise InvalidRequest(
            "kv_cache must be one layer [num_blocks, 2, n_kv_heads, block_size, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise InvalidRequest("kv_cache must be contiguous (pass kv_caches[layer] of the full cache)")
    num_blocks, _, n_kv_heads, block_size, head_dim = kv_cache.shape
    if num_blocks == 0 or n_kv_heads == 0 or block_size == 0 or head_dim == 0:
        raise InvalidRequest(f"kv_cache has an empty dimension: {tuple(kv_cache.shape)}")
    return num_blocks, n_kv_heads, block_size, head_dim


def _index_vector(name: str, t: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if t.dtype != dtype or t.shape != (n,):
        raise InvalidRequest(f"{name} must be {dtype} of shape ({n},), got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise InvalidRequest(f"{name} is on {t.device} but the cache is on {device}")
    return t.contiguous()


def kv_append(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    validate_indices: bool = True,
) -> None:
    """Write this step's keys and values into one layer's paged cache (reshape_and_cache).

    Args:
        k: [n_tokens, n_kv_heads, head_dim], heads contiguous, any token stride.
        v: like k.
        kv_cache: [num_blocks, 2, n_kv_heads, block_size, head_dim], same device; k's dtype, or on
            the CPU float16 / bfloat16 under float32 k (rounded once, to nearest even).
        slot_mapping: [n_tokens] int64, block_id * block_size + offset; negative = skip (padding).
            Non-negative slots must be distinct.
        validate_indices: check slot values (reads them; pass False when the caller already has).
    """
    num_blocks, n_kv_heads, block_size, head_dim = _kv_cache_shape(kv_cache)
    _same("v", v, k, "k")
    kv_code = _kv_dtype_code("k", k, kv_cache)
    code = DTYPE_CODE[k.dtype]
    for name, t in (("k", k), ("v", v)):
        _heads(name, t, k.shape[0] if k.dim() == 3 else None)
        if t.shape[1:] != (n_kv_heads, head_dim):
            raise InvalidRequest(f"{name} must be [n_tokens, {n_kv_heads}, {head_dim}] to match kv_cache, got {tuple(t.shape)}")
    n_tokens = k.shape[0]
    slot_mapping = _index_vector("slot_mapping", slot_mapping, n_tokens, torch.int64, kv_cache.device)
    if validate_indices and n_tokens:
        if int(slot_mapping.max()) >= num_blocks * block_size:
            raise InvalidRequest(f"slot_mapping holds slot {int(slot_mapping.max())} past the cache ({num_blocks} blocks of {block_size})")
        used = slot_mapping[slot_mapping >= 0]
        if used.numel() != torch.unique(used).numel():
            raise InvalidRequest("slot_mapping maps two tokens to the same slot")
    device, stream = _device_and_stream(kv_cache)
    _C.kv_append(
        kv_cache.data_ptr(), k.data_ptr(), v.data_ptr(), slot_mapping.data_ptr(), n_tokens,
        n_kv_heads, head_dim, block_size, num_blocks, _token_stride(k), _token_stride(v), code,
        device, stream, kv_code,
    )


def paged_attention_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float | None = None, out: torch.Tensor | None = None, validate_indices: bool = True,
    window: int = 0,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context (FlashDecoding on CPU).

    window > 0: a sliding-window layer; the token sees its last `window` positions.

    Args:
        q: [n_seqs, n_q_heads, head_dim], heads contiguous; n_q_heads a multiple of n_kv_heads,
            head_dim a multiple of 16 up to 256.
        kv_cache: one layer [num_blocks, 2, n_kv_heads, block_size, head_dim], q's dtype (or on the
            CPU float16 / bfloat16 under float32 q: keys and values widen to fp32 as they are read).
        block_tables: [n_seqs, max_blocks_per_seq] int32 block ids (entries past a sequence's
            last block are ignored).
        seq_lens: [n_seqs] int32 tokens in the cache incl. the new one, in [1, max_blocks * block_size].
        scale: softmax scale, head_dim ** -0.5 when None.
        out: optional [n_seqs, n_q_heads, head_dim] like q; may be q itself.
        validate_indices: check seq_lens and block ids (reads them; pass False for later layers
            of a step whose metadata was checked once).

    Returns:
        out: [n_seqs, n_q_heads, head_dim].
    """
    return _paged_attention(q, kv_cache, block_tables, seq_lens, None, scale, out, validate_indices, window=window)


def paged_attention_prefill(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, scale: float | None = None, out: torch.Tensor | None = None,
    validate_indices: bool = True, kernel: str = "auto", window: int = 0,
) -> torch.Tensor:
    """Causal attention of a batch of query chunks over their cached context.

    window > 0: a sliding-window layer; a row at position t sees positions in
    (t - window, t] (HF's sliding_window).

    Serves prompt prefill, chunked prefill and multi-token (speculative) verification. Sequence
    s owns q rows [query_start_loc[s], query_start_loc[s+1]) (q_len of them); its row i sits at
    position seq_lens[s] - q_len + i and attends to the cached positions up to that one.

    Args:
        q: [n_tokens, n_q_heads, head_dim], heads contiguous.
        kv_cache, block_tables, scale, out, validate_indices: as for paged_attention_decode
            (out [n_tokens, n_q_heads, head_dim], may be q itself).
        seq_lens: [n_seqs] int32 cached tokens per sequence incl. this chunk, >= q_len.
        query_start_loc: [n_seqs + 1] int32, non-decreasing, first 0, last n_tokens.
        kernel: GPU only: "auto" takes the flash-style prefill kernel when the longest chunk has
            at least _C.GPU_FLASH_PREFILL_MIN_QUERY_LEN tokens and the split (FlashDecoding)
            kernel otherwise; "flash" or "split" forces one (tests compare them).

    Returns:
        out: [n_tokens, n_q_heads, head_dim].
    """
    if query_start_loc is None:
        raise InvalidRequest("query_start_loc is required (use paged_attention_decode for one token per sequence)")
    if kernel not in _PREFILL_KERNEL:
        raise InvalidRequest(f"kernel must be one of {sorted(_PREFILL_KERNEL)}, got {kernel!r}")
    return _paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, out, validate_indices,
                            _PREFILL_KERNEL[kernel], window)


# GpuPrefillKernel (csrc/ops/attention.h).
_PREFILL_KERNEL = {"auto": 0, "split": 1, "flash": 2}


def _paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, out, validate, kernel=0, window=0):
    decode = query_start_loc is None
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise InvalidRequest(f"window must be an int >= 0 (0: no sliding window), got {window!r}")
    num_blocks, n_kv_heads, block_size, head_dim = _kv_cache_shape(kv_cache)
    kv_code = _kv_dtype_code("q", q, kv_cache)
    code = DTYPE_CODE[q.dtype]
    _heads("q", q)
    n_tokens, n_q_heads = q.shape[0], q.shape[1]
    if q.shape[2] != head_dim:
        raise InvalidRequest(f"q head_dim {q.shape[2]} != kv_cache head_dim {head_dim}")
    if n_q_heads == 0 or n_q_heads % n_kv_heads:
        raise InvalidRequest(f"q has {n_q_heads} heads, not a multiple of kv_cache's {n_kv_heads}")
    if head_dim % 16 or head_dim > 256:
        raise InvalidRequest(f"head_dim must be a multiple of 16 up to 256, got {head_dim}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise InvalidRequest(f"block_tables must be 2-D int32, got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.device != kv_cache.device:
        raise InvalidRequest(f"block_tables is on {block_tables.device} but kv_cache is on {kv_cache.device}")
    if block_tables.numel() and block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    n_seqs, max_blocks = block_tables.shape
    seq_lens = _index_vector("seq_lens", seq_lens, n_seqs, torch.int32, kv_cache.device)
    if decode and n_tokens != n_seqs:
        raise InvalidRequest(f"decode takes one query per sequence: q has {n_tokens} tokens, block_tables {n_seqs} rows")
    if not decode:
        query_start_loc = _index_vector("query_start_loc", query_start_loc, n_seqs + 1, torch.int32, kv_cache.device)
    max_seq_len = int(seq_lens.max()) if n_seqs else 0
    q_lens = query_start_loc.diff() if not decode else None
    max_q_len = 1 if decode else (int(q_lens.max()) if n_seqs else 0)
    if validate and n_seqs:
        _check_attention_indices(seq_lens, block_tables, query_start_loc, q_lens, n_tokens, num_blocks, block_size, decode)
    if scale is None:
        scale = head_dim ** -0.5
    if not math.isfinite(scale):
        raise InvalidRequest(f"scale must be finite, got {scale}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        _same("out", out, q, "q")
        _heads("out", out)
        if out.shape != q.shape:
            raise InvalidRequest(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    device, stream = _device_and_stream(kv_cache)
    partials = None
    if device >= 0:  # the split kernel's scratch (none for the flash prefill kernel), on the same stream
        if kernel == 0 and kv_cache.data_ptr() % 16:
            kernel = 1  # the flash kernel loads 16-byte vectors of the cache
        floats = _C.paged_attention_partials_floats(n_tokens, n_q_heads, head_dim, max(max_seq_len, 1), decode,
                                                    max_q_len, kernel)
        partials = torch.empty(floats, dtype=torch.float32, device=q.device) if floats else None
    _C.paged_attention(
        decode, out.data_ptr(), q.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), 0 if decode else query_start_loc.data_ptr(), n_seqs, n_tokens,
        n_q_heads, n_kv_heads, head_dim, block_size, num_blocks, max_blocks,
        block_tables.stride(0) if n_seqs > 1 else max_blocks, _token_stride(q), _token_stride(out),
        max_seq_len, max_q_len, float(scale), code, device, stream,
        partials.data_ptr() if partials is not None else 0, kernel, window, kv_code,
    )
    return out


def _check_attention_indices(seq_lens, block_tables, query_start_loc, q_lens, n_tokens, num_blocks, block_size, decode):
    max_blocks = block_tables.shape[1]
    if int(seq_lens.min()) < (1 if decode else 0):
        raise InvalidRequest(f"seq_lens must be >= {1 if decode else 0}, got {seq_lens.tolist()[:16]}")
    if int(seq_lens.max()) > max_blocks * block_size:
        raise InvalidRequest(f"seq_lens {int(seq_lens.max())} exceeds block_tables capacity ({max_blocks} blocks of {block_size})")
    if query_start_loc is not None:
        if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != n_tokens:
            raise InvalidRequest(f"query_start_loc must start at 0 and end at n_tokens={n_tokens}, got {query_start_loc.tolist()[:16]}")
        if int(q_lens.min()) < 0:
            raise InvalidRequest("query_start_loc must be non-decreasing")
        if bool((q_lens > seq_lens).any()):
            raise InvalidRequest("a sequence has more query tokens (query_start_loc) than seq_lens")
    n_used = (seq_lens.to(torch.int64) + block_size - 1) // block_size  # [n_seqs]
    used = torch.arange(max_blocks, device=block_tables.device)[None, :] < n_used[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise InvalidRequest(f"block_tables holds block ids outside [0, {num_blocks}) in a sequence's used blocks")
