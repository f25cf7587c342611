"""ZeRO (Zero Redundancy Optimizer) for PyTorch Lightning.

Importing the package registers the strategies ``"zero1"``, ``"zero2"`` and ``"zero3"`` (and ``"zero1_spawn"``,
``"zero2_spawn"``, ``"zero3_spawn"``) with Lightning, so ``Trainer(strategy="zero3")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.checkpoint import CheckpointError, load_full_state_dict
from lightning_zero.collectives import CommLedger
from lightning_zero.config import ZeroConfig
from lightning_zero.consolidate import consolidate_checkpoint
from lightning_zero.loss_scaler import DynamicLossScaler
from lightning_zero.memory import ModelStateBytes, expected_model_state_bytes, model_state_bytes
from lightning_zero.parameter_gatherer import ParameterGatherer, RankDivergenceError
from lightning_zero.precision import ZeroPrecision
from lightning_zero.sharded_init import shard_module
from lightning_zero.sharded_optimizer import ZeroOptimizer
from lightning_zero.strategy import ZeroStrategy

__all__ = [
    "CheckpointError",
    "CommLedger",
    "DynamicLossScaler",
    "ModelStateBytes",
    "ParameterGatherer",
    "RankDivergenceError",
    "ZeroConfig",
    "ZeroOptimizer",
    "ZeroPrecision",
    "ZeroStrategy",
    "consolidate_checkpoint",
    "expected_model_state_bytes",
    "load_full_state_dict",
    "model_state_bytes",
    "shard_module",
]


ZeroStrategy.register_strategies(StrategyRegistry)
