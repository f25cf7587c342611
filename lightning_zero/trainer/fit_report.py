"""``FitReport``: what ``MemoryReport`` measured in a run, a row per rank (``RankReport``): the numbers it prints,
logs, writes as JSON and draws (``report_plot.py``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from lightning_zero.engine.memory import ModelStateBytes
from lightning_zero.engine.throughput import ThroughputSummary


@dataclass(frozen=True)
class RankReport:
    """One rank's numbers. Bytes throughout."""

    rank: int
    parameters: int
    gradients: int
    master_weights: int
    optimizer_state: int
    peak_memory: int
    """Peak CUDA memory allocated on GPU; on CPU the peak resident set size of the process since it started
    (libraries included; in a Hydra sweep, over the jobs it has run so far)."""
    sent: dict[str, int]
    """Bytes sent in the last optimizer step, per collective."""
    secondary_shards: int = 0
    """ZeRO++ hpZ secondary shards (``ModelStateBytes.secondary_shards``)."""
    intra_node: int = 0
    """Of the bytes sent in the last optimizer step, those to ranks on this rank's node."""
    inter_node: int = 0
    """... and those to ranks on other nodes (Note [bytes by link] in ``comm/ledger.py``)."""
    tiers: dict[str, int] = field(default_factory=dict)
    """Model-state bytes by memory tier (``device``, ``host``, ``disk``) with ``ZeroConfig.offload_*``; empty
    without tiers."""

    @property
    def model_state(self) -> ModelStateBytes:
        return ModelStateBytes(
            self.parameters, self.gradients, self.master_weights, self.optimizer_state, self.secondary_shards
        )


@dataclass(frozen=True)
class FitReport:
    """The whole table: what ran, and a row per rank."""

    strategy: str
    stage: int | None
    """0 for DDP, the ZeRO stage for ``ZeroStrategy``, None for anything else."""
    world_size: int
    num_params: int
    param_bytes: int
    """Bytes per parameter element (4 for fp32, 2 for bf16)."""
    peak_memory_kind: str
    """What ``RankReport.peak_memory`` measures: "peak RSS" (CPU) or "peak CUDA allocated"."""
    sent_is_estimate: bool
    """True when ``sent`` is DDP's formula rather than a measurement."""
    ranks: list[RankReport]
    throughput: ThroughputSummary | None = None
    """Rank 0's throughput over the steps after the first (Note [throughput from the real step]); None before two
    steps."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)
