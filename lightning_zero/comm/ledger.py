"""``CommLedger``: what the collectives of one optimizer step moved, per kind of collective."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_zero.comm.collectives import Collective, PendingCollective


@dataclass
class CommLedger:
    """Bytes and calls per collective. ``current`` accumulates until ``end_step()`` moves it to ``last_step``,
    which therefore always holds exactly one optimizer step's communication; ``total`` keeps everything."""

    current: dict[Collective, int] = field(default_factory=dict)
    last_step: dict[Collective, int] = field(default_factory=dict)
    total: dict[Collective, int] = field(default_factory=dict)
    calls: dict[Collective, int] = field(default_factory=dict)
    steps: int = 0

    def record(self, pending: PendingCollective) -> PendingCollective:
        self.current[pending.kind] = self.current.get(pending.kind, 0) + pending.bytes_sent
        self.calls[pending.kind] = self.calls.get(pending.kind, 0) + 1
        return pending

    def end_step(self) -> None:
        self.last_step = dict(self.current)
        for kind, nbytes in self.current.items():
            self.total[kind] = self.total.get(kind, 0) + nbytes
        self.current.clear()
        self.steps += 1

    def last_step_bytes(self) -> dict[str, int]:
        return {kind.value: nbytes for kind, nbytes in self.last_step.items()}
