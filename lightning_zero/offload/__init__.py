"""Memory tiers: where a rank's shards live between uses (ZeRO-Offload's host tier, ZeRO-Infinity's disk tier).

The sharding does not change: every tier is per rank and per shard, and only moves a shard between memory and its
tier around its use. Configured by ``ZeroConfig.offload_optimizer``, ``offload_params``, ``offload_dir``,
``offload_ratio``, ``offload_overlap`` and ``offload_optimizer_state``.

- ``memory_tiers``: ``MemoryTiers``, one rank's tiers built from the config: placement, the parameter tier of
  stage-3 units, the reducer and optimizer hooks, bytes per tier.
- ``optimizer_tiers``: ``OptimizerTiers``, the masters and optimizer state loaded around each bucket's step.
- ``tiered_gradients``: ``TieredGradients``, the tiered buckets' gradients as the step reads them (unscaled,
  clipped).
- ``tiered_grad_reducer``: stage 3's gradient shards written to disk as their reduce-scatter completes.
- ``tensor_swapper``: ``TensorSwapper``, tensors whose storage is swapped to a file, read ahead and written behind.
- ``swap_file``: ``SwapFile``, one rank's tier file: regions, ``preadv``/``pwritev`` into tensor memory.
- ``host_copies``: the host tier's copies between device and host memory (``CopyStream``, ``HostStore``).
- ``host_tier``: ``HostTier``, host masters and gradients of the host-tier buckets and their copies.
- ``host_adam``: ``HostAdam``, torch's Adam/AdamW stepped per bucket over flat moments; the tiers' kernel choice.
- ``host_steps``: ``HostSteps``, the host updates on a worker thread, exact or delayed (``offload_overlap``).
- ``host_moments``: ``DiskMoments``, the host step's moments on the disk tier beside host masters.
- ``host_arena``: ``HostArena``, the host tier's pinned buffers at their exact sizes.
- ``directory``: the per-job, per-rank tier directory, free-space checks, removal.

``sharding`` and ``stage3`` see the tiers only through protocols (``StateTiers``, ``UnitTiers``, ``ShardSource``);
the Lightning strategy builds them.

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding, lightning_zero.stage3
"""
