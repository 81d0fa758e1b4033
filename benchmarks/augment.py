"""The train-time augmentation every decode+augment case applies: random-resized-crop 224 + flip.

readers.transforms (uint8 throughout, no float round trip) is used when the installed
packer has it; otherwise a stand-in with the same parameters as
torchvision's RandomResizedCrop(224) + RandomHorizontalFlip, resizing with Pillow, runs
and the results say so. The PIL peer always uses the Pillow path, as most users do.
"""
from __future__ import annotations

import math
import random

from PIL import Image

SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)


def crop_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) drawn as torchvision's RandomResizedCrop.get_params draws it."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.randint(0, width - w), rng.randint(0, height - h)
            return left, top, left + w, top + h
    # Fallback to a central crop at the nearest allowed aspect ratio.
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif in_ratio > RATIO[1]:
        w, h = int(round(height * RATIO[1])), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def augment_pil(image: Image.Image, rng: random.Random = random) -> Image.Image:
    """RandomResizedCrop(224) + RandomHorizontalFlip on a PIL image (the torchvision path)."""
    box = crop_box(image.width, image.height, rng)
    out = image.resize((SIZE, SIZE), Image.BILINEAR, box=box)
    return out.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else out


def train_transform():
    """(transform, decode mode to build the dataset with, description): readers' own.

    readers.transforms.RandomResizedCrop takes the raw JPEG bytes, so it can decode at a
    reduced DCT scale; that saving is part of what packer offers, so the suite uses it.
    """
    from readers.transforms import RandomResizedCrop

    return RandomResizedCrop(SIZE, flip=0.5), "raw", "readers.transforms.RandomResizedCrop(224) (flip 0.5) on raw bytes"
