"""What a trial's ranks must be told about the NVLink fabric under them (HybridEP, MNNVL, CUDA
connections), derived from where the trial's ranks were placed.

HybridEP, the flex dispatcher's backend for GB200, moves tokens over NVLink inside an NVLink domain
and over RDMA between domains, and it learns where a domain ends from the environment, not from the
hardware. ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` is how many consecutive ranks of its group
(the expert-tensor x expert-parallel ranks megatron-core hands it) share one domain, and the group's
size must be a multiple of it (deep_ep's ``hybrid_ep_buffer.py``). ``USE_MNNVL`` says whether that
domain crosses nodes (a GB200 NVL72 rack: 18 trays of 4 GPUs); current builds act only on its "0"
(CUDA IPC, which stops at the node); ``NVLINK_DOMAIN_SIZE``, read only by the builds of late 2025,
is left unset (a label tells which nodes share a domain, not how large the rack is), and so are
NCCL's MNNVL switches, whose default detects the fabric.
Megatron-Bridge's GB200 recipes set them per launch from the recipe's EP (ranks per domain = EP,
domain 72, ``USE_MNNVL=1``), which is right only when the whole group sits in one rack; a trial
knows its placement. ``CUDA_DEVICE_MAX_CONNECTIONS`` follows Bridge's rule: 32 for DeepEP or
HybridEP and on Blackwell, 1 where TP or CP > 1 on Hopper (so communication kernels queue ahead of
compute; Bridge keeps 8 where the expert all-to-all overlaps compute, which no knob here turns on),
8 (CUDA's default) otherwise, and never 1 with FSDP, which megatron-core refuses.

Nodes name their NVLink domain with a Ray label (``autotune.engine.placement``). Where they carry
none, a domain is a node: right on H100/H200/B200 systems, whose NVLink ends at the node. On GB200 it
is not known which trays share a rack, so a HybridEP group larger than a node is refused there
before launch (:func:`hybrid_ep_span_problem`) rather than run with settings that may be wrong. The
same holds where the trays are labelled but their processes hold no IMEX channel (the probe reads
``/dev/nvidia-caps-imex-channels``; Kubernetes pods get one from their rack's ComputeDomain claim):
no GPU can then map another tray's memory, so HybridEP's domain is the tray.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from autotune.core.knobs import Config

MULTI_NODE_NVLINK: frozenset[str] = frozenset({"gb200"})
"""Accelerators whose NVLink domain spans nodes."""
BLACKWELL: frozenset[str] = frozenset({"b200", "gb200"})


class FabricRefused(ValueError):
    """The placement cannot give HybridEP what it needs; the message says why."""


def hybrid_ep_group_size(config: Config) -> int:
    """Ranks of the group HybridEP spans: expert-tensor x expert parallel (ETP defaults to TP)."""
    expert_tensor = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    return expert_tensor * config.expert_model_parallel_size


def uses_hybrid_ep(config: Config) -> bool:
    return config.moe_token_dispatcher_type == "flex" and config.moe_flex_dispatcher_backend == "hybridep"


def hybrid_ep_span_problem(config: Config, accelerator: str, gpus_per_node: int, labelled: bool,
                           imex_channel: bool) -> str | None:
    """Why ``config``'s HybridEP group cannot span the nodes it needs, or ``None``: on an
    accelerator whose NVLink crosses nodes, a group larger than a node needs to know which nodes
    share a domain (their labels) and an IMEX channel to reach them over NVLink."""
    group = hybrid_ep_group_size(config)
    if not uses_hybrid_ep(config) or accelerator not in MULTI_NODE_NVLINK or group <= gpus_per_node:
        return None
    spans = (f"HybridEP's group of {group} ranks (ETP x EP) spans {-(-group // gpus_per_node)} nodes of "
             f"{gpus_per_node} GPUs, and on {accelerator} NVLink crosses nodes")
    if not labelled:
        return (f"{spans}, but these nodes carry no autotune.io/nvlink-domain label, so which of them share a "
                "domain is unknown (NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN and USE_MNNVL would be guesses); "
                "label the nodes (cluster/README.md)")
    if not imex_channel:
        return (f"{spans}, but the nodes' processes hold no IMEX channel (/dev/nvidia-caps-imex-channels), "
                "without which no GPU maps another tray's memory; give the pods their rack's ComputeDomain "
                "channel claim (cluster/gb200_raycluster.yaml) or start the nodes' IMEX service")
    return None


def planned_environment(config: Config, accelerator: str, gpus_per_node: int, world_size: int,
                        plan: Sequence[str] | None, imex_channel: bool) -> dict[str, str]:
    """The environment every rank of ``config``'s burst starts with, from the trial's plan: each
    worker's NVLink domain in rank order (a rack, or on GB200 trays without an IMEX channel the
    tray itself: ``autotune.engine.placement.domain_label``; ``None``: the nodes carry no domain
    label, and the ranks fill nodes of ``gpus_per_node`` in order). Raises :class:`FabricRefused`
    where HybridEP's group does not split evenly over the domains it spans."""
    if plan is None:
        return _environment(config, accelerator, [f"node {rank // gpus_per_node}" for rank in range(world_size)],
                            mnnvl=False)
    return _environment(config, accelerator, list(plan), mnnvl=accelerator in MULTI_NODE_NVLINK and imex_channel)


def placed_environment(config: Config, accelerator: str, nodes: Sequence[str],
                       domains: Sequence[str | None], imex_channel: bool) -> dict[str, str]:
    """The same from where the ranks did start (each rank's node and domain label): what the
    planned environment must match."""
    if all(domain is not None for domain in domains) and _domains_cross_nodes(accelerator, imex_channel):
        return _environment(config, accelerator, list(domains), mnnvl=accelerator in MULTI_NODE_NVLINK)
    return _environment(config, accelerator, [f"node {node}" for node in nodes], mnnvl=False)


def _domains_cross_nodes(accelerator: str, imex_channel: bool) -> bool:
    """Whether a labelled domain's ranks may sit on several nodes: on GB200 only through an IMEX
    channel; without one, HybridEP's domain is the node, as on systems whose NVLink ends there
    (where a domain label names one node: the same either way)."""
    return accelerator not in MULTI_NODE_NVLINK or imex_channel


def _environment(config: Config, accelerator: str, domains: list[str], mnnvl: bool) -> dict[str, str]:
    """``mnnvl``: the domains are GB200 racks reached through an IMEX channel, where a group's ranks
    may sit on several trays, which only MNNVL reaches (it also serves ranks on one tray); else
    each domain is a node, where NVLink is reached through CUDA IPC."""
    environment = {"CUDA_DEVICE_MAX_CONNECTIONS": str(_max_connections(config, accelerator))}
    if not uses_hybrid_ep(config):
        return environment
    group = hybrid_ep_group_size(config)
    per_domain: set[int] = set()
    for start in range(0, len(domains), group):
        ranks = range(start, min(start + group, len(domains)))
        runs = [domains[r] for r in ranks if r == start or domains[r] != domains[r - 1]]
        if len(runs) != len(set(runs)):
            raise FabricRefused(f"HybridEP's group of ranks {start}-{ranks[-1]} leaves an NVLink domain and comes back "
                                "to it: a domain's ranks must be consecutive")
        per_domain |= set(Counter(domains[r] for r in ranks).values())
    if len(per_domain) != 1:
        raise FabricRefused(f"HybridEP's groups of {group} ranks hold {sorted(per_domain)} ranks in their NVLink domains: "
                            "every domain must hold the same number of a group's ranks")
    (ranks_per_domain,) = per_domain
    environment.update(NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=str(ranks_per_domain), USE_MNNVL="1" if mnnvl else "0")
    return environment


def _max_connections(config: Config, accelerator: str) -> int:
    sharded = config.use_megatron_fsdp or config.use_torch_fsdp2
    if config.moe_token_dispatcher_type == "flex" or accelerator in BLACKWELL:
        return 32
    if (config.tensor_model_parallel_size > 1 or config.context_parallel_size > 1) and not sharded:
        return 1
    return 8
