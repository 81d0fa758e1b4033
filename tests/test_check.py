import pytest

from packer.check import problem, sniff

from conftest import jpeg_12bit, jpeg_bytes, write
from packer import pack


@pytest.mark.parametrize("level", ["header", "full"])
@pytest.mark.parametrize("kind", ["RGB", "L", "CMYK", "PNG", "progressive"])
def test_valid_images_pass(kind, level):
    if kind == "PNG":
        data = jpeg_bytes(1, fmt="PNG")
    elif kind == "progressive":
        from PIL import Image
        import io
        buf = io.BytesIO()
        Image.open(io.BytesIO(jpeg_bytes(2, size=(120, 90)))).save(buf, "JPEG", progressive=True)
        data = buf.getvalue()
    else:
        data = jpeg_bytes(1, mode=kind)
    assert problem(data, level) is None


def test_trailing_bytes_after_end_marker_are_accepted():
    assert problem(jpeg_bytes(3) + b"\x00" * 100) is None


@pytest.mark.parametrize("level", ["header", "full"])
@pytest.mark.parametrize("cut", [0.1, 0.5, 0.99])
def test_truncated_jpeg_is_caught_without_decoding(cut, level):
    data = jpeg_bytes(4, size=(200, 150))
    reason = problem(data[: int(len(data) * cut)], level)
    assert reason is not None and "truncated" in reason


def test_truncated_png_is_caught():
    data = jpeg_bytes(5, size=(100, 80), fmt="PNG")
    assert "truncated PNG" in problem(data[: len(data) - 30])


@pytest.mark.parametrize("data,expected", [
    (b"", "empty file"),
    (b"hello, world", "not an image"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF", "truncated JPEG"),
])
def test_bad_bytes_get_a_reason(data, expected):
    assert expected in problem(data)


def test_full_check_catches_corrupt_scan_data_the_header_check_cannot_see():
    data = jpeg_bytes(6, size=(160, 120))
    damaged = data[: len(data) // 2] + b"\xff\xd9"  # cut short, but an end marker re-added
    assert problem(damaged, "header") is None
    assert "corrupt JPEG" in problem(damaged, "full")


def test_sniff_names_formats():
    assert sniff(jpeg_bytes(7)) == "jpeg"
    assert sniff(jpeg_bytes(7, fmt="PNG")) == "png"
    assert sniff(b"BM" + b"\0" * 20) == "bmp"
    assert sniff(b"GIF89a") is None


def test_header_check_of_a_jpeg_never_opens_pillow(monkeypatch):
    import packer.check

    def fail(*args, **kwargs):
        raise AssertionError("Pillow was used: the header check must stay cheap for JPEGs")

    monkeypatch.setattr(packer.check, "pillow_problem", fail)
    monkeypatch.setattr(packer.check, "strict_jpeg_problem", fail)
    assert problem(jpeg_bytes(8), "header") is None
    assert "truncated" in problem(jpeg_bytes(8)[:200], "header")


@pytest.mark.parametrize("level", ["header", "full"])
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "TIFF"])
def test_the_pixel_limit_is_inclusive_and_names_the_size(fmt, level):
    data = jpeg_bytes(9, size=(64, 48), fmt=fmt)
    assert problem(data, level, max_pixels=64 * 48) is None
    reason = problem(data, level, max_pixels=64 * 48 - 1)
    assert "image too large: its header claims 64x48 = 3,072 pixels, over the limit of 3,071" in reason
    assert "--max-pixels" in reason


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_full_check_refuses_an_oversized_image_before_decoding_it(monkeypatch, fmt):
    import packer.check

    def fail(*args, **kwargs):
        raise AssertionError("the image was decoded: the size must be refused from the header first")

    monkeypatch.setattr(packer.check, "pillow_problem", fail)
    monkeypatch.setattr(packer.check, "strict_jpeg_problem", fail)
    assert "image too large" in problem(jpeg_bytes(10, size=(64, 48), fmt=fmt), "full", max_pixels=100)


@pytest.mark.parametrize("level", ["header", "full"])
def test_a_12_bit_jpeg_is_refused_saying_what_to_do(level):
    reason = problem(jpeg_12bit(), level)
    assert reason.startswith("12-bit JPEG (sample precision 12)") and "convert it to an 8-bit" in reason


@pytest.mark.parametrize("options", [{}, {"check": "full"}, {"baseline_420": True}, {"baseline_420": True, "check": "none"}])
def test_every_pack_leaves_a_12_bit_jpeg_out_by_name(tmp_path, options):
    """Nothing decodes it (libjpeg-turbo and Pillow are 8-bit), so no path stores or re-encodes it."""
    src = tmp_path / "src"
    write(src / "a" / "deep.jpg", jpeg_12bit())
    write(src / "a" / "plain.jpg", jpeg_bytes(0))
    result = pack(str(src), "lmdb", str(tmp_path / "o.lmdb"), progress=False, workers=1, on_error="skip", **options)
    assert [(e["path"], e["reason"][:33]) for e in result.metadata.skipped] == [("a/deep.jpg", "12-bit JPEG (sample precision 12)")]
