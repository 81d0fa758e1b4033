"""readers.resize: many windows resized at once equal F.interpolate's antialiased bilinear, window by window."""
import random

import pytest
import torch
import torch.nn.functional as F

from readers.resize import groups, resize_windows

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def interpolated(image, window, size):
    top, left, h, w = window
    crop = image[None, :, top:top + h, left:left + w].float()
    return F.interpolate(crop, size=size, mode="bilinear", align_corners=False, antialias=True)[0]


def random_windows(count, seed, channels=3, most=300):
    rng, pixels = random.Random(seed), torch.Generator().manual_seed(seed)  # not torch's global one: other tests draw from it
    images, windows = [], []
    for _ in range(count):
        height, width = rng.randint(1, most), rng.randint(1, most)
        h, w = rng.randint(1, height), rng.randint(1, width)
        images.append(torch.randint(0, 256, (channels, height, width), dtype=torch.uint8, generator=pixels))
        windows.append((rng.randint(0, height - h), rng.randint(0, width - w), h, w))
    return images, windows


@pytest.mark.parametrize("size", [(224, 224), (48, 64), (5, 300), (1, 1)])
def test_each_window_is_resized_as_interpolate_resizes_it(size):
    """Shrinking and enlarging, 1-pixel windows and whole images, in groups small enough that
    several form and the largest window makes a group alone."""
    images, windows = random_windows(40, seed=size[0])
    images.append(torch.randint(0, 256, (3, 280, 290), dtype=torch.uint8))
    windows.append((0, 0, 280, 290))
    out = resize_windows(images, windows, size, budget=3 * 200 * 200)
    assert out.shape == (len(images), 3, *size) and out.dtype == torch.float32 and out.is_contiguous()
    for image, window, resized in zip(images, windows, out):
        assert (resized - interpolated(image, window, size)).abs().max() < 1e-3, window


def test_rounded_to_uint8_a_pixel_is_at_most_one_level_off_and_rarely():
    """What the GPU transforms hand out: against F.interpolate window by window, rounded,
    only values within float rounding of a half can differ (6e-6 of pixels here)."""
    from readers.transforms import resized_float, to_uint8

    images, windows = random_windows(30, seed=5, most=400)
    ours = resize_windows(images, windows, (224, 224), rounded=True, budget=3 * 300 * 300)
    # The same groups, rounded at the end: equal. Other groups may differ by float rounding,
    # which the comparison with interpolate below bounds.
    assert torch.equal(ours, to_uint8(resize_windows(images, windows, (224, 224), budget=3 * 300 * 300)))
    theirs = torch.cat([to_uint8(resized_float(image[:, t:t + h, l:l + w], (224, 224)))
                        for image, (t, l, h, w) in zip(images, windows)])
    gap = (ours.int() - theirs.int()).abs()
    assert gap.max() <= 1 and (gap > 0).float().mean() < 1e-4


def test_resize_then_keep_a_window_is_resize_then_center_crop():
    """`resized`: each window resized to its own size, then the output window kept, as
    Resize(256) + CenterCrop(224) do, on whole images and on windows of them."""
    images, windows = random_windows(12, seed=7)
    rng = random.Random(8)
    resized = []
    for _, _, h, w in windows:
        rh, rw = rng.randint(20, 400), rng.randint(20, 400)
        resized.append((rh, rw, rng.randint(0, rh - 20), rng.randint(0, rw - 20)))
    out = resize_windows(images, windows, (20, 20), resized)
    for image, window, (rh, rw, top, left), got in zip(images, windows, resized, out):
        whole = interpolated(image, window, (rh, rw))[:, top:top + 20, left:left + 20]
        assert (got - whole).abs().max() < 1e-3


def test_one_channel_images_and_views_of_channels_last_memory():
    gray, windows = random_windows(6, seed=3, channels=1)
    out = resize_windows(gray, windows, (32, 32))
    assert out.shape == (6, 1, 32, 32)
    for image, window, got in zip(gray, windows, out):
        assert (got - interpolated(image, window, (32, 32))).abs().max() < 1e-3
    hwc = torch.randint(0, 256, (50, 70, 3), dtype=torch.uint8)
    chw = hwc.permute(2, 0, 1)  # what readers.transforms.as_chw makes of a decoded array
    got = resize_windows([chw], [(5, 7, 40, 33)], (16, 16))[0]
    assert (got - interpolated(chw, (5, 7, 40, 33), (16, 16))).abs().max() < 1e-3


def test_groups_keep_each_group_within_the_budget_and_tall_apart_from_wide():
    windows = [(0, 0, h, w) for h, w in [(10, 10), (300, 300), (20, 30), (10, 12), (200, 100), (5, 5)]]
    found = groups(windows, 3, (8, 8), budget=3 * 100 * 100)
    assert sorted(i for group in found for i in group) == list(range(len(windows)))
    for group in found:
        padded = len(group) * 3 * max(windows[i][2] for i in group) * max(windows[i][3] for i in group)
        assert padded <= 3 * 100 * 100 or len(group) == 1
    assert [1] in found and [4] in found  # each larger than the budget alone
    # Enlarged to the output, a thin window makes output-sized tensors: those count too.
    assert len(groups([(0, 0, 1, 4000)] * 64, 3, (224, 224), budget=1 << 25)) > 1
    # Tall and wide windows of one area, sorted by area alone, would alternate into groups of one.
    mixed = [(0, 0, 100, 3000), (0, 0, 3000, 100)] * 32
    assert len(groups(mixed, 3, (224, 224), budget=1 << 25)) <= 2 * len(groups(mixed[::2], 3, (224, 224), 1 << 25))


def test_bad_batches_are_refused_with_what_is_wrong():
    images, windows = random_windows(2, seed=1)
    with pytest.raises(ValueError, match="2 images, 1 windows"):
        resize_windows(images, windows[:1], (8, 8))
    with pytest.raises(ValueError, match="no images"):
        resize_windows([], [], (8, 8))
    gray = torch.zeros(1, 20, 20, dtype=torch.uint8)
    for budget in (1, 1 << 25):  # whichever image a group starts with, the batch is checked as a whole
        with pytest.raises(ValueError, match="image 1 is \\(1, 20, 20\\).*image 0's channels"):
            resize_windows([images[0], gray], [(0, 0, 1, 1), (0, 0, 5, 5)], (8, 8), budget=budget)
    with pytest.raises(ValueError, match="image 0 is \\(20, 30\\)"):
        resize_windows([torch.zeros(20, 30, dtype=torch.uint8)], [(0, 0, 5, 5)], (8, 8))
    image = torch.zeros(3, 10, 10, dtype=torch.uint8)
    for window in [(0, 0, 11, 5), (-1, 0, 5, 5), (0, 6, 5, 5), (0, 0, 0, 5)]:
        with pytest.raises(ValueError, match="not inside image 0, a 10x10 image"):
            resize_windows([image], [window], (8, 8))
    with pytest.raises(ValueError, match="must be four whole numbers"):
        resize_windows([image], [(0, 0, 5.5, 5)], (8, 8))
    with pytest.raises(ValueError, match="8x8 output at \\(0, 3\\) is not inside image 0's 10x10"):
        resize_windows([image], [(0, 0, 10, 10)], (8, 8), [(10, 10, 0, 3)])
    for size in [(0, 8), (8, -1), (8.0, 8), (8,)]:
        with pytest.raises(ValueError, match="size must be"):
            resize_windows([image], [(0, 0, 5, 5)], size)


@cuda
def test_on_the_gpu_the_values_are_interpolates_and_under_tf32_within_a_level():
    """At full float32 (torch's default) the GPU gives interpolate's values; where a training
    script lets matmuls run in TF32, whose mantissa has 10 bits, they stay within a level."""
    images, windows = random_windows(64, seed=11, most=600)
    images = [image.cuda() for image in images]

    def worst() -> float:
        out = resize_windows(images, windows, (224, 224))
        return max((got - interpolated(image, window, (224, 224))).abs().max().item()
                   for image, window, got in zip(images, windows, out))

    assert worst() < 1e-2
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert worst() < 1.0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
