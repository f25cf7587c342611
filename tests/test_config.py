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
    from lightning_zero.fabric.strategy import ZeroFabricStrategy

    for front_door in (ZeroStrategy, ZeroFabricStrategy):
        with pytest.raises(TypeError, match="either `config=ZeroConfig"):
            front_door(ZeroConfig(), stage=1)
        assert front_door(stage=2, bucket_numel=7).config == ZeroConfig(stage=2, bucket_numel=7)


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


def test_import_registers_offload_presets():
    assert StrategyRegistry.get("zero2_offload").config == ZeroConfig(stage=2, offload_optimizer="cpu")
    assert StrategyRegistry.get("zero3_offload").config == ZeroConfig(
        stage=3, offload_optimizer="cpu", offload_params="cpu"
    )
    disk = StrategyRegistry.get("zero3_offload_disk").config
    assert (disk.stage, disk.offload_optimizer, disk.offload_params) == (3, "disk", "disk")
    assert disk.offload_dir is not None
    assert not disk.offload_dir.startswith("/")  # under the Trainer's default_root_dir


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offload_optimizer": "nvme"}, r"ZeroConfig\.offload_optimizer: 'nvme'\. Expected 'none', 'cpu' or 'disk'"),
        ({"stage": 3, "offload_params": True}, r"ZeroConfig\.offload_params: True\. Expected 'none', 'cpu' or 'disk'"),
        ({"stage": 2, "offload_params": "cpu"}, r"ZeroConfig\.offload_params: 'cpu' at stage 2\. Expected 'none'"),
        ({"stage": 1, "offload_params": "disk", "offload_dir": "x"}, r"offload_params: 'disk' at stage 1"),
        ({"offload_optimizer": "disk"}, r"ZeroConfig\.offload_dir: None with offload_optimizer='disk'"),
        ({"stage": 3, "offload_params": "disk"}, r"ZeroConfig\.offload_dir: None with offload_params='disk'"),
        ({"offload_optimizer": "cpu", "offload_ratio": 0}, r"ZeroConfig\.offload_ratio: 0\. Expected a number in"),
        ({"offload_optimizer": "cpu", "offload_ratio": 1.5}, r"ZeroConfig\.offload_ratio: 1\.5\. Expected"),
        ({"offload_optimizer": "cpu", "offload_ratio": True}, r"ZeroConfig\.offload_ratio: True\. Expected"),
        ({"offload_ratio": 0.5}, r"offload_ratio: 0\.5 with offload_optimizer='none'"),
        ({"offload_optimizer": "disk", "offload_dir": ""}, r"ZeroConfig\.offload_dir: ''\. Expected None or a"),
        ({"offload_optimizer": "disk", "offload_dir": 3}, r"ZeroConfig\.offload_dir: 3\. Expected None or a"),
    ],
)
def test_offload_fields_out_of_range_are_refused_naming_field_value_and_expectation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**kwargs)


def test_offload_fields_in_range_are_accepted():
    config = ZeroConfig(stage=3, offload_optimizer="disk", offload_params="disk", offload_dir="/x", offload_ratio=0.25)
    assert config.offloads_to_disk
    assert not ZeroConfig(stage=2, offload_optimizer="cpu").offloads_to_disk
