"""Real image-text data: shards of real JPEGs, Qwen-VL token counts, packing and loss masks."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from trainables.data import tokenizer
from trainables.data.image_tokens import decoder_image_tokens, smart_resize, to_patches
from trainables.data.loader import ImageSettings, PackedVLMDataset, tokenize
from trainables.data.photos import PHOTOS
from trainables.data.shards import DataError, iter_samples, list_shards

QWEN2 = dict(factor=28, min_pixels=56 * 56, max_pixels=1280 * 28 * 28)
TINY = ImageSettings(patch_size=14, merge=2, min_pixels=56 * 56, max_pixels=336 * 336)


def test_shards_hold_decodable_real_jpegs_of_varied_sizes(photo_shards: Path) -> None:
    shards = list_shards(photo_shards)
    samples = [(key, parts) for shard in shards for key, parts in iter_samples(shard)]
    assert len(samples) >= 200
    long_sides, qualities, photos = set(), set(), set()
    for key, parts in samples:
        meta = json.loads(parts["json"])
        image = Image.open(io.BytesIO(parts["jpg"]))
        assert image.format == "JPEG"
        image.load()
        assert (image.width, image.height) == (meta["width"], meta["height"])
        long_sides.add(max(image.size))
        qualities.add(meta["jpeg_quality"])
        photos.add(meta["photo"])
        assert meta["caption"] and meta["qa"][0]["answer"] and meta["licence"] and meta["source"]
    assert min(long_sides) >= 224 and max(long_sides) <= 2048 and len(long_sides) > 100
    assert min(qualities) >= 80 and max(qualities) <= 95 and len(qualities) > 8
    assert photos == {photo.key for photo in PHOTOS}


def test_webdataset_reads_the_same_shards(photo_shards: Path) -> None:
    import webdataset as wds

    shards = [str(p) for p in list_shards(photo_shards)]
    ours = sum(1 for s in list_shards(photo_shards) for _ in iter_samples(s))
    theirs = list(wds.WebDataset(shards, shardshuffle=False).decode("pil"))
    assert len(theirs) == ours
    assert isinstance(theirs[0]["jpg"], Image.Image) and "caption" in theirs[0]["json"]


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [
        (1080, 1920, (728, 1316)),  # over max_pixels: scaled down, floor to multiples of 28
        (20, 30, (56, 84)),  # under min_pixels: scaled up, ceil to multiples of 28
        (448, 336, (448, 336)),  # already multiples of 28 and in range
        (500, 700, (504, 700)),  # rounded to the nearest multiple
    ],
)
def test_smart_resize_known_sizes(height: int, width: int, expected: tuple[int, int]) -> None:
    assert smart_resize(height, width, **QWEN2) == expected


def test_token_counts_follow_the_resize() -> None:
    height, width = smart_resize(1080, 1920, **QWEN2)
    assert decoder_image_tokens(height, width, patch_size=14, merge=2) == (728 // 14) * (1316 // 14) // 4 == 1222
    qwen3 = smart_resize(1080, 1920, factor=32, min_pixels=64 * 32 * 32, max_pixels=1024 * 32 * 32)
    assert qwen3[0] % 32 == 0 and qwen3[1] % 32 == 0 and qwen3[0] * qwen3[1] <= 1024 * 32 * 32


def test_patches_keep_merge_groups_contiguous() -> None:
    import numpy as np

    pixels = np.zeros((56, 84, 3), dtype=np.uint8)
    pixels[:28, :28] = 255  # the top-left 2x2 patch group is white
    patches = to_patches(pixels, patch_size=14, merge=2)
    assert patches.shape == (4 * 6, 3 * 14 * 14)
    assert (patches[:4] == 1.0).all() and (patches[4:] == -1.0).all()


def test_packed_batches_count_tokens_and_mask_only_answers(photo_shards: Path) -> None:
    dataset = PackedVLMDataset(photo_shards, TINY, seq_length=512, micro_batch_size=2)
    batch = next(iter(dataset))
    grids = batch.image_grids
    assert batch.patches.shape[0] == int((grids[:, 0] * grids[:, 1]).sum())
    assert batch.image_tokens == int((grids[:, 0] * grids[:, 1]).sum()) // 4
    assert int((batch.tokens == tokenizer.IMAGE).sum()) == batch.image_tokens
    # Loss only where the next token is answer text or EOS: never image, prompt or padding.
    targets = batch.labels[batch.loss_mask.bool()]
    assert not ((targets == tokenizer.IMAGE) | (targets == tokenizer.PAD) | (targets == tokenizer.IMAGE_START)).any()
    assert int((targets == tokenizer.EOS).sum()) == batch.samples
    assert batch.useful_tokens == batch.loss_tokens + batch.image_tokens
    assert batch.loss_tokens == int(batch.loss_mask.sum())
    assert int((batch.segment_ids == 0).sum()) + int((batch.segment_ids > 0).sum()) == batch.tokens.numel()


def test_tokenize_puts_loss_on_the_answer_only() -> None:
    meta = {"caption": "A cat.", "qa": [{"question": "What?", "answer": "A cat."}]}
    ids, targets = tokenize(meta, "x", image_tokens=3)
    answer = [i for i, t in zip(ids, targets) if t]
    assert tokenizer.decode(answer) == "A cat." and answer[-1] == tokenizer.EOS
    assert ids.count(tokenizer.IMAGE) == 3


def _shard(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def test_corrupt_and_truncated_jpegs_are_skipped_and_counted(tmp_path: Path, photo_shards: Path) -> None:
    good = [(k, p) for k, p in iter_samples(list_shards(photo_shards)[0])][:12]
    members = {}
    for index, (key, parts) in enumerate(good):
        jpeg = parts["jpg"]
        if index == 3:
            jpeg = jpeg[: len(jpeg) // 3]  # truncated
        if index == 7:
            jpeg = b"not a jpeg at all"
        members[f"{key}.jpg"] = jpeg
        members[f"{key}.json"] = parts["json"]
    _shard(tmp_path / "bad.tar", members)
    dataset = PackedVLMDataset(tmp_path, TINY, seq_length=512, micro_batch_size=1)
    stream = iter(dataset)
    skipped, samples = {}, 0
    for _ in range(6):
        batch = next(stream)
        samples += batch.samples
        for reason, count in batch.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
    assert skipped.get("corrupt_image") == 2
    assert samples >= 6


@pytest.mark.parametrize("kind", ["missing", "empty", "file"])
def test_unusable_folder_is_a_clear_error(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "data"
    if kind == "empty":
        folder.mkdir()
    if kind == "file":
        folder.write_text("x")
    with pytest.raises(DataError, match=str(folder)):
        PackedVLMDataset(folder, TINY, seq_length=512, micro_batch_size=1)


def test_mock_data_has_no_images(photo_shards: Path) -> None:
    batch = next(iter(PackedVLMDataset(photo_shards, TINY, seq_length=512, micro_batch_size=2, realism="mock")))
    assert batch.image_tokens == 0 and batch.patches.shape[0] == 0 and batch.image_grids.shape[0] == 0
    assert batch.loss_tokens > 0


def test_ranks_read_disjoint_samples(photo_shards: Path) -> None:
    def first_tokens(rank: int):
        batch = next(iter(PackedVLMDataset(photo_shards, TINY, 512, 1, rank=rank, world_size=2)))
        return batch.tokens[0].tolist()

    assert first_tokens(0) != first_tokens(1)


def test_shards_prepare_for_megatron_energon(tmp_path: Path) -> None:
    import subprocess
    import sys

    from trainables.data.shards import build_photo_shards

    folder = tmp_path / "shards"
    report = build_photo_shards(folder, samples_per_photo=1, samples_per_shard=8)
    energon = Path(sys.executable).parent / "energon"
    result = subprocess.run(
        [str(energon), "prepare", "--non-interactive", "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset",
         "--no-progress", str(folder)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    info = json.loads((folder / ".nv-meta" / ".info.json").read_text())
    assert sum(info["shard_counts"].values()) == report.samples
    assert len(list_shards(folder)) == report.shards  # the index files energon adds do not confuse us


def _first_batch_from_a_loader_worker(folder: str, out) -> None:
    """In a process a forkserver started (Python 3.14's default start method): the loader's
    workers' start method and whether they delivered a micro-batch."""
    from trainables.data.loader import make_loader

    loader = make_loader(PackedVLMDataset(Path(folder), TINY, seq_length=512, micro_batch_size=2), num_workers=1)
    out.put(loader.multiprocessing_context.get_start_method())
    out.put(next(iter(loader)).tokens.shape[0])


def test_a_rank_started_by_a_forkserver_forks_its_loader_workers(photo_shards: Path) -> None:
    """A forkserver-started rank inherits that start method; its DataLoader workers would then each
    start a forkserver of their own and import torch and PIL again (7 s of a CPU demo burst)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    out = context.Queue()
    rank = context.Process(target=_first_batch_from_a_loader_worker, args=(str(photo_shards), out))
    rank.start()
    assert out.get(timeout=60) == "fork"
    assert out.get(timeout=60) == 2  # the worker delivered a micro-batch
    rank.join(timeout=60)
    assert rank.exitcode == 0
