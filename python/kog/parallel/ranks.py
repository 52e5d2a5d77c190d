"""Tensor-parallel ranks as processes: rank 0 runs the engine, ranks 1 .. N-1 mirror its calls.

    runner = start_ranks(model, dtype, size, num_kv_blocks, block_size)   # in rank 0's process
    LLMEngine(runner, ...)                                                 # what a ModelRunner is
    runner.close()

Each rank loads the model, keeps its shard (kog.parallel.shard) and owns the KV cache of its KV
heads. Rank 0's ParallelRunner sends every call that touches the model or the cache (prefill,
verify, decode, KV moves) to the other ranks, in order, over a command group, then makes the
call itself; the calls' collectives run over the data group, whose timeout bounds every one of
them. The command group waits without a timeout (a server may sit idle), but a rank whose peer
dies sees its connection close and exits; a rank that hangs makes rank 0's next collective
fail with TransportError after the timeout. Ranks 1 .. N-1 are started with `python -m
kog.parallel.worker` on this host (loopback), or by torchrun / any launcher that runs that
module with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.

On GPUs (RankSpec.device "cuda") rank r runs on its host's GPU r % ranks per host; the
collectives outside the decode kernel go over an NCCL (RCCL) group, and decode runs in every
rank's persistent kernel, rank 0's launches mirrored by MirroredGpuDecoder (docs/GPU.md).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch

from kog import _C
from kog.config import ModelConfig
from kog.engine.decode_loop import CpuLoop
from kog.errors import InvalidRequest
from kog.parallel.shard import lane_form, shard_config, shard_weights
from kog.parallel.transport import ShmRankTransport, TorchDistTransport, TransportError

# Seconds a collective may wait for the slowest rank before it fails (TransportError).
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its runner: the same on every rank."""

    model: str | None
    dtype: str | None
    size: int
    num_kv_blocks: int
    block_size: int
    num_host_blocks: int
    max_rows: int = 32           # the largest decode batch (sizes the shared-memory transport)
    shm_name: str | None = None  # the ranks' shared-memory segment (one host, CPU); None: no segment
    device: str = "cpu"          # "cpu", or "cuda": rank r runs on its host's GPU r % (size / nnodes)
    nnodes: int = 1              # hosts; each runs size / nnodes consecutive ranks
    kv_cache_dtype: str | None = None  # the KV cache's dtype name ("float16"); None: the run dtype


def rank_device(spec: RankSpec, rank: int) -> str:
    """Where rank `rank` runs: the CPU, or its host's GPU (local rank = rank % ranks per host;
    CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES pick which GPUs a host lends)."""
    if spec.device == "cpu":
        return "cpu"
    return f"cuda:{rank % (spec.size // spec.nnodes)}"


@dataclass(frozen=True)
class PlainMoves:
    """A KVMoves as plain arrays, to send to the other ranks."""

    swap_out: np.ndarray
    swap_in: np.ndarray
    cow: np.ndarray


def rank_view(rank: int, size: int) -> Callable[[ModelConfig], ModelConfig]:
    """full config -> rank `rank` of `size`'s view (its lane form's shard): load_model's `shard`."""
    def view(config: ModelConfig) -> ModelConfig:
        return shard_config(lane_form(config, size) if config.lanes is None else config, rank, size)

    return view


def build_rank_runner(spec: RankSpec, rank: int, transport, loaded=None, commands=None):
    """This rank's ModelRunner: the model loaded as the rank's share (only its part of each
    tensor read), or `loaded`: the rank's share already loaded (kog.LLM's rank 0), or the whole
    model, cut here.

    On GPUs (spec.device "cuda", a collective: every rank calls it in the same order) the
    program's collectives go through an NCCL group (RCCL on ROCm: the same backend name), and
    where the persistent kernel runs the rank's program its inbox and flags are exchanged over
    `commands` (kog.parallel.gpu_peers): decode then runs in every rank's kernel, its
    collectives peer-memory stores."""
    from kog.loader import load_model
    from kog.models.runner import ModelRunner

    view = rank_view(rank, spec.size)
    device = rank_device(spec, rank)
    if device != "cpu":
        transport = gpu_transport(device)
    if loaded is None:
        from kog.fp8 import gpu_format

        model = load_model(spec.model, spec.dtype, shard=view, device=device,
                           fp8_format=gpu_format() if device != "cpu" else None)
    elif loaded.config.shard.size == spec.size:
        model = loaded
    else:
        local = view(loaded.config)
        model = dataclasses.replace(loaded, config=local, weights=shard_weights(local, loaded.weights))
    if spec.shm_name is not None:  # ranks on one host: shared memory for prefill and native decode
        transport = shm_transport(spec, model.config, rank)
    runner = ModelRunner(model, num_kv_blocks=spec.num_kv_blocks, block_size=spec.block_size,
                         num_host_blocks=spec.num_host_blocks, device=device, transport=transport,
                         kv_cache_dtype=getattr(torch, spec.kv_cache_dtype) if spec.kv_cache_dtype else None)
    if device != "cpu" and runner.native_decoder is not None:
        from kog.parallel.gpu_peers import connect_gpu_ranks

        # NOTE: the runner keeps the segment: it owns the mappings the kernel stores into
        runner.peer_segment = connect_gpu_ranks(runner.native_decoder, rank, spec.size, group=commands)
    return runner, model


def gpu_transport(device: str) -> TorchDistTransport:
    """This rank's GPU on the current device and a new NCCL group over every rank (a collective),
    bounded by the collective timeout (torch's NCCL watchdog aborts a rank whose collective
    outlives it)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(device)
    return TorchDistTransport(dist.new_group(backend="nccl", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)))


def shm_transport(spec: RankSpec, local, rank: int) -> ShmRankTransport:
    """This rank's end of the host's shared-memory segment, sized for the model's collectives:
    all-reduces of [rows, hidden] (and of logits, in pieces), gathers of [rows, lanes, hidden]."""
    lanes, h = local.lanes, local.hidden_size
    elem = 2 if spec.dtype in ("bfloat16", "float16", "half", "bf16", "fp16", "f16") else 4
    return ShmRankTransport(spec.shm_name, rank, spec.size, reduce_floats=min(1 << 20, spec.max_rows * max(
        h, local.vocab_size)), n_slots=2 * lanes.hist_slots_per_kind, slot_bytes=spec.max_rows * lanes.num_lanes * h * elem,
        timeout_s=COLLECTIVE_TIMEOUT_S)


def init_groups(rank: int, size: int, addr: str, port: int):
    """The data group (the default group, collective timeout) and the command group (no
    practical timeout: a server may be idle for days)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    commands = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    return TorchDistTransport(), commands


class _MirroredKV:
    """Rank 0's KV storage: apply() is sent to every rank first; the rest is the local one's."""

    def __init__(self, kv, parent: ParallelRunner) -> None:
        self._kv, self._parent = kv, parent

    def apply(self, moves) -> None:
        plain = PlainMoves(*(np.array(getattr(moves, n)) for n in ("swap_out", "swap_in", "cow")))
        self._parent.send("kv_apply", plain)
        self._kv.apply(plain)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


class ParallelRunner:
    """Rank 0's runner: the ModelRunner interface, each call mirrored on every rank."""

    def __init__(self, local, commands, procs: list[subprocess.Popen]) -> None:
        self.local, self._commands, self._procs = local, commands, procs
        self.kv = _MirroredKV(local.kv, self)
        # Rank 0's executor (None where decode goes through the interpreter: ranks over several
        # hosts, or a GPU program the kernel does not run); the engine's multi-token loop over a
        # CPU executor is a MirroredLoop (native_loop), over a GpuDecoder a MirroredGpuDecoder.
        decoder = local.native_decoder
        gpu = decoder is not None and not isinstance(decoder, _C.DecodeExecutor)
        self.native_decoder = MirroredGpuDecoder(self, decoder) if gpu else decoder
        self._closed = False
        atexit.register(self.close)

    def __getattr__(self, name: str) -> Any:  # block_size, vocab_size, config, weights, ...
        return getattr(self.local, name)

    def send(self, name: str, *args: Any) -> None:
        import torch.distributed as dist

        if self._closed:
            raise InvalidRequest("the tensor-parallel ranks are closed")
        try:
            dist.broadcast_object_list([(name, args)], src=0, group=self._commands)
        except RuntimeError as e:
            raise TransportError(f"rank 0: sending {name!r} to the other ranks failed: {e}") from None

    def prefill(self, chunks, all_logits: bool = False):
        self.send("prefill", chunks, all_logits)
        return self.local.prefill(chunks, all_logits)

    def verify(self, chunks):
        self.send("verify", chunks)
        return self.local.verify(chunks)

    def decode(self, tokens, positions, block_tables, seq_lens, slots, sampled: np.ndarray | None = None):
        args = tuple(np.ascontiguousarray(a) for a in (tokens, positions, block_tables, seq_lens, slots))
        self.send("decode", *args)
        return self.local.decode(*args, sampled)

    def native_loop(self, sampler) -> MirroredLoop:
        """The engine's K-steps-per-call decode loop (kog.engine.decode_loop), run on every rank."""
        return MirroredLoop(self, sampler)

    def close(self) -> None:
        """Stops the other ranks (their processes exit) and leaves the groups."""
        if self._closed:
            return
        import torch.distributed as dist

        try:
            self.send("stop")
        except Exception:  # noqa: BLE001 - a dead rank: nothing left to stop
            pass
        self._closed = True
        for p in self._procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


class MirroredLoop(CpuLoop):
    """Rank 0's decode loop: each call is sent to the other ranks first, which run the same loop
    on their shards over sampling states equal to rank 0's (LoopFollower), so every rank samples
    the same tokens (the program's gathers leave bit-identical logits on every rank) and stops
    the same rows at the same step: their collectives stay in step.

    A row's state travels once (its SequenceSampling arguments, kog.engine.decode_loop.
    NativeSampler.origin, with the prompt's ids where a repetition penalty counts them), then
    only the outputs it gained outside the loop (the first token, one-step decodes): a later
    call costs the other ranks O(new tokens), not O(context).
    """

    def __init__(self, parent: ParallelRunner, sampler) -> None:
        super().__init__(parent.local.native_decoder, parent.vocab_size, parent.block_size)
        self._parent, self._sampler = parent, sampler
        self._synced: dict[int, int] = {}  # state key -> outputs the other ranks' copy counted (last call's rows)

    def run(self, seqs, states, tokens, positions, block_tables, k):
        rows = []
        for seq, st in zip(seqs, states):
            key, args = self._sampler.origin(seq)
            have = self._synced.get(key)
            first = seq.num_prompt_tokens + (have or 0)
            new = np.asarray(seq.token_ids[first:seq.num_prompt_tokens + st.n_output], dtype=np.int32)
            rows.append((key, None if have is not None else args, new, st.n_output))
        self._synced = {}  # a failed call leaves the other ranks' states unknown: rebuilt next time
        self._parent.send("loop", rows, tokens, positions, block_tables, k)
        out = super().run(seqs, states, tokens, positions, block_tables, k)
        self._synced = {row[0]: st.n_output for row, st in zip(rows, states)}
        return out


class MirroredGpuDecoder:
    """Rank 0's GpuDecoder for the engine's decode loop: each launch is staged (checked) here, sent
    to the other ranks, then launched; they launch their kernels with the same arguments
    (sampling rows, seeds, stop ids):
    the kernels exchange the collectives through each other's inboxes and, from bit-identical
    gathered logits, draw the same tokens (kog.parallel.gpu_peers)."""

    def __init__(self, parent: ParallelRunner, decoder) -> None:
        self._parent, self._decoder = parent, decoder

    def decode(self, *args: Any):
        # NOTE: staged (checked) first: a call rank 0 refuses reaches no rank, whose kernel would
        # otherwise wait for rank 0's pushes until the watchdog traps it
        staged = self._decoder.stage(*args)
        self._parent.send("gpu_decode", *args)
        self._decoder.launch(staged)
        return staged.result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._decoder, name)


def follow_gpu_decode(runner, args) -> None:
    """Ranks 1 .. N-1's side of MirroredGpuDecoder: the same launch, waited for, so that a
    kernel whose dependency wait outlived the watchdog fails this rank (and so rank 0's next
    collective) with the wait's place rather than a later, unrelated error."""
    import torch

    decoder = runner.native_decoder
    decoder.decode(*args)
    torch.cuda.synchronize(decoder.device)
    if (where := decoder.wait_timeout()) is not None:
        raise TransportError(f"GPU decode: a rank's kernel waited past the watchdog at {where}")


class LoopFollower:
    """Ranks 1 .. N-1's side of MirroredLoop: the rows' states (kept from one call to the next,
    those of rows absent from a call dropped), and the same native loop on the rank's executor."""

    def __init__(self, runner) -> None:
        self._loop = CpuLoop(runner.native_decoder, runner.vocab_size, runner.block_size)
        self._states: dict[int, Any] = {}

    def run(self, rows, tokens, positions, block_tables, k) -> None:
        states = {}
        for key, args, new, n_output in rows:
            st = _C.SequenceSampling(*args) if args is not None else self._states[key]
            if len(new):
                st.add_outputs(new)
            if st.n_output != n_output:  # a broken invariant: this rank's loop would draw other tokens
                raise TransportError(f"decode loop: this rank's sampling state {key} counted {st.n_output} "
                                     f"outputs, rank 0's {n_output}")
            states[key] = st
        self._states = states
        self._loop.run(None, list(states.values()), tokens, positions, block_tables, k)


@dataclass(frozen=True)
class Placement:
    """Where the ranks run: `nnodes` hosts with size / nnodes ranks each; host `node_rank` holds
    ranks node_rank * per_node ..; rank 0 (the engine) is on host 0 and hosts the rendezvous at
    master_addr:master_port (torchrun's MASTER_ADDR / MASTER_PORT; SGLang's --nnodes/--node-rank)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port on this host (one host only)

    def local_ranks(self, size: int) -> range:
        if self.nnodes < 1 or size % self.nnodes or not 0 <= self.node_rank < self.nnodes:
            raise InvalidRequest(f"--nnodes {self.nnodes} must divide tensor_parallel_size {size} "
                                 f"and --node-rank {self.node_rank} be in [0, {self.nnodes})")
        per = size // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)


def start_ranks(spec: RankSpec, loaded=None, placement: Placement = Placement()) -> ParallelRunner:
    """Rank 0 in this process (with `loaded`, the model rank 0 already loaded, if given), this
    host's other ranks as worker processes; the other hosts' ranks join the rendezvous on their
    own (run_node). Ranks on one host share memory for the data path; over several hosts every
    collective goes through gloo (and decode through the interpreter)."""
    if placement.node_rank != 0:
        raise InvalidRequest("the engine (rank 0) runs on --node-rank 0; other hosts run their ranks only")
    if loaded is not None and loaded.config.shard.size == 1:  # a bad split fails here, before any process starts
        rank_view(0, spec.size)(loaded.config)
    addr, port = placement.master_addr, placement.master_port or _free_port()
    one_host_cpu = placement.nnodes == 1 and spec.device == "cpu"
    spec = dataclasses.replace(spec, shm_name=f"/kog-tp-{os.getpid()}-{port}" if one_host_cpu else None,
                               nnodes=placement.nnodes)
    check_devices(spec.device, spec.size, placement)
    procs = _spawn(placement.local_ranks(spec.size)[1:], spec.size, addr, port)
    try:
        transport, commands = init_groups(0, spec.size, addr, port)
        import torch.distributed as dist

        dist.broadcast_object_list([spec], src=0, group=commands)  # every rank builds what rank 0 builds
        local, _ = build_rank_runner(spec, 0, transport, loaded, commands)
    except BaseException:
        for p in procs:
            p.kill()
        import torch.distributed as dist

        if dist.is_initialized():  # a later LLM in this process starts its own groups
            dist.destroy_process_group()
        raise
    return ParallelRunner(local, commands, procs)


def check_devices(device: str, size: int, placement: Placement) -> None:
    """Refuses, before any rank starts (or any weight is read), a device this host cannot give
    every one of its `size` / nnodes ranks."""
    if device == "cpu":
        return
    if device != "cuda":
        raise InvalidRequest(f"tensor_parallel_size > 1 takes device 'cpu' or 'cuda' (rank r on its host's GPU "
                             f"r % ranks per host; pick the GPUs with CUDA_VISIBLE_DEVICES), got {device!r}")
    import torch

    per_host = len(placement.local_ranks(size))
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < per_host:
        raise InvalidRequest(f"tensor_parallel_size {size} over {placement.nnodes} host(s) puts {per_host} ranks "
                             f"on this host, one GPU each, and it has {have}")


def run_node(size: int, placement: Placement) -> int:
    """A host other than the engine's: runs its ranks until rank 0 stops them; the exit status
    of the first that failed (0 when all stopped cleanly)."""
    if placement.master_port is None:
        raise InvalidRequest("a host other than the engine's needs the rendezvous port (--master-port)")
    procs = _spawn(placement.local_ranks(size), size, placement.master_addr, placement.master_port)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def _spawn(ranks, size: int, addr: str, port: int) -> list[subprocess.Popen]:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in [_package_root(), os.environ.get("PYTHONPATH")] if p)}
    return [subprocess.Popen([sys.executable, "-m", "kog.parallel.worker", "--rank", str(r), "--size", str(size),
                              "--addr", addr, "--port", str(port)], env=env) for r in ranks]


def serve_rank(rank: int, size: int, addr: str, port: int) -> None:
    """A worker rank's life: join the groups, receive rank 0's RankSpec, build the runner, run
    rank 0's calls until "stop"."""
    import torch.distributed as dist

    transport, commands = init_groups(rank, size, addr, port)
    box = [None]
    dist.broadcast_object_list(box, src=0, group=commands)
    runner, _ = build_rank_runner(box[0], rank, transport, commands=commands)
    follower = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=commands)
        name, args = box[0]
        if name == "stop":
            break
        if name == "kv_apply":
            runner.kv.apply(args[0])
        elif name == "loop":
            follower = follower or LoopFollower(runner)
            follower.run(*args)
        elif name == "gpu_decode":
            follow_gpu_decode(runner, args)
        else:
            getattr(runner, name)(*args)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _package_root() -> str:
    import kog

    return os.path.dirname(os.path.dirname(os.path.abspath(kog.__file__)))
