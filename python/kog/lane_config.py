"""Laneformer's lane layout (HF `model_type: "laneformer_tp"`), as the model program needs it.

With L = num_lanes, the residual stream is kept per lane ([tokens, L, hidden]). After each
layer's attention and MLP, the lane outputs a_l are combined by one of three reductions
(`reduce_mode`):

    "scale"  a_l * sqrt(L)                          (no communication)
    "sum"    sum over lanes, in every lane          (an all-reduce across lane ranks)
    "past"   a_l + sum_{l' != l} a_{l'} of layer i - broadcast_delay
                                                    (an all-gather issued broadcast_delay layers earlier)

as `LaneformerTPModel` builds its layers: layers below broadcast_delay "sum" with
use_early_comm, else "scale"; later layers "past" with use_comm, else "scale". A delay of 0
with use_comm makes every layer "sum" (the past of layer i - 0 is the present; the reference
code indexes past the list there).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from kog.errors import ModelLoadError

ReduceMode = Literal["scale", "sum", "past"]
LM_HEAD_TYPES = ("replicate", "lane", "vocab_parallel")


@dataclasses.dataclass(frozen=True)
class LaneShard:
    """Rank `rank` of `size` tensor-parallel ranks: it holds lanes [rank L / size, (rank + 1) L / size)
    of the model's L lanes (kog.parallel.shard). size 1: the whole model, no communication."""

    rank: int = 0
    size: int = 1


@dataclasses.dataclass(frozen=True)
class LaneConfig:
    num_lanes: int
    broadcast_delay: int = 1
    use_comm: bool = True
    use_early_comm: bool = True
    lm_head_type: str = "replicate"      # "replicate": mean of the normed lanes, [vocab, hidden] head;
                                         # "lane": lanes concatenated, [vocab, L hidden] head;
                                         # "vocab_parallel": lane l computes vocab rows l V/L ...
    pre_norm_lane_agg: bool = False      # sum the lanes before the final norm (replicate head only)
    replicated_rmsn_scale: bool = True   # one [hidden] norm weight for every lane, else [L, hidden]
    sliding_window_n_layers: int = 0     # > 0: the first n layers are windowed; < 0: the last -n
    unclamped_layers: tuple[int, ...] = ()  # layers that keep full attention whatever the above says
    # A dense model's lane form with fewer KV heads than lanes (kog.parallel.shard.lane_form): the
    # stored k/v projections hold num_key_value_heads / kv_repeat heads, each used by kv_repeat
    # consecutive lanes (replicated: one KV head per lane). 1 everywhere else (not an HF field).
    kv_repeat: int = 1

    def check(self, n_layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, tied: bool,
              source: str = "config.json") -> None:
        """ModelLoadError naming the field of a layout Kog cannot run (or the reference rejects)."""
        L = self.num_lanes
        if L < 1:
            raise ModelLoadError(f"{source}: num_lanes={L} must be >= 1")
        for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("intermediate_size", intermediate)):
            if n % L:
                raise ModelLoadError(f"{source}: {name}={n} is not a multiple of num_lanes={L}")
        if self.broadcast_delay < 0:
            raise ModelLoadError(f"{source}: broadcast_delay={self.broadcast_delay} must be >= 0")
        if self.lm_head_type not in LM_HEAD_TYPES:
            raise ModelLoadError(f"{source}: lm_head_type={self.lm_head_type!r}; Kog knows {list(LM_HEAD_TYPES)}")
        if self.pre_norm_lane_agg and self.lm_head_type != "replicate":
            raise ModelLoadError(f"{source}: pre_norm_lane_agg needs lm_head_type='replicate', "
                                 f"got {self.lm_head_type!r}")
        if self.lm_head_type == "vocab_parallel" and vocab % L:
            raise ModelLoadError(f"{source}: vocab_size={vocab} is not a multiple of num_lanes={L} "
                                 f"(lm_head_type 'vocab_parallel')")
        if tied and self.lm_head_type != "replicate":
            raise ModelLoadError(f"{source}: tie_word_embeddings needs lm_head_type='replicate', "
                                 f"got {self.lm_head_type!r}")
        bad = [i for i in self.unclamped_layers if not 0 <= i < n_layers]
        if bad:
            raise ModelLoadError(f"{source}: unclamped_layers names layer {bad[0]} outside [0, {n_layers})")

    def reduce_mode(self, layer: int) -> ReduceMode:
        """How layer `layer` combines its lanes' attention and MLP outputs."""
        if layer < self.broadcast_delay or (self.use_comm and self.broadcast_delay == 0):
            return "sum" if self.use_early_comm or self.broadcast_delay == 0 else "scale"
        return "past" if self.use_comm else "scale"

    def keeps_output(self, layer: int, n_layers: int) -> bool:
        """True when a later layer (layer + broadcast_delay) reduces with this layer's outputs."""
        later = layer + self.broadcast_delay
        return self.broadcast_delay > 0 and later < n_layers and self.reduce_mode(later) == "past"

    @property
    def hist_slots_per_kind(self) -> int:
        """Ring slots of kept outputs per kind (attention, MLP): 2 delay + 2. One process needs
        delay + 1 (layer i's output lives until layer i + delay reads it); ranks that run ahead
        of each other need 2 delay + 2: a rank keeping layer j's output has read layer
        j - 1 - delay's, so every other rank kept that one and may still read layers from
        j - 1 - 2 delay on (csrc/engine/shm_transport.h). One program for both."""
        return 2 * self.broadcast_delay + 2 if self.use_comm and self.broadcast_delay > 0 else 0

    def hist_slot(self, kind: int, layer: int) -> int:
        """LANE_HIST slot of layer's kept output; kind 0 attention, 1 MLP."""
        return kind * self.hist_slots_per_kind + layer % self.hist_slots_per_kind

    def windowed(self, layer: int, n_layers: int) -> bool:
        """True when layer attends through the sliding window (the reference's mask choice)."""
        n = self.sliding_window_n_layers
        if layer in self.unclamped_layers:
            return False
        return layer < n or layer >= n_layers + n

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> LaneConfig:
        return cls(num_lanes=int(d.get("num_lanes", 1)), broadcast_delay=int(d.get("broadcast_delay", 1)),
                   use_comm=bool(d.get("use_comm", True)), use_early_comm=bool(d.get("use_early_comm", True)),
                   lm_head_type=str(d.get("lm_head_type", "replicate")),
                   pre_norm_lane_agg=bool(d.get("pre_norm_lane_agg", False)),
                   replicated_rmsn_scale=bool(d.get("replicated_rmsn_scale", True)),
                   sliding_window_n_layers=int(d.get("sliding_window_n_layers", 0)),
                   unclamped_layers=tuple(int(i) for i in d.get("unclamped_layers") or ()))

    def to_hf(self) -> dict[str, Any]:
        d = dataclasses.asdict(self) | {"unclamped_layers": list(self.unclamped_layers)}
        del d["kv_repeat"]
        return d
