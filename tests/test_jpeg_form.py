"""packer.jpeg_form: JPEG forms read from headers, and info's census of a packed dataset's forms."""
from __future__ import annotations

import io

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from packer import pack
from packer.formats import read_metadata
from packer.jpeg_form import form_summary, in_baseline_420, jpeg_form
from packer.verify import census

from conftest import write


def picture(width: int = 64, height: int = 48, mode: str = "RGB") -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    return image if mode == "RGB" else image.convert(mode)


def jpeg(mode: str = "RGB", **options) -> bytes:
    buf = io.BytesIO()
    picture(mode=mode).save(buf, "JPEG", **options)
    return buf.getvalue()


@pytest.mark.parametrize("options, mode, expected", [
    ({"quality": 95, "subsampling": 2}, "RGB", ("4:2:0", "YCbCr", True, True)),
    ({"quality": 95, "subsampling": 0}, "RGB", ("4:4:4", "YCbCr", False, True)),
    ({"quality": 95, "subsampling": 1}, "RGB", ("4:2:2", "YCbCr", False, True)),
    ({"quality": 90, "progressive": True}, "RGB", ("4:2:0", "YCbCr", False, False)),
    ({"quality": 90}, "L", ("gray", "Gray", True, True)),
    ({"quality": 90}, "CMYK", ("other", "CMYK", False, False)),
])
def test_the_form_is_read_from_the_headers(options, mode, expected):
    form = jpeg_form(jpeg(mode, **options))
    assert (form.subsampling, form.colorspace, form.baseline_420, form.hardware) == expected
    assert form.progressive == bool(options.get("progressive"))


def test_subsamplings_the_engines_do_not_take_and_non_jpegs():
    pixels = np.asarray(picture())
    form = jpeg_form(simplejpeg.encode_jpeg(np.ascontiguousarray(pixels), colorsubsampling="411"))
    assert form.subsampling == "4:1:1" and form.baseline and not form.hardware and not form.baseline_420
    buf = io.BytesIO()
    picture().save(buf, "PNG")
    assert jpeg_form(buf.getvalue()) is None and not in_baseline_420(buf.getvalue())
    data = jpeg(quality=90)
    assert jpeg_form(data[:20]) is None  # cut inside the header: no frame header to read
    assert jpeg_form(data[:2] + b"\x00" + data[3:]) is None  # no marker where one must be


def test_census_counts_the_forms_of_an_even_sample(tmp_path):
    src = tmp_path / "src"
    for i in range(6):
        write(src / "a" / f"{i}-420.jpg", jpeg(quality=95, subsampling=2))
    for i in range(3):
        write(src / "b" / f"{i}-444.jpg", jpeg(quality=95, subsampling=0))
    write(src / "b" / "prog.jpg", jpeg(quality=90, progressive=True))
    out = tmp_path / "out.lmdb"
    pack(str(src), "lmdb", str(out), workers=1, progress=False)
    meta = read_metadata(out)
    every = census(str(out), meta)
    assert every == {"sampled": 10, "jpeg": 10, "baseline_420": 6, "hardware": 9, "progressive": 1,
                     "subsampling": {"4:2:0": 7, "4:4:4": 3}, "unreadable": 0}
    assert "90% decodable by GPU JPEG engines" in form_summary(every) and "60% baseline 4:2:0" in form_summary(every)
    some = census(str(out), meta, sample=5)  # records 0, 2, 4 of class a (6 records), 6, 8 of b
    assert some["sampled"] == 5 and some["baseline_420"] == 3


def test_info_describes_a_damaged_dataset_and_counts_what_it_cannot_read(tmp_path):
    from click.testing import CliRunner

    from packer.cli import main

    src = tmp_path / "src"
    for i in range(4):
        write(src / "a" / f"{i}.jpg", jpeg(quality=95, subsampling=0))
    out = tmp_path / "out.wds"
    pack(str(src), "wds", str(out), workers=1, progress=False)
    shard = next(out.rglob("shard-*.tar"))
    damaged = bytearray(shard.read_bytes())
    damaged[1000] ^= 0xFF  # inside the first record's image: its checksum no longer matches
    shard.write_bytes(bytes(damaged))
    result = CliRunner().invoke(main, ["info", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 unreadable: run packer verify" in result.output and "75% decodable by GPU JPEG engines" in result.output
    shard.unlink()
    result = CliRunner().invoke(main, ["info", str(out)])
    assert result.exit_code == 0 and "4 unreadable" in result.output, result.output
