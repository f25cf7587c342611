"""The engine as a front door uses it: what the Trainer's strategy (``lightning_zero.trainer``) and Fabric's
(``lightning_zero.fabric``) both do to a model and its optimizers, written once, below both.

- ``model_sharding``: stage 3's sharding of a model unit by unit (built normally or on meta), the guard against
  sharding placeholders, the takeover of a model an earlier strategy sharded, the model's own ``state_dict`` made
  true, the one-rank-call wiring, and ``gathered_parameters()`` / ``full_state_dict()`` over it.
- ``optimizer_wrapping``: the user's optimizers as ``ZeroOptimizer``s, one loss scaler each, the refusal of a
  parameter two optimizers would shard, the tiers' space check and the ledger's topology.
- ``buffers``: rank 0's buffers broadcast where DDP would (``BufferBroadcast``, Note [buffers follow rank 0]).
- ``tier_setup``: a rank's memory tiers (``lightning_zero.offload``) built with the directory and space checks, every
  shard brought into memory for a while, the tiers closed.
- ``precision``: ``ParameterPrecision``, ZeRO's mixed precision (low-precision parameters, fp32 masters) under both
  doors' plugins, and Lightning's precision plugins mapped onto it.
- ``grad_norm``: ``grad_norm`` from the reduced shards; partial gradients hidden from ``.grad``.
- ``sharded_gradient``: ``ShardedGradient``, the averaged gradient as ``.grad`` shows it (norms and reads from the
  shards), which both doors put where code reads gradients.
- ``memory``: per-rank model-state bytes, counted, by memory tier and as the ZeRO paper's formula; bytes sent.
- ``throughput``: samples, tokens and FLOPs per second, MFU.
- ``rank_layout``: ``RankLayout``, what the engine reads of either door's strategy about this rank (group, device,
  ranks), so that a door hands itself over; ``world_group()``.
- ``fault_watch``: ``FaultWatch``, the fault monitor started, told of the run's exception, stopped.
- ``presets``: the strategy names both front doors register (``"zero1"`` ... and the memory-tier presets), and how
  their processes start.

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding, lightning_zero.stage3,
lightning_zero.offload, lightning_zero.checkpoint, lightning_zero.planning
"""
