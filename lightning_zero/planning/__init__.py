"""Planning: what a configuration costs before it runs, and the choice of one.

- ``model_state``: model-state bytes per rank as named quantities (the paper's formula, the split by memory tier).
- ``layout``: the strategy's own layout of a meta-device model as rank 0 of N, for every stage.

May import: lightning_zero.config, lightning_zero.comm, lightning_zero.sharding, lightning_zero.stage3,
lightning_zero.offload
"""
