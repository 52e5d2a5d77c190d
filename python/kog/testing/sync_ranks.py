"""Tensor-parallel ranks' persistent kernels and their cross-rank protocol, modelled on the CPU
(docs/GPU.md, "Tensor parallelism inside the persistent kernel"; schedule/gpu_program.h,
"cross-rank ops").

    protocols = [Protocol(tuple(sync_ops(expanded_r, dims_r, batch)), tuple(_C.program_sinks(expanded_r)))
                 for each rank r]
    run_ranks(protocols, Launch(grid=5, n_steps=3, batch=batch), seed=0)

Each rank is kog.testing.sync_model's launch model (its own grid, counters and group counters;
its launches back to back in its own stream order), and one seeded scheduler moves any runnable
workgroup of any rank, so ranks drift apart as far as the protocol lets them. What the ranks
share is modelled here: every rank's flags (flag[q][c][r]: the last epoch rank r raised on rank
q for channel c) and inboxes. A push's last item on rank r raises flag[q][c][r] = epoch on every
q; a finish on rank s waits until flag[s][c][q] >= epoch for every q. Epoch = launch * n_steps +
step + 1 (the kernel's step_base + step + 1: monotone, never reset). A push item of step t
writes parity t % parities of its channel in every rank's inbox; a finish item reads its own.

It raises kog.testing.sync_model's Hazard when
  RAW  a finish item of step t on rank s reads its inbox while some rank's push of that step
       has items not done;
  WAR  a push item of step t writes rank q's inbox part (c, parity) while q has not finished
       reading the last step that wrote that part;
and Deadlock when no workgroup of any rank can move. Memory ordering is assumed correct (the
item stores fenced at system scope before the local count, the flags stored with release and
read with acquire).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kog.testing.sync_model import CounterReuse, Deadlock, Hazard, Launch, LaunchRun, Protocol, Stats


@dataclass
class _World:
    protocols: list[Protocol]
    n_steps: int
    parities: int = 2

    def __post_init__(self) -> None:
        self.ranks = len(self.protocols)
        ops = self.protocols[0].ops
        channels = [o.comm for o in ops if o.comm >= 0]
        self.n_channels = max(channels) + 1 if channels else 0
        self.push_of = {o.comm: j for j, o in enumerate(ops) if o.comm >= 0 and o.comm_push}
        self.finish_of = {o.comm: j for j, o in enumerate(ops) if o.comm >= 0 and not o.comm_push}
        self.flags = [[[0] * self.ranks for _ in range(self.n_channels)] for _ in range(self.ranks)]
        self.done: dict[tuple[int, int, int], int] = {}  # (rank, epoch, op) -> its items complete
        # (rank q, channel, parity) -> epochs whose pushes wrote that part of q's inbox
        self.writes: dict[tuple[int, int, int], set[int]] = {}

    def epoch(self, launch: int, step: int) -> int:
        return launch * self.n_steps + step + 1

    def flags_ready(self, rank: int, channel: int, epoch: int) -> bool:
        return all(f >= epoch for f in self.flags[rank][channel])

    def raise_flags(self, rank: int, channel: int, epoch: int) -> None:
        for q in range(self.ranks):
            self.flags[q][channel][rank] = epoch

    def completed(self, rank: int, epoch: int, j: int) -> None:
        key = (rank, epoch, j)
        self.done[key] = self.done.get(key, 0) + 1

    def item(self, rank: int, epoch: int, j: int, w: int, item: int) -> None:
        op = self.protocols[rank].ops[j]
        c, parity = op.comm, epoch % self.parities
        where = f"rank {rank} epoch {epoch} op {j} ({op.name}) item {item} on workgroup {w}"
        if op.comm_push:  # writes every rank's part (c, parity): the last epoch that wrote it was read
            for q in range(self.ranks):
                written = self.writes.setdefault((q, c, parity), set())
                before = [e for e in written if e < epoch]
                if before:
                    last, fin = max(before), self.finish_of[c]
                    got, need = self.done.get((q, last, fin), 0), self.protocols[q].ops[fin].n_items
                    if got < need:
                        raise Hazard(f"WAR on rank {q}'s inbox of channel {c} (parity {parity}): {where} writes "
                                     f"while rank {q}'s finish of epoch {last} has {got}/{need} items done")
                written.add(epoch)
            return
        push = self.push_of[c]  # a finish reads every rank's part of this epoch
        for q in range(self.ranks):
            got, need = self.done.get((q, epoch, push), 0), self.protocols[q].ops[push].n_items
            if got < need:
                raise Hazard(f"RAW on rank {rank}'s inbox of channel {c}: {where} reads while rank {q}'s push "
                             f"of that epoch has {got}/{need} items done")


def run_ranks(protocols: list[Protocol], launch: Launch, seed: int, n_launches: int = 2,
              parities: int = 2) -> Stats:
    """Runs every rank's n_launches launches (each rank's back to back, the ranks free to drift)
    under one seeded scheduler; every rank's rows stop at the same steps (the ranks draw the same
    tokens). parities: inbox parities (2 in the kernel; 1 shows the overwrite the second prevents).

    Raises:
        SyncViolation: a Hazard (within a rank or across ranks), Deadlock or CounterReuse.
    """
    rng = random.Random(seed)
    world = _World(protocols, launch.n_steps, parities)
    stops = [[rng.randrange(launch.n_steps + 1) for _ in range(launch.batch)] for _ in range(n_launches)]
    stats = Stats()
    counters = [[0] * (launch.n_steps * len(p.ops) + 1) for p in protocols]
    group_counts: list[dict] = [{} for _ in protocols]
    runs: dict[int, LaunchRun] = {}
    next_launch = [0] * len(protocols)

    def begin(r: int) -> None:
        k = next_launch[r]
        next_launch[r] += 1
        runs[r] = LaunchRun(protocols[r], launch, counters[r], group_counts[r], stops[k], rng, stats, k, True, world, r)
        runs[r].start()

    for r in range(len(protocols)):
        begin(r)
    while runs:
        movable = [(r, w) for r, run in runs.items() for w in run.runnable()]
        if not movable:
            raise Deadlock("ranks deadlock\n" + "\n".join(run.deadlock_report() for run in runs.values()))
        r, w = rng.choices(movable, weights=[runs[q].speed[v] for q, v in movable])[0]
        run = runs[r]
        run.advance(w)
        if not run.gens:  # this rank's launch exited
            if any(counters[r]) or any(group_counts[r].values()):
                raise CounterReuse(f"rank {r} launch {run.index} left counters not zero")
            del runs[r]
            if next_launch[r] < n_launches:
                begin(r)
    return stats
