"""The flat layout every stage is built on: no process group needed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.sharding.flat_bucket import build_buckets


def _named(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters())


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parameters_become_views_of_a_padded_flat_buffer(world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (bucket,) = build_buckets(
        [_named(model)], 10**6, rank=0, world_size=world_size, registration_order=list(model.parameters())
    )
    assert bucket.numel == sum(t.numel() for t in before.values())
    assert bucket.padded_numel % world_size == 0
    assert bucket.padded_numel - bucket.numel < world_size
    assert torch.count_nonzero(bucket.data[bucket.numel :]) == 0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
        assert p.untyped_storage().data_ptr() == bucket.data.untyped_storage().data_ptr()
    # Writing the flat buffer is writing the module's parameters.
    bucket.data.fill_(3.0)
    assert all(bool((p == 3.0).all()) for p in model.parameters())


def test_shards_are_balanced_by_elements_not_by_parameter_count():
    # One huge and many tiny parameters: a split by count would give one rank nearly everything.
    model = nn.ParameterList([nn.Parameter(torch.randn(1000))] + [nn.Parameter(torch.randn(1)) for _ in range(9)])
    world = 4
    shards = []
    for rank in range(world):
        clone = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in model])
        (bucket,) = build_buckets([_named(clone)], 10**6, rank, world, list(clone.parameters()))
        shards.append(bucket.param_shard.clone())
    assert {s.numel() for s in shards} == {(1009 + 3) // 4}
    assert torch.equal(torch.cat(shards)[:1009], torch.cat([p.detach() for p in model][::-1]))


def test_buckets_split_by_size_never_mix_groups_or_dtypes_and_fill_in_reverse_order():
    model = nn.ModuleDict(
        {
            "a": nn.Linear(4, 4),  # 20 elements
            "b": nn.Linear(4, 4),
            "c": nn.Linear(4, 4).to(torch.bfloat16),
        }
    )
    decay = [(n, p) for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [(n, p) for n, p in model.named_parameters() if n.endswith("bias")]
    buckets = build_buckets(
        [decay, no_decay], bucket_numel=16, rank=0, world_size=2, registration_order=list(model.parameters())
    )
    for bucket in buckets:
        assert len({p.dtype for p in bucket.params}) == 1
        names = [s.fqn for s in bucket.slots]
        assert all(n.endswith("weight") for n in names) or all(n.endswith("bias") for n in names)
    # The last registered parameters (backward's first gradients) are in the first bucket.
    assert buckets[0].slots[0].fqn == "c.weight"
    assert sorted(s.fqn for b in buckets for s in b.slots) == sorted(n for n, _ in model.named_parameters())
    assert [b.index for b in buckets] == list(range(len(buckets)))


def test_tied_parameter_is_flattened_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    (bucket,) = build_buckets([_named(model)], 10**6, 0, 2, list(model.parameters()))
    assert bucket.numel == 40
    assert model["head"].weight is model["emb"].weight
