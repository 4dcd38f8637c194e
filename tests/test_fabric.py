"""The environment a trial's ranks get from where they run: HybridEP's ranks per NVLink domain and
MNNVL from the placement, CUDA's connection count by Megatron-Bridge's rule, and a HybridEP group
that cannot be told where its domains end refused before launch."""

from __future__ import annotations

import pytest

from autotune.core.fabric import (
    FabricRefused, placed_environment, planned_environment, unknown_domain_problem,
)
from autotune.core.knobs import complete_config

HYBRID_EP8 = complete_config({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
                              "expert_model_parallel_size": 8})
TRAYS = [f"tray{rank // 4}" for rank in range(8)]  # GB200: 4 GPUs a node


def test_cuda_connections_follow_bridges_rule() -> None:
    def connections(config, accelerator: str = "h200") -> str:
        return planned_environment(config, accelerator, 8, 2, None)["CUDA_DEVICE_MAX_CONNECTIONS"]

    assert planned_environment(complete_config({}), "h200", 8, 1, None) == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    tp2 = complete_config({"tensor_model_parallel_size": 2, "sequence_parallel": True})
    assert connections(tp2) == "1"  # Hopper: communication kernels queue ahead of compute
    assert connections(tp2.replace(use_megatron_fsdp=True)) == "8"  # megatron-core refuses 1 with FSDP
    assert connections(tp2, "gb200") == "32"
    assert connections(HYBRID_EP8) == "32"


def test_a_hybrid_ep_group_in_one_rack_crosses_trays_over_mnnvl() -> None:
    assert planned_environment(HYBRID_EP8, "gb200", 4, 8, ["rack-a"] * 8) == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "32", "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "8", "USE_MNNVL": "1"}
    # where the ranks did start agrees with the plan
    assert placed_environment(HYBRID_EP8, "gb200", TRAYS, ["rack-a"] * 8) == planned_environment(
        HYBRID_EP8, "gb200", 4, 8, ["rack-a"] * 8)


def test_a_hybrid_ep_group_over_two_racks_has_half_its_ranks_in_each() -> None:
    environment = planned_environment(HYBRID_EP8, "gb200", 4, 8, ["rack-a"] * 4 + ["rack-b"] * 4)
    assert environment["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == "4"


def test_unlabelled_nodes_are_a_domain_each() -> None:
    ep16 = complete_config({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
                            "expert_model_parallel_size": 16})
    environment = planned_environment(ep16, "h200", 8, 16, None)
    assert (environment["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"], environment["USE_MNNVL"]) == ("8", "0")
    # Ray put the ranks on four nodes, not two: what the ranks were told no longer holds
    spread = placed_environment(ep16, "h200", [f"n{rank // 4}" for rank in range(16)], [None] * 16)
    assert spread["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == "4"


def test_a_group_split_unevenly_over_racks_is_refused() -> None:
    with pytest.raises(FabricRefused, match=r"hold \[2, 6\] ranks"):
        planned_environment(HYBRID_EP8, "gb200", 4, 8, ["rack-a"] * 6 + ["rack-b"] * 2)
    with pytest.raises(FabricRefused, match="consecutive"):
        planned_environment(HYBRID_EP8, "gb200", 4, 8, ["rack-a"] * 2 + ["rack-b"] * 4 + ["rack-a"] * 2)


def test_hybrid_ep_over_trays_with_no_domain_labels_is_refused_before_launch() -> None:
    reason = unknown_domain_problem(HYBRID_EP8, "gb200", gpus_per_node=4, labelled=False)
    assert reason is not None and "spans 2 nodes" in reason and "autotune.io/nvlink-domain" in reason
    assert unknown_domain_problem(HYBRID_EP8, "gb200", gpus_per_node=4, labelled=True) is None
    assert unknown_domain_problem(HYBRID_EP8, "h200", gpus_per_node=4, labelled=False) is None  # NVLink ends at the node
    assert unknown_domain_problem(HYBRID_EP8, "gb200", gpus_per_node=8, labelled=False) is None  # one node holds it
