"""The scheduler's last resort (reclaim) under a full pool of forked sequences."""

from kog.engine.scheduler import Scheduler
from kog.engine.sequence import Sequence, SeqStatus
from kog.kvcache import KVCacheManager
from kog.sampling_params import SamplingParams

BS = 4


def running_seq(seq_id: int, prompt: list[int], output: list[int], computed: int, arrival: float) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(prompt) + list(output), SamplingParams(max_tokens=64), None,
                   num_prompt_tokens=len(prompt), num_computed=computed, arrival_time=arrival)
    seq.status = SeqStatus.RUNNING
    return seq


def test_a_victim_that_only_shares_a_prefix_is_not_readmitted_in_the_same_step():
    # 6 blocks: an 8-token prompt (2 blocks) forked 3 ways; branches 0 and 1 hold 2 blocks each
    # of their own, branch 2 only the shared prompt. All three have 4 tokens to compute (a
    # jump-forward chunk) and no block is free.
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    prompt = list(range(10, 18))
    kv.add_sequence(0, [])
    kv.append(0, tokens=prompt)
    kv.fork(0, 1)
    kv.fork(0, 2)
    kv.append(0, tokens=list(range(20, 28)))
    kv.append(1, tokens=list(range(30, 38)))
    assert kv.stats()["blocks_free"] == 0
    seqs = [running_seq(0, prompt, list(range(20, 32)), 16, 1.0),
            running_seq(1, prompt, list(range(30, 42)), 16, 2.0),
            running_seq(2, prompt, list(range(40, 44)), 8, 3.0)]
    sched = Scheduler(kv, lambda moves: None, max_num_seqs=8, max_num_batched_tokens=64)
    sched.running.extend(seqs)

    out = sched.schedule()  # before the fix: branch 2 preempted and re-admitted until KVCacheFull

    assert [s.seq_id for s in out.preempted] == [2, 1]  # the next victim freed real blocks
    assert [(w.seq.seq_id, w.start, w.n) for w in out.prefill] == [(0, 16, 4)]
    assert [s.seq_id for s in sched.waiting] == [1, 2] and [s.seq_id for s in sched.running] == [0]
    assert 2 not in kv and 1 not in kv  # both recompute later; nothing lost
