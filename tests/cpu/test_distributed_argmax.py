"""The distributed argmax of a vocabulary-parallel LM head (DecodeStep::argmax_only): when every
row is plain greedy, each rank exchanges its slice's best (logit, id) per row instead of the
slice, and the ids are those a full argmax of the gathered logits gives, ties to the lower id."""

import numpy as np
import pytest
import torch

import kog
from kog.models import PrefillChunk
from kog.testing.threads import in_threads
from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

from test_laneformer import VARIANTS, VOCAB, lane_model_config
from test_tensor_parallel import IDS, SPLIT, rank_runner, run_sequence, shm_transports


def decode_ids(r, argmax_only: bool) -> tuple[list[int], torch.Tensor]:
    """Prefill SPLIT tokens of IDS, then decode the rest one by one straight through the native
    executor: the ids it samples at each step (and its logits, which argmax_only leaves as set)."""
    table = np.arange(4, dtype=np.int32)
    r.verify([PrefillChunk(IDS[:SPLIT], 0, table, np.arange(SPLIT, dtype=np.int64))])
    ids, n = [], len(IDS) - SPLIT
    logits = torch.full((n, VOCAB), 7.0)
    for i, p in enumerate(range(SPLIT, len(IDS))):
        a = [np.array([IDS[p]], np.int64), np.array([p], np.int64), table[None].copy(),
             np.array([p + 1], np.int32), np.array([p], np.int64)]
        sampled = np.full(1, -1, np.int64)
        r.native_decoder.run(1, a[0].ctypes.data, a[1].ctypes.data, a[2].ctypes.data, 4, a[3].ctypes.data,
                             a[4].ctypes.data, logits[i].data_ptr(), sampled.ctypes.data, argmax_only=argmax_only)
        ids.append(int(sampled[0]))
    return ids, logits


def ranks_decode(config, weights, argmax_only: bool):
    """Two ranks over shared memory, as threads: each rank's decode_ids, and the runners."""
    transports = shm_transports(config, 2)
    runners = [rank_runner(config, weights, r, 2, transports[r]) for r in range(2)]
    out = in_threads([lambda r=r: decode_ids(runners[r], argmax_only) for r in range(2)])
    return out, runners


@pytest.mark.parametrize("variant", ["delay1", "delay0_tied", "pre_norm_agg", "vocab_parallel"])
def test_two_ranks_sample_by_distributed_argmax_what_the_gathered_logits_give(variant):
    config = lane_model_config(**VARIANTS[variant])
    w = random_weights(config, seed=9)
    gathered, runners_gathered = ranks_decode(config, w, argmax_only=False)
    ids0, logits0 = gathered[0]  # rank 0: the ids its SAMPLE drew from the gathered logits
    want = logits0.argmax(-1).tolist()
    assert ids0 == want and runners_gathered[0].native_decoder.num_argmax_gathers == 0
    got, runners = ranks_decode(config, w, argmax_only=True)
    for rank in range(2):
        ids, logits = got[rank]
        assert ids == want
        assert torch.all(logits == 7.0)  # no logits written: only the pairs crossed ranks
        assert runners[rank].native_decoder.num_argmax_gathers == len(IDS) - SPLIT
    # one process: no collective, the same argmax from the whole row
    one = rank_runner(config, w, 0, 1, None)
    ids, _ = decode_ids(one, argmax_only=True)
    assert ids == run_sequence(rank_runner(config, w, 0, 1, None))[SPLIT:].argmax(-1).tolist()
    assert one.native_decoder.num_argmax_gathers == 0


def tied_head(config, w, rows_equal: list[int], rows_negated: list[int]) -> dict:
    """w with an LM head of zeros but for rows_equal (one random row each) and rows_negated (its
    negation): whichever sign their logit has, the best is a tie of two rows (or of every row)."""
    name = "lm_head.weight"
    assert not config.tie_word_embeddings
    w = dict(w)
    v = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(4))
    head = torch.zeros_like(w[name])
    for i in rows_equal:
        head[i] = v
    for i in rows_negated:
        head[i] = -v
    w[name] = head
    return w


@pytest.mark.parametrize("rows_equal, rows_negated", [
    ([], []),                                            # every logit 0: id 0, a tie inside and across slices
    ([VOCAB // 2 + 3, VOCAB // 2 + 5], [VOCAB // 2 + 7, VOCAB // 2 + 9]),  # a tie inside rank 1's slice
    ([2, VOCAB // 2 + 1], [VOCAB // 2 - 1, VOCAB - 1]),  # a tie across the slices, both ways
])
def test_ties_go_to_the_lower_id_as_a_full_argmax(rows_equal, rows_negated):
    config = lane_model_config(**VARIANTS["delay1"])
    w = tied_head(config, random_weights(config, seed=9), rows_equal, rows_negated)
    gathered, _ = ranks_decode(config, w, argmax_only=False)
    _, logits = gathered[0]  # rank 0's gathered logits, one row per decode step
    best = logits.max(-1, keepdim=True).values
    assert ((logits == best).sum(-1) >= 2).all()  # every step really is a tie
    want = logits.argmax(-1).tolist()  # torch: the first maximal index
    got, _ = ranks_decode(config, w, argmax_only=True)
    assert [ids for ids, _ in got] == [want, want]


def test_argmax_only_needs_somewhere_to_write_the_ids():
    config = lane_model_config(**VARIANTS["delay1"])
    r = rank_runner(config, random_weights(config, seed=9), 0, 1, None)
    a = [np.array([3], np.int64), np.array([0], np.int64), np.zeros((1, 4), np.int32), np.array([1], np.int32),
         np.array([0], np.int64)]
    with pytest.raises(Exception, match="argmax_only step needs sampled"):
        r.native_decoder.run(1, a[0].ctypes.data, a[1].ctypes.data, a[2].ctypes.data, 4, a[3].ctypes.data,
                             a[4].ctypes.data, 0, 0, argmax_only=True)


def test_kog_llm_over_two_ranks_takes_the_distributed_argmax_for_greedy_batches_only(tmp_path):
    """The engine's loop (on every rank) asks for the argmax when every row is plain greedy; a
    penalty (or a temperature) on any row keeps the gathered logits and the sampler."""
    config = tiny_config("llama", num_hidden_layers=2)
    folder = write_hf_model(tmp_path / "m", config, random_weights(config, seed=6))
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 8, 41]}, {"prompt_token_ids": list(range(30, 52))}]
    greedy = kog.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    penalized = kog.SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.5, ignore_eos=True)
    one = kog.LLM(str(folder), dtype="float32")
    want = [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
    want_pen = [o.outputs[0].token_ids for o in one.generate(prompts, [greedy, penalized])]
    assert want_pen[1] != want[1]  # the penalty changes the tokens: its logits must be adjusted
    llm = kog.LLM(str(folder), dtype="float32", tensor_parallel_size=2)
    try:
        ex = llm.engine.runner.native_decoder
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
        n = ex.num_argmax_gathers
        assert n >= 8
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy, penalized])] == want_pen
        assert ex.num_argmax_gathers == n
    finally:
        llm.engine.runner.close()
