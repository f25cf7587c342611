"""``conf/``: every config group composes with Hydra's compose API (no processes), the strategy YAMLs mirror
``ZeroConfig`` field for field, and a misspelled or ill-typed field fails while composing."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from omegaconf import DictConfig, OmegaConf

import lightning_zero  # noqa: F401  (registers the strategies)
from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.hydra.schema import GPTConfigSchema, ZeroStrategySchema, register_configs
from lightning_zero.models import GPTConfig, LitGPT, SyntheticTextDataModule
from lightning_zero.models.data import ByteCorpusDataModule
from tests.test_example import stage3_unavailable_reason

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
ZERO_FIELDS = [f.name for f in dataclasses.fields(ZeroConfig)]
STRATEGY_ARGS = {"_target_", "process_group_backend", "start_method"}  # ZeroStrategy arguments besides ZeroConfig

register_configs()


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def conf_dir() -> Iterator[Path]:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield CONF


def _compose(*overrides: str) -> DictConfig:
    return compose(config_name="config", overrides=list(overrides))


def test_config_groups_have_the_documented_options():
    assert _options("strategy") == ["ddp", *sorted([*ZERO_FILES, "zero3pp", "zero_auto"])]
    assert {"tiny", "small"} <= set(_options("model"))
    assert _options("data") == ["fables", "synthetic"]
    assert _options("trainer") == ["cpu", "gpu", "slurm"]


# Each strategy file and the ZeroConfig fields it sets away from their defaults (the string presets of the same name).
ZERO_FILES: dict[str, dict[str, object]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": "cpu"},
    "zero3_offload": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    "zero3_offload_disk": {
        "stage": 3,
        "offload_optimizer": "disk",
        "offload_params": "disk",
        "offload_dir": "offload",
    },
}


@pytest.mark.parametrize("option", sorted(ZERO_FILES))
def test_zero_yaml_lists_every_zero_config_field_with_its_default(option):
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "strategy" / f"{option}.yaml"))
    assert isinstance(raw, dict)
    assert raw.pop("defaults") == ["zero_schema", "_self_"]
    missing = sorted(set(ZERO_FIELDS) - set(raw))
    unknown = sorted(set(raw) - set(ZERO_FIELDS) - STRATEGY_ARGS)
    assert not missing, f"conf/strategy/{option}.yaml lacks ZeroConfig field(s) {missing}: add them with defaults"
    assert not unknown, f"conf/strategy/{option}.yaml has {unknown}, which ZeroStrategy does not take"
    defaults = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}
    for name in ZERO_FIELDS:
        expected = ZERO_FILES[option].get(name, defaults[name])
        expected = list(expected) if isinstance(expected, tuple) else expected
        assert raw[name] == expected, f"{option}.yaml: {name}={raw[name]!r}, expected {expected!r}"


def test_schemas_are_derived_from_the_dataclasses():
    schema_fields = {f.name for f in dataclasses.fields(ZeroStrategySchema)}
    assert schema_fields == set(ZERO_FIELDS) | STRATEGY_ARGS
    gpt_fields = {f.name for f in dataclasses.fields(GPTConfigSchema)}
    assert gpt_fields == {f.name for f in dataclasses.fields(GPTConfig)} | {"_target_"}


@pytest.mark.parametrize(
    ("group", "option"),
    [(group, option) for group in ("strategy", "model", "data", "trainer") for option in _options(group)],
)
def test_every_config_group_option_composes_and_resolves(conf_dir, group, option):
    cfg = _compose(f"{group}={option}")
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(resolved, dict)
    assert set(resolved) >= {"strategy", "model", "data", "trainer", "seed", "sample", "report"}


def test_default_config_is_the_readme_run(conf_dir):
    cfg = _compose()
    assert cfg.strategy.stage in (2, 3)  # zero2 until stage 3 is released; then one line in conf/config.yaml
    assert cfg.model.config.n_layer == GPTConfig.small().n_layer
    assert cfg.trainer.accelerator == "cpu"
    assert cfg.trainer.devices == 2
    assert cfg.data.seq_len == cfg.model.config.block_size


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_strategy_configs_instantiate_the_strategy(conf_dir, stage):
    if stage == 3 and (reason := stage3_unavailable_reason()):
        pytest.skip(reason)
    cfg = _compose(f"strategy=zero{stage}", "strategy.bucket_numel=1000")
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.config == ZeroConfig(stage=stage, bucket_numel=1000)


def test_zero3pp_config_turns_every_zeropp_switch_on_over_zero3(conf_dir):
    if reason := stage3_unavailable_reason():
        pytest.skip(reason)
    strategy = instantiate(_compose("strategy=zero3pp").strategy, _convert_="all")
    assert isinstance(strategy, ZeroStrategy)
    expected = ZeroConfig(stage=3, quantize_weights=True, hpz_partition_size=2, quantize_gradients=True)
    assert strategy.config == expected


def test_zero_auto_config_is_the_registered_preset(conf_dir):
    strategy = instantiate(_compose("strategy=zero_auto").strategy, _convert_="all")
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.config == ZeroConfig(stage=3, auto=True) == ZeroStrategy(stage="auto").config


def test_activation_checkpointing_policy_from_yaml_is_a_tuple_of_class_names(conf_dir):
    cfg = _compose("strategy=zero2", "strategy.activation_checkpointing_policy=[Block,lightning_zero.models.gpt.Block]")
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert strategy.config.activation_checkpointing_policy == ("Block", "lightning_zero.models.gpt.Block")


@pytest.mark.parametrize("name", ["zero2_offload", "zero3_offload", "zero3_offload_disk"])
def test_offload_strategy_configs_instantiate_the_registered_presets(conf_dir, name):
    strategy = instantiate(_compose(f"strategy={name}").strategy, _convert_="all")
    preset = StrategyRegistry.get(name)
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.config == preset.config == ZeroConfig(**ZERO_FILES[name])  # type: ignore[arg-type]


def test_ddp_strategy_config_instantiates_ddp(conf_dir):
    assert isinstance(instantiate(_compose("strategy=ddp").strategy), DDPStrategy)


def test_lists_from_yaml_reach_zero_config_as_tuples(conf_dir):
    cfg = _compose("strategy=zero2", "strategy.wrap_module_classes=[Block]")
    assert instantiate(cfg.strategy, _convert_="all").config.wrap_module_classes == ("Block",)
    cfg = _compose("strategy=zero3", "strategy.leaf_module_classes=[MoEBlock]")
    assert instantiate(cfg.strategy, _convert_="all").config.leaf_module_classes == ("MoEBlock",)
    assert instantiate(_compose("strategy=zero3").strategy, _convert_="all").config.leaf_module_classes is None


@pytest.mark.parametrize(("option", "preset"), [("tiny", GPTConfig.tiny()), ("small", GPTConfig.small())])
def test_model_configs_build_the_presets(conf_dir, option, preset):
    model = instantiate(_compose(f"model={option}").model, _convert_="all")
    assert isinstance(model, LitGPT)
    assert model.config == preset


def test_data_configs_instantiate(conf_dir):
    cfg = _compose("model=tiny")
    fables = instantiate(cfg.data, path=str(ROOT / cfg.data.path))
    assert isinstance(fables, ByteCorpusDataModule)
    inputs, targets = fables.train_set[0]
    assert inputs.shape == targets.shape == (cfg.model.config.block_size,)
    synthetic = instantiate(_compose("model=tiny", "data=synthetic").data)
    assert isinstance(synthetic, SyntheticTextDataModule)


def test_cpu_trainer_config_instantiates_a_two_process_trainer(conf_dir):
    cfg = _compose("strategy=zero1", "trainer.max_steps=3")
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy, _convert_="all"))
    assert isinstance(trainer, pl.Trainer)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert trainer.strategy.config.stage == 1
    assert trainer.num_devices == 2
    assert trainer.max_steps == 3


def test_gpu_and_slurm_trainer_configs_extend_cpu(conf_dir):
    gpu = _compose("trainer=gpu").trainer
    slurm = _compose("trainer=slurm").trainer
    assert gpu.accelerator == slurm.accelerator == "gpu"
    assert gpu.precision == "bf16-true"
    assert slurm.num_nodes > 1
    assert slurm.devices > 1
    assert set(_compose().trainer) <= set(slurm)  # every cpu key is still overridable


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("strategy.bucket_numell=10", "bucket_numell"),
        ("strategy.bucket_numel=lots", "bucket_numel"),
        ("strategy.overlap_comm=maybe", "overlap_comm"),
        ("strategy.reduce_dtype=[1]", "reduce_dtype"),
        ("model.config.n_layr=3", "n_layr"),
        ("model.config.n_layer=two", "n_layer"),
    ],
)
def test_wrong_field_fails_at_composition(conf_dir, override, named):
    with pytest.raises(ConfigCompositionException) as error:
        _compose("strategy=zero2", override)
    message = str(error.value) + str(error.value.__cause__)
    assert named in message


def test_misspelled_field_in_a_strategy_file_fails_at_composition(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "strategy" / "typo.yaml").write_text(
        "defaults:\n  - zero_schema\n  - _self_\n\nstage: 1\nbucket_numell: 5\n"
    )
    with (
        initialize_config_dir(config_dir=str(conf), version_base="1.3"),
        pytest.raises(ConfigCompositionException, match=r"(?s)strategy/typo.*'bucket_numell' not in"),
    ):
        _compose("strategy=typo")


def test_field_forced_in_with_plus_is_rejected_by_the_strategy(conf_dir):
    # `+key=value` asks Hydra to add a key even to a checked config; ZeroStrategy then names it and the valid ones.
    cfg = _compose("strategy=zero2", "+strategy.bucket_numell=10")
    with pytest.raises(Exception, match=r"Unknown ZeroConfig option.*bucket_numell.*HINT"):
        instantiate(cfg.strategy, _convert_="all")


def test_out_of_range_value_composes_then_zero_config_names_it(conf_dir):
    # OmegaConf has no Literal type: the value is checked by ZeroConfig when the strategy is built.
    cfg = _compose("strategy=zero2", "strategy.stage=5")
    with pytest.raises(Exception, match=r"ZeroConfig\.stage: 5"):
        instantiate(cfg.strategy, _convert_="all")


def test_submitit_slurm_launcher_config_is_sized_from_the_trainer(conf_dir):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher is not installed")
    cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "trainer=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher.nodes == cfg.trainer.num_nodes
    assert launcher.tasks_per_node == launcher.gpus_per_node == cfg.trainer.devices
    assert "SlurmLauncher" in launcher._target_
