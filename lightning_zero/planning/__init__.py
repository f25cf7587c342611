"""Planning: what a configuration costs before it runs, and the choice of one.

- ``model_state``: model-state bytes per rank as named quantities (the paper's formula, the split by memory tier).
- ``layout``: the strategy's own layout of a meta-device model as rank 0 of N, for every stage.
- ``fake_step``: the user's training step on fake tensors, every tensor it creates counted (``LiveBytes``).
- ``engine_replay``: the engine's gathers, gradient buckets and shards replayed onto that step from the layout.
- ``peak``: ``predict_peak``, a rank's peak in a training step, split by kind.
- ``module_step``: a LightningModule's optimizer and training step, for a prediction.
- ``auto_config``: ``stage="auto"``'s candidates, budgets and choice.

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding, lightning_zero.stage3,
lightning_zero.offload
"""
