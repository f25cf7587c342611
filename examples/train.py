"""Train a GPT with ZeRO on two CPU processes, configured with Hydra (``conf/``).

    .venv/bin/python examples/train.py

trains the small GPT (3.3M parameters) on the shipped fables (``data/fables.txt``) with ZeRO (the ``strategy`` default
in ``conf/config.yaml``) on two CPU processes in about a minute: Lightning's progress bar, the loss every 10 steps, a
per-rank table of model-state memory and bytes communicated, and a sample of generated text. Everything is a Hydra
override::

    .venv/bin/python examples/train.py strategy=zero1 trainer.max_steps=200 trainer.devices=2
    .venv/bin/python examples/train.py strategy=ddp model=tiny data=synthetic
    .venv/bin/python examples/train.py -m strategy=zero1,zero2        # a sweep: one job (of 2 processes) each
    .venv/bin/python examples/train.py --cfg job                      # print the composed config

Two nodes (here both on localhost; on a cluster run the same command on each node with its --node-rank)::

    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=0 --master-addr=127.0.0.1 --master-port=29500 \\
        examples/train.py trainer.num_nodes=2 trainer.devices=1 &
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=1 --master-addr=127.0.0.1 --master-port=29500 \\
        examples/train.py trainer.num_nodes=2 trainer.devices=1

Outputs (the composed config, logs, ``memory_report.json``, and ``logs/metrics.csv``: the loss and every rank's
memory and bytes sent every ``report.log_every_n_steps`` steps) go to Hydra's directory: ``outputs/<date>/<time>/``,
or ``multirun/<date>/<time>/<job>/`` for a sweep.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from typing_extensions import override

from lightning_zero import ZeroStrategy
from lightning_zero.hydra.launch import HydraJob
from lightning_zero.hydra.schema import register_configs
from lightning_zero.models import LitGPT
from lightning_zero.models.data import ByteCorpusDataModule, decode, encode

REPO = Path(__file__).resolve().parent.parent

register_configs()  # the schemas conf/ extends; must exist before Hydra composes
# Emitted by Lightning's own internals with this torch; nothing a user of the example can act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


class PrintLoss(pl.Callback):
    """A line per ``every_n_steps`` optimizer steps, so the falling loss stays on screen under the progress bar."""

    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = max(1, every_n_steps)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and (step % self.every_n_steps == 0 or step in (1, trainer.max_steps)):
            message = (
                f"step {step:>4}/{trainer.max_steps}  train_loss {float(trainer.callback_metrics['train_loss']):.3f}"
            )
            bar = trainer.progress_bar_callback
            if bar is not None:
                bar.print(message)  # above the progress bar instead of through it
            else:
                print(message, flush=True)


class SampleText(pl.Callback):
    """Continue a prompt with the trained model; rank 0 prints the text once fit is over.

    Sampled at the end of training, while the strategy is still set up. Stage 3 shards the parameters, so every
    rank gathers them (``gathered_parameters``, a collective) and samples with the same seed, getting the same text.
    """

    def __init__(self, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int) -> None:
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self.text: str | None = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, LitGPT)
        was_training = pl_module.training
        pl_module.eval()
        torch.manual_seed(self.seed)
        prompt = encode(self.prompt).unsqueeze(0).to(pl_module.device)  # (1, T)
        strategy = trainer.strategy
        with strategy.gathered_parameters() if isinstance(strategy, ZeroStrategy) else contextlib.nullcontext():
            tokens = pl_module.gpt.generate(prompt, self.max_new_tokens, self.temperature, self.top_k)
        self.text = decode(tokens[0].cpu())
        pl_module.train(was_training)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.text is not None:
            print(f"\nSample, {self.max_new_tokens} bytes after {self.prompt!r}:\n\n{self.text}\n", flush=True)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    with HydraJob() as job:
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        model: LitGPT = instantiate(cfg.model, _convert_="all")
        # Relative data paths are relative to the repository, so the example runs from any directory.
        paths = {"path": str(REPO / cfg.data.path)} if "path" in cfg.data else {}
        data: pl.LightningDataModule = instantiate(cfg.data, **paths)
        vocab = getattr(data, "vocab_size", 0)
        if vocab > model.config.vocab_size:
            raise ValueError(
                f"model.config.vocab_size={model.config.vocab_size} is smaller than the data's vocabulary of {vocab} "
                f"tokens. HINT: set model.config.vocab_size={vocab} or more."
            )
        callbacks: list[pl.Callback] = [instantiate(cfg.report), PrintLoss(cfg.trainer.log_every_n_steps)]
        if isinstance(data, ByteCorpusDataModule):  # text: show what the model writes
            callbacks.append(SampleText(**cfg.sample, seed=cfg.seed))
        # The job's logger writes the loss and MemoryReport's per-rank figures into the job's directory.
        logger = instantiate(cfg.logger, save_dir=str(job.output_dir)) if cfg.get("logger") else False
        trainer: pl.Trainer = instantiate(
            cfg.trainer,
            strategy=instantiate(cfg.strategy, _convert_="all"),
            callbacks=callbacks,
            logger=logger,
            default_root_dir=str(job.output_dir),
        )
        job.attach(trainer)
        trainer.fit(model, data)
        return float(trainer.callback_metrics["train_loss"])


if __name__ == "__main__":
    main()
