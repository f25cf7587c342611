"""``ZeroConfig``: every knob of the ZeRO strategy, in one frozen, validated dataclass.

The Hydra configs under ``conf/strategy/`` mirror these fields one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

DTypeName = Literal["float32", "bfloat16", "float16"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_from_name(name: DTypeName) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """How the strategy shards and communicates model state. Validated once, at construction."""

    stage: Literal[1, 2] = 2
    """Which model state is sharded across data-parallel ranks. 1: optimizer state and fp32 master weights.
    2: also gradients, reduce-scattered in buckets during backward."""

    bucket_numel: int = 4_000_000
    """Elements per communication bucket. Parameters are packed into flat buckets of about this size (a parameter is
    never split across buckets, so a bucket can be larger when a single parameter is). Larger buckets mean fewer,
    more efficient collectives; smaller buckets overlap better with backward and, for stage 2, bound the transient
    full-gradient memory."""

    overlap_comm: bool = True
    """Launch each bucket's gradient reduce-scatter from the backward hooks as soon as the bucket is complete, so
    communication overlaps the rest of backward. False: stage 1 reduces every bucket at the optimizer step and
    stage 2 reduces each bucket as it completes but waits for it at once (no overlap; easier to debug)."""

    max_inflight_buckets: int = 2
    """Stage 2: how many buckets may be in flight at once during backward. Each one holds a transient full-size
    gradient buffer, so this bounds stage 2's gradient memory at ``max_inflight_buckets * bucket_numel`` elements
    above the sharded gradients."""

    reduce_dtype: DTypeName | None = None
    """dtype in which gradients are communicated and averaged. None: the parameters' own dtype. ``"float32"`` with
    bf16 parameters trades twice the gradient traffic for full-precision reduction."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            requested: object = self.stage
            hint = " Stage 3 (parameter sharding) is not available in this version." if requested == 3 else ""
            raise ValueError(f"Invalid ZeroConfig.stage: {self.stage!r}. Expected 1 or 2.{hint}")
        _check_positive_int("bucket_numel", self.bucket_numel)
        _check_positive_int("max_inflight_buckets", self.max_inflight_buckets)
        if not isinstance(self.overlap_comm, bool):
            raise TypeError(f"Invalid ZeroConfig.overlap_comm: {self.overlap_comm!r}. Expected True or False.")
        if self.reduce_dtype is not None and self.reduce_dtype not in _DTYPES:
            raise ValueError(
                f"Invalid ZeroConfig.reduce_dtype: {self.reduce_dtype!r}. Expected None or one of {sorted(_DTYPES)}."
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ZeroConfig:
        """Build a config from keyword arguments, naming any unknown keyword and the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"Unknown ZeroConfig option(s) {unknown}. Valid options are: {sorted(known)}. "
                "HINT: check the spelling in `ZeroStrategy(...)` or in your `strategy` config."
            )
        return cls(**kwargs)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"Invalid ZeroConfig.{name}: {value!r}. Expected a positive integer.")
