"""The command-line tools behind ``python -m lightning_zero``: they run without a training job.

- ``consolidate``: a sharded checkpoint directory to one plain checkpoint file.
- ``estimate``: model-state memory and communication per rank for each stage, by formula or from a model config.
- ``estimate_tables``: the tables ``estimate`` prints; ``estimate_plot``: the pictures it draws (``--plot``).
- ``estimate_module``: ``estimate --model`` with a LightningModule class path, its micro-batch, peaks, ``--auto``.
- ``estimate_zeropp``: ``estimate --ranks-per-node``: ZeRO++'s traffic by link and hpZ's memory, by formula.
- ``fabric_run``, ``fabric_script``: ``fabric-run``, Lightning Fabric's ``fabric run`` with ZeRO's strategy names.

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding, lightning_zero.stage3,
lightning_zero.offload, lightning_zero.checkpoint, lightning_zero.engine, lightning_zero.trainer, lightning_zero.fabric,
lightning_zero.hydra, lightning_zero.models, lightning_zero.planning
"""
