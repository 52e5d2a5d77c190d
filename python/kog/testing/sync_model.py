"""A discrete-event model of the persistent decode kernel's synchronization protocol
(csrc/gpu/decode/persistent_kernel.cuh, sync.cuh), run under seeded random interleavings.

    protocol = Protocol(tuple(sync_ops(expanded, dims, batch)), tuple(_C.program_sinks(expanded)))
    stats = run_launches(protocol, Launch(grid=7, n_steps=3, batch=batch), seed=0)

Each workgroup is a generator that yields before every action: a wait (it stays blocked until
the counter reaches the target), an item (its reads and writes happen at once, then its data
counts as complete), a signal (counter += 1, once per workgroup and op, after its last item of
the op: the target is min(items, grid)), the flag check at the top of a step > 0, the exit
increment, and the counter zeroing by the last workgroup out. An op with groups
(SyncOp.group_items: attention's items per (sequence, KV head)) also counts each item on its
group's counter; the item that brings it to group_items runs the group's tail (its reads and
writes) and resets the counter, before the item's signal. A seeded scheduler with skewed,
changing per-workgroup speeds picks the next workgroup among the runnable ones. It raises:
  Hazard       an item touched a resource while a program-earlier conflicting access (RAW, WAR
               or WAW, at whole-resource granularity) was not complete;
  Deadlock     no workgroup can move and some have not exited;
  CounterReuse a counter was read after the zeroing, a launch ended with counters not zero, or a
               group counter went past group_items;
  Hazard also  a group's tail ran before every item of its group had run.
Memory ordering is assumed correct (release before each count, acquire after each wait): the
model checks the order the counters impose, not the fences that make it visible.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from kog.testing.sync_program import FINISHED, FLAG_CHECK, SyncOp

RECENT_ACTIONS = 16  # how much of the interleaving a report shows
EXIT = -2  # where a workgroup is once it left the step loop


class SyncViolation(AssertionError):
    """The protocol let something happen that the kernel must never do."""


class Hazard(SyncViolation):
    pass


class Deadlock(SyncViolation):
    pass


class CounterReuse(SyncViolation):
    pass


@dataclass(frozen=True)
class Protocol:
    """What the kernel is told to do; tests break a field to show the model notices."""

    ops: tuple[SyncOp, ...]            # the expanded program, in the order every workgroup walks it
    sinks: tuple[int, ...]             # ops a step > 0 waits for in the previous step (program_sinks)
    target_bonus: Mapping[int, int] = field(default_factory=dict)  # op -> added to its wait target
    zero_at_exit: int | None = None    # exit count whose workgroup zeroes (None: the last, = grid)
    reset_group_counts: bool = True    # whether a group's tail zeroes its group counter
    signal_after_first_item: bool = False  # a broken kernel: a workgroup signals after its first item
    group_target_bonus: Mapping[int, int] = field(default_factory=dict)  # op -> added to its group size
                                       # where an item decides whether it runs the tail
    stage_any_route: bool = False      # a broken kernel: stages expert items without knowing their route


@dataclass(frozen=True)
class Launch:
    grid: int                          # workgroups launched
    n_steps: int
    batch: int
    resident: int | None = None        # workgroups that ever run (None: all; cooperative launch)
    slow: tuple[int, ...] = ()         # workgroups that crawl throughout (e.g. preempted)


@dataclass
class Stats:
    actions: int = 0
    blocked_ticks: int = 0  # scheduler choices made while some workgroup was held by a wait
    split_exits: int = 0    # launches whose workgroups left the step loop after different steps
    staged_expert_items: int = 0  # expert items whose staging's reads were checked (_stage)


def run_launches(protocol: Protocol, launch: Launch, seed: int, n_launches: int = 2,
                 check_flag_reads: bool = True) -> Stats:
    """Runs n_launches launches back to back (stream order: each starts after the last exited)
    on one counter array.

    Args:
        check_flag_reads: whether the step's flag check is hazard-checked like an op; without it
            the check still reads the flags' current values and breaks on them, so a stale or
            early read shows up only through its consequences (a deadlock, counters left set).
    Raises:
        SyncViolation: a Hazard, Deadlock or CounterReuse, the first one met.
    """
    rng = random.Random(seed)
    n_ops = len(protocol.ops)
    counters = [0] * (launch.n_steps * n_ops + 1)  # the last one is exit_count, as in the kernel
    group_counts: dict[tuple[str, int], int] = {}  # (array, group) -> its counter, kept across ops and steps
    stats = Stats()
    for k in range(n_launches):
        # A row stops at a random step (or never); finished flags start clear.
        stop_at = [rng.randrange(launch.n_steps + 1) for _ in range(launch.batch)]
        LaunchRun(protocol, launch, counters, group_counts, stop_at, rng, stats, k, check_flag_reads).run()
        if any(counters):
            raise CounterReuse(f"launch {k} left counters not zero: "
                               f"{[(i, c) for i, c in enumerate(counters) if c][:8]}")
        if any(group_counts.values()):
            raise CounterReuse(f"launch {k} left group counters not zero: "
                               f"{sorted((g, c) for g, c in group_counts.items() if c)[:8]}")
    return stats


class LaunchRun:
    """One launch: workgroup generators, counters and the ground truth of completed items.

    With `world` (kog.testing.sync_ranks), this is rank `rank`'s launch among several: a cross-rank
    finish waits for the world's flags of its channel and step, a push's last item raises them,
    and every item of either half is checked against the other ranks' (world.item)."""

    def __init__(self, protocol: Protocol, launch: Launch, counters: list[int], group_counts: dict[int, int],
                 stop_at: list[int], rng: random.Random, stats: Stats, index: int, check_flag_reads: bool,
                 world=None, rank: int = 0) -> None:
        self.world, self.rank = world, rank
        self.p, self.l, self.counters, self.stop_at, self.rng = protocol, launch, counters, stop_at, rng
        self.group_counts = group_counts
        self.group_done: dict[tuple[int, int, int], int] = {}  # (step, op, group) -> its items that ran
        self.stats, self.index = stats, index
        self.n_ops = len(protocol.ops)
        self.width = self.n_ops + 1  # instance (step, op) -> step * width + op + 1; op -1 = flag check
        self.done = [0] * (launch.n_steps * self.width)
        self.finished = [False] * launch.batch
        self.zeroed = False
        self.where: dict[int, tuple[int, int]] = {}
        self.left_at: set[int] = set()  # how many steps each workgroup ran before leaving
        self.recent: deque = deque(maxlen=RECENT_ACTIONS)
        # op j -> the ops at or after it whose stagings read something (the experts' GEMVs)
        staged = [k for k, o in enumerate(protocol.ops) if o.stage_reads]
        self.staged_from = [[k for k in staged if k >= j] for j in range(self.n_ops)]
        self.conflicts = _conflicts(protocol.ops, check_flag_reads)
        self.conflicts_tail = _conflicts(protocol.ops, check_flag_reads, tails=True)

    # -- the scheduler ------------------------------------------------------------------------
    def run(self) -> None:
        self.start()
        while self.gens:
            runnable = self.runnable()
            if not runnable:
                raise Deadlock(self.deadlock_report())
            self.stats.blocked_ticks += len(runnable) < len(self.gens)
            self.advance(self.rng.choices(runnable, weights=[self.speed[v] for v in runnable])[0])
        self.stats.split_exits += len(self.left_at) > 1

    def start(self) -> None:
        self.resident = self.l.grid if self.l.resident is None else self.l.resident
        self.gens = {w: self._workgroup(w) for w in range(self.resident)}
        self.guards = {w: next(self.gens[w]) for w in self.gens}
        self.speed = {w: self._speed(w) for w in self.gens}

    def runnable(self) -> list[int]:
        return [w for w in self.gens if self._can_pass(w, self.guards[w])]

    def advance(self, w: int) -> None:
        """Workgroup w's next action (it is runnable)."""
        if self.rng.random() < 1 / 32:
            self.speed[w] = self._speed(w)
        self.stats.actions += 1
        try:
            self.guards[w] = next(self.gens[w])
        except StopIteration:
            del self.gens[w], self.guards[w]

    def deadlock_report(self) -> str:
        return self._deadlock_report(self.guards, self.resident)

    def _speed(self, w: int) -> float:
        if w in self.l.slow:
            return 1e-6
        # Heavy-tailed: some workgroups crawl for a while, so others run far ahead of them.
        return self.rng.random() ** 4 + 1e-4

    def _can_pass(self, w: int, guard: tuple[int, int] | None) -> bool:
        if guard is None:
            return True
        if len(guard) == 3:  # ("flags", channel, step): a finish waits for every rank's push
            return self.world.flags_ready(self.rank, guard[1], self.world.epoch(self.index, guard[2]))
        if self.zeroed:
            s, d = divmod(guard[0], self.n_ops)
            raise CounterReuse(f"launch {self.index}: workgroup {w} reads the counter of step {s} {self._name(d)} "
                               f"after the last workgroup out zeroed the counters" + self._trace())
        return self.counters[guard[0]] >= guard[1]

    # -- one workgroup, as persistent_decode_kernel walks the program ---------------------------
    def _workgroup(self, w: int) -> Iterator[tuple[int, int] | None]:
        ops, grid = self.p.ops, self.l.grid
        steps_run = self.l.n_steps
        for step in range(self.l.n_steps):
            if step > 0:
                self.where[w] = (step, FLAG_CHECK)
                for d in self.p.sinks:
                    yield self._wait(step - 1, d)
                yield None
                if self._flag_check(w, step):
                    steps_run = step
                    break  # every sequence finished
            route = -1  # the MoE layer whose route this workgroup has acquired this step
            for j, op in enumerate(ops):
                self.where[w] = (step, j)
                ready = not op.deps and not op.waits_for_ranks
                self._stage(w, step, j, w, route)  # stage_next before the op's wait
                for item in range(w, op.n_items, grid):
                    if not ready:
                        for d in op.deps:
                            yield self._wait(step, d)
                        if op.waits_for_ranks:  # every rank's flag of the channel
                            yield ("flags", op.comm, step)
                        ready = True
                        if op.route_layer >= 0:
                            route = op.route_layer
                    yield None
                    self._stage(w, step, j, item, route)  # this item (if not staged yet) and the next ones
                    self._run_item(w, step, j, item)
                    if op.group_items:
                        yield None
                        if self._count_group(step, j, item):
                            yield None
                            self._run_tail(w, step, j, item)
                    self.done[step * self.width + j + 1] += 1  # the item, tail included, is complete
                    if op.comm >= 0:
                        self.world.completed(self.rank, self.world.epoch(self.index, step), j)
                    if self.p.signal_after_first_item and item == w:
                        yield None
                        self.counters[step * self.n_ops + j] += 1
                if w < op.n_items and not self.p.signal_after_first_item:  # once, after its last item
                    yield None
                    self.counters[step * self.n_ops + j] += 1
        self.left_at.add(steps_run)
        self.where[w] = (self.l.n_steps, EXIT)
        yield None
        self.counters[-1] += 1
        zero_at = self.l.grid if self.p.zero_at_exit is None else self.p.zero_at_exit
        if self.counters[-1] == zero_at:  # the last workgroup out
            yield None
            self.counters[:] = [0] * len(self.counters)
            self.zeroed = True

    def _stage(self, w: int, step: int, j: int, cand: int, route: int) -> None:
        """The staging walk's reads (stage_next from op j, item cand on): over-approximated as
        every item of w's it could stage in this step, up to the first expert GEMV whose route w
        does not know (where the kernel's walk stops). Only expert items' stagings read anything
        a launch writes (the route); a LINEAR's reads only weights."""
        for k in self.staged_from[j]:
            op = self.p.ops[k]
            if op.route_layer != route and not self.p.stage_any_route:
                return
            reads = [c for c in self.conflicts[k] if c[2] == "RAW" and c[1] in op.stage_reads]
            for item in range(cand if k == j else w, op.n_items, self.l.grid):
                self._check(w, step, k, item, reads)
                self.stats.staged_expert_items += 1

    def _wait(self, step: int, d: int) -> tuple[int, int]:
        if not 0 <= d < self.n_ops:
            raise ValueError(f"dep {d} is not an op of the program")
        return step * self.n_ops + d, min(self.p.ops[d].n_items, self.l.grid) + self.p.target_bonus.get(d, 0)

    def _flag_check(self, w: int, step: int) -> bool:
        self._access(w, step, FLAG_CHECK, w)
        return all(self.finished)

    def _run_item(self, w: int, step: int, j: int, item: int) -> None:
        self._access(w, step, j, item)
        op = self.p.ops[j]
        if op.comm >= 0:
            self.world.item(self.rank, self.world.epoch(self.index, step), j, w, item)
        if op.group_items:
            key = (step, j, item // op.group_items)
            self.group_done[key] = self.group_done.get(key, 0) + 1
        if j == self.n_ops - 1 and self.stop_at[item % self.l.batch] == step:
            self.finished[item % self.l.batch] = True  # SAMPLE (the last op) sampled a stop id

    @staticmethod
    def _group(op: SyncOp, item: int) -> tuple[int, int]:
        """(group, its item count) of an item of a grouped op; the last group holds what is left."""
        g = item // op.group_items
        return g, min(op.group_items, op.n_items - g * op.group_items)

    def _count_group(self, step: int, j: int, item: int) -> bool:
        """The item's atomic increment of its group counter; whether it was the group's last."""
        op = self.p.ops[j]
        g, size = self._group(op, item)
        key = (op.group_counter, g)
        self.group_counts[key] = self.group_counts.get(key, 0) + 1
        if self.group_counts[key] > size:
            raise CounterReuse(f"launch {self.index}: step {step} {self._name(j)} item {item}: {op.group_counter}[{g}] "
                               f"is {self.group_counts[key]} > {size} items" + self._trace())
        return self.group_counts[key] == size + self.p.group_target_bonus.get(j, 0)

    def _run_tail(self, w: int, step: int, j: int, item: int) -> None:
        op = self.p.ops[j]
        g, size = self._group(op, item)
        got = self.group_done.get((step, j, g), 0)
        if got < size:
            raise Hazard(f"launch {self.index}: step {step} {self._name(j)} group {g}'s tail ran on workgroup {w} "
                         f"with {got}/{size} of its items done" + self._trace())
        self._check(w, step, j, item, self.conflicts_tail[j])
        if op.comm >= 0 and op.comm_push:  # after every item of the push on this rank
            self.world.raise_flags(self.rank, op.comm, self.world.epoch(self.index, step))
        if self.p.reset_group_counts:
            self.group_counts[(op.group_counter, g)] = 0

    # -- hazards -----------------------------------------------------------------------------
    def _n_items(self, step: int, k: int) -> int:
        if k == FLAG_CHECK:
            return 0 if step == 0 else self.l.grid
        return self.p.ops[k].n_items

    def _access(self, w: int, step: int, k: int, item: int) -> None:
        self.recent.append((w, step, k, item))
        self._check(w, step, k, item, self.conflicts[k])
        if k == FLAG_CHECK:
            self.done[step * self.width + k + 1] += 1  # an op's item counts once complete (_workgroup)

    def _check(self, w: int, step: int, k: int, item: int, conflicts: list[tuple[int, str, str]]) -> None:
        """Hazard unless every program-earlier access that conflicts is complete."""
        for k2, resource, kind in conflicts:
            for s2 in range(step + 1):
                if (s2, k2) >= (step, k):
                    break
                got = self.done[s2 * self.width + k2 + 1]
                if got < self._n_items(s2, k2):
                    raise Hazard(f"launch {self.index}: {kind} on {resource}: step {step} {self._name(k)} item "
                                 f"{item} ran on workgroup {w} while step {s2} {self._name(k2)} had "
                                 f"{got}/{self._n_items(s2, k2)} items done" + self._trace())

    # -- reports -----------------------------------------------------------------------------
    def _name(self, k: int) -> str:
        if k == EXIT:
            return "exit"
        return "flag check" if k == FLAG_CHECK else f"op {k} ({self.p.ops[k].name})"

    def _trace(self) -> str:
        lines = [f"  wg {w} step {s} {self._name(k)} item {i}" for w, s, k, i in self.recent]
        return "\nlast items and flag checks, oldest first:\n" + "\n".join(lines)

    def _deadlock_report(self, guards: dict, resident: int) -> str:
        lines = []
        for w, guard in sorted(guards.items()):
            step, j = self.where[w]
            if guard is not None and len(guard) == 3:
                lines.append(f"  rank {self.rank} wg {w} at step {step} {self._name(j)} waits for the flags of "
                             f"channel {guard[1]}, step {guard[2]}")
                continue
            c, target = guard
            ws, wd = divmod(c, self.n_ops)
            lines.append(f"  wg {w} at step {step} {self._name(j)} waits for step {ws} "
                         f"{self._name(wd)}: counter {self.counters[c]} < {target}")
        never = f"; workgroups {resident}..{self.l.grid - 1} never started" if resident < self.l.grid else ""
        return f"launch {self.index}: deadlock{never}\n" + "\n".join(lines)


def _conflicts(ops: tuple[SyncOp, ...], check_flag_reads: bool,
               tails: bool = False) -> dict[int, list[tuple[int, str, str]]]:
    """op k -> (k2, resource, kind) for every op k2 whose access to resource conflicts with k's
    (at least one writes). An op's access is its items' and its tails' together (an item is
    complete once its tail, if it ran one, is); with tails=True, k's side is its tail's access
    alone. The flag check (FLAG_CHECK) reads `finished`, or nothing when its reads are not checked."""
    access = {FLAG_CHECK: (frozenset({FINISHED} if check_flag_reads else ()), frozenset())}
    access |= {k: (o.reads | o.tail_reads, o.writes | o.tail_writes) for k, o in enumerate(ops)}
    mine = dict(access)
    if tails:
        mine |= {k: (o.tail_reads, o.tail_writes) for k, o in enumerate(ops)}
    out: dict[int, list[tuple[int, str, str]]] = {k: [] for k in access}
    for k, (reads, writes) in mine.items():
        for k2, (reads2, writes2) in access.items():
            for r in sorted(reads & writes2):
                out[k].append((k2, r, "RAW"))
            for r in sorted(writes & reads2):
                out[k].append((k2, r, "WAR"))
            for r in sorted(writes & writes2):
                out[k].append((k2, r, "WAW"))
    return out
