"""The training input: real JPEG decode in DataLoader workers, Qwen-VL resize and patching, byte
tokens, packing into fixed-length sequences, and loss masks that cover answer text only.

Workers pack whole micro-batches, so the training loop only waits when decoding cannot keep up
(the burst measures that wait). A corrupt or truncated image is skipped and counted, never raised.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from autotune.core.contract import BurstRequest, DataRealism
from trainables.data import tokenizer
from trainables.data.image_tokens import decoder_image_tokens, smart_resize, to_patches
from trainables.data.shards import DataError, iter_samples, list_shards

log = logging.getLogger(__name__)

WORKER_START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
"""How DataLoader workers start (:func:`make_loader`); ``None`` is the platform's default."""


@dataclass(frozen=True)
class ImageSettings:
    patch_size: int
    merge: int
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge


@dataclass
class Sample:
    """One tokenised sample: ids (``IMAGE`` placeholders where image embeddings go), targets."""

    ids: list[int]
    targets: list[bool]
    """Whether each id is predicted with loss (answer/caption text and EOS only)."""
    patches: torch.Tensor | None = None
    grid: tuple[int, int] | None = None
    image_tokens: int = 0


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [B, S] long
    labels: torch.Tensor  # [B, S] long, next-token ids
    loss_mask: torch.Tensor  # [B, S] float, 1 where the label carries loss
    segment_ids: torch.Tensor  # [B, S] long, 0 = padding, 1.. = packed sample
    position_ids: torch.Tensor  # [B, S] long, restarting per sample
    patches: torch.Tensor  # [P, 3·p·p] float, every image's patches in order
    image_grids: torch.Tensor  # [I, 2] long, (rows, cols) of patches per image
    image_tokens: int
    loss_tokens: int
    samples: int
    skipped: dict[str, int] = field(default_factory=dict)
    """Samples dropped since the previous micro-batch of the same worker, by reason."""

    def model_inputs(self) -> tuple[torch.Tensor, ...]:
        """The model's positional inputs, in the order ``MoEVLM.forward`` takes them."""
        return (self.tokens, self.labels, self.loss_mask, self.segment_ids, self.position_ids, self.patches,
                self.image_grids)

    @property
    def useful_tokens(self) -> int:
        """Loss-bearing text tokens plus image tokens entering the decoder; never padding."""
        return self.loss_tokens + self.image_tokens

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {
            name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for name, value in self.__dict__.items()
        }
        return MicroBatch(**moved)


def tokenize(meta: dict, key: str, image_tokens: int) -> tuple[list[int], list[bool]]:
    """Image block, then a prompt, then the answer; only the answer (and EOS) carries loss.

    Each sample alternates deterministically between its caption and a question/answer pair.
    """
    use_qa = bool(meta.get("qa")) and (sum(key.encode()) % 2 == 1)
    if use_qa:
        pair = meta["qa"][0]
        prompt, answer = f"Question: {pair['question']} Answer: ", pair["answer"]
    else:
        prompt, answer = "Describe the image. ", meta.get("caption", "")
    ids = [tokenizer.BOS]
    if image_tokens:
        ids += [tokenizer.IMAGE_START] + [tokenizer.IMAGE] * image_tokens + [tokenizer.IMAGE_END]
    prompt_ids, answer_ids = tokenizer.encode(prompt), tokenizer.encode(answer) + [tokenizer.EOS]
    targets = [False] * (len(ids) + len(prompt_ids)) + [True] * len(answer_ids)
    return ids + prompt_ids + answer_ids, targets


class Packer:
    """Packs samples into ``micro_batch_size`` sequences of ``seq_length`` tokens.

    A sample never straddles two sequences: one that does not fit the current sequence opens the
    next; one longer than ``seq_length`` is dropped and counted as ``too_long``.
    """

    def __init__(self, seq_length: int, micro_batch_size: int) -> None:
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.sequences: list[list[Sample]] = [[]]
        self.skipped: dict[str, int] = {}

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def add(self, sample: Sample) -> MicroBatch | None:
        if len(sample.ids) > self.seq_length:
            self.skip("too_long")
            return None
        used = sum(len(s.ids) for s in self.sequences[-1])
        if used + len(sample.ids) > self.seq_length:
            if len(self.sequences) == self.micro_batch_size:
                batch = self._emit()
                self.sequences = [[sample]]
                return batch
            self.sequences.append([])
        self.sequences[-1].append(sample)
        return None

    def _emit(self) -> MicroBatch:
        batch, seq = self.micro_batch_size, self.seq_length
        tokens = torch.full((batch, seq), tokenizer.PAD, dtype=torch.long)
        labels = torch.full((batch, seq), tokenizer.PAD, dtype=torch.long)
        loss_mask = torch.zeros((batch, seq))
        segment_ids = torch.zeros((batch, seq), dtype=torch.long)
        position_ids = torch.zeros((batch, seq), dtype=torch.long)
        patches, grids, image_tokens, count = [], [], 0, 0
        for row, samples in enumerate(self.sequences):
            offset = 0
            for segment, sample in enumerate(samples, start=1):
                n = len(sample.ids)
                ids = torch.tensor(sample.ids)
                tokens[row, offset:offset + n] = ids
                labels[row, offset:offset + n - 1] = ids[1:]
                loss_mask[row, offset:offset + n - 1] = torch.tensor(sample.targets[1:], dtype=torch.float)
                segment_ids[row, offset:offset + n] = segment
                position_ids[row, offset:offset + n] = torch.arange(n)
                offset += n
                count += 1
                if sample.patches is not None:
                    patches.append(sample.patches)
                    grids.append(sample.grid)
                    image_tokens += sample.image_tokens
        patch_dim = patches[0].shape[1] if patches else 0
        micro = MicroBatch(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            segment_ids=segment_ids,
            position_ids=position_ids,
            patches=torch.cat(patches) if patches else torch.zeros((0, patch_dim)),
            image_grids=torch.tensor(grids, dtype=torch.long).reshape(-1, 2),
            image_tokens=image_tokens,
            loss_tokens=int(loss_mask.sum().item()),
            samples=count,
            skipped=self.skipped,
        )
        self.skipped = {}
        return micro


class PackedVLMDataset(IterableDataset):
    """An endless stream of packed micro-batches from a shard folder, split over ranks and workers.

    ``realism="mock"`` drops every image (text only): the image-free setting whose throughput is
    misleading, kept for benchmarks that measure exactly that.
    """

    def __init__(
        self,
        folder: Path,
        images: ImageSettings,
        seq_length: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        realism: DataRealism = "real",
    ) -> None:
        self.shards = list_shards(folder)
        self.folder = folder
        self.images = images
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed = seed
        self.realism = realism

    def __iter__(self) -> Iterator[MicroBatch]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        stride, offset = self.world_size * workers, self.rank * workers + worker
        packer = Packer(self.seq_length, self.micro_batch_size)
        epoch = 0
        while True:
            order = list(self.shards)
            random.Random(self.seed * 1000003 + epoch).shuffle(order)
            produced = False
            index = 0
            for shard in order:
                try:
                    for key, parts in iter_samples(shard):
                        index += 1
                        if index % stride != offset:
                            continue
                        sample = self._sample(key, parts, packer)
                        if sample is None:
                            continue
                        produced = True
                        batch = packer.add(sample)
                        if batch is not None:
                            yield batch
                except DataError as exc:
                    log.warning("%s; skipping the rest of that shard", exc)
                    packer.skip("unreadable_shard")
            if not produced:
                raise DataError(f"no usable sample in {self.folder} for rank {self.rank} worker {worker}")
            epoch += 1

    def _sample(self, key: str, parts: dict[str, bytes], packer: Packer) -> Sample | None:
        try:
            meta = json.loads(parts["json"])
        except (KeyError, ValueError):
            packer.skip("bad_json")
            return None
        if self.realism == "mock":
            ids, targets = tokenize(meta, key, image_tokens=0)
            return Sample(ids=ids, targets=targets)
        if "jpg" not in parts:
            packer.skip("missing_image")
            return None
        settings = self.images
        try:
            image = Image.open(io.BytesIO(parts["jpg"]))
            height, width = smart_resize(
                image.height, image.width, settings.factor, settings.min_pixels, settings.max_pixels
            )
            # JPEG can decode straight to 1/2, 1/4 or 1/8 scale: decoding a 2048 px photo at the
            # scale it is resized to anyway is most of what keeps the data wait small.
            image.draft("RGB", (width, height))
            image = image.convert("RGB")  # forces the full decode: a truncated file fails here
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            packer.skip("corrupt_image")
            return None
        pixels = image.resize((width, height), Image.Resampling.BICUBIC)
        patches = to_patches(np.asarray(pixels), settings.patch_size, settings.merge)
        image_tokens = decoder_image_tokens(height, width, settings.patch_size, settings.merge)
        ids, targets = tokenize(meta, key, image_tokens)
        grid = (height // settings.patch_size, width // settings.patch_size)
        return Sample(ids=ids, targets=targets, patches=patches, grid=grid, image_tokens=image_tokens)


def make_loader(dataset: PackedVLMDataset, num_workers: int, prefetch_factor: int = 4) -> DataLoader:
    """Workers build whole micro-batches; ``batch_size=None`` passes them through unchanged.

    Workers are forked from the rank where the platform can fork. A rank started by a forkserver
    (our launcher's, before its zygote; Python 3.14's default start method) inherits that start
    method, and a forkserver worker would start a forkserver of its own and import torch, PIL and
    this module again before its first sample: a CPU demo burst spent 12.7 s outside its steps with
    them, 5.2 s without (``bench/burst_startup.py``). A forked worker
    has them already; it never touches CUDA (the rank pins and moves each batch), which is what
    makes forking a CUDA rank safe."""
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        multiprocessing_context=WORKER_START_METHOD if num_workers else None,
    )


def rank_loader(request: BurstRequest, rank: int, world_size: int) -> Iterator[MicroBatch]:
    """The micro-batches of data-parallel rank ``rank`` of ``world_size`` for a burst."""
    spec = request.model
    images = ImageSettings(
        patch_size=spec.vision.patch_size,
        merge=spec.vision.spatial_merge_size,
        min_pixels=spec.images.min_pixels,
        max_pixels=spec.images.max_pixels,
    )
    dataset = PackedVLMDataset(
        Path(request.data.folder),
        images,
        seq_length=spec.seq_length,
        micro_batch_size=request.config.micro_batch_size,
        rank=rank,
        world_size=world_size,
        seed=request.seed,
        realism=request.data.realism,
    )
    return iter(make_loader(dataset, request.data_workers))
