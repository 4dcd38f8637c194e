"""What the tuner and the trainables agree on: the stack a trial runs on, what a trainable honours,
one burst's request, its per-step records, how it ended, and the measurement contract that travels
with every figure.

A burst takes a :class:`BurstRequest` and reports a :class:`StepReport` after every step; it ends
with a :class:`BurstResult` whose outcome is ``ok``, ``oom``, ``invalid`` (only when the trainable
raised :class:`InvalidConfig` before step 1), ``pruned`` (told to stop) or ``failed`` (anything
else, with its traceback). The tuner never imports Megatron and trainables never import Optuna or
Ray Tune: both import this module, which imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict

from autotune.core.knobs import KNOBS, Config, ConfigField, Value, get_knob, global_batch_misfit, micro_batches_per_step
from autotune.core.model import ModelSpec

Accelerator = Literal["cpu", "h100", "h200", "b200", "gb200"]


class StackCapabilities(BaseModel):
    """The software and hardware a trial runs on; a campaign states assumptions, the probe measures.

    Versions are strings as the packages report them; ``None`` means "not installed".
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    accelerator: Accelerator
    megatron_core: str | None = None
    transformer_engine: str | None = None
    deep_ep: bool = False
    hybrid_ep: bool = False
    imex_channel: bool = False
    """Every GPU node's processes hold an IMEX channel: on GB200, what lets a GPU reach another
    tray's memory over NVLink (MNNVL), and HybridEP span the trays of a rack."""

    @property
    def has_cuda(self) -> bool:
        return self.accelerator != "cpu"


RankStart = Literal["warm", "cold"]
"""How a burst's ranks started: forked from a zygote already running, or one started for them."""
RanksStarted = Literal["in_process", "cold", "warm", "kept"]
"""How a burst's ranks did start (:attr:`Contract.rank_start`)."""


@dataclass(frozen=True, slots=True)
class TrainingBytes:
    """Bytes a trainable keeps per parameter and per activation element: the memory model's units."""

    frozen_parameter: int
    """A parameter it does not train (its weight only)."""
    trained_parameter: int
    """A parameter it trains: weight, gradient, optimizer states (and a main copy where kept)."""
    activation: int
    """An activation element saved for backward."""


MEGATRON_BF16 = TrainingBytes(frozen_parameter=2, trained_parameter=18, activation=2)
"""megatron-core's bf16 training: a bf16 weight, an fp32 gradient, an fp32 main weight and two fp32
Adam moments per trained parameter (without the distributed optimizer), bf16 activations."""
FP32 = TrainingBytes(frozen_parameter=4, trained_parameter=16, activation=4)
"""Plain fp32 training with AdamW: weight, gradient and two moments, fp32 activations."""


@dataclass(frozen=True, slots=True)
class TrainableSupport:
    """The knob values a trainable honours for real; the rules engine rejects the rest before launch.

    ``allowed`` maps a knob to the values it accepts (for set-valued knobs: the elements, with
    ``()`` standing for the empty set). Knobs not listed are honoured in full. A trainable never
    silently ignores a knob.
    """

    name: str
    requires_cuda: bool = False
    allowed: Mapping[str, frozenset[Value]] = field(default_factory=dict)
    cuda_only: Mapping[str, frozenset[Value]] = field(default_factory=dict)
    """Values honoured only on a CUDA device (e.g. graphs), checked against the stack."""
    moe_layer_graph_scopes: frozenset[str] = frozenset({"moe", "moe_router", "moe_preprocess"})
    """``cuda_graph_scope`` elements whose local CUDA graphs capture part of a MoE layer; the
    other elements graph dense layers only. The default is megatron-core's: a MoE layer's local
    graphs hold its router with the preprocessing, or the whole MoE block, never its attention."""
    megatron_core_layers: bool = False
    """Its layers are megatron-core's, built from Transformer Engine layer specs where TE imports
    and from megatron-core's local specs otherwise, so megatron-core's own limits apply: its local
    attention has no context parallelism, its torch norms no sequence parallelism, and the stack's
    megatron-core version bugs are its bugs."""
    own_process: bool = False
    """Its ranks never run in the caller's process (they need ``torch.distributed`` up, or set
    process-global state the caller must not inherit)."""
    kept_ranks: bool = True
    """A campaign may run its next burst in the rank processes of one that ended healthy: its
    burst releases every process-global it sets (megatron-core's parallel groups and CUDA-graph
    records) and seeds every generator it draws from."""
    training_bytes: TrainingBytes = MEGATRON_BF16
    """What it keeps per parameter and activation on CUDA (the memory model counts in these)."""
    cpu_training_bytes: TrainingBytes | None = None
    """The same on the CPU, where it trains in another precision."""
    rank_imports: tuple[str, ...] = ()
    """The stack its ranks import before they build anything (megatron-core, TE, Bridge), where
    installed: a warm rank zygote imports them once, so a burst forked from it does not."""

    def bytes_on(self, accelerator: str) -> TrainingBytes:
        return (self.cpu_training_bytes or self.training_bytes) if accelerator == "cpu" else self.training_bytes

    def __post_init__(self) -> None:
        for name in (*self.allowed, *self.cuda_only):
            get_knob(name)

    def unsupported(self, knob: str, value: Value, stack: StackCapabilities) -> str | None:
        """Why ``value`` of ``knob`` cannot run here, or ``None`` if it can."""
        if value is None:
            return None
        # Set-valued knobs are checked element by element; the empty set (a whole-layer graph
        # scope) is checked as the element ``()``.
        items = (value or ((),)) if isinstance(value, tuple) else (value,)
        if knob in self.allowed:
            bad = [item for item in items if item not in self.allowed[knob]]
            if bad:
                accepted = ", ".join(sorted(KNOBS[knob].format(v) for v in self.allowed[knob]))
                return (
                    f"the {self.name} trainable cannot honour {knob}="
                    f"{KNOBS[knob].format(value)} (it honours {accepted})"
                )
        if knob in self.cuda_only and not stack.has_cuda:
            bad = [item for item in items if item in self.cuda_only[knob]]
            if bad:
                return f"{knob}={KNOBS[knob].format(value)} needs a CUDA device; this stack is {stack.accelerator}"
        return None


# -- the burst: what a trial runs and what it reports ----------------------------------------------

Outcome = Literal["ok", "oom", "invalid", "pruned", "failed", "hung"]
"""How a burst ended: ``ok``; ``oom`` (out of memory, memory released); ``invalid`` (the trainable
raised :class:`InvalidConfig`: the stack rejected the config before step 1); ``pruned`` (told to
stop); ``failed`` (anything else); ``hung`` (no step for the campaign's ``stages.hang_timeout_s``:
killed by the campaign's watchdog)."""

FAILED_OUTCOMES = frozenset({"oom", "invalid", "failed", "hung"})
"""Outcomes of a launched burst that measured no throughput: infeasible to the study, waste to the
search benchmark."""


class InvalidConfig(Exception):
    """The stack refuses this config (megatron-core's own checks, a combination the trainable
    cannot build): raised before step 1, the burst ends ``invalid`` and the study never retries it.
    Anything else a trainable raises ends ``failed`` with its traceback, so a bug is never taken
    for an infeasible config."""


DataRealism = Literal["real", "mock"]


@dataclass(frozen=True, slots=True)
class DataSpec:
    folder: str
    """A folder of WebDataset tar shards."""
    realism: DataRealism = "real"
    """``mock`` drops every image: benchmark-only, never a throughput result."""


@dataclass(frozen=True, slots=True)
class RecipeSpec:
    """The user's Megatron-Bridge training, which a ``bridge`` trial runs as they launch it: their
    recipe, their fixed overrides, and where the checkpoints it names live on this machine."""

    recipe: str
    """``package.module:function`` or ``path/to/file.py:function``, returning a ``ConfigContainer``."""
    overrides: tuple[str, ...] = ()
    """The user's own Hydra-style overrides (``dataset.path=…``), applied before the trial's."""
    tuned: tuple[str, ...] = ()
    """The knobs the campaign tunes: the only ones a trial overrides; the recipe keeps the rest."""
    hf_checkpoints: tuple[tuple[str, str], ...] = ()
    """``(hub id, local directory)``: the recipe names a checkpoint by hub id and it is read from the
    directory, offline (a Hugging Face cache is laid out for it)."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One training step, summed over the trial's ranks (times: the slowest rank)."""

    step: int
    step_seconds: float
    data_wait_seconds: float
    vision_seconds: float
    projector_seconds: float
    decoder_seconds: float
    useful_tokens: int
    """Loss-bearing text tokens plus image tokens entering the decoder; never padding."""
    image_tokens: int
    loss_tokens: int
    samples: int
    model_flops: float
    peak_memory_bytes: int
    loss: float
    skipped_samples: int = 0
    sm_clock_mhz: float | None = None
    """The GPU's SM clock at the step's end, the lowest of the ranks'; ``None`` on the CPU or where
    NVML cannot read it."""
    clock_held_by: tuple[str, ...] = ()
    """What held a rank's SM clock down at the step's end (NVML's power, thermal and slowdown
    reasons, by NVML's names; any rank's)."""

    @property
    def tokens_per_second(self) -> float:
        return self.useful_tokens / self.step_seconds if self.step_seconds > 0 else 0.0


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Evidence(BaseModel):
    """What a run observed of its knobs (recompute active, frozen parameters without gradients, EP
    group size…), so promotion can check that the knobs took effect. What is observed differs by
    trainable (the extra fields); ``checks`` maps each knob the trainable verified to whether the
    observation matched the config."""

    model_config = ConfigDict(frozen=True, extra="allow")

    checks: dict[str, bool] = {}

    def failed_checks(self) -> list[str]:
        return sorted(knob for knob, ok in self.checks.items() if not ok)

    def is_empty(self) -> bool:
        """Nothing observed (a burst that ended before its first step, or a replay)."""
        return not self.checks and not self.model_extra


class Hardware(_Record):
    device: str
    accelerator: str
    """``cuda`` or ``cpu`` (what the trainable ran on; the campaign's label is in the probe)."""
    world_size: int
    cpu_threads_per_rank: int | None = None
    counted_memory_bytes: int | None = None
    """A CPU burst's counted device memory per rank (``BurstRequest.cpu_device_memory_bytes``):
    where set, its peaks count tensors (``trainables/native/device_memory.py``), not the resident set."""


class DataProvenance(_Record):
    folder: str
    realism: DataRealism
    tokenizer: str


class Shapes(_Record):
    """The workload's shape as run: runs compare only at the same shape."""

    micro_batch_size: int
    seq_length: int
    data_parallel: int
    global_batch_size: int
    expert_parallel: int
    num_microbatches: int | None = None
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    context_parallel: int | None = None
    expert_tensor_parallel: int | None = None


class SteadyWindow(_Record):
    first_step: int
    steps: int


class WorkerPlacement(_Record):
    """Where one rank ran: its Ray node, that node's NVLink domain label, and the accelerator Ray
    gave it (``None`` on the CPU). Long runs of one config differed 13–47 % between H100s
    (``bench/results/fidelity_h100_te_grid.json``): runs compare fairly only where they ran alike."""

    node_id: str
    nvlink_domain: str | None
    accelerator_id: str | None = None


class Contract(_Record):
    """The measurement contract: versions, hardware, model, data realism, precision, shapes, timing
    method and FLOPs convention of a measured burst; the steady window and where each rank ran are
    added on the way to the trial's record. A replayed burst (``trainable: replay``) measured
    nothing here: it carries the recorded burst's contract as the table holds it (``recorded``).

    Serialised with ``exclude_unset``, so a contract reads back exactly as written."""

    trainable: str
    versions: dict[str, str | None] | None = None
    hardware: Hardware | None = None
    model: dict[str, Any] | None = None
    """The model preset as run (``ModelSpec`` fields)."""
    layer_spec: str | None = None
    """megatron-core's layer specs: ``transformer_engine`` or ``local``."""
    kernels: dict[str, bool] | None = None
    """Fused kernels the trainable chose and no knob owns (megatron-core's fusion fields)."""
    data: DataProvenance | None = None
    precision: str | None = None
    shapes: Shapes | None = None
    timing: str | None = None
    flops_convention: str | None = None
    config: ConfigField | None = None
    replayed_from: str | None = None
    """A replay's recorded table."""
    recorded: dict[str, Any] | None = None
    """A replay's recorded contract, as the table holds it."""
    workers: tuple[WorkerPlacement, ...] | None = None
    """Where each rank ran, rank by rank."""
    recipe: str | None = None
    """The Megatron-Bridge recipe a ``bridge`` burst ran."""
    recipe_overrides: tuple[str, ...] | None = None
    """Every override the ``bridge`` burst applied to the recipe, the user's first: its config is
    the recipe with exactly these."""
    environment: dict[str, str] | None = None
    """What the ranks' environment was given from the fabric under them (CUDA connections, HybridEP's
    ranks per NVLink domain, MNNVL)."""
    rank_start: RanksStarted | None = None
    """How the burst's ranks started: in the trial's own process, or forked from a zygote that held
    torch and the trainables' imports, one that was started for this burst (``cold``) or one already
    running (``warm``: a campaign's, kept on each node across its trials), or in rank processes
    that had run an earlier burst and were kept by the campaign's zygote (``kept``: their CUDA
    context, compiled kernels and caches warm). Start-up costs differ.
    A replay's is the recorded start-up it charged."""
    steady_window: SteadyWindow | None = None

    @property
    def measured_on(self) -> tuple[WorkerPlacement, ...] | None:
        """Where its ranks ran, where that is where it measured: ``None`` where it does not say,
        and for a replay (it ran here what a table recorded elsewhere)."""
        return self.workers if self.workers and self.replayed_from is None else None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


@dataclass(frozen=True, slots=True)
class RankStartup:
    """When the reporting rank was ready (its process started or forked, the process group up, its
    trainable called) and when it began its first step: wall-clock ``time.time()`` seconds, so the
    tuner, in another process of the same node, can split a trial's seconds outside its steps."""

    ready_at: float
    first_step_at: float


@dataclass(frozen=True)
class TimedPart:
    """One named part of a burst's set-up before its first step (the parallel groups, the model, the
    optimizer…) or of its end after the last (the trainable's release, the ranks' exit), and its
    wall seconds: what the seconds outside the steps are spent on."""

    name: str
    seconds: float


@dataclass(frozen=True)
class StepReport:
    """What a burst tells its caller after each step, so a caller that stops it early (or loses
    it) already holds everything the finished burst would have returned."""

    record: StepRecord
    evidence: Evidence
    """The run's evidence as of this step (see :attr:`BurstResult.evidence`)."""
    contract: Contract | None = None
    """The measurement contract, with the first step's report only."""
    elapsed_seconds: float | None = None
    """A replayed burst's recorded seconds since launch (start-up included), which the tuner
    charges instead of its own clock; ``None`` for a burst that spends real time."""
    startup: RankStartup | None = None
    """With the first step's report only, from a rank that spends real time (not a replay)."""
    build_phases: tuple[TimedPart, ...] = ()
    """With the first step's report only: the trainable's set-up, part by part, as it timed it."""
    began_at: float | None = None
    """With the first step's report only: when the reporting rank began that step (``time.time()``),
    by its own clock: the record's step time is the slowest rank's, and the report leaves after the
    step's reduction over the ranks."""


Reporter = Callable[[StepReport], bool]
"""Called after every step; returning ``False`` stops the burst after that step (``pruned``)."""


@dataclass(frozen=True)
class BurstResult:
    outcome: Outcome
    records: tuple[StepRecord, ...] = ()
    contract: Contract | None = None
    """The measurement contract of an ``ok`` (or pruned) burst."""
    error: str | None = None
    evidence: Evidence = field(default_factory=Evidence)
    elapsed_seconds: float | None = None
    """A replayed burst's recorded seconds in all (see :attr:`StepReport.elapsed_seconds`)."""
    teardown: tuple[TimedPart, ...] = ()
    """From the last step's verdict to the ranks' exit, part by part (ranks a launcher forked)."""
    rank_start: RanksStarted | None = None
    """How its ranks started, whatever the outcome: a contract comes only with steps, and what an
    out-of-memory burst cost depends on it (in kept ranks its build, in new ones a process's start)."""
    release: tuple[TimedPart, ...] = ()
    """The trainable's release of the burst's objects (its model, graphs, library state), part by
    part, as the rank timed it: what the teardown's first part spends, where the trainable times it."""
    before_first_step: tuple[TimedPart, ...] = ()
    """A burst that ran out of memory before its first step's report: its set-up part by part, then
    the part it ran out of memory in (its first step, or the build's next part), as the reporting
    rank timed them. Such a burst has no step to send its set-up with, yet its seconds are its cost."""


@dataclass(frozen=True)
class BurstRequest:
    """What a trainable needs to run one burst: the config, the model, the data, the budget."""

    config: Config
    model: ModelSpec
    data: DataSpec
    steps: int
    world_size: int
    seed: int = 0
    data_workers: int = 1
    """DataLoader worker processes per rank (decode and pack run there)."""
    memory_cap_fraction: float | None = None
    """On CUDA: ``torch.cuda.set_per_process_memory_fraction`` for the burst."""
    cpu_memory_cap_bytes: int | None = None
    """On the CPU: address space each rank may add once its model and loader are built
    (``RLIMIT_AS``), so training steps that need more fail to allocate: a real OOM boundary.
    Capped ranks run in fresh processes, whose heaps hold no freed memory to reuse uncounted."""
    cpu_device_memory_bytes: int | None = None
    """On the CPU: the device memory each rank has, counted in tensors (parameters, gradients and
    AdamW's moments, and the activations saved for backward: ``trainables/native/device_memory.py``);
    a step that would hold more is ``oom``, at the same point at every step count and on every
    machine, and peaks are reported in that count."""
    replay_table: str | None = None
    """The replay trainable's recorded table (``autotune/core/tables.py``); other trainables ignore it."""
    replay_start: RankStart = "warm"
    """The recorded start-up a replay charges: ``warm`` (ranks forked from a zygote already running,
    as a campaign's trials start them) where its table recorded it, else ``cold``."""
    recipe: RecipeSpec | None = None
    """The ``bridge`` trainable's recipe; other trainables ignore it."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all replicas, as the user's recipe fixes it: each replica
    accumulates GBS / (MBS × DP) micro-batches per step. ``None``: one micro-batch per pipeline
    stage, so the global batch follows MBS (tables recorded before the workload declared one)."""
    environment: Mapping[str, str] = field(default_factory=dict)
    """Set in every rank's environment before it starts: what the fabric under the trial's
    placement needs (``autotune/core/fabric.py``); the contract records it."""
    new_rank_processes: bool = False
    """Run in rank processes that no earlier burst ran in, ended after this one (never ``kept``):
    a promotion run measures its config as the user's own launch will run it, in a new process,
    and its repeats measure the spread between such processes."""

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches per replica per step.

        Raises:
            InvalidConfig: the global batch is not a whole number of micro-batches of this config.
        """
        misfit = global_batch_misfit(self.config, self.world_size, self.global_batch_size)
        if misfit is not None:
            raise InvalidConfig(misfit)
        return micro_batches_per_step(self.config, self.world_size, self.global_batch_size)
