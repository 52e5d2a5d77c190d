"""A tensor-parallel rank reads only its share of a GGUF file: load_model(..., shard=view) gives
the tensors shard_weights cuts from the whole model, bit for bit, while the bytes it takes from
the file are the replicated tensors plus 1/N of the split ones (kog.loader.gguf's `_read`)."""

import pytest
import torch

import kog
from kog.errors import InvalidRequest
from kog.loader import load_model
from kog.loader.gguf import GGUFCheckpoint
from kog.parallel.ranks import rank_view
from kog.parallel.shard import shard_index, shard_weights
from kog.quantized import QuantizedWeight
from kog.testing.tiny_models import random_weights, tiny_config, write_gguf_model, write_hf_model


def gguf_model(tmp_path, arch, qtype, **overrides):
    config = tiny_config(arch, **overrides)
    weights = random_weights(config, seed=11)
    path = tmp_path / f"{arch}-{qtype}.gguf"
    if arch == "qwen2_moe":  # its shared expert's names: kog convert's writer (llama.cpp's layout)
        from kog.loader.gguf_write import hf_to_gguf

        hf_to_gguf(write_hf_model(tmp_path / arch, config, weights), path, qtype.lower())
        return path
    return write_gguf_model(path, config, weights, qtype)


def assert_same_weights(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        if isinstance(w, QuantizedWeight):
            assert isinstance(g, QuantizedWeight), name
            assert (g.qtype, g.cols) == (w.qtype, w.cols), name
            assert torch.equal(g.data, w.data), name
        else:
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(g, w), name


class ReadCounter:
    """Counts the file bytes GGUFCheckpoint._read hands out, per GGUF tensor."""

    def __init__(self, monkeypatch):
        self.bytes: dict[str, int] = {}
        real = GGUFCheckpoint._read

        def counting(ckpt, info, index):
            raw, shape, cut = real(ckpt, info, index)
            self.bytes[info.name] = self.bytes.get(info.name, 0) + raw.nbytes
            return raw, shape, cut

        monkeypatch.setattr(GGUFCheckpoint, "_read", counting)


@pytest.mark.parametrize("arch,qtype,dtype,size", [
    ("llama", "F32", None, 2),         # q/k rows un-permuted per head after the cut
    ("llama", "Q8_0", None, 2),        # blocks kept: byte rows, whole blocks of columns
    ("llama", "Q4_1", "float32", 2),   # dequantized from the rank's bytes only
    ("llama", "F32", None, 4),         # 2 KV heads over 4 ranks: a rank's stored head, replicated
    ("llama", "Q8_0", "float32", 4),   # 16 columns of o_proj: inside a Q8_0 block, decoded whole rows then cut
    ("qwen2", "Q8_0", None, 2),        # biases
    ("qwen3_moe", "Q8_0", None, 2),    # stacked experts: the rank's experts' byte rows
    ("mixtral", "Q4_1", "float32", 2),
    ("qwen2_moe", "Q8_0", None, 2),    # the shared expert whole
])
def test_a_rank_reads_only_its_share_and_gets_what_the_whole_model_cut_gives(tmp_path, monkeypatch, arch, qtype,
                                                                          dtype, size):
    path = gguf_model(tmp_path, arch, qtype, **({"shared_expert_intermediate_size": 64} if arch == "qwen2_moe" else {}))
    full = load_model(path, dtype)
    counter = ReadCounter(monkeypatch)
    whole_bytes = {name: info.nbytes for name, info in GGUFCheckpoint(path).tensors.items()}
    for rank in range(size):
        view = rank_view(rank, size)
        counter.bytes.clear()
        part = load_model(path, dtype, shard=view)
        local = view(full.config)
        assert part.config == local
        assert_same_weights(part.weights, shard_weights(local, full.weights))
        # Bytes read: whole for the replicated tensors, 1/size for the split ones -- except
        # columns that cut a block, read as whole rows.
        ckpt = GGUFCheckpoint(path)
        names = _hf_names(ckpt)
        assert sorted(counter.bytes) == sorted(g for gs in names.values() for g in gs)  # each read once
        for hf, gnames in names.items():
            for gname in gnames:
                shape = ckpt.tensors[gname].torch_shape
                index = shard_index(local, hf, len(shape)) or ()
                share = 1.0
                for dim, s in zip((0, len(shape) - 1), index):  # the first dim's slice, the columns'
                    cut_block = dim == len(shape) - 1 and size == 4 and qtype != "F32" and "o_proj" in hf
                    if not cut_block:
                        a, b, _ = s.indices(shape[dim])
                        share *= (b - a) / shape[dim]
                assert counter.bytes[gname] == whole_bytes[gname] * share, (gname, counter.bytes[gname])


def _hf_names(ckpt: GGUFCheckpoint) -> dict[str, list[str]]:
    """HF name -> its GGUF tensors, as load_weights groups them."""
    from kog.loader.gguf import _BLOCK_RE, _EXPERT_NAMES, hf_name

    out: dict[str, list[str]] = {}
    for g in ckpt.tensors:
        m = _BLOCK_RE.fullmatch(g)
        if m and m.group(2) in _EXPERT_NAMES:
            out.setdefault(f"model.layers.{m.group(1)}.{_EXPERT_NAMES[m.group(2)][0]}", []).append(g)
        elif (h := hf_name(g)) is not None:
            out[h] = [g]
    return out


def test_a_share_whose_columns_cut_a_kept_block_is_refused_naming_the_tensor(tmp_path):
    path = gguf_model(tmp_path, "llama", "Q8_0")  # o_proj over 4 ranks: 16 columns of 32-wide blocks
    with pytest.raises(InvalidRequest, match=r"o_proj.weight: its part \[0:, 0:16\]: 16 columns do not fill Q8_0"):
        load_model(path, shard=rank_view(0, 4))


def test_llm_rank_0_reads_only_its_share_of_a_gguf(tmp_path, monkeypatch):
    path = gguf_model(tmp_path, "llama", "Q8_0", num_hidden_layers=2)
    counter = ReadCounter(monkeypatch)
    greedy = kog.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 17, 99, 3, 250, 8]}]
    whole = kog.LLM(str(path))
    want = whole.generate(prompt, greedy)[0].outputs[0].token_ids
    read_whole = sum(counter.bytes.values())
    counter.bytes.clear()
    llm = kog.LLM(str(path), tensor_parallel_size=2)
    try:
        assert llm.generate(prompt, greedy)[0].outputs[0].token_ids == want
        assert llm.model.config == whole.model.config  # the model's own config, not rank 0's view
        read_rank0 = sum(counter.bytes.values())
        embed_and_norms = sum(n for g, n in counter.bytes.items() if "norm" in g or g == "token_embd.weight")
        # everything but the replicated tensors (embedding, norms) is read by halves
        assert read_rank0 - embed_and_norms == (read_whole - embed_and_norms) // 2
    finally:
        llm.engine.runner.close()


def test_quantize_at_load_under_tensor_parallelism_is_refused(tmp_path):
    path = gguf_model(tmp_path, "llama", "F32")
    with pytest.raises(InvalidRequest, match="quantization='fp8' with tensor_parallel_size > 1"):
        kog.LLM(str(path), quantization="fp8", tensor_parallel_size=2)
