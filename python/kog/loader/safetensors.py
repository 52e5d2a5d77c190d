"""Weights from a Hugging Face folder: `model.safetensors`, or shards listed in
`model.safetensors.index.json`.

`safe_open` memory-maps each file; shapes are checked from the header before any tensor is
read, and each tensor is materialized once (plus one cast when the run dtype differs).
"""

from __future__ import annotations

import json
import struct
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from kog.config import ModelConfig
from kog.errors import ModelLoadError
from kog.loader.fp8_checkpoint import fp8_matrix, read_fp8_checkpoint
from kog.loader.int4_checkpoint import SUFFIXES as INT4_SUFFIXES
from kog.loader.int4_checkpoint import int4_matrix, read_int4_checkpoint
from kog.loader.moe import combine, is_expert_stack, source_shape
from kog.loader.weights import Weights, check_shape, expected_shapes, progress_bar, select_names, stored_sources

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Maps each tensor name of an HF folder to the safetensors file that holds it.

    Raises:
        ModelLoadError: no safetensors file, an unreadable index, or a shard the index names is absent.
    """
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable shard index: {e!r}") from None
        files = {name: folder / shard for name, shard in weight_map.items()}
        for name, path in files.items():
            if not path.exists():
                raise ModelLoadError(f"{index}: shard {path.name} (holding tensor {name!r}) is missing")
        return files
    single = folder / SINGLE_FILE
    if not single.exists():
        raise ModelLoadError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def load_safetensors(
    folder: str | Path, config: ModelConfig, dtype: torch.dtype, progress: bool | None = None,
    fp8_format: str | None = None,
    part: Callable[[str, int], tuple | None] | None = None,
    keep_int4: bool = False,
) -> Weights:
    """Loads and validates every weight of an HF folder.

    Args:
        folder: the model folder.
        config: the model's config; tensor names and shapes are checked against it.
        dtype: run dtype, every tensor is cast to it.
        progress: show a progress bar (None: only when stderr is a TTY).
        fp8_format: for an FP8 checkpoint (kog.loader.fp8_checkpoint), keep its FP8 matrices as
            kog.fp8.Fp8Weight in this encoding; None: dequantize them to `dtype`.
        part: (name, ndim) -> the index of the part of a tensor to keep, or None for all of it
            (a tensor-parallel rank's share: kog.parallel.shard.shard_index); a tensor stored as
            itself is read only in that part, one stacked from parts (experts) whole first.
        keep_int4: for a GPTQ / AWQ checkpoint (kog.loader.int4_checkpoint), keep its 4-bit
            linears as GGUF blocks (QuantizedWeight, `dtype` must be float32); False: dequantize
            them to `dtype`.
    Returns:
        {HF tensor name: tensor or Fp8Weight}, without `lm_head.weight` when embeddings are tied.
    Raises:
        ModelLoadError: naming the file and tensor that is missing, misshapen or unreadable.
    """
    files = weight_files(folder)
    fp8 = read_fp8_checkpoint(folder)
    scales = {n: p for n, p in files.items() if fp8 is not None and fp8.is_scale(n)}
    files = {n: p for n, p in files.items() if n not in scales}
    int4 = read_int4_checkpoint(folder)
    int4_parts = {n: p for n, p in files.items() if int4 is not None and n.endswith(INT4_SUFFIXES)}
    files = {n: p for n, p in files.items() if n not in int4_parts}
    int4_names = {n[: -len(".qweight")] + ".weight" for n in int4_parts if n.endswith(".qweight")}
    files |= {n: int4_parts[n[: -len(".weight")] + ".qweight"] for n in int4_names}  # stand-ins for the checks
    sources = stored_sources(files, config)
    names = select_names(files, config, source=str(folder), sources=sources)
    expected = expected_shapes(config)
    weights: Weights = {}
    with progress_bar(len(names), f"loading {Path(folder).name}", progress) as bar, ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def handle(path: Path):  # each file opened once for the whole load
            if path not in opened:
                opened[path] = stack.enter_context(_open(path))
            return opened[path]

        def read(canonical: str, name: str, index: tuple | None = None) -> torch.Tensor:
            path = files[name]
            f = handle(path)
            want = {name: source_shape(canonical, name, config, expected)}
            check_shape(name, f.get_slice(name).get_shape(), want, str(path))
            try:
                return f.get_tensor(name) if index is None else f.get_slice(name)[index]
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"{path}: cannot read tensor {name!r}: {e}") from None

        # NOTE: MoE layers stored one tensor per expert are stacked here, once (kog.loader.moe).
        def scale_of(name: str) -> torch.Tensor | None:
            scale = name[: -len(".weight")] + fp8.scale_suffix
            if scale not in scales:
                return None
            with _open(scales[scale]) as f:
                return f.get_tensor(scale)

        for name in names:
            index = part(name, len(expected[name])) if part is not None else None
            if name in int4_names:
                if index is not None or sources[name] != [name]:
                    raise ModelLoadError(f"{folder}: tensor {name!r}: 4-bit {int4.method.upper()} linears are "
                                         "not supported with tensor parallelism or as MoE experts")
                base = name[: -len(".weight")]
                stored = {base + suffix: handle(int4_parts[base + suffix]).get_tensor(base + suffix)
                          for suffix in INT4_SUFFIXES if base + suffix in int4_parts}
                n, k = expected[name]
                weights[name] = int4_matrix(name, stored, int4, n, k, dtype, keep_int4)
                bar.update()
                continue
            stored_whole = sources[name] == [name]
            parts = sources[name]
            if not stored_whole and index is not None and is_expert_stack(name):
                # one tensor per expert (kog.loader.moe): read only the experts index keeps
                per = len(parts) // config.num_experts  # gate_up: gate and up; down: one
                experts = index[0]
                parts, index = parts[experts.start * per:experts.stop * per], index[1:] or None
            w = read(name, name, index) if stored_whole else combine(name, parts, [read(name, n) for n in parts])
            if not stored_whole and index is not None:
                w = w[index]
            if w.dtype == torch.float8_e4m3fn or (fp8 is not None and scale_of(name) is not None):
                if fp8 is None or len(sources[name]) != 1 or not name.endswith(".weight"):
                    raise ModelLoadError(f"{folder}: tensor {name!r} is {w.dtype} but config.json has no FP8 "
                                         "quantization_config for it (FP8 MoE experts are not supported)")
                if index is not None:
                    raise ModelLoadError(f"{folder}: tensor {name!r}: tensor parallelism over FP8 checkpoints "
                                         "is not supported")
                weights[name] = fp8_matrix(name, w, scale_of(name), fp8, dtype, fp8_format)
            else:
                weights[name] = w.to(dtype)
            bar.update()
    return weights


class _open:
    """safe_open with errors turned into ModelLoadError naming the file."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            self.f = safe_open(str(self.path), framework="pt")
        except Exception as e:
            raise ModelLoadError(f"{self.path}: not a readable safetensors file{_beyond_end(self.path)}: {e}") from None
        return self.f.__enter__()

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


def _beyond_end(path: Path) -> str:
    """For a truncated file, names the first tensor whose bytes lie past the end ("" otherwise)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        size = path.stat().st_size - 8 - n
    except (OSError, ValueError, struct.error):
        return ""
    tensors = [(v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__"]
    past = sorted((end, name) for end, name in tensors if end > size)
    return f" (truncated: tensor {past[0][1]!r} ends at data byte {past[0][0]}, the data has {size})" if past else ""

