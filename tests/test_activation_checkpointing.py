"""``ZeroConfig.activation_checkpointing_policy``: the selected layers recompute their activations in backward (torch's
checkpoint wrapper, applied before stage 3 forms its units); DDP's numbers at every stage, the checkpoint names of the
unwrapped model, and the activation memory it saves."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.checkpoint.sharded_checkpoint import owned_parameter_slices
from lightning_zero.compat import CheckpointWrapper
from lightning_zero.models.gpt import GPT, Block, GPTConfig
from lightning_zero.sharding.activation_checkpointing import apply_activation_checkpointing_policy, state_dict_name
from tests import memory_probe
from tests.harness import run_distributed
from tests.test_strategy import STEPS, ParityModule, _dataset, _full_weights, _trainer, assert_fits_match, fit


def _wrapped(module: nn.Module) -> int:
    return sum(isinstance(m, CheckpointWrapper) for m in module.modules())


def _fit(strategy: ZeroStrategy, save_to: str | None = None, resume_from: str | None = None) -> dict[str, Any]:
    module = ParityModule("gpt", "adamw")
    trainer = _trainer(strategy)
    trainer.fit(module, DataLoader(_dataset("gpt", 2 * 4 * STEPS), batch_size=4), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    moments = _moments_by_name(trainer.strategy)
    units = [u.name for u in strategy._gatherer.units] if strategy._gatherer is not None else []
    weights = {state_dict_name(n): w for n, w in _full_weights(trainer, module.model).items()}
    return {
        "losses": module.losses,
        "lrs": module.lrs,
        "weights": weights,
        "moments": moments,
        "wrapped": _wrapped(module),
        "units": units,
    }


def _moments_by_name(strategy: ZeroStrategy) -> dict[tuple[str, str, int], Tensor]:
    """This rank's Adam moments, by (parameter name, state name, first flat element owned): the bucket layout may
    differ between runs, the elements of each parameter must not."""
    zero = strategy.optimizers[0]
    moments = {}
    for s in owned_parameter_slices([zero], strategy._gatherer):
        if s.state_key is None or s.stop == s.start:
            continue
        for name, value in zero.state[s.state_key].items():
            if value.dim() > 0:
                moments[(s.fqn, name, s.start)] = value[s.state_offset : s.state_offset + s.stop - s.start].clone()
    return moments


def _whole(ranks: list[dict[tuple[str, str, int], Tensor]]) -> dict[tuple[str, str], Tensor]:
    pieces: dict[tuple[str, str], list[tuple[int, Tensor]]] = {}
    for moments in ranks:
        for (fqn, name, start), value in moments.items():
            pieces.setdefault((fqn, name), []).append((start, value))
    return {key: torch.cat([v for _, v in sorted(parts, key=lambda p: p[0])]) for key, parts in pieces.items()}


def _ddp_then_checkpointed_stages(checkpoint: str) -> dict[str, Any]:
    reference = fit("ddp", "gpt", "adamw")
    runs: dict[int | str, dict[str, Any]] = {}
    for stage in (1, 2, 3):
        policy = {Block} if stage != 2 else lambda module: isinstance(module, Block)  # classes, or a callable
        strategy = ZeroStrategy(stage=stage, bucket_numel=4_000, activation_checkpointing_policy=policy)
        runs[stage] = _fit(strategy, save_to=checkpoint if stage == 3 else None)
    # The units inside the wrappers: each wrapper's checkpointed forward gathers its block, and so does the
    # recomputation in backward.
    inside = ZeroStrategy(stage=3, wrap_module_classes=("Block",), activation_checkpointing_policy={Block})
    runs["3, units inside"] = _fit(inside)
    # The stage-3 checkpoint, saved with the policy, into the same model without it (fit restores it, optimizer
    # state included, and stops at once: max_steps is reached).
    resumed = _fit(ZeroStrategy(stage=3, bucket_numel=4_000), resume_from=checkpoint)
    return {"reference": reference, "runs": runs, "saved": runs[3], "resumed": resumed}


@pytest.mark.timeout(240)
def test_checkpointing_policy_matches_ddp_at_every_stage_and_keeps_checkpoint_names(tmp_path):
    results = run_distributed(
        _ddp_then_checkpointed_stages, 2, str(tmp_path / "with_policy"), init_process_group=False, timeout=220
    )
    saved, resumed = (_whole([r[run]["moments"] for r in results]) for run in ("saved", "resumed"))
    assert saved.keys() == resumed.keys()
    assert len(saved) > 0
    for key, expected in saved.items():
        torch.testing.assert_close(resumed[key], expected, rtol=0, atol=0, msg=str(key))
    for result in results:
        reference = result["reference"]
        for stage, run in result["runs"].items():
            assert run["wrapped"] == 2, stage  # both blocks of the parity GPT
            assert_fits_match(reference, run)
        # The wrapper stands where the block was: still a unit; or the block inside it is.
        assert result["runs"][3]["units"] == ["<root>", "model.blocks.0", "model.blocks.1"]
        inside = ["<root>", "model.blocks.0._checkpoint_wrapped_module", "model.blocks.1._checkpoint_wrapped_module"]
        assert result["runs"]["3, units inside"]["units"] == inside
        resumed = result["resumed"]
        assert resumed["wrapped"] == 0
        assert resumed["losses"] == []  # restored at max_steps: nothing trained after the load
        for name, expected in result["runs"][3]["weights"].items():
            torch.testing.assert_close(resumed["weights"][name], expected, rtol=0, atol=0, msg=name)


def test_policy_forms_are_validated_and_normalized():
    assert ZeroConfig(activation_checkpointing_policy={Block}).activation_checkpointing_policy == (Block,)
    assert ZeroConfig(activation_checkpointing_policy=["Block"]).activation_checkpointing_policy == ("Block",)
    with pytest.raises(TypeError, match=r"Invalid ZeroConfig\.activation_checkpointing_policy: \[3\]"):
        ZeroConfig(activation_checkpointing_policy=[3])
    model = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    with pytest.raises(ValueError, match=r"\['Blok'\] name no module class of GPT"):
        apply_activation_checkpointing_policy(model, ("Blok",))
    with pytest.raises(ValueError, match=r"\['Conv1d'\] is no module class"):
        apply_activation_checkpointing_policy(model, (nn.Conv1d,))
    assert apply_activation_checkpointing_policy(model, lambda m: isinstance(m, Block)) == 2
    assert apply_activation_checkpointing_policy(model, ("lightning_zero.models.gpt.Block",)) == 0  # already applied
    plain = GPT(model.config)
    assert [state_dict_name(n) for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(model.state_dict()) == list(plain.state_dict())


def _peak_of_forward_and_backward(model: GPT, tokens: Tensor) -> int:
    memory_probe.reset_peak()
    before = memory_probe.rss_bytes()
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    peak = memory_probe.peak_rss_bytes() - before
    model.zero_grad(set_to_none=True)
    return peak


def test_checkpointing_every_block_saves_most_activation_memory():
    """8 blocks, batch 8 x 128 tokens: a forward and backward with every block checkpointed peaks at a fraction of
    the memory it takes with every activation kept (the saved activations of one block, recomputed in backward,
    instead of all eight). Measured as resident memory with freed memory returned (``tests/memory_probe.py``)."""
    memory_probe.return_freed_memory_to_the_kernel()
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=8, n_embd=128, n_head=4, vocab_size=256, block_size=128))
    tokens = torch.randint(0, 256, (8, 129))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients allocated before measuring: only activations remain
    _peak_of_forward_and_backward(model, tokens)  # page in the code paths
    kept = _peak_of_forward_and_backward(model, tokens)
    apply_activation_checkpointing_policy(model, (Block,))
    _peak_of_forward_and_backward(model, tokens)
    checkpointed = _peak_of_forward_and_backward(model, tokens)
    print(f"peak of forward+backward: {kept / 1e6:.1f} MB kept, {checkpointed / 1e6:.1f} MB checkpointed")
    assert checkpointed < 0.4 * kept, (kept / 1e6, checkpointed / 1e6)


def _full_saves_with_the_policy_resume_ddp(root: str) -> dict[int, tuple[Any, ...]]:
    """At stages 2 and 3 under the policy: one full ``.ckpt`` at step 2, and DDP resumed from it (one more step)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.test_checkpoint_trainer import Snapshot, fit

    runs = {}
    for stage in (2, 3):
        at_save, at_load = Snapshot(at="save"), Snapshot(at="start")
        saves = ModelCheckpoint(dirpath=f"{root}/{stage}", every_n_train_steps=2, save_top_k=-1)
        policy = ZeroStrategy(
            stage=stage, bucket_numel=3_000, state_dict_type="full", activation_checkpointing_policy={Block}
        )
        wrapped = _wrapped(fit(policy, 2, 2, root, callbacks=[at_save, saves]))
        fit("ddp", 2, 3, root, ckpt=f"{root}/{stage}/epoch=0-step=2.ckpt", callbacks=[at_load])
        runs[stage] = (at_save.taken, at_load.taken, wrapped)
    return runs


@pytest.mark.timeout(180)
def test_full_checkpoint_under_the_policy_holds_every_parameters_optimizer_state_and_resumes_ddp(tmp_path):
    """Item: a full save names the optimizer state of wrapped layers as the unwrapped model does (their Adam state
    was dropped when the names kept the wrapper's segment)."""
    from tests.test_checkpoint_trainer import TinyGPT, assert_same_training_state

    results = run_distributed(_full_saves_with_the_policy_resume_ddp, 2, str(tmp_path), init_process_group=False)
    trainable = sum(p.requires_grad for p in TinyGPT().parameters())
    for stage in (2, 3):
        assert all(r[stage][2] == 2 for r in results)  # both blocks of TinyGPT's GPT were wrapped
        # DDP starts from ZeRO's exact weights and the Adam state of every parameter.
        assert_same_training_state([r[stage][1] for r in results], [r[stage][0] for r in results])
        (adam,) = torch.load(tmp_path / str(stage) / "epoch=0-step=2.ckpt", weights_only=True)["optimizer_states"]
        assert len(adam["state"]) == trainable, stage
        assert all(set(entry) == {"step", "exp_avg", "exp_avg_sq"} for entry in adam["state"].values())
