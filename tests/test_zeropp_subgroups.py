"""ZeRO++ on a ZeRO process group that is a subset of the world (Note [node topology]): its node groups are created
by the group's ranks alone, and a group whose ranks fall unevenly on the nodes is refused up front."""

from __future__ import annotations

import pytest
import torch

from tests import hpz_runs
from tests.harness import run_distributed


@pytest.mark.timeout(120)
def test_zeropp_on_a_subgroup_of_the_world_trains_with_ddp_numbers_and_no_help_from_the_other_ranks():
    hpz = {"hpz_partition_size": 2}
    everything = {**hpz, "quantize_weights": True, "quantize_gradients": True, "quantization_block": 64}
    ranks = run_distributed(hpz_runs.subgroup, 6, [0, 1, 2, 3], [hpz, everything], timeout=100)
    assert all(r["world_sum"] == 15 for r in ranks)  # ranks 4 and 5 still agree with the others on the next group
    assert [r["runs"] is None for r in ranks] == [False] * 4 + [True] * 2
    for rank in range(4):
        ddp, exact, quantized = ranks[rank]["runs"]
        torch.testing.assert_close(torch.tensor(exact["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=1e-6)
        for name, weight in ddp["weights"].items():
            torch.testing.assert_close(exact["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(torch.tensor(quantized["losses"]), torch.tensor(ddp["losses"]), rtol=0.02, atol=0.0)


@pytest.mark.timeout(60)
def test_zeropp_on_a_group_with_uneven_ranks_per_node_is_refused_before_training():
    ranks = run_distributed(hpz_runs.subgroup, 6, [0, 1, 2], [{"hpz_partition_size": 2}], timeout=50)
    for rank in range(3):
        error = ranks[rank]["runs"][1]["error"]
        assert "ranks [0, 1, 2] fall unevenly on nodes of 2 ranks (node 0: 2, node 1: 1)" in error
        assert "HINT:" in error
