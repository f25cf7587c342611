"""LitGPT's own fine-tuning scripts (``litgpt/finetune/lora.py``, ``litgpt/finetune/full.py``), unchanged, under
``Fabric(strategy="zero3")`` and Fabric's DDP: a tiny LitGPT checkpoint directory made here (``model_config.yaml``,
``lit_model.pth``, a word-level ``tokenizer.json``) and a small JSON instruction data set, no network.

The scripts' ``setup()`` only parses arguments and builds a ``Fabric`` (with ``ModelParallelStrategy`` for several
devices); each rank here builds the ``Fabric`` with the strategy under test and calls the script's ``main(fabric,
...)`` with the arguments ``setup()`` would pass, and ``sys.argv`` as the command line would be (the scripts save
their hyper-parameters by parsing it, and ``merge_lora`` reads them back).

The pretrained ``lit_model.pth`` holds the LoRA adapters' initial values too (``lora_A`` random, ``lora_B`` zero):
LitGPT builds the model under ``fabric.init_module(empty_init=True)`` on several devices, where Fabric's DDP leaves
the adapters uninitialized memory and stage 3 initializes them, so both start from the file's (``load_checkpoint``
loads with ``strict=False``, so the extra entries are simply loaded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger

_CONFIG: dict[str, Any] = {
    "name": "tiny",
    "block_size": 64,
    "vocab_size": 64,
    "padded_vocab_size": 64,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 32,
    "rotary_percentage": 1.0,
    "parallel_residual": False,
    "bias": False,
    "norm_class_name": "RMSNorm",
    "mlp_class_name": "LLaMAMLP",
    "intermediate_size": 64,
}
"""A 2-layer Llama-style model, 25k parameters."""

WORDS = "red green blue cat dog bird runs sits sings fast slow loud small big one two three".split()  # noqa: SIM905


def make_checkpoint(directory: Path) -> Path:
    """A LitGPT checkpoint directory of a 2-layer Llama-style model with a word-level tokenizer; returns it."""
    from litgpt.config import Config
    from litgpt.lora import GPT as LoRAGPT  # noqa: N811
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers

    checkpoint = directory / "tiny"
    checkpoint.mkdir(parents=True)
    template = (  # noqa: SIM905  the words of the Alpaca prompt
        "Below is an instruction that describes a task . Write a response that appropriately completes the request "
        ". ### Instruction : ### Response : ( ) ,"
    ).split()
    vocab = {token: i for i, token in enumerate(dict.fromkeys(["<unk>", "<s>", "</s>", *template, *WORDS]))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "tokenizer_class": "Fast"}))
    config = Config(**_CONFIG)
    save_config(config, checkpoint)
    torch.manual_seed(0)
    from litgpt.lora import Config as LoRAConfig

    lora = LoRAGPT(LoRAConfig.from_file(checkpoint / "model_config.yaml", **LORA))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if name.endswith("lora_A"):
                p.normal_(std=0.2)
    # The base model's names (LitGPT's LoRA layers map them to theirs when loading) and the adapters' own.
    state = {k.replace(".linear.", "."): v for k, v in lora.state_dict().items() if not k.endswith(("cos", "sin"))}
    torch.save(state, checkpoint / "lit_model.pth")
    return checkpoint


def base_weights() -> dict[str, torch.Tensor]:
    """The plain model's weights (``litgpt/finetune/full.py`` loads them strictly): the same seed as the LoRA file's."""
    from litgpt.model import GPT, Config

    torch.manual_seed(0)
    model = GPT(Config(**_CONFIG))
    return {k: v for k, v in model.state_dict().items() if not k.endswith(("cos", "sin"))}


LORA = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_query": True, "lora_value": True}


def make_data(directory: Path) -> Path:
    """16 instructions and their answers, words of the tokenizer's vocabulary."""
    g = torch.Generator().manual_seed(3)
    samples = []
    for _ in range(16):
        words = [WORDS[int(i)] for i in torch.randint(len(WORDS), (4,), generator=g)]
        samples.append({"instruction": " ".join(words[:2]), "input": "", "output": " ".join(reversed(words))})
    path = directory / "data.json"
    path.write_text(json.dumps(samples))
    return path


class Recorder(Logger):
    """Keeps what the script logs (its ``loss`` and ``val_loss`` per iteration)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.metrics.append({k: float(v) for k, v in metrics.items() if k in ("loss", "val_loss", "iter")})

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _arguments(script: str) -> tuple[Any, Any, Any]:
    from litgpt.args import EvalArgs, TrainArgs

    train = TrainArgs(
        save_interval=2,
        log_interval=1,
        global_batch_size=4,
        micro_batch_size=2,
        lr_warmup_steps=1,
        epochs=50,
        max_steps=4,
    )
    evaluation = EvalArgs(interval=2, max_new_tokens=3, max_iters=2, final_validation=True)
    return train, evaluation, {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.02}}


def run_script(script: str, strategy: str, checkpoint: str, data_path: str, out: str, precision: str) -> dict[str, Any]:
    """One rank of ``litgpt finetune_{script}`` under ``strategy`` ("ddp" or "zero3")."""
    from litgpt.data import JSON

    import lightning_zero  # noqa: F401  registers "zero3" with Fabric

    checkpoint_dir, out_dir = Path(checkpoint), Path(out)
    lora = script == "lora"
    command = ["litgpt", f"finetune_{script}", checkpoint, "--out_dir", out, "--devices", "2", "--precision", precision]
    if lora:
        command += [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in LORA.items()]
    sys.argv = command  # as the command line has it: the scripts save their hyper-parameters from it
    recorder = Recorder()
    fabric = Fabric(devices=2, accelerator="cpu", strategy=strategy, precision=precision, loggers=recorder)  # type: ignore[arg-type]
    fabric.launch()
    train, evaluation, optimizer = _arguments(script)
    data = JSON(json_path=Path(data_path), val_split_fraction=0.25, num_workers=0)
    samples: list[list[int]] = []
    if lora:
        from litgpt.finetune import lora as module

        generate = module.generate

        def recorded(*args: Any, **kwargs: Any) -> Any:
            # Observes the sampling with the same random numbers under both strategies (stage 3 initialized the model
            # from the global generator, DDP's empty_init did not), and leaves the script's own stream as it was.
            with torch.random.fork_rng():
                torch.manual_seed(0)
                out = generate(*args, **kwargs)
            samples.append(out.tolist())
            return out

        module.generate = recorded
        config = module.Config.from_file(checkpoint_dir / "model_config.yaml", **LORA)  # the script's own Config
        module.main(fabric, 2, 1337, config, data, checkpoint_dir, out_dir, train, evaluation, optimizer, 1, precision)
    else:
        from litgpt.finetune import full as module

        config = module.Config.from_file(checkpoint_dir / "model_config.yaml")
        module.main(fabric, 2, False, 1337, config, data, checkpoint_dir, out_dir, train, evaluation, optimizer, 1)
    return {"metrics": recorder.metrics, "samples": samples}


class _ResumableLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A loader ``fabric.save`` stores by its ``state_dict()``, as it stores litdata's ``StreamingDataLoader`` (a plain
    ``DataLoader`` in the saved state is refused: Note [a save that cannot load back])."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def run_pretrain(strategy: str, out: str, iterations: int, resume: bool) -> dict[str, Any]:
    """One rank of ``litgpt pretrain``'s ``main`` under ``strategy`` (what its ``setup()`` would call, with this
    ``Fabric``): random tokens, tied embeddings, a save every 2 optimizer steps, ``resume="auto"`` when ``resume``."""
    from litgpt import pretrain
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.config import Config
    from litgpt.data import DataModule

    import lightning_zero  # noqa: F401  registers "zero3" with Fabric

    class RandomTokens(DataModule):  # type: ignore[misc]
        def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int = -1) -> None:
            self.batch_size, self.length = batch_size, max_seq_length

        def _tokens(self, count: int, seed: int) -> _ResumableLoader:
            tokens = torch.randint(0, 64, (count, self.length + 1), generator=torch.Generator().manual_seed(seed))
            return _ResumableLoader(tokens, batch_size=self.batch_size)

        def train_dataloader(self) -> _ResumableLoader:
            return self._tokens(64, 0)

        def val_dataloader(self) -> _ResumableLoader:
            return self._tokens(16, 1)

    recorder = Recorder()
    fabric = Fabric(devices=2, accelerator="cpu", strategy=strategy, loggers=recorder)  # type: ignore[arg-type]
    fabric.launch()
    pretrain.save_hyperparameters = lambda *args, **kwargs: None  # it parses the command line `litgpt pretrain` had
    config = Config(**{**_CONFIG, "block_size": 32})
    train = TrainArgs(
        save_interval=2, log_interval=1, global_batch_size=8, micro_batch_size=2, max_tokens=2 * 2 * 32 * iterations,
        lr_warmup_steps=1, tie_embeddings=True, max_norm=1.0,
    )  # fmt: skip
    evaluation = EvalArgs(interval=2, max_iters=2, initial_validation=True, final_validation=True)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}}
    pretrain.main(
        fabric, 2, 42, None, "auto" if resume else False, config, RandomTokens(), Path(out), None, None, train,
        evaluation, optimizer,
    )  # fmt: skip
    return {"metrics": recorder.metrics}
