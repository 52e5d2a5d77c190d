"""Model loading: config, weights, tokenizer and chat template from an HF folder or a GGUF file.

    model = kog.loader.load_model()            # the default SmolLM2-135M-Instruct
    model.config, model.weights                # ModelConfig, {HF name: tensor}
    model.tokenizer.encode(model.chat_template.render(messages, add_generation_prompt=True),
                           add_special_tokens=False)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

import torch

from kog.config import ModelConfig
from kog.errors import ModelLoadError
from kog.loader.chat_template import CHATML_MARKERS, ChatTemplate, TemplateError, hermes_tool_template
from kog.loader.fp8_checkpoint import quantize_linears, read_fp8_checkpoint
from kog.loader.int4_checkpoint import read_int4_checkpoint
from kog.loader.gguf import GGUFCheckpoint
from kog.loader.hub import DEFAULT_MODEL, cache_dir, resolve_model
from kog.loader.safetensors import load_safetensors
from kog.loader.tokenizer import IncrementalDetokenizer, Tokenizer, read_tokenizer_config, tokenizer_from_gguf
from kog.loader.weights import Weights, expected_shapes, run_dtype


@dataclasses.dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint."""

    path: Path  # the .gguf file or the HF folder
    config: ModelConfig
    weights: Weights  # HF names -> tensors in `dtype` (or QuantizedWeight: a GGUF's blocks kept); no lm_head.weight when tied
    dtype: torch.dtype  # run dtype of activations, KV cache and float weights
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    stop_token_ids: tuple[int, ...]  # end of turn: config eos ids, generation_config eos ids, tokenizer eos
    file_weight_bytes: int | None = None  # bytes of the checkpoint's tensors as stored (GGUF data, safetensors files)

    @property
    def lm_head(self) -> torch.Tensor:
        """[vocab, hidden] output projection: the embedding itself when the two are tied."""
        return self.weights["model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"]


def load_model(name_or_path: str | os.PathLike[str] | None = None, dtype: torch.dtype | str | None = None,
               progress: bool | None = None, chat_template: str | None = None, quantization: str | None = None,
               fp8_format: str | None = None, shard: Callable[[ModelConfig], ModelConfig] | None = None,
               device: str = "cpu") -> LoadedModel:
    """Loads a model.

    Args:
        name_or_path: see `resolve_model` (None: the default SmolLM2-135M-Instruct).
        dtype: run dtype (float32, bfloat16, float16; None or "auto": a quantized GGUF or GPTQ /
            AWQ folder keeps its blocks (QuantizedWeight) with f32 activations on the CPU, bf16 on
            a GPU (the decode kernel's quantized GEMVs run bf16); bf16 for bf16 checkpoints, else f32).
        progress: progress bar while loading weights (None: only when stderr is a TTY).
        chat_template: Jinja text that replaces the model's own chat template.
        quantization: "fp8" quantizes each layer's linear matrices to FP8 e4m3 with per-output-
            channel scales at load (kog.loader.fp8_checkpoint.quantize_linears); None: as stored.
            An FP8 checkpoint (quantization_config) is FP8 either way.
        fp8_format: keep FP8 matrices as kog.fp8.Fp8Weight in this encoding (the GPU kernel's,
            kog.fp8.gpu_format()); None: their values in the run dtype (what the CPU runs).
        shard: full config -> a tensor-parallel rank's view (kog.parallel); the model is then
            that rank's: its config, and only its part of each tensor (only those bytes are
            read, from safetensors and GGUF alike).
        device: where the model will run ("cpu", "cuda", "cuda:N"); only picks the defaults above
            (nothing is moved here).
    Raises:
        ModelLoadError: anything wrong with the checkpoint, naming the file and tensor.
    """
    if quantization not in (None, "fp8"):
        raise ModelLoadError(f"quantization {quantization!r} is not supported (supported: fp8)")
    path = resolve_model(name_or_path)
    fp8_checkpoint = False
    on_gpu = str(device) != "cpu"
    # activations of a model that keeps its quantized blocks: f32 on the CPU, bf16 on a GPU
    kept_dtype = torch.bfloat16 if on_gpu else torch.float32
    if path.suffix == ".gguf":
        ckpt = GGUFCheckpoint(path)
        config = ckpt.config
        # dtype None/"auto" keeps a quantized file's matrices as stored.
        keep = dtype in (None, "auto") and ckpt.is_quantized
        dt = kept_dtype if keep else run_dtype(dtype, config)
        if shard is None:
            weights = ckpt.load_weights(config, dt, progress, keep_quantized=keep)
        else:
            from kog.parallel.shard import replicate_kv_heads, shard_index

            local = shard(config)
            weights = replicate_kv_heads(local, ckpt.load_weights(config, dt, progress, keep_quantized=keep,
                                                                  part=lambda n, ndim: shard_index(local, n, ndim)))
            config = local
        tokenizer = tokenizer_from_gguf(ckpt.metadata, source=str(path))
        source = ckpt.get("tokenizer.chat_template")
        extra_stops: list[int] = []
        file_bytes = sum(t.nbytes for t in ckpt.tensors.values())
    else:
        config = ModelConfig.from_hf_file(path)
        # A GPTQ / AWQ folder with dtype None/"auto" keeps its 4-bit linears as GGUF blocks.
        keep_int4 = dtype in (None, "auto") and read_int4_checkpoint(path) is not None
        fp8_checkpoint = read_fp8_checkpoint(path) is not None
        # FP8 kept as FP8 (fp8_format) runs with the kept dtype too: the kernel's FP8 GEMV is bf16
        keep_fp8 = dtype in (None, "auto") and on_gpu and fp8_format is not None and (fp8_checkpoint or quantization == "fp8")
        dt = kept_dtype if keep_int4 or keep_fp8 else run_dtype(dtype, config)
        if shard is None:
            weights = load_safetensors(path, config, dt, progress, fp8_format, keep_int4=keep_int4)
        else:
            from kog.parallel.shard import replicate_kv_heads, shard_index

            local = shard(config)
            weights = replicate_kv_heads(local, load_safetensors(path, config, dt, progress, fp8_format,
                                                                 part=lambda n, ndim: shard_index(local, n, ndim)))
            config = local
        tokenizer = Tokenizer.from_folder(path)
        source = read_tokenizer_config(path).get("chat_template")
        extra_stops = _generation_config_eos(path)
        file_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if quantization == "fp8" and not fp8_checkpoint:
        weights = quantize_linears(weights, dt, fp8_format)
    template = _chat_template(source if chat_template is None else chat_template, tokenizer,
                              user_given=chat_template is not None)
    stops = [*config.eos_token_ids, *extra_stops, tokenizer.eos_token_id]
    return LoadedModel(path, config, weights, dt, tokenizer, template,
                       tuple(dict.fromkeys(i for i in stops if i is not None)), file_bytes)


def load_config(name_or_path: str | os.PathLike[str] | None = None) -> ModelConfig:
    """Only the config of a model (cheap: no tensor is read)."""
    path = resolve_model(name_or_path)
    return GGUFCheckpoint(path).config if path.suffix == ".gguf" else ModelConfig.from_hf_file(path)


def _chat_template(source: str | list | None, tokenizer: Tokenizer, user_given: bool) -> ChatTemplate | None:
    """The model's template (or the user's); a model's own template that ignores tools gets Kog's
    Hermes tool template as its tool_template when the vocabulary is ChatML's."""
    if isinstance(source, list):  # several named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source}
        source = named.get("default") or next(iter(named.values()), None)
    if not source:
        return None
    chatml = all(tokenizer.token_to_id(m) is not None for m in CHATML_MARKERS)
    tool_template = hermes_tool_template(tokenizer.bos_token, tokenizer.eos_token) if chatml and not user_given else None
    return ChatTemplate(source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                        special_tokens={"pad_token": tokenizer.pad_token or "", "unk_token": tokenizer.unk_token or ""},
                        tool_template=tool_template)


def _generation_config_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.exists():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from None
    return [eos] if isinstance(eos, int) else list(eos or [])


__all__ = [
    "DEFAULT_MODEL",
    "ChatTemplate",
    "GGUFCheckpoint",
    "IncrementalDetokenizer",
    "LoadedModel",
    "ModelConfig",
    "TemplateError",
    "Tokenizer",
    "Weights",
    "cache_dir",
    "expected_shapes",
    "load_config",
    "load_model",
    "load_safetensors",
    "resolve_model",
    "run_dtype",
    "tokenizer_from_gguf",
]
