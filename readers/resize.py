"""Many windows resized at once: torch's antialiased bilinear resize as two matrix products.

On a GPU, resizing a batch image by image costs a few kernel launches and tens of µs of
host time per image (benchmarks/suites/gpu_host.py), so the host, not the GPU, sets the
pace of GPUDecoder. Here a batch takes a fixed number of launches, however many images:

- the images go into one flat buffer, and each window's rows are gathered from it into one
  zero-padded N x H x C x W tensor (through a view whose rows start at every element, so
  the gather's index holds one entry per row, not per pixel);
- a resize is separable and linear: out = Wy @ window @ Wx^T. Wy (out_h x H) and Wx
  (out_w x W) hold the weight F.interpolate(mode="bilinear", antialias=True,
  align_corners=False) gives each input pixel: a triangle filter, widened by the scale
  when shrinking, cut to torch's window and renormalised at the borders. Weights past a
  window's own size are zero, so the padding adds nothing;
- the matrices are built on the device from the windows' sizes, a few batched ops each.

The result is each window resized with F.interpolate in float, to float rounding (the
tests hold it within 1e-3 of a level). The products are float32 matrix products, so where
the caller lets them run in TF32 (torch.backends.cuda.matmul, a process-wide setting that
is theirs: torch raises when its two APIs for it are mixed, so it is neither read nor
changed here), a pixel can land a level off; F.interpolate itself ignores that setting.

Windows are grouped so that no group's largest tensor passes `budget` elements (see
groups): one large window does not pad the whole batch to its size.
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch

# Elements of a group's largest float tensor: 128 MiB of them. A batch of 256 of the
# standard corpus's images then takes 5 groups and peaks near 360 MiB beside its images
# (measured on the CPU, which holds the same tensors; 1 << 26 peaked near 550 MiB).
BUDGET = 1 << 25


def resize_windows(images: Sequence[torch.Tensor], windows: Sequence[tuple[int, int, int, int]],
                   size: tuple[int, int], resized: Sequence[tuple[int, int, int, int]] | None = None,
                   rounded: bool = False, budget: int = BUDGET) -> torch.Tensor:
    """An N x C x out_h x out_w float32 batch: window i of CxHxW uint8 image i, resized.

    windows: (top, left, h, w) of each image. resized: (height, width, top, left) per image,
    to resize its window to height x width and keep the `size` window at (top, left) of
    that, as Resize then CenterCrop do; by default each window is resized to `size`.
    rounded: uint8 out, each group rounded as it is done (a quarter of the float batch's memory).
    """
    out_h, out_w = size = checked_size(size)
    if resized is None:
        resized = [(out_h, out_w, 0, 0)] * len(images)
    windows, resized = check_batch(images, windows, resized, size)
    first = images[0]
    out = torch.empty((len(images), first.shape[0], out_h, out_w), dtype=torch.uint8 if rounded else torch.float32,
                      device=first.device)
    for group in groups(windows, first.shape[0], size, budget):
        done = resize_group([images[i] for i in group], [windows[i] for i in group],
                            [resized[i] for i in group], size)
        if rounded:
            done = to_uint8(done)
        out.index_copy_(0, torch.tensor(group, device=out.device), done)
    return out


def to_uint8(floats: torch.Tensor) -> torch.Tensor:
    """Rounds resized floats back to uint8, in place before the one conversion."""
    return floats.round_().clamp_(0, 255).to(torch.uint8)


def checked_size(size) -> tuple[int, int]:
    try:
        out_h, out_w = (operator.index(v) for v in size)
    except (TypeError, ValueError):
        raise ValueError(f"resize_windows: size must be two whole numbers (height, width), not {size!r}") from None
    if out_h < 1 or out_w < 1:
        raise ValueError(f"resize_windows: size must be positive, not {size!r}")
    return out_h, out_w


def check_batch(images, windows, resized, size) -> tuple[list, list]:
    """The windows and resized sizes as tuples of ints, once every image, window and output
    is checked to fit: ValueError naming the first that does not."""
    if not (len(images) == len(windows) == len(resized)):
        raise ValueError(f"resize_windows: {len(images)} images, {len(windows)} windows, {len(resized)} sizes")
    if not images:
        raise ValueError("resize_windows: no images")
    out_h, out_w = size
    channels = images[0].shape[0] if images[0].ndim == 3 else None
    checked_windows, checked_resized = [], []
    for i, (image, window, kept) in enumerate(zip(images, windows, resized)):
        if image.ndim != 3 or image.shape[0] != channels or image.dtype != torch.uint8:
            raise ValueError(f"resize_windows: image {i} is {tuple(image.shape)} {image.dtype}; every image must "
                             f"be a CxHxW uint8 tensor with image 0's channels ({tuple(images[0].shape)})")
        try:
            top, left, h, w = map(operator.index, window)
            rh, rw, kept_top, kept_left = map(operator.index, kept)
        except (TypeError, ValueError):
            raise ValueError(f"resize_windows: image {i}'s window {window!r} and size {kept!r} must be four "
                             "whole numbers each") from None
        height, width = image.shape[1:]
        if not (0 <= top and 0 < h and top + h <= height and 0 <= left and 0 < w and left + w <= width):
            raise ValueError(f"resize_windows: window (top={top}, left={left}, h={h}, w={w}) is not inside "
                             f"image {i}, a {height}x{width} image")
        if not (0 <= kept_top and kept_top + out_h <= rh and 0 <= kept_left and kept_left + out_w <= rw):
            raise ValueError(f"resize_windows: a {out_h}x{out_w} output at ({kept_top}, {kept_left}) is not "
                             f"inside image {i}'s {rh}x{rw} resized window")
        checked_windows.append((top, left, h, w))
        checked_resized.append((rh, rw, kept_top, kept_left))
    return checked_windows, checked_resized


def groups(windows: Sequence[tuple[int, int, int, int]], channels: int, size: tuple[int, int],
           budget: int) -> list[list[int]]:
    """Indexes of windows in groups, by their longer side (tall before wide where it ties),
    each within `budget` elements of the largest float tensor a group makes: channels x (the
    tallest window or output) x (the widest window or output), times the group's size. A
    window larger than that on its own makes a group of one."""
    out_h, out_w = size
    order = sorted(range(len(windows)), key=lambda i: longer_side_then_tall(windows[i]))
    found, group, most_h, most_w = [], [], 0, 0
    for i in order:
        _, _, h, w = windows[i]
        h, w = max(h, out_h), max(w, out_w)
        grown_h, grown_w = max(most_h, h), max(most_w, w)
        if group and (len(group) + 1) * channels * grown_h * grown_w > budget:
            found.append(group)
            group, grown_h, grown_w = [], h, w
        group.append(i)
        most_h, most_w = grown_h, grown_w
    return found + [group]


def longer_side_then_tall(window: tuple[int, int, int, int]) -> tuple[int, bool]:
    _, _, h, w = window
    return max(h, w), h > w


def resize_group(images: list, windows: list, resized: list, size: tuple[int, int]) -> torch.Tensor:
    channels, device = images[0].shape[0], images[0].device
    out_h, out_w = size
    n, height, width = len(images), max(w[2] for w in windows), max(w[3] for w in windows)
    spec = torch.tensor([(h, w, rh, rw, top, left) for (_, _, h, w), (rh, rw, top, left) in zip(windows, resized)],
                        dtype=torch.float32).to(device, non_blocking=True)
    # Each step drops what it no longer needs: a group's peak stays near its padded windows in float32.
    wy = weights(spec[:, 0], spec[:, 2], spec[:, 4], out_h, height)  # n x out_h x H
    wx = weights(spec[:, 1], spec[:, 3], spec[:, 5], out_w, width)  # n x out_w x W
    floats = gathered_rows(images, windows, height, width).view(n, height, channels * width).float()  # n x H x C x W
    tall = torch.bmm(wy, floats)  # n x out_h x (C*W)
    del floats, wy
    both = torch.bmm(tall.view(n, out_h * channels, width), wx.transpose(1, 2))  # n x (out_h*C) x out_w
    return both.view(n, out_h, channels, out_w).permute(0, 2, 1, 3)


def gathered_rows(images: list, windows: list, height: int, width: int) -> torch.Tensor:
    """The windows' pixels, padded to height x width (the largest window's): n x H x C x W
    uint8 (rows past a window's height, and columns past its width, hold other pixels;
    their weights are 0)."""
    channels, device = images[0].shape[0], images[0].device
    starts, offset = [], 0
    for image, (top, left, _, _) in zip(images, windows):
        plane = image.shape[1] * image.shape[2]
        starts.append((offset + top * image.shape[2] + left, image.shape[2], plane))
        offset += channels * plane
    # Row r of channel c of window i starts at start_i + r * W_i + c * H_i * W_i.
    flat = torch.cat([image.reshape(-1) for image in images] + [images[0].new_zeros(width)])
    spec = torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True)
    heights = torch.tensor([w[2] for w in windows], dtype=torch.int64).to(device, non_blocking=True)
    r = torch.arange(height, device=device).view(1, height, 1)
    c = torch.arange(channels, device=device).view(1, 1, channels)
    index = spec[:, 0].view(-1, 1, 1) + r * spec[:, 1].view(-1, 1, 1) + c * spec[:, 2].view(-1, 1, 1)
    index = torch.where(r < heights.view(-1, 1, 1), index, 0)  # past the window: any real row
    return flat.unfold(0, width, 1)[index]


def weights(sizes: torch.Tensor, resized: torch.Tensor, offsets: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """n x count x length float32: row o of matrix i weights input pixel j of a window of
    sizes[i] pixels resized to resized[i], for output pixel offsets[i] + o (torch's
    antialiased bilinear: aten/src/ATen/native/UpSample.h, _compute_weights_aa, in float32
    as torch computes it for float input)."""
    scale = (sizes / resized).view(-1, 1, 1)
    shrinking = scale >= 1.0
    support = torch.where(shrinking, scale, 1.0)
    inverse = torch.where(shrinking, 1.0 / scale, 1.0)
    centre = scale * (offsets.view(-1, 1, 1) + torch.arange(count, device=sizes.device).view(1, -1, 1) + 0.5)
    j = torch.arange(length, device=sizes.device, dtype=torch.float32).view(1, 1, -1)
    # torch's window: [trunc(centre - support + 0.5), trunc(centre + support + 0.5)), within the input.
    outside = (j < (centre - support + 0.5).trunc()) | (j >= torch.minimum(
        (centre + support + 0.5).trunc(), sizes.view(-1, 1, 1)))
    tent = (j + 0.5 - centre).mul_(inverse).abs_().neg_().add_(1.0).clamp_(min=0.0).masked_fill_(outside, 0.0)
    del outside
    return tent.div_(tent.sum(-1, keepdim=True))
