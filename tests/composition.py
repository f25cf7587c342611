"""The composition matrix's cases: the factors, an all-pairs covering array over them, and what each case expects.

Every option of the strategy is a factor; some exist only at stage 3 (the parameter tier, ZeRO++ and
``reshard_root_after_forward``) and take the value ``"n/a"`` at stages 1 and 2. :func:`all_pairs` is a small
deterministic greedy generator (AETG-like, without randomness): among every valid combination it repeatedly picks
the one that covers the most pairs of values not covered yet, until every pair that some valid combination holds is
in some case. Options refused together by design (:data:`REFUSED`) get a case of their own, which must be refused
before training with an error naming the options and the fix; ``all_pairs`` keeps refused combinations out of the
array, so every pair that can train is covered by a case that trains.

The runs themselves are in ``tests/composition_runs.py``; the tests in ``tests/test_composition.py``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

NA = "n/a"

FACTORS: dict[str, tuple[Any, ...]] = {
    "stage": (1, 2, 3),
    "precision": ("32-true", "bf16-mixed", "16-mixed", "bf16-true"),
    "optimizer_tier": ("none", "host_copies", "disk"),  # host_copies: offload_optimizer="cpu" with FORCE_COPIES
    "param_tier": (NA, "none", "disk"),  # offload_params, stage 3 only
    "zeropp": (NA, "off", "hpz", "qwz_qgz"),  # stage 3 only; 4 ranks as 2 nodes x 2 when on
    "accumulate": (1, 2),  # micro-batches per step; all but the last under no_sync
    "clip": ("none", "norm"),
    "checkpointing": ("none", "reentrant_shared"),  # reentrant, one layer shared by two checkpointed segments
    "model": ("hf_causal_lm", "hf_lora", "moe"),  # moe: routing that changes per step and per rank
    "reshard_root": (NA, True, False),  # reshard_root_after_forward, stage 3 only
    "manual": (False, True),  # manual optimization with two optimizers
}
STAGE3_ONLY = ("param_tier", "zeropp", "reshard_root")

Pair = tuple[str, Any, str, Any]  # (factor, value, other factor, its value), factors in FACTORS order


@dataclass(frozen=True)
class Refusal:
    """Option values the library refuses together at setup (two, or three where a third decides), and what its
    error must say."""

    options: tuple[tuple[str, Any], ...]  # (factor, value) pairs, all of which a refused case holds
    why: str  # for the table of docs/composition.md
    says: tuple[str, ...]  # substrings the error must contain (the options and the fix)

    def holds(self, case: Mapping[str, Any]) -> bool:
        return all(case[f] == v for f, v in self.options)


# 16-mixed with the host tier's copy path, and with the optimizer on disk at stage 3, were refused until the tiers
# checked and unscaled the gradients they hold (Note [gradients on disk]); they train now.
REFUSED: tuple[Refusal, ...] = (
    Refusal(
        options=(("stage", 2), ("zeropp", "hpz")),
        why="ZeRO++ changes stage 3's parameter all-gathers and gradient reduce-scatters; stages 1 and 2 gather no "
        "parameters, so the switches would do nothing",
        says=("hpz_partition_size=2", "stage=2", "HINT"),
    ),
    Refusal(
        options=(("stage", 1), ("param_tier", "disk")),
        why="stages 1 and 2 keep the full parameters on every rank: there are no parameter shards to offload",
        says=("offload_params", "'disk' at stage 1", "HINT"),
    ),
)
"""Combinations refused by design, each checked against the library's setup error by the matrix. Both are
combinations the ``"n/a"`` values keep out of the array (options of stage 3 below stage 3): the library refuses them
instead of ignoring them."""


def valid(case: Mapping[str, Any]) -> bool:
    """A combination exists: the stage-3-only factors are ``"n/a"`` exactly below stage 3."""
    below = case["stage"] != 3
    return all((case[f] == NA) == below for f in STAGE3_ONLY)


def pairs_of(case: Mapping[str, Any], factors: Mapping[str, tuple[Any, ...]] = FACTORS) -> Iterator[Pair]:
    for a, b in itertools.combinations(factors, 2):
        yield (a, case[a], b, case[b])


@dataclass(frozen=True)
class Array:
    cases: tuple[dict[str, Any], ...]
    required: frozenset[Pair]  # every pair some valid combination holds that no refusal refuses


def all_pairs(
    factors: Mapping[str, tuple[Any, ...]],
    is_valid: Callable[[Mapping[str, Any]], bool],
    refused: Sequence[Refusal] = (),
) -> Array:
    """An all-pairs covering array of the valid combinations of ``factors`` (see the module docstring)."""
    names = list(factors)
    index: dict[Pair, int] = {}
    candidates: list[tuple[dict[str, Any], frozenset[int]]] = []
    for values in itertools.product(*factors.values()):
        case = dict(zip(names, values, strict=True))
        if not is_valid(case):
            continue
        if any(r.holds(case) for r in refused):
            continue
        candidates.append((case, frozenset(index.setdefault(p, len(index)) for p in pairs_of(case, factors))))
    uncovered = set(index.values())
    chosen: list[dict[str, Any]] = []
    while uncovered:
        best, gain = None, 0
        for case, pairs in candidates:  # the first of the best: deterministic
            covers = len(pairs & uncovered)
            if covers > gain:
                best, gain = (case, pairs), covers
        assert best is not None
        chosen.append(best[0])
        uncovered -= best[1]
    return Array(tuple(chosen), frozenset(index))


@functools.cache
def matrix() -> Array:
    return all_pairs(FACTORS, valid, REFUSED)


REFUSAL_BASE: dict[str, Any] = {
    "stage": 3,
    "precision": "32-true",
    "optimizer_tier": "none",
    "param_tier": "none",
    "zeropp": "off",
    "accumulate": 1,
    "clip": "none",
    "checkpointing": "none",
    "model": "moe",  # the cheapest
    "reshard_root": True,
    "manual": False,
}


EXTRA: tuple[dict[str, Any], ...] = (
    # Stage 3, LoRA's frozen base in a decoder layer shared by two reentrant segments, automatic optimization: the
    # array pairs each of these (its LoRA + checkpointing case at stage 3 is in manual optimization), not all four.
    {**REFUSAL_BASE, "checkpointing": "reentrant_shared", "model": "hf_lora"},
)
"""Combinations beyond the pairs that failed while the array was built, kept as cases of their own."""


def refusal_case(refusal: Refusal) -> dict[str, Any]:
    """The refused options on the cheapest case; stage-3 options it does not name are "n/a" below stage 3."""
    case = {**REFUSAL_BASE, **dict(refusal.options)}
    if case["stage"] != 3:
        case.update({f: NA for f in STAGE3_ONLY if f not in dict(refusal.options)})
    return case


def case_id(case: Mapping[str, Any]) -> str:
    parts = [f"s{case['stage']}", case["precision"], f"opt-{case['optimizer_tier']}"]
    names = {"param_tier": "params", "zeropp": "zpp", "reshard_root": "reshard"}
    parts += [f"{names[f]}-{case[f]}" for f in STAGE3_ONLY if case[f] != NA]
    parts += [f"acc{case['accumulate']}", f"clip-{case['clip']}", f"ckpt-{case['checkpointing']}", case["model"]]
    parts.append("manual2" if case["manual"] else "auto")
    return "/".join(str(p) for p in parts)


def every_value_sample(cases: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """A deterministic subset of ``cases`` in which every value of every factor appears (greedy, as above)."""
    missing = {(f, v) for f, values in FACTORS.items() for v in values}
    missing = {(f, v) for f, v in missing if any(c[f] == v for c in cases)}
    sample: list[dict[str, Any]] = []
    while missing:
        best = max(cases, key=lambda c: (len({(f, c[f]) for f in FACTORS} & missing), -cases.index(c)))
        sample.append(best)
        missing -= {(f, best[f]) for f in FACTORS}
    return sample


class Distances(NamedTuple):
    loss: float  # the largest relative difference of a step's loss
    weight: float  # the largest relative difference of a weight tensor's update
    tensor: str  # that tensor's name


def distances(run: Mapping[str, Any], ref: Mapping[str, Any], dtype: torch.dtype) -> Distances:
    """How far ``run`` trained from ``ref`` (results of ``composition_runs.fit`` from the same initial weights):
    the largest relative difference of a step's loss, and the largest over weight tensors of

        ||w - w_ref|| / (||w_ref - w_0|| + eps(dtype) ||w_ref||)

    with every tensor rounded to ``dtype`` (ZeRO's parameters are the rounding of its fp32 masters): the difference
    relative to how far ``ref`` moved the tensor, plus one unit of the dtype's resolution (an update smaller than
    that is rounded away in one run and not in the other). A tensor ``ref`` left exactly as it was (frozen, or
    never used) must be left exactly as it was in ``run`` too: infinite distance otherwise."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"], strict=True))
    eps = torch.finfo(dtype).eps
    by_tensor = {}
    for name, expected in ref["weights"].items():
        initial, got = ref["initial"][name], run["weights"][name]
        if torch.equal(expected, initial):
            by_tensor[name] = 0.0 if torch.equal(got.to(dtype), initial.to(dtype)) else float("inf")
            continue
        target = expected.to(dtype).float()
        moved = (target - initial.to(dtype).float()).norm() + eps * target.norm()
        by_tensor[name] = float((got.to(dtype).float() - target).norm() / moved)
    worst = max(by_tensor, key=lambda n: (by_tensor[n] != by_tensor[n], by_tensor[n]))  # NaN first
    return Distances(loss, by_tensor[worst], worst)
