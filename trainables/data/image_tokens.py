"""Qwen-VL ``smart_resize`` and patching: how many patches an image gives the vision encoder and
how many image tokens reach the decoder.

factor f = patch · merge (14·2 = 28 for Qwen2/2.5-VL, 16·2 = 32 for Qwen3-VL). Each side is
rounded to a multiple of f, then the area is scaled into [min_pixels, max_pixels] keeping the
aspect ratio. Encoder patches = (h'/p)·(w'/p); decoder image tokens = patches / merge².
"""

from __future__ import annotations

import math

import numpy as np
import torch


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width), multiples of ``factor``, area within the pixel bounds."""
    if height < 1 or width < 1:
        raise ValueError(f"image of {height}x{width} pixels has no area")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decoder_image_tokens(height: int, width: int, patch_size: int, merge: int) -> int:
    """Image tokens entering the decoder for an image already resized by :func:`smart_resize`."""
    return (height // patch_size) * (width // patch_size) // (merge * merge)


def to_patches(pixels: np.ndarray, patch_size: int, merge: int) -> torch.Tensor:
    """``[H, W, 3]`` uint8 → ``[H/p · W/p, 3·p·p]`` float patches, each merge×merge group contiguous.

    Contiguous groups let the projector merge 2×2 patches with a plain reshape.
    """
    height, width, channels = pixels.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    x = torch.from_numpy(np.array(pixels, dtype=np.uint8, copy=True)).float().div_(127.5).sub_(1.0)
    x = x.permute(2, 0, 1)  # [3, H, W]
    x = x.reshape(channels, grid_h // merge, merge, patch_size, grid_w // merge, merge, patch_size)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, 3, p, p]
    return x.reshape(grid_h * grid_w, channels * patch_size * patch_size)
