"""``MemoryReport``: a Lightning callback that shows, per rank, what the model state costs and what a step sends.

At the end of training every rank measures its model-state bytes (parameters, gradients, fp32 master weights,
optimizer state), its peak memory and the bytes it sent in the last optimizer step per collective; rank 0 prints one
row per rank and can write the numbers as JSON and a PNG bar chart of memory by ZeRO stage::

    trainer = pl.Trainer(strategy="zero2", devices=2, callbacks=[MemoryReport(plot_path="memory.png")])

With ``log_every_n_steps=N`` the same per-rank figures also go through the Trainer's loggers (TensorBoard, CSV, ...)
every N optimizer steps, beside the loss: ``memory/rank{r}/{parameters,gradients,master_weights,optimizer_state,
model_state,peak_memory}`` and ``comm/rank{r}/{reduce_scatter,all_gather,all_reduce}`` (bytes sent in the last step).

Works with any strategy. ``ZeroStrategy`` reports its own counts; for other strategies (DDP, single device) the
tensors are counted directly and DDP's all-reduce is shown as its bandwidth-optimal size, 2Ψ(N-1)/N gradient bytes
(marked ``*``), since DDP does not record what it sends.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from typing_extensions import override

from lightning_zero.comm.pending_collective import Collective
from lightning_zero.comm.topology import LINKS
from lightning_zero.compat import batches_that_stepped
from lightning_zero.engine.memory import ModelStateBytes
from lightning_zero.engine.throughput import StepThroughput, ThroughputSummary, compute_dtype
from lightning_zero.trainer.fit_report import FitReport, RankReport
from lightning_zero.trainer.report_plot import (
    STAGE_NAMES,
    plot_memory_by_stage,
    report_bars,
    require_matplotlib,
)
from lightning_zero.trainer.strategy import ZeroStrategy

COLLECTIVES: tuple[str, ...] = tuple(c.value for c in Collective)


class MemoryReport(pl.Callback):
    """Print per-rank model-state memory and communication when training ends; optionally save JSON and a chart.

    Args:
        json_path: where rank 0 writes the report as JSON; relative paths are relative to the trainer's
            ``default_root_dir``. None: not written.
        plot_path: where rank 0 writes a PNG bar chart of model-state memory per rank for every stage (the paper's
            formula for this model and world size, next to what this run measured). Needs matplotlib
            (``pip install "lightning-zero[plot]"``). None: no chart.
        log_every_n_steps: every this many optimizer steps, every rank measures and rank 0 logs all ranks' figures
            through ``trainer.loggers`` at Lightning's own step, so they line up with the loss, and its throughput
            (``throughput/*``). None: not logged. Each time is one small all-gather on every rank.
        peak_flops: the device's peak FLOPS for MFU where Lightning's table has none (a CPU, an unlisted GPU).
    """

    def __init__(
        self,
        json_path: str | Path | None = None,
        plot_path: str | Path | None = None,
        log_every_n_steps: int | None = None,
        peak_flops: float | None = None,
    ) -> None:
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                f"Invalid MemoryReport.log_every_n_steps: {log_every_n_steps!r}. Expected a positive int "
                "(optimizer steps between two logged measurements), or None not to log."
            )
        if plot_path is not None:
            require_matplotlib()
        self.log_every_n_steps = log_every_n_steps
        self._last_logged_step = -1
        self.json_path = None if json_path is None else Path(json_path)
        self.plot_path = None if plot_path is None else Path(plot_path)
        self.report: FitReport | None = None
        """Set on every rank at the end of training (the rows of other ranks are gathered on all of them)."""
        self.peak_flops = peak_flops
        self._throughput: StepThroughput | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        recomputes = isinstance(strategy, ZeroStrategy) and strategy.config.activation_checkpointing_policy is not None
        self._throughput = StepThroughput(recomputation=recomputes)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Lightning runs the forward and backward inside optimizer.step(closure), after the step's pre-hooks: this
        # hook is where they are done. Once per step, whatever the number of optimizers.
        if self._throughput is not None and optimizer is trainer.optimizers[0]:
            self._throughput.on_step()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        if self._throughput is not None:
            self._throughput.on_batch(batch)

    def throughput(self, trainer: pl.Trainer) -> ThroughputSummary | None:
        """This rank's throughput so far (Note [throughput from the real step])."""
        if self._throughput is None:
            return None
        dtype = compute_dtype(str(trainer.precision))
        return self._throughput.summary(trainer.world_size, trainer.strategy.root_device, dtype, self.peak_flops)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        # Every rank sees the same global_step, so every rank joins the all-gather at the same batch; under
        # gradient accumulation the batches between two optimizer steps do not measure again.
        if self.log_every_n_steps is None or step == self._last_logged_step or step % self.log_every_n_steps:
            return
        self._last_logged_step = step
        rows = _gather_rows(_measure(trainer, pl_module).to(trainer.strategy.root_device))
        if not trainer.is_global_zero or not trainer.loggers:
            return
        metrics = step_metrics(_row_to_report(r, row) for r, row in enumerate(rows.tolist()))
        throughput = self.throughput(trainer)
        metrics.update(throughput.metrics() if throughput is not None else {})
        # Lightning logs this batch's loss at the count of batches that stepped before this one (private, but it is
        # the step the loggers already hold for the loss); the same step puts these figures on the loss's row/x.
        logged_step = batches_that_stepped(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=logged_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Measured here, while optimizers and the process group are alive; printed in on_fit_end, after the
        # progress bar has closed, so the table is not interleaved with it.
        rows = _gather_rows(_measure(trainer, pl_module).to(trainer.strategy.root_device))
        params = list(pl_module.parameters())  # tied weights once
        throughput = self.throughput(trainer)
        if self._throughput is not None:
            self._throughput.close()
        if throughput is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(throughput.metrics(), step=batches_that_stepped(trainer))
        self.report = FitReport(
            strategy=type(trainer.strategy).__name__,
            stage=_stage_of(trainer.strategy),
            world_size=trainer.world_size,
            num_params=_num_params(trainer, params),
            param_bytes=params[0].element_size() if params else 4,
            peak_memory_kind="peak CUDA allocated" if trainer.strategy.root_device.type == "cuda" else "peak RSS",
            sent_is_estimate=not isinstance(trainer.strategy, ZeroStrategy) and trainer.world_size > 1,
            ranks=[_row_to_report(r, row) for r, row in enumerate(rows.tolist())],
            throughput=throughput,
        )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.report is None or not trainer.is_global_zero:
            return
        print(format_report(self.report), flush=True)
        root = Path(trainer.default_root_dir)
        if self.json_path is not None:
            path = root / self.json_path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.report.to_json())
        if self.plot_path is not None:
            path = root / self.plot_path
            path.parent.mkdir(parents=True, exist_ok=True)
            title = (
                f"{self.report.num_params:,} parameters ({self.report.param_bytes} bytes each) on "
                f"{self.report.world_size} ranks: formula per stage, and this run"
            )
            plot_memory_by_stage(report_bars(self.report), path, title)
            print(f"memory chart written to {path}", flush=True)


def step_metrics(ranks: Iterable[RankReport]) -> dict[str, float]:
    """The logger keys of every rank's figures: ``memory/rank{r}/<kind>`` and ``comm/rank{r}/<collective>``."""
    metrics: dict[str, float] = {}
    for r in ranks:
        state = r.model_state
        kinds = {**state._asdict(), "model_state": state.total, "peak_memory": r.peak_memory}
        kinds.update({f"{tier}_tier": nbytes for tier, nbytes in r.tiers.items()})
        metrics.update({f"memory/rank{r.rank}/{kind}": float(v) for kind, v in kinds.items()})
        metrics.update({f"comm/rank{r.rank}/{c}": float(r.sent.get(c, 0)) for c in COLLECTIVES})
    return metrics


# -- measuring -------------------------------------------------------------------------------------------------------
_FIELDS = 8  # the model state's 5, peak_memory, intra_node, inter_node; then one per collective, one per tier
TIERS = ("device", "host", "disk")


def _measure(trainer: pl.Trainer, module: pl.LightningModule) -> Tensor:
    strategy = trainer.strategy
    tiers = (0, 0, 0)
    if isinstance(strategy, ZeroStrategy):
        state = strategy.model_state_bytes()
        sent = strategy.communication_per_step()
        links = [sum(strategy.communication_per_step(link).values()) for link in LINKS]
        tiers = tuple(strategy.tier_bytes())  # type: ignore[assignment]
    else:
        state = _count_model_state(module, trainer.optimizers)
        sent = {}
        links = [0, 0]
        if trainer.world_size > 1 and isinstance(strategy, DDPStrategy):
            # DDP all-reduces every gradient once per step; bandwidth-optimal bytes sent: 2 * size * (N-1) / N.
            n = trainer.world_size
            sent = {Collective.ALL_REDUCE.value: 2 * state.gradients * (n - 1) // n}
    values = [*state, _peak_memory(strategy.root_device), *links, *(sent.get(c, 0) for c in COLLECTIVES), *tiers]
    return torch.tensor(values, dtype=torch.int64)


def _gather_rows(local: Tensor) -> Tensor:
    """Every rank's row, in rank order: (world, fields). A plain all-gather: the numbers need no autograd."""
    if not (dist.is_available() and dist.is_initialized()):
        return local.cpu().unsqueeze(0)
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)
    return torch.stack(rows).cpu()


def _row_to_report(rank: int, row: Sequence[int]) -> RankReport:
    params, grads, masters, state, secondary, peak, intra, inter = row[:_FIELDS]
    sent = dict(zip(COLLECTIVES, row[_FIELDS : _FIELDS + len(COLLECTIVES)], strict=True))
    by_tier = row[_FIELDS + len(COLLECTIVES) :]
    tiers = dict(zip(TIERS, by_tier, strict=True)) if any(by_tier[1:]) else {}
    return RankReport(rank, params, grads, masters, state, peak, sent, secondary, intra, inter, tiers)


def _num_params(trainer: pl.Trainer, params: Sequence[Tensor]) -> int:
    if all(p.numel() > 0 for p in params):
        return sum(p.numel() for p in params)
    # Outside forward, stage-3 parameters are empty placeholders; the flat buckets know the real sizes.
    buckets = [b for optimizer in trainer.strategy.optimizers for b in getattr(optimizer, "buckets", ())]
    return sum(int(b.numel) for b in buckets)


def _count_model_state(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> ModelStateBytes:
    params = list(module.parameters())  # tied weights once
    parameters = sum(p.numel() * p.element_size() for p in params)
    # Gradients live from backward until zero_grad frees them; count what a step holds, whether or not they exist
    # at this moment (Lightning may already have set them to None).
    gradients = sum((p.grad if p.grad is not None else p).nbytes for p in params if p.requires_grad)
    # Zero-dim entries (Adam's step counter) are bookkeeping, not per-parameter state.
    state = sum(
        v.numel() * v.element_size()
        for optimizer in optimizers
        for per_param in optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, Tensor) and v.dim() > 0
    )
    return ModelStateBytes(parameters, gradients, 0, state)


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _stage_of(strategy: pl.strategies.Strategy) -> int | None:
    if isinstance(strategy, ZeroStrategy):
        return int(strategy.config.stage)
    if isinstance(strategy, DDPStrategy):
        return 0
    return None


# -- showing ---------------------------------------------------------------------------------------------------------
def format_bytes(nbytes: float) -> str:
    """Decimal units (kB, MB, GB), as the ZeRO paper counts."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def format_report(report: FitReport) -> str:
    what = STAGE_NAMES.get(report.stage, report.strategy) if report.stage is not None else report.strategy
    secondary = any(r.secondary_shards for r in report.ranks)
    header = ["rank", "params", "grads", "fp32 master", "optim state", *(["hpZ secondary"] if secondary else [])]
    header += ["model state", report.peak_memory_kind]
    sent_columns = [c for c in COLLECTIVES if any(r.sent.get(c, 0) for r in report.ranks)]
    mark = "*" if report.sent_is_estimate else ""
    header += [f"{c}{mark}" for c in sent_columns]
    by_link = any(r.inter_node for r in report.ranks)
    header += ["to own node", "to other nodes"] if by_link else []
    tiered = any(r.tiers for r in report.ranks)
    header += [f"{t} tier" for t in TIERS] if tiered else []
    rows = [
        [
            str(r.rank),
            *(format_bytes(v) for v in r.model_state[: 5 if secondary else 4]),
            format_bytes(r.model_state.total),
            format_bytes(r.peak_memory),
            *(format_bytes(r.sent[c]) for c in sent_columns),
            *([format_bytes(r.intra_node), format_bytes(r.inter_node)] if by_link else []),
            *((format_bytes(r.tiers.get(t, 0)) for t in TIERS) if tiered else ()),
        ]
        for r in report.ranks
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        f"Model state and communication per rank: {what}, {report.world_size} rank(s), "
        f"{report.num_params:,} parameters ({report.param_bytes} bytes each)",
        "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
        *("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows),
    ]
    if tiered:
        lines.append(
            "tier columns: model state by where it lives between uses (ZeroConfig.offload_*); the model-state "
            "columns count only what is in memory now"
        )
    if report.throughput is not None:
        lines.append(report.throughput.describe())
    if sent_columns:
        lines.append(
            "collective columns: bytes this rank sent in the last optimizer step"
            + (" (* DDP's bandwidth-optimal all-reduce, 2Ψ(N-1)/N, not measured)" if mark else "")
            + ("; to own node / to other nodes: the same bytes by where they went" if by_link else "")
        )
    return "\n".join(lines)
