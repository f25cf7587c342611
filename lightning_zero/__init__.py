"""ZeRO (Zero Redundancy Optimizer) for PyTorch Lightning.

Importing the package registers the strategies ``"zero1"``, ``"zero2"`` and ``"zero3"`` (and ``"zero1_spawn"``,
``"zero2_spawn"``, ``"zero3_spawn"``), and the memory-tier presets ``"zero2_offload"``, ``"zero3_offload"`` and
``"zero3_offload_disk"`` with Lightning, so ``Trainer(strategy="zero3")`` works, and the same names with Lightning
Fabric (``ZeroFabricStrategy``), so ``Fabric(strategy="zero3")`` works too.

The package, bottom to top (each subpackage's docstring says what it owns and which others it may import; nothing
imports upwards):

- ``config``: ``ZeroConfig``, every option, validated once (by ``config_checks``).
- ``comm``: collectives, the communication ledger, the buffer pool, the fault monitor.
- ``sharding``: stages 1 and 2 and the shared optimizer: flat buckets, gradient reducers, ``ZeroOptimizer``.
- ``stage3``: parameters sharded too: unit policy, units, the gatherer, sharded initialization.
- ``offload``: memory tiers: where shards live between uses (host memory, disk), read ahead and written behind.
- ``checkpoint``: sharded checkpoint IO.
- ``planning``: what a configuration costs before it runs, and ``stage="auto"``'s choice.
- ``engine``: what both front doors do to a model and its optimizers: sharding, optimizer wrapping, memory tiers,
  ``ZeroPrecision``, ``grad_norm``, the memory count.
- ``trainer``: ``ZeroStrategy``, the Trainer's front door; ``ShardedEMA``, the memory report.
- ``fabric``: ``ZeroFabricStrategy``, the Lightning Fabric front door over the same engine.
- ``hydra``: structured configs and multirun launch; ``cli``: ``python -m lightning_zero`` commands.
- ``models``: the example models and data (plain PyTorch / Lightning code).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.checkpoint.full_weights import load_full_state_dict
from lightning_zero.checkpoint.sharded_checkpoint import CheckpointError
from lightning_zero.cli.consolidate import consolidate_checkpoint
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.grad_norm import grad_norm
from lightning_zero.engine.memory import ModelStateBytes, expected_model_state_bytes, model_state_bytes
from lightning_zero.fabric.precision import ZeroFabricPrecision
from lightning_zero.fabric.strategy import ZeroFabricStrategy
from lightning_zero.sharding.loss_scaler import DynamicLossScaler
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer, RankDivergenceError
from lightning_zero.stage3.sharded_init import shard_module
from lightning_zero.trainer.ema import ShardedEMA
from lightning_zero.trainer.precision import ZeroPrecision
from lightning_zero.trainer.report import MemoryReport
from lightning_zero.trainer.strategy import ZeroStrategy

__all__ = [
    "CheckpointError",
    "CommLedger",
    "DynamicLossScaler",
    "MemoryReport",
    "ModelStateBytes",
    "ParameterGatherer",
    "RankDivergenceError",
    "ShardedEMA",
    "ZeroConfig",
    "ZeroFabricPrecision",
    "ZeroFabricStrategy",
    "ZeroOptimizer",
    "ZeroPrecision",
    "ZeroStrategy",
    "consolidate_checkpoint",
    "expected_model_state_bytes",
    "grad_norm",
    "load_full_state_dict",
    "model_state_bytes",
    "shard_module",
]


ZeroStrategy.register_strategies(StrategyRegistry)
ZeroFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
