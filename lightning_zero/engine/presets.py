"""The names both front doors register (``"zero1"`` ... ``"zero3"``, their ``_spawn`` variants and the memory-tier
presets: ``Trainer(strategy="zero3")``, ``Fabric(strategy="zero3")``), how either starts its processes
(``StartMethod``), and FSDP's ``cpu_offload`` expressed as memory tiers."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from lightning_zero.config import ZeroConfig

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
"""``"popen"`` re-runs the script per rank (like ``torchrun``, ``fabric run``); the others start ranks with
``multiprocessing`` (notebooks, tests, ``fabric.launch(function)``)."""


def register_presets(cls: type[Any], strategy_registry: Any) -> list[str]:
    """Register ``cls`` under each preset name with its ``ZeroConfig`` fields; returns the names."""
    # `override=True`: importing the package again (autoreload, spawned children) must not fail.
    for stage in (1, 2, 3):
        strategy_registry.register(
            f"zero{stage}",
            cls,
            description=f"ZeRO stage {stage}, one process per device launched like torchrun",
            override=True,
            stage=stage,
        )
        strategy_registry.register(
            f"zero{stage}_spawn",
            cls,
            description=f"ZeRO stage {stage}, processes started with multiprocessing spawn",
            override=True,
            stage=stage,
            start_method="spawn",
        )
    # As Lightning's "deepspeed_stage_2_offload" / "deepspeed_stage_3_offload(_nvme)" presets.
    offload_presets: dict[str, dict[str, Any]] = {
        "zero2_offload": {"stage": 2, "offload_optimizer": "cpu"},
        "zero3_offload": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
        "zero3_offload_disk": {
            "stage": 3,
            "offload_optimizer": "disk",
            "offload_params": "disk",
            "offload_dir": "offload",  # relative: under the Trainer's default_root_dir
        },
    }
    for name, fields in offload_presets.items():
        strategy_registry.register(name, cls, description=f"ZeRO with memory tiers: {fields}", override=True, **fields)
    strategy_registry.register(
        "zero_auto",
        cls,
        description="ZeRO with the stage and memory tiers chosen when fit starts from the predicted peak memory",
        override=True,
        stage="auto",
    )
    stages = [name for stage in (1, 2, 3) for name in (f"zero{stage}", f"zero{stage}_spawn")]
    return [*stages, *offload_presets, "zero_auto"]


def with_cpu_offload(config: ZeroConfig, given: dict[str, Any]) -> ZeroConfig:
    """``config`` with FSDP's ``cpu_offload=True`` as memory tiers: the optimizer state and its step in host memory,
    at stage 3 the parameter shards too. Refused next to a tier field it would override (``given``)."""
    tiers: dict[str, Any] = {"offload_optimizer": "cpu", "offload_params": "cpu" if config.stage == 3 else "none"}
    clash = [name for name in tiers if given.get(name, "none") != "none"]
    if clash:
        raise TypeError(
            f"ZeroStrategy(cpu_offload=True) sets {tiers}, and {clash[0]}={given[clash[0]]!r} was given too. HINT: "
            "drop `cpu_offload` and set the memory tiers alone (offload_optimizer, offload_params)."
        )
    return dataclasses.replace(config, **tiers)
