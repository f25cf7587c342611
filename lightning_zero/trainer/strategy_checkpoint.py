"""The checkpoint hooks of ``ZeroStrategy``: a sharded directory per checkpoint, written and read by every rank.

``ShardedCheckpointing`` routes Lightning's checkpoint hooks to ``lightning_zero.checkpoint``, on top of the processes
and their group (``ProcessPerDevice``, ``strategy_processes.py``); ``ZeroStrategy`` (``strategy.py``) inherits them and
adds everything else.

Note [Lightning's WeightAveraging]
Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``, SWA) deep-copy the module into an
``AveragedModel`` when fit starts, update it from ``pl_module.parameters()`` after steps and swap values with the
parameters around validation. At stages 1 and 2 every rank holds full parameters between steps, and the next step
starts from parameters edited there, so all of that works unchanged, with the callback's own full copy per rank. Its
checkpoint protocol does not: ``on_save_checkpoint`` moves the strategy's state dict (this rank's shards) to
``current_model_state`` and puts the full average in ``state_dict``. ``save_checkpoint`` puts them back where the
sharded format expects them and stores the average whole, once (``save_sharded_checkpoint(averaged=)``);
``load_checkpoint`` returns it as ``state_dict`` and the loaded live weights as ``current_model_state``, which is what
the callback's ``on_load_checkpoint`` reads; ``consolidate --weights ema`` exports it. At stage 3 a parameter holds no
data outside its unit's forward: the average would be built from empty parameters and the swap writes into them, so
the strategy refuses the callback when it connects, before the callback copies anything, and names ``ShardedEMA``.

Note [the module's state for Lightning and for a checkpoint]
Lightning asks a strategy for the model's state through ``lightning_module_state_dict()``, both when it dumps a
checkpoint and for any other caller (a callback exporting weights, Lightning's own strategy tests comparing them with
``load_from_checkpoint``). Any other caller wants tensors with the model's values, as Lightning's sharded strategies
return them: ``module.state_dict()`` (at stage 3 FSDP2's DTensor rows, Note [a stage-3 model's state dict]), or with
``state_dict_type="full"`` the full tensors on rank 0 and nothing on the others, as FSDP's strategy gives; so
``lightning_module_state_dict()`` returns those. A checkpoint dump hands the dictionary to the checkpoint hooks and
then writes this rank's owned ranges of each parameter, nothing copied; so the strategy has the dump take the model's
state from ``checkpoint_model_state()`` when it connects (``compat.route_checkpoint_model_state``): the same values,
on every rank, read from the shards only where a hook uses them, and written from the shards where the hooks left
them (Note [checkpoint hooks see the model's values] in ``checkpoint/model_entries.py``). A load reads the
checkpoint's entries in ``load_checkpoint`` and loads the model from what ``on_load_checkpoint`` left in
``load_model_state_dict`` (Note [on_load_checkpoint edits what loads] in ``checkpoint/saved_entries.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import lightning
import lightning.pytorch as pl
from lightning.pytorch import callbacks
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.async_save import AsyncSaver
from lightning_zero.checkpoint.files import remove
from lightning_zero.checkpoint.frozen import FROZEN_KEY, frozen_keys, source_path
from lightning_zero.checkpoint.full_save import save_full_checkpoint
from lightning_zero.checkpoint.model_entries import HookEntries, Written, written_state
from lightning_zero.checkpoint.module_state import ModuleState
from lightning_zero.checkpoint.saved_entries import PendingLoad, load_edited, read_for_hooks
from lightning_zero.checkpoint.sharded_checkpoint import (
    save_sharded_checkpoint,
    sharded_optimizer_state,
)
from lightning_zero.compat import MockOptimizer, route_checkpoint_model_state
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.optimizer_wrapping import as_zero_optimizer
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from lightning_zero.trainer.auto_setup import AUTO_KEY
from lightning_zero.trainer.strategy_processes import ProcessPerDevice


class ShardedCheckpointing(ProcessPerDevice):
    """Lightning's checkpoint hooks for a strategy whose optimizers are ``ZeroOptimizer``s."""

    config: ZeroConfig
    _tiers: MemoryTiers | None
    """The memory tiers; saves and loads stream through them (Note [checkpoints stream through the tiers] in
    ``checkpoint/tiered.py``)."""
    _gatherer: ParameterGatherer | None
    """Stage 3's sharded model; None for stages 1 and 2."""
    pretrained_source: str | None = None
    """The pretrained weights this run loaded (``fit(ckpt_path=<pretrained>)``, ``load_full_state_dict``), recorded
    by checkpoints that leave frozen parameters out (Note [frozen base restored from its source])."""
    built_on_meta: bool = False
    """Whether stage 3 built the model on the meta device and initialized it (no weights of its own)."""
    async_saver: AsyncSaver | None = None
    """``ZeroConfig.async_save``: the background writer, created at setup (Note [asynchronous save])."""
    _module_state: ModuleState | None = None
    """Stage 3's ``state_dict()``/``load_state_dict()`` of the model; None for stages 1 and 2."""
    _pending_load: PendingLoad | None = None
    """A checkpoint read by ``load_checkpoint`` whose model loads in ``load_model_state_dict`` (Note
    [on_load_checkpoint edits what loads])."""
    _hook_entries: HookEntries | None = None
    """The model's entries handed to the checkpoint hooks of the save in progress (Note [checkpoint hooks see the
    model's values])."""

    def start_saves(self) -> None:
        """``ZeroConfig.async_save``: create the background writer and its process group, unless there is one.
        Collective: at setup, and at a save after the end of training."""
        if self.config.async_save and self.async_saver is None:
            self.async_saver = AsyncSaver(timedelta(seconds=self.config.collective_timeout_s), self.process_group)

    def finish_saves(self) -> None:
        """Wait for the asynchronous save in flight, if any, and raise its error (the end of training)."""
        if self.async_saver is not None:
            saver, self.async_saver = self.async_saver, None
            saver.close()

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        # Checkpoints save the ranges: Note [the module's state for Lightning and for a checkpoint].
        route_checkpoint_model_state(model.trainer, self.checkpoint_model_state)
        refuse_weight_averaging_at_stage_3(model.trainer.callbacks, self.config.stage)  # type: ignore[attr-defined]
        refuse_parameter_changing_callbacks(model.trainer.callbacks, self.config.stage)  # type: ignore[attr-defined]
        if self.config.state_dict_type == "full":
            refuse_remote_full_checkpoints(model.trainer)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints load straight into the optimizer shards, which setup() creates

    @property
    def memory_tiers(self) -> MemoryTiers | None:
        """This rank's memory tiers (``ZeroConfig.offload_*``), or None."""
        return self._tiers

    def settle_optimizers(self) -> None:
        """Publish a delayed update still in flight (Note [delayed parameter update] in ``offload/host_steps.py``):
        what is saved, loaded or swapped is the state after every step taken. Collective."""
        for optimizer in iter_zero_optimizers(self.optimizers):
            optimizer.settle()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state dict with its values, as Lightning's sharded strategies give it: DTensor rows
        at stage 3, or with ``state_dict_type="full"`` full tensors on rank 0 (none on the others). Collective at
        stage 3. (Note [the module's state for Lightning and for a checkpoint])"""
        module = self.lightning_module
        assert module is not None
        self.settle_optimizers()
        if self.config.state_dict_type == "full":
            with self.full_state_dict(offload_to_cpu=True, rank0_only=True):
                state = module.state_dict()
            return state if self.is_global_zero else {}
        return module.state_dict()

    def full_state_dict(self, offload_to_cpu: bool = True, rank0_only: bool = False) -> AbstractContextManager[None]:
        """Full tensors from ``state_dict()`` inside the context: ``ZeroStrategy``'s."""
        raise NotImplementedError

    def checkpoint_model_state(self) -> dict[str, Any]:
        """The LightningModule's state as the checkpoint hooks see it: tensors with the model's values, nothing copied
        or gathered until a hook reads one; ``save_checkpoint`` writes what they left (Note [the module's state for
        Lightning and for a checkpoint], Note [checkpoint hooks see the model's values])."""
        self._hook_entries = self._model_entries()
        return self._hook_entries.state

    def _model_entries(self) -> HookEntries:
        assert self.lightning_module is not None
        self.settle_optimizers()
        zero_optimizers = list(iter_zero_optimizers(self.optimizers))
        full = self.config.state_dict_type == "full"
        module, gatherer, tiers = self.lightning_module, self._gatherer, self._tiers
        return HookEntries(module, zero_optimizers, gatherer, tiers, self._module_state, full)

    def _written_model_state(self, state: Any) -> Written:
        """What this rank writes of the model's state the hooks left; collective, refusals before anything is
        written (Note [checkpoint hooks see the model's values])."""
        entries, self._hook_entries = self._hook_entries, None
        if entries is None:  # not dumped by the Trainer: every entry is the caller's own
            entries = self._model_entries()
        try:
            return written_state(
                entries,
                state,
                self.process_group,
                exclude_frozen=self.config.exclude_frozen_parameters,
                full=self.config.state_dict_type == "full",
            )
        finally:
            entries.release()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, MockOptimizer):  # no optimizer: a checkpoint holds no optimizer state
            return {}
        self.settle_optimizers()
        zero_optimizers = list(iter_zero_optimizers(self.optimizers))
        index = zero_optimizers.index(as_zero_optimizer(optimizer))
        return sharded_optimizer_state(zero_optimizers, index, self._tiers)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes what it owns into the directory ``filepath``; call it on every rank."""
        if storage_options is not None:
            raise TypeError(
                f"ZeroStrategy.save_checkpoint(storage_options={storage_options!r}) is not supported: sharded "
                "checkpoints are written by every rank, not through a CheckpointIO plugin. HINT: drop storage_options."
            )
        if any(isinstance(o, MockOptimizer) for o in self.optimizers) and "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = []  # trained without an optimizer: nothing to save or restore
        saved_with = {"world_size": self.world_size, "stage": self.config.stage}
        decision = getattr(self, "auto_decision", None)
        if decision is not None:  # stage="auto": what was chosen, and from what (Note [automatic configuration])
            checkpoint[AUTO_KEY] = decision.record()
        averaged = None
        if _WEIGHT_AVERAGING_LIVE in checkpoint:  # Note [Lightning's WeightAveraging]
            averaged = checkpoint.pop("state_dict")
            checkpoint["state_dict"] = checkpoint.pop(_WEIGHT_AVERAGING_LIVE)
        written = self._written_model_state(checkpoint.get("state_dict"))
        checkpoint["state_dict"] = written.state
        if self.config.exclude_frozen_parameters:  # Note [frozen base restored from its source]
            checkpoint[FROZEN_KEY] = {"excluded": written.excluded, "source": self.pretrained_source}
        if self.config.state_dict_type == "full":  # one file as DDP writes it: Note [full checkpoint streamed]
            if averaged is not None:  # back where Lightning's callback put them
                checkpoint[_WEIGHT_AVERAGING_LIVE] = checkpoint.pop("state_dict")
                checkpoint["state_dict"] = averaged
            assert self.lightning_module is not None
            save_full_checkpoint(
                checkpoint,
                self.broadcast(filepath),
                self.lightning_module,
                list(iter_zero_optimizers(self.optimizers)),
                self.process_group,
                self._gatherer,
                self._tiers,
                param_of=written.params,
                as_left=written.as_left,
            )
            return
        path = self.broadcast(filepath)
        if self.config.async_save:  # Note [asynchronous save]
            self.start_saves()
            assert self.async_saver is not None
            self.async_saver.save(checkpoint, path, self.process_group, saved_with, averaged, written.masters)
            return
        save_sharded_checkpoint(checkpoint, path, self.process_group, saved_with, averaged, written.masters)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a sharded directory (any world size or stage) or a full ``.ckpt`` file, whose model and optimizer
        state ``load_model_state_dict`` loads into this rank's shards once ``on_load_checkpoint`` has run; or load
        pretrained weights only (a ``.safetensors`` file, a Hugging Face directory), from which training starts.

        Always as ``weights_only=True`` would (see Note [safe loading] in ``checkpoint/files.py``).
        """
        if self.async_saver is not None:
            self.async_saver.wait()  # the checkpoint may be the one in flight
        module = self.lightning_module
        assert module is not None
        self.settle_optimizers()
        # The model loads in load_model_state_dict, after on_load_checkpoint: Note [on_load_checkpoint edits what
        # loads] (pretrained weights and a WeightAveraging checkpoint load here).
        state, self._pending_load = read_for_hooks(
            self.broadcast(checkpoint_path),
            module,
            list(iter_zero_optimizers(self.optimizers)),
            self.process_group,
            load_optimizer=module.trainer.state.fn == TrainerFn.FITTING,
            strict=module.strict_loading,
            gatherer=self._gatherer,
            tiers=self._tiers,
            built_on_meta=self.built_on_meta,
        )
        if not state:  # pretrained weights (a safetensors file or directory): training starts from them
            self.pretrained_source = source_path(self.broadcast(checkpoint_path))
            return weights_only_checkpoint(module.trainer)
        frozen = state.get(FROZEN_KEY)
        if isinstance(frozen, dict) and frozen.get("source") is not None:  # the base came from there: saves say so
            self.pretrained_source = frozen["source"]
        if self._pending_load is None and "state_dict" in state:  # Note [Lightning's WeightAveraging]: the average
            # The live weights are in place already; loading them into the module again changes nothing.
            state[_WEIGHT_AVERAGING_LIVE] = module.state_dict()
        return state

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        module = self.lightning_module
        if self.config.exclude_frozen_parameters and self.built_on_meta and self.pretrained_source is None:
            assert module is not None
            frozen = frozen_keys(module)
            if frozen:
                raise ValueError(
                    f"ZeroConfig.exclude_frozen_parameters=True leaves {len(frozen)} frozen parameter(s) out of "
                    f"checkpoints (e.g. {frozen[:3]}), but this model was built on the meta device and initialized, "
                    "and no pretrained weights were loaded: a resume could not restore them (Note [frozen base "
                    "restored from its source]). HINT: load the pretrained base with `trainer.fit(model, "
                    "ckpt_path=<pretrained>)` or `lightning_zero.load_full_state_dict(trainer.strategy, <pretrained>)` "
                    "in `on_fit_start`, build the model with its weights in `__init__`, or set "
                    "exclude_frozen_parameters=False."
                )

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load the model, and when fitting its optimizers, from ``checkpoint["state_dict"]`` as ``on_load_checkpoint``
        left it, straight into this rank's shards (Note [on_load_checkpoint edits what loads]). Collective."""
        pending, self._pending_load = self._pending_load, None
        if pending is not None:
            load_edited(pending, checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # load_model_state_dict() loaded it with the weights, in one read of the files

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.is_global_zero:
            return
        if self.async_saver is not None:  # not before the save in flight is committed: Note [asynchronous save]
            self.async_saver.after_commit(lambda: remove(filepath))
            return
        remove(filepath)


_WEIGHT_AVERAGING_LIVE = "current_model_state"
"""Where ``WeightAveraging.on_save_checkpoint`` moves the live state dict (Note [Lightning's WeightAveraging])."""


def weights_only_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """What Lightning restores after ``load_checkpoint`` put pretrained weights (``fit(ckpt_path=hf_dir)``) in place:
    nothing. Loops start at zero; the optimizers (already loaded: nothing) and LR schedulers keep their own state."""
    return {
        "pytorch-lightning_version": lightning.__version__,
        "optimizer_states": [],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }


def refuse_remote_full_checkpoints(trainer: pl.Trainer) -> None:
    """``state_dict_type="full"`` writes local files (``checkpoint/full_save.py``): refuse remote checkpoint
    directories when fit starts rather than at the first save."""
    for callback in trainer.checkpoint_callbacks:
        directory = str(getattr(callback, "dirpath", None) or trainer.default_root_dir)
        if "://" in directory and not directory.startswith("file://"):
            raise ValueError(
                f"ZeroConfig.state_dict_type='full' writes local files, but {type(callback).__name__} saves under "
                f"{directory}. HINT: use state_dict_type='sharded' (the default) for remote storage and "
                "`python -m lightning_zero consolidate` for one file, or save to a local directory."
            )


def refuse_weight_averaging_at_stage_3(trainer_callbacks: list[pl.Callback], stage: int) -> None:
    weight_averaging = getattr(callbacks, "WeightAveraging", None)  # Lightning >= 2.5
    if stage != 3 or weight_averaging is None:
        return
    for callback in trainer_callbacks:
        if isinstance(callback, weight_averaging):
            raise ValueError(
                f"Lightning's {type(callback).__name__} callback cannot run under ZeroStrategy(stage=3): it copies "
                "the whole model and reads and writes full parameters between steps, and at stage 3 a parameter "
                "holds no data outside its unit's forward (Note [Lightning's WeightAveraging]). HINT: use "
                "`lightning_zero.ShardedEMA(decay=..., update_every_n_steps=..., update_starting_at_step=..., "
                "update_starting_at_epoch=...)`, which takes EMAWeightAveraging's arguments and averages each rank's "
                "shard at every stage, or train with stage 1 or 2."
            )


def refuse_parameter_changing_callbacks(trainer_callbacks: list[pl.Callback], stage: int) -> None:
    """Refuse, when fit starts, Lightning's callbacks that would fail only after training has run.

    ``StochasticWeightAveraging`` (not a ``WeightAveraging`` subclass) copies its full average into the parameters
    when training ends, which at stage 3 are placeholders (Note [Lightning's WeightAveraging]); at stages 1 and 2 it
    gives DDP's weights (``tests/test_lightning_callbacks.py``). ``BaseFinetuning`` callbacks unfreeze layers
    mid-fit with ``optimizer.add_param_group``, which ``ZeroOptimizer`` refuses at every stage: it decides at setup
    which parameters it reduces, shards and steps.
    """
    for callback in trainer_callbacks:
        name = type(callback).__name__
        if stage == 3 and isinstance(callback, callbacks.StochasticWeightAveraging):
            raise ValueError(
                f"Lightning's {name} callback cannot run under ZeroStrategy(stage=3): it copies the whole model "
                "and, when training ends, writes its full average into the parameters, which at stage 3 hold no data "
                "outside their unit's forward (Note [Lightning's WeightAveraging]). HINT: train with stage 1 or 2, "
                "where it gives DDP's weights, or use `lightning_zero.ShardedEMA(decay=...)` for an exponential "
                "moving average on the shards (at every stage; not SWA's equal-weight mean)."
            )
        if isinstance(callback, callbacks.BaseFinetuning):
            raise ValueError(
                f"Lightning's {name} callback cannot run under ZeroStrategy: it unfreezes layers mid-fit with "
                "`optimizer.add_param_group`, and ZeroOptimizer decides at setup which parameters it reduces, shards "
                "and steps (it refuses add_param_group and parameters (un)frozen after setup). HINT: "
                + (
                    "fine-tune in phases, one `Trainer(...).fit(model)` per phase with `requires_grad` set before "
                    "it starts (each fit builds fresh sharded optimizers over the trainable parameters), "
                    if stage < 3
                    else "at stage 3 set `requires_grad` once, before the fit, for the whole fit; to unfreeze in "
                    "phases use stage 1 or 2 (one `Trainer(...).fit(model)` per phase, `requires_grad` set before "
                    "each) "
                )
                + "or train with strategy='ddp'."
            )


def iter_zero_optimizers(optimizers: list[Optimizer]) -> Iterator[ZeroOptimizer]:
    """The strategy's optimizers, none when ``configure_optimizers`` returned None (Lightning's stand-in)."""
    return (as_zero_optimizer(o) for o in optimizers if not isinstance(o, MockOptimizer))
