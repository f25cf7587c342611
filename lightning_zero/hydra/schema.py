"""Hydra structured-config schemas for ``conf/``, derived from the dataclasses they configure.

``conf/strategy/zero*.yaml`` extend ``zero_schema`` and ``conf/model/*.yaml`` extend ``gpt_schema`` (see their
``defaults`` lists), so Hydra checks names and types while composing, before any process starts::

    $ python examples/train.py strategy.bucket_numell=10
    Could not override 'strategy.bucket_numell'. ... Key 'bucket_numell' not in 'ZeroStrategySchema'
    $ python examples/train.py strategy.bucket_numel=lots
    Error merging override strategy.bucket_numel=lots
    Value 'lots' of type 'str' could not be converted to Integer

The schemas are generated from ``ZeroConfig`` and ``GPTConfig`` rather than written out, so a field added there is
known to Hydra at once. Values are checked by the dataclasses themselves when the configs are instantiated: OmegaConf
has no ``Literal`` type, so ``stage: 5`` composes and then fails with ``ZeroConfig``'s own message.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from lightning_zero.config import ZeroConfig
from lightning_zero.models.gpt import GPTConfig

_SCALARS = (bool, int, float, str)

FieldSpec = tuple[str, Any, Any]
"""(name, type, default) of one schema field."""

# Arguments of ZeroStrategy.__init__ besides the ZeroConfig fields that a YAML file can sensibly set.
_STRATEGY_ARGS: list[FieldSpec] = [
    ("process_group_backend", Optional[str], None),  # noqa: UP045  (OmegaConf wants typing.Optional)
    ("start_method", str, "popen"),
]


def omegaconf_type(annotation: Any) -> Any:
    """The closest type OmegaConf can validate: ``Literal[1, 2]`` -> int, ``X | None`` -> Optional[X],
    ``tuple[str, ...]`` -> List[str]; anything else -> Any (the name is still checked, the value is not)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation in _SCALARS:
        return annotation
    if origin is Literal:
        kinds = {type(a) for a in args}
        return kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in _SCALARS else Any
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = omegaconf_type(rest[0]) if len(rest) == 1 else Any
        return Optional[inner] if len(rest) < len(args) and inner is not Any else inner  # noqa: UP045
    if origin in (tuple, list) and args and (len(args) == 1 or args[1] is Ellipsis):
        item = omegaconf_type(args[0])
        return list[item] if item is not Any else Any  # type: ignore[valid-type]
    return Any


def schema_of(cls: type[Any], schema_name: str, target: str, extra: Sequence[FieldSpec] = ()) -> type[Any]:
    """A dataclass with ``_target_``, every field of the dataclass ``cls`` (typed for OmegaConf, same defaults; no
    default stays mandatory) and the ``extra`` (name, type, default) fields."""
    hints = typing.get_type_hints(cls)
    fields: list[FieldSpec] = [("_target_", str, target)]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        fields.append((f.name, omegaconf_type(hints[f.name]), default))
    fields.extend(extra)
    return _make_schema(schema_name, fields)


def _make_schema(name: str, fields: Sequence[FieldSpec]) -> type[Any]:
    schema = dataclasses.make_dataclass(name, [_dataclass_field(*spec) for spec in fields])
    schema.__module__ = __name__  # OmegaConf names it in errors (object_type=...); make_dataclass says "types"
    return schema


def _dataclass_field(name: str, annotation: Any, default: Any) -> tuple[str, Any, Any]:
    if isinstance(default, tuple | list):
        return name, annotation, dataclasses.field(default_factory=lambda: list(default))
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return name, annotation, dataclasses.field(default_factory=default)
    return name, annotation, dataclasses.field(default=default)


ZeroStrategySchema = schema_of(ZeroConfig, "ZeroStrategySchema", "lightning_zero.ZeroStrategy", _STRATEGY_ARGS)
"""``conf/strategy/zero*.yaml``: the arguments of ``ZeroStrategy``, i.e. every ``ZeroConfig`` field and a few more."""

GPTConfigSchema = schema_of(GPTConfig, "GPTConfigSchema", "lightning_zero.models.GPTConfig")

LitGPTSchema = _make_schema(
    "LitGPTSchema",
    [
        ("_target_", str, "lightning_zero.models.LitGPT"),
        ("config", GPTConfigSchema, GPTConfigSchema),
        ("lr", float, MISSING),
        ("weight_decay", float, MISSING),
        ("betas", list[float], MISSING),
    ],
)
"""``conf/model/*.yaml``: a ``LitGPT`` and the ``GPTConfig`` it builds."""


def register_configs(store: ConfigStore | None = None) -> None:
    """Put the schemas in Hydra's ConfigStore. Call before composing (``examples/train.py`` does, at import)."""
    store = store or ConfigStore.instance()
    store.store(group="strategy", name="zero_schema", node=ZeroStrategySchema)
    store.store(group="model", name="gpt_schema", node=LitGPTSchema)
