"""The surface users know from Lightning's sharded strategies: every argument and method that ``FSDPStrategy``,
``DeepSpeedStrategy`` and ``ModelParallelStrategy`` add to (or override in) Lightning's ``ParallelStrategy`` is either
on ``ZeroStrategy`` too or named, with the reason, in the table "Compared with Lightning's sharded strategies" of
``docs/lightning-strategies.md``; and the table names nothing those classes do not have, so it cannot rot either
way."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, ParallelStrategy

from lightning_zero import ZeroConfig, ZeroStrategy

PAGE = Path(__file__).resolve().parent.parent / "docs" / "lightning-strategies.md"
SHARDED = (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy)


def _arguments(cls: type) -> set[str]:
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _added_members(cls: type) -> set[str]:
    """Public names ``cls`` defines below ``ParallelStrategy``: what it adds or overrides."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is ParallelStrategy:
            break
        names |= {name for name in vars(klass) if not name.startswith("_")}
    return names


def _page_table() -> set[str]:
    text = PAGE.read_text()
    section = text.split("## Compared with Lightning's sharded strategies", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", row.split("|")[1])}


ZERO_ARGUMENTS = _arguments(ZeroStrategy) | {f.name for f in dataclasses.fields(ZeroConfig)}
ZERO_MEMBERS = _added_members(ZeroStrategy)


@pytest.mark.parametrize("cls", SHARDED, ids=lambda cls: cls.__name__)
def test_every_argument_of_lightnings_sharded_strategies_is_taken_or_explained(cls):
    unexplained = sorted(_arguments(cls) - ZERO_ARGUMENTS - _page_table())
    assert not unexplained, f"{cls.__name__} arguments neither on ZeroStrategy nor in {PAGE.name}: {unexplained}"


@pytest.mark.parametrize("cls", SHARDED, ids=lambda cls: cls.__name__)
def test_every_method_of_lightnings_sharded_strategies_is_implemented_or_explained(cls):
    unexplained = sorted(_added_members(cls) - ZERO_MEMBERS - _page_table())
    assert not unexplained, f"{cls.__name__} methods neither on ZeroStrategy nor in {PAGE.name}: {unexplained}"


def test_the_table_names_only_what_lightnings_sharded_strategies_have():
    surface = set().union(*(_arguments(cls) | _added_members(cls) for cls in SHARDED))
    table = _page_table()
    assert len(table) > 40
    assert not table - surface, f"{PAGE.name} rows for names no Lightning sharded strategy has: {table - surface}"


@pytest.mark.parametrize(("stage", "params"), [(2, "none"), (3, "cpu")])
def test_fsdp_cpu_offload_is_the_cpu_memory_tiers(stage, params):
    config = ZeroStrategy(stage=stage, cpu_offload=True).config
    assert (config.offload_optimizer, config.offload_params) == ("cpu", params)
    assert ZeroStrategy(config=ZeroConfig(stage=stage), cpu_offload=True).config == config
    with pytest.raises(TypeError, match=r"offload_optimizer='disk' was given too\. HINT: drop `cpu_offload`"):
        ZeroStrategy(stage=stage, cpu_offload=True, offload_optimizer="disk", offload_dir="tiers")


def test_registered_strategies_are_listed_as_fsdps_are():
    from lightning.pytorch.strategies import StrategyRegistry

    names = ZeroStrategy.get_registered_strategies()
    assert {"zero1", "zero2", "zero3", "zero3_spawn", "zero3_offload_disk"} <= set(names)
    assert all(StrategyRegistry[name]["strategy"] is ZeroStrategy for name in names)
