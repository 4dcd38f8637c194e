"""The environment a trial's ranks get from where they run: HybridEP's ranks per NVLink domain and
MNNVL from the placement, CUDA's connection count by Megatron-Bridge's rule, and a HybridEP group
that cannot be told where its domains end refused before launch."""

from __future__ import annotations

import pytest

from autotune.core.fabric import (
    FabricRefused, hybrid_ep_span_problem, placed_environment, planned_environment,
)
from autotune.core.knobs import complete_config

HYBRID_EP8 = complete_config({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
                              "expert_model_parallel_size": 8})
TRAYS = [f"tray{rank // 4}" for rank in range(8)]  # GB200: 4 GPUs a node


def test_cuda_connections_follow_bridges_rule() -> None:
    def connections(config, accelerator: str = "h200") -> str:
        return planned_environment(config, accelerator, 8, 2, None, imex_channel=True)["CUDA_DEVICE_MAX_CONNECTIONS"]

    assert planned_environment(complete_config({}), "h200", 8, 1, None, imex_channel=True) == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    tp2 = complete_config({"tensor_model_parallel_size": 2, "sequence_parallel": True})
    assert connections(tp2) == "1"  # Hopper: communication kernels queue ahead of compute
    assert connections(tp2.replace(use_megatron_fsdp=True)) == "8"  # megatron-core refuses 1 with FSDP
    assert connections(tp2, "gb200") == "32"
    assert connections(HYBRID_EP8) == "32"


def test_a_hybrid_ep_group_in_one_rack_crosses_trays_over_mnnvl() -> None:
    assert planned_environment(HYBRID_EP8, "gb200", 4, 8, ["rack-a"] * 8, imex_channel=True) == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "32", "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "8", "USE_MNNVL": "1"}
    # where the ranks did start agrees with the plan
    assert placed_environment(HYBRID_EP8, "gb200", TRAYS, ["rack-a"] * 8, imex_channel=True) == planned_environment(
        HYBRID_EP8, "gb200", 4, 8, ["rack-a"] * 8, imex_channel=True)


def test_a_hybrid_ep_group_over_two_racks_has_half_its_ranks_in_each() -> None:
    environment = planned_environment(HYBRID_EP8, "gb200", 4, 8, ["rack-a"] * 4 + ["rack-b"] * 4, imex_channel=True)
    assert environment["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == "4"


def test_unlabelled_nodes_are_a_domain_each() -> None:
    ep16 = complete_config({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
                            "expert_model_parallel_size": 16})
    environment = planned_environment(ep16, "h200", 8, 16, None, imex_channel=True)
    assert (environment["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"], environment["USE_MNNVL"]) == ("8", "0")
    # Ray put the ranks on four nodes, not two: what the ranks were told no longer holds
    spread = placed_environment(ep16, "h200", [f"n{rank // 4}" for rank in range(16)], [None] * 16,
                                imex_channel=True)
    assert spread["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == "4"


def test_a_group_split_unevenly_over_racks_is_refused() -> None:
    with pytest.raises(FabricRefused, match=r"hold \[2, 6\] ranks"):
        planned_environment(HYBRID_EP8, "gb200", 4, 8, ["rack-a"] * 6 + ["rack-b"] * 2, imex_channel=True)
    with pytest.raises(FabricRefused, match="consecutive"):
        planned_environment(HYBRID_EP8, "gb200", 4, 8, ["rack-a"] * 2 + ["rack-b"] * 4 + ["rack-a"] * 2,
                            imex_channel=True)


def test_hybrid_ep_over_trays_with_no_domain_labels_is_refused_before_launch() -> None:
    def problem(accelerator: str = "gb200", gpus_per_node: int = 4, labelled: bool = False) -> str | None:
        return hybrid_ep_span_problem(HYBRID_EP8, accelerator, gpus_per_node, labelled, imex_channel=True)

    reason = problem()
    assert reason is not None and "spans 2 nodes" in reason and "autotune.io/nvlink-domain" in reason
    assert problem(labelled=True) is None
    assert problem("h200") is None  # NVLink ends at the node
    assert problem(gpus_per_node=8) is None  # one node holds it


def test_without_an_imex_channel_a_tray_is_hybrid_eps_domain() -> None:
    """Labelled GB200 trays whose processes hold no IMEX channel cannot map each other's memory: a
    group over two trays is refused before launch, and one inside a tray is told its tray is its
    domain, with CUDA IPC, wherever its rack label puts it."""
    reason = hybrid_ep_span_problem(HYBRID_EP8, "gb200", 4, labelled=True, imex_channel=False)
    assert reason is not None and "IMEX channel" in reason and "ComputeDomain" in reason
    ep4 = HYBRID_EP8.replace(expert_model_parallel_size=4)
    assert hybrid_ep_span_problem(ep4, "gb200", 4, labelled=True, imex_channel=False) is None
    # planned there by tray (the placement's node ids): one tray, or two when no tray had room
    assert planned_environment(ep4, "gb200", 4, 4, ["tray0"] * 4, imex_channel=False) == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "32", "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "4", "USE_MNNVL": "0"}
    assert planned_environment(ep4, "gb200", 4, 4, ["tray0"] * 2 + ["tray1"] * 2, imex_channel=False) == \
        placed_environment(ep4, "gb200", ["tray0"] * 2 + ["tray1"] * 2, ["rack-a"] * 4, imex_channel=False)
    # Ray put the group's ranks on two trays of the rack: what they were told no longer holds
    split = placed_environment(ep4, "gb200", ["t0", "t0", "t1", "t1"], ["rack-a"] * 4, imex_channel=False)
    assert split["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == "2"
