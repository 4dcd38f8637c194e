"""The campaign file: one YAML that says what to tune, on what, within which budget.

Loaded with pydantic; every error names the file, the field and what was expected. Paths inside a
campaign (space, data) are relative to the campaign file; ``output_dir`` is relative to the
directory the command runs in (under ``ray job submit`` that is the job's working directory).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from autotune._paths import BUILTIN_CAMPAIGNS_DIR
from autotune.core.contract import (
    Accelerator, BurstRequest, DataRealism, DataSpec, RankStart, RecipeSpec, StackCapabilities, TrainableSupport,
)
from autotune.core.errors import InputFileError
from autotune.core.knobs import FREEZE_KNOBS_BY_PART, KNOBS, Config
from autotune.core.model import ModelSpec
from autotune.core.steady import MIN_WINDOW
from autotune.resolve import resolve_checkpoint_model, resolve_model, resolve_trainable
from autotune.rules import RuleContext
from autotune.search import SamplerName
from autotune.space import SearchSpace, WarmStart, load_space, resolve_space_path
from autotune.yaml_io import load_file

if TYPE_CHECKING:
    from autotune.memory_model import MemoryModel

Objective = Literal["useful_tokens_per_s_per_gpu", "model_tflops_per_s_per_gpu"]
Launcher = Literal["auto", "local", "ray_train"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    """The model's sizes, for the rules and the memory model: a preset, or a Hugging Face checkpoint
    directory (a ``bridge`` campaign's: the model its recipe builds), with overrides either way."""

    preset: str | None = None
    hf_checkpoint: str | None = None
    """A Qwen-VL MoE checkpoint directory (relative to the campaign file); ``overrides.seq_length``
    then gives the recipe's sequence length."""
    overrides: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        if (self.preset is None) == (self.hf_checkpoint is None):
            raise ValueError("give either preset or hf_checkpoint")
        return self


class BridgeSection(_Strict):
    """The user's Megatron-Bridge training, for ``trainable: bridge``: trials run this recipe with the
    user's overrides and their own (the tuned knobs'), through Bridge's ``pretrain()``."""

    recipe: str
    """``package.module:function`` (e.g. ``megatron.bridge.recipes.qwen_vl.qwen3_vl:qwen3_vl_30b_a3b_sft_config``)
    or ``path/to/file.py:function`` (relative to the campaign file), returning a ``ConfigContainer``."""
    recipe_overrides: list[str] = Field(default_factory=list)
    """The user's fixed Hydra-style overrides, as on their launch line (``dataset.path=…``)."""
    hf_checkpoints: dict[str, str] = Field(default_factory=dict)
    """Hub id → local checkpoint directory (relative to the campaign file): the recipe names a
    checkpoint by hub id, the trial reads this directory offline."""

    @field_validator("recipe")
    @classmethod
    def _module_and_function(cls, value: str) -> str:
        target, _, function = value.rpartition(":")
        if not target or not function.isidentifier():
            raise ValueError("expected 'package.module:function' or 'path/to/file.py:function'")
        return value

    @field_validator("recipe_overrides")
    @classmethod
    def _assignments(cls, value: list[str]) -> list[str]:
        for override in value:
            key, equals, _ = override.partition("=")
            if not equals or not key.strip():
                raise ValueError(f"{override!r} is not a key=value override")
        return value


class DataSection(_Strict):
    source: Literal["builtin_photos", "shards"] = "builtin_photos"
    """``builtin_photos``: shards built from the real photographs shipped in scikit-image and
    scikit-learn; ``shards``: a folder of WebDataset tar shards (``path``)."""
    path: str | None = None
    realism: DataRealism = "real"
    """``mock`` (no images) is for benchmarks only: its results are labelled and can never win."""

    @model_validator(mode="after")
    def _path_matches_source(self) -> "DataSection":
        if self.source == "shards" and not self.path:
            raise ValueError("source 'shards' needs path: the folder holding the .tar shards")
        if self.source == "builtin_photos" and self.path:
            raise ValueError("path is only used with source 'shards'")
        return self


FreezablePart = Literal[tuple(FREEZE_KNOBS_BY_PART)]  # type: ignore[valid-type]


def freezing_warning(part: str) -> str:
    """What a reader of a winner that freezes ``part``, which the workload trains, must be told."""
    return (f"the winner freezes {part}, which the workload trains (tunable_freezing): pasting it changes what "
            "is trained; accept it only if your training may freeze it")


class WorkloadSection(_Strict):
    """What the user's training is, which a tuned setting must not change: its global batch and
    what it freezes. The search tunes how to run it, never what it trains."""

    global_batch_size: int | None = Field(default=None, ge=1)
    """Samples per optimizer step, as the user's recipe fixes it (Megatron-Bridge's Qwen3-VL-30B-A3B
    GB200 recipe: 512). Each replica then accumulates GBS / (MBS × DP) micro-batches per step, and
    a config whose MBS × DP does not divide it is rejected before launch. Unset: one micro-batch
    per replica per step, so a larger MBS is also a larger global batch."""
    frozen: list[FreezablePart] = Field(default_factory=list)
    """The parts the user's training freezes (decoder-centric work freezes the vision stack).
    Every config of the campaign freezes exactly these, unless ``tunable_freezing``."""
    tunable_freezing: bool = False
    """Let the search also try freezing the parts the space tunes freezing of; a winner that freezes
    a part the workload does not is then reported as a choice the user must accept."""

    @field_validator("frozen")
    @classmethod
    def _no_repeats(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("names a part twice")
        return value


class HardwareSection(_Strict):
    accelerator: Accelerator
    gpus_per_node: int = Field(ge=1, description="GPUs per node (CPU worker slots on a CPU box).")
    nodes: int = Field(default=1, ge=1)
    gpus_per_trial: int = Field(ge=1, description="World size of one trial.")
    memory_cap_fraction: float | None = Field(default=None, gt=0, le=1)
    """Cap each trial's GPU memory (``torch.cuda.set_per_process_memory_fraction``)."""
    cpu_memory_cap_gib: float | None = Field(default=None, gt=0)
    """CPU only: memory each rank may add once its model is built (``RLIMIT_AS``), so the OOM
    boundary of a CPU campaign is real: steps that need more fail to allocate."""
    cpu_device_memory_gib: float | None = Field(default=None, gt=0)
    """CPU only: each rank's device memory, counted in tensors (parameters, gradients and AdamW's
    moments, and the activations a micro-batch saves for backward); a step that would hold more is
    ``oom``. Unlike ``cpu_memory_cap_gib`` it does not see the allocator's freed blocks, which creep
    with the heap's history: a config meets the same wall in a screen and in its promotion."""
    launcher: Launcher = "auto"
    """How a trial starts its ranks. ``ray_train``: a ``TorchTrainer`` worker group (any number of
    nodes); ``local``: processes the trial spawns on its own node (one node; no per-trial worker
    group to start, which costs more than a whole CPU trial: the README's launcher paragraph). ``auto``: ``local`` on the CPU,
    ``ray_train`` on GPUs."""
    data_workers: int = Field(default=1, ge=0, description="DataLoader worker processes per rank.")

    @model_validator(mode="after")
    def _trial_fits(self) -> "HardwareSection":
        total = self.gpus_per_node * self.nodes
        if self.gpus_per_trial > total:
            raise ValueError(f"gpus_per_trial ({self.gpus_per_trial}) exceeds the cluster's {total} GPUs")
        for name in ("cpu_memory_cap_gib", "cpu_device_memory_gib"):
            if getattr(self, name) is not None and self.accelerator != "cpu":
                raise ValueError(f"{name} applies to accelerator 'cpu'; on GPUs use memory_cap_fraction")
        if self.launcher == "local" and self.gpus_per_trial > self.gpus_per_node:
            raise ValueError("launcher 'local' runs a trial on one node, but gpus_per_trial exceeds gpus_per_node")
        return self

    @property
    def cpu_device_memory_bytes(self) -> int | None:
        return None if self.cpu_device_memory_gib is None else int(self.cpu_device_memory_gib * GIB)

    @property
    def resolved_launcher(self) -> Literal["local", "ray_train"]:
        if self.launcher != "auto":
            return self.launcher
        return "local" if self.accelerator == "cpu" else "ray_train"


class StackSection(_Strict):
    """Assumed software stack; the capability probe replaces it with what is really installed."""

    megatron_core: str | None = None
    transformer_engine: str | None = None
    deep_ep: bool = False
    hybrid_ep: bool = False
    imex_channel: bool = False


class BudgetSection(_Strict):
    max_trials: int = Field(ge=1)
    patience: int | None = Field(default=None, ge=1)
    """Screening ends once this many screens in a row found nothing faster than the best so far
    (configs rejected before launch cost nothing and do not count). Only the sampler's proposals
    count: warm starts run whatever the search finds, and the memory-frontier walk ends by its own
    rule."""
    gpu_hours: float | None = Field(default=None, gt=0)
    deadline: datetime | None = None
    """ISO 8601 with a time zone, e.g. ``2026-12-02T06:00:00Z``."""

    @field_validator("deadline")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("deadline needs a time zone, e.g. 2026-12-02T06:00:00Z")
        return value


class StagesSection(_Strict):
    warmup_steps: int = Field(default=3, ge=1)
    screen_steps: int = Field(default=12, ge=2, description="Steps of a screening burst, warm-up included.")
    promote_top_k: int = Field(default=3, ge=1)
    promote_steps: int = Field(default=50, ge=50, description="The winner runs at least 50 steps.")
    promote_repeats: int = Field(default=1, ge=1, le=10)
    """Fresh-process runs of each promoted config, round by round. From two on, the verdict and the
    gains are bounded by how far a run's mean moves between processes (pooled over the configs),
    which one run's interval does not show: on a host-bound loop it is the larger part
    (bench/results/h200_bridge_campaign/paste_back_ab.json)."""
    target_relative_half_width: float = Field(default=0.02, gt=0, lt=1)
    """A screening burst stops once its steady interval is this tight (relative half-width)."""
    prune_margin: float = Field(default=0.02, ge=0, lt=1)
    """A trial is pruned once its interval's upper bound is this far below the best's lower bound."""
    promote_early: bool = False
    """Promote the space's best screen while screening goes on, once a later screen has failed to
    beat it and if it beats every config promoted so far by more than ``prune_margin`` (bring-up
    waits for the promotion stage, as its baseline), instead of once screening has ended: a good
    config reaches the user sooner, and a better one found later costs one more promotion
    (:func:`autotune.engine.promotion.early_promotion`; the search benchmark measures the trade)."""
    hang_timeout_s: float = Field(default=1800, gt=0)
    """A running trial with no step for this long (its first step's start-up included), a
    collective stuck on a lost peer say, is killed, recorded ``hung`` and its slots freed."""

    @model_validator(mode="after")
    def _steady_window(self) -> "StagesSection":
        if self.screen_steps < self.warmup_steps + MIN_WINDOW:
            raise ValueError(
                f"screen_steps ({self.screen_steps}) must exceed warmup_steps ({self.warmup_steps}) "
                f"by at least {MIN_WINDOW} to leave a steady window"
            )
        return self


class SearchSection(_Strict):
    sampler: SamplerName = "tpe"
    """``tpe``: multivariate TPE with constant liar and constraints; ``random``."""
    seed: int = 0
    startup_trials: int = Field(default=4, ge=0, description="Trials before TPE models the space.")
    warm_start_from: list[str] = Field(default_factory=list)
    """Earlier run directories: their best finished configs are re-measured first, and the
    configs that ran out of memory there are avoided here."""
    memory_model: bool = True
    """Reject before launch the configs the memory model, calibrated on this campaign's peaks,
    predicts over the memory limit: the GPU's cap, or the CPU's counted device memory
    (autotune/memory_model.py)."""
    memory_frontier: bool = True
    """Before the sampler, walk the incumbent's memory frontier: the largest micro-batch that fits
    with the most memory saved, then the recompute it no longer needs (autotune/search/frontier.py)."""


class WorkflowSection(_Strict):
    """The seed's workflow: tune the campaign's space first (FSDP-first), then ``then_space`` (3D)
    only if the projected headroom - what ``then_space`` declares it can reach, over the first
    space's promoted best, in model TFLOP/s per GPU - exceeds ``min_headroom``."""

    then_space: str
    min_headroom: float = Field(default=0.10, ge=0)


class CampaignFile(_Strict):
    name: str = Field(min_length=1)
    trainable: str
    space: str
    model: ModelSection
    bridge: BridgeSection | None = None
    """Required with ``trainable: bridge``, and only then."""
    data: DataSection = Field(default_factory=DataSection)
    workload: WorkloadSection = Field(default_factory=WorkloadSection)
    hardware: HardwareSection
    stack: StackSection = Field(default_factory=StackSection)
    budget: BudgetSection
    stages: StagesSection = Field(default_factory=StagesSection)
    search: SearchSection = Field(default_factory=SearchSection)
    workflow: WorkflowSection | None = None
    objective: Objective = "useful_tokens_per_s_per_gpu"
    output_dir: str

    @model_validator(mode="after")
    def _bridge_recipe_with_bridge(self) -> "CampaignFile":
        if (self.trainable == "bridge") != (self.bridge is not None):
            raise ValueError("trainable 'bridge' needs a bridge section (its recipe), and only it takes one")
        if self.bridge is not None and self.data.source != "shards":
            raise ValueError("trainable 'bridge' reads an Energon dataset: data: {source: shards, path: DIR} "
                             "(autotune data build --energon DIR writes one from the built-in photos)")
        return self


GIB = 2**30


@dataclass(frozen=True)
class Campaign:
    """A loaded campaign: the file's settings with the space, model and rule context resolved."""

    path: Path
    spec: CampaignFile
    space: SearchSpace
    model: ModelSpec
    stack: StackCapabilities
    trainable: TrainableSupport
    next_space: SearchSpace | None = None
    """The workflow's second space, when the campaign has one."""
    replay_table: Path | None = None
    """Replay this recorded table instead of training (the search benchmark sets it): trials run
    the replay trainable on no device, charged the recorded device-seconds."""
    replay_start: RankStart = "warm"
    """Which recorded start-up a replay charges (``BurstRequest.replay_start``)."""

    @property
    def spaces(self) -> tuple[SearchSpace, ...]:
        return (self.space,) if self.next_space is None else (self.space, self.next_space)

    @property
    def tuned_knobs(self) -> list[str]:
        """The knobs any of its spaces tunes, in registry order: what its exports write by default."""
        return [name for name in KNOBS if any(name in space.tuned for space in self.spaces)]

    @property
    def rule_context(self) -> RuleContext:
        return RuleContext(
            model=self.model,
            world_size=self.spec.hardware.gpus_per_trial,
            stack=self.stack,
            trainable=self.trainable,
            global_batch_size=self.spec.workload.global_batch_size,
            gpus_per_node=self.spec.hardware.gpus_per_node,
        )

    @property
    def output_dir(self) -> Path:
        return Path(self.spec.output_dir)

    @property
    def trials_at_once(self) -> int:
        """How many trials the campaign's cluster runs side by side."""
        hardware = self.spec.hardware
        return hardware.gpus_per_node * hardware.nodes // hardware.gpus_per_trial

    @property
    def recipe(self) -> RecipeSpec | None:
        """The ``bridge`` trainable's recipe, its paths resolved from the campaign file's folder, with
        the knobs the campaign tunes (the only ones its trials override)."""
        bridge = self.spec.bridge
        if bridge is None:
            return None
        return RecipeSpec(
            recipe=_recipe_reference(bridge.recipe, self.path.parent), overrides=tuple(bridge.recipe_overrides),
            tuned=tuple(self.tuned_knobs),
            hf_checkpoints=tuple((hub_id, str((self.path.parent / folder).resolve()))
                                 for hub_id, folder in bridge.hf_checkpoints.items()))

    def spec_with_absolute_paths(self) -> dict[str, Any]:
        """The campaign file's content with every path in it (data, checkpoint directories, a recipe
        file, earlier runs to warm-start from) made absolute, so a copy of it loads from anywhere (a
        run directory's ``campaign.yaml``, which resume, report and export read)."""
        base = self.path.parent
        spec = self.spec.model_dump(mode="json", exclude_defaults=False)
        if spec["data"]["path"] is not None:
            spec["data"]["path"] = str((base / spec["data"]["path"]).resolve())
        if spec["model"]["hf_checkpoint"] is not None:
            spec["model"]["hf_checkpoint"] = str((base / spec["model"]["hf_checkpoint"]).resolve())
        if spec["bridge"] is not None:
            spec["bridge"]["recipe"] = _recipe_reference(spec["bridge"]["recipe"], base)
            spec["bridge"]["hf_checkpoints"] = {hub_id: str((base / folder).resolve())
                                                for hub_id, folder in spec["bridge"]["hf_checkpoints"].items()}
        spec["search"]["warm_start_from"] = [str(Path(earlier).resolve())
                                             for earlier in spec["search"]["warm_start_from"]]
        return spec

    def frozen_beyond_workload(self, config: Config) -> list[str]:
        """The parts ``config`` freezes that the user's training trains (only a campaign with
        ``tunable_freezing`` has such configs): pasting a winner that freezes any of them changes
        what is trained."""
        workload = self.spec.workload
        return [part for part, knob in FREEZE_KNOBS_BY_PART.items() if config[knob] and part not in workload.frozen]

    def memory_model(self, limit_bytes: float | None) -> MemoryModel:
        """The memory model of this campaign's trials (its model, trial size, global batch and the
        trainable's bytes per parameter and activation on its accelerator), empty of peaks."""
        from autotune.memory_model import MemoryModel

        return MemoryModel(self.model, self.spec.hardware.gpus_per_trial, limit_bytes,
                           self.spec.workload.global_batch_size, self.trainable.bytes_on(self.stack.accelerator))

    def burst_request(self, config: Config, steps: int) -> BurstRequest:
        """A burst of ``config`` as this campaign runs it: its model, data, trial size and caps
        (built-in photos are built on first use; a replay reads no data)."""
        from autotune.bursts import data_folder

        spec, hardware = self.spec, self.spec.hardware
        folder = Path(spec.data.path or ".") if self.replay_table is not None else \
            data_folder(spec.data.source, spec.data.path, self.path.parent)
        return BurstRequest(
            config=config,
            model=self.model,
            data=DataSpec(str(folder.resolve()), spec.data.realism),
            steps=steps,
            world_size=hardware.gpus_per_trial,
            seed=spec.search.seed,
            data_workers=hardware.data_workers,
            memory_cap_fraction=hardware.memory_cap_fraction,
            cpu_memory_cap_bytes=None if hardware.cpu_memory_cap_gib is None else int(hardware.cpu_memory_cap_gib * GIB),
            cpu_device_memory_bytes=hardware.cpu_device_memory_bytes,
            replay_table=None if self.replay_table is None else str(self.replay_table),
            replay_start=self.replay_start,
            global_batch_size=spec.workload.global_batch_size,
            recipe=self.recipe,
        )


def _recipe_reference(reference: str, base: Path) -> str:
    """A file recipe's path made absolute (trials run elsewhere); a module reference as written."""
    target, _, function = reference.rpartition(":")
    return f"{(base / target).resolve()}:{function}" if target.endswith(".py") else reference


def _check_bridge_paths(path: Path, spec: CampaignFile) -> None:
    bridge = spec.bridge
    assert bridge is not None and spec.data.path is not None
    if not (path.parent / spec.data.path / ".nv-meta" / "dataset.yaml").is_file():
        raise InputFileError(path, "data.path", f"{path.parent / spec.data.path} is not an Energon dataset (no "
                             ".nv-meta/dataset.yaml); autotune data build --energon DIR writes one")
    target = bridge.recipe.rpartition(":")[0]
    if target.endswith(".py") and not (path.parent / target).is_file():
        raise InputFileError(path, "bridge.recipe", f"no recipe file at {path.parent / target}")
    for hub_id, folder in bridge.hf_checkpoints.items():
        if not (path.parent / folder / "config.json").is_file():
            raise InputFileError(path, f"bridge.hf_checkpoints.{hub_id}",
                                 f"{path.parent / folder} is not a checkpoint directory (no config.json)")


def builtin_campaign_path(name: str) -> Path:
    return BUILTIN_CAMPAIGNS_DIR / f"{name}.yaml"


def load_campaign(path: Path, workload: WorkloadSection | None = None, check_inputs: bool = True) -> Campaign:
    """Load a campaign file and everything it names; errors name the file and the field.
    ``workload`` replaces the file's (a replay runs the workload its table was recorded with).
    ``check_inputs=False`` reads a finished run's campaign where its trials' inputs (a ``bridge``
    campaign's recipe file, checkpoints and Energon data) are not: a report or an export needs none."""
    spec = load_file(path, CampaignFile)
    if workload is not None:
        spec = spec.model_copy(update={"workload": workload})
    trainable = resolve_trainable(path, "trainable", spec.trainable)
    if spec.bridge is not None and check_inputs:
        _check_bridge_paths(path, spec)
    if spec.model.preset is not None:
        model = resolve_model(path, "model.preset", spec.model.preset, "model.overrides", spec.model.overrides)
    else:
        model = resolve_checkpoint_model(path, "model.hf_checkpoint", spec.model.hf_checkpoint, "model.overrides",
                                         spec.model.overrides)
    space_path = resolve_space_path(spec.space, path.parent)
    if not space_path.is_file():
        raise InputFileError(path, "space", f"no space file at {space_path}")
    space = load_space(space_path)
    next_space = None
    if spec.workflow is not None:
        next_path = resolve_space_path(spec.workflow.then_space, path.parent)
        if not next_path.is_file():
            raise InputFileError(path, "workflow.then_space", f"no space file at {next_path}")
        next_space = load_space(next_path)
        if next_space.reachable is None:
            raise InputFileError(path, "workflow.then_space", f"{next_path} declares no `reachable` throughput "
                                 "to project the headroom from")
        if next_space.name == space.name:
            raise InputFileError(path, "workflow.then_space", "is the campaign's own space")
    space = _as_workload_freezes(space, spec.workload, path)
    if next_space is not None:
        next_space = _as_workload_freezes(next_space, spec.workload, path)
    stack = StackCapabilities(accelerator=spec.hardware.accelerator, **spec.stack.model_dump())
    return Campaign(path=path, spec=spec, space=space, model=model, stack=stack, trainable=trainable,
                    next_space=next_space)


def _as_workload_freezes(space: SearchSpace, workload: WorkloadSection, path: Path) -> SearchSpace:
    """``space`` with each freezing knob fixed to whether the workload freezes that part (warm
    starts included), so no config trains less than the user's training does, or more. With
    ``tunable_freezing`` the space's freezing choices stay, except that declared parts stay frozen."""
    tuned, fixed = dict(space.tuned), dict(space.fixed)
    for part, knob in FREEZE_KNOBS_BY_PART.items():
        frozen = part in workload.frozen
        if workload.tunable_freezing and not frozen:
            continue
        if fixed.get(knob, frozen) != frozen:
            raise InputFileError(path, "workload.frozen",
                                 f"the space {space.name} fixes {knob}: {fixed[knob]}, but the workload "
                                 f"{'freezes' if frozen else 'trains'} {part}: say what the training does here "
                                 "(or set workload.tunable_freezing to let the search try it)")
        tuned.pop(knob, None)
        fixed[knob] = frozen
    warm_starts: dict[Config, WarmStart] = {}
    for start in space.warm_starts:
        config = start.config.replace(**{knob: fixed[knob] for knob in FREEZE_KNOBS_BY_PART.values() if knob in fixed})
        warm_starts.setdefault(config, dataclasses.replace(start, config=config))
    return dataclasses.replace(space, tuned=tuned, fixed=fixed, warm_starts=tuple(warm_starts.values()))
