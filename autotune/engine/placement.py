"""Where a multi-GPU trial's workers go: inside one NVLink domain when they fit in it.

Megatron puts its TP and EP groups on the fastest links, so a trial whose workers straddle two
NVLink domains (two GB200 NVL72 racks, say) runs its expert all-to-all over the slower network
and measures the wrong thing. Nodes say which domain they are in with the Ray node label
:data:`NVLINK_DOMAIN_LABEL` (``cluster/`` sets it on every GPU node). The driver plans each trial
as Tune asks for it: the domain with the *fewest* free GPUs that still holds all the trial's
workers (best fit, so a half-free rack is used before a whole one is broken into), and only when
no domain can hold them, the fewest domains with the most free GPUs. Each worker then carries a
label selector for its domain (Ray Train's per-worker ``label_selector``).

The plan counts the GPUs of this campaign's own running trials: campaigns run overnight on nodes
allocated to them (a Slurm allocation, a dedicated RayCluster). A cluster without the label has
no domains, and trials go wherever Ray puts them, as before.

On GB200 trays whose processes hold no IMEX channel, NVLink stops at the tray
(:mod:`autotune.core.fabric`), so the domains planned are the nodes themselves, by Ray's own
:data:`NODE_LABEL`: a trial that fits a tray runs on one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.core.fabric import MULTI_NODE_NVLINK

NVLINK_DOMAIN_LABEL = "autotune.io/nvlink-domain"
NODE_LABEL = "ray.io/node-id"
"""The label Ray gives every node: its id."""


def domain_label(accelerator: str, imex_channel: bool) -> str:
    """The node label whose values are the NVLink domains trials are planned in."""
    return NODE_LABEL if accelerator in MULTI_NODE_NVLINK and not imex_channel else NVLINK_DOMAIN_LABEL


def domains_labelled(nodes: list[dict]) -> bool:
    """Whether the alive GPU nodes of ``ray.nodes()`` carry :data:`NVLINK_DOMAIN_LABEL`."""
    return bool(DomainPlanner.from_nodes(nodes).capacity)


@dataclass
class DomainPlanner:
    """GPUs per NVLink domain and which of them this campaign's running trials hold."""

    capacity: dict[str, int]
    """Domain → GPUs of the alive nodes that carry its label."""
    label: str = NVLINK_DOMAIN_LABEL
    """The node label whose values are the domains (:func:`domain_label`)."""
    held: dict[str, list[str]] = field(default_factory=dict)
    """Trial id → each worker's domain."""
    node_domains: dict[str, str] = field(default_factory=dict)
    """Node id → its domain, for the alive labelled GPU nodes."""

    @classmethod
    def from_nodes(cls, nodes: list[dict], label: str = NVLINK_DOMAIN_LABEL) -> "DomainPlanner":
        """From ``ray.nodes()``: alive nodes with GPUs and the domain label."""
        capacity: dict[str, int] = {}
        node_domains: dict[str, str] = {}
        for node in nodes:
            domain = (node.get("Labels") or {}).get(label)
            gpus = int((node.get("Resources") or {}).get("GPU", 0))
            if node.get("Alive") and domain and gpus:
                capacity[domain] = capacity.get(domain, 0) + gpus
                if node.get("NodeID"):
                    node_domains[node["NodeID"]] = domain
        return cls(capacity, label, node_domains=node_domains)

    def observe(self, nodes: list[dict]) -> None:
        """Re-read which nodes are alive: a node lost overnight takes its GPUs out of its domain
        (its trial's retry must not wait for them)."""
        observed = DomainPlanner.from_nodes(nodes, self.label)
        self.capacity, self.node_domains = observed.capacity, observed.node_domains

    def hold(self, trial_id: str, nodes: tuple[str, ...]) -> list[str] | None:
        """Each worker's domain for a trial whose workers go to ``nodes`` (held until
        :meth:`release`), or ``None`` where a node has no domain."""
        if not all(node in self.node_domains for node in nodes):
            return None
        self.held[trial_id] = [self.node_domains[node] for node in nodes]
        return self.held[trial_id]

    def free(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for plan in self.held.values():
            for domain in plan:
                used[domain] = used.get(domain, 0) + 1
        return {domain: max(0, gpus - used.get(domain, 0)) for domain, gpus in self.capacity.items()}

    def place(self, trial_id: str, workers: int) -> list[str] | None:
        """Each worker's domain for ``trial_id`` (held until :meth:`release`), or ``None`` where
        there are no domains or not enough free GPUs in them (Ray then places the workers)."""
        free = self.free()
        if not free or sum(free.values()) < workers:
            return None
        fitting = [domain for domain, gpus in free.items() if gpus >= workers]
        if fitting:
            domain = min(fitting, key=lambda d: (free[d], d))
            plan = [domain] * workers
        else:
            plan = []
            for domain in sorted(free, key=lambda d: (-free[d], d)):
                plan += [domain] * min(free[domain], workers - len(plan))
                if len(plan) == workers:
                    break
        self.held[trial_id] = plan
        return plan

    def release(self, trial_id: str) -> None:
        self.held.pop(trial_id, None)


def label_selectors(plan: list[str] | None, label: str, nodes: list[str] | None = None) -> list[dict[str, str]] | None:
    """Ray Train's per-worker ``label_selector`` for a plan of ``label``'s values, or for workers
    that must go to ``nodes`` (a promotion run: each worker to its node, which is in its domain)."""
    if nodes is not None:
        return [{NODE_LABEL: node} for node in nodes]
    return None if plan is None else [{label: domain} for domain in plan]
