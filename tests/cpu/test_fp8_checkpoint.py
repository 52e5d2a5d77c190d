"""FP8 checkpoints in the HF layout (kog.loader.fp8_checkpoint) and `quantization="fp8"` at load:
tiny models written here with safetensors, loaded on the CPU (dequantized to the run dtype) and
as Fp8Weight (the GPU kernel's form), compared with the float model; bad inputs name the tensor."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import kog
from kog.fp8 import Fp8Weight, decode
from kog.loader import load_model
from kog.loader.fp8_checkpoint import LINEAR_SUFFIXES
from kog.models import ModelRunner
from kog.models.runner import PrefillChunk
from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

CONFIG = tiny_config("llama", intermediate_size=256)  # k = 256 on down_proj: two 128-blocks


def fp8_checkpoint(folder, form: str, weights=None):
    """An HF folder whose linear matrices are float8_e4m3fn with scales as `form` writes them:
    "channel" (quant_method fp8, weight_scale_inv [n, 1]), "tensor" (compressed-tensors,
    weight_scale [1], with an input_scale), "block" (fp8, [128, 128] blocks). Returns (folder,
    the f32 weights the checkpoint stands for)."""
    weights = dict(random_weights(CONFIG, seed=3) if weights is None else weights)
    stored, exact = {}, {}
    for name, w in weights.items():
        if not name.endswith(LINEAR_SUFFIXES):
            stored[name] = exact[name] = w
            continue
        base = name[: -len(".weight")]
        if form == "block":
            n, k = w.shape
            nb, kb = -(-n // 128), -(-k // 128)
            padded = torch.zeros(nb * 128, kb * 128)
            padded[:n, :k] = w
            scale = padded.reshape(nb, 128, kb, 128).abs().amax(dim=(1, 3)) / 448  # [nb, kb]
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
            q = (w / full).to(torch.float8_e4m3fn)
            stored[base + ".weight_scale_inv"], exact[name] = scale, q.float() * full
        else:
            scale = w.abs().amax(dim=1, keepdim=True) / 448 if form == "channel" else w.abs().max().reshape(1) / 448
            q = (w / scale).to(torch.float8_e4m3fn)
            stored[base + (".weight_scale_inv" if form == "channel" else ".weight_scale")] = scale
            if form == "tensor":
                stored[base + ".input_scale"] = torch.ones(1)
            exact[name] = q.float() * scale
        stored[name] = q
    folder = write_hf_model(folder, CONFIG, {n: w for n, w in weights.items()})
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                                       "targets": ["Linear"]}}, "ignore": ["lm_head"]}
        if form == "tensor" else
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128] if form == "block" else None})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, exact


def logits(model) -> torch.Tensor:
    runner = ModelRunner(model, num_kv_blocks=16, block_size=4)
    ids = [3 + i % 40 for i in range(11)]
    ch = PrefillChunk(ids, 0, np.arange(4, dtype=np.int32), np.arange(len(ids), dtype=np.int64))
    return runner.prefill([ch], all_logits=True)[0]


@pytest.mark.parametrize("form", ["channel", "tensor", "block"])
def test_fp8_checkpoint_loads_dequantized_on_the_cpu(tmp_path, form):
    folder, exact = fp8_checkpoint(tmp_path / form, form)
    m = load_model(folder, dtype="float32", progress=False)
    for name in exact:  # the checkpoint's values, exactly (f32 products of e4m3 and f32 scales)
        if name.endswith(LINEAR_SUFFIXES):
            assert torch.equal(m.weights[name], exact[name]), name
    want = load_model(write_hf_model(tmp_path / "f32", CONFIG, exact), dtype="float32", progress=False)
    torch.testing.assert_close(logits(m), logits(want), rtol=0, atol=0)
    orig = load_model(write_hf_model(tmp_path / "orig", CONFIG, random_weights(CONFIG, seed=3)), dtype="float32",
                      progress=False)
    lo, lf = logits(m), logits(orig)
    assert (lo - lf).abs().max() <= 0.05 * lf.abs().max()  # FP8's rounding, not a wrong model


@pytest.mark.parametrize("form,fmt", [("channel", "e4m3fn"), ("channel", "e4m3fnuz"), ("tensor", "e4m3fnuz"),
                                      ("block", "e4m3fn")])
def test_fp8_checkpoint_kept_as_per_channel_fp8(tmp_path, form, fmt):
    folder, exact = fp8_checkpoint(tmp_path / form, form)
    m = load_model(folder, dtype="bfloat16", progress=False, fp8_format=fmt)
    for name, w in m.weights.items():
        if not name.endswith(LINEAR_SUFFIXES):
            assert isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16
            continue
        assert isinstance(w, Fp8Weight) and w.fmt == fmt and w.shape == tuple(exact[name].shape)
        if form == "block":  # re-quantized per channel: one more e4m3 rounding
            torch.testing.assert_close(w.dequantize(), exact[name], rtol=2 ** -3, atol=1e-6)
        else:
            assert torch.equal(w.dequantize(), exact[name]), name


def test_quantization_fp8_at_load(tmp_path):
    weights = random_weights(CONFIG, seed=4)
    folder = write_hf_model(tmp_path, CONFIG, weights)
    cpu = load_model(folder, dtype="float32", progress=False, quantization="fp8")
    kept = {fmt: load_model(folder, dtype="float32", progress=False, quantization="fp8", fp8_format=fmt)
            for fmt in ("e4m3fn", "e4m3fnuz")}
    plain = load_model(folder, dtype="float32", progress=False)
    for name, w in weights.items():
        if name.endswith(LINEAR_SUFFIXES):
            for fmt, fmax in (("e4m3fn", 448), ("e4m3fnuz", 240)):
                k = kept[fmt].weights[name]
                assert isinstance(k, Fp8Weight) and k.fmt == fmt
                assert torch.allclose(k.scale, w.abs().amax(dim=1) / fmax)  # per-channel absmax / the format's max
            k = kept["e4m3fn"].weights[name]  # the CPU runs the OCP encoding's values
            assert torch.equal(cpu.weights[name], decode(k.data, "e4m3fn") * k.scale[:, None])
            assert not torch.equal(cpu.weights[name], w)
        else:
            assert torch.equal(cpu.weights[name], w) and torch.equal(kept["e4m3fnuz"].weights[name], w)
    lq, lf = logits(cpu), logits(plain)
    assert (lq - lf).abs().max() <= 0.05 * lf.abs().max()
    with pytest.raises(kog.ModelLoadError, match="quantization 'int3' is not supported"):
        load_model(folder, progress=False, quantization="int3")


def test_llm_and_cli_take_quantization(tmp_path):
    from kog.generate_cli import add_arguments

    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["m", "hi", "--quantization", "fp8"]).quantization == "fp8"
    folder = write_hf_model(tmp_path, CONFIG, random_weights(CONFIG, seed=4))
    llm = kog.LLM(str(folder), "float32", quantization="fp8", kv_cache_gib=0.01, progress=False)
    out = llm.generate("hello", kog.SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3


def bad(tmp_path, mutate, config_patch=None):
    folder, _ = fp8_checkpoint(tmp_path, "channel")
    from safetensors.torch import load_file

    t = load_file(str(folder / "model.safetensors"))
    mutate(t)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if config_patch:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] |= config_patch
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


Q = "model.layers.1.self_attn.q_proj"


def test_bad_fp8_checkpoints_name_the_tensor(tmp_path):
    with pytest.raises(kog.ModelLoadError, match="quant_method 'bitsandbytes' is not supported"):
        load_model(bad(tmp_path / "a", lambda t: None, {"quant_method": "bitsandbytes"}), progress=False)
    with pytest.raises(kog.ModelLoadError, match=f"FP8 weight '{Q}.weight' has no scale tensor '{Q}.weight_scale_inv'"):
        load_model(bad(tmp_path / "b", lambda t: t.pop(Q + ".weight_scale_inv")), progress=False)
    with pytest.raises(kog.ModelLoadError, match=f"tensor '{Q}.weight_scale_inv' has shape \\[3, 2\\]"):
        load_model(bad(tmp_path / "c", lambda t: t.__setitem__(Q + ".weight_scale_inv", torch.ones(3, 2))),
                   progress=False)
    with pytest.raises(kog.ModelLoadError, match=f"'{Q}.weight_scale_inv' has non-finite scales"):
        load_model(bad(tmp_path / "d", lambda t: t[Q + ".weight_scale_inv"].__setitem__(0, float("nan"))),
                   progress=False)
    with pytest.raises(kog.ModelLoadError, match="FP8 format 'e5m2' is not supported"):
        load_model(bad(tmp_path / "e", lambda t: None, {"fmt": "e5m2"}), progress=False)
