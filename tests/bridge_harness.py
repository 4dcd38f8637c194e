"""Megatron-Bridge where it cannot train: what its import and its recipes need that the machine lacks.

Megatron-Bridge imports Transformer Engine, Triton and several training-only packages (W&B, timm,
Energon, ModelOpt, …) unconditionally, and its MoE recipes read the GPU's properties to pick a
dispatcher. None of that matters to what the export checks ask of it (Hydra overrides applied by
``process_config_with_overrides``, then ``runtime_config_update``, which ``pretrain()`` runs before
training and which ends in ``ConfigContainer.validate()``), so, for the checks only:

- without Transformer Engine (this CPU box, Bridge 0.3.1 on megatron-core 0.16.1), megatron-core is
  imported first, whole, so that it takes its no-TE paths and records ``HAVE_TE = False``
  everywhere, and TE's fused MoE permutation kernels, which it checks for when a config turns on
  ``moe_permute_fusion`` (the Qwen3-VL MoE provider does), are present as placeholders, and its
  TE version checks (FP8 recipes) are answered with the newest TE that Bridge 0.3.1 accepts;
- the training-only packages that are absent are then replaced by empty modules whose attributes
  are placeholder classes, for Bridge's own imports;
- without CUDA, ``torch.cuda.get_device_properties`` answers for a GB200 (compute capability 10.0),
  our users' GPU, so the recipe's dispatcher choices are the ones they get;
- the model's checkpoint directory is our small Qwen3-VL MoE proxy (``trainables/bridge/hf_proxy.py``:
  config, tokenizer, image processor; no weights) in a temporary directory: Bridge 0.6's recipes
  name the Hub checkpoint, which an offline Hub cache then holds. (The committed 0.6.2 verdicts
  were made with an earlier config of the same shape written here: vocabulary 1,024, Qwen's token ids.)

Bridge 0.6.2 (megatron-core 0.19.2) needs Python 3.12: its committed check ran on the GPU machine,
without TE on the path (the same stand-ins, TE 2.12 answered) and with the H200's real properties.
The product never imports this module.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pkgutil
import sys
import types
from pathlib import Path
from typing import Any

from packaging.version import Version

from trainables.bridge.hf_proxy import write_qwen3_vl_moe_proxy
from trainables.bridge.recipe import stage_offline_checkpoints

TRAINING_ONLY = ("transformer_engine", "triton", "timm", "wandb", "open_clip", "mamba_ssm", "causal_conv1d", "fla",
                 "nvidia_resiliency_ext", "mlflow", "qwen_vl_utils", "datasets", "peft", "diffusers", "mistral_common",
                 "comet_ml", "flashinfer", "fast_hadamard_transform", "accelerate", "tensorboard", "megatron.energon",
                 "modelopt", "webdataset", "torchvision")
"""Packages Bridge imports that the override parser and ``validate()`` never use: replaced where absent."""
TE_FUSED_PERMUTATION = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                        "fused_sort_chunks_by_index_with_probs", "fused_unpermute")
TE_VERSION_PINNED = Version("2.12.0")
"""The newest Transformer Engine Megatron-Bridge 0.3.1 accepts (``<2.13``): what megatron-core's
version checks (FP8 recipes) are told where TE is absent."""
PROVIDER_SHAPE = ("num_layers", "hidden_size", "num_moe_experts", "moe_router_topk", "vocab_size", "image_token_id")
"""What the verdicts record of the provider Bridge built from the checkpoint directory."""
GB200 = types.SimpleNamespace(name="NVIDIA GB200", major=10, minor=0, total_memory=186 * 2**30,
                              multi_processor_count=152)


class _Placeholder(abc.ABCMeta):
    """A class whose attributes and instances are placeholder classes too (an ``ABCMeta``, so that
    Bridge's classes deriving from one and from ``ABC`` can be defined)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _Placeholder(cls.__name__, (), {})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _MissingPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.names or ".".join(fullname.split(".")[:2]) in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_installed = False
_replaced: list[str] = []


def install() -> None:
    """Make ``import megatron.bridge`` work here (idempotent): the absent training-only packages
    replaced; without Transformer Engine megatron-core imported first; without CUDA a GB200's
    properties."""
    global _installed
    if _installed:
        return
    absent = [name for name in TRAINING_ONLY if importlib.util.find_spec(name) is None]
    import megatron.core  # some of its modules put megatron/core on sys.path, where "datasets" is theirs
    import torch

    if "transformer_engine" in absent:
        for module in pkgutil.walk_packages(megatron.core.__path__, "megatron.core."):
            try:
                importlib.import_module(module.name)
            except Exception:  # noqa: BLE001 — modules that need Triton or Mamba stay unimported, as on a CPU
                continue
        from megatron.core.transformer.moe import moe_utils

        for name in TE_FUSED_PERMUTATION:
            setattr(moe_utils, name, _Placeholder(name, (), {}))
        from megatron.core import utils

        utils.get_te_version = lambda: TE_VERSION_PINNED
    if not torch.cuda.is_available():
        torch.cuda.get_device_properties = lambda *args, **kwargs: GB200
    sys.meta_path.insert(0, _MissingPackages(absent))
    _replaced.extend(absent)
    _installed = True


def qwen3_vl_30b_a3b_recipe(directory: Path) -> Any:
    """Megatron-Bridge's Qwen3-VL-30B-A3B recipe of the installed release, on the small config:
    0.3's pretraining recipe (``hf_path`` given, mock data), 0.6's 8-GPU H100 SFT recipe (which names
    the Hub checkpoint and sets ``cuda_graph_scope = "full"``; read from the offline cache that
    ``HF_HUB_CACHE`` names) without its in-batch sequence packing: the bursts measure unpacked
    samples, so a winner is checked on the workload it was measured on (packing, which refuses
    MBS 1, is a workload choice of its own)."""
    import megatron.bridge

    if megatron.bridge.__version__.startswith("0.3"):
        from megatron.bridge.recipes.qwen_vl.qwen3_vl import qwen3_vl_30b_a3b_pretrain_config

        return qwen3_vl_30b_a3b_pretrain_config(hf_path=str(write_qwen3_vl_moe_proxy(directory / "proxy")), mock=True)
    proxy = write_qwen3_vl_moe_proxy(directory / "proxy")
    stage_offline_checkpoints((("Qwen/Qwen3-VL-30B-A3B-Instruct", str(proxy)),), Path(os.environ["HF_HUB_CACHE"]))
    from megatron.bridge.recipes.qwen_vl.h100.qwen3_vl import qwen3_vl_30b_a3b_sft_8gpu_h100_bf16_config

    recipe = qwen3_vl_30b_a3b_sft_8gpu_h100_bf16_config()
    recipe.dataset.enable_in_batch_packing = False
    return recipe


def validation_error(config: Any, overrides: list[str], world_size: int) -> str | None:
    """Bridge's verdict: ``overrides`` applied to ``config`` (a ``ConfigContainer``, changed in
    place) by Bridge's own override parser, then what its ``pretrain()`` runs before training
    (``runtime_config_update``: the precision preset resolved, the data-parallel size over
    ``world_size`` ranks, ``validate()``)."""
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        process_config_with_overrides(config, cli_overrides=overrides)
        runtime_config_update(config)  # what pretrain() runs first: precision preset, DP size, validate()
        return None
    except Exception as exc:  # noqa: BLE001 — Bridge raises AssertionError, ValueError, OverridesError, …
        return f"{type(exc).__name__}: {exc}"
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved


def _plain(value: Any) -> Any:
    """A field as the override wrote it: enums by name, sequences as lists, a config (the precision
    preset ``runtime_config_update`` resolves to its ``MixedPrecisionConfig``) field by field."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if hasattr(value, "name") and hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _field(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return _plain(config)


def _transformer_engine() -> str:
    """The TE the checks saw: the installed release, or the stand-ins and the version they answer."""
    if "transformer_engine" in _replaced:
        return f"absent: placeholders, megatron-core told {TE_VERSION_PINNED}"
    import transformer_engine

    return transformer_engine.__version__


def main(cases_path: Path, out: Path) -> None:
    """``python tests/bridge_harness.py CASES.json OUT.json``: every case's base then export applied
    to Megatron-Bridge's Qwen3-VL-30B-A3B recipe and validated; the verdicts, and each overridden
    field as the validated config holds it."""
    import copy
    import json
    import tempfile

    cases = json.loads(cases_path.read_text())["cases"]
    with tempfile.TemporaryDirectory() as directory:
        # read by huggingface_hub when it is imported: set before Bridge imports it
        os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(Path(directory) / "hub"))
        install()
        import megatron.bridge

        recipe = qwen3_vl_30b_a3b_recipe(Path(directory))
    results = []
    for case in cases:
        config = copy.deepcopy(recipe)
        overrides = case["base"] + case["export"]
        error = validation_error(config, overrides, case["world_size"])
        fields = {} if error else {o.partition("=")[0]: _field(config, o.partition("=")[0]) for o in overrides}
        results.append({"key": case["key"], "error": error, "fields": fields})
    import torch

    out.write_text(json.dumps({
        "contract": {"megatron_bridge": megatron.bridge.__version__, "megatron_core": megatron.core.__version__,
                     "torch": torch.__version__, "python": sys.version.split()[0],
                     "transformer_engine": _transformer_engine(),
                     "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (harness)",
                     "recipe": f"{type(recipe.model).__name__} from the Qwen3-VL-30B-A3B recipe, small config",
                     "provider": {name: getattr(recipe.model, name) for name in PROVIDER_SHAPE}},
        "recipe_cuda_graph_scope": _plain(recipe.model.cuda_graph_scope), "results": results}, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
