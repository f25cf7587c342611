"""The host tier's speed mechanisms: the kernels a tiered step takes (Note [tier step kernels]) and parameter shards
read ahead from host memory without a host wait per read (Note [stream-ordered reads])."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_zero import ZeroConfig, ZeroOptimizer
from lightning_zero.offload import host_copies
from lightning_zero.offload.host_copies import Copy, CopyStream, HostStore
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.offload.optimizer_tiers import choose_step_kernels
from lightning_zero.offload.tensor_swapper import TensorSwapper
from tests.harness import run_distributed


# -- the kernels ---------------------------------------------------------------------------------------------------
def _tiered_groups(offload_optimizer: str, forced_copies: bool, options: dict[str, Any]) -> list[dict[str, Any]]:
    """A stage-2 ``ZeroOptimizer`` of AdamW(``options``) with the optimizer's tier on: its groups' kernel flags."""
    import torch.distributed as dist

    host_copies.FORCE_COPIES = forced_copies
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        config = ZeroConfig(stage=2, offload_optimizer=offload_optimizer, bucket_numel=64)  # type: ignore[arg-type]
        tiers = MemoryTiers(config, None, io_entries=2)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, **options)
        optimizer = ZeroOptimizer(model, adamw, dist.group.WORLD, config, tiers=tiers.for_optimizer())
        model(torch.ones(3, 8)).sum().backward()
        optimizer.step()  # the fused kernels take the masters and their gradients
        groups = [{k: g[k] for k in ("foreach", "fused")} for g in optimizer.optimizer.param_groups]
        tiers.close()
        return groups
    finally:
        host_copies.FORCE_COPIES = False


@pytest.mark.timeout(60)
def test_the_tiers_step_with_the_fused_kernels_unless_the_user_chose_the_kernels():
    cases = [
        ("cpu", False, {}),  # the host tier on a CPU device: the normal step, fused
        ("cpu", True, {}),  # the host tier's copy path (a GPU's): fused on the host masters
        ("cpu", True, {"fused": False}),  # the user's choice: not fused; the host tier's multi-tensor kernels
        ("cpu", False, {"foreach": False}),  # the user's choice: kept
    ]
    (found,) = run_distributed(_all_tiered_groups, 1, cases, timeout=50)
    assert found[0] == [{"foreach": None, "fused": True}]
    assert found[1] == [{"foreach": None, "fused": True}]
    assert found[2] == [{"foreach": True, "fused": False}]
    assert found[3] == [{"foreach": False, "fused": None}]


def _all_tiered_groups(cases: list[tuple[str, bool, dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    return [_tiered_groups(*case) for case in cases]


def test_only_torch_optimizers_with_fused_host_kernels_on_host_floats_are_fused():
    class OwnStep(torch.optim.AdamW):
        def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
            return super().step(closure)

    host = [nn.Parameter(torch.zeros(4))]
    for optimizer, multi_tensor, expected in [
        (torch.optim.SGD(host, lr=0.1), False, (None, True)),
        # torch's fused SGD fails when only some parameters have a momentum buffer: multi-tensor in the host tier
        (torch.optim.SGD(host, lr=0.1, momentum=0.9), True, (True, None)),
        (torch.optim.Adagrad(host, lr=0.1), False, (None, True)),
        (torch.optim.RMSprop(host, lr=0.1), True, (True, None)),  # no fused kernel: multi-tensor in the host tier
        (torch.optim.RMSprop(host, lr=0.1), False, (None, None)),  # and torch's default elsewhere
        (OwnStep(host, lr=0.1), False, (None, None)),  # a step of its own may not read ``fused``
        (torch.optim.AdamW([nn.Parameter(torch.zeros(4, device="meta"))], lr=0.1), True, (True, None)),
        (torch.optim.AdamW(host, lr=0.1, foreach=True), True, (True, None)),
    ]:
        choose_step_kernels(optimizer, multi_tensor)
        group = optimizer.param_groups[0]
        assert (group["foreach"], group.get("fused")) == expected, type(optimizer).__name__


# -- stream-ordered reads ------------------------------------------------------------------------------------------
class _Event:
    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self._log = log

    def synchronize(self) -> None:
        self._log.append(("host waits", self))


class _Stream:
    def __init__(self, name: str, log: list[tuple[str, Any]]) -> None:
        self.name = name
        self._log = log

    def wait_stream(self, other: _Stream) -> None:
        self._log.append((f"{self.name} waits for {other.name}", None))

    def wait_event(self, event: _Event) -> None:
        self._log.append((f"{self.name} waits for", event))

    def record_event(self) -> _Event:
        return _Event(self._log)

    def synchronize(self) -> None:
        self._log.append(("host waits", self))


class _DeviceModule:
    """What ``torch.get_device_module`` gives for an accelerator, reduced to streams and events that log their use;
    the copies themselves run on the CPU."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.compute = _Stream("compute", self.log)

    def Stream(self, device: torch.device) -> _Stream:  # noqa: N802 (torch's name)
        return _Stream("copy", self.log)

    def current_stream(self, device: torch.device) -> _Stream:
        return self.compute

    def stream(self, stream: _Stream) -> nullcontext[None]:
        return nullcontext()


@pytest.fixture
def device_module(monkeypatch: pytest.MonkeyPatch) -> _DeviceModule:
    module = _DeviceModule()
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: module)
    return module


def test_parameter_shards_read_ahead_from_the_host_tier_without_a_host_wait_per_read(device_module):
    """Note [stream-ordered reads]: in a step whose order read-ahead predicts, each shard's copy to the device is
    ordered before its use by the compute stream waiting on the copy's event, never by the host waiting for it."""
    store = HostStore(torch.device("cpu"))
    store.copies = CopyStream(torch.device("cuda", 0))  # the device module above: logged streams and events
    issued: dict[Hashable, Any] = {}
    start_read = store.start_read

    def logged_start_read(key: Hashable, tensor: Tensor) -> Any:
        move = start_read(key, tensor)
        issued[key] = (move if isinstance(move, Copy) else move.__self__)._event  # type: ignore[union-attr]
        return move

    store.start_read = logged_start_read  # type: ignore[method-assign]
    swapper = TensorSwapper(store, io_entries=2)
    shards = {unit: torch.full((256,), float(unit)) for unit in range(6)}
    for unit, shard in shards.items():
        swapper.add(unit, shard)
    swapper.evict_all()
    swapper.flush()
    for step in range(3):
        device_module.log.clear()
        issued.clear()
        for unit in [*range(6), *reversed(range(6))]:  # forward, then backward
            tensor = swapper.acquire(unit)
            host_waits = [what for what, _ in device_module.log if what == "host waits"]
            assert host_waits == [], f"step {step}, unit {unit}: {len(host_waits)} host waits for {len(issued)} reads"
            waited = [event for what, event in device_module.log if what == "compute waits for"]
            assert any(event is issued[unit] for event in waited), (step, unit)  # ordered before its use
            assert torch.equal(tensor, torch.full((256,), float(unit))), (step, unit)
            swapper.release(unit)
        swapper.end_step()
        assert len(issued) >= 6, step  # every use read its shard again (a clean release frees it)
        assert [what for what, _ in device_module.log if what == "host waits"] == [], step
    swapper.close()
