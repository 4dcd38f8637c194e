"""The capability probe at campaign start: every node that can run a trial reports its stack, and
the rules judge configs against what is installed rather than what the campaign assumed."""

from __future__ import annotations

import dataclasses
import json

from autotune.campaign import Campaign
from autotune.core.contract import StackCapabilities
from autotune.core.errors import AutotuneError
from autotune.core.tables import RecordedTable

SOFTWARE_FIELDS = ("megatron_core", "transformer_engine", "deep_ep", "hybrid_ep", "imex_channel")


def probe_this_machine() -> dict:
    """The probe of the machine this process runs on (``autotune burst`` judges configs by it)."""
    from trainables.probe import probe

    return probe()


def probe_cluster(accelerator_resource: str | None) -> list[dict]:
    """One probe per alive node (holding ``accelerator_resource``, e.g. ``GPU``, when given)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n["Alive"]
             and (accelerator_resource is None or n["Resources"].get(accelerator_resource, 0) > 0)]
    remote = ray.remote(probe_this_machine)
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
    """The campaign with its stack's software replaced by what the nodes run, and what changed."""
    if not probes:
        raise AutotuneError(f"no alive Ray node can run a {campaign.stack.accelerator} trial")
    stack, changes = probed_stack(campaign.stack, probes, uses_stack=campaign.trainable.requires_cuda)
    return dataclasses.replace(campaign, stack=stack), changes


def probed_stack(assumed: StackCapabilities, probes: list[dict], uses_stack: bool) -> tuple[StackCapabilities, list[str]]:
    """``assumed`` with its software replaced by what the probed machines run, and each change in
    words. Machines that disagree on megatron-core are a clear error (one campaign, one stack); a
    package that some machines lack, or cannot load, counts as absent. ``uses_stack`` is false for
    a trainable that needs none of these packages (the native one): nothing changes then."""
    if assumed.has_cuda and not any(p["device_count"] for p in probes):
        raise AutotuneError(f"the campaign targets {assumed.accelerator} but no node has a CUDA device")
    versions = {p["megatron_core"] for p in probes}
    if len(versions) > 1:
        raise AutotuneError(f"nodes run different megatron-core versions: {sorted(map(str, versions))}")
    te = {p["transformer_engine"] for p in probes}
    probed = {
        "megatron_core": versions.pop(),
        "transformer_engine": te.pop() if len(te) == 1 else None,
        "deep_ep": all(p["deep_ep"] for p in probes),
        "hybrid_ep": all(p["hybrid_ep"] for p in probes),
        # probes written before IMEX channels were read say nothing of them: none assumed
        "imex_channel": all(p.get("imex_channels", 0) > 0 for p in probes),
    }
    if not uses_stack:
        return assumed, []
    changes = [f"{name}: campaign assumed {getattr(assumed, name)!r}, nodes run {probed[name]!r}"
               for name in SOFTWARE_FIELDS if getattr(assumed, name) != probed[name]]
    changes += sorted({p["transformer_engine_error"] for p in probes if p.get("transformer_engine_error")})
    return assumed.model_copy(update=probed), changes
