"""The GPU check's throughput section: what the strategy costs at world size 1, where there is nothing to shard and
everything it does beyond the model's own work is overhead.

A GPT of 125M parameters (width 768, 12 blocks, vocab 50304, seq 1024, batch 8: small blocks, so the host's work per
unit shows) and the 1.3B GPT of ``gpt.py`` (width 2048, 24 blocks, vocab 32768, seq 1024, batch 8), trained through
the Lightning ``Trainer`` in bf16-mixed on random tokens under six strategies: the unsharded model (Lightning's
single-device strategy), DDP, our ``zero1``, ``zero2`` and ``zero3``, and FSDP2 (``fully_shard`` per block and on
the root, bf16 parameters and fp32 reduction); first eagerly, then with every block compiled (``Block.compile()``,
before FSDP2 shards it, as torchtitan orders the two). Per run: the median step time of the timed steps (the GPU's
work included: each step ends with a synchronize), tokens/s, and the model FLOPs utilization

    MFU = tokens/s x (6 N + 12 L d T) / peak,   N parameters without the position table, L blocks, d width, T seq,

against the GPU's dense bf16 peak (``PEAK_BF16``; None for a GPU not listed there, and on the CPU). The section's
checks are the goals: zero3 within ``ZERO3_OVER_FSDP2`` of FSDP2's step time and within ``ZERO3_OVER_UNSHARDED`` of
the unsharded model's, eager, at both sizes.

Each size runs in one fresh rank, its runs one after the other in that process (a model and its optimizer are
dropped, and the CUDA cache emptied, before the next), so the section pays the start of a process twice, not
twenty-four times; each run is noted as it ends, so a size cut short by the budget still reports what finished. The
dry mode (``--device cpu --dry``) runs the tiny GPT of ``gpt.py`` through the same code, compiled with ``aot_eager``
(dynamo's tracing and the graph breaks at unit boundaries, without waiting for a C++ compiler) and only under zero3
and FSDP2, whose hooks meet the compiled blocks (the test suite's time).

Not yet run on a GPU. The full check leaves it little time; run it alone:

    bash scripts/gpu_check.sh --only gpt_throughput OUT
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from gpu_check.common import Config, brief, note, ranks
from gpu_check.gpt import CheckGPT, Timer, num_parameters, shape

Batch = tuple[Tensor, Tensor]
VARIANTS = ("unsharded", "ddp", "zero1", "zero2", "zero3", "fsdp2")
PEAK_BF16 = {"H200": 989.4e12, "H100 PCIe": 756.0e12, "H100": 989.4e12, "A100": 312.0e12}
"""Dense bf16 tensor-core FLOP/s by device name (the first key the name contains wins; SXM parts unless named)."""
ZERO3_OVER_FSDP2 = 1.00
ZERO3_OVER_UNSHARDED = 1.03


def sizes(config: Config) -> dict[str, dict[str, int]]:
    if config.dry:
        return {"tiny": shape(config, 2)}
    small = {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}
    return {"125m": small, "1.3b": shape(config, 24)}


def flops_per_token(gpt: dict[str, int]) -> int:
    """6 N + 12 L d T: the matmuls' FLOPs per token in forward and backward (PaLM's estimate, nanoGPT's MFU)."""
    params = num_parameters(gpt) - gpt["block_size"] * gpt["n_embd"]
    return 6 * params + 12 * gpt["n_layer"] * gpt["n_embd"] * gpt["block_size"]


def peak_flops(name: str) -> float | None:
    return next((flops for key, flops in PEAK_BF16.items() if key in name), None)


def _strategy(variant: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_zero import ZeroStrategy

    if variant == "unsharded":
        return "auto"
    if variant == "ddp":
        return DDPStrategy()
    if variant == "fsdp2":
        return ModelParallelStrategy(1, 1)  # type: ignore[arg-type]
    return ZeroStrategy(stage=int(variant[-1]))


def _fit(config: Config, variant: str, gpt: dict[str, int], batch: int, compile_with: str | None) -> dict[str, Any]:
    warmup, steps = (1, 1) if config.dry else (3 if compile_with else 2, 6)
    timer = Timer(warmup)
    trainer = pl.Trainer(
        strategy=_strategy(variant),
        accelerator="gpu" if config.device == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    module = CheckGPT(gpt, batch, warmup + steps, variant == "fsdp2", fused=False, compile_with=compile_with)
    trainer.fit(module)
    timed = timer.times[warmup:]
    median = statistics.median(timed)
    tokens_per_s = batch * gpt["block_size"] / median
    name = torch.cuda.get_device_name(0) if config.device == "cuda" else "cpu"
    peak = peak_flops(name) if config.device == "cuda" else None
    result = {
        "median_step_s": median,
        "step_s": timer.times,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token(gpt) / peak if peak else None,
        "losses": timer.losses,
    }
    if config.device == "cuda":
        result["steady_peak_allocated"] = timer.steady_peak
    return result


def _size(config: Config, size: str, gpt: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Every variant of one size, eager then compiled, in this rank, one after the other."""
    batch = 2 if config.dry else 8
    groups: dict[str, dict[str, Any]] = {}
    for mode in ("eager", "compiled"):
        compile_with = None if mode == "eager" else "aot_eager" if config.dry else "inductor"
        variants = ("zero3", "fsdp2") if config.dry and compile_with else VARIANTS
        runs = groups[mode] = {}
        for variant in variants:
            start = time.perf_counter()
            try:
                runs[variant] = _fit(config, variant, gpt, batch, compile_with)
            except Exception as error:
                runs[variant] = {"error": f"{type(error).__name__}: {error}"[:1500]}
            runs[variant]["seconds"] = round(time.perf_counter() - start, 1)
            note(config, size=size, mode=mode, variant=variant, result=runs[variant])
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            torch._dynamo.reset()  # each variant compiles its own blocks
    return groups


def gpt_throughput(config: Config) -> dict[str, Any]:
    result: dict[str, Any] = {"flops_per_token": {size: flops_per_token(gpt) for size, gpt in sizes(config).items()}}
    checks: list[str] = []
    for index, (size, gpt) in enumerate(sizes(config).items()):
        share = config.left() / (len(sizes(config)) - index)
        try:
            (groups,) = ranks(config, _size, 1, size, gpt, timeout=share)
        except Exception as error:
            result[size] = {"error": brief(error)}
            checks.append(f"{size}: {brief(error)}")
            continue
        for mode, runs in groups.items():
            result[f"{size} {mode}"] = runs
            checks += _ratios(config, f"{size} {mode}", runs)
    return {"result": result, "failed_checks": checks}


def _ratios(config: Config, key: str, runs: dict[str, Any]) -> list[str]:
    """Adds zero3's step time over FSDP2's and over the unsharded model's to ``runs``; returns the failed runs and,
    eager on a GPU, the goals missed."""
    checks = [f"{key} {v}: {r['error'][:200]}" for v, r in runs.items() if "error" in r]
    zero3, fsdp2, unsharded = (runs.get(v, {}).get("median_step_s") for v in ("zero3", "fsdp2", "unsharded"))
    goals = config.device == "cuda" and key.endswith("eager")
    if zero3 and fsdp2:
        runs["zero3_over_fsdp2"] = ratio = zero3 / fsdp2
        if goals and ratio > ZERO3_OVER_FSDP2:
            checks.append(f"{key}: zero3 {ratio:.3f}x FSDP2's step time (goal {ZERO3_OVER_FSDP2})")
    if zero3 and unsharded:
        runs["zero3_over_unsharded"] = ratio = zero3 / unsharded
        if goals and ratio > ZERO3_OVER_UNSHARDED:
            checks.append(f"{key}: zero3 {ratio:.3f}x the unsharded step (goal {ZERO3_OVER_UNSHARDED})")
    return checks
