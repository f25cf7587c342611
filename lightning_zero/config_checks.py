"""The checks of ``ZeroConfig``'s fields (each names the field, what it got and what it expects), and the matching of
the class-name fields against a model's modules.

Kept apart from ``config.py``, which holds the fields and their documentation; the checks run in
``ZeroConfig.__post_init__``, so an invalid config never exists. This file imports nothing of ``config.py`` (which
imports it): the config it checks is typed ``UncheckedConfig``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

UncheckedConfig = Any
"""The ``ZeroConfig`` being checked, inside its ``__post_init__``: until these checks pass its fields hold whatever
the caller gave (keywords, YAML through Hydra), so they are read as anything, and each check states what it expects."""

TIERS = ("none", "cpu", "disk")
"""The values of ``offload_optimizer`` and ``offload_params``."""
ZEROPP_OFF: dict[str, object] = {"quantize_weights": False, "hpz_partition_size": 1, "quantize_gradients": False}
"""The ZeRO++ switches and their values when off."""


def check_zeropp(config: UncheckedConfig) -> None:
    if config.ranks_per_node is not None:
        check_positive_int("ranks_per_node", config.ranks_per_node)
    check_positive_int("hpz_partition_size", config.hpz_partition_size)
    check_positive_int("quantization_block", config.quantization_block)
    for name in ("quantize_weights", "quantize_gradients"):
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"Invalid ZeroConfig.{name}: {getattr(config, name)!r}. Expected True or False.")
    bits = config.gradient_quantization_bits
    if isinstance(bits, bool) or bits not in (4, 8):
        raise ValueError(f"Invalid ZeroConfig.gradient_quantization_bits: {bits!r}. Expected 4 or 8.")
    if config.ranks_per_node is not None and config.ranks_per_node % config.hpz_partition_size:
        raise ValueError(
            f"Invalid ZeroConfig.hpz_partition_size: {config.hpz_partition_size} with ranks_per_node="
            f"{config.ranks_per_node}. Expected a divisor of ranks_per_node, so that a secondary shard's "
            "partition stays inside one node. HINT: hpz_partition_size=ranks_per_node."
        )
    if config.stage < 3:
        on = [f"{n}={getattr(config, n)!r}" for n in ZEROPP_OFF if getattr(config, n) != ZEROPP_OFF[n]]
        if on:
            raise ValueError(
                f"Invalid ZeroConfig: {', '.join(on)} with stage={config.stage}. ZeRO++ (quantize_weights, "
                "hpz_partition_size, quantize_gradients) works on stage 3's parameter gathers and gradient "
                "reduce-scatters. HINT: set stage=3, or turn these off."
            )


def check_auto(config: UncheckedConfig) -> None:
    if not isinstance(config.auto, bool):
        raise TypeError(f"Invalid ZeroConfig.auto: {config.auto!r}. Expected True or False.")
    for name in ("auto_device_budget", "auto_host_budget"):
        if getattr(config, name) is not None:
            check_positive_int(name, getattr(config, name))
    headroom = config.auto_headroom
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(f"Invalid ZeroConfig.auto_headroom: {headroom!r}. Expected a fraction, 0 <= f < 1.")


def check_offload(config: UncheckedConfig) -> None:
    for name in ("offload_optimizer", "offload_params"):
        if getattr(config, name) not in TIERS:
            raise ValueError(f"Invalid ZeroConfig.{name}: {getattr(config, name)!r}. Expected 'none', 'cpu' or 'disk'.")
    if config.offload_params != "none" and config.stage != 3:
        raise ValueError(
            f"Invalid ZeroConfig.offload_params: {config.offload_params!r} at stage {config.stage}. Expected 'none': "
            "stages 1 and 2 keep full parameters on every rank. HINT: use stage=3 to offload parameter shards, "
            "or offload_optimizer to offload the optimizer state."
        )
    ratio = config.offload_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"Invalid ZeroConfig.offload_ratio: {ratio!r}. Expected a number in (0, 1].")
    if ratio < 1 and config.offload_optimizer == "none":
        raise ValueError(
            f"Invalid ZeroConfig.offload_ratio: {ratio!r} with offload_optimizer='none'. Expected 1.0, or "
            "offload_optimizer 'cpu' or 'disk' (the ratio is the part of the optimizer state it moves)."
        )
    directory: object = config.offload_dir
    if directory is not None and (not isinstance(directory, str) or not directory):
        raise ValueError(
            f"Invalid ZeroConfig.offload_dir: {directory!r}. Expected None or a directory path (a string)."
        )
    uses_disk = [n for n in ("offload_optimizer", "offload_params") if getattr(config, n) == "disk"]
    if uses_disk and directory is None:
        raise ValueError(
            f"Invalid ZeroConfig.offload_dir: None with {uses_disk[0]}='disk'. Expected a directory for the disk "
            "tier. HINT: ZeroStrategy(offload_dir='/path/on/a/fast/disk'), or the preset 'zero3_offload_disk'."
        )


def check_offload_optimizer_state(config: UncheckedConfig) -> None:
    state = config.offload_optimizer_state
    if state not in ("with_masters", "disk"):
        raise ValueError(f"Invalid ZeroConfig.offload_optimizer_state: {state!r}. Expected 'with_masters' or 'disk'.")
    if state == "with_masters":
        return
    if config.offload_optimizer != "cpu":
        raise ValueError(
            f"Invalid ZeroConfig: offload_optimizer_state='disk' with offload_optimizer={config.offload_optimizer!r}. "
            "Expected offload_optimizer='cpu': the moments go to disk beside host masters, stepped by the host. "
            "HINT: offload_optimizer='disk' puts masters and moments on disk; 'cpu' with "
            "offload_optimizer_state='disk' keeps the masters in host memory."
        )
    if config.offload_overlap == "delayed":
        raise ValueError(
            "Invalid ZeroConfig: offload_optimizer_state='disk' with offload_overlap='delayed'. The delayed update "
            "would hold every bucket's moments in memory through the next forward and backward. HINT: use "
            "offload_overlap='exact' with moments on disk, or offload_optimizer_state='with_masters'."
        )
    if config.offload_dir is None:
        raise ValueError(
            "Invalid ZeroConfig.offload_dir: None with offload_optimizer_state='disk'. Expected a directory for the "
            "disk tier. HINT: ZeroStrategy(offload_dir='/path/on/a/fast/disk')."
        )


def check_offload_overlap(config: UncheckedConfig) -> None:
    check_non_negative_int("offload_overlap_warmup", config.offload_overlap_warmup)
    if config.offload_overlap not in ("exact", "delayed"):
        raise ValueError(
            f"Invalid ZeroConfig.offload_overlap: {config.offload_overlap!r}. Expected 'exact' or 'delayed'."
        )
    if config.offload_overlap == "exact":
        return
    # The delayed update runs on the host tier's own masters and gradient buffers, for every bucket at once.
    refusals = [
        ("offload_optimizer", config.offload_optimizer != "cpu", "'cpu' (the host tier steps the delayed update)"),
        ("offload_ratio", config.offload_ratio != 1, "1.0 (buckets on the device would step without delay)"),
        ("offload_params", config.offload_params != "none", "'none' (the step writes the parameter tier while the "
         "next forward reads it)"),
    ]  # fmt: skip
    for name, refused, expected in refusals:
        if refused:
            raise ValueError(
                f"Invalid ZeroConfig: offload_overlap='delayed' with {name}={getattr(config, name)!r}. Expected "
                f"{name}={expected}. HINT: use offload_overlap='exact' with this {name}."
            )


def check_class_names(name: str, config: UncheckedConfig, example: str) -> None:
    """A field holding None or module class names: lists from YAML are frozen as a tuple."""
    classes: object = getattr(config, name)  # typed loosely: YAML and callers may pass anything
    if classes is None:
        return
    names = list(classes) if isinstance(classes, (tuple, list)) else None
    if names is None or not all(isinstance(c, str) and c for c in names):
        raise TypeError(
            f"Invalid ZeroConfig.{name}: {classes!r}. Expected None or a tuple of class names, e.g. {example}."
        )
    object.__setattr__(config, name, tuple(names))


def check_checkpointing_policy(config: UncheckedConfig) -> None:
    """Module classes (a class, a set, a list from YAML) are frozen as a tuple; a callable stays as it is."""
    policy: object = config.activation_checkpointing_policy  # typed loosely: YAML and callers may pass anything
    if policy is None or (callable(policy) and not isinstance(policy, type)):
        return
    items = [policy] if isinstance(policy, (type, str)) else list(policy) if isinstance(policy, Iterable) else None
    if not items or not all(
        (isinstance(c, str) and c) or (isinstance(c, type) and issubclass(c, torch.nn.Module)) for c in items
    ):
        raise TypeError(
            f"Invalid ZeroConfig.activation_checkpointing_policy: {policy!r}. Expected None, module classes (e.g. "
            "{Block}, or from YAML a list of class names such as [Block] or [transformers.models.llama.modeling_"
            "llama.LlamaDecoderLayer]), or a callable taking a module and returning whether to checkpoint it."
        )
    object.__setattr__(config, "activation_checkpointing_policy", tuple(items))


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"Invalid ZeroConfig.{name}: {value!r}. Expected a positive integer.")


def check_non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Invalid ZeroConfig.{name}: {value!r}. Expected a non-negative integer.")


def class_matches(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """Whether ``module``'s class is one of ``names``, by class name or qualified name (the class-name fields)."""
    cls = type(module)
    return cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names


def check_classes_exist(root: torch.nn.Module, names: tuple[str, ...], field: str, otherwise: str) -> None:
    # A misspelled wrap class would silently leave the whole model in the root unit (every rank would gather all of
    # it); a misspelled leaf class would leave the units it was meant to merge to diverge after the first step; a
    # misspelled checkpointing class would keep every activation.
    missing = [n for n in names if not any(class_matches(m, (n,)) for m in root.modules())]
    if missing:
        present = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(
            f"Invalid ZeroConfig.{field}: {missing} name no module class of {type(root).__name__} "
            f"(its classes: {present}). HINT: use a class name from that list, {otherwise}."
        )


def check_async_save(config: UncheckedConfig) -> None:
    """``async_save`` holds what each rank writes in host memory while a thread writes it: a full checkpoint is
    assembled on rank 0 instead, and the disk tiers stream their saves."""
    if config.async_save and (config.state_dict_type == "full" or config.offloads_to_disk):
        other = "state_dict_type='full'" if config.state_dict_type == "full" else "a disk tier (offload_*='disk')"
        raise ValueError(
            f"Invalid ZeroConfig: async_save=True with {other}. An asynchronous save copies what each rank writes "
            "into host memory first; a full checkpoint is assembled on rank 0 as the pieces arrive, and the disk "
            "tiers stream saves instead of holding the state in memory. HINT: drop async_save, or use "
            "state_dict_type='sharded' without disk tiers."
        )
