"""The GPU check's GPT sections, at world size 1 through the Lightning ``Trainer``, bf16-mixed:

- ``stage3_vs_fsdp2``: a 1.3B-parameter GPT (width 2048, 24 blocks, vocab 32768, seq 1024, batch 8), step time and
  ``max_memory_allocated`` under ZeRO stage 3 and under FSDP2 (Lightning's ``ModelParallelStrategy`` with
  ``fully_shard`` per block and on the root, bf16 parameters and fp32 reduction as FSDP2's usual policy);
- ``offload_largest``: the ZeRO-Offload headline: the deepest GPT at width 2048 that trains 3 steps on the GPU
  without tiers, with ``offload_optimizer="cpu"``, and with ``offload_params="cpu"`` too. Each mode runs at the depth
  a byte count predicts from the GPU's and the host's free memory (bf16 parameters and gradients 4 B/parameter, fp32
  masters and Adam 12 B, host gradient and staging buffers 6 B; activations per block measured by nothing but
  a formula, so the prediction is checked by the run) and steps down a fifth while a run fails and time is left.
  Every run is a fresh process; a host-memory watchdog ends a rank before the machine runs out.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from gpu_check.common import Config, brief, memory_available, note, ranks

Batch = tuple[Tensor, Tensor]
WARMUP, STEPS = 2, 5


def shape(config: Config, n_layer: int) -> dict[str, int]:
    if config.dry:
        return {"vocab_size": 256, "block_size": 32, "n_layer": n_layer, "n_head": 2, "n_embd": 64}
    return {"vocab_size": 32768, "block_size": 1024, "n_layer": n_layer, "n_head": 16, "n_embd": 2048}


def num_parameters(gpt: dict[str, int]) -> int:
    width, vocab, seq = gpt["n_embd"], gpt["vocab_size"], gpt["block_size"]
    return gpt["n_layer"] * (12 * width * width + 13 * width) + (vocab + seq + 2) * width


class CheckGPT(pl.LightningModule):
    """A GPT on random tokens, built in ``configure_model`` (stage 3 on meta, FSDP2 sharded there too); its blocks
    compiled there with ``compile_with`` (a ``torch.compile`` backend), before FSDP2 is applied."""

    def __init__(
        self, gpt: dict[str, int], batch: int, steps: int, fsdp2: bool, fused: bool, compile_with: str | None = None
    ) -> None:
        super().__init__()
        from lightning_zero.models.gpt import GPTConfig

        self.config = GPTConfig(**gpt)
        self.batch, self.steps, self.fsdp2, self.fused = batch, steps, fsdp2, fused
        self.compile_with = compile_with
        self.model: Any = None

    def configure_model(self) -> None:
        from lightning_zero.models.gpt import GPT

        if self.model is not None:
            return
        torch.manual_seed(0)
        # FSDP2: on meta, as stage 3 builds it; Lightning's ModelParallelStrategy materializes the shards on the GPU
        # in setup (to_empty, then each module's reset_parameters): no 5 GB fp32 model initialized on the CPU first.
        with torch.device("meta") if self.fsdp2 else nullcontext():
            self.model = GPT(self.config)
        if self.compile_with is not None:
            for block in self.model.blocks:  # in place: the module (and its parameters' names) stay the same
                block.compile(backend=self.compile_with)
        if self.fsdp2:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = self.device_mesh["data_parallel"]
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(self.model, mesh=mesh, mp_policy=policy)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss: Tensor = self.model.loss(*batch)
        return loss

    def train_dataloader(self) -> DataLoader[Batch]:
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(
            self.config.vocab_size, (self.steps, self.batch, self.config.block_size + 1), generator=gen
        )
        return DataLoader([(t[:, :-1], t[:, 1:]) for t in tokens], batch_size=None)  # type: ignore[arg-type]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # fused: with the optimizer in host memory, torch's fused CPU AdamW steps the masters in one pass (Note [host
        # tier data path]); the multi-tensor default makes several passes over billions of host elements.
        return torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=self.fused or None)


class Progress(pl.Callback):
    """Notes when a run reaches each phase (seconds since the rank started it): a run killed at its budget still
    says whether building, the strategy's setup (sharding, pinning the host tiers) or the steps took the time."""

    def __init__(self, config: Config, variant: str, start: float) -> None:
        self.config, self.variant, self.start = config, variant, start
        self.phases: dict[str, float] = {}

    def _note(self, phase: str) -> None:
        self.phases[phase] = round(time.perf_counter() - self.start, 1)
        note(self.config, variant=self.variant, phase=phase, at_s=self.phases[phase])

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        self._note("building the model")

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._note("sharded, optimizers and tiers set up")

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._note("training starts")

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self._note(f"step {trainer.global_step}")


class Timer(pl.Callback):
    """Each step's wall time (the GPU's work included) and loss; peak device memory of the steady-state steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.losses = warmup, [], []  # type: ignore[var-annotated]
        self.start = 0.0
        self.steady_peak = 0

    def _sync(self, module: pl.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self._sync(module)
        if len(self.times) == self.warmup and module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self._sync(module)
        self.times.append(time.perf_counter() - self.start)
        self.losses.append(float(outputs["loss"]))
        if module.device.type == "cuda":
            self.steady_peak = torch.cuda.max_memory_allocated()


def _watch_host_memory(config: Config, floor: int) -> None:
    """Ends this rank before the host runs out (pinned host tiers can take most of it)."""

    def watch() -> None:
        while True:
            time.sleep(0.2)
            if memory_available() < floor:
                note(config, watchdog=f"host MemAvailable below {floor:,} B: rank ended")
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def train(config: Config, variant: str, gpt: dict[str, int], batch: int, warmup: int, steps: int) -> dict[str, Any]:
    """One Lightning fit of ``warmup + steps`` steps at world size 1 (runs in a rank of its own)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_zero import ZeroStrategy

    _watch_host_memory(config, max(4 << 30, memory_available() // 20))
    tiers = {"zero3": {}, "zero3_offload_optimizer": {"offload_optimizer": "cpu"},
             "zero3_offload_both": {"offload_optimizer": "cpu", "offload_params": "cpu"}}  # fmt: skip
    fsdp2 = variant == "fsdp2"
    strategy: Any = ModelParallelStrategy(1, 1) if fsdp2 else ZeroStrategy(stage=3, **tiers[variant])  # type: ignore[arg-type]
    timer = Timer(warmup)
    begin = time.perf_counter()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="gpu" if config.device == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, progress := Progress(config, variant, begin)],
    )
    module = CheckGPT(gpt, batch, warmup + steps, fsdp2, fused=variant.startswith("zero3_offload"))
    start = time.perf_counter()
    trainer.fit(module)
    timed = timer.times[warmup:]
    median = statistics.median(timed) if timed else float("nan")
    result = {
        "variant": variant,
        "parameters": num_parameters(gpt),
        "shape": gpt,
        "batch": batch,
        "step_s": timer.times,
        "median_step_s": median,
        "tokens_per_s": batch * gpt["block_size"] / median if timed else None,
        "losses": timer.losses,
        "fit_s": time.perf_counter() - start,
        "host_peak_rss_bytes": _status("VmHWM"),
        "phases_s": progress.phases,
    }
    if config.device == "cuda":
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        result["steady_peak_allocated"] = timer.steady_peak  # the timed steps only, without the model's build
        result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    return result


def stage3_vs_fsdp2(config: Config) -> dict[str, Any]:
    gpt = shape(config, 2 if config.dry else 24)
    batch = 2 if config.dry else 8
    runs: dict[str, Any] = {}
    for variant in ("zero3", "fsdp2"):
        try:
            steps = (1, 1) if config.dry else (WARMUP, STEPS)
            (runs[variant],) = ranks(config, train, 1, variant, gpt, batch, *steps, timeout=config.left() / 2 + 5)
        except Exception as error:
            runs[variant] = {"error": brief(error), "detail": f"{error}"[-3000:]}
        note(config, variant=variant, result=runs[variant])
    checks = [f"{v}: {r['error']}" for v, r in runs.items() if "error" in r]
    ratio = None
    if not checks:
        ratio = runs["zero3"]["median_step_s"] / runs["fsdp2"]["median_step_s"]
    return {"result": {"runs": runs, "zero3_step_time_over_fsdp2": ratio}, "failed_checks": checks}


# -- the ZeRO-Offload headline -------------------------------------------------------------------------------------
MODES = {  # GPU bytes per parameter, host bytes per parameter (see the module docstring), share of the time
    "zero3": (16, 0, 0.2),
    "zero3_offload_optimizer": (4, 16, 0.45),
    "zero3_offload_both": (0, 18, 0.35),
}
HOST_FRACTION = 0.7
"""Of the host's available memory, what the predicted sizes may take (the watchdog ends a rank at 5% left)."""


def _memory(config: Config) -> dict[str, int]:
    gpu = torch.cuda.mem_get_info(0)[1] if config.device == "cuda" else 8 << 30
    return {"gpu_total": gpu, "host_available": memory_available()}


def predict_layers(config: Config, mode: str, memory: dict[str, int]) -> int:
    """The deepest model whose predicted bytes fit 88% of the GPU and ``HOST_FRACTION`` of the host's available
    memory."""
    if config.dry:
        return 2
    gpu_per, host_per, _ = MODES[mode]
    one = shape(config, 1)
    per_layer = num_parameters(shape(config, 2)) - num_parameters(one)
    fixed = num_parameters(one) - per_layer
    activations = 40 * one["block_size"] * one["n_embd"]  # per block, batch 1, bf16, with the saved inputs
    logits = 8 * one["block_size"] * one["vocab_size"]
    gpu_room = 0.88 * memory["gpu_total"] - gpu_per * fixed - logits - (2 << 30)  # kernels' workspaces, context
    layers = int(gpu_room / (gpu_per * per_layer + activations))
    if host_per:
        layers = min(layers, int((HOST_FRACTION * memory["host_available"] / host_per - fixed) / per_layer))
    return max(layers, 1)


def offload_largest(config: Config) -> dict[str, Any]:
    unknown = sorted(set(config.offload_modes) - set(MODES))
    if unknown:
        raise ValueError(f"--offload-modes: unknown {unknown}; known: {list(MODES)}")
    modes = [m for m in MODES if not config.offload_modes or m in config.offload_modes]
    (memory,) = ranks(config, _memory, 1, timeout=30)
    runs: dict[str, list[dict[str, Any]]] = {}
    for index, mode in enumerate(modes):
        layers = config.offload_layers or predict_layers(config, mode, memory)
        runs[mode] = []
        while layers >= 1:
            weights = [1.0 if config.dry else MODES[m][2] for m in modes[index:]]
            share = config.left() * weights[0] / sum(weights)  # what is left, shared with the modes still to run
            if share < (2 if config.dry else 20):
                runs[mode].append({"layers": layers, "skipped": f"no time left ({config.left():.0f} s)"})
                break
            gpt = shape(config, layers)
            record: dict[str, Any] = {"layers": layers, "parameters": num_parameters(gpt)}
            try:
                steps = (1, 1) if config.dry else (1, 2)  # 3 steps: 1 + 2 timed
                (result,) = ranks(config, train, 1, mode, gpt, 1, *steps, timeout=share)
                record |= {"trained": True, **result}
            except Exception as error:
                record |= {"trained": False, "error": brief(error), "detail": f"{error}"[-1500:]}
            runs[mode].append(record)
            note(config, mode=mode, record=record)
            if record["trained"] or "did not finish" in record.get("error", ""):
                break  # a run that ran out of time says nothing about a smaller model's memory
            layers = int(layers * 0.8)
    largest = {
        mode: max((r["parameters"] for r in tries if r.get("trained")), default=None) for mode, tries in runs.items()
    }
    predicted = {mode: num_parameters(shape(config, predict_layers(config, mode, memory))) for mode in modes}
    checks = [f"{mode}: no size trained ({tries[-1].get('error') or tries[-1].get('skipped')})"
              for mode, tries in runs.items() if tries and largest[mode] is None]  # fmt: skip
    result = {"memory": memory, "predicted_parameters": predicted, "largest_trained_parameters": largest, "runs": runs}
    return {"result": result, "failed_checks": checks}
