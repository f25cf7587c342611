"""Unit tests for the reference models (single process, CPU, a few seconds in total)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_zero.models import (
    GPT,
    MLP,
    GPTConfig,
    LitGPT,
    SyntheticTextDataModule,
    SyntheticTokenDataset,
    param_groups_with_weight_decay,
)

CPU = torch.device("cpu")


def assert_same_weights(actual: nn.Module, expected: nn.Module) -> None:
    actual_state, expected_state = actual.state_dict(), expected.state_dict()
    assert actual_state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert torch.equal(actual_state[name], tensor), f"{name} differs"


# --- GPTConfig ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("preset", "expected"), [("tiny", 120_576), ("small", 3_257_856), ("bench25m", 25_010_176)])
def test_preset_parameter_counts(preset: str, expected: int) -> None:
    config: GPTConfig = getattr(GPTConfig, preset)()
    with torch.device("meta"):  # counting needs shapes only
        model = GPT(config)
    d, n_layer = config.n_embd, config.n_layer
    # Per block: qkv 3d^2+3d, attention out d^2+d, MLP 8d^2+5d, two LayerNorms 4d.
    formula = n_layer * (12 * d * d + 13 * d) + (config.vocab_size + config.block_size) * d + 2 * d
    assert model.num_parameters() == formula == expected
    assert model.num_parameters(exclude_tied=False) == expected + config.vocab_size * d


def test_preset_overrides() -> None:
    config = GPTConfig.tiny(n_layer=3, dropout=0.1)
    assert (config.n_layer, config.dropout, config.n_embd) == (3, 0.1, 64)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vocab_size", 0),
        ("block_size", -1),
        ("n_layer", 0),
        ("n_head", 3),  # does not divide n_embd=64
        ("n_head", 0),
        ("n_embd", 2.5),
        ("dropout", 1.0),
    ],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"Invalid GPTConfig\.{field}: {value!r}\. Expected"):
        GPTConfig.tiny(**{field: value})


def test_config_is_frozen() -> None:
    config = GPTConfig.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.n_layer = 4  # type: ignore[misc]


# --- GPT ---------------------------------------------------------------------------------------------------------


def test_tied_embeddings_are_one_parameter() -> None:
    model = GPT(GPTConfig.tiny())
    assert model.lm_head.weight is model.wte.weight
    assert sum(p is model.wte.weight for p in model.parameters()) == 1

    untied = GPT(GPTConfig.tiny(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_parameters() == untied.num_parameters(exclude_tied=False)


def test_forward_shapes_and_loss() -> None:
    config = GPTConfig.tiny()
    model = GPT(config)
    idx, targets = torch.randint(0, config.vocab_size, (2, 3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, config.vocab_size)
    loss = model.loss(idx, targets)
    assert loss.shape == ()
    # A freshly initialized model is close to uniform over the vocabulary.
    assert loss.item() == pytest.approx(math.log(config.vocab_size), rel=0.05)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, config.block_size + 1, dtype=torch.long))


def test_loss_decreases_on_a_fixed_batch() -> None:
    torch.manual_seed(0)
    config = GPTConfig.tiny()
    model = GPT(config)
    inputs, targets = SyntheticTokenDataset(num_samples=1, seq_len=32, vocab_size=config.vocab_size)[0]
    inputs, targets = inputs.repeat(4, 1), targets.repeat(4, 1)
    optimizer = torch.optim.AdamW(param_groups_with_weight_decay(model, 0.1), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = model.loss(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    "config", [GPTConfig.tiny(), GPTConfig.tiny(tie_embeddings=False, bias=False, dropout=0.1)], ids=["tied", "untied"]
)
def test_meta_init_matches_direct_init(config: GPTConfig) -> None:
    torch.manual_seed(1234)
    direct = GPT(config)
    rng_after_direct = torch.get_rng_state()

    torch.manual_seed(1234)
    with torch.device("meta"):
        model = GPT(config)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device=CPU)
    model.tie_weights()  # to_empty() gives each module its own new tensor
    model.reset_parameters()

    assert_same_weights(model, direct)
    # The same random numbers were drawn, no more: code after either path sees the same RNG state.
    assert torch.equal(torch.get_rng_state(), rng_after_direct)
    assert (model.lm_head.weight is model.wte.weight) == config.tie_embeddings


def test_init_statistics() -> None:
    config = GPTConfig.small()
    model = GPT(config)
    block = next(model.iter_blocks())
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * config.n_layer)
    assert block.mlp.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.all(block.attn.qkv.bias == 0)
    assert torch.all(block.ln_1.weight == 1)
    assert torch.all(block.ln_1.bias == 0)


def test_generate() -> None:
    config = GPTConfig.tiny(block_size=8)
    model = GPT(config).eval()
    prompt = torch.randint(0, config.vocab_size, (2, 5))
    out = model.generate(prompt, max_new_tokens=10, temperature=0.8, top_k=5)  # runs past block_size
    assert out.shape == (2, 15)
    assert torch.equal(out[:, :5], prompt)
    assert 0 <= out.min() <= out.max() < config.vocab_size
    greedy = model.generate(prompt, max_new_tokens=4, temperature=0.0)
    assert torch.equal(greedy, model.generate(prompt, max_new_tokens=4, temperature=0.0))


# --- MLP and param groups ----------------------------------------------------------------------------------------


def test_mlp_forward_and_meta_init() -> None:
    torch.manual_seed(3)
    direct = MLP(in_features=32, hidden=(64, 64), out_features=8)
    assert direct(torch.randn(5, 32)).shape == (5, 8)

    torch.manual_seed(3)
    with torch.device("meta"):
        model = MLP(in_features=32, hidden=(64, 64), out_features=8)
    model.to_empty(device=CPU)
    model.reset_parameters()
    assert_same_weights(model, direct)

    with pytest.raises(ValueError, match="hidden"):
        MLP(in_features=32, hidden=(0,), out_features=8)


def test_param_groups_split_decay_and_no_decay() -> None:
    model = MLP(in_features=4, hidden=(8,), out_features=2)
    groups = param_groups_with_weight_decay(model, 0.1, no_decay_overrides={"lr": 1e-4})
    by_name = {group["name"]: group for group in groups}
    assert set(by_name) == {"decay", "no_decay"}
    assert all(p.dim() >= 2 for p in by_name["decay"]["params"])
    assert all(p.dim() < 2 for p in by_name["no_decay"]["params"])
    assert (by_name["decay"]["weight_decay"], by_name["no_decay"]["weight_decay"]) == (0.1, 0.0)
    assert by_name["no_decay"]["lr"] == 1e-4
    assert "lr" not in by_name["decay"]
    # Every parameter lands in exactly one group, and torch optimizers accept the groups as they are.
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
    assert optimizer.param_groups[1]["lr"] == 1e-4

    # Without biases or norms there is nothing to exempt from decay: no empty group.
    bare = MLP(in_features=4, hidden=(8,), out_features=2, bias=False, layer_norm=False)
    assert [g["name"] for g in param_groups_with_weight_decay(bare, 0.1)] == ["decay"]


def test_param_groups_list_tied_weight_once() -> None:
    model = GPT(GPTConfig.tiny())
    params = [p for group in param_groups_with_weight_decay(model, 0.1) for p in group["params"]]
    assert len(params) == len({id(p) for p in params})
    assert sum(p.numel() for p in params) == model.num_parameters()


# --- LitGPT and synthetic data -----------------------------------------------------------------------------------


def test_synthetic_dataset_is_deterministic_and_shifted() -> None:
    make = lambda seed: SyntheticTokenDataset(num_samples=4, seq_len=16, vocab_size=50, seed=seed)  # noqa: E731
    inputs, targets = make(0)[2]
    assert inputs.shape == targets.shape == (16,)
    assert torch.equal(inputs[1:], targets[:-1])
    assert 0 <= inputs.min() <= inputs.max() < 50
    assert torch.equal(make(0)[2][0], inputs)
    assert not all(torch.equal(make(0)[i][0], make(1)[i][0]) for i in range(4))


def test_lit_gpt_trains_and_reloads(tmp_path: Path) -> None:
    pl.seed_everything(0)
    config = GPTConfig.tiny()
    lit = LitGPT(config, lr=3e-3)
    lit.configure_model()
    model = lit.model
    lit.configure_model()  # must not rebuild (and so re-initialize) the model
    assert lit.model is model

    data = SyntheticTextDataModule(vocab_size=config.vocab_size, seq_len=32, batch_size=8, num_train=192, num_val=16)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=24,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(lit, datamodule=data)
    assert trainer.callback_metrics["train_loss"] < 0.85 * math.log(config.vocab_size)  # from ~log(vocab_size)
    assert "val_loss" in trainer.callback_metrics
    optimizer = trainer.optimizers[0]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]

    # Hyper-parameters are plain types, so the default weights_only checkpoint loading works.
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    reloaded = LitGPT.load_from_checkpoint(tmp_path / "last.ckpt")
    assert reloaded.config == config
    assert reloaded.lr == 3e-3
    assert_same_weights(reloaded.gpt, lit.gpt)
