"""The Lightning glue: ZeRO as a ``Strategy``, its precision plugin, and what it reports.

- ``strategy``: ``ZeroStrategy`` (optimizer wrapping, accumulation, the stage-3 root unit).
- ``presets``: the names the strategy registers (``"zero1"`` ... and the memory-tier presets); FSDP's ``cpu_offload``.
- ``strategy_processes``: one process per device, its process group, launcher and Lightning's collectives (as DDP).
- ``strategy_checkpoint``: the strategy's checkpoint hooks, routed to ``lightning_zero.checkpoint``.
- ``root_unit_steps``: the strategy's step hooks, stage 3's root unit gathered around each.
- ``engine_setup``: what this strategy and Fabric's (``lightning_zero.fabric``) both do to the engine.
- ``offload_setup``: building a rank's memory tiers (``lightning_zero.offload``), with the directory and space checks.
- ``precision``: ``ZeroPrecision``, ZeRO's mixed precision (low-precision parameters, fp32 masters).
- ``memory``: per-rank model-state bytes, counted and as the ZeRO paper's formula.
- ``ema``: ``ShardedEMA``, the moving average of the weights kept on each rank's fp32 shard.
- ``auto_setup``: ``stage="auto"`` when fit starts: the choice, printed, logged and kept for checkpoints.
- ``report``: ``MemoryReport``, the per-rank memory and communication table at the end of a run;
  ``report_plot``: its chart; ``throughput``: samples, tokens and FLOPs per second, MFU (both front doors).

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding, lightning_zero.stage3,
lightning_zero.offload, lightning_zero.checkpoint, lightning_zero.planning
"""
