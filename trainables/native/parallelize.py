"""Parallelism for the native model: expert parallel (all-to-all token dispatch), then data
parallel as DDP or FSDP2 (``fully_shard``). Works over gloo on the CPU and NCCL on CUDA.

Process groups for a world of W ranks and EP size E: EP groups are consecutive blocks of E ranks;
expert-data-parallel groups join the ranks holding the same experts (W / E of them). Non-expert
parameters are replicated over all W ranks; expert parameters over their expert-DP group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from autotune.core.contract import InvalidConfig
from autotune.core.knobs import Config
from trainables.native.model import GroupedExperts, MoE, MoEVLM


@dataclass
class ParallelGroups:
    world_size: int
    rank: int
    ep_size: int
    ep_group: dist.ProcessGroup | None
    expert_dp_group: dist.ProcessGroup | None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // self.ep_size


def make_groups(config: Config, world_size: int, rank: int) -> ParallelGroups:
    """This rank's EP and expert-DP groups; an EP size that does not divide the world is
    :class:`InvalidConfig` (its last group would name ranks that do not exist)."""
    ep = config.expert_model_parallel_size
    if world_size % ep:
        raise InvalidConfig(f"expert_model_parallel_size={ep} does not divide the burst's {world_size} ranks")
    ep_group = expert_dp_group = None
    if world_size > 1:
        # Every rank must create every group, in the same order.
        for start in range(0, world_size, ep):
            group = dist.new_group(list(range(start, start + ep)))
            if start <= rank < start + ep:
                ep_group = group
        for ep_rank in range(ep):
            group = dist.new_group(list(range(ep_rank, world_size, ep)))
            if rank % ep == ep_rank:
                expert_dp_group = group
    return ParallelGroups(world_size, rank, ep, ep_group, expert_dp_group)


class AllToAllDispatcher:
    """Sends each token to the rank holding its expert and brings the results back (autograd-aware)."""

    def __init__(self, group: dist.ProcessGroup, size: int) -> None:
        self.group, self.size = group, size

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        local = experts.local_count
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_splits = counts.view(self.size, local).sum(1).tolist()
        recv_matrix = recv_counts.view(self.size, local)  # [source rank, local expert]
        recv_splits = recv_matrix.sum(1).tolist()
        # torch's functional collective is the autograd-aware all-to-all its deprecation notice
        # for torch.distributed.nn points to; it works over gloo and NCCL.
        received = all_to_all_single_autograd(tokens, recv_splits, send_splits, self.group)
        # Source-major → expert-major, run the experts, and back.
        chunks = received.split(recv_matrix.flatten().tolist())
        expert_major = [chunks[s * local + e] for e in range(local) for s in range(self.size)]
        out = experts(torch.cat(expert_major), recv_matrix.sum(0).tolist())
        out_chunks = out.split([c.shape[0] for c in expert_major])
        source_major = torch.cat([out_chunks[e * self.size + s] for s in range(self.size) for e in range(local)])
        return all_to_all_single_autograd(source_major, send_splits, recv_splits, self.group)


def apply_expert_parallel(model: MoEVLM, groups: ParallelGroups) -> list[nn.Parameter]:
    """Keep this rank's slice of every MoE layer's experts; returns the expert parameters.

    Raises:
        InvalidConfig: the experts cannot be spread evenly over the EP group (a rank's slice
            would drop experts the router still sends tokens to).
    """
    expert_params: list[nn.Parameter] = []
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        if experts.local_count % groups.ep_size:
            raise InvalidConfig(f"{experts.local_count} experts cannot be spread evenly over "
                                f"expert_model_parallel_size={groups.ep_size}")
        if groups.ep_size > 1:
            local = experts.local_count // groups.ep_size
            start = groups.ep_rank * local
            for name in ("gate", "up", "down"):
                full = getattr(experts, name)
                setattr(experts, name, nn.Parameter(full.detach()[start:start + local].clone(), full.requires_grad))
            experts.first = start
            module.dispatcher = AllToAllDispatcher(groups.ep_group, groups.ep_size)
        expert_params.extend(experts.parameters())
    return expert_params


def apply_data_parallel(model: MoEVLM, config: Config, groups: ParallelGroups, expert_params, device) -> nn.Module:
    """FSDP2 (per decoder layer and vision block, then the root) or DDP; identity on one rank."""
    if groups.world_size == 1:
        return model
    if config.use_torch_fsdp2:
        for stack in model.decoder:
            fully_shard(stack)
        for block in model.vision.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    if expert_params and groups.ep_size > 1:
        ignored = {f"{name}" for name, param in model.named_parameters() if any(param is p for p in expert_params)}
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignored))
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=True,
    )


def sync_expert_gradients(expert_params: list[nn.Parameter], groups: ParallelGroups) -> None:
    """With EP, DDP ignores expert weights: average their gradients over the expert-DP group."""
    if groups.ep_size == 1 or groups.expert_dp_size == 1:
        return
    for param in expert_params:
        if param.grad is not None:
            dist.all_reduce(param.grad, group=groups.expert_dp_group)
            param.grad.div_(groups.expert_dp_size)
