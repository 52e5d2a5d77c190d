"""Tensor parallelism over lanes: a Laneformer split over N ranks computes what one process
computes with every lane (prefill and decode), ranks as threads (ThreadGroup) and as processes
(torch.distributed gloo over loopback); a rank that never arrives fails the others, never hangs.
"""

import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import kog
from kog.errors import ModelLoadError
from kog.loader import LoadedModel
from kog.models import ModelRunner, PrefillChunk
from kog.parallel import ThreadGroup, lane_form, shard_config, shard_weights
from kog.parallel.transport import TransportError
from kog.testing.threads import in_threads
from kog.testing.tiny_models import random_weights, tiny_config

from test_laneformer import VARIANTS, VOCAB, lane_model_config, reference_logits

# The folder that holds the kog package these tests import (the source tree's python/ with an
# in-place build, or site-packages once installed): what a rank process must import too.
KOG_ROOT = str(Path(kog.__file__).resolve().parents[1])
IDS = torch.randint(3, 400, (24,), generator=torch.Generator().manual_seed(3)).tolist()
SPLIT = 18  # prefill 18 tokens (every row's logits), decode the other 6 one by one


def rank_runner(config, weights, rank, size, transport):
    local = shard_config(config, rank, size)
    model = LoadedModel(path=None, config=local, weights=shard_weights(local, weights), dtype=torch.float32,
                        tokenizer=None, chat_template=None, stop_token_ids=())
    return ModelRunner(model, num_kv_blocks=16, block_size=16, transport=transport)


def run_sequence(r: ModelRunner) -> torch.Tensor:
    """[len(IDS), vocab] logits: a prefill of SPLIT tokens, then one decode step per token."""
    table = np.arange(4, dtype=np.int32)
    rows = list(r.verify([PrefillChunk(IDS[:SPLIT], 0, table, np.arange(SPLIT, dtype=np.int64))])[0])
    for p in range(SPLIT, len(IDS)):
        rows.append(r.decode(np.array([IDS[p]]), np.array([p]), table[None], np.array([p + 1], np.int32),
                             np.array([p], np.int64))[0])
    return torch.stack(rows)


def shm_transports(config, size):
    """Every rank's end of a fresh shared-memory segment sized for config (rank 0 first)."""
    from kog.parallel.transport import ShmRankTransport

    name = f"/kog-test-tp-{os.getpid()}-{next(_SEGMENTS)}"
    slots = 2 * config.lanes.hist_slots_per_kind if config.lanes else 0
    lanes = (config.lanes.num_lanes if config.lanes else size) // size
    return [ShmRankTransport(name, r, size, reduce_floats=4096, n_slots=slots,
                             slot_bytes=32 * lanes * config.hidden_size * 4, timeout_s=30) for r in range(size)]


_SEGMENTS = iter(range(10**6))


def run_threads(config, weights, size, shm=False):
    """Every rank's logits of the token sequence, ranks as threads: over a ThreadGroup (decode
    through the interpreter) or shared memory (decode natively)."""
    if shm:
        transports = shm_transports(lane_form(config, size) if config.lanes is None else config, size)
    else:
        group = ThreadGroup(size)
        transports = [group.transport(r) for r in range(size)]
    runners = [rank_runner(config, weights, r, size, transports[r]) for r in range(size)]
    return in_threads([lambda r=r: run_sequence(runners[r]) for r in range(size)])


@pytest.mark.parametrize("variant, size", [
    ("delay1", 2), ("delay2_4lanes_lane_scale_lane_head", 2), ("delay2_4lanes_lane_scale_lane_head", 4),
    ("no_comm", 2), ("pre_norm_agg", 2), ("vocab_parallel", 4), ("vocab_parallel", 2),
    ("window_last_layers_one_unclamped", 2), ("delay0_tied", 2),
])
@pytest.mark.parametrize("shm", [False, True], ids=["interpreted", "native_shm"])
def test_ranks_as_threads_compute_what_one_process_computes(variant, size, shm):
    config = lane_model_config(**VARIANTS[variant])
    w = random_weights(config, seed=9)
    one = run_sequence(rank_runner(config, w, 0, 1, None))
    ranks = run_threads(config, w, size, shm)
    for r in range(1, size):  # every rank ends with the same logits
        assert torch.equal(ranks[r], ranks[0])
    scale = one.abs().max().item()
    torch.testing.assert_close(ranks[0], one, rtol=0, atol=1e-5 * scale)  # only the sums' order differs
    assert ranks[0].argmax(-1).tolist() == one.argmax(-1).tolist()
    torch.testing.assert_close(one, reference_logits(config, w, IDS), rtol=0, atol=1e-4 * scale)


def test_shard_config_divides_heads_units_and_lanes():
    config = lane_model_config(**VARIANTS["delay2_4lanes_lane_scale_lane_head"])
    local = shard_config(config, 1, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (4, 2, 128)
    assert local.lanes.num_lanes == 2 and (local.shard.rank, local.shard.size) == (1, 2)
    with pytest.raises(ModelLoadError, match="tensor_parallel_size=3"):
        shard_config(config, 0, 3)
    with pytest.raises(ModelLoadError, match="already"):
        shard_config(local, 0, 2)


def test_a_rank_that_never_arrives_fails_the_other_with_a_transport_error():
    config = lane_model_config(**VARIANTS["delay1"])
    w = random_weights(config)
    group = ThreadGroup(2, timeout_s=0.5)
    r0 = rank_runner(config, w, 0, 2, group.transport(0))
    with pytest.raises(TransportError, match="did not reach"):
        run_sequence(r0)  # rank 1 never runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_as_processes_over_gloo_compute_what_one_process_computes(tmp_path):
    variant, size, port = "delay2_4lanes_lane_scale_lane_head", 2, _free_port()
    here = Path(__file__).parent
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(here), KOG_ROOT, os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(here / "tp_rank_worker.py"), str(r), str(size), str(port), variant,
                               str(tmp_path / f"rank{r}.pt")], env=env, stderr=subprocess.PIPE, text=True)
             for r in range(size)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    config = lane_model_config(**VARIANTS[variant])
    one = run_sequence(rank_runner(config, random_weights(config, seed=9), 0, 1, None))
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0], one, rtol=0, atol=1e-5 * one.abs().max().item())
    assert got[0].argmax(-1).tolist() == one.argmax(-1).tolist()


def dense_run(config, w, lanes=None, size=1):
    """The token sequence's logits of a dense tiny model: plain, in lane form on one process
    (lanes), or that lane form over `size` thread ranks (rank 0's logits)."""
    if lanes is None:
        model = LoadedModel(path=None, config=config, weights=w, dtype=torch.float32, tokenizer=None,
                            chat_template=None, stop_token_ids=())
        return run_sequence(ModelRunner(model, num_kv_blocks=16, block_size=16))
    form = lane_form(config, lanes)
    if size == 1:
        return run_sequence(rank_runner(form, w, 0, 1, None))
    return run_threads(form, w, size)[0]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_dense_families_in_lane_form_equal_the_plain_model_on_one_process_and_over_ranks(arch):
    config = tiny_config(arch, num_hidden_layers=3)  # 4 query heads over 2 KV heads: 2 lanes
    w = random_weights(config, seed=4)
    plain = dense_run(config, w)
    scale = plain.abs().max().item()
    for lanes, size in ((2, 1), (2, 2)):
        got = dense_run(config, w, lanes, size)
        torch.testing.assert_close(got, plain, rtol=0, atol=1e-5 * scale, msg=f"{lanes} lanes on {size} ranks")
        assert got.argmax(-1).tolist() == plain.argmax(-1).tolist()
    form = lane_form(config, 2)
    assert form.lanes.lm_head_type == ("replicate" if config.tie_word_embeddings else "vocab_parallel")


@pytest.mark.parametrize("arch, kv, size", [("llama", 2, 4), ("qwen2", 1, 2), ("qwen3", 1, 4)])
def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path, arch, kv, size):
    # each rank holds one copy of its query heads' KV head (qwen2: k/v biases; qwen3: k norm)
    from kog.loader import load_model
    from kog.testing.tiny_models import write_hf_model

    config = tiny_config(arch, num_hidden_layers=2, num_key_value_heads=kv)
    w = random_weights(config, seed=8)
    plain = dense_run(config, w)
    form = lane_form(config, size)
    assert (form.num_key_value_heads, form.lanes.kv_repeat) == (size, size // kv)
    last = size - 1  # the last rank's KV head is stored head last // (size // kv)
    local = shard_config(form, last, size)
    k = shard_weights(local, w)["model.layers.0.self_attn.k_proj.weight"]
    stored = w["model.layers.0.self_attn.k_proj.weight"].reshape(kv, -1, config.hidden_size)[last // (size // kv)]
    assert torch.equal(k, stored)
    # the same tensors read as a rank's part of a safetensors checkpoint
    view = lambda c: shard_config(lane_form(c, size), last, size)  # noqa: E731
    rank = load_model(str(write_hf_model(tmp_path / arch, config, w)), "float32", shard=view)
    for name, t in shard_weights(local, w).items():
        assert torch.equal(rank.weights[name], t), name
    for lanes, ranks in ((size, 1), (size, size)):
        got = dense_run(config, w, lanes, ranks)
        torch.testing.assert_close(got, plain, rtol=0, atol=1e-5 * plain.abs().max().item(),
                                   msg=f"{lanes} lanes on {ranks} ranks")
        assert got.argmax(-1).tolist() == plain.argmax(-1).tolist()


def test_lane_form_refuses_what_it_cannot_split():
    config = tiny_config("llama", num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ModelLoadError, match="num_key_value_heads=2"):
        lane_form(config, 3)  # 3 lanes: 2 KV heads neither split over them nor divide them


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("shm", [False, True], ids=["interpreted", "native_shm"])
def test_moe_families_with_experts_placed_on_two_ranks_equal_the_plain_model(arch, shm):
    # Expert parallelism: attention split by heads, experts 0-1 on rank 0 and 2-3 on rank 1
    # (qwen2_moe's two shared-expert slices one per rank), the ranks' partial MoE outputs summed:
    # a rank that ran another's experts too would count them twice.
    from kog.models.weights import expert_ranks

    config = tiny_config(arch, num_hidden_layers=3)
    w = random_weights(config, seed=8)
    plain = dense_run(config, w)
    got = run_threads(lane_form(config, 2), w, 2, shm)
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0], plain, rtol=0, atol=1e-5 * plain.abs().max().item())
    assert got[0].argmax(-1).tolist() == plain.argmax(-1).tolist()
    local = shard_config(lane_form(config, 2), 1, 2)
    assert expert_ranks(local).tolist() == [0, 0, 1, 1] + ([0, 1] if arch == "qwen2_moe" else [])


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_a_rank_keeps_only_its_experts_matrices(arch):
    # Rank r's stacks hold its experts, in ascending order (MOE_EXPERTS indexes them so): half of
    # the experts' bytes per rank at 2 ranks, the routers whole.
    from kog.models.weights import expert_ranks, prepare_weights, weight_bytes

    config = lane_form(tiny_config(arch, num_hidden_layers=3), 2)
    w = random_weights(tiny_config(arch, num_hidden_layers=3), seed=8)
    full = prepare_weights(tiny_config(arch, num_hidden_layers=3), w, torch.float32)
    layer = f"model.layers.{config.moe_layers[0]}.mlp."
    sizes = []
    for rank in range(2):
        local = shard_config(config, rank, 2)
        prepared = prepare_weights(local, shard_weights(local, w), torch.float32)
        mine = (expert_ranks(local) == rank).nonzero().flatten()
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            assert torch.equal(prepared[layer + name], full[layer + name][mine])
        assert torch.equal(prepared[layer + "gate.weight"], full[layer + "gate.weight"])
        sizes.append(sum(prepared[layer + n].nbytes for n in ("experts.gate_up_proj", "experts.down_proj")))
    stacked = sum(full[layer + n].nbytes for n in ("experts.gate_up_proj", "experts.down_proj"))
    assert sizes == [stacked // 2, stacked // 2]
    assert weight_bytes(prepared) < weight_bytes(full)


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "laneformer_tp"])
def test_kog_llm_with_two_ranks_generates_what_one_rank_generates(tmp_path, arch):
    import kog
    from kog.testing.tiny_models import write_hf_model

    config = tiny_config(arch, num_hidden_layers=3) if arch != "laneformer_tp" else lane_model_config(
        **VARIANTS["delay2_4lanes_lane_scale_lane_head"])
    folder = write_hf_model(tmp_path / arch, config, random_weights(config, seed=6))
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 8, 41]}, {"prompt_token_ids": list(range(30, 52))}]
    greedy = kog.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in kog.LLM(str(folder), dtype="float32").generate(prompts, greedy)]
    llm = kog.LLM(str(folder), dtype="float32", tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert got == want
        worker = llm.engine.runner._procs[0]
        assert worker.poll() is None  # the second rank is alive between requests
    finally:
        llm.engine.runner.close()
    assert worker.wait(timeout=30) == 0  # and exits cleanly when rank 0 closes


def test_tensor_parallel_size_must_divide_and_be_positive(tmp_path):
    import kog
    from kog.testing.tiny_models import write_hf_model

    folder = write_hf_model(tmp_path / "m", tiny_config("llama"))
    for bad in (0, -1, 1.5):
        with pytest.raises(kog.InvalidRequest, match="tensor_parallel_size"):
            kog.LLM(str(folder), dtype="float32", tensor_parallel_size=bad)


def test_gpu_ranks_are_placed_one_per_gpu_of_their_host_and_refused_without_them(tmp_path):
    import kog
    from kog.parallel.ranks import RankSpec, rank_device
    from kog.testing.tiny_models import write_hf_model

    spec = RankSpec(None, None, 4, 8, 16, 0, device="cuda", nnodes=2)
    assert [rank_device(spec, r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert rank_device(RankSpec(None, None, 4, 8, 16, 0), 3) == "cpu"
    folder = write_hf_model(tmp_path / "m", tiny_config("llama"))
    if not torch.cuda.is_available():
        with pytest.raises(kog.InvalidRequest, match="puts 2 ranks on this host, one GPU each, and it has 0"):
            kog.LLM(str(folder), dtype="float32", device="cuda", tensor_parallel_size=2)
    with pytest.raises(kog.InvalidRequest, match="device 'cpu' or 'cuda'.*got 'cuda:1'"):
        kog.LLM(str(folder), dtype="float32", device="cuda:1", tensor_parallel_size=2)


def test_rank_0_mirrors_each_gpu_launch_on_the_other_ranks_before_its_own():
    """ParallelRunner wraps a GPU rank 0's decoder: the engine's decode loop launches through
    MirroredGpuDecoder, which sends the launch's arguments (the followers run
    kog.parallel.ranks.follow_gpu_decode with them) before launching rank 0's kernel."""
    from kog.parallel.ranks import MirroredGpuDecoder, ParallelRunner

    calls = []

    class Decoder:  # stands in for rank 0's GpuDecoder
        device = "cuda:0"

        def stage(self, *args):
            if args[4] > 16:
                raise kog.InvalidRequest("n_steps")
            calls.append(("stage", args))
            return types.SimpleNamespace(result="result")

        def launch(self, staged):
            calls.append(("launch", staged.result))

    class Local:
        native_decoder, kv = Decoder(), None

    runner = ParallelRunner.__new__(ParallelRunner)
    ParallelRunner.__init__(runner, Local(), None, [])
    runner.send = lambda name, *args: calls.append((name, args))
    runner._closed = True  # nothing to stop at exit
    assert isinstance(runner.native_decoder, MirroredGpuDecoder) and runner.native_decoder.device == "cuda:0"
    args = (np.array([5]), np.array([3]), np.zeros((1, 1), np.int32), None, 4, [2], 0)
    assert runner.native_decoder.decode(*args) == "result"
    # checked and staged, then sent, then launched
    assert calls == [("stage", args), ("gpu_decode", args), ("launch", "result")]
    calls.clear()
    with pytest.raises(kog.InvalidRequest):  # a call rank 0 refuses reaches no other rank
        runner.native_decoder.decode(*args[:4], 32, [2], 0)
    assert calls == []


def test_a_dead_rank_fails_the_request_with_a_transport_error_instead_of_hanging(tmp_path):
    import time

    import kog
    from kog.testing.tiny_models import write_hf_model

    folder = write_hf_model(tmp_path / "m", tiny_config("llama"))
    llm = kog.LLM(str(folder), dtype="float32", tensor_parallel_size=2)
    try:
        worker = llm.engine.runner._procs[0]
        worker.kill()
        worker.wait(timeout=30)
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, kog.SamplingParams(max_tokens=4, temperature=0.0))
        assert time.monotonic() - t0 < 60  # the closed connection is seen at once, not after a timeout
    finally:
        llm.engine.runner.close()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", None], ids=["dequantized", "q4_1_blocks"])
def test_smollm2_over_three_ranks_generates_what_one_process_generates(dtype):
    # SmolLM2-135M: 9 query heads over 3 KV heads, so 3 ranks (3 heads and 1 KV head each);
    # its tied head is replicated. fp32 from the Q4_1 GGUF dequantized at load, or its blocks
    # kept (dtype None): each rank holds its rows / whole blocks of columns of each matrix.
    import kog

    prompts = ["The capital of France is", "def fibonacci(n):"]
    greedy = kog.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    one = kog.LLM(None, dtype=dtype, max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
    del one
    llm = kog.LLM(None, dtype=dtype, max_num_seqs=2, tensor_parallel_size=3)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    finally:
        llm.engine.runner.close()
    assert got == want


def test_two_hosts_on_loopback_generate_what_one_process_generates(tmp_path):
    # --nnodes 2: "host" 1 runs its rank with `python -m kog.parallel.worker --node-rank 1`, the
    # rendezvous at host 0's address; the collectives go through gloo (no shared memory).
    import kog
    from kog.testing.tiny_models import write_hf_model

    config = lane_model_config(**VARIANTS["delay1"])
    folder = write_hf_model(tmp_path / "lf", config, random_weights(config, seed=2))
    greedy = kog.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": [9, 8, 7, 6, 5, 4]}
    want = kog.LLM(str(folder), dtype="float32").generate(prompt, greedy)[0].outputs[0].token_ids
    port = _free_port()
    env = os.environ | {"PYTHONPATH": os.pathsep.join([KOG_ROOT, os.environ.get("PYTHONPATH", "")])}
    host1 = subprocess.Popen([sys.executable, "-m", "kog.parallel.worker", "--size", "2", "--nnodes", "2",
                              "--node-rank", "1", "--addr", "127.0.0.1", "--port", str(port)], env=env)
    try:
        llm = kog.LLM(str(folder), dtype="float32", tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                      master_port=port)
        try:
            assert llm.engine.runner._procs == []  # host 0 starts no process for host 1's rank
            assert llm.generate(prompt, greedy)[0].outputs[0].token_ids == want
        finally:
            llm.engine.runner.close()
        assert host1.wait(timeout=60) == 0
    finally:
        host1.kill()


@pytest.mark.parametrize("arch", ["llama", "laneformer_tp"])
def test_a_rank_reads_only_its_part_of_each_safetensors_tensor(tmp_path, arch):
    from kog.loader import load_model
    from kog.testing.tiny_models import write_hf_model

    config = tiny_config("llama") if arch == "llama" else lane_model_config(**VARIANTS["delay2_4lanes_lane_scale_lane_head"])
    w = random_weights(config, seed=12)
    folder = write_hf_model(tmp_path / arch, config, w, shards=2)
    view = (lambda c: shard_config(lane_form(c, 2) if c.lanes is None else c, 1, 2))
    rank1 = load_model(str(folder), "float32", shard=view)
    want = shard_weights(view(config), w)
    assert rank1.config == view(config) and set(rank1.weights) == set(want)
    for name, t in want.items():
        assert torch.equal(rank1.weights[name], t), name
    smaller = [n for n in want if want[n].numel() < w[n].numel()]
    assert smaller  # really a part: q/k/v, o_proj, ... or the lane tensors


@pytest.mark.parametrize("variant", ["delay1", "delay0_tied", "pre_norm_agg"])
def test_a_replicated_head_is_split_by_vocabulary_over_the_ranks(variant):
    # Each rank computes its vocabulary slice from the merged stream (a tied head from a copy of
    # the embedding's rows), then the slices are gathered: no rank reads the whole head.
    from kog.program import Opcode

    config = lane_model_config(**VARIANTS[variant])
    r = rank_runner(config, random_weights(config, seed=1), 1, 2, ThreadGroup(2).transport(1))
    head = next(ins for ins in r.program if ins.opcode == Opcode.LINEAR and ins.layer == -1)
    assert head.vocab_slice and r.program[-2].opcode == Opcode.ALL_GATHER
    w = r.weights[head.weights[0]]
    assert w.shape == (VOCAB // 2, config.hidden_size)
    full = random_weights(config, seed=1)["model.tok_embeddings.weight" if config.tie_word_embeddings else "lm_head.weight"]
    assert torch.equal(w, full[VOCAB // 2:])


def test_a_lane_rank_publishes_its_delayed_gathers_without_a_copy():
    """Each LANE_GATHER's LINEAR writes straight into the rank's slot part (the decode executor's
    zero-copy publish); one process, or a rank without shared memory, has none."""
    from kog.program import Opcode

    config = lane_model_config(**VARIANTS["delay1"])
    w = random_weights(config, seed=9)
    transports = shm_transports(config, 2)
    rank0 = rank_runner(config, w, 0, 2, transports[0])
    gathers = sum(1 for ins in rank0.program if ins.opcode == Opcode.LANE_GATHER)
    assert gathers > 0 and rank0.native_decoder.num_zero_copy_publishes == gathers
    assert rank_runner(config, w, 0, 1, None).native_decoder.num_zero_copy_publishes == 0


def test_two_ranks_run_the_multi_token_loop_and_sample_what_one_process_samples(tmp_path):
    """The engine's native loop over ranks (kog.parallel.ranks.MirroredLoop): K decode steps per
    call on every rank, seeded sampling with penalties and a stop token met mid-loop, the tokens
    one process draws."""
    import kog
    from kog.parallel.ranks import MirroredLoop
    from kog.testing.tiny_models import write_hf_model

    config = lane_model_config(**VARIANTS["delay1"])  # a Laneformer: its delayed gathers inside the loop
    folder = write_hf_model(tmp_path / "m", config, random_weights(config, seed=12))
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 8, 41]}, {"prompt_token_ids": list(range(30, 52))}]
    one = kog.LLM(str(folder), dtype="float32")
    free = one.generate(prompts[1:], kog.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    ids = free[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(ids) if i >= 9 and t not in ids[:i])  # first met at index >= 9
    params = [kog.SamplingParams(max_tokens=28, temperature=0.9, top_p=0.9, seed=7, repetition_penalty=1.3,
                                 ignore_eos=True),
              kog.SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)]
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    assert len(want[0]) == 28 and want[1][-1] == stop and len(want[1]) < 24
    llm = kog.LLM(str(folder), dtype="float32", tensor_parallel_size=2)
    try:
        loop = llm.engine.decode_loop._cpu
        assert isinstance(loop, MirroredLoop)
        steps, run = [], loop.run
        loop.run = lambda *a: (steps.append(a[-1]), run(*a))[1]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want
        assert max(steps) >= 8  # K decode steps per call, on both ranks
        # again: the other rank's sampling states were dropped with their rows and are rebuilt
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    finally:
        llm.engine.runner.close()


def test_a_follower_whose_sampling_state_disagrees_with_rank_0_stops_before_decoding():
    """LoopFollower checks each row's output count against rank 0's before running the loop: a
    rank that would draw other tokens fails loudly instead of desynchronizing the collectives."""
    from kog.engine.decode_loop import NativeSampler
    from kog.engine.sequence import Sequence
    from kog.parallel.ranks import LoopFollower

    config = lane_model_config(**VARIANTS["delay1"])
    runner = rank_runner(config, random_weights(config, seed=1), 0, 1, None)
    seq = Sequence(0, "r", 0, [5, 6, 7], kog.SamplingParams(max_tokens=8, seed=3), None)
    sampler = NativeSampler(config.vocab_size, (2,), 64)
    sampler.state(seq)
    key, args = sampler.origin(seq)
    follower = LoopFollower(runner)
    tables = np.zeros((1, 1), dtype=np.int32)
    with pytest.raises(TransportError, match="counted 1 outputs, rank 0's 2"):
        follower.run([(key, args, np.array([9], np.int32), 2)], np.array([9]), np.array([3]), tables, 1)


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_a_rank_reads_only_its_routed_experts_from_safetensors(tmp_path, monkeypatch, layout):
    # qwen2_moe: 4 routed experts (2 per rank) and a shared expert (whole on every rank, its
    # slices placed round-robin later). Stored stacked, the rank's rows are sliced out of the file;
    # stored one tensor per expert, only its experts' tensors are read at all.
    from safetensors.torch import save_file

    from kog.loader import load_model
    from kog.loader import safetensors as st
    from kog.testing.tiny_models import write_hf_model

    config = tiny_config("qwen2_moe", num_hidden_layers=2)
    w = random_weights(config, seed=5)
    folder = write_hf_model(tmp_path / "m", config, w)
    if layout == "per_expert":  # save_pretrained's names: mlp.experts.<e>.{gate,up,down}_proj.weight
        ie, stored = config.moe_intermediate_size, {}
        for name, t in w.items():
            if name.endswith("mlp.experts.gate_up_proj"):
                p = name[: -len("gate_up_proj")]
                for e in range(config.num_experts):
                    stored[f"{p}{e}.gate_proj.weight"] = t[e, :ie].clone()
                    stored[f"{p}{e}.up_proj.weight"] = t[e, ie:].clone()
            elif name.endswith("mlp.experts.down_proj"):
                p = name[: -len("down_proj")]
                for e in range(config.num_experts):
                    stored[f"{p}{e}.down_proj.weight"] = t[e].clone()
            else:
                stored[name] = t
        save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    parts_read = []
    combine = st.combine
    monkeypatch.setattr(st, "combine", lambda name, parts, tensors: parts_read.append(len(parts)) or
                        combine(name, parts, tensors))
    full = load_model(folder, "float32")
    layer = f"model.layers.{config.moe_layers[0]}.mlp.experts."
    for rank in range(2):
        parts_read.clear()
        local = load_model(folder, "float32", shard=lambda c, r=rank: shard_config(lane_form(c, 2), r, 2))
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(local.weights[layer + name], full.weights[layer + name][2 * rank:2 * rank + 2])
        if layout == "per_expert":  # per MoE layer: 2 experts' gate and up, then their down
            assert parts_read and set(parts_read) <= {2 * 2, 2} and 2 * 2 in parts_read
        else:
            assert not parts_read  # sliced straight from the stored stacks


@pytest.mark.parametrize("quant,tie", [("Q8_0", True), ("Q4_1", False)])
def test_gguf_blocks_split_over_two_ranks_generate_what_one_process_generates(tmp_path, quant, tie):
    # The blocks kept (dtype auto): q/k/v/gate/up by byte rows, o/down by whole blocks of
    # columns, a tied head's vocabulary rows copied from the quantized embedding.
    from kog.quantized import QuantizedWeight
    from kog.testing.tiny_models import write_gguf_model

    config = tiny_config("llama", num_hidden_layers=3, intermediate_size=256, tie_word_embeddings=tie)
    path = write_gguf_model(tmp_path / "m.gguf", config, random_weights(config, seed=6), quant)
    greedy = kog.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 8, 41]}, {"prompt_token_ids": list(range(30, 52))}]
    want = [o.outputs[0].token_ids for o in kog.LLM(str(path)).generate(prompts, greedy)]
    llm = kog.LLM(str(path), tensor_parallel_size=2)
    try:
        local = llm.engine.runner.local.weights
        assert llm.engine.runner.local.kv_dtype == torch.float16  # "auto" for kept blocks, on every rank
        assert isinstance(local["model.layers.0.self_attn.o_proj.weight"], QuantizedWeight)
        assert local["model.layers.0.mlp.down_proj.weight"].shape == (config.hidden_size, 128)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    finally:
        llm.engine.runner.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_quantized_moe_experts_split_over_two_ranks_generate_what_one_process_generates(tmp_path, arch):
    # Q8_0 expert stacks kept as blocks: each rank reads its experts' byte rows.
    from kog.quantized import QuantizedWeight
    from kog.testing.tiny_models import write_gguf_model

    config = tiny_config(arch, num_hidden_layers=2, **({} if arch == "mixtral" else {"intermediate_size": 256}))
    path = write_gguf_model(tmp_path / "m.gguf", config, random_weights(config, seed=6), "Q8_0")
    greedy = kog.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 8, 41]}, {"prompt_token_ids": list(range(30, 52))}]
    want = [o.outputs[0].token_ids for o in kog.LLM(str(path)).generate(prompts, greedy)]
    llm = kog.LLM(str(path), tensor_parallel_size=2)
    try:
        stack = llm.engine.runner.local.weights["model.layers.0.mlp.experts.gate_up_proj"]
        assert isinstance(stack, QuantizedWeight)
        assert stack.shape[0] == 2 * 2 * config.moe_intermediate_size  # 2 of the 4 experts
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    finally:
        llm.engine.runner.close()


def test_quantized_expert_stacks_with_a_shared_expert_keep_the_ranks_experts():
    # qwen2_moe's shared expert (two slices, one per rank) appended after the routed experts in
    # blocks: rank r's stacks are the full stacks' rows of its experts, routed then shared.
    from kog.models.weights import expert_ranks, prepare_weights
    from kog.quantized import QuantizedWeight, quantize_q8_0

    base = tiny_config("qwen2_moe", num_hidden_layers=2, intermediate_size=256, shared_expert_intermediate_size=64)
    w = random_weights(base, seed=3)
    for name in list(w):  # every expert matrix as Q8_0 blocks ([E n, k] stacks)
        if ".experts." in name or ("shared_expert." in name and name.endswith("proj.weight")):
            t = w[name]
            w[name] = quantize_q8_0(t.reshape(-1, t.shape[-1]))
    config = lane_form(base, 2)
    full = prepare_weights(base, w, torch.float32)
    layer = f"model.layers.{base.moe_layers[0]}.mlp."
    for rank in range(2):
        local = shard_config(config, rank, 2)
        prepared = prepare_weights(local, shard_weights(local, w), torch.float32)
        mine = (expert_ranks(local) == rank).nonzero().flatten()
        for name, rows in (("experts.gate_up_proj", 2 * base.moe_intermediate_size),
                           ("experts.down_proj", base.hidden_size)):
            got, whole = prepared[layer + name], full[layer + name]
            assert isinstance(got, QuantizedWeight) and got.shape[0] == len(mine) * rows
            want = whole.dequantize().view(-1, rows, whole.shape[1])[mine].reshape(-1, whole.shape[1])
            assert torch.equal(got.dequantize(), want)


def test_a_split_that_cuts_a_quantized_block_is_refused_by_name():
    from kog.quantized import quantize_q8_0

    config = lane_form(tiny_config("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                   head_dim=16), 2)
    local = shard_config(config, 0, 2)
    w = {"model.layers.0.self_attn.q_proj.weight": quantize_q8_0(torch.randn(96, 96)),
         "model.layers.0.self_attn.o_proj.weight": quantize_q8_0(torch.randn(96, 96))}
    with pytest.raises(kog.InvalidRequest, match=r"o_proj.weight: its 2-way split: 48 columns do not fill Q8_0"):
        shard_weights(local, w)
    q = shard_weights(local, {k: v for k, v in w.items() if "q_proj" in k})["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q.dequantize(), w["model.layers.0.self_attn.q_proj.weight"].dequantize()[:48])


def test_a_rank_0_that_fails_to_build_kills_the_workers_and_leaves_the_group(tmp_path, monkeypatch):
    import torch.distributed as dist

    from kog.parallel import ranks
    from kog.testing.tiny_models import write_hf_model

    folder = write_hf_model(tmp_path / "m", tiny_config("llama"))
    real = ranks.build_rank_runner

    def fails(*args, **kwargs):
        raise ModelLoadError("rank 0 cannot build (test)")

    monkeypatch.setattr(ranks, "build_rank_runner", fails)
    with pytest.raises(ModelLoadError, match="cannot build"):
        kog.LLM(str(folder), dtype="float32", tensor_parallel_size=2)
    assert not dist.is_initialized()
    monkeypatch.setattr(ranks, "build_rank_runner", real)
    llm = kog.LLM(str(folder), dtype="float32", tensor_parallel_size=2)  # a fresh group, new workers
    try:
        greedy = kog.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy)[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.runner.close()
