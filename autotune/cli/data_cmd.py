"""``autotune data build``: real photo shards for the built-in data, or anywhere you want them."""

from __future__ import annotations

from pathlib import Path

import typer

from autotune.cli import console

app = typer.Typer(help="Build and inspect training data.", no_args_is_help=True)


@app.command("build")
def build(
    out_dir: Path = typer.Argument(..., help="Folder to write the WebDataset .tar shards into."),
    samples_per_photo: int = typer.Option(16, min=1, help="Random crops per source photograph."),
    samples_per_shard: int = typer.Option(64, min=1),
    seed: int = typer.Option(0),
    energon: bool = typer.Option(False, "--energon", help="Write a Megatron-Energon dataset in the ChatML form "
                                 "Megatron-Bridge's Qwen-VL recipes read (point dataset.path at it)."),
) -> None:
    """Shards of real photographs (shipped in scikit-image and scikit-learn) with our captions."""
    if energon:
        _build_energon(out_dir, samples_per_photo, samples_per_shard, seed)
        return
    from trainables.data.shards import build_photo_shards

    report = build_photo_shards(out_dir, samples_per_photo, samples_per_shard, seed)
    console.print(
        f"{report.samples} samples in {report.shards} shards under {report.folder} "
        f"({report.total_bytes / 2**20:.1f} MiB of JPEG; long sides {report.long_sides[0]}–{report.long_sides[1]} px; "
        f"JPEG quality {report.qualities[0]}–{report.qualities[1]})"
    )


def _build_energon(out_dir: Path, samples_per_photo: int, samples_per_shard: int, seed: int) -> None:
    try:
        from trainables.bridge.energon import build_chatml_energon

        report = build_chatml_energon(out_dir, samples_per_photo, samples_per_shard, seed)
    except ImportError as exc:  # megatron-energon is the bridge extra's
        console.print(f"autotune data build --energon needs megatron-energon ({exc}): pip install -e '.[bridge]'",
                      style="red", markup=False)
        raise typer.Exit(2) from exc
    console.print(f"{report.samples} ChatML samples under {report.folder}: {report.train_shards} train shards, "
                  f"{report.val_shards} validation; Energon-prepared for Megatron-Bridge "
                  f"(dataset.path={report.folder})", markup=False)


@app.command("hf-proxy")
def hf_proxy(
    out_dir: Path = typer.Argument(..., help="Folder to write the checkpoint directory into."),
    shape_name: str = typer.Option("tiny", "--shape", help="tiny (CPU tests) or h200 (one-GPU campaigns)."),
) -> None:
    """A small Qwen3-VL-MoE checkpoint directory (config, BPE tokenizer, image processor), made offline,
    that Megatron-Bridge's AutoBridge reads as it reads a user's."""
    from trainables.bridge.hf_proxy import PROXY_SHAPES, write_qwen3_vl_moe_proxy

    if shape_name not in PROXY_SHAPES:
        raise typer.BadParameter(f"expected one of {', '.join(PROXY_SHAPES)}, got {shape_name!r}", param_hint="--shape")
    shape = PROXY_SHAPES[shape_name]
    try:
        folder = write_qwen3_vl_moe_proxy(out_dir, shape)
    except ImportError as exc:  # transformers (and its tokenizers) are the bridge extra's
        console.print(f"autotune data hf-proxy needs transformers ({exc}): pip install -e '.[bridge]'",
                      style="red", markup=False)
        raise typer.Exit(2) from exc
    console.print(f"Qwen3-VL-MoE proxy in {folder}: {shape.decoder_layers} decoder layers of {shape.experts} experts "
                  f"(top-{shape.experts_per_token}), hidden {shape.hidden_size}, {shape.vision_layers} ViT layers; "
                  f"tokenizer, chat template and image processor beside config.json")
