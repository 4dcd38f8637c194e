"""Activation recompute for the native model, applied by wrapping modules (the model stays plain).

- full: decoder layers are checkpointed whole: ``uniform`` in chunks of ``recompute_num_layers``
  consecutive layers, ``block`` the first ``recompute_num_layers`` layers only (Megatron's meaning
  per pipeline stage; the native trainable has one stage). The vision encoder is not recomputed.
- selective: the named submodules of every decoder layer are checkpointed: ``core_attn`` (the
  attention kernel on projected q, k, v), ``mlp`` (dense SwiGLU), ``moe`` (router, dispatch and
  experts), ``layernorm`` (both RMSNorms).
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.core.knobs import Config
from trainables.native.model import LayerStack, MoEVLM


class Checkpointed(nn.Module):
    """Runs ``inner`` under activation checkpointing and counts how often it did (evidence)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, *args):
        if not self.training:
            return self.inner(*args)
        self.calls += 1
        return checkpoint(self.inner, *args, use_reentrant=False)


def apply_recompute(model: MoEVLM, config: Config) -> list[Checkpointed]:
    """Wrap ``model`` per the config's recompute knobs; returns the wrappers (for evidence)."""
    wrappers: list[Checkpointed] = []

    def wrap(module: nn.Module) -> Checkpointed:
        wrapper = Checkpointed(module)
        wrappers.append(wrapper)
        return wrapper

    if config.recompute_granularity == "full":
        layers = model.decoder_layers()
        count = config.recompute_num_layers
        if config.recompute_method == "uniform":
            stacks = [LayerStack(layers[i:i + count]) for i in range(0, len(layers), count)]
            model.decoder = nn.ModuleList(wrap(stack) for stack in stacks)
        else:  # block
            model.decoder = nn.ModuleList(
                wrap(LayerStack([layer])) if index < count else LayerStack([layer])
                for index, layer in enumerate(layers)
            )
    elif config.recompute_granularity == "selective":
        modules = set(config.recompute_modules)
        for layer in model.decoder_layers():
            if "core_attn" in modules:
                layer.attention.core = wrap(layer.attention.core)
            if "mlp" in modules and layer.mlp is not None:
                layer.mlp = wrap(layer.mlp)
            if "moe" in modules and layer.moe is not None:
                layer.moe = wrap(layer.moe)
            if "layernorm" in modules:
                layer.input_norm = wrap(layer.input_norm)
                layer.mlp_norm = wrap(layer.mlp_norm)
    return wrappers
