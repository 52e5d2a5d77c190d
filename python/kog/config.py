"""Model configuration: one dataclass for every Llama-family model Kog runs.

Built from a Hugging Face `config.json` (transformers 4 or 5 layout) or, through
`kog.loader.gguf`, from GGUF metadata. The runner reads only this object; it never looks at
the raw JSON again.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from kog.errors import ModelLoadError
from kog.lane_config import LaneConfig, LaneShard

# HF `model_type` -> (family, HF architecture class). Families differ only in switches below:
# Qwen2 has a bias on q/k/v, Qwen3 an RMSNorm on each head of q and k; the rest is Llama.
# Qwen3-MoE, Qwen2-MoE and Mixtral replace the MLP of some (all) layers by routed experts;
# Qwen2-MoE adds a shared expert every token runs, gated by a sigmoid.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "laneformer_tp": "LaneformerTPForCausalLM",
}
# Families with lanes: Laneformer's own, and the tensor-parallel lane form of the others
# (kog.parallel.shard.lane_form: each lane a shard of the heads and MLP units, summed after
# every block; an MoE family's experts placed on the ranks, one lane per rank).
LANE_ARCHITECTURES = ("laneformer_tp", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")
# Families whose MLP is (in some layers) a routed mixture of experts.
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe")
_FAMILY_OF_CLASS = {cls: family for family, cls in ARCHITECTURES.items()}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    `rope_scaling` is None for plain RoPE, else a dict with at least `rope_type`
    (e.g. {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}).
    """

    architecture: str  # family: "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3_moe" | "mixtral" | "qwen2_moe"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"  # dtype the checkpoint was published in
    # Mixture of experts (0 / () in a dense model): the layers in moe_layers replace the MLP by
    # num_experts experts of width moe_intermediate_size, num_experts_per_tok of them per token,
    # weighted by the router's softmax over all experts (renormalized over the chosen ones with
    # norm_topk_prob). The other layers keep the dense MLP of width intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # qwen2_moe: the shared expert's width (0: none)
    # Laneformer (laneformer_tp): the lane layout (kog.lane_config); None for every other family.
    # With a shard, this config is one tensor-parallel rank's view (kog.parallel.shard): heads,
    # intermediate and lanes are the rank's share, lanes.num_lanes its local lanes.
    lanes: LaneConfig | None = None
    shard: LaneShard = LaneShard()

    @property
    def hf_architecture(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one KV head (GQA); 1 for plain multi-head attention."""
        return self.num_attention_heads // self.num_key_value_heads

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelLoadError(f"unknown architecture {self.architecture!r}; Kog knows {sorted(ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.torch_dtype not in _DTYPES:
            raise ModelLoadError(f"unsupported torch_dtype {self.torch_dtype!r}")
        self.eos_token_ids = tuple(int(i) for i in self.eos_token_ids)
        self.moe_layers = tuple(int(i) for i in self.moe_layers)
        self._check_moe()
        if self.architecture == "laneformer_tp" and self.lanes is None:
            raise ModelLoadError("laneformer_tp needs a lane layout (num_lanes, broadcast_delay, ...)")
        if self.lanes is not None and self.architecture not in LANE_ARCHITECTURES:
            raise ModelLoadError(f"lanes={self.lanes}: {self.architecture} has no lane form "
                                 f"(lane models: {list(LANE_ARCHITECTURES)})")
        if self.lanes is not None and self.architecture != "laneformer_tp" and (
                self.lanes.broadcast_delay or not self.lanes.use_comm or not self.lanes.replicated_rmsn_scale):
            raise ModelLoadError(f"lanes={self.lanes}: the lane form of a {self.architecture} model sums its lanes "
                                 f"after every block (broadcast_delay 0, use_comm, replicated norms)")
        if self.lanes is not None:
            self.lanes.check(self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads,
                             self.intermediate_size, self.vocab_size, self.tie_word_embeddings)

    def _check_moe(self) -> None:
        """ModelLoadError naming the field of an inconsistent mixture-of-experts config."""
        if self.architecture not in MOE_ARCHITECTURES:
            if self.num_experts or self.moe_layers:
                raise ModelLoadError(f"num_experts={self.num_experts}: {self.architecture} is not a mixture-of-experts family")
            return
        if self.num_experts < 1:
            raise ModelLoadError(f"num_experts={self.num_experts}: a {self.architecture} model needs >= 1 expert")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                                 f"{self.num_experts}]")
        if self.moe_layers and self.moe_intermediate_size < 1:
            raise ModelLoadError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        if (self.architecture == "qwen2_moe") != (self.shared_expert_intermediate_size > 0):
            raise ModelLoadError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size}: "
                                 f"{'needs' if self.architecture == 'qwen2_moe' else 'has no'} a shared expert "
                                 f"for {self.architecture}")
        if self.architecture == "mixtral" and self.moe_intermediate_size != self.intermediate_size:
            raise ModelLoadError(f"moe_intermediate_size={self.moe_intermediate_size}: Mixtral's experts are "
                                 f"intermediate_size={self.intermediate_size} wide")
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if bad or len(set(self.moe_layers)) != len(self.moe_layers):
            raise ModelLoadError(f"moe_layers={list(self.moe_layers)}: layers must be distinct and in "
                                 f"[0, num_hidden_layers={self.num_hidden_layers})")

    @property
    def is_moe(self) -> bool:
        """True when some layer's MLP is a mixture of experts."""
        return bool(self.moe_layers)

    @property
    def shared_expert_slots(self) -> int:
        """Slices of moe_intermediate_size the shared expert runs as (its width rounded up):
        always-on experts after the routed ones (kog.models.weights)."""
        return -(-self.shared_expert_intermediate_size // max(1, self.moe_intermediate_size))

    # ------------------------------------------------------------------ HF config.json

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Builds a config from the dict of a Hugging Face `config.json`.

        Args:
            d: the parsed JSON.
            source: file name quoted in errors.
        Returns:
            The config.
        Raises:
            ModelLoadError: unknown architecture, or a required key is missing.
        """
        family = _family_from_hf(d, source)
        lanes = LaneConfig.from_hf(d) if family == "laneformer_tp" else None
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            theta, scaling = _rope_from_hf(d)
            eos = d.get("eos_token_id")
            return cls(
                architecture=family,
                hidden_size=hidden,
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                intermediate_size=int(d["intermediate_size"]),
                vocab_size=int(d["vocab_size"]),
                rms_norm_eps=float(d.get("norm_eps", 1e-5) if lanes else d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("qkv_bias", True) if family == "qwen2_moe" else
                                    d.get("attention_bias", family == "qwen2")),
                qk_norm=family in ("qwen3", "qwen3_moe"),
                sliding_window=_sliding_window(d),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
                torch_dtype=_dtype_name(d.get("dtype") or d.get("torch_dtype") or "float32"),
                lanes=lanes,
                **_moe_from_hf(d, family, int(d["num_hidden_layers"]), source),
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing key {e.args[0]!r}") from None

    @classmethod
    def from_hf_file(cls, path: str | Path) -> ModelConfig:
        """Reads `config.json` (or the `config.json` inside a folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read config: {e}") from None
        return cls.from_hf_dict(d, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` dict transformers reads back into the same model."""
        d: dict[str, Any] = {
            "architectures": [self.hf_architecture],
            "model_type": self.architecture,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else
            (self.eos_token_ids[0] if self.eos_token_ids else None),
            "torch_dtype": self.torch_dtype,
        }
        if self.architecture == "llama":
            d |= {"attention_bias": self.attention_bias, "mlp_bias": False}
        if self.architecture in ("mistral", "qwen2", "qwen3"):
            d["sliding_window"] = self.sliding_window
        if self.architecture in ("qwen3", "qwen3_moe"):
            d["attention_bias"] = False
        if self.architecture == "qwen2_moe":
            d |= {"qkv_bias": self.attention_bias, "shared_expert_intermediate_size": self.shared_expert_intermediate_size}
        if self.architecture in ("qwen3_moe", "qwen2_moe"):
            d |= {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                  "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                  "decoder_sparse_step": 1,
                  "mlp_only_layers": [i for i in range(self.num_hidden_layers) if i not in self.moe_layers]}
        if self.architecture == "mixtral":
            d |= {"num_local_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                  "sliding_window": self.sliding_window}
        if self.architecture == "laneformer_tp":  # LaneformerTPConfig's names: norm_eps, no head_dim (hidden / heads)
            d |= {"norm_eps": d.pop("rms_norm_eps"), "sliding_window": self.sliding_window} | self.lanes.to_hf()
            del d["head_dim"]
        return d


# ---------------------------------------------------------------------- internal helpers


def _family_from_hf(d: dict[str, Any], source: str) -> str:
    model_type = d.get("model_type")
    if model_type in ARCHITECTURES:
        return model_type
    for cls in d.get("architectures") or []:
        if cls in _FAMILY_OF_CLASS:
            return _FAMILY_OF_CLASS[cls]
    name = model_type or (d.get("architectures") or ["<none>"])[0]
    raise ModelLoadError(f"{source}: unknown architecture {name!r}; Kog knows {sorted(ARCHITECTURES)}")


def _moe_from_hf(d: dict[str, Any], family: str, n_layers: int, source: str) -> dict[str, Any]:
    """The MoE fields of a qwen3_moe / mixtral config.json ({} for a dense family).

    qwen3_moe: layer i is sparse when i is not in mlp_only_layers and (i + 1) is a multiple of
    decoder_sparse_step (transformers' rule); mixtral: every layer, experts as wide as
    intermediate_size, weights always renormalized over the chosen experts.
    """
    if family not in MOE_ARCHITECTURES:
        return {}
    experts = d.get("num_experts", d.get("num_local_experts"))
    if experts is None:
        raise ModelLoadError(f"{source}: missing key 'num_experts' (or 'num_local_experts')")
    experts, top_k = int(experts), int(d.get("num_experts_per_tok", 2))
    if family == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(d["intermediate_size"]),
                    norm_topk_prob=True, moe_layers=tuple(range(n_layers)) if experts > 0 else ())
    shared = {}
    if family == "qwen2_moe":
        shared = dict(shared_expert_intermediate_size=int(d["shared_expert_intermediate_size"]))
    step = int(d.get("decoder_sparse_step", 1))
    if step < 1:
        raise ModelLoadError(f"{source}: decoder_sparse_step={step} must be >= 1")
    dense = {int(i) for i in d.get("mlp_only_layers") or []}
    if any(not 0 <= i < n_layers for i in dense):
        raise ModelLoadError(f"{source}: mlp_only_layers={sorted(dense)} names a layer outside [0, {n_layers})")
    layers = tuple(i for i in range(n_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(d["moe_intermediate_size"]),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)), moe_layers=layers, **shared)


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from transformers 4 keys or the 5.x `rope_parameters`."""
    params = dict(d.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = dict(d.get("rope_scaling") or params or {})
    if "type" in scaling and "rope_type" not in scaling:  # older spelling
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("rope_theta", None)
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _sliding_window(d: dict[str, Any]) -> int | None:
    if d.get("use_sliding_window") is False:
        return None
    sw = d.get("sliding_window")
    return int(sw) if sw else None


def _dtype_name(name: str) -> str:
    name = str(name).removeprefix("torch.")
    return {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
