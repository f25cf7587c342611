"""DDP's step semantics under every stage, through the Trainer: a parameter without gradient is left alone, a step
without backward changes nothing, buffers follow rank 0, step hooks fire once per step, and optimizers that cannot
run on flat shards are refused by name."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_zero import ZeroConfig, ZeroOptimizer
from lightning_zero.checkpoint.slices import owned_parameter_slices
from lightning_zero.stage3.sharded_init import shard_module
from tests.harness import run_distributed
from tests.parity import loss_fn
from tests.test_lightning_features import STEPS, ZERO_RUNS, LitMLP, full_weights, loader, make_trainer, zero
from tests.test_strategy import _dataset

STAGES = {name: int(name[-1]) for name in ZERO_RUNS}


def optimizer_state(trainer: Any, module: nn.Module) -> dict[str, dict[str, Any]]:
    """This rank's view of optimizer 0's state, per parameter name: full tensors under DDP; under ZeRO, the pieces
    this rank owns as ``(start, stop, values)`` (0-d entries as numbers), to be joined across ranks by ``join``."""
    optimizer = trainer.strategy.optimizers[0]
    if not isinstance(optimizer, ZeroOptimizer):
        names = {id(p): n for n, p in module.named_parameters()}
        return {
            names[id(p)]: {k: v.detach().clone() if v.dim() else float(v) for k, v in entry.items()}
            for p, entry in optimizer.state.items()
        }
    pieces: dict[str, dict[str, Any]] = {}
    for s in owned_parameter_slices([optimizer]):
        entry = optimizer.state.get(s.state_key, {}) if s.state_key is not None else {}
        for name, value in entry.items():
            if value.dim() == 0:
                pieces.setdefault(s.fqn, {})[name] = float(value)
                continue
            piece = value[s.state_offset : s.state_offset + s.stop - s.start].detach().clone()
            shown = (s.start, s.stop, piece)
            pieces.setdefault(s.fqn, {})[name] = shown
    return pieces


def join(ranks: list[dict[str, dict[str, Any]]], shapes: dict[str, torch.Size]) -> dict[str, dict[str, Any]]:
    """Every rank's pieces of ZeRO's optimizer state, joined into full tensors per parameter."""
    joined: dict[str, dict[str, Any]] = {}
    for pieces in ranks:
        for fqn, entry in pieces.items():
            for name, shown in entry.items():
                if not isinstance(shown, tuple):
                    assert joined.setdefault(fqn, {}).setdefault(name, shown) == shown, (fqn, name)
                    continue
                start, stop, values = shown
                full = joined.setdefault(fqn, {}).setdefault(name, torch.full((shapes[fqn].numel(),), float("nan")))
                full[start:stop] = values
    return {f: {n: v.view(shapes[f]) if isinstance(v, Tensor) else v for n, v in e.items()} for f, e in joined.items()}


# -- a module that is never used --------------------------------------------------------------------------------------
class LitSpareHead(LitMLP):
    """AdamW with weight decay over every parameter, including a head that no forward ever calls; counts the step
    hooks registered on the optimizer Lightning hands out."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(5, 3)
        self.hook_calls = [0, 0]

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def on_train_start(self) -> None:
        optimizer = self.trainer.strategy.optimizers[0]
        optimizer.register_step_pre_hook(lambda *args: self.hook_calls.__setitem__(0, self.hook_calls[0] + 1))
        optimizer.register_step_post_hook(lambda *args: self.hook_calls.__setitem__(1, self.hook_calls[1] + 1))


def _spare_head(strategy: Any) -> dict[str, Any]:
    module = LitSpareHead()
    initial = {n: p.detach().clone() for n, p in module.spare.named_parameters()}
    trainer = make_trainer(strategy)
    trainer.fit(module, loader(2 * 4 * STEPS))
    return {
        "losses": module.losses,
        "weights": full_weights(trainer, module),
        "state": optimizer_state(trainer, module),
        "initial_spare": initial,
        "hook_calls": module.hook_calls,
    }


def _spare_head_runs() -> dict[str, dict[str, Any]]:
    runs = {"ddp": _spare_head("ddp_find_unused_parameters_true")}
    runs.update({name: _spare_head(zero(stage)) for name, stage in STAGES.items()})
    return runs


@pytest.mark.timeout(240)
def test_a_module_never_used_keeps_its_weights_and_gets_no_optimizer_state_as_under_ddp():
    ranks = run_distributed(_spare_head_runs, 2, init_process_group=False, timeout=200)
    shapes = {n: p.shape for n, p in LitSpareHead().named_parameters()}
    reference = ranks[0]["ddp"]
    assert not any(fqn.startswith("spare.") for fqn in reference["state"])  # DDP: grad None, never stepped
    for name in ZERO_RUNS:
        state = join([runs[name]["state"] for runs in ranks], shapes)
        for rank, runs in enumerate(ranks):
            run = runs[name]
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(runs["ddp"]["losses"]))
            assert run["hook_calls"] == [STEPS, STEPS] == runs["ddp"]["hook_calls"], (name, rank)
            for fqn, initial in run["initial_spare"].items():
                # Bit-identical: the spare head never moves (AdamW's weight decay alone would move it).
                assert torch.equal(run["weights"][f"spare.{fqn}"], initial), (name, fqn)
                assert torch.equal(run["weights"][f"spare.{fqn}"], runs["ddp"]["weights"][f"spare.{fqn}"])
            for fqn, expected in runs["ddp"]["weights"].items():
                torch.testing.assert_close(run["weights"][fqn], expected, rtol=1e-5, atol=1e-6, msg=f"{name} {fqn}")
        assert state.keys() == reference["state"].keys(), name  # no state at all for the spare head
        for fqn, expected in reference["state"].items():
            assert state[fqn]["step"] == expected["step"] == STEPS, (name, fqn)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(state[fqn][key], expected[key], rtol=1e-5, atol=1e-7, msg=f"{fqn} {key}")


# -- an optimizer step without backward -------------------------------------------------------------------------------
class LitStepWithoutBackward(LitMLP):
    """Manual optimization; every other batch steps without any backward. Records whether that step changed this
    rank's parameters or optimizer state."""

    def __init__(self) -> None:
        super().__init__("adamw")
        self.automatic_optimization = False
        self.changed: list[bool] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        if batch_idx % 2 == 0:
            self.manual_backward(super().training_step(batch, batch_idx))
            optimizer.step()
            return
        before = _local_state(self.trainer)
        optimizer.step()
        after = _local_state(self.trainer)
        same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        self.changed.append(not same)


def _local_state(trainer: Any) -> list[Tensor]:
    optimizer = trainer.strategy.optimizers[0]
    tensors = [b.param_shard for b in optimizer.buckets] + list(optimizer.masters)
    tensors += [v for entry in optimizer.state.values() for v in entry.values()]
    return [t.detach().clone() for t in tensors]


def _without_backward() -> dict[str, list[bool]]:
    changed = {}
    for name, stage in STAGES.items():
        module = LitStepWithoutBackward()
        make_trainer(zero(stage)).fit(module, loader(2 * 4 * STEPS))
        changed[name] = module.changed
    return changed


@pytest.mark.timeout(180)
def test_a_manual_optimizer_step_without_backward_changes_nothing():
    for changed in run_distributed(_without_backward, 2, init_process_group=False):
        for name in ZERO_RUNS:
            assert changed[name] == [False] * (STEPS // 2), name


# -- training_step returning None --------------------------------------------------------------------------------------
class LitSkipsSomeSteps(LitMLP):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


def _none_errors() -> dict[str, str]:
    errors = {}
    for name, strategy in (("ddp", "ddp"), *((n, zero(s)) for n, s in STAGES.items())):
        try:
            make_trainer(strategy).fit(LitSkipsSomeSteps(), loader(2 * 4 * STEPS))
            errors[name] = ""
        except RuntimeError as error:
            errors[name] = str(error)
    return errors


@pytest.mark.timeout(120)
def test_training_step_returning_none_is_refused_as_under_ddp():
    for errors in run_distributed(_none_errors, 2, init_process_group=False):
        assert "returning None in distributed training is not supported" in errors["ddp"]
        for name in ZERO_RUNS:
            assert errors[name] == errors["ddp"], name


# -- BatchNorm: buffers follow rank 0 ---------------------------------------------------------------------------------
class LitBatchNorm(LitMLP):
    """BatchNorm between two layers; every rank records its own validation losses (no sync) and final buffers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.model = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))
        self.val_losses: list[float] = []

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.val_losses.append(loss_fn("mlp", self.model, batch).item())


def _batch_norm(strategy: Any) -> dict[str, Any]:
    module = LitBatchNorm()
    trainer = make_trainer(strategy, val_check_interval=3, limit_val_batches=2, accumulate_grad_batches=2)
    trainer.fit(module, loader(2 * 4 * 2 * STEPS), DataLoader(_dataset("mlp", 2 * 4 * 2), batch_size=4))
    return {
        "val_losses": module.val_losses,
        "buffers": {n: b.clone() for n, b in module.named_buffers()},
        "weights": full_weights(trainer, module),
    }


def _batch_norm_runs() -> dict[str, dict[str, Any]]:
    runs = {name: _batch_norm(s) for name, s in (("ddp", "ddp"), *((n, zero(st)) for n, st in STAGES.items()))}
    runs["zero2_own_buffers"] = _batch_norm(zero(2, broadcast_buffers=False))
    return runs


@pytest.mark.timeout(240)
def test_batch_norm_statistics_and_validation_on_every_rank_match_ddp():
    ranks = run_distributed(_batch_norm_runs, 2, init_process_group=False, timeout=200)
    for rank, runs in enumerate(ranks):
        reference = runs["ddp"]
        assert len(reference["val_losses"]) > 4  # sanity check + two validations during the fit
        for name in ZERO_RUNS:
            run = runs[name]
            torch.testing.assert_close(
                torch.tensor(run["val_losses"]), torch.tensor(reference["val_losses"]), rtol=1e-5, atol=1e-6
            )
            for fqn, expected in reference["buffers"].items():
                torch.testing.assert_close(run["buffers"][fqn], expected, rtol=1e-5, atol=1e-6, msg=f"{name} {fqn}")
            for fqn, expected in reference["weights"].items():
                torch.testing.assert_close(run["weights"][fqn], expected, rtol=1e-5, atol=1e-6, msg=f"{name} {fqn}")
        # Without the broadcast rank 1 validates its own statistics: the comparison above can fail.
        own = torch.tensor(runs["zero2_own_buffers"]["val_losses"])
        close = torch.allclose(own, torch.tensor(reference["val_losses"]), rtol=1e-5, atol=1e-6)
        assert close == (rank == 0), rank


# -- buffers of a model built on meta ---------------------------------------------------------------------------------
class Rotary(nn.Module):
    """A buffer computed in ``__init__``, like RoPE's ``inv_freq``; ``reset_parameters`` may or may not redo it."""

    def __init__(self, resets: bool) -> None:
        super().__init__()
        self.resets = resets
        self.proj = nn.Linear(8, 8)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    @staticmethod
    def _inv_freq() -> Tensor:
        return 1.0 / (10_000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()
        if self.resets:
            self.inv_freq.copy_(self._inv_freq())


def _meta_buffers(resets: bool) -> str:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Rotary(resets))
    try:
        shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, torch.device("cpu"))
    except RuntimeError as error:
        return str(error)
    return "ok" if torch.equal(model[1].inv_freq, Rotary._inv_freq()) else f"wrong: {model[1].inv_freq}"


@pytest.mark.timeout(60)
def test_meta_built_buffers_are_initialized_or_refused_naming_the_module():
    for initialized, refused in run_distributed(_meta_buffers_both, 2):
        assert initialized == "ok"
        assert "'1.inv_freq' of Rotary" in refused
        assert "HINT: compute them in Rotary.reset_parameters()" in refused


def _meta_buffers_both() -> tuple[str, str]:
    return _meta_buffers(True), _meta_buffers(False)


# -- optimizer hooks and optimizers that are not element-wise ---------------------------------------------------------
class Lamb(torch.optim.Optimizer):
    """A LAMB-like optimizer from outside torch: the step is scaled by a per-tensor trust ratio."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad * p.norm() / (p.grad.norm() + 1e-6))


class Lion(torch.optim.Optimizer):
    """Lion (sign of an interpolated momentum): element-wise, from outside torch."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("momentum", torch.zeros_like(p))
                p.add_(torch.sign(momentum * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                momentum.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class SubclassedAdamW(torch.optim.AdamW):
    pass


def _build(kind: type[torch.optim.Optimizer], declared: tuple[str, ...]) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 2))
    try:
        ZeroOptimizer(model, kind(model.parameters()), dist.group.WORLD, ZeroConfig(elementwise_optimizers=declared))
    except TypeError as error:
        return str(error)
    return "accepted"


def _hooks_and_optimizers() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    reference = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    reference.module.load_state_dict(model.state_dict())
    inner = Lion(model.parameters(), lr=1e-2)
    calls: dict[str, int] = OrderedDict(pre=0, post=0, inner_pre=0, state_dict=0)
    config = ZeroConfig(stage=2, bucket_numel=100, elementwise_optimizers=("Lion",))
    optimizer = ZeroOptimizer(model, inner, dist.group.WORLD, config)
    optimizer.register_step_pre_hook(lambda *a: calls.__setitem__("pre", calls["pre"] + 1))
    optimizer.register_step_post_hook(lambda *a: calls.__setitem__("post", calls["post"] + 1))
    inner.register_step_pre_hook(lambda *a: calls.__setitem__("inner_pre", calls["inner_pre"] + 1))
    optimizer.register_state_dict_pre_hook(lambda *a: calls.__setitem__("state_dict", calls["state_dict"] + 1))
    ref_optimizer = Lion(reference.parameters(), lr=1e-2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):
        model(x).square().mean().backward()
        optimizer.step()
        reference(x).square().mean().backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    optimizer.state_dict()
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    return {
        "buckets": len(optimizer.buckets),
        "calls": dict(calls),
        "lion_matches_ddp": same,
        "lamb": _build(Lamb, ()),
        "lamb_declared": _build(Lamb, ("Lamb",)),
        "lion": _build(Lion, ()),
        "subclassed_adamw": _build(SubclassedAdamW, ()),
    }


@pytest.mark.timeout(60)
def test_step_hooks_fire_once_per_step_and_optimizers_not_known_element_wise_are_refused_by_name():
    for result in run_distributed(_hooks_and_optimizers, 2):
        assert result["buckets"] > 1  # the step runs in chunks, one inner step per bucket
        assert result["calls"] == {"pre": 3, "post": 3, "inner_pre": 3, "state_dict": 1}
        assert result["lion_matches_ddp"]
        lamb = result["lamb"]
        assert "tests.test_step_semantics.Lamb cannot be sharded by ZeRO" in lamb
        assert "elementwise_optimizers=('Lamb',)" in lamb
        # Declared element-wise, LAMB still fails the probe (its trust ratio reads the whole tensor).
        assert "is declared element-wise in ZeroConfig.elementwise_optimizers, but it is not" in result["lamb_declared"]
        assert "elementwise_optimizers=('Lion',)" in result["lion"]
        assert result["subclassed_adamw"] == "accepted"
