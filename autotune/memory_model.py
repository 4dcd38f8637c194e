"""Predict a config's peak memory per device before launch, and reject what surely will not fit.

The analytic part counts, per device, the bytes each config changes:

- *static*: weights, gradients and optimizer states under the config's sharding — dense decoder
  weights over TP x PP, experts over EP x ETP x PP, the vision stack over TP; a frozen part keeps
  only its weights; a trained parameter keeps what the trainable's precision keeps
  (:class:`~autotune.core.contract.TrainingBytes`: megatron's bf16 training 18 bytes — bf16
  weight, fp32 gradient, fp32 main weight, two fp32 Adam moments; the native trainable's fp32
  16), all sharded over data parallel under FSDP (Megatron-FSDP or FSDP2), none under DDP; FP8 adds one byte per parameter of
  the decoder's linear layers (Transformer Engine's FP8 weight copies: +0.89 GiB measured at
  hidden 1,024 on the H200 where this count gives 0.79, ``bench/results/te_paths_gpu.json``);
- *decoder activations* kept for backward, per micro-batch in flight on the first pipeline
  stage (:func:`micro_batches_in_flight`: one without a pipeline, however many micro-batches a
  step accumulates, since each one's backward frees its activations before the next forward):
  per layer, the attention block (with the unfused softmax's two [heads, s, s] tensors unless
  ``core_attn`` is recomputed), the MoE block (top-k copies of each token through the experts
  unless ``moe`` is recomputed; ``moe_act`` drops the activation's output, one of its three
  expert-width tensors), the residuals; full recompute keeps each layer's input plus one layer's
  activations; graphed layers keep static input/output buffers;
- *vision activations*: the ViT over the images' patches of each micro-batch in flight, none when
  the vision stack is frozen.

Accumulating micro-batches adds no static bytes on megatron-core: gradients accumulate in the
buffers counted above (its FSDP reduce-scatters every micro-batch). The native trainable's FSDP2
keeps unsharded gradients until a step's last micro-batch; that is not counted here, nor by the
CPU demo's counted device memory (``trainables/native/device_memory.py``), the limit it meets there.

The static bytes are counted, not guessed; activations differ from their count by factors the
count cannot know (the allocator, the framework's saved tensors, how many images a batch carries),
so the prediction is ``static + b·decoder + c·vision + d`` with non-negative ``b, c, d`` fitted to
the peaks finished trials report. (Fitting a factor on the static bytes too lets peaks of similar
configs fit each other exactly and extrapolate badly: static memory barely varies within a layout.) Its error is the
largest leave-one-out relative error over those trials (at least 10 %); a config is rejected only
when even the prediction less that error exceeds the limit.

A floor rejects from the first proposal on, before any peak: the counted static bytes and decoder
activations at face value (a factor of 1: tensors that must exist, all live at the peak; what the
count leaves out — the framework's buffers, the dispatcher's copies — only adds). The vision count
is left out of it: it assumes every token an image token, an upper bound (a median 1.4× what the
CPU demo's ranks hold beyond the rest). A config whose floor exceeds the limit by more than 10 % is
rejected. Every committed table's peaks lie above the floor less that margin
(``tests/test_memory_model.py`` holds them to it): on the H200 tables above the floor itself; on
the CPU demo's, 4 of 72 up to 3.4 % below it (FSDP2 at MBS 1, whose counted memory leaves out the
layer a full or selective recompute rebuilds during backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

from autotune.core.contract import MEGATRON_BF16, TrainingBytes
from autotune.core.knobs import KNOBS, Config, data_parallel, expert_tensor_parallel, micro_batches_per_step
from autotune.core.model import ModelSpec

MIN_OBSERVATIONS = 5
"""Fitting three coefficients and measuring a leave-one-out error takes more than three peaks."""
MIN_MARGIN = 0.10
"""The least error a rejection allows for: peaks from similar configs can fit each other exactly
and still extrapolate badly to a larger micro-batch."""
SCALED_MARGIN = 0.25
"""The error a rejection allows for before calibration, when a prediction scales one peak (on the
H200 table no config that fits was rejected at it; 0.10 rejected one)."""


@dataclass(frozen=True)
class MemoryTerms:
    static: float
    decoder_activations: float
    vision_activations: float

    def features(self) -> np.ndarray:
        """What the fitted coefficients multiply (the static bytes are added as counted)."""
        return np.array([self.decoder_activations, self.vision_activations, 1.0])


def _parameters(model: ModelSpec) -> tuple[float, float, float, float]:
    """Dense decoder (attention, router, dense MLPs, embeddings), expert, vision and projector parameters."""
    h, heads, groups = model.hidden_size, model.num_attention_heads, model.num_query_groups or model.num_attention_heads
    head_dim = model.kv_channels or h // heads
    attention = h * head_dim * (2 * heads + 2 * groups)
    moe_layers = model.num_layers - model.first_k_dense_layers
    shared = 3 * h * (model.moe_shared_expert_intermediate_size or 0)
    dense = (model.num_layers * attention + moe_layers * (h * model.num_moe_experts + shared)
             + model.first_k_dense_layers * 3 * h * model.ffn_hidden_size + 2 * model.vocab_size * h)
    experts = moe_layers * model.num_moe_experts * 3 * h * model.moe_ffn_hidden_size
    v = model.vision
    vision = v.num_layers * (4 * v.hidden_size**2 + 2 * v.hidden_size * v.ffn_hidden_size) + 3 * v.patch_size**2 * v.hidden_size
    merged = v.hidden_size * v.spatial_merge_size**2
    projector = merged * merged + merged * h
    return dense, experts, vision, projector


def _fp8_weight_parameters(model: ModelSpec) -> tuple[float, float]:
    """Dense and expert parameters of the decoder's linear layers, the GEMMs FP8 runs (embeddings,
    the output layer and the router stay in bf16)."""
    dense, experts, _, _ = _parameters(model)
    moe_layers = model.num_layers - model.first_k_dense_layers
    return dense - 2 * model.vocab_size * model.hidden_size - moe_layers * model.hidden_size * model.num_moe_experts, \
        experts


def micro_batches_in_flight(config: Config, micro_batches: int) -> float:
    """How many micro-batches' activations of its stage the first pipeline stage holds at its
    peak, as megatron-core's schedules run them: one without a pipeline; 1F1B warms up with PP
    forwards (fewer when the step has fewer micro-batches); the interleaved schedule with VPP
    chunks runs 2·(PP−1) + (VPP−1)·PP warm-up chunks and one more before its first backward,
    each chunk 1/VPP of the stage's layers."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    if pp == 1:
        return 1.0
    if not vpp or vpp == 1:
        return float(min(pp, max(1, micro_batches)))
    chunks = min(max(1, micro_batches) * vpp, 2 * (pp - 1) + (vpp - 1) * pp + 1)
    return chunks / vpp


def memory_terms(config: Config, model: ModelSpec, world_size: int, global_batch_size: int | None = None,
                 units: TrainingBytes = MEGATRON_BF16) -> MemoryTerms:
    """The counted bytes of ``config`` per device, in the trainable's ``units``; ``global_batch_size``
    sets how many micro-batches a step accumulates (``None``: one per pipeline stage, as the
    trainables run without one)."""
    tp, pp, cp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size
    ep = config.expert_model_parallel_size
    etp = expert_tensor_parallel(config)
    dp = max(1, world_size // (tp * pp * cp))
    expert_dp = max(1, world_size // (ep * etp * pp))
    dense, experts, vision, projector = _parameters(model)

    def trained(parameters: float, data_parallel: int) -> float:
        if config.use_megatron_fsdp or config.use_torch_fsdp2:
            return parameters * units.trained_parameter / data_parallel
        return parameters * units.trained_parameter  # DDP without the distributed optimizer

    def held(parameters: float, frozen: bool, data_parallel: int) -> float:
        return parameters * units.frozen_parameter if frozen else trained(parameters, data_parallel)

    static = (trained(dense / (tp * pp), dp) + trained(experts / (ep * etp * pp), expert_dp)
              + held(vision / tp, bool(config.freeze_vision_model), dp)
              + held(projector / tp, bool(config.freeze_vision_projection), dp))
    if config.fp8 != "none":
        dense_linear, expert_linear = _fp8_weight_parameters(model)
        static += dense_linear / (tp * pp) + expert_linear / (ep * etp * pp)  # one byte each

    s, b, h = model.seq_length / cp, config.micro_batch_size, model.hidden_size
    heads = model.num_attention_heads / tp
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    groups = (model.num_query_groups or model.num_attention_heads) / tp
    k, f = model.moe_router_topk, model.moe_ffn_hidden_size / etp
    selective = set(config.recompute_modules or ()) if config.recompute_granularity == "selective" else set()
    scores = 2 * heads * s * model.seq_length * b
    attention = s * b * (2 * h + (heads + 2 * groups) * head_dim) + (0 if "core_attn" in selective else scores)
    expert_width_tensors = 2 if "moe_act" in selective else 3
    moe = s * b * h + (0 if "moe" in selective else k * s * b * (h + expert_width_tensors * f))
    layer = attention + moe + 2 * s * b * h
    layers = model.num_layers / pp
    per_micro_batch = layers * (s * b * h if config.recompute_granularity == "full" else layer)
    if config.cuda_graph_impl != "none":
        per_micro_batch += layers * 2 * s * b * h
    micro_batches = micro_batches_per_step(config, world_size, global_batch_size) if data_parallel(config, world_size) \
        else pp  # a layout larger than the trial: the rules reject it, the count need not
    in_flight = micro_batches_in_flight(config, micro_batches)
    recomputing = layer if config.recompute_granularity == "full" else 0.0  # one layer at a time
    decoder = (per_micro_batch * in_flight + recomputing) * units.activation

    v = model.vision
    patches = b * model.seq_length * v.spatial_merge_size**2  # at most every token an image token
    vision_kept = 0.0 if config.freeze_vision_model else \
        patches * v.num_layers * (6 * v.hidden_size + 2 * v.ffn_hidden_size) * units.activation / tp * in_flight
    return MemoryTerms(static=static, decoder_activations=decoder, vision_activations=vision_kept)


@dataclass
class MemoryModel:
    """The analytic terms, calibrated online on reported peaks (see the module's docstring), for
    one campaign's trial size and global batch."""

    model: ModelSpec
    world_size: int
    limit_bytes: float | None
    global_batch_size: int | None = None
    units: TrainingBytes = MEGATRON_BF16
    """What the trainable keeps per parameter and activation (its :class:`TrainableSupport`'s)."""
    observations: list[tuple[MemoryTerms, float]] = field(default_factory=list)
    observed_configs: list[Config] = field(default_factory=list)
    """The config of each observation, in the same order (what :meth:`scaled` matches on)."""
    _calibrated_on: int = field(default=-1, init=False, repr=False)
    _coefficients: np.ndarray = field(default=None, init=False, repr=False)
    _error: float = field(default=0.0, init=False, repr=False)

    def terms(self, config: Config) -> MemoryTerms:
        return memory_terms(config, self.model, self.world_size, self.global_batch_size, self.units)

    def observe(self, config: Config, peak_bytes: float) -> None:
        if peak_bytes > 0:
            self.observations.append((self.terms(config), float(peak_bytes)))
            self.observed_configs.append(config)

    @staticmethod
    def _fit(observations: list[tuple[MemoryTerms, float]]) -> np.ndarray:
        features = np.array([terms.features() for terms, _ in observations])
        rest = np.array([peak - terms.static for terms, peak in observations])
        scale = np.maximum(np.abs(features).max(axis=0), 1.0)
        coefficients, _ = nnls(features / scale, rest)
        return coefficients / scale

    @staticmethod
    def _apply(terms: MemoryTerms, coefficients: np.ndarray) -> float:
        return terms.static + float(terms.features() @ coefficients)

    @property
    def calibrated(self) -> bool:
        return len(self.observations) >= MIN_OBSERVATIONS

    def _calibration(self) -> tuple[np.ndarray, float]:
        """Coefficients and leave-one-out error, fitted once per new peak rather than per
        proposal (the search asks about every config it proposes; peaks are only appended)."""
        if self._calibrated_on != len(self.observations):
            errors = []
            for index, (terms, peak) in enumerate(self.observations):
                rest = self.observations[:index] + self.observations[index + 1:]
                errors.append(abs(self._apply(terms, self._fit(rest)) - peak) / peak)
            self._calibrated_on = len(self.observations)
            self._coefficients, self._error = self._fit(self.observations), max(errors)
        return self._coefficients, self._error

    def predict(self, config: Config) -> float | None:
        """Peak bytes per device, once calibrated."""
        if not self.calibrated:
            return None
        coefficients, _ = self._calibration()
        return self._apply(self.terms(config), coefficients)

    def error(self) -> float | None:
        """The largest leave-one-out relative error of the calibrated model."""
        return self._calibration()[1] if self.calibrated else None

    def floor(self, config: Config) -> float:
        """Peak bytes per device no run of ``config`` stays under: its counted static bytes and
        decoder activations at face value (see the module's docstring)."""
        terms = self.terms(config)
        return terms.static + terms.decoder_activations

    def scaled(self, config: Config) -> float | None:
        """Peak bytes per device before calibration, from a peak of the same config at another
        micro-batch size: the counted static bytes plus what that peak held beyond its own, scaled by
        the ratio of the activation counts. The framework's base is scaled with the activations, so
        a larger micro-batch is overstated (by up to 71 % on the H200 table, understated by at most
        19 %); ``None`` without such a peak: a count alone is too far from a peak to reject on, and a
        peak of another config is too (scaled across recompute, freezing and graphs, a peak misses by
        up to 5.4× on the H200 table: ``bench/memory_model.py``'s ``one_peak_scaling``)."""
        terms = self.terms(config)
        twins = [observation for seen, observation in zip(self.observed_configs, self.observations)
                 if all(seen[name] == config[name] for name in KNOBS if name != "micro_batch_size")]
        if not twins:
            return None
        reference, peak = min(twins, key=lambda twin: abs(np.log(_activations(twin[0]) / _activations(terms))))
        return scale_peak(terms, reference, peak)

    def rejection(self, config: Config) -> str | None:
        """Why ``config`` surely exceeds the limit, or ``None``: from the calibrated model beyond its
        error, before it from :meth:`scaled` beyond ``SCALED_MARGIN``, and always from
        :meth:`floor` beyond ``MIN_MARGIN``."""
        if self.limit_bytes is None:
            return None
        if self.calibrated:
            predictions = [(self.predict(config), max(self.error(), MIN_MARGIN), f"from {len(self.observations)} peaks")]
        else:
            predictions = [(self.scaled(config), SCALED_MARGIN,
                            "scaled from the same config's peak at another micro-batch size")]
        predictions.append((self.floor(config), MIN_MARGIN, "its counted weights, optimizer states and decoder "
                                                             "activations alone"))
        for predicted, error, source in predictions:
            if predicted is not None and predicted * (1 - error) > self.limit_bytes:
                return (f"the memory model predicts {predicted / 2**30:.2f} GiB per device (±{100 * error:.0f} %, "
                        f"{source}), over the {self.limit_bytes / 2**30:.2f} GiB limit")
        return None


def _activations(counted: MemoryTerms) -> float:
    return max(counted.decoder_activations + counted.vision_activations, 1.0)


def scale_peak(terms: MemoryTerms, reference: MemoryTerms, peak: float) -> float:
    """A config's peak bytes from another's ``peak``: its counted static bytes plus what that peak
    held beyond the other's static bytes, scaled by the ratio of their activation counts."""
    return terms.static + max(0.0, peak - reference.static) * _activations(terms) / _activations(reference)
