"""Per-layer CUDA graphs for the native model (``cuda_graph_impl: local``), where shapes allow.

Packed micro-batches give every step the same decoder shapes ([MBS, seq_length]), so two units
are capturable with ``torch.cuda.make_graphed_callables``: the attention kernel of each decoder
layer (scope ``attn``) and each MoE layer's router with the permutation preprocessing (scopes
``moe_router`` + ``moe_preprocess``, which local graphs capture together). Expert computation
and the vision encoder have data-dependent shapes and stay eager; a whole-layer scope is not
offered. The sample arguments are probed from one eager forward, so dtypes under autocast and
``requires_grad`` match training exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from autotune.core.contract import InvalidConfig
from autotune.core.knobs import Config
from trainables.native.model import MoEVLM


def _unwrap(module: nn.Module) -> nn.Module:
    """The module a recompute wrapper holds (graphs go inside the checkpoint, not around it)."""
    return getattr(module, "inner", module)


def graph_targets(model: MoEVLM, config: Config) -> list[nn.Module]:
    scope = set(config.cuda_graph_scope or ())
    targets: list[nn.Module] = []
    for layer in model.decoder_layers():
        if "attn" in scope:
            targets.append(_unwrap(layer.attention.core))
        if "moe_router" in scope and layer.moe is not None:
            targets.append(_unwrap(layer.moe).router)
    return targets


def apply_cuda_graphs(model: MoEVLM, config: Config, probe_forward) -> list[nn.Module]:
    """Capture the configured units; ``probe_forward()`` runs one eager forward of a real batch.

    Returns the graphed modules, each counting its replays in ``graph_replays``.

    Raises:
        InvalidConfig: with FSDP2, whose sharded parameters move (captured graphs would read stale storage).
    """
    if config.cuda_graph_impl != "local":
        return []
    if config.use_torch_fsdp2:
        raise InvalidConfig("cuda_graph_impl=local cannot run with use_torch_fsdp2 in the native trainable: its CUDA "
                            "graphs would read FSDP2-sharded parameters whose storage moves between steps")
    targets = graph_targets(model, config)
    samples: dict[nn.Module, tuple[torch.Tensor, ...]] = {}

    def record(module, args):
        samples.setdefault(module, tuple(
            a.detach().clone().requires_grad_(a.is_floating_point()) for a in args
        ))

    handles = [t.register_forward_pre_hook(record) for t in targets]
    try:
        probe_forward()
    finally:
        for handle in handles:
            handle.remove()
    captured = [t for t in targets if t in samples]
    if not captured:
        return []
    torch.cuda.make_graphed_callables(tuple(captured), tuple(samples[t] for t in captured))
    for module in captured:
        module.graph_replays = 0
        module.register_forward_pre_hook(_count_replay)
    return captured


def _count_replay(module: nn.Module, args) -> None:
    module.graph_replays += 1
