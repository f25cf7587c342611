"""The native (NCCL) branch of every collective, run on gloo (Note [native collectives]); what each step hands to
``torch.distributed``, metered at the call, against the ZeRO formulas; the buffers a bucket holds in flight."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, ZeroOptimizer, ZeroStrategy
from lightning_zero.comm.collectives import NATIVE_COLLECTIVES_ENV, native_collectives, takes_pieces
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.stage3.sharded_init import shard_module
from tests.harness import run_distributed
from tests.parity import (
    Run,
    assert_runs_match,
    batch,
    build_model,
    build_optimizer,
    ddp,
    full_weights,
    loss_fn,
    native_collectives_on,
    optimizer_no_sync,
    zero,
    zero3,
)
from tests.test_strategy import assert_fits_match, fit

NATIVE = {NATIVE_COLLECTIVES_ENV: "1"}
GLOO = {NATIVE_COLLECTIVES_ENV: "0"}


def test_the_switch_accepts_on_and_off_and_names_itself_otherwise(monkeypatch):
    for value, expected in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv(NATIVE_COLLECTIVES_ENV, value)
        assert native_collectives() is expected
    monkeypatch.setenv(NATIVE_COLLECTIVES_ENV, "yes")
    with pytest.raises(ValueError, match=f"{NATIVE_COLLECTIVES_ENV}='yes'.*Expected 1"):
        native_collectives()


def _which_forms() -> dict[str, dict[str, bool]]:
    """Per value of the switch (read at each call), whether each device's tensors take gloo's pairwise forms."""
    group, forms = dist.group.WORLD, {}
    for value in ("0", "1"):
        os.environ[NATIVE_COLLECTIVES_ENV] = value  # this rank's process only
        forms[value] = {device: takes_pieces(torch.device(device), group) for device in ("cpu", "cuda", "meta")}
    return forms


@pytest.mark.timeout(60)
def test_gloo_takes_its_pairwise_forms_for_host_tensors_only():
    # Gloo's isend/irecv hands a CUDA tensor's pointer to the socket and aborts the rank (Note [native
    # collectives]): ranks sharing a GPU over gloo must take the native forms, even without the switch.
    for forms in run_distributed(_which_forms, 2, timeout=30):
        assert forms["0"] == {"cpu": True, "cuda": False, "meta": False}, forms
        assert forms["1"] == {"cpu": False, "cuda": False, "meta": False}, forms  # the switch: never pairwise


def _train_stages(stages: tuple[int, ...], old_torch: bool = False) -> dict[int, dict[str, Any]]:
    if old_torch:  # torch before the *_single names: only reduce_scatter_tensor / all_gather_into_tensor exist
        del dist.reduce_scatter_single, dist.all_gather_single  # this rank's process only
    return {stage: _train(stage) for stage in stages}


def _train(stage: int, steps: int = 2, **config: Any) -> dict[str, Any]:
    """A few steps of the parity GPT; what the last step handed to torch.distributed, and the final weights."""
    model = build_model("gpt")
    zero_config = ZeroConfig(stage=stage, bucket_numel=4_000, **config)
    gatherer = shard_module(model, zero_config, dist.group.WORLD, torch.device("cpu")) if stage == 3 else None
    optimizer = ZeroOptimizer(model, build_optimizer("adamw", model), dist.group.WORLD, zero_config, gatherer)
    for step in range(steps):
        loss_fn("gpt", model, batch("gpt", dist.get_rank(), step, 0)).backward()
        optimizer.step()
        optimizer.zero_grad()
    with gatherer.gathered() if gatherer is not None else torch.no_grad():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in model.parameters())
    return {"sends": optimizer.ledger.last_step_sends, "sent": optimizer.ledger.last_step, "numel": numel,
            "weights": weights}  # fmt: skip


@pytest.mark.timeout(120)
def test_native_mode_calls_the_native_ops_and_older_torch_names_give_the_same_weights():
    # Stage 3 issues every kind of collective: parameter gathers, gradient reduce-scatters, the optimizer's gathers.
    (gloo_runs, *_) = run_distributed(_train_stages, 2, (3,), env=GLOO)
    (native_runs, *_) = run_distributed(_train_stages, 2, (3,), env=NATIVE)
    (old_runs, *_) = run_distributed(_train_stages, 2, (3,), True, env=NATIVE)
    for stage in (3,):
        gloo, native, old = gloo_runs[stage], native_runs[stage], old_runs[stage]
        ops = {mode: {s.op for s in run["sends"]} for mode, run in (("gloo", gloo), ("native", native), ("old", old))}
        # all_reduce: the step's "got a gradient" flags (Note [unused parameters]), the same in every mode.
        assert ops["gloo"] == {"isend", "all_reduce"}  # Notes [reduce-scatter on gloo], [all-gather on gloo]
        assert ops["native"] == {"reduce_scatter_single", "all_gather_single", "all_reduce"}
        assert ops["old"] == {"reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"}
        for name, expected in gloo["weights"].items():
            torch.testing.assert_close(native["weights"][name], expected, rtol=1e-5, atol=1e-6, msg=name)
            assert torch.equal(old["weights"][name], native["weights"][name]), name  # one op under two names


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world_size", "native"), [(2, False), (4, True)], ids=["gloo-2", "native-4"])
def test_metered_bytes_per_step_are_the_zero_formulas(world_size, native):
    for runs in run_distributed(_train_stages, world_size, (1, 2, 3), env=NATIVE if native else GLOO):
        for stage, run in runs.items():
            psi, n = run["numel"], world_size
            theory = (3 if stage == 3 else 2) * psi * 4 * (n - 1) // n  # elements x 4 bytes (fp32)
            params = [s for s in run["sends"] if s.dtype == torch.float32]
            metered = sum(s.wire_bytes for s in params)
            # Measured at the calls, they exceed the formula only by each bucket's padding (< N elements, sent
            # once per collective of the bucket) and integer rounding.
            calls = len([s for s in params if s.wire_bytes > 0])
            assert theory <= metered <= theory + calls * n * 4, (stage, metered, theory)
            assert sum(run["sent"].values()) == sum(s.wire_bytes for s in run["sends"])
            assert len(params) == len(run["sends"])  # fp32 parameters and gradients, nothing else


def _held_in_flight_per_stage() -> dict[int, dict[str, Any]]:
    return {stage: _held_in_flight(stage) for stage in (1, 2)}


def _held_in_flight(stage: int) -> dict[str, Any]:
    """Per bucket launch: the pooled buffers that bucket's reduce-scatter holds, and the bucket's sizes."""
    model = build_model("gpt")
    config = ZeroConfig(stage=stage, bucket_numel=4_000)
    optimizer = ZeroOptimizer(model, build_optimizer("adamw", model), dist.group.WORLD, config)
    reducer = optimizer.reducer
    held: list[tuple[list[int], int, int]] = []
    launch = reducer._launch_one

    def observed(bucket: FlatBucket) -> None:
        launch(bucket)
        lent = [b.numel() * b.element_size() for b in reducer._lent[bucket.index]]
        held.append((lent, bucket.padded_numel * 4, bucket.shard_numel * 4))

    reducer._launch_one = observed  # type: ignore[method-assign]
    for step in range(2):
        loss_fn("gpt", model, batch("gpt", dist.get_rank(), step, 0)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"held": held, "pool": reducer.pool.nbytes(), "buckets": len(optimizer.buckets)}


@pytest.mark.timeout(120)
def test_with_native_collectives_a_bucket_in_flight_holds_the_bucket_and_its_shard_only():
    natives = run_distributed(_held_in_flight_per_stage, 2, env=NATIVE)[0]
    gloos = run_distributed(_held_in_flight_per_stage, 2, env=GLOO)[0]
    for stage in (1, 2):
        native, gloo = natives[stage], gloos[stage]
        assert len(native["held"]) == 2 * native["buckets"]
        for lent, bucket_bytes, _ in native["held"]:
            # Stage 1 reduces its persistent gradient buffer into its own shard in place: nothing borrowed.
            # Stage 2 borrows the staging buffer (the bucket) and reduces into its persistent shard.
            assert lent == ([] if stage == 1 else [bucket_bytes]), (stage, lent, bucket_bytes)
        for lent, _, shard_bytes in gloo["held"]:
            # Gloo's pairwise form on two ranks receives the peer's chunk straight into the output shard, and stage 2
            # sends the gradients from where autograd put them (Note [gradients sent from where autograd put them]);
            # only stage 1's in-place reduction (its output is its own chunk of the bucket) receives into scratch.
            assert lent == ([shard_bytes] if stage == 1 else []), (stage, lent)
        if stage == 1:
            assert native["pool"] == 0 < gloo["pool"]
        else:
            assert native["pool"] > 0 == gloo["pool"]


def _ddp_then_every_stage_native() -> list[dict]:
    assert native_collectives()
    runs = [fit("ddp", "gpt", "adamw")]
    for stage in (1, 2, 3):
        runs.append(fit(ZeroStrategy(stage=stage, bucket_numel=4_000), "gpt", "adamw"))
    return runs


@pytest.mark.timeout(240)
def test_trainer_with_native_collectives_matches_trainer_ddp_at_every_stage():
    for reference, *sharded in run_distributed(_ddp_then_every_stage_native, 2, init_process_group=False, env=NATIVE):
        for run in sharded:
            assert_fits_match(reference, run)


def _discarded_micro_batch(stage: int, grad_accumulation: str) -> list[Run]:
    """[ZeRO on gloo's path, ZeRO on the native one]: each step runs a backward inside ``no_sync()``, throws its
    gradients away with ``zero_grad()``, then trains on one more micro-batch."""
    config = ZeroConfig(stage=stage, bucket_numel=4_000, grad_accumulation=grad_accumulation)  # type: ignore[arg-type]
    runs = [_discard_and_train(zero3(config) if stage == 3 else zero(config))]
    with native_collectives_on():
        runs.append(_discard_and_train(zero3(config) if stage == 3 else zero(config)))
    return runs


def _discarded_micro_batch_under_ddp() -> Run:
    return _discard_and_train(ddp)


@functools.cache
def _discarded_micro_batch_reference() -> list[Run]:
    """Each rank's DDP run of ``_discarded_micro_batch``: no ZeRO option changes it, so every case shares it."""
    return run_distributed(_discarded_micro_batch_under_ddp, 2)


def _discard_and_train(wrap: Any) -> Run:
    model = build_model("gpt")
    forward, optimizer = wrap(model, build_optimizer("adamw", model))
    run, rank = Run(), dist.get_rank()
    for step in range(3):
        with optimizer_no_sync(forward, optimizer):
            loss_fn("gpt", forward, batch("gpt", rank, step, 0)).backward()
        optimizer.zero_grad()  # the gradients of that micro-batch must not reach the step
        loss = loss_fn("gpt", forward, batch("gpt", rank, step, 1))
        loss.backward()
        optimizer.step()
        run.losses.append(loss.item())
    run.weights = full_weights(model, optimizer)
    return run


@pytest.mark.timeout(120)
@pytest.mark.parametrize("grad_accumulation", ["local", "sharded"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_after_a_no_sync_backward_discards_its_gradients_on_both_paths(stage, grad_accumulation):
    # The native path stages gradients in pooled buffers during a local no_sync backward; zero_grad must drop them.
    sharded = run_distributed(_discarded_micro_batch, 2, stage, grad_accumulation)
    for reference, (gloo, native) in zip(_discarded_micro_batch_reference(), sharded, strict=True):
        assert_runs_match(reference, gloo)
        assert_runs_match(reference, native)
