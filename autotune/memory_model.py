"""Predict a config's peak memory per device before launch, and reject what surely will not fit.

The analytic part counts, per device, the bytes each config changes:

- *static*: weights, gradients and optimizer states under the config's sharding — dense decoder
  weights over TP x PP, experts over EP x ETP x PP, the vision stack over TP; a frozen part keeps
  only its bf16 weights; megatron's bf16 training keeps 18 bytes per trainable parameter (bf16
  weight, fp32 gradient, fp32 main weight, two fp32 Adam moments), all 18 sharded over data
  parallel under FSDP (Megatron-FSDP or FSDP2), none under DDP;
- *decoder activations* kept for backward, per micro-batch in flight (PP of them on the first
  stage): per layer, the attention block (with the unfused softmax's two [heads, s, s] tensors
  unless ``core_attn`` is recomputed), the MoE block (top-k copies of each token through the
  experts unless ``moe`` is recomputed), the residuals; full recompute keeps each layer's input
  plus one layer's activations; graphed layers keep static input/output buffers;
- *vision activations*: the ViT over the images' patches, none when the vision stack is frozen.

The static bytes are counted, not guessed; activations differ from their count by factors the
count cannot know (the allocator, the framework's saved tensors, how many images a batch carries),
so the prediction is ``static + b·decoder + c·vision + d`` with non-negative ``b, c, d`` fitted to
the peaks finished trials report. (Fitting a factor on the static bytes too lets peaks of similar
configs fit each other exactly and extrapolate badly: static memory barely varies within a layout.) Its error is the
largest leave-one-out relative error over those trials (at least 10 %); a config is rejected only
when even the prediction less that error exceeds the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

from autotune.core.knobs import Config, expert_tensor_parallel
from autotune.core.model import ModelSpec

BF16 = 2
TRAINED_BYTES_PER_PARAMETER = 18
MIN_OBSERVATIONS = 5
"""Fitting three coefficients and measuring a leave-one-out error takes more than three peaks."""
MIN_MARGIN = 0.10
"""The least error a rejection allows for: peaks from similar configs can fit each other exactly
and still extrapolate badly to a larger micro-batch."""


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


def memory_terms(config: Config, model: ModelSpec, world_size: int) -> MemoryTerms:
    tp, pp, cp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size
    ep = config.expert_model_parallel_size
    etp = expert_tensor_parallel(config)
    dp = max(1, world_size // (tp * pp * cp))
    expert_dp = max(1, world_size // (ep * etp * pp))
    dense, experts, vision, projector = _parameters(model)

    def trained(parameters: float, data_parallel: int) -> float:
        if config.use_megatron_fsdp or config.use_torch_fsdp2:
            return parameters * TRAINED_BYTES_PER_PARAMETER / data_parallel
        return parameters * TRAINED_BYTES_PER_PARAMETER  # DDP without the distributed optimizer

    def held(parameters: float, frozen: bool, data_parallel: int) -> float:
        return parameters * BF16 if frozen else trained(parameters, data_parallel)

    static = (trained(dense / (tp * pp), dp) + trained(experts / (ep * etp * pp), expert_dp)
              + held(vision / tp, bool(config.freeze_vision_model), dp)
              + held(projector / tp, bool(config.freeze_vision_projection), dp))

    s, b, h = model.seq_length / cp, config.micro_batch_size, model.hidden_size
    heads = model.num_attention_heads / tp
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    groups = (model.num_query_groups or model.num_attention_heads) / tp
    k, f = model.moe_router_topk, model.moe_ffn_hidden_size / etp
    selective = set(config.recompute_modules or ()) if config.recompute_granularity == "selective" else set()
    scores = 2 * heads * s * model.seq_length * b
    attention = s * b * (2 * h + (heads + 2 * groups) * head_dim) + (0 if "core_attn" in selective else scores)
    moe = s * b * h + (0 if "moe" in selective else k * s * b * (h + 3 * f))
    layer = attention + moe + 2 * s * b * h
    layers = model.num_layers / pp
    if config.recompute_granularity == "full":
        kept = layers * s * b * h + layer
    else:
        kept = layers * layer
    if config.cuda_graph_impl != "none":
        kept += layers * 2 * s * b * h
    decoder = kept * BF16 * pp  # 1F1B: the first stage holds PP micro-batches

    v = model.vision
    patches = b * model.seq_length * v.spatial_merge_size**2  # at most every token an image token
    vision_kept = 0.0 if config.freeze_vision_model else \
        patches * v.num_layers * (6 * v.hidden_size + 2 * v.ffn_hidden_size) * BF16 / tp
    return MemoryTerms(static=static, decoder_activations=decoder, vision_activations=vision_kept)


@dataclass
class MemoryModel:
    """The analytic terms, calibrated online on reported peaks (see the module's docstring)."""

    model: ModelSpec
    world_size: int
    limit_bytes: float | None
    observations: list[tuple[MemoryTerms, float]] = field(default_factory=list)
    _calibrated_on: int = field(default=-1, init=False, repr=False)
    _coefficients: np.ndarray = field(default=None, init=False, repr=False)
    _error: float = field(default=0.0, init=False, repr=False)

    def observe(self, config: Config, peak_bytes: float) -> None:
        if peak_bytes > 0:
            self.observations.append((memory_terms(config, self.model, self.world_size), float(peak_bytes)))

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
        return self._apply(memory_terms(config, self.model, self.world_size), coefficients)

    def error(self) -> float | None:
        """The largest leave-one-out relative error of the calibrated model."""
        return self._calibration()[1] if self.calibrated else None

    def rejection(self, config: Config) -> str | None:
        """Why ``config`` surely exceeds the limit, or ``None``."""
        if self.limit_bytes is None or not self.calibrated:
            return None
        predicted, error = self.predict(config), max(self.error(), MIN_MARGIN)
        if predicted * (1 - error) <= self.limit_bytes:
            return None
        return (f"the memory model predicts {predicted / 2**30:.1f} GiB per device (±{100 * error:.0f} %, "
                f"from {len(self.observations)} peaks), over the {self.limit_bytes / 2**30:.1f} GiB limit")
