"""readers.transforms: torchvision's crop semantics, decode-aware scaling, uint8 output."""
import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import readers.transforms as T
from readers.decode import decode_array
from readers.transforms import RandomResizedCrop, ResizeCenterCrop, random_resized_crop_params, resized_size


def encode(height, width, mode="RGB", fmt="JPEG", seed=0):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(max(2, height // 24), max(2, width // 24), 3), dtype=np.uint8)
    im = Image.fromarray(small).resize((width, height), Image.BILINEAR).convert(mode)
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def reference_get_params(height, width, scale, ratio):
    """torchvision.transforms.RandomResizedCrop.get_params (v0.15-0.20), verbatim apart from the signature."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


SIZES = [(375, 500), (500, 375), (224, 224), (64, 2000), (2000, 64), (1, 1), (7, 300)]
SCALES = [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (3 / 4, 4 / 3)), ((0.5, 1.0), (1.0, 1.0))]


@pytest.mark.parametrize("scale,ratio", SCALES)
def test_crop_params_match_torchvision_draw_for_draw(scale, ratio):
    for seed, (h, w) in enumerate(SIZES * 30):
        torch.manual_seed(seed)
        expected = reference_get_params(h, w, scale, ratio)
        torch.manual_seed(seed)
        assert random_resized_crop_params(h, w, scale, ratio) == expected, (seed, h, w)
        # and the generator is left where torchvision leaves it
        torch.manual_seed(seed)
        reference_get_params(h, w, scale, ratio)
        after_reference = torch.rand(1)
        torch.manual_seed(seed)
        random_resized_crop_params(h, w, scale, ratio)
        assert torch.equal(torch.rand(1), after_reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_batch_of_crop_and_flip_draws_is_torchvisions_under_either_default_dtype(dtype):
    """Image after image, as RandomResizedCrop(flip=).batch draws: the windows and flips of
    Compose([RandomResizedCrop, RandomHorizontalFlip]) and the generator left where they
    leave it, also with float64 as the default dtype (where torch.rand draws 64 bits)."""
    crop, saved = RandomResizedCrop(8, flip=0.5), torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(11)
        expected = [(reference_get_params(h, w, crop.scale, crop.ratio), bool(torch.rand(1) < 0.5))
                    for h, w in SIZES * 8]
        after = torch.rand(1)
        torch.manual_seed(11)
        drawn = [crop.draw(h, w) for h, w in SIZES * 8]
        assert drawn == expected and torch.equal(torch.rand(1), after)
    finally:
        torch.set_default_dtype(saved)


def test_flip_draws_compare_in_the_draws_dtype_as_torch_does():
    """torchvision flips when torch.rand(1) < p, compared in float32: p just above a float32
    draw rounds down to it, and that draw does not flip (in double it would)."""
    from readers.transforms import RandomHorizontalFlip

    torch.manual_seed(0)
    drawn = torch.rand(1).item()
    p = math.nextafter(drawn, 1.0)
    torch.manual_seed(0)
    assert not bool(torch.rand(1) < p)  # torchvision's comparison
    torch.manual_seed(0)
    assert not T.flip_drawn(p)  # what RandomResizedCrop(flip=p) compares
    torch.manual_seed(0)
    assert RandomHorizontalFlip(p)(torch.arange(2).view(1, 1, 2)).flatten().tolist() == [0, 1]
    torch.manual_seed(0)
    above = RandomHorizontalFlip(p + 1e-7)  # past the next float32: this draw flips
    assert above(torch.arange(2).view(1, 1, 2)).flatten().tolist() == [1, 0]


def test_crop_params_match_real_torchvision_when_installed():
    tv = pytest.importorskip("torchvision.transforms")
    crop = tv.RandomResizedCrop(224)
    for seed, (h, w) in enumerate(SIZES * 10):
        torch.manual_seed(seed)
        expected = crop.get_params(torch.empty(3, h, w), crop.scale, crop.ratio)
        torch.manual_seed(seed)
        assert random_resized_crop_params(h, w, crop.scale, crop.ratio) == tuple(expected)


def test_crop_params_have_the_documented_distribution():
    g = torch.Generator().manual_seed(0)
    h, w = 400, 400  # square, so tall and wide windows are equally likely to fit
    areas, ratios = [], []
    for _ in range(3000):
        top, left, ch, cw = random_resized_crop_params(h, w, generator=g)
        assert 0 <= top <= h - ch and 0 <= left <= w - cw and ch > 0 and cw > 0
        areas.append(ch * cw / (h * w))
        ratios.append(cw / ch)
    areas, log_ratios = np.array(areas), np.log(ratios)
    # Accepted draws are uniform in area on [0.08, 1] and log-uniform in ratio, less the
    # draws that do not fit (large areas at extreme ratios), which pull the means down a little.
    assert areas.min() >= 0.075 and areas.max() <= 1.0
    assert 0.40 < areas.mean() < 0.52
    assert log_ratios.min() >= math.log(3 / 4) - 0.02 and log_ratios.max() <= math.log(4 / 3) + 0.02
    assert abs(log_ratios.mean()) < 0.02


def test_crop_params_fall_back_to_a_centred_crop():
    # No area in [0.99, 1] fits a 4/3 ratio bound in a 100:1 image: take the widest allowed window.
    assert random_resized_crop_params(10, 1000, scale=(0.99, 1.0)) == (0, 493, 10, 13)
    assert random_resized_crop_params(1000, 10, scale=(0.99, 1.0)) == (493, 0, 13, 10)


def crop_resize_reference(chw, top, left, h, w, size=(224, 224)):
    return F.interpolate(chw[:, top:top + h, left:left + w].unsqueeze(0), size=size, mode="bilinear",
                         antialias=True, align_corners=False)[0]


def test_random_resized_crop_on_arrays_is_crop_then_antialiased_resize():
    array = decode_array(encode(300, 410))
    chw = torch.from_numpy(array).permute(2, 0, 1).contiguous()
    for seed in range(5):
        torch.manual_seed(seed)
        out = RandomResizedCrop(224, flip=0.0)(array)
        torch.manual_seed(seed)
        expected = crop_resize_reference(chw, *random_resized_crop_params(300, 410))
        assert out.dtype == torch.uint8 and out.shape == (3, 224, 224) and out.is_contiguous()
        assert torch.equal(out, expected)


def test_crops_of_decoded_images_reach_torchs_channels_last_kernel():
    # A crop view of a decoded HxWx3 image must be seen as channels-last, or interpolate
    # silently runs its slower NCHW path.
    crop = torch.from_numpy(decode_array(encode(300, 410))).permute(2, 0, 1)[:, 10:250, 20:300]
    batch = T._batch_of_one(crop)
    assert torch.equal(batch[0], crop)
    out = F.interpolate(batch, size=(224, 224), mode="bilinear", antialias=True)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    resized = T.resize(crop, (224, 224))
    assert resized.is_contiguous() and torch.equal(resized, out[0])


def test_bytes_without_dct_equal_the_array_path_and_tensors_too():
    data = encode(333, 500)
    array = decode_array(data)
    for seed in range(5):
        torch.manual_seed(seed)
        from_bytes = RandomResizedCrop(224, dct=False)(data)
        torch.manual_seed(seed)
        from_array = RandomResizedCrop(224, dct=False)(array)
        torch.manual_seed(seed)
        from_tensor = RandomResizedCrop(224)(torch.from_numpy(array).permute(2, 0, 1))
        assert torch.equal(from_bytes, from_array) and torch.equal(from_array, from_tensor)


def test_flip_follows_the_crop_draw_like_torchvision():
    data = encode(300, 300)
    torch.manual_seed(3)
    flipped = RandomResizedCrop(128, flip=1.0)(data)
    torch.manual_seed(3)
    plain = RandomResizedCrop(128, flip=0.0)(data)
    torch.manual_seed(3)
    random_resized_crop_params(300, 300)
    draw = torch.rand(1).item()
    torch.manual_seed(3)
    half = RandomResizedCrop(128, flip=0.5)(data)
    assert torch.equal(flipped, plain.flip(-1))
    assert torch.equal(half, flipped if draw < 0.5 else plain)


def test_dct_decode_scales_only_as_far_as_the_window_allows(monkeypatch):
    seen = []

    def spy(data, where=None, min_size=None, **limits):
        out = decode_array(data, where, min_size, **limits)
        seen.append(out.shape[:2])
        return out

    monkeypatch.setattr(T, "decode_array", spy)
    data = encode(1600, 1200)
    torch.manual_seed(0)
    crop = RandomResizedCrop(224, flip=0.0)
    scaled = []
    for seed in range(40):
        torch.manual_seed(seed)
        top, left, h, w = random_resized_crop_params(1600, 1200)
        torch.manual_seed(seed)
        out = crop(data)
        dec_h, dec_w = seen[-1]
        k = 1600 / dec_h
        scaled.append(k > 1)
        # the window in the decoded image still has at least the output's pixels (1 px rounding)
        assert h / k >= 224 - 1 and w / k >= 224 - 1
        assert k in (1, 2, 4, 8)
        if k > 1:  # and it was the smallest power of two that did
            assert h / (2 * k) < 224 or w / (2 * k) < 224 or k == 8
        assert out.shape == (3, 224, 224)
    assert any(scaled) and not all(scaled)


def test_dct_output_stays_close_to_the_full_decode():
    data = encode(1200, 1600, seed=2)
    for seed in range(8):
        torch.manual_seed(seed)
        fast = RandomResizedCrop(224)(data).float()
        torch.manual_seed(seed)
        exact = RandomResizedCrop(224, dct=False)(data).float()
        # The scaled window is placed to the nearest decoded pixel (under half an output
        # pixel off), so textures shift slightly; colours and brightness must not.
        assert (fast - exact).abs().mean() < 8.0
        assert (fast.mean((1, 2)) - exact.mean((1, 2))).abs().max() < 1.0


@pytest.mark.parametrize("mode,fmt", [("L", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG")])
def test_transforms_give_three_channels_for_any_input(mode, fmt):
    data = encode(260, 300, mode, fmt)
    assert RandomResizedCrop(224)(data).shape == (3, 224, 224)
    assert ResizeCenterCrop(224)(data).shape == (3, 224, 224)


def test_the_batched_form_draws_the_same_windows_and_flips_as_image_by_image():
    """transform.batch (the GPU's form: float resize, one rounding and flip for the batch), run
    here on the CPU against __call__'s uint8 kernel: the same seed must give the same windows
    and flips, so the two differ by rounding alone."""
    images = [T.as_chw(decode_array(encode(h, w, seed=h))) for h, w in ((90, 120), (224, 224), (300, 200), (57, 80))]
    for transform in (RandomResizedCrop(64, flip=0.5), RandomResizedCrop(224, scale=(1, 1), ratio=(1, 1)),
                      ResizeCenterCrop(48, 56)):
        torch.manual_seed(3)
        one_by_one = torch.stack([transform(image) for image in images])
        torch.manual_seed(3)
        batched = transform.batch(images)
        assert batched.shape == one_by_one.shape and batched.dtype == torch.uint8
        assert (batched.int() - one_by_one.int()).abs().max() <= 2, transform
        assert (batched.float() - one_by_one.float()).abs().mean() < 0.5, transform
    flips = T.flip_some(torch.arange(8.0).view(2, 1, 1, 4), [True, False])
    assert flips[0, 0, 0].tolist() == [3, 2, 1, 0] and flips[1, 0, 0].tolist() == [4, 5, 6, 7]


def test_resized_size_matches_torchvision_resize_int():
    assert resized_size(375, 500, 256) == (256, 341)
    assert resized_size(500, 375, 256) == (341, 256)
    assert resized_size(100, 100, 256) == (256, 256)


def test_center_crop_is_resize_then_centre_crop():
    data = encode(375, 500)
    chw = torch.from_numpy(decode_array(data)).permute(2, 0, 1).contiguous()
    resized = F.interpolate(chw.unsqueeze(0), size=(256, 341), mode="bilinear", antialias=True,
                            align_corners=False)[0]
    top, left = int(round((256 - 224) / 2.0)), int(round((341 - 224) / 2.0))
    expected = resized[:, top:top + 224, left:left + 224]
    assert torch.equal(ResizeCenterCrop(224, 256, dct=False)(data), expected)
    assert torch.equal(ResizeCenterCrop(224, 256)(chw), expected)
    fast = ResizeCenterCrop(224, 256)(encode(1200, 1600))
    assert fast.shape == (3, 224, 224) and fast.is_contiguous()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="scale and ratio"):
        RandomResizedCrop(224, scale=(1.0, 0.5))
    with pytest.raises(ValueError, match="resize >= 300"):
        ResizeCenterCrop(300, resize=256)(encode(100, 100))


def test_every_file_of_a_tricky_tree_becomes_a_fixed_size_rgb_crop(image_tree):
    from readers import FolderDataset

    for transform in (RandomResizedCrop(32), ResizeCenterCrop(32, 36)):
        dataset = FolderDataset(str(image_tree), decode="raw", transform=transform)
        shapes = {tuple(dataset[i][0].shape) for i in range(len(dataset))}
        assert shapes == {(3, 32, 32)}


def test_a_broken_file_is_named_in_the_error(bad_tree):
    from packer.errors import CorruptDataError
    from readers import FolderDataset

    dataset = FolderDataset(str(bad_tree), decode="raw", transform=RandomResizedCrop(32))
    index = list(dataset.paths).index("bad/truncated.jpg")
    with pytest.raises(CorruptDataError, match=r"bad/truncated\.jpg: cannot decode") as info:
        dataset[index]
    assert info.value.path.endswith("bad/truncated.jpg")


def test_same_names_mean_what_they_mean_in_torchvision():
    """RandomResizedCrop does not flip unless asked; CenterCrop only crops (padding with
    zeros, as torchvision does); RandomHorizontalFlip flips as a separate step, with the
    draw a fused flip= makes."""
    from readers.transforms import CenterCrop, RandomHorizontalFlip

    data = encode(300, 400)
    torch.manual_seed(5)
    default = RandomResizedCrop(128)(data)
    torch.manual_seed(5)
    assert torch.equal(default, RandomResizedCrop(128, flip=0.0)(data))
    torch.manual_seed(5)
    composed = RandomHorizontalFlip(0.5)(RandomResizedCrop(128)(data))
    torch.manual_seed(5)
    assert torch.equal(composed, RandomResizedCrop(128, flip=0.5)(data))
    full = torch.from_numpy(decode_array(data)).permute(2, 0, 1)
    assert torch.equal(CenterCrop(100)(data), full[:, 100:200, 150:250])
    assert torch.equal(CenterCrop((300, 400))(data), full)  # no resize, ever
    padded = CenterCrop((310, 404))(full)
    assert padded.shape == (3, 310, 404) and torch.equal(padded[:, 5:305, 2:402], full)
    assert int(padded[:, :5].sum()) == 0 and int(padded[:, :, :2].sum()) == 0


@pytest.mark.parametrize("mode", ["pil", "tensor"])
def test_torchvision_v2_transforms_accept_what_the_datasets_return(tmp_path, mode):
    v2 = pytest.importorskip("torchvision.transforms.v2", reason="torchvision is not installed here")
    from packer import pack
    from readers import LMDBDataset

    src = tmp_path / "src"
    for i in range(3):
        (src / "c").mkdir(parents=True, exist_ok=True)
        (src / "c" / f"{i}.jpg").write_bytes(encode(60 + i, 80))
    pack(str(src), "lmdb", str(tmp_path / "d.lmdb"), progress=False, workers=1)
    transform = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(32), v2.ToDtype(torch.float32, scale=True)])
    image, label = LMDBDataset(tmp_path / "d.lmdb", decode=mode, transform=transform)[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label == 0
