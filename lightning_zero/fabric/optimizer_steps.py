"""``OptimizerSteps``: how many steps each optimizer a ``ZeroFabricStrategy`` set up has taken, the count that ends the
delayed update's warm-up in a Fabric loop; saved and restored with the optimizer.

Note [delayed update in a Fabric loop]
The delayed parameter update (Note [delayed parameter update] in ``offload/host_steps.py``) starts after
``offload_overlap_warmup`` exact steps. The Trainer counts them with its ``global_step``; a Fabric loop has no such
count (its own ``step`` variable is not the strategy's to read), so the strategy counts each set-up optimizer's steps:
``optimizer.step()`` reaches ``ZeroFabricStrategy.optimizer_step`` on every rank (the step is collective), so every
rank holds the same count, and it becomes that optimizer's host step number before each step. A step the loss
scaler skips counts, as it does in ``global_step``. ``fabric.save`` writes each saved optimizer's count by the name it
is saved under (``STEPS_KEY``), and ``fabric.load`` restores it with that optimizer's state, so a resumed run takes
the same exact and delayed steps as the run that saved it. A Trainer's checkpoint gives its ``global_step``, the
count the Trainer used; a checkpoint with neither (Fabric's DDP's file) restarts the warm-up: a few exact steps,
never a wrong one. The one file of ``state_dict_type="full"`` carries the counts only with ``offload_overlap=
"delayed"``, so that a DDP loop reading it gets back what it saved and nothing else.

What reads the masters, the moments or the weights waits for the update in flight, or publishes it, as under the
Trainer: ``fabric.save``, ``fabric.load`` (and ``load_raw``) and ``full_state_dict()`` settle every optimizer first
(collective, as they are), clipping waits for it inside the optimizer, and the strategy's ``teardown`` publishes the
last one (``close_memory_tiers``); ``settle_optimizers()`` does it wherever every rank calls it. Between steps the
parameters a loop reads directly are those its next forward uses: one update behind while delayed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_zero.offload.optimizer_tiers import OptimizerTiers
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer

STEPS_KEY = "zero_optimizer_steps"
"""Where a Fabric checkpoint keeps each saved optimizer's step count, by the name it was saved under."""
TRAINER_STEPS_KEY = "global_step"
"""Where a Trainer's checkpoint keeps its step count (Lightning's ``dump_checkpoint``)."""


class OptimizerSteps:
    """The steps each set-up optimizer has taken (Note [delayed update in a Fabric loop])."""

    def __init__(self) -> None:
        self._taken: dict[ZeroOptimizer, int] = {}

    def taken(self, optimizer: ZeroOptimizer) -> int:
        return self._taken.get(optimizer, 0)

    @contextmanager
    def step(self, optimizer: ZeroOptimizer) -> Iterator[None]:
        """Around one step of ``optimizer``: its host steps know the step's number; a step that completes counts."""
        tiers = optimizer.tiers
        if isinstance(tiers, OptimizerTiers) and tiers.host_steps is not None:
            tiers.host_steps.step_number = self.taken(optimizer)
        yield
        self._taken[optimizer] = self.taken(optimizer) + 1

    def saved(self, named: Iterable[tuple[str, ZeroOptimizer]]) -> dict[str, int]:
        """``STEPS_KEY``'s entry for the optimizers saved under these names."""
        return {name: self.taken(optimizer) for name, optimizer in named}

    def restore(
        self, loaded: Iterable[tuple[ZeroOptimizer, str | None]], counts: Any, trainer_step: Any = None
    ) -> None:
        """Each ``(optimizer, the name its state was saved under)`` takes its count in ``counts`` (a checkpoint's
        ``STEPS_KEY`` entry), else a Trainer checkpoint's ``trainer_step``, else 0: the warm-up again."""
        for optimizer, name in loaded:
            count = counts.get(name) if isinstance(counts, dict) else trainer_step
            self._taken[optimizer] = count if isinstance(count, int) and count >= 0 else 0
