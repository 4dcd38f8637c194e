"""The capability probe at campaign start: every node that can run a trial reports its stack, and
the rules judge configs against what is installed rather than what the campaign assumed."""

from __future__ import annotations

import dataclasses
import json

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from autotune.campaign import Campaign
from autotune.core.errors import AutotuneError
from autotune.core.tables import RecordedTable

SOFTWARE_FIELDS = ("megatron_core", "transformer_engine", "deep_ep", "hybrid_ep")


def _probe_node() -> dict:
    from trainables.probe import probe

    return probe()


def probe_cluster(accelerator_resource: str | None) -> list[dict]:
    """One probe per alive node (holding ``accelerator_resource``, e.g. ``GPU``, when given)."""
    nodes = [n for n in ray.nodes() if n["Alive"]
             and (accelerator_resource is None or n["Resources"].get(accelerator_resource, 0) > 0)]
    remote = ray.remote(_probe_node)
    return ray.get([
        remote.options(num_cpus=0, num_gpus=0,
                       scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ])


def recorded_probes(table: RecordedTable) -> list[dict]:
    """The stack a recorded table ran on, as one probe per distinct recorded stack."""
    stacks = {json.dumps(row.contract["stack"], sort_keys=True) for row in table.rows.values()
              if "stack" in row.contract}
    if not stacks:
        raise AutotuneError(f"{table.path}: no row records the stack it ran on (contract.stack)")
    return [json.loads(stack) for stack in sorted(stacks)]


def apply_probe(campaign: Campaign, probes: list[dict]) -> tuple[Campaign, list[str]]:
    """The campaign with its stack's software replaced by what the nodes run, and what changed.

    Nodes that disagree on megatron-core are a clear error (one campaign, one stack); a package
    that some nodes lack counts as absent.
    """
    if not probes:
        raise AutotuneError(f"no alive Ray node can run a {campaign.stack.accelerator} trial")
    if campaign.stack.has_cuda and not any(p["device_count"] for p in probes):
        raise AutotuneError(f"the campaign targets {campaign.stack.accelerator} but no node has a CUDA device")
    versions = {p["megatron_core"] for p in probes}
    if len(versions) > 1:
        raise AutotuneError(f"nodes run different megatron-core versions: {sorted(map(str, versions))}")
    te = {p["transformer_engine"] for p in probes}
    probed = {
        "megatron_core": versions.pop(),
        "transformer_engine": te.pop() if len(te) == 1 else None,
        "deep_ep": all(p["deep_ep"] for p in probes),
        "hybrid_ep": all(p["hybrid_ep"] for p in probes),
    }
    if not campaign.trainable.requires_cuda:
        return campaign, []  # the native trainable uses none of these packages
    changes = [f"{name}: campaign assumed {getattr(campaign.stack, name)!r}, nodes run {probed[name]!r}"
               for name in SOFTWARE_FIELDS if getattr(campaign.stack, name) != probed[name]]
    return dataclasses.replace(campaign, stack=campaign.stack.model_copy(update=probed)), changes
