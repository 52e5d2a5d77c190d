"""The native decode executor against a Python interpreter of the same schedule with kog.ops."""

import numpy as np
import pytest
import torch

import kog
from kog import ops
from kog.loader import LoadedModel
from kog.models import ModelRunner, PrefillChunk
from kog.models.decode import schedule_for
from kog.program import Buffer, Opcode
from kog.testing.tiny_models import random_weights, tiny_config

BS = 4  # small blocks: sequences cross block boundaries


def tiny_runner(arch: str, dtype=torch.float32, num_blocks: int = 64, **overrides) -> ModelRunner:
    config = tiny_config(arch, **overrides)
    weights = {k: v.to(dtype) for k, v in random_weights(config, seed=3).items()}
    model = LoadedModel(path=None, config=config, weights=weights, dtype=dtype, tokenizer=None,
                        chat_template=None, stop_token_ids=())
    return ModelRunner(model, num_kv_blocks=num_blocks, block_size=BS)


def run_schedule_in_python(r: ModelRunner, tokens, positions, tables, seq_lens, slots) -> torch.Tensor:
    """Each instruction of the schedule, in order, with the typed kog.ops wrappers."""
    c, w = r.config, r.weights
    B, hd = len(tokens), c.head_dim
    q_w, kv_w = c.num_attention_heads * hd, c.num_key_value_heads * hd
    bufs: dict[Buffer, torch.Tensor] = {}
    pos_t, slots_t = torch.tensor(positions), torch.tensor(slots)
    tables_t, lens_t = torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    for ins in schedule_for(c):
        op, wt = ins.opcode, [w[n] for n in ins.weights]
        if op == Opcode.EMBED:
            bufs[Buffer.RESIDUAL] = wt[0][torch.tensor(tokens)].clone()
        elif op == Opcode.RMS_NORM:
            res = bufs[ins.reads[1]] if len(ins.reads) == 2 else None
            bufs[Buffer.NORMED] = ops.rmsnorm(bufs[ins.reads[0]], wt[0], c.rms_norm_eps, residual=res)
        elif op == Opcode.LINEAR:
            bufs[ins.writes[0]] = ops.linear(bufs[ins.reads[0]], wt[0], wt[1] if len(wt) > 1 else None)
        elif op == Opcode.QK_NORM:
            qkv = bufs[Buffer.QKV]
            for lo, hi, nw in ((0, q_w, wt[0]), (q_w, q_w + kv_w, wt[1])):
                qkv[:, lo:hi] = ops.rmsnorm(qkv[:, lo:hi].reshape(-1, hd), nw, c.rms_norm_eps).view(B, -1)
        elif op == Opcode.ROPE:
            qkv = bufs[Buffer.QKV]
            ops.rope(qkv[:, :q_w].view(B, -1, hd), qkv[:, q_w:q_w + kv_w].view(B, -1, hd), pos_t, r.inv_freq)
        elif op == Opcode.KV_APPEND:
            qkv = bufs[Buffer.QKV]
            ops.kv_append(qkv[:, q_w:q_w + kv_w].view(B, -1, hd), qkv[:, q_w + kv_w:].view(B, -1, hd),
                          r.kv.kv[ins.layer], slots_t)
        elif op == Opcode.ATTN_DECODE:
            q = bufs[Buffer.QKV][:, :q_w].view(B, -1, hd)
            bufs[Buffer.ATTN] = ops.paged_attention_decode(q, r.kv.kv[ins.layer], tables_t, lens_t).view(B, q_w)
        elif op == Opcode.SILU_MUL:
            bufs[Buffer.ACT] = ops.silu_and_mul(bufs[Buffer.GATE_UP])
    return bufs[Buffer.LOGITS].float()


def fill(r: ModelRunner, prompts, blocks_per_seq: int = 16):
    """Prefills prompts into disjoint block ranges; returns the decode inputs of the next step."""
    tables = np.zeros((len(prompts), blocks_per_seq), dtype=np.int32)
    for i, p in enumerate(prompts):
        tables[i] = np.arange(blocks_per_seq * i, blocks_per_seq * (i + 1))
    slots = lambda i, s, e: tables[i][np.arange(s, e) // BS] * BS + np.arange(s, e) % BS  # noqa: E731
    r.prefill([PrefillChunk(p, 0, tables[i], slots(i, 0, len(p))) for i, p in enumerate(prompts)])
    pos = np.array([len(p) for p in prompts])
    return dict(tokens=np.array([p[-1] for p in prompts]) + 7, positions=pos, block_tables=tables,
                seq_lens=(pos + 1).astype(np.int32), slots=np.array([slots(i, n, n + 1)[0] for i, n in enumerate(pos)]))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_executor_equals_the_python_schedule(arch, dtype):
    r = tiny_runner(arch, dtype)
    step = fill(r, [[5, 9, 13], list(range(20, 31)), [40]])  # mixed lengths, crossing blocks
    kv_before = r.kv.kv.clone()
    want = run_schedule_in_python(r, step["tokens"], step["positions"], step["block_tables"],
                                  step["seq_lens"], step["slots"])
    kv_python = r.kv.kv.clone()
    r.kv.kv.copy_(kv_before)
    sampled = np.zeros(3, dtype=np.int64)
    got = r.decode(**step, sampled=sampled)
    # Same kernels in the same order: identical up to float reassociation inside threads.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(r.kv.kv, kv_python, rtol=0, atol=0)
    assert sampled.tolist() == got.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_executor_with_attention_outside_the_region_equals_the_python_schedule(dtype):
    # batch x longest context x query heads x head_dim = 3 x 600 x 8 x 64, well above the
    # 2^18 multiply-adds from which the step runs attention on all threads, outside its region
    # (DecodeExecutor::runs_alone); 600 tokens also span two context partitions.
    r = tiny_runner("llama", dtype, num_blocks=3 * 160, hidden_size=256, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (599, 300, 17)]
    step = fill(r, prompts, blocks_per_seq=160)
    kv_before = r.kv.kv.clone()
    want = run_schedule_in_python(r, step["tokens"], step["positions"], step["block_tables"],
                                  step["seq_lens"], step["slots"])
    r.kv.kv.copy_(kv_before)
    got = r.decode(**step)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_executor_equals_one_token_prefill():
    r = tiny_runner("qwen3")
    step = fill(r, [[5, 9, 13], list(range(20, 31))])
    got = r.decode(**step)
    chunks = [PrefillChunk([int(t)], int(p), step["block_tables"][i], np.array([s]))
              for i, (t, p, s) in enumerate(zip(step["tokens"], step["positions"], step["slots"]))]
    want = r.prefill(chunks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_bad_decode_inputs_raise_before_running():
    r = tiny_runner("llama")
    step = fill(r, [[5, 9, 13]])
    kv = r.kv.kv.clone()
    with pytest.raises(kog.InvalidRequest, match="slot"):
        r.decode(**(step | dict(slots=step["slots"] + 1)))
    with pytest.raises(kog.InvalidRequest, match="vocabulary"):
        r.decode(**(step | dict(tokens=np.array([r.vocab_size]))))
    with pytest.raises(kog.InvalidRequest, match="positions"):
        r.decode(**(step | dict(seq_lens=step["seq_lens"] + 1)))
    with pytest.raises(kog.InvalidRequest, match="max_position_embeddings 256"):
        pos = np.array([300])
        r.decode(**(step | dict(positions=pos, seq_lens=(pos + 1).astype(np.int32))))
    with pytest.raises(kog.InvalidRequest, match="block table holds 8"):
        pos = np.array([9])
        r.decode(**(step | dict(positions=pos, seq_lens=(pos + 1).astype(np.int32),
                                block_tables=step["block_tables"][:, :2])))
    assert torch.equal(r.kv.kv, kv)
