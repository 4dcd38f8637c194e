"""The user's Megatron-Bridge recipe as a ``bridge`` trial runs it: loaded, overridden with the
trial's knob values through Bridge's own override parser, and validated by Bridge before anything
touches a GPU (a rejection is the trial's ``invalid`` outcome, with Bridge's message).

The knob overrides are the ones ``autotune export`` writes (:mod:`autotune.core.tool_flags`) for the
knobs the campaign tunes, so the winner's export is exactly what its trial ran; the recipe keeps
every other setting. Companions only a trial can know: an Energon dataset carries its own
micro-batch size, which Bridge requires equal to the training's (and in Bridge 0.3 its own global
batch), and pads to the longest sequence of each batch unless told to pad to the recipe's length,
which CUDA graphs need (their replay copies into static shapes: "The size of tensor a (1024) must
match the size of tensor b (512)", measured on the H200 with Bridge 0.6.2); and the workload's global
batch.
The burst's own settings (its length, no evaluation, no checkpoint) are never exported.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from autotune.core.contract import BurstRequest, InvalidConfig, RecipeSpec
from autotune.core.tool_flags import ExportRefused, bridge_overrides

OFFLINE_REVISION = "0" * 40
"""The commit a staged checkpoint is filed under in the offline hub cache (any 40 hex digits do)."""


def set_burst_length(recipe: Any, steps: int) -> None:
    """What makes the user's training a burst: ``steps`` iterations, no evaluation, no checkpoint.
    Set on the fields, not by override: Bridge 0.3 keeps its evaluation settings in ``train``, 0.6
    in ``validation``."""
    recipe.train.train_iters = steps
    getattr(recipe, "validation", recipe.train).eval_iters = 0
    recipe.checkpoint.save = None


def load_recipe_function(reference: str) -> Callable[[], Any]:
    """The recipe function ``reference`` names: ``package.module:function`` (importable), or
    ``path/to/file.py:function`` (a file of the user's)."""
    target, _, name = reference.rpartition(":")
    if not target or not name:
        raise ValueError(f"recipe {reference!r} is not 'package.module:function' or 'path/to/file.py:function'")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"autotune_recipe_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"recipe {reference!r}: {target} has no function {name!r}")
    return function


def stage_offline_checkpoints(checkpoints: tuple[tuple[str, str], ...], cache: Path) -> None:
    """A Hugging Face hub cache at ``cache`` in which each hub id resolves to its local directory, so
    a recipe that names ``Qwen/…`` reads the user's directory with ``HF_HUB_OFFLINE=1``, as on a
    cluster without internet (and without a copy: the snapshot is a link)."""
    for repo_id, directory in checkpoints:
        source = Path(directory).resolve()
        if not (source / "config.json").is_file():
            raise FileNotFoundError(f"checkpoint directory {source} (for {repo_id}) has no config.json")
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / OFFLINE_REVISION
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        if snapshot.is_symlink() or snapshot.exists():
            snapshot.unlink()
        snapshot.symlink_to(source, target_is_directory=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(OFFLINE_REVISION)


def go_offline(spec: RecipeSpec, cache: Path) -> None:
    """Stage the recipe's checkpoints and point Hugging Face at them, offline. Call before anything
    imports ``huggingface_hub``, which reads these variables once, at import. A campaign that names
    no local checkpoint changes nothing (its recipe reads the Hub as the user's launch does)."""
    if not spec.hf_checkpoints:
        return
    if "huggingface_hub" in sys.modules:
        raise RuntimeError("huggingface_hub was imported before the offline checkpoints were staged: it would "
                           "not read HF_HUB_OFFLINE and HF_HUB_CACHE")
    stage_offline_checkpoints(spec.hf_checkpoints, cache)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_CACHE=str(cache),
                      HF_HOME=str(cache.parent))


def knob_overrides(request: BurstRequest, recipe: Any, megatron_core_version: str | None) -> list[str]:
    """The trial's overrides of the recipe: the tuned knobs as ``autotune export`` writes them, with
    the companions this recipe needs (module docstring)."""
    spec = request.recipe
    assert spec is not None
    try:
        overrides = bridge_overrides(request.config, megatron_core_version, spec.tuned)
    except ExportRefused as exc:
        raise InvalidConfig(str(exc)) from None
    if request.config.cuda_graph_impl != "none" and hasattr(recipe.dataset, "pad_to_max_length"):
        # CUDA graphs replay static shapes: sequences of the recipe's length, not the batch's longest.
        overrides.append("dataset.pad_to_max_length=true")
    if "micro_batch_size" in spec.tuned and hasattr(recipe.dataset, "micro_batch_size"):
        overrides.append(f"dataset.micro_batch_size={request.config.micro_batch_size}")
    if request.global_batch_size is not None:
        overrides.append(f"train.global_batch_size={request.global_batch_size}")
        if hasattr(recipe.dataset, "global_batch_size"):  # Bridge 0.3's Energon provider keeps its own
            overrides.append(f"dataset.global_batch_size={request.global_batch_size}")
    return overrides


class RecipeRefused(Exception):
    """The user's recipe with the user's own overrides does not validate: no trial can run, which is
    the campaign's error (the burst ends ``failed`` with it), not a config's."""


def prepare(request: BurstRequest, megatron_core_version: str | None) -> tuple[Any, list[str]]:
    """The recipe's ``ConfigContainer`` on the campaign's Energon dataset with the user's overrides and
    the trial's, as a burst, and
    the trial's overrides alone. Validated as ``pretrain()`` validates it (``runtime_config_update``
    on a copy: precision preset, data-parallel size, ``validate()``) before any GPU work: first as
    the user's launch (:class:`RecipeRefused`), then with the trial's knobs (:class:`InvalidConfig`,
    with Bridge's message)."""
    spec = request.recipe
    if spec is None:
        raise RecipeRefused("the bridge trainable needs the campaign's bridge.recipe")
    recipe = load_recipe_function(spec.recipe)()
    set_burst_length(recipe, request.steps)
    if not hasattr(recipe.dataset, "path"):
        raise RecipeRefused(f"the recipe {spec.recipe} reads its data from a {type(recipe.dataset).__name__}, which "
                            "takes no dataset.path: a bridge campaign trains on its Energon dataset (data.path), so "
                            "its recipe's dataset is an Energon one (EnergonDatasetConfig)")
    try:
        _override_and_validate(recipe, [f"dataset.path={request.data.folder}", *spec.overrides])
    except Exception as exc:  # noqa: BLE001 — Bridge raises AssertionError, ValueError, OverridesError, …
        raise RecipeRefused(f"Megatron-Bridge refuses the recipe {spec.recipe} with the campaign's "
                            f"bridge.recipe_overrides: {_reason(exc)}") from None
    trial = knob_overrides(request, recipe, megatron_core_version)
    try:
        _override_and_validate(recipe, trial)
    except Exception as exc:  # noqa: BLE001 — as above
        raise InvalidConfig(f"Megatron-Bridge refuses it: {_reason(exc)}") from None
    return recipe, trial


def _reason(exc: BaseException) -> str:
    """Bridge's message; for a bare ``assert`` (no message), the check that failed, from its source line."""
    message = str(exc).strip()
    if message:
        return f"{type(exc).__name__}: {message}"
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__} at {Path(frame.filename).name}:{frame.lineno}: {frame.line}"


def _override_and_validate(recipe: Any, overrides: list[str]) -> None:
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    process_config_with_overrides(recipe, cli_overrides=overrides)
    runtime_config_update(copy.deepcopy(recipe))
