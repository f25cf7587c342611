"""The third-party fixtures of ``tests/third_party_models.py``: each one runs, and trains through the Trainer with
DDP's numbers under every stage (``benchmarks/probe_third_party.py`` prints the whole table), and generates as under DDP
afterwards."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.third_party_models import BUILDERS, fit_probe, moe_routing

# -- one process: every builder runs forward and backward ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_builder_is_deterministic_and_trains_what_it_says(name):
    fixture = BUILDERS[name]()
    again = BUILDERS[name]().model.state_dict()
    for key, value in fixture.model.state_dict().items():
        assert torch.equal(value, again[key]), f"{name}: {key} differs between two builds"

    loss = fixture.loss(fixture.model, fixture.batch(0, 0))
    assert loss.ndim == 0
    assert torch.isfinite(loss)
    loss.backward()

    trainable = {n: p for n, p in fixture.model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in fixture.model.named_parameters() if not p.requires_grad}
    assert trainable, name
    assert all(p.grad is None for p in frozen.values())
    without_grad = sorted(n for n, p in trainable.items() if p.grad is None)
    assert bool(without_grad) == fixture.unused_parameters, without_grad
    # Fixed data, different on every rank and at every step.
    assert torch.equal(_inputs(fixture.batch(1, 2)), _inputs(fixture.batch(1, 2)))
    assert not torch.equal(_inputs(fixture.batch(0, 0)), _inputs(fixture.batch(1, 0)))
    assert not torch.equal(_inputs(fixture.batch(0, 0)), _inputs(fixture.batch(0, 1)))


def _inputs(batch: Any) -> torch.Tensor:
    return batch["input_ids"] if isinstance(batch, dict) else batch[0]


def test_fixtures_have_the_frozen_parts_they_promise():
    lora = BUILDERS["hf_lora"]().model
    assert {n.split(".")[-3] for n, p in lora.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}
    prompt = BUILDERS["hf_prompt_tuning"]().model
    assert [n for n, p in prompt.named_parameters() if p.requires_grad] == ["prompt_encoder.default.embedding.weight"]
    norms = BUILDERS["frozen_norm_before_linear"]().model
    assert sorted(n for n, p in norms.named_parameters() if not p.requires_grad) == [
        f"blocks.{i}.norm.{w}" for i in range(3) for w in ("bias", "weight")
    ]
    encoder = BUILDERS["transformer_encoder_with_pe"]().model
    assert encoder.get_buffer("pe").dtype == torch.float32


def test_moe_routes_each_rank_to_its_own_experts_and_leaves_some_unused():
    rank0, rank1 = moe_routing(0, 6), moe_routing(1, 6)
    assert all(set(e) <= {0, 1} for e in rank0)
    assert all(set(e) <= {2, 3} for e in rank1)
    unused_everywhere = [sorted({0, 1, 2, 3} - set(a) - set(b)) for a, b in zip(rank0, rank1, strict=True)]
    assert any(unused_everywhere)  # some steps leave an expert without a gradient on every rank


# -- two processes through the Trainer: parity with DDP where it holds today ----------------------------------------


def _fits(builder: str, strategies: list[str], precision: str = "32-true", optimizer: str = "adamw") -> list[dict]:
    import lightning_zero  # noqa: F401  (registers "zero1", "zero2", "zero3")

    return [fit_probe(builder, s, precision, optimizer=optimizer) for s in strategies]  # type: ignore[arg-type]


def _assert_match(reference: dict, candidate: dict, label: str) -> None:
    assert len(candidate["losses"]) == len(reference["losses"]) == 6, label
    torch.testing.assert_close(
        torch.tensor(candidate["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6, msg=label
    )
    # Buffers only on rank 0: DDP broadcasts rank 0's buffers (BatchNorm statistics) at every forward, ZeRO syncs
    # them once at setup, so other ranks' running statistics differ (see the probe's "buffer Δ").
    for kind in ("weights", "buffers") if reference["rank"] == 0 else ("weights",):
        assert candidate[kind].keys() == reference[kind].keys()
        for name, expected in reference[kind].items():
            torch.testing.assert_close(candidate[kind][name], expected, rtol=1e-5, atol=1e-6, msg=f"{label}: {name}")


@functools.cache
def _reference_fits(builder: str, strategy: str, optimizer: str) -> list[dict]:
    """Each rank's fit under the reference ``strategy``, trained once per test session: the stages 1 and 2 test and
    the stage 3 test compare most builders with the same one."""
    ranks = run_distributed(_fits, 2, builder, [strategy], "32-true", optimizer, init_process_group=False)
    return [runs[0] for runs in ranks]


def _check(builder: str, strategies: list[str], optimizer: str = "adamw") -> None:
    reference, others = strategies[0], strategies[1:]
    ranks = run_distributed(_fits, 2, builder, others, "32-true", optimizer, init_process_group=False)
    references = _reference_fits(builder, reference, optimizer)
    for expected, runs in zip(references, ranks, strict=True):
        for strategy, run in zip(others, runs, strict=True):
            _assert_match(expected, run, f"{builder} {strategy} vs {reference}")
    assert references[0]["losses"] != references[1]["losses"]  # the ranks trained on different data


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "builder",
    [
        "hf_lora",
        "hf_prompt_tuning",
        "hf_t5",
        "frozen_norm_before_linear",
        "reentrant_checkpointing",
        "batchnorm_mlp",
        "transformer_encoder_with_pe",
        "lightning_transformer",
        "lightning_lstm",
        "dataclass_output",
    ],
)
def test_stages_1_and_2_match_ddp(builder):
    _check(builder, ["ddp", "zero1", "zero2"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "builder",
    [
        "hf_causal_lm",
        "hf_prompt_tuning",
        "hf_lora",
        "hf_gpt2",
        "hf_t5",
        "frozen_norm_before_linear",
        "reentrant_checkpointing",
        "dataclass_output",
        "batchnorm_mlp",
        "lightning_transformer",
        "lightning_lstm",
    ],
)
def test_stage_3_matches_ddp(builder):
    _check(builder, ["ddp", "zero3"])


@pytest.mark.timeout(120)
def test_unused_parameters_match_ddp_with_a_stateless_optimizer():
    """Plain SGD: parameters unused on some or all ranks (experts, a spare head) step exactly as under DDP."""
    _check("moe", ["ddp_find_unused_parameters_true", "zero1", "zero2", "zero3"], optimizer="plain_sgd")


@pytest.mark.timeout(120)
def test_mixture_of_experts_matches_ddp_find_unused_with_adamw():
    """With AdamW, experts unused on every rank in a step must keep their weights and Adam state, as DDP's do."""
    _check("moe", ["ddp_find_unused_parameters_true", "zero2", "zero3"])
    _check("unused_head", ["ddp_find_unused_parameters_true", "zero1", "zero2", "zero3"], optimizer="plain_sgd")


@pytest.mark.timeout(400)
def test_compiled_model_matches_ddp_with_compile_at_every_stage():
    """``torch.compile`` of the model's body (the fixture compiles it) through the Trainer: stage 3 breaks the graph
    at each unit boundary and gathers there, eagerly (Note [placeholders under compile])."""
    _check("compiled_mlp", ["ddp", "zero1", "zero2", "zero3"])


def _fit_and_generate(builder: str, strategies: list[str]) -> list[tuple[list[list[int]], torch.Tensor]]:
    import lightning_zero  # noqa: F401  (registers "zero1", "zero2", "zero3")
    from tests.third_party_models import ProbeModule, probe_trainer

    generated = []
    for strategy in strategies:
        module = ProbeModule(builder, steps=3)
        probe_trainer(strategy, steps=3).fit(module)
        assert module.model is not None
        prompt = torch.arange(3, 11).view(2, 4)  # the same on every rank: generation is collective under stage 3
        with torch.no_grad():
            out = module.model.generate(  # type: ignore[operator]
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=6,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        generated.append((out.sequences.tolist(), torch.stack(out.scores)))
    return generated


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("builder", "length"), [("hf_causal_lm", 4 + 6), ("hf_t5", 1 + 6)])
def test_hugging_face_generate_after_fit_gives_ddps_tokens_under_stage_3(builder, length):
    """``generate`` after ``fit``: every forward of the loop runs outside a training step (T5's decoder many times
    without its encoder), each unit gathered when called and freed after. Greedy decoding gives DDP's tokens and
    DDP's scores at every position."""
    ranks = run_distributed(_fit_and_generate, 2, builder, ["ddp", "zero3"], init_process_group=False)
    for (ddp_tokens, ddp_scores), (tokens, scores) in ranks:
        assert len(ddp_tokens) == 2
        assert all(len(row) == length for row in ddp_tokens), ddp_tokens
        assert tokens == ddp_tokens
        assert scores.shape == ddp_scores.shape == (6, 2, 96)
        torch.testing.assert_close(scores, ddp_scores, rtol=1e-5, atol=1e-5)
    assert ranks[0][1][0] == ranks[1][1][0]  # both ranks generated the same
