"""``CommLedger``: what the collectives of one optimizer step handed to ``torch.distributed``, per collective.

Bytes are metered, not computed from a formula over the model: each ``Send`` is taken from the tensor handed to
``torch.distributed`` at the call (``collectives.py``). Comparing them with the ZeRO formulas is a test's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_zero.comm.collectives import Collective, PendingCollective, Send


@dataclass
class CommLedger:
    """Bytes and calls per collective. ``current`` accumulates until ``end_step()`` moves it to ``last_step``,
    which therefore always holds exactly one optimizer step's communication; ``total`` keeps everything."""

    current: dict[Collective, int] = field(default_factory=dict)
    last_step: dict[Collective, int] = field(default_factory=dict)
    total: dict[Collective, int] = field(default_factory=dict)
    calls: dict[Collective, int] = field(default_factory=dict)
    steps: int = 0
    current_sends: list[Send] = field(default_factory=list)
    last_step_sends: list[Send] = field(default_factory=list)
    """Every call into ``torch.distributed`` of the last step, with the size and dtype of what it was handed."""

    def record(self, pending: PendingCollective) -> PendingCollective:
        self.current[pending.kind] = self.current.get(pending.kind, 0) + pending.bytes_sent
        self.calls[pending.kind] = self.calls.get(pending.kind, 0) + 1
        self.current_sends.extend(pending.sends)
        return pending

    def end_step(self) -> None:
        self.last_step = dict(self.current)
        for kind, nbytes in self.current.items():
            self.total[kind] = self.total.get(kind, 0) + nbytes
        self.current.clear()
        self.last_step_sends, self.current_sends = self.current_sends, []
        self.steps += 1

    def last_step_bytes(self) -> dict[str, int]:
        return {kind.value: nbytes for kind, nbytes in self.last_step.items()}
