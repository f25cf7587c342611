"""ZeroConfig and ZeroStrategy construction: every bad value is refused with the field, the value and the fix."""

from __future__ import annotations

import dataclasses

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero
from lightning_zero import ZeroConfig, ZeroStrategy


def test_defaults_are_valid_and_frozen():
    config = ZeroConfig()
    assert config.stage == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stage = 1  # type: ignore[misc]


@pytest.mark.parametrize("stage", [0, 4, -1, "2", True])
def test_stage_outside_range_is_refused(stage):
    with pytest.raises(ValueError, match=r"ZeroConfig\.stage: .*Expected 1, 2 or 3"):
        ZeroConfig(stage=stage)


@pytest.mark.parametrize("field", ["wrap_min_numel", "persistence_threshold", "prefetch_limit_numel"])
def test_thresholds_must_be_non_negative_integers(field):
    assert getattr(ZeroConfig(**{field: 0}), field) == 0
    with pytest.raises(ValueError, match=rf"ZeroConfig\.{field}: -1\. Expected a non-negative integer"):
        ZeroConfig(**{field: -1})


def test_wrap_module_classes_accepts_names_and_freezes_lists():
    assert ZeroConfig(wrap_module_classes=["Block"]).wrap_module_classes == ("Block",)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"wrap_module_classes: 'Block'\. Expected None or a tuple of class names"):
        ZeroConfig(wrap_module_classes="Block")  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["bucket_numel", "max_inflight_buckets"])
@pytest.mark.parametrize("value", [0, -5, 1.5, True])
def test_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=rf"ZeroConfig\.{field}: {value!r}\. Expected a positive integer"):
        ZeroConfig(**{field: value})


def test_reduce_dtype_choices():
    assert ZeroConfig(reduce_dtype="float32").reduce_dtype == "float32"
    with pytest.raises(ValueError, match=r"ZeroConfig\.reduce_dtype: 'fp8'.*'bfloat16'"):
        ZeroConfig(reduce_dtype="fp8")  # type: ignore[arg-type]


def test_overlap_comm_must_be_bool():
    with pytest.raises(TypeError, match="overlap_comm"):
        ZeroConfig(overlap_comm="yes")  # type: ignore[arg-type]


def test_strategy_builds_config_from_keywords():
    strategy = ZeroStrategy(stage=1, bucket_numel=123)
    assert strategy.config == ZeroConfig(stage=1, bucket_numel=123)


def test_strategy_names_unknown_option_and_lists_valid_ones():
    with pytest.raises(TypeError, match=r"Unknown ZeroConfig option\(s\) \['bucket_size'\].*bucket_numel"):
        ZeroStrategy(stage=2, bucket_size=10)


def test_strategy_refuses_config_and_keywords_together():
    with pytest.raises(TypeError, match="either `config=ZeroConfig"):
        ZeroStrategy(ZeroConfig(), stage=1)


def test_strategy_refuses_unknown_start_method():
    with pytest.raises(ValueError, match="start_method: 'thread'"):
        ZeroStrategy(start_method="thread")  # type: ignore[arg-type]


def test_import_registers_presets():
    assert lightning_zero.ZeroStrategy is ZeroStrategy
    for name, stage in [
        ("zero1", 1),
        ("zero2", 2),
        ("zero1_spawn", 1),
        ("zero2_spawn", 2),
        ("zero3", 3),
        ("zero3_spawn", 3),
    ]:
        entry = StrategyRegistry[name]
        assert entry["strategy"] is ZeroStrategy
        assert entry["init_params"]["stage"] == stage
    strategy = StrategyRegistry.get("zero1_spawn")
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.config.stage == 1
