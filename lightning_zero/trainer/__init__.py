"""The Trainer's front door: ZeRO as a Lightning ``Strategy``, and the callbacks that read it.

- ``strategy``: ``ZeroStrategy`` (optimizer wrapping, accumulation, the stage-3 root unit).
- ``strategy_processes``: one process per device, its process group, launcher and Lightning's collectives (as DDP).
- ``strategy_checkpoint``: the strategy's checkpoint hooks, routed to ``lightning_zero.checkpoint``.
- ``root_unit_steps``: the strategy's step hooks, stage 3's root unit gathered around each.
- ``precision``: ``ZeroPrecision``, ZeRO's precision (``lightning_zero.engine``) with the Trainer's clipping hooks;
  ``visible_gradients``: ``.grad`` shown to ``on_before_optimizer_step`` hooks from the reduced shards.
- ``ema``: ``ShardedEMA``, the moving average of the weights kept on each rank's fp32 shard.
- ``auto_setup``: ``stage="auto"`` when fit starts: the choice, printed, logged and kept for checkpoints.
- ``report``: ``MemoryReport``, the per-rank memory and communication table at the end of a run;
  ``fit_report``: its numbers, a row per rank; ``report_plot``: its chart.

What Fabric's front door (``lightning_zero.fabric``) does too is in ``lightning_zero.engine``, below both; the two
doors never import each other.

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding, lightning_zero.stage3,
lightning_zero.offload, lightning_zero.checkpoint, lightning_zero.planning, lightning_zero.engine
"""
