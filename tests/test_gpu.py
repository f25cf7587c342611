"""The CUDA path, for the machines with GPUs that run it (skipped without CUDA: ``gpu`` marker).

What needs one NCCL rank per GPU is marked ``gpus(2)`` and skips, saying so, on a machine with one GPU (NCCL refuses
two ranks on one device); the rest runs on one GPU: world size 1 on NCCL for the CUDA kernels, streams, pinned memory
and the allocator, and two ranks sharing the GPU over gloo for multi-rank parity. ``scripts/gpu_check.sh`` runs this
file on a GPU machine and records every outcome (``benchmarks/README.md``, "What has run on GPUs"). The harness starts
the ranks as for the gloo tests, and Lightning (``init_process_group=False``) creates the NCCL group from the
variables it sets.

- parity with ``Trainer(strategy="ddp")`` for every stage, fp32 and bf16-mixed, with the host tier (optimizer, and
  parameters at stage 3) and the ``zero3_offload`` preset, losses and weights step by step;
- the host tier's copies ordered against compute with ``torch.cuda._sleep`` widening every race window, its masters
  pinned in host memory;
- peak ``torch.cuda.max_memory_allocated`` of a step within the model-state formula plus the measured activations
  of the same model and the communication buffers the design allows;
- a profiler trace in which stage 3's all-gather kernels overlap compute kernels (Note [collective streams]; 2 GPUs);
- teardown: ``fit``, ``validate``, ``fit`` keeps the stage-3 model sharded on its GPU, nothing moved to the host.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroConfig, ZeroOptimizer, ZeroStrategy, expected_model_state_bytes, shard_module
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.offload import host_copies
from tests import host_tier_gradient_runs
from tests.harness import run_distributed
from tests.test_host_tier_gradients import check_fabric, check_trainer
from tests.test_strategy import STEPS, ParityModule, _dataset, _full_weights
from tests.test_teardown import TrackedModule, _sharded_state

pytestmark = pytest.mark.gpu
RTOL, ATOL = 1e-4, 1e-5  # NCCL's ring sums in another order than gloo's; both runs share every other kernel
TOLERANCES = {"32-true": (RTOL, ATOL), "bf16-mixed": (2e-2, 2e-2)}  # bf16: as tests/test_mixed_precision.py
RANKS_TIMEOUT = 120  # seconds for one test's ranks: a hang must not eat the other tests' share of a GPU run
TEST_TIMEOUT = 180
WORLDS = [pytest.param(n, marks=pytest.mark.gpus(n), id=f"{n}gpu") for n in (1, 2)]
"""One NCCL rank per GPU: a test parametrized by these runs on one GPU and, where there are two, on two."""


def _gpu_trainer(strategy: Any, devices: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=devices,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _gpu_fit(strategy: Any, devices: int, precision: str = "32-true") -> dict[str, Any]:
    module = ParityModule("gpt", "adamw")
    trainer = _gpu_trainer(strategy, devices, precision=precision)
    trainer.fit(module, DataLoader(_dataset("gpt", 2 * 4 * STEPS), batch_size=4))
    weights = {n: w.float().cpu() for n, w in _full_weights(trainer, module.model).items()}
    dtypes = {str(p.dtype) for p in module.model.parameters()}
    return {"losses": module.losses, "weights": weights, "backend": dist.get_backend(), "dtypes": dtypes}


def assert_matches(run: dict[str, Any], reference: dict[str, Any], precision: str, what: str) -> None:
    rtol, atol = TOLERANCES[precision]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: per-step losses: {m}")  # fmt: skip
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(run["weights"][name], expected, rtol=rtol, atol=atol, msg=f"{what} {name}")


def _ddp_then_every_stage(devices: int) -> list[dict[str, Any]]:
    return [_gpu_fit("ddp", devices)] + [
        _gpu_fit(ZeroStrategy(stage=s, bucket_numel=4_000), devices) for s in (1, 2, 3)
    ]


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("world", WORLDS)
def test_every_stage_matches_ddp_on_gpus_with_nccl(world):
    for reference, *sharded in run_distributed(_ddp_then_every_stage, world, world, init_process_group=False,
                                               timeout=RANKS_TIMEOUT):  # fmt: skip
        for stage, run in enumerate(sharded, start=1):
            assert run["backend"] == "nccl"
            assert_matches(run, reference, "32-true", f"stage {stage}")


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])  # before Lightning creates the group: the harness sets it


def _nccl_group() -> torch.device:
    """This rank's GPU and an NCCL default group (the harness passes the rendezvous in the environment)."""
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def _peak_memory(stage: int) -> dict[str, int]:
    """Peak allocated bytes of a steady-state step, and what the design allows for it."""
    device = _nccl_group()
    config = GPTConfig.small(n_layer=6)
    zero = ZeroConfig(stage=stage, bucket_numel=1_000_000)
    tokens = torch.randint(0, config.vocab_size, (8, config.block_size + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    # Activations of this model and batch, measured on an unsharded copy: peak minus what was there before.
    torch.manual_seed(0)
    plain = GPT(config).to(device)
    plain.loss(x, y)  # warm-up (cuBLAS workspaces)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    plain.loss(x, y).backward()
    activations = torch.cuda.max_memory_allocated() - before  # includes the full gradients the copy produces
    del plain
    torch.cuda.empty_cache()

    torch.manual_seed(0)
    if stage == 3:
        with torch.device("meta"):
            model = GPT(config)
        gatherer = shard_module(model, zero, dist.group.WORLD, device)
        largest_unit = max(u.numel for u in gatherer.units) * 4
        buffers = 2 * largest_unit + gatherer.units[0].numel * 4  # a unit in use, the prefetched one, the root
    else:
        model, gatherer = GPT(config).to(device), None
        buffers = 0
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), dist.group.WORLD, zero, gatherer)
    buckets = max(b.padded_numel for b in optimizer.reducer.buckets) * 4
    buffers += (zero.max_inflight_buckets + 1) * buckets  # staging buffers in flight and filling
    peaks = {}
    for _ in range(2):  # the second step has optimizer state from the start
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        model.loss(x, y).backward()
        torch.cuda.synchronize()
        peaks = {"start": start, "backward": torch.cuda.max_memory_allocated()}  # where the peak is, if it fails
        held = [(block["size"], segment["stream"]) for segment in torch.cuda.memory_snapshot()
                for block in segment["blocks"] if block["state"] == "active_allocated"]  # fmt: skip
        peaks["largest_held_before_step"] = sorted(held, reverse=True)[:12]  # (bytes, stream): what start is made of
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        peaks["step"] = torch.cuda.max_memory_allocated()
        peaks["end"] = torch.cuda.memory_allocated()
    psi = sum(b.numel for b in optimizer.reducer.buckets)
    state = expected_model_state_bytes(psi, dist.get_world_size(), stage, param_bytes=4, master_bytes=0).total
    return {"peak": torch.cuda.max_memory_allocated(), "state": state, "activations": activations,
            "buffers": buffers, "inputs": tokens.numel() * tokens.element_size(), "peaks": peaks}  # fmt: skip


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", WORLDS)
def test_peak_gpu_memory_is_the_formula_plus_activations(world, stage):
    for m in run_distributed(_peak_memory, world, stage, init_process_group=False, timeout=RANKS_TIMEOUT):
        allowed = m["state"] + m["activations"] + m["buffers"] + m["inputs"]
        assert m["peak"] <= 1.05 * allowed, str(m)  # 5%: allocator rounding to 512-byte blocks, kernel workspaces


def _all_gather_overlap() -> dict[str, float]:
    """Time of NCCL all-gather kernels, and of that time spent while a compute kernel ran, in one stage-3 step."""
    device = _nccl_group()
    config = GPTConfig.small(n_layer=8)
    with torch.device("meta"):
        model = GPT(config)
    zero = ZeroConfig(stage=3)
    gatherer = shard_module(model, zero, dist.group.WORLD, device)
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), dist.group.WORLD, zero, gatherer)
    tokens = torch.randint(0, config.vocab_size, (16, config.block_size + 1), device=device)

    def step() -> None:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up: NCCL communicators, optimizer state
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gathers = [(e.time_range.start, e.time_range.end) for e in kernels if "AllGather" in e.name]
    compute = sorted((e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower())
    overlapped = sum(max(0, min(end, c_end) - max(start, c_start)) for start, end in gathers
                     for c_start, c_end in compute)  # fmt: skip
    return {"gather_us": sum(end - start for start, end in gathers), "overlapped_us": overlapped}


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.gpus(2)  # at world size 1 there is nothing to gather from another rank
def test_stage3_all_gathers_overlap_compute_on_gpus():
    for m in run_distributed(_all_gather_overlap, 2, init_process_group=False, timeout=RANKS_TIMEOUT):
        assert m["gather_us"] > 0, m
        # Prefetched gathers run on their own stream while the previous unit computes (Note [collective streams]).
        assert m["overlapped_us"] >= 0.25 * m["gather_us"], m


def _teardown_on_gpu() -> dict[str, Any]:
    module = TrackedModule()
    trainer = _gpu_trainer(ZeroStrategy(stage=3, persistence_threshold=100), _world())
    loader = DataLoader(_dataset("gpt", 2 * 4 * 2 * STEPS), batch_size=4)
    trainer.fit(module, loader)
    trainer.validate(module, DataLoader(_dataset("gpt", 16), batch_size=4), verbose=False)
    trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS
    trainer.fit(module, loader)
    state = _sharded_state(module, trainer.strategy)
    devices = {p.device.type for p in module.parameters()} | {b.device.type for b in module.buffers()}
    named = [*module.named_parameters(), *module.named_buffers()]
    off_device = [n for n, t in named if t.device.type != "cuda"]
    return {"state": state, "devices": devices, "off_device": off_device, "moves": module.moves_after_run,
            "steps": len(module.losses)}  # fmt: skip


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("world", WORLDS)
def test_zero3_fit_validate_fit_stays_sharded_on_the_gpu(world):
    for m in run_distributed(_teardown_on_gpu, world, init_process_group=False, timeout=RANKS_TIMEOUT):
        assert m["devices"] == {"cuda"}, str(m)  # nothing was moved to the host
        assert m["state"]["full"] == [], m
        assert m["state"]["detached"] == [], m
        assert m["moves"] == 0, m
        assert m["steps"] == 2 * STEPS, m


# -- the host tier (ZeRO-Offload): Note [host tier data path] in lightning_zero/offload/host_copies.py -------------
HOST_TIERS = [
    {"stage": 1, "offload_optimizer": "cpu"},
    {"stage": 2, "offload_optimizer": "cpu"},
    {"stage": 2, "offload_optimizer": "cpu", "offload_ratio": 0.5},
    {"stage": 3, "offload_optimizer": "cpu"},
    {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
]


TIERED: list[str | dict[str, Any]] = [*HOST_TIERS, "zero3_offload"]  # the preset: both tiers in host memory
"""The host-tier runs compared with DDP: ZeroStrategy arguments, or a registered preset's name."""


def _tiered_strategy(tier: str | dict[str, Any]) -> Any:
    return tier if isinstance(tier, str) else ZeroStrategy(**tier, bucket_numel=4_000)


def _ddp_then_host_tiers(devices: int, precision: str) -> list[dict[str, Any]]:
    return [_gpu_fit("ddp", devices, precision)] + [_gpu_fit(_tiered_strategy(t), devices, precision) for t in TIERED]


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("world", WORLDS)
def test_host_tier_matches_ddp_on_gpus(world):
    for reference, *tiered in run_distributed(_ddp_then_host_tiers, world, world, "32-true",
                                              init_process_group=False, timeout=RANKS_TIMEOUT):  # fmt: skip
        for tier, run in zip(TIERED, tiered, strict=True):
            assert_matches(run, reference, "32-true", str(tier))


def _ddp_then_bf16_runs() -> list[dict[str, Any]]:
    stages: list[str | dict[str, Any]] = [{"stage": s} for s in (1, 2, 3)]
    return [_gpu_fit("ddp", 1, "bf16-mixed")] + [
        _gpu_fit(_tiered_strategy(v), 1, "bf16-mixed") for v in stages + TIERED
    ]


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.gpus(1)
def test_bf16_mixed_every_stage_and_host_tier_matches_ddp_on_one_gpu():
    ((reference, *runs),) = run_distributed(_ddp_then_bf16_runs, 1, init_process_group=False, timeout=RANKS_TIMEOUT)
    for variant, run in zip([f"stage {s}" for s in (1, 2, 3)] + [str(t) for t in TIERED], runs, strict=True):
        assert run["dtypes"] == {"torch.bfloat16"}, variant  # ZeRO's bf16-mixed: bf16 parameters, fp32 masters
        assert_matches(run, reference, "bf16-mixed", variant)


# -- `.grad` with the host tier: Note [gradients visible to hooks] in lightning_zero/engine/sharded_gradient.py ------
# Not yet run on a GPU: on the CPU the same path runs with host_copies.FORCE_COPIES (tests/test_host_tier_gradients.py).
def _host_tier_gradients_fabric(devices: int) -> dict[str, Any]:
    variants = {f"zero{s}": (f"zero{s}", {"offload_optimizer": "cpu"}) for s in (2, 3)}
    return host_tier_gradient_runs.fabric_runs("32-true", variants, accelerator="cuda", devices=devices)


def _host_tier_gradients_trainer(devices: int) -> dict[str, Any]:
    variants = {"zero3": {"stage": 3, "offload_optimizer": "cpu"}}
    with tempfile.TemporaryDirectory() as root:
        return host_tier_gradient_runs.trainer_runs(root, "32-true", variants, accelerator="gpu", devices=devices)


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("world", WORLDS)
def test_host_tier_gradients_read_between_backward_and_step_match_ddp_on_gpus(world):
    """``.grad`` read from the device shards the host tier copies from, in a Fabric loop and in
    ``on_before_optimizer_step``, against DDP on NCCL."""
    fabric = run_distributed(_host_tier_gradients_fabric, world, world, init_process_group=False,
                             timeout=RANKS_TIMEOUT)  # fmt: skip
    check_fabric(fabric, ["zero2", "zero3"], "32-true", delayed=False)
    trainer = run_distributed(_host_tier_gradients_trainer, world, world, init_process_group=False,
                              timeout=RANKS_TIMEOUT)  # fmt: skip
    check_trainer(trainer, "32-true", delayed=False)


# Note: `torch.cuda._sleep` makes the compute stream (or the copy stream) busy for that many GPU cycles (about
# 1 ms per 2M on an H100), so an ordering the tier forgot (a copy that does not wait for the kernel that writes its
# source, a reader that does not wait for the copy) reads stale or zeroed memory and the run leaves DDP's numbers.
SLEEP_CYCLES = 2_000_000


def _sleepy_copies() -> None:
    """Every host-tier copy: its device source is zeroed and restored after a sleep on the compute stream, and the
    copy itself starts after a sleep on the copy stream."""
    original = host_copies.CopyStream.copy

    def copy(self: host_copies.CopyStream, dst: Tensor, src: Tensor) -> host_copies.Copy:
        if self.stream is not None and src.is_cuda:
            saved = src.clone()
            src.zero_()
            torch.cuda._sleep(SLEEP_CYCLES)
            src.copy_(saved)  # the source holds its value again only once the sleep is over
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(SLEEP_CYCLES)  # the copy lands late: whoever reads it early reads old bytes
        return original(self, dst, src)

    host_copies.CopyStream.copy = copy  # type: ignore[method-assign]  # this rank only: a process of its own


SLEEPY_TIERS: list[dict[str, Any]] = [
    {"stage": 2, "offload_optimizer": "cpu"},
    {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
]


def _ddp_then_sleepy_tiers() -> list[dict[str, Any]]:
    reference = _gpu_fit("ddp", 1)
    _sleepy_copies()
    return [reference] + [_gpu_fit(ZeroStrategy(**tier, bucket_numel=4_000), 1) for tier in SLEEPY_TIERS]


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.gpus(1)
def test_host_tier_copies_are_ordered_against_compute_with_sleeps_widening_the_races():
    ((reference, *runs),) = run_distributed(_ddp_then_sleepy_tiers, 1, init_process_group=False, timeout=RANKS_TIMEOUT)
    for tier, run in zip(SLEEPY_TIERS, runs, strict=True):
        assert_matches(run, reference, "32-true", f"{tier} with sleeps")


def _count_pageable_copies() -> dict[str, int]:
    """Counts, in this rank, the host tier's copies and those whose host side is not pinned, per direction. Such a
    copy is synchronous: the overlap the tier is built for would be lost without an error. Uploads are never waited
    for on the host, so each must be pinned; a download the host waits for at once (the edit check's read of the
    parameters) loses nothing by being pageable, so downloads are only counted."""
    counts = {"copies": 0, "pageable_up": 0, "pageable_down": 0}
    original = host_copies.CopyStream.copy

    def copy(self: host_copies.CopyStream, dst: Tensor, src: Tensor) -> host_copies.Copy:
        counts["copies"] += 1
        if src.device.type == "cpu" and not src.is_pinned():
            counts["pageable_up"] += 1
        if dst.device.type == "cpu" and not dst.is_pinned():
            counts["pageable_down"] += 1
        return original(self, dst, src)

    host_copies.CopyStream.copy = copy  # type: ignore[method-assign]  # this rank only: a process of its own
    return counts


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward runs ``torch.cuda._sleep`` (a ``spin_kernel``): marks each block's backward on the
    GPU's timeline."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        return grad


def _host_tier_step(offload_params: str) -> dict[str, Any]:
    """Where a stage-3 step with the host tier keeps things, what it copies, and how many gradient copies to the
    host start while backward still runs.

    Not "overlap with kernels": this small model is bound by the host at stage 3 (under the profiler, about 4 ms of
    Python per block's backward against 0.3 ms of kernels on an H100, 2026-11-26), so the GPU idles most of backward
    and a copy issued as early as it can be lands in an idle gap, overlapping no kernel. What the tier controls is
    *when* a copy is issued: as each bucket's reduction completes, not all at the end. Each block's backward
    therefore starts with a sleep kernel that marks it on the timeline, and a copy that starts before the last
    block's sleep ends was issued while backward had blocks to go."""
    from lightning_zero.offload.memory_tiers import MemoryTiers

    pageable = _count_pageable_copies()
    device = _nccl_group()
    config = GPTConfig.small(n_layer=8)
    zero = ZeroConfig(stage=3, offload_optimizer="cpu", offload_params=offload_params)
    tiers = MemoryTiers(zero, None, 4, device)
    with torch.device("meta"):
        model = GPT(config)
    gatherer = shard_module(model, zero, dist.group.WORLD, device, tiers=tiers)
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: _SleepInBackward.apply(out))
    adamw = torch.optim.AdamW(model.parameters())
    optimizer = ZeroOptimizer(model, adamw, dist.group.WORLD, zero, gatherer, tiers=tiers.for_optimizer())
    tokens = torch.randint(0, config.vocab_size, (16, config.block_size + 1), device=device)

    def step() -> None:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up: NCCL communicators, optimizer state on the host
    torch.cuda.synchronize()
    down, up = tiers.host_copy_bytes()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step()
        torch.cuda.synchronize()
    moved = tuple(after - before for after, before in zip(tiers.host_copy_bytes(), (down, up), strict=True))
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    to_host = [(e.time_range.start, e.time_range.end) for e in kernels if "DtoH" in e.name]
    last_block = max(e.time_range.end for e in kernels if "spin_kernel" in e.name)
    during_backward = sum(1 for e in kernels if "Device -> Pinned" in e.name and e.time_range.start < last_block)
    states = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    sharded = [b for u in gatherer.units for b in u.buckets]
    result = {
        "masters": {(m.device.type, m.is_pinned()) for m in optimizer.masters},
        "state": {v.device.type for v in states},
        "shards": {b.param_shard.device.type for b in gatherer.all_buckets()},
        "resident_shard_bytes": sum(b.param_shard.untyped_storage().nbytes() for b in sharded),
        "moved": moved,
        "shard_bytes": sum(m.numel() * 4 for m in optimizer.masters),
        "to_host_us": sum(end - start for start, end in to_host),
        "blocks": len(model.blocks),
        "copies_during_backward": during_backward,
        **pageable,
    }
    tiers.close()
    return result


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("offload_params", ["none", "cpu"])
@pytest.mark.parametrize("world", WORLDS)
def test_host_tier_keeps_masters_and_state_pinned_on_the_host_and_copies_gradients_during_backward(
    world, offload_params
):
    for m in run_distributed(_host_tier_step, world, offload_params, init_process_group=False, timeout=RANKS_TIMEOUT):
        assert m["masters"] == {("cpu", True)}, m
        assert m["copies"] > 0, m
        assert m["pageable_up"] == 0, m  # every upload reads pinned host memory
        assert m["state"] == {"cpu"}, m
        assert m["shards"] == {"cuda"}, m
        if offload_params == "cpu":  # between uses the parameter shards hold no device memory
            assert m["resident_shard_bytes"] == 0, m
        down, up = m["moved"]
        # Gradients come down; updated parameters go up (with offload_params, as the gathers read the shards ahead);
        # without offload_params the parameters are also read back for edits (Note [host tier data path]).
        assert down >= (1 if offload_params == "cpu" else 2) * m["shard_bytes"], m
        assert up >= m["shard_bytes"], m
        # The gradients' copies are issued as each bucket's reduction completes, while backward still runs (Note
        # [host tier data path]); one issued only at the end of backward starts after the last block's sleep. Seen
        # on an H100: 5 of 9 start before it (8 blocks; the last buckets complete at backward's end).
        assert m["to_host_us"] > 0, m
        assert m["copies_during_backward"] >= m["blocks"] // 4, str(m)
