"""Tensor parallelism: a model's lanes split over ranks (kog.parallel.shard) and the transports
that carry the program's collectives between them (kog.parallel.transport)."""

from kog.parallel.shard import lane_form, shard_config, shard_weights
from kog.parallel.transport import ThreadGroup, TorchDistTransport, Transport

__all__ = ["ThreadGroup", "TorchDistTransport", "Transport", "lane_form", "shard_config",
           "shard_weights"]
