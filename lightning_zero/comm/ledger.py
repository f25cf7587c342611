"""``CommLedger``: what the collectives of one optimizer step handed to ``torch.distributed``, per collective.

Bytes are metered, not computed from a formula over the model: each ``Send`` is taken from the tensor handed to
``torch.distributed`` at the call (``collectives.py``). Comparing them with the ZeRO formulas is a test's job.

Note [bytes by link]
Each ``Send`` says how many bytes leave this rank (``wire_bytes``, the op's bandwidth-optimal volume) and where to:
the other ranks of a group (``group``, a collective) or one global rank (``peer``, a point-to-point send). The model
is ring-free: a collective over a group of N ranks sends every peer an equal part, ``wire_bytes / (N - 1)`` (an
all-gather its whole input to each, a reduce-scatter or all-to-all the peer's 1/N of the input, the root of a
broadcast its tensor to each, an all-reduce twice the peer's 1/N), as a direct exchange would, rather than routing
through neighbours as a ring does. Under that model the bytes a call sends over the node's own links are
``wire_bytes`` times the fraction of its destinations on this rank's node (``NodeTopology``, Note [node topology] in
``topology.py``); the rest cross to other nodes. A ring all-gather on NCCL moves the same total, but which link a
given byte takes depends on the ring order; the model says what the algorithm must deliver where, not how NCCL
routes it. That fraction depends only on the group (or peer) and the topology, so it is counted once per group and
kept (``CommLedger._shares``): metering a call costs the same at 8 ranks as at 1024, where counting its destinations
at every call cost 434 µs per collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from lightning_zero.comm.pending_collective import Collective, PendingCollective, Send
from lightning_zero.comm.topology import LINKS, Link, NodeTopology


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
    topology: NodeTopology | None = None
    """Which ranks share a node, to split bytes by link (Note [bytes by link]); None: all on one node."""
    current_by_link: dict[tuple[Collective, Link], int] = field(default_factory=dict)
    last_step_by_link: dict[tuple[Collective, Link], int] = field(default_factory=dict)
    _shares: dict[object, tuple[int, int]] = field(default_factory=dict, repr=False)
    """Per group (or peer) of a send: (destinations on this rank's node, destinations), under ``_shares_of``."""
    _shares_of: NodeTopology | None = field(default=None, repr=False)
    """The topology ``_shares`` were counted with: they are counted again when it changes."""

    def record(self, pending: PendingCollective) -> PendingCollective:
        self.current[pending.kind] = self.current.get(pending.kind, 0) + pending.bytes_sent
        self.calls[pending.kind] = self.calls.get(pending.kind, 0) + 1
        self.current_sends.extend(pending.sends)
        for send in pending.sends:
            for link, nbytes in self.split_by_link(send).items():
                key = (pending.kind, link)
                self.current_by_link[key] = self.current_by_link.get(key, 0) + nbytes
        return pending

    def split_by_link(self, send: Send) -> dict[Link, int]:
        """``send.wire_bytes`` split between this node's links and other nodes' (Note [bytes by link])."""
        destination = send.group if send.group is not None else send.peer
        if not send.wire_bytes or destination is None:
            return {}
        if self.topology is None:
            return {"intra_node": send.wire_bytes}
        if self._shares_of is not self.topology:
            self._shares.clear()
            self._shares_of = self.topology
        share = self._shares.get(destination)
        if share is None:  # once per group: Note [bytes by link]
            share = self._shares[destination] = self._count_share(destination, self.topology)
        inside, total = share
        if total == 0:
            return {}
        intra = send.wire_bytes * inside // total
        return {"intra_node": intra, "inter_node": send.wire_bytes - intra}

    @staticmethod
    def _count_share(destination: object, topology: NodeTopology) -> tuple[int, int]:
        me = dist.get_rank()
        if isinstance(destination, int):
            destinations: list[int] = [destination]
        else:
            assert isinstance(destination, dist.ProcessGroup)
            destinations = [r for r in dist.get_process_group_ranks(destination) if r != me]
        inside = sum(topology.link(me, d) == "intra_node" for d in destinations)
        return inside, len(destinations)

    def end_step(self) -> None:
        self.last_step = dict(self.current)
        for kind, nbytes in self.current.items():
            self.total[kind] = self.total.get(kind, 0) + nbytes
        self.current.clear()
        self.last_step_sends, self.current_sends = self.current_sends, []
        self.last_step_by_link, self.current_by_link = self.current_by_link, {}
        self.steps += 1

    def last_step_bytes(self, link: Link | None = None) -> dict[str, int]:
        """Bytes sent in the last step per collective: in all (``link=None``), or only to ranks on this rank's node
        (``"intra_node"``) or on other nodes (``"inter_node"``)."""
        if link is None:
            return {kind.value: nbytes for kind, nbytes in self.last_step.items()}
        if link not in LINKS:
            raise ValueError(f"Invalid link: {link!r}. Expected None, 'intra_node' or 'inter_node'.")
        return {kind.value: self.last_step_by_link.get((kind, link), 0) for kind in self.last_step}
