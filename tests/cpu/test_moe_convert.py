"""`kog convert` of mixtral and qwen2_moe folders to GGUF in llama.cpp's layout (arch `llama` with
expert tensors, `qwen2moe` with the shared-expert tensors), round-tripped through Kog's loader:
the F32 file gives the folder's logits (1e-5 x max|logit|), a Q8_0 file keeps its expert blocks
(the shared expert's too) and decodes like itself dequantized at load (1e-3 x max|logit|, measured
<= 2.5e-5: every LINEAR's two int8 x stages; 16 greedy tokens equal).
"""

import pytest
import torch

from kog.loader import load_model
from kog.loader.gguf import GGUFCheckpoint
from kog.loader.gguf_write import hf_to_gguf
from kog.quantized import QuantizedWeight
from test_moe import hf_moe, kog_greedy, prompts, runner_for

pytest.importorskip("transformers")

MODELS = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a shared expert 1.5 experts wide: down_shexp's 48-wide rows are not whole Q8_0 blocks (F16
    # in the file, the shared down slices float), gate/up_shexp are (kept as blocks, padded)
    "qwen2_moe": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False,
                                    shared_expert_intermediate_size=48)),
    # a shared expert of two whole slices, renormalized top-k (expert_weights_norm = true in the file)
    "qwen2_moe-64-norm": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[],
                                            norm_topk_prob=True, shared_expert_intermediate_size=64)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def folder(request, tmp_path_factory):
    family, overrides = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf_moe(path, family, **overrides)
    return request.param, path


def test_f32_file_has_llama_cpp_layout_and_the_folders_logits(folder, tmp_path):
    name, path = folder
    written = hf_to_gguf(path, tmp_path / "m.gguf", "f32")
    ck = GGUFCheckpoint(tmp_path / "m.gguf")
    want_folder = load_model(path, dtype=torch.float32)
    c = want_folder.config
    arch = "llama" if c.architecture == "mixtral" else "qwen2moe"
    layer = c.moe_layers[0]
    assert ck.get("general.architecture") == arch
    assert (ck.get(f"{arch}.expert_count"), ck.get(f"{arch}.expert_used_count")) == (c.num_experts,
                                                                                     c.num_experts_per_tok)
    assert ck.tensors[f"blk.{layer}.ffn_gate_exps.weight"].torch_shape == (c.num_experts, c.moe_intermediate_size, 64)
    assert ck.tensors[f"blk.{layer}.ffn_down_exps.weight"].torch_shape == (c.num_experts, 64, c.moe_intermediate_size)
    if arch == "qwen2moe":
        s = c.shared_expert_intermediate_size
        assert (ck.get("qwen2moe.expert_feed_forward_length"), ck.get("qwen2moe.expert_shared_feed_forward_length"),
                ck.get("qwen2moe.feed_forward_length")) == (32, s, 96)
        assert ck.get("qwen2moe.expert_weights_norm", False) == c.norm_topk_prob
        assert ck.tensors[f"blk.{layer}.ffn_gate_inp_shexp.weight"].torch_shape == (1, 64)
        assert ck.tensors[f"blk.{layer}.ffn_up_shexp.weight"].torch_shape == (s, 64)
        assert ck.tensors[f"blk.{layer}.ffn_down_shexp.weight"].torch_shape == (64, s)
        assert "blk.0.attn_q.bias" in ck.tensors
    else:
        assert ck.get("llama.feed_forward_length") == 32
    assert {t for n, t in written.items()} == {"F32"}
    got = load_model(tmp_path / "m.gguf", dtype="float32")
    assert got.config.moe_layers == c.moe_layers and got.config.norm_topk_prob == c.norm_topk_prob
    assert got.config.shared_expert_intermediate_size == c.shared_expert_intermediate_size
    for n, t in want_folder.weights.items():  # q/k rows permuted back for llama, names mapped back
        assert torch.equal(got.weights[n], t), n
    want = runner_for(path)
    from kog.testing.runner_seqs import RunnerSeqs

    p = prompts(40)[3][:40]
    ref = want.prefill([RunnerSeqs(want).chunk(0, p)])[0]
    _, logits = kog_greedy(got, p, 1)
    assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max(), name


def test_q8_0_file_keeps_expert_blocks_and_decodes_like_it_dequantized(folder, tmp_path):
    name, path = folder
    written = hf_to_gguf(path, tmp_path / "m.gguf", "q8_0")
    assert {t for n, t in written.items() if "_exps." in n} == {"Q8_0"}
    assert {t for n, t in written.items() if ".ffn_gate_inp" in n} == {"F32"}  # router, shared gate
    kept = load_model(tmp_path / "m.gguf")
    c = kept.config
    layer = c.moe_layers[0]
    for kind in ("gate_up_proj", "down_proj"):
        assert isinstance(kept.weights[f"model.layers.{layer}.mlp.experts.{kind}"], QuantizedWeight)
    dequantized = load_model(tmp_path / "m.gguf", dtype="float32")
    from kog.models import ModelRunner

    prepared = ModelRunner(kept, num_kv_blocks=4, block_size=16).weights
    stack = prepared[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    assert isinstance(stack, QuantizedWeight)  # shared slices in blocks after the routed experts
    assert stack.shape[0] == (c.num_experts + c.shared_expert_slots) * 2 * c.moe_intermediate_size
    p = prompts(40)[3][:40]
    got_ids, got = kog_greedy(kept, p, 16)
    want_ids, want = kog_greedy(dequantized, p, 16)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max(), name
    assert got_ids == want_ids, name
