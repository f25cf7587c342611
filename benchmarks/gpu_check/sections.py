"""The GPU check's sections about the machine and correctness: environment, gloo on CUDA, the ``gpu`` tests, host
synchronizations. Each section runs in the orchestrator and starts its own ranks (``common.ranks``)."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpu_check.common import ROOT_OF, Config, environment_variables, memory_available, nccl_or_gloo, note, ranks


# -- environment -------------------------------------------------------------------------------------------------
def _describe(config: Config) -> dict[str, Any]:
    import importlib.metadata as metadata

    import lightning_zero  # noqa: F401  (what a user imports: it must not need hydra)

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hydra_imported_by_lightning_zero": sorted(m for m in sys.modules if m.split(".")[0] in ("hydra", "omegaconf")),
        "cpu_count": os.cpu_count(),
        "host_memory_available_bytes": memory_available(),
        "env": environment_variables(),
        "nccl": str(torch.cuda.nccl.version()) if torch.cuda.is_available() else None,
    }
    for package in ("lightning", "pytorch-lightning", "transformers", "peft", "pytest", "pytest-timeout"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    if config.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        info |= {
            "gpu": props.name,
            "gpu_count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "gpu_memory_total_bytes": total,
            "gpu_memory_free_bytes": free,
            "bf16_supported": torch.cuda.is_bf16_supported(),
        }
    return info


def environment(config: Config) -> dict[str, Any]:
    (info,) = ranks(config, _describe, 1)
    if config.device == "cuda" and "gpu" not in info:
        raise RuntimeError("--device cuda, but the rank saw no CUDA device")
    checks = [] if not info["hydra_imported_by_lightning_zero"] else ["`import lightning_zero` imported hydra"]
    return {"result": info, "failed_checks": checks}


# -- which collectives gloo runs on CUDA tensors -------------------------------------------------------------------
def _probe(config: Config) -> dict[str, str]:
    from tests.test_gpu_gloo import gloo_cuda_probe

    rank = dist.get_rank()
    return gloo_cuda_probe(config.device, lambda op, outcome: note(config, rank=rank, op=op, outcome=outcome))


def gloo_probe(config: Config) -> dict[str, Any]:
    from tests.test_gpu_gloo import gloo_cuda_mode

    results = ranks(config, _probe, 2, group=True)
    return {"result": {"per_rank": results, "zero_mode": gloo_cuda_mode(results[0])}}


# -- the gpu tests (tests/test_gpu.py, tests/test_gpu_gloo.py) ---------------------------------------------------
TEST_FILES = ("tests/test_gpu.py", "tests/test_gpu_gloo.py")


def gpu_tests(config: Config) -> dict[str, Any]:
    """``pytest -m gpu`` on the GPU test files in a process group of its own, killed when the budget runs out; each
    test's outcome comes back as it is known (``pytest_lines.py``), so a run cut short still reports what finished."""
    out = Path(config.out)
    log, lines = out / "pytest_gpu.log", out / ".pytest_lines.jsonl"
    lines.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", *TEST_FILES, "-m", "gpu", "-v", "-p", "no:cacheprovider"]
    command += ["-p", "gpu_check.pytest_lines", "-p", "no:hydra_pytest", "--tb=short"]  # hydra: not on GPU machines
    path = os.pathsep.join([ROOT_OF, str(Path(ROOT_OF) / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "GPU_CHECK_PYTEST_LINES": str(lines), "PYTHONPATH": path}
    with open(log, "w") as file:
        process = subprocess.Popen(
            command, cwd=ROOT_OF, stdout=file, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            code: int | None = process.wait(timeout=max(1.0, config.left() - 3))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # pytest and every rank it started
            process.wait()
            code = None
    reports = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
    lines.unlink(missing_ok=True)
    collected = [test for report in reports for test in report.get("collected", [])]
    reports = [report for report in reports if "collected" not in report]
    tests: dict[str, dict[str, Any]] = {}
    for report in reports:  # setup, call, teardown: the first that did not pass says what happened
        known = tests.get(report["test"])
        if known is None or known["outcome"] == "passed":
            tests[report["test"]] = {k: v for k, v in report.items() if k != "test"}
    text = log.read_text(errors="replace")
    not_run = [test for test in collected if test not in tests]  # the budget ran out (the first one was running)
    result: dict[str, Any] = {"exit_code": code, "tests": tests, "not_run": not_run, "log": log.name}
    result["tail"] = text[-2000:]
    failed = sorted(t for t, r in tests.items() if r["outcome"] == "failed")
    checks = [f"failed: {t}" for t in failed]
    if code is None:
        checks.append(f"pytest ran out of its {config.section} budget (the test running then is not listed)")
    elif code not in (0, 1, 5):  # 1: tests failed (listed above); 5: nothing collected
        checks.append(f"pytest exit code {code} (see {log.name})")
    return {"result": result, "failed_checks": checks}


# -- host synchronizations per steady-state step -------------------------------------------------------------------
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
BUDGET = {"32-true": 0, "bf16-mixed": 0, "16-mixed": 1}
"""Blocking host synchronizations per steady-state step: none in fp32 (the "got a gradient" flags are read only by a
rank that lacks one, Note [unused parameters]) nor in bf16-mixed (fp32 masters adopt edits by a masked copy, Note
[edits reach the masters]); fp16 reads the overflow flag."""


def _frames(event: Any) -> list[str]:
    """The ops around a runtime call (its CPU parents) and the first Python frames outside torch that issued it."""
    ops: list[str] = []
    while event is not None:
        stack = [f for f in (getattr(event, "stack", None) or []) if "torch/" not in f and "profiler" not in f]
        if stack:
            return ops[:3] + stack[:4]
        ops.append(event.name)
        event = getattr(event, "cpu_parent", None)
    return ops[:6]


def _count_syncs(config: Config, stage: int, precision: str, tier: str) -> dict[str, Any]:
    """Host synchronizations of steady-state steps: on CUDA, the profiler's cudaStreamSynchronize,
    cudaEventSynchronize, cudaDeviceSynchronize and device-to-host copies (with the Python frames that issued each
    sync); everywhere, the host reads ``tests/host_syncs.py`` counts."""
    from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
    from lightning_zero.models.gpt import GPT, GPTConfig
    from lightning_zero.sharding.loss_scaler import DynamicLossScaler
    from tests.host_syncs import count_host_syncs

    device = nccl_or_gloo(config)
    gpt = GPTConfig.tiny() if config.dry else GPTConfig.small(n_layer=4)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision, torch.float32)
    scaler = DynamicLossScaler(scale=2.0**10) if precision == "16-mixed" else None
    tiers: dict[str, Any] = {"offload_optimizer": "cpu", "offload_params": "cpu"} if tier == "host" else {}
    zero = ZeroConfig(stage=stage, **tiers)  # type: ignore[arg-type]
    memory = None
    torch.manual_seed(0)
    if stage == 3:
        from lightning_zero.offload.memory_tiers import MemoryTiers

        memory = MemoryTiers(zero, None, 4, device) if tier == "host" else None
        with torch.device("meta"):
            model = GPT(gpt).to(dtype)
        gatherer = shard_module(model, zero, dist.group.WORLD, device, tiers=memory)
    else:
        model, gatherer = GPT(gpt).to(device=device, dtype=dtype), None
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer_tiers = memory.for_optimizer() if memory is not None else None
    optimizer = ZeroOptimizer(model, adamw, dist.group.WORLD, zero, gatherer, tiers=optimizer_tiers, loss_scaler=scaler)
    tokens = torch.randint(0, gpt.vocab_size, (4, gpt.block_size + 1), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        (loss * (scaler.scale if scaler is not None else 1.0)).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # warm-up: optimizer state, first-step checks, NCCL communicators
        step()
    steps = 1 if config.dry else 3
    with count_host_syncs() as reads:  # what .item()/.tolist() block on, outside torch.optim (tests/host_syncs.py)
        for _ in range(steps):
            step()
    counts: dict[str, int] = {"host reads (tests/host_syncs.py)": reads.count}
    where: list[Any] = reads.where[:6]
    syncs = reads.count
    if device.type == "cuda":  # what the GPU run actually waited for
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, with_stack=True) as profile:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()  # the last step's copies are in the trace; not counted (below)
        waited: set[int] = set()  # the ops that blocked the host, each counted once
        for event in profile.events():
            key = event.name if event.name in SYNC_EVENTS or event.name.startswith("Memcpy DtoH") else None
            if key in SYNC_EVENTS:
                op = getattr(event, "cpu_parent", None)
                if op is None and key == "cudaDeviceSynchronize":
                    continue  # inside no op, so not the steps': ours above, and one more the trace holds (torch 2.11)
                # One blocking op can issue several syncs (torch 2.11: a copy to pageable memory calls
                # cudaStreamSynchronize twice): count the op once. Syncs issued by ZeroOptimizer.step's own Python
                # code (its record_function is their parent) are each a wait of their own.
                if op is not None and not op.name.startswith("Optimizer.step#"):
                    if id(op) in waited:
                        continue
                    waited.add(id(op))
            if key is not None:
                counts[key] = counts.get(key, 0) + 1
                if key in SYNC_EVENTS and len(where) < 18:
                    where.append([key, *_frames(event)])
        syncs = sum(counts.get(s, 0) for s in SYNC_EVENTS)
    if memory is not None:
        memory.close()
    return {"counts": counts, "syncs_per_step": syncs / steps, "where": where, "steps": steps}


def _all_syncs(config: Config) -> dict[str, Any]:
    runs = {}
    variants = [(s, p, "none") for p in ("32-true", "bf16-mixed") for s in (1, 2, 3)] + [(3, "32-true", "host")]
    variants.append((3, "16-mixed", "none"))
    if config.dry:  # the code paths, on fewer runs
        variants = [(1, "32-true", "none"), (3, "bf16-mixed", "none"), (3, "16-mixed", "none"), (3, "32-true", "host")]
    for stage, precision, tier in variants:
        name = f"stage{stage} {precision}" + (" host tier" if tier == "host" else "")
        try:
            runs[name] = _count_syncs(config, stage, precision, tier)
        except Exception as error:
            runs[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        note(config, run=name, result=runs[name])
    return runs


def host_syncs(config: Config) -> dict[str, Any]:
    (runs,) = ranks(config, _all_syncs, 1)
    checks = []
    for name, run in runs.items():
        if "error" in run:
            checks.append(f"{name}: {run['error'][:200]}")
        elif "host tier" not in name:  # on the CPU the reads are counted (a GPU would block on each), on CUDA the syncs
            budget = BUDGET[name.split()[1]]
            if run["syncs_per_step"] > budget:
                checks.append(f"{name}: {run['syncs_per_step']:.2f} host syncs per step, budget {budget}")
    note_text = "counts per profiled run of `steps` steps; the host tier waits for its copies by design"
    return {"result": {"runs": runs, "budget": BUDGET, "note": note_text}, "failed_checks": checks}
