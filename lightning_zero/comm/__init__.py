"""The communication layer: how ranks exchange tensors, and what that costs.

- ``collectives``: stateless reduce-scatter / all-gather / all-reduce over flat buffers, each taking an explicit
  process group and returning a ``PendingCollective``.
- ``pending_collective``: ``PendingCollective``, an issued collective (work handles, held buffers, local finish)
  and a ``Send`` per call into ``torch.distributed`` (bytes sent).
- ``ledger``: ``CommLedger``, the per-step record of bytes and calls per collective.
- ``buffer_pool``: ``BufferPool``, receive and staging buffers reused across buckets and steps.
- ``streams``: ``CollectiveStream``, the side stream a kind of collective runs on (CUDA), ordered by events.
- ``fault_monitor``: ``FaultMonitor``, heartbeats in the c10d store that name a failed, dead or hung rank.
- ``topology``: ``NodeTopology``, which ranks share a node, and the intra-/inter-node process groups.
- ``quantization``: block quantization to int8 / int4 with fp32 scales, packed into byte rows.
- ``quantized_all_gather``: ZeRO++ qwZ, an all-gather of int8 shards dequantized on arrival.
- ``hierarchical_reduce``: ZeRO++ qgZ, a quantized reduce-scatter as all-to-alls within, then across nodes.

May import: lightning_zero.config
"""
