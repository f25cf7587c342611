"""The Hydra glue: structured configs for composing runs, and multirun under Lightning's launcher.

- ``schema``: structured configs generated from ``ZeroConfig`` and ``GPTConfig``, so YAML typos fail while composing.
- ``launch``: one Hydra job per set of Lightning processes (Note [Hydra multirun and Lightning's relaunch]).

May import: lightning_zero.config, lightning_zero.models
"""
