"""``Trainer(sync_batchnorm=True)``: BatchNorm layers become ``SyncBatchNorm`` as under DDP, at every stage.

torch's ``SyncBatchNorm`` runs only on accelerators: on the CPU its forward refuses the input and its kernels
(``aten::batch_norm_stats`` & co.) have no CPU implementation. To compare numbers on CPU ranks, the parity test gives
those five kernels a CPU implementation in plain torch (registered with ``torch.library``) and lets the CPU through
torch's device check, in DDP's runs and ZeRO's alike; ``test_sync_batchnorm_on_cpu_is_refused_as_under_ddp`` checks
that without them both refuse the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

from tests.harness import run_distributed
from tests.third_party_models import ProbeModule, full_state

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


def _channels_last(x: Tensor) -> Tensor:
    """(N, C, *) as (C, N * prod(*))."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _shape_like(v: Tensor, x: Tensor) -> Tensor:
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _stats(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    flat = _channels_last(x).double()
    mean = flat.mean(1)
    var = flat.var(1, unbiased=False)
    return mean.to(x.dtype), torch.rsqrt(var + eps).to(x.dtype)


def _gather_stats(
    x: Tensor,
    mean_all: Tensor,
    invstd_all: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: float,
    eps: float,
    counts: Tensor,
) -> tuple[Tensor, Tensor]:
    counts = counts.double().view(-1, 1)
    total = counts.sum()
    means = mean_all.double()
    variances = 1.0 / invstd_all.double() ** 2 - eps
    mean = (counts * means).sum(0) / total
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
    if running_var is not None:
        unbiased = var * total / (total - 1)
        running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
    return mean.to(x.dtype), torch.rsqrt(var + eps).to(x.dtype)


def _elemt(x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, invstd: Tensor, eps: float) -> Tensor:
    out = (x - _shape_like(mean, x)) * _shape_like(invstd, x)
    if weight is not None:
        out = out * _shape_like(weight, x)
    if bias is not None:
        out = out + _shape_like(bias, x)
    return out


def _backward_reduce(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    input_g: bool,
    weight_g: bool,
    bias_g: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    sum_dy = _channels_last(dy).sum(1)
    sum_dy_xmu = _channels_last(dy * (x - _shape_like(mean, x))).sum(1)
    return sum_dy, sum_dy_xmu, sum_dy_xmu * invstd, sum_dy.clone()


def _backward_elemt(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sum_dy: Tensor,
    sum_dy_xmu: Tensor,
    count: Tensor,
) -> Tensor:
    total = count.sum().to(dy.dtype)
    scale = invstd if weight is None else invstd * weight
    xmu = x - _shape_like(mean, x)
    return (dy - _shape_like(sum_dy / total, x) - xmu * _shape_like(invstd**2 * sum_dy_xmu / total, x)) * _shape_like(
        scale, x
    )


@contextmanager
def sync_batchnorm_on_cpu() -> Iterator[None]:
    """Give torch's ``SyncBatchNorm`` CPU kernels (its own math, in plain torch) and let CPU inputs through."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("batch_norm_stats", _stats, "CPU")
    library.impl("batch_norm_gather_stats_with_counts", _gather_stats, "CPU")
    library.impl("batch_norm_elemt", _elemt, "CPU")
    library.impl("batch_norm_backward_reduce", _backward_reduce, "CPU")
    library.impl("batch_norm_backward_elemt", _backward_elemt, "CPU")
    # SyncBatchNorm.forward accepts "cuda", "hpu", "xpu" and the private-use backend's name.
    backend_name = torch._C._get_privateuse1_backend_name
    torch._C._get_privateuse1_backend_name = lambda: "cpu"  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch._C._get_privateuse1_backend_name = backend_name  # type: ignore[attr-defined]
        library._destroy()


def _norms(module: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})


class _Probe(ProbeModule):
    def on_train_start(self) -> None:
        self.trained_with = _norms(self)


class _ValidatedProbe(_Probe):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        assert self.model is not None
        assert self._loss is not None
        self._loss(self.model, batch)

    def val_dataloader(self) -> Any:
        return self.train_dataloader()


def _trainer(strategy: str, sync_batchnorm: bool, steps: int) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        sync_batchnorm=sync_batchnorm,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _fit(strategy: str, sync_batchnorm: bool, steps: int = 4, build_in: str = "init") -> dict[str, Any]:
    import lightning_zero  # noqa: F401  (registers "zero1", "zero2", "zero3")

    module = _Probe("batchnorm_mlp", steps=steps, build_in=build_in)  # type: ignore[arg-type]
    trainer = _trainer(strategy, sync_batchnorm, steps)
    trainer.fit(module)
    assert module.model is not None
    weights, buffers = full_state(trainer, module.model)
    after = _norms(module)
    return {
        "losses": module.losses,
        "weights": weights,
        "buffers": buffers,
        "norms": module.trained_with,
        "after": after,
    }


def _runs() -> dict[str, dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_zero.trainer import strategy_processes

    # Both strategies' refusal of SyncBatchNorm on the CPU, lifted now that it has CPU kernels.
    ddp_refusal = DistributedDataParallel._passing_sync_batchnorm_handle
    zero_refusal = strategy_processes.refuse_sync_batchnorm_on_cpu
    DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None  # type: ignore[method-assign]
    strategy_processes.refuse_sync_batchnorm_on_cpu = lambda module, device: None
    try:
        with sync_batchnorm_on_cpu():
            runs = {s: _fit(s, sync_batchnorm=True) for s in STRATEGIES}
            # Stage 3 on the meta device: BatchNorm built there, converted, then materialized and sharded.
            runs["zero3_meta"] = _fit("zero3", sync_batchnorm=True, build_in="configure_model")
    finally:
        DistributedDataParallel._passing_sync_batchnorm_handle = ddp_refusal  # type: ignore[method-assign]
        strategy_processes.refuse_sync_batchnorm_on_cpu = zero_refusal
    runs["ddp_unsynced"] = _fit("ddp", sync_batchnorm=False)
    return runs


def _assert_close(candidate: dict[str, Any], reference: dict[str, Any], label: str) -> None:
    torch.testing.assert_close(
        torch.tensor(candidate["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6, msg=label
    )
    for kind in ("weights", "buffers"):
        assert candidate[kind].keys() == reference[kind].keys(), label
        for name, expected in reference[kind].items():
            torch.testing.assert_close(candidate[kind][name], expected, rtol=1e-5, atol=1e-6, msg=f"{label} {name}")


@pytest.mark.timeout(180)
def test_sync_batchnorm_matches_ddp_at_every_stage():
    ranks = run_distributed(_runs, 2, init_process_group=False, timeout=170)
    for rank, runs in enumerate(ranks):
        reference = runs["ddp"]
        assert reference["norms"] == ["SyncBatchNorm"]
        for strategy in STRATEGIES[1:]:
            assert runs[strategy]["norms"] == ["SyncBatchNorm"], strategy
            _assert_close(runs[strategy], reference, f"rank {rank} {strategy}")
        # Reverted after the fit as DDP does (Lightning's _BatchNormXd), except stage 3's sharded model keeps its
        # layers (Note [teardown keeps the model sharded]).
        for strategy in ("ddp", "zero1", "zero2"):
            assert runs[strategy]["after"] == ["_BatchNormXd"], strategy
        assert runs["zero3"]["after"] == ["SyncBatchNorm"]
        assert runs["zero3_meta"]["norms"] == ["SyncBatchNorm"]
        assert all(torch.isfinite(torch.tensor(runs["zero3_meta"]["losses"])))
        # The ranks train on different batches, so synchronized statistics are not what each rank sees alone.
        unsynced = runs["ddp_unsynced"]
        assert unsynced["norms"] == ["BatchNorm1d"]
        assert not torch.allclose(torch.tensor(unsynced["losses"]), torch.tensor(reference["losses"]), rtol=1e-4)
        assert not torch.allclose(unsynced["buffers"]["1.running_mean"], reference["buffers"]["1.running_mean"])
    assert ranks[0]["ddp"]["losses"] != ranks[1]["ddp"]["losses"]
    # Synchronized statistics are the same on both ranks; DDP's own also match across ranks.
    for strategy in [*STRATEGIES, "zero3_meta"]:
        for name, value in ranks[0][strategy]["buffers"].items():
            torch.testing.assert_close(ranks[1][strategy]["buffers"][name], value, msg=f"{strategy} {name}")


def _refusal(strategy: str) -> str:
    try:
        _fit(strategy, sync_batchnorm=True, steps=1)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(120)
def test_sync_batchnorm_on_cpu_is_refused_as_under_ddp():
    ranks = run_distributed(_refusals, 2, init_process_group=False, timeout=110)
    for errors in ranks:
        assert errors["ddp"] == "SyncBatchNorm layers only work with GPU modules", errors
        for strategy in STRATEGIES[1:]:
            assert errors[strategy].startswith("SyncBatchNorm layers only work with GPU modules ('model.1' is on"), (
                strategy,
                errors,
            )
            assert "HINT:" in errors[strategy]
        assert errors["zero3_after_validate"].startswith("Trainer(sync_batchnorm=True) cannot convert 'model.1'")


def _refusals() -> dict[str, str]:
    errors = {s: _refusal(s) for s in STRATEGIES}
    # Stage 3 sharded the model in a validate without converting it; a later fit cannot replace its layers.
    module = _ValidatedProbe("batchnorm_mlp", steps=1)
    trainer = _trainer("zero3", sync_batchnorm=True, steps=1)
    trainer.validate(module)
    try:
        trainer.fit(module)
    except ValueError as error:
        errors["zero3_after_validate"] = str(error)
    return errors


def test_cpu_kernels_agree_with_batch_norm_on_one_rank():
    """The test's CPU kernels are BatchNorm's math: one rank's SyncBatchNorm path equals ``F.batch_norm``."""
    from torch.nn.modules._functions import SyncBatchNorm

    class _OneRank:
        def _get_backend_name(self) -> str:
            return "gloo"

    torch.manual_seed(0)
    x = torch.randn(8, 5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    rm2, rv2 = rm.clone(), rv.clone()
    ref = torch.nn.functional.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
    grads = torch.autograd.grad(ref.square().sum(), (x, w, b))

    def fake_all_gather(out: list[Tensor], t: Tensor, *args: Any, **kwargs: Any) -> None:
        out[0].copy_(t)

    def fake_all_reduce(t: Tensor, *args: Any, **kwargs: Any) -> None:
        pass

    original = torch.distributed.all_gather, torch.distributed.all_reduce
    torch.distributed.all_gather, torch.distributed.all_reduce = fake_all_gather, fake_all_reduce  # type: ignore[assignment]
    with sync_batchnorm_on_cpu():
        try:
            out = SyncBatchNorm.apply(x, w, b, rm2, rv2, 1e-5, 0.1, _OneRank(), 1)
            sync_grads = torch.autograd.grad(out.square().sum(), (x, w, b))
        finally:
            torch.distributed.all_gather, torch.distributed.all_reduce = original  # type: ignore[assignment]
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(rm2, rm)
    torch.testing.assert_close(rv2, rv)
    for got, expected in zip(sync_grads, grads, strict=True):
        torch.testing.assert_close(got, expected)
