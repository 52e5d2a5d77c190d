"""GGUF -> Hugging Face folder, so a GGUF model can be checked against (or used by) transformers."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from kog.loader.gguf import GGUFCheckpoint
from kog.loader.tokenizer import tokenizer_from_gguf
from kog.loader.weights import run_dtype

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 dtype: torch.dtype | str | None = None, progress: bool | None = None) -> Path:
    """Writes an HF-layout folder (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json with the chat template, generation_config.json) from a GGUF file.

    Args:
        gguf_path: the .gguf file.
        out_dir: the folder to write (created; existing files of the same names are replaced).
        dtype: dtype of the written weights; None keeps the file's own (F32/F16/BF16), and
            float32 for quantized files, which holds dequantized values exactly.
        progress: progress bar while dequantizing (None: only when stderr is a TTY).
    Returns:
        out_dir.
    Raises:
        ModelLoadError: the GGUF cannot be loaded (see GGUFCheckpoint).
    """
    ckpt = GGUFCheckpoint(gguf_path)
    config = ckpt.config
    dt = run_dtype(dtype, config) if dtype is not None else config.dtype
    config = dataclasses.replace(config, torch_dtype=_DTYPE_NAMES[dt])
    weights = ckpt.load_weights(config, dt, progress)
    tokenizer = tokenizer_from_gguf(ckpt.metadata, source=str(ckpt.path))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config.to_hf_dict())
    _write_json(out / "generation_config.json", {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else config.eos_token_ids[0],
    } if config.eos_token_ids else {"bos_token_id": config.bos_token_id})
    tokenizer.save(out, chat_template=ckpt.get("tokenizer.chat_template"),
                   model_max_length=config.max_position_embeddings)
    return out


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
