"""readers.decode: always-RGB uint8 decode, DCT-scaled decode, header sizes, error naming."""
import io

import numpy as np
import pytest
from PIL import Image

from conftest import SHARED_DATA, jpeg_12bit
from packer.errors import CorruptDataError
from readers.decode import (DECODE_MODES, dct_factor, decode, decode_array, decode_pil, decode_tensor,
                            image_size, turbo_decodable)

SAMPLE = SHARED_DATA / "imagenet-sample"


def encode(height, width, mode="RGB", fmt="JPEG", seed=0, **save):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    im = Image.fromarray(small).resize((width, height), Image.BILINEAR).convert(mode)
    buf = io.BytesIO()
    im.save(buf, fmt, **save)
    return buf.getvalue()


def sample_files():
    if not SAMPLE.is_dir():
        pytest.skip(f"real sample data not found at {SAMPLE} (set PACKER_SHARED_DATA)")
    return sorted(SAMPLE.rglob("*.JPEG"))


def test_real_jpegs_decode_to_rgb_identical_to_pillow():
    files = sample_files()
    grayscale = 0
    for path in files:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            grayscale += im.mode == "L"
        array = decode_array(data)
        assert array.dtype == np.uint8 and array.ndim == 3 and array.shape[2] == 3
        np.testing.assert_array_equal(array, np.asarray(decode_pil(data)), err_msg=str(path))
    assert grayscale > 0  # the sample holds grayscale JPEGs: they must come out RGB


@pytest.mark.parametrize("mode,fmt", [("L", "JPEG"), ("CMYK", "JPEG"), ("RGB", "PNG"), ("RGBA", "PNG"),
                                      ("P", "PNG"), ("L", "PNG")])
def test_every_mode_and_format_comes_out_rgb_like_pillow(mode, fmt):
    data = encode(40, 60, mode, fmt)
    array = decode_array(data)
    assert array.shape == (40, 60, 3) and array.dtype == np.uint8
    np.testing.assert_array_equal(array, np.asarray(decode_pil(data)))
    tensor = decode_tensor(data)
    assert tuple(tensor.shape) == (3, 40, 60)


def test_png_named_jpeg_and_cmyk_go_to_pillow():
    assert not turbo_decodable(encode(20, 20, "RGB", "PNG"))
    assert not turbo_decodable(encode(20, 20, "CMYK", "JPEG"))
    assert turbo_decodable(encode(20, 20, "L", "JPEG"))


@pytest.mark.parametrize("mode,fmt", [("RGB", "JPEG"), ("L", "JPEG"), ("CMYK", "JPEG"), ("RGB", "PNG")])
def test_image_size_reads_the_header(mode, fmt):
    assert image_size(encode(37, 91, mode, fmt)) == (37, 91)


def test_dct_factor_picks_the_smallest_scale_that_still_covers():
    assert dct_factor(1000, 800, None) == 1
    assert dct_factor(1000, 800, (100, 100)) == 8
    assert dct_factor(1000, 800, (125, 100)) == 8
    assert dct_factor(1000, 800, (126, 100)) == 4
    assert dct_factor(1000, 800, (400, 400)) == 2
    assert dct_factor(1000, 800, (401, 401)) == 1
    assert dct_factor(300, 200, (1000, 1000)) == 1


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
@pytest.mark.parametrize("min_size", [(1, 1), (60, 60), (100, 250), (251, 100), (600, 600)])
def test_scaled_decode_is_never_smaller_than_asked(mode, min_size):
    data = encode(501, 333, mode, "JPEG", subsampling=0 if mode != "RGB" else 2)
    k = dct_factor(501, 333, min_size)
    array = decode_array(data, min_size=min_size)
    assert array.shape == (-(-501 // k), -(-333 // k), 3)
    if min_size[0] <= 501 and min_size[1] <= 333:
        assert array.shape[0] >= min_size[0] and array.shape[1] >= min_size[1]
    if k > 1:  # and the scaled pixels are a downscale of the full decode, not something else
        full = decode_array(data).astype(np.float32)
        h, w = array.shape[0] - 1, array.shape[1] - 1  # skip the partial last block row/column
        blocks = full[:h * k, :w * k].reshape(h, k, w, k, 3).mean(axis=(1, 3))
        assert np.abs(blocks - array[:h, :w]).mean() < 4


def test_scaled_decode_of_non_jpeg_is_full_size():
    data = encode(80, 120, "RGB", "PNG")
    assert decode_array(data, min_size=(10, 10)).shape == (80, 120, 3)


def test_corrupt_bytes_raise_corrupt_data_error_without_a_path():
    data = encode(64, 64)
    for bad in (data[: len(data) // 2], b"not an image at all", b""):
        with pytest.raises(CorruptDataError, match="^image: cannot") as info:
            decode_array(bad)
        assert info.value.path is None
    with pytest.raises(CorruptDataError, match="^cat/x.jpg: cannot") as info:
        decode_array(b"junk", "cat/x.jpg")
    assert info.value.path == "cat/x.jpg"


def test_decode_modes_keep_their_contract():
    data = encode(10, 12)
    assert DECODE_MODES == ("pil", "tensor", "numpy", "raw")
    assert decode(data, "raw") is data
    assert decode(data, "pil").mode == "RGB"
    assert decode(data, "numpy").shape == (10, 12, 3)
    assert tuple(decode(data, "tensor").shape) == (3, 10, 12)
    with pytest.raises(ValueError, match="pil, tensor, numpy, raw"):
        decode(data, "jpeg")


@pytest.mark.parametrize("mode,fmt", [("RGB", "JPEG"), ("CMYK", "JPEG"), ("RGB", "PNG"), ("RGB", "BMP")])
def test_every_decode_path_refuses_an_image_over_max_pixels_from_its_header(mode, fmt):
    data = encode(40, 60, mode, fmt)
    calls = {"decode_pil": lambda limit: decode_pil(data, "cat/x", limit),
             "decode_array": lambda limit: decode_array(data, "cat/x", max_pixels=limit),
             "scaled decode_array": lambda limit: decode_array(data, "cat/x", (10, 10), limit),
             "decode_tensor": lambda limit: decode_tensor(data, "cat/x", max_pixels=limit),
             "image_size": lambda limit: image_size(data, "cat/x", limit),
             "decode": lambda limit: decode(data, "numpy", "cat/x", limit)}
    for name, call in calls.items():
        with pytest.raises(CorruptDataError, match="^cat/x: image too large: its header claims 60x40 = 2,400 "
                                                   "pixels, over the limit of 2,399.*max_pixels=") as info:
            call(2399)
        assert info.value.path == "cat/x", name
        call(2400)  # the limit itself is allowed


def test_a_max_pixels_above_pillows_limit_raises_pillows(monkeypatch):
    """Pillow refuses above its own process-wide limit whatever packer allows: a raised
    max_pixels raises Pillow's to match, so such an image is read, not refused."""
    from test_bomb import bmp_bomb

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    claims = bmp_bomb(20000, 10000)  # 2e8 pixels: over Pillow's default limit
    with pytest.raises(CorruptDataError, match=r"Pillow refuses it \(Image size \(200000000 pixels\)"):
        image_size(claims)
    assert Image.MAX_IMAGE_PIXELS == 178_956_970 // 2  # the default left alone
    assert image_size(claims, max_pixels=250_000_000) == (10000, 20000)
    assert Image.MAX_IMAGE_PIXELS == 250_000_000
    with pytest.raises(CorruptDataError, match="over the limit of 199,999,999"):
        image_size(claims, max_pixels=199_999_999)


@pytest.mark.parametrize("mode", [m for m in DECODE_MODES if m != "raw"])
def test_a_12_bit_jpeg_is_named_by_its_precision(mode):
    """No decoder here reads one (a pack refuses it): the error says why, not Pillow's
    "cannot identify image file"."""
    with pytest.raises(CorruptDataError, match=r"x\.jpg: 12-bit JPEG \(sample precision 12\)"):
        decode(jpeg_12bit(), mode, "x.jpg")
    with pytest.raises(CorruptDataError, match="12-bit JPEG"):
        decode_array(jpeg_12bit(64, 64), "x.jpg", min_size=(8, 8))
