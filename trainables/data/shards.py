"""WebDataset tar shards: building them from the shipped photos, and reading any such folder.

A shard is a plain tar of ``<key>.jpg`` + ``<key>.json`` members, consecutive per key (the
WebDataset convention, so the ``webdataset`` package and Megatron-Energon read the same files).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import random
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image

from autotune.core.errors import AutotuneError
from trainables.data.photos import PHOTOS

log = logging.getLogger(__name__)

MIN_LONG_SIDE, MAX_LONG_SIDE = 224, 2048
MIN_QUALITY, MAX_QUALITY = 80, 95
BUILD_VERSION = 1
"""Bump when the builder's output changes, so cached shards are rebuilt."""


class DataError(AutotuneError):
    """A data folder or shard that cannot be used; the message names it."""


@dataclass(frozen=True)
class BuildReport:
    folder: Path
    shards: int
    samples: int
    total_bytes: int
    long_sides: tuple[int, int]
    qualities: tuple[int, int]


def build_photo_shards(
    folder: Path, samples_per_photo: int = 16, samples_per_shard: int = 64, seed: int = 0
) -> BuildReport:
    """Write shards of random crops of every shipped photo: long sides 224–2048 px (log-uniform),
    JPEG quality 80–95, captions and question/answer pairs from :mod:`trainables.data.photos`."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    samples: list[tuple[str, bytes, dict]] = []
    for photo in PHOTOS:
        pixels = photo.load()
        for index in range(samples_per_photo):
            jpeg, meta = _crop_sample(pixels, rng)
            meta.update(
                source=photo.source,
                licence=photo.licence,
                photo=photo.key,
                caption=photo.captions[index % len(photo.captions)],
                qa=[{"question": q, "answer": a} for q, a in (photo.qa[index % len(photo.qa)],)],
            )
            samples.append((f"{photo.key}-{index:03d}", jpeg, meta))
    rng.shuffle(samples)
    shard_count = math.ceil(len(samples) / samples_per_shard)
    for shard in range(shard_count):
        _write_shard(folder / f"shard-{shard:06d}.tar", samples[shard * samples_per_shard:(shard + 1) * samples_per_shard])
    metas = [meta for _, _, meta in samples]
    return BuildReport(
        folder=folder,
        shards=shard_count,
        samples=len(samples),
        total_bytes=sum(len(jpeg) for _, jpeg, _ in samples),
        long_sides=(min(max(m["width"], m["height"]) for m in metas), max(max(m["width"], m["height"]) for m in metas)),
        qualities=(min(m["jpeg_quality"] for m in metas), max(m["jpeg_quality"] for m in metas)),
    )


def _crop_sample(pixels: np.ndarray, rng: random.Random) -> tuple[bytes, dict]:
    height, width = pixels.shape[:2]
    crop_h = max(16, int(height * rng.uniform(0.5, 1.0)))
    crop_w = max(16, int(width * rng.uniform(0.5, 1.0)))
    top, left = rng.randint(0, height - crop_h), rng.randint(0, width - crop_w)
    image = Image.fromarray(pixels[top:top + crop_h, left:left + crop_w])
    long_side = round(math.exp(rng.uniform(math.log(MIN_LONG_SIDE), math.log(MAX_LONG_SIDE))))
    scale = long_side / max(crop_h, crop_w)
    size = (max(1, round(crop_w * scale)), max(1, round(crop_h * scale)))
    image = image.resize(size, Image.Resampling.BICUBIC)
    quality = rng.randint(MIN_QUALITY, MAX_QUALITY)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    meta = {"width": size[0], "height": size[1], "jpeg_quality": quality, "crop": [top, left, crop_h, crop_w]}
    return buffer.getvalue(), meta


def _write_shard(path: Path, samples: list[tuple[str, bytes, dict]]) -> None:
    write_tar(path, [member for key, jpeg, meta in samples
                     for member in ((f"{key}.jpg", jpeg), (f"{key}.json", json.dumps(meta).encode()))])


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A tar of ``(name, payload)`` members in order, written beside ``path`` and moved into place, so
    a reader never sees half a shard."""
    partial = path.with_suffix(".tar.partial")
    with tarfile.open(partial, "w") as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(payload))
    os.replace(partial, path)


def builtin_photo_shards(cache_root: Path) -> Path:
    """The built-in photo shards, built on first use under ``cache_root``."""
    folder = cache_root / f"photos-v{BUILD_VERSION}"
    if not (folder / "COMPLETE").exists():
        report = build_photo_shards(folder)
        (folder / "COMPLETE").write_text(json.dumps({"samples": report.samples, "shards": report.shards}))
        log.info("built %d samples in %d shards under %s", report.samples, report.shards, folder)
    return folder


def list_shards(folder: Path) -> list[Path]:
    """The ``.tar`` shards of ``folder``; a missing or empty folder is a :class:`DataError`."""
    if not folder.exists():
        raise DataError(f"data folder {folder} does not exist")
    if not folder.is_dir():
        raise DataError(f"data folder {folder} is not a directory")
    shards = sorted(folder.glob("*.tar"))
    if not shards:
        raise DataError(f"data folder {folder} holds no .tar shards")
    return shards


def iter_samples(shard: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` per sample, members grouped by key in file order."""
    current_key, parts = None, {}
    try:
        with tarfile.open(shard, "r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                base = os.path.basename(member.name)
                key, _, extension = base.partition(".")
                if key != current_key and current_key is not None:
                    yield current_key, parts
                    parts = {}
                current_key = key
                handle = tar.extractfile(member)
                parts[extension] = handle.read() if handle else b""
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DataError(f"shard {shard} is unreadable: {exc}") from None
    if current_key is not None:
        yield current_key, parts
