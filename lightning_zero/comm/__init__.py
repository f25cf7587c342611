"""The communication layer: how ranks exchange tensors, and what that costs.

- ``collectives``: stateless reduce-scatter / all-gather / all-reduce over flat buffers, each taking an explicit
  process group and returning a ``PendingCollective`` (work handles, held buffers, bytes sent).
- ``ledger``: ``CommLedger``, the per-step record of bytes and calls per collective.
- ``buffer_pool``: ``BufferPool``, receive and staging buffers reused across buckets and steps.
- ``streams``: ``CollectiveStream``, the side stream a kind of collective runs on (CUDA), ordered by events.
- ``fault_monitor``: ``FaultMonitor``, heartbeats in the c10d store that name a failed, dead or hung rank.

Node topology and hierarchical (intra-/inter-node) collectives belong here too.

May import: lightning_zero.config
"""
