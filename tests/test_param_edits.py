"""Note [edits reach the masters] (``sharding/param_edits.py``): parameters edited between steps, by any writer, are
what the next step starts from, with and without the host tier; a steady step reads no parameter back to the host
(the host tier's copies counted as ``tests/host_syncs.py`` counts reads)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero import DynamicLossScaler, ZeroConfig, ZeroOptimizer
from lightning_zero.offload import host_copies
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.param_edits import digest
from lightning_zero.stage3.sharded_init import shard_module
from tests.harness import run_distributed
from tests.offload_runs import forced_host_copies

PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
EDITS = ("writeback", "load_state_dict", "ema_swap", "clamp", "reassign")


@contextmanager
def parameter_reads(buckets: list[FlatBucket]) -> Iterator[list[str]]:
    """The host tier's copies (``CopyStream.copy``, every copy between the device and host buffers) whose source
    is a parameter shard, while the context is open."""
    shards = {int(b.param_shard.untyped_storage()._cdata) for b in buckets}
    reads: list[str] = []
    copy = host_copies.CopyStream.copy

    def counted(self: host_copies.CopyStream, dst: Tensor, src: Tensor) -> host_copies.Copy:
        if int(src.untyped_storage()._cdata) in shards:
            reads.append(f"{src.numel()} elements")
        return copy(self, dst, src)

    host_copies.CopyStream.copy = counted  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        host_copies.CopyStream.copy = copy  # type: ignore[method-assign]


def _edited_run(stage: int, precision: str, edit: str, tier: bool) -> dict[str, Any]:
    """Two steps, the edit (every parameter set to exactly representable values), a step with lr 0: whether the
    parameters still hold the edit, and the parameter reads of the host tier in the steady and the edited step."""
    dtype = PRECISIONS[precision]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)).to(dtype)
    config = ZeroConfig(stage=stage, bucket_numel=50, offload_optimizer="cpu" if tier else "none")
    tiers = MemoryTiers(config, None, 2) if tier else None
    group = dist.group.WORLD
    gatherer = shard_module(model, config, group, torch.device("cpu"), tiers=tiers) if stage == 3 else None
    scaler = DynamicLossScaler(scale=2.0**8) if dtype == torch.float16 else None
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer = ZeroOptimizer(
        model,
        inner,
        group,
        config,
        gatherer,
        fp32_masters=dtype != torch.float32,
        loss_scaler=scaler,
        tiers=tiers.for_optimizer() if tiers is not None else None,
    )

    def step() -> None:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank())).to(dtype)
        loss = model(x).float().square().mean()
        (loss * (scaler.scale if scaler is not None else 1.0)).backward()
        optimizer.step()
        optimizer.zero_grad()

    def gathered(writeback: bool = False) -> Any:
        return gatherer.gathered(writeback=writeback) if gatherer is not None else nullcontext()

    try:
        step()
        with parameter_reads(optimizer.buckets) as steady:
            step()
        edited = {n: (torch.arange(p.numel()).view(p.shape) % 7 - 3).to(dtype) / 8 for n, p in model.named_parameters()}
        with gathered(writeback=True), torch.no_grad():
            if edit == "load_state_dict":
                model.load_state_dict(edited)
            for name, param in model.named_parameters():
                if edit == "writeback":
                    param.copy_(edited[name])
                elif edit == "ema_swap":  # through .data, as Lightning's WeightAveraging swaps: no version counter
                    param.data.copy_(edited[name])
                elif edit == "clamp":  # WGAN's weight clipping, through .data too, after the values are set
                    param.data.copy_(edited[name] * 2)
                    param.data.clamp_(-0.25, 0.25)
                    edited[name] = (edited[name] * 2).clamp(-0.25, 0.25)
                elif edit == "reassign":
                    param.data = edited[name].clone()
        for group_ in inner.param_groups:
            group_["lr"] = 0.0
        with parameter_reads(optimizer.buckets) as after_edit:
            step()
        with gathered():
            survived = all(torch.equal(p, edited[n]) for n, p in model.named_parameters())
        return {"survived": survived, "steady": steady, "after_edit": after_edit, "flagged": optimizer.edits.flagged}
    finally:
        if tiers is not None:
            tiers.close()


def _runs(tier: bool, cases: list[tuple[int, str, str]]) -> dict[str, dict[str, Any]]:
    with forced_host_copies() if tier else nullcontext():
        return {f"stage{s}/{p}/{e}": _edited_run(s, p, e, tier) for s, p, e in cases}


@pytest.mark.timeout(200)
def test_edits_between_steps_reach_the_host_tier_and_a_steady_step_reads_no_parameter_back():
    """The host tier's copy path (forced on the CPU): every kind of edit at every stage survives a step with lr 0;
    the steady step copies no parameter to the host, the step after the edit does (only what changed)."""
    cases = [(s, p, e) for s in (1, 2, 3) for p in ("32-true", "bf16-mixed") for e in EDITS]
    cases += [(s, "16-mixed", "ema_swap") for s in (1, 2, 3)]
    for runs in run_distributed(_runs, 2, True, cases, timeout=180):
        assert [case for case, run in runs.items() if not run["survived"]] == []
        assert {case: run["steady"] for case, run in runs.items() if run["steady"]} == {}
        assert [case for case, run in runs.items() if not run["after_edit"]] == []
        assert [case for case, run in runs.items() if run["flagged"] == 0] == []


@pytest.mark.timeout(120)
def test_edits_through_data_and_reassigned_parameters_reach_the_masters_without_tiers():
    """Without tiers: the edits no version counter sees (``.data`` writes, a reassigned ``.data``) at stages 1-3."""
    cases = [(s, p, e) for s in (1, 2, 3) for p in ("32-true", "bf16-mixed") for e in ("clamp", "reassign")]
    for runs in run_distributed(_runs, 2, False, cases, timeout=100):
        assert [case for case, run in runs.items() if not run["survived"]] == []
        mixed = [case for case in runs if "bf16" in case]
        assert [case for case in mixed if runs[case]["flagged"] == 0] == []  # found by the check, not by chance


def test_the_digest_sees_any_single_changed_element_and_only_changes():
    generator = torch.Generator().manual_seed(0)
    weights = torch.randint(1, 1 << 15, (1024, 2), generator=generator).double()
    for dtype, numel in ((torch.bfloat16, 5000), (torch.float32, 3001), (torch.float16, 1), (torch.float8_e4m3fn, 77)):
        shard = torch.randn(numel, generator=generator).to(dtype)
        before = digest(shard, weights)
        assert torch.equal(digest(shard.clone(), weights), before)
        for position in (0, numel // 2, numel - 1):
            changed = shard.clone()
            bits = changed.view(torch.uint8)
            bits[position * dtype.itemsize] ^= 1  # the lowest bit of one element
            assert not torch.equal(digest(changed, weights), before), (dtype, position)


def test_a_reassigned_parameter_of_another_shape_is_refused_naming_it():
    model = nn.Linear(4, 2)
    bucket = FlatBucket(0, 0, list(model.named_parameters()), 0, 1)
    assert not bucket.reattach()
    model.bias.data = torch.ones(2)
    assert bucket.reattach()
    assert torch.equal(bucket.data[8:10], torch.ones(2))  # type: ignore[index]
    model.weight.data = torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match=r"Parameter 'weight' was given a new tensor .* HINT"):
        bucket.reattach()
