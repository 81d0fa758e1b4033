"""pack/convert --max-side and --baseline-420: which images are re-encoded, how, what the metadata says, and
verify."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image, ImageOps

from packer import FORMATS, FormatError, PackError, open_reader, pack
from packer.cli import main
from packer.convert import convert
from packer.formats import read_metadata
from packer.pack import load_file
from packer.records import Metadata, metadata_crc
from packer.reencode import Reencode, expected_size, reencode_image, reencode_spec, target_size
from packer.verify import DAMAGED, DIFFERS, verify

from conftest import cut_with_end_marker, noisy_jpeg_444, write

ORIENTATION = 0x0112


def photo(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Smooth gradients with a bright block in the top-left corner: resizing keeps them, so
    a re-encoded image can be compared with a reference by pixels, and its orientation seen."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y + seed * 40) * 255 // (width + height + 80)],
                      -1).astype(np.uint8)
    pixels[: height // 4, : width // 4] = 255
    image = Image.fromarray(pixels, "RGB")
    return image if mode == "RGB" else image.convert(mode)


def encoded(image: Image.Image, fmt: str = "JPEG", orientation: int | None = None) -> bytes:
    buf = io.BytesIO()
    extra = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[ORIENTATION] = orientation
        extra["exif"] = exif
    image.save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}), **extra)
    return buf.getvalue()


def opened(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def mean_difference(a: Image.Image, b: Image.Image) -> float:
    return float(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).mean())


@pytest.fixture
def mixed_tree(tmp_path) -> Path:
    """SRC/<class>/...: images over and under 256 px, rotated by EXIF, grayscale, CMYK and PNG."""
    src = tmp_path / "src"
    write(src / "a" / "big.jpg", encoded(photo(800, 600)))
    write(src / "a" / "small.jpg", encoded(photo(250, 200, seed=1)))
    write(src / "a" / "edge.jpg", encoded(photo(256, 100, seed=2)))  # exactly at the limit: kept
    write(src / "b" / "rotated.jpg", encoded(photo(900, 400, seed=3), orientation=6))
    write(src / "b" / "gray.jpg", encoded(photo(700, 500, "L", seed=4)))
    write(src / "b" / "cmyk.jpg", encoded(photo(640, 480, "CMYK", seed=5)))
    write(src / "b" / "wide.png", encoded(photo(1000, 300, "RGBA", seed=6), "PNG"))
    write(src / "b" / "small.png", encoded(photo(120, 90, seed=7), "PNG"))
    return src


def stored(path: Path) -> dict[str, bytes]:
    found = {}
    for split in read_metadata(path).splits:
        reader = open_reader(path, split)
        for i in range(len(reader)):
            data, _, relpath = reader.read(i)
            found[relpath] = data
        reader.close()
    return found


def test_target_size_keeps_the_aspect_ratio_and_leaves_images_within_the_limit_alone():
    assert target_size(800, 600, 256) == (256, 192)
    assert target_size(600, 800, 256) == (192, 256)
    assert target_size(1000, 333, 256) == (256, 85)  # 85.248 rounds down
    assert target_size(10000, 1, 256) == (256, 1)  # never 0 pixels
    assert target_size(256, 256, 256) is None and target_size(100, 50, 256) is None


def test_expected_size_is_upright():
    data = encoded(photo(900, 400), orientation=6)  # shown rotated: 400 wide, 900 high
    assert expected_size(data, Reencode(256)) == (114, 256)
    assert expected_size(encoded(photo(900, 400), orientation=3), Reencode(256)) == (256, 114)
    assert expected_size(encoded(photo(200, 100)), Reencode(256)) is None


def test_images_within_the_limit_are_not_re_encoded():
    data = encoded(photo(256, 200), orientation=6)
    assert reencode_image(data, Reencode(256)) is None


def test_re_encoding_resizes_with_a_good_filter_and_stores_upright_pixels():
    source = photo(1200, 500)
    data = encoded(source, orientation=8)
    out = opened(reencode_image(data, Reencode(300, quality=95)))
    assert out.format == "JPEG" and out.mode == "RGB" and out.size == (125, 300)
    assert ORIENTATION not in out.getexif()
    upright = ImageOps.exif_transpose(opened(data)).resize(out.size, Image.Resampling.LANCZOS)
    assert mean_difference(out, upright) < 3
    assert mean_difference(out, opened(data).resize(out.size)) > 30  # not the stored, sideways pixels


def test_grayscale_stays_grayscale_and_cmyk_becomes_rgb_as_the_readers_convert_it():
    gray = opened(reencode_image(encoded(photo(700, 500, "L")), Reencode(256)))
    assert gray.mode == "L" and gray.size == (256, 183)
    cmyk_source = encoded(photo(640, 480, "CMYK"))
    cmyk = opened(reencode_image(cmyk_source, Reencode(256)))
    assert cmyk.mode == "RGB" and cmyk.size == (256, 192)
    reference = opened(cmyk_source).convert("RGB").resize(cmyk.size, Image.Resampling.LANCZOS)
    assert mean_difference(cmyk, reference) < 3


def test_a_png_over_the_limit_becomes_an_rgb_jpeg():
    source = photo(1000, 300, "RGBA")
    out = opened(reencode_image(encoded(source, "PNG"), Reencode(256)))
    assert out.format == "JPEG" and out.mode == "RGB" and out.size == (256, 77)
    assert mean_difference(out, source.convert("RGB").resize(out.size, Image.Resampling.LANCZOS)) < 3


def test_lower_quality_stores_fewer_bytes():
    data = encoded(photo(1000, 800))
    assert len(reencode_image(data, Reencode(500, quality=50))) < len(reencode_image(data, Reencode(500, quality=95)))


def test_an_image_that_cannot_be_decoded_becomes_a_reason_so_on_error_applies(tmp_path):
    data = encoded(photo(800, 600))
    path = write(tmp_path / "cut.jpg", data[: len(data) // 3])
    loaded = load_file(str(path), "none", reencode=Reencode(256))
    assert loaded.data is None and "re-encode" in loaded.reason


def test_bad_arguments_are_refused_by_name():
    assert reencode_spec(None, None) is None
    assert reencode_spec(300, None) == Reencode(300, 90)
    for max_side, quality, named in ((0, None, "max_side"), (70000, None, "max_side"), (True, None, "max_side"),
                                     (256, 0, "quality"), (256, 101, "quality"), (None, 80, "max_side")):
        with pytest.raises(PackError, match=named):
            reencode_spec(max_side, quality)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pack_re_encodes_only_images_over_the_limit_and_verify_accepts_it(mixed_tree, tmp_path, fmt):
    out = tmp_path / f"out{FORMATS[fmt].extension}"
    pack(str(mixed_tree), fmt, str(out), workers=2, progress=False, max_side=256, quality=85)
    records = stored(out)
    for kept in ("a/small.jpg", "a/edge.jpg", "b/small.png"):
        assert records[kept] == (mixed_tree / kept).read_bytes()
    sizes = {"a/big.jpg": (256, 192), "b/rotated.jpg": (114, 256), "b/gray.jpg": (256, 183),
             "b/cmyk.jpg": (256, 192), "b/wide.png": (256, 77)}
    for relpath, size in sizes.items():
        assert opened(records[relpath]).format == "JPEG" and opened(records[relpath]).size == size, relpath
    meta = read_metadata(out)
    assert meta.reencode == {"max_side": 256, "quality": 85, "counts": {"all": 5}}
    report = verify(str(out), str(mixed_tree), workers=1)
    assert report.ok, report.problems
    assert report.reencoded and any("5 records were re-encoded" in note for note in report.notes)


def test_processes_and_one_worker_store_the_same_bytes(mixed_tree, tmp_path):
    one, two = tmp_path / "one.lmdb", tmp_path / "two.lmdb"
    pack(str(mixed_tree), "lmdb", str(one), workers=1, progress=False, max_side=256)
    pack(str(mixed_tree), "lmdb", str(two), workers=2, progress=False, max_side=256)
    assert stored(one) == stored(two)


def test_verify_against_finds_changed_sources_of_both_kinds(mixed_tree, tmp_path):
    out = tmp_path / "out.lmdb"
    pack(str(mixed_tree), "lmdb", str(out), workers=1, progress=False, max_side=256)
    write(mixed_tree / "a" / "big.jpg", encoded(photo(800, 300)))  # a different shape: 256x96 now
    write(mixed_tree / "a" / "small.jpg", encoded(photo(250, 200, seed=9)))  # kept, so compared by bytes
    write(mixed_tree / "b" / "small.png", encoded(photo(900, 90), "PNG"))  # over the limit now, stored as it was
    report = verify(str(out), str(mixed_tree), workers=1)
    assert report.kinds[DIFFERS] == 3, report.problems
    found = "\n".join(report.problems)
    assert "a/big.jpg): stored image is 256x192, re-encoding the source under the max side 256 gives 256x96" in found
    assert "a/small.jpg): differs from the source file" in found
    assert "b/small.png): stored image is 120x90, re-encoding the source under the max side 256 gives 256x26" in found


def _rewrite_metadata(out: Path, max_side: int) -> Metadata:
    """out's metadata claiming a max side it was not packed with: what damage to either looks like."""
    import lmdb

    meta = read_metadata(out)
    meta.reencode = {"max_side": max_side, "quality": 90, "counts": {"all": 0}}
    env = lmdb.open(str(out), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"__meta__", meta.to_json())  # the metadata key (packer.formats.lmdb)
    env.close()
    return read_metadata(out)


def test_verify_finds_images_stored_as_they_are_though_over_the_recorded_max_side(mixed_tree, tmp_path):
    out = tmp_path / "plain.lmdb"
    pack(str(mixed_tree), "lmdb", str(out), workers=1, progress=False)
    _rewrite_metadata(out, max_side=256)
    report = verify(str(out), workers=1)
    assert report.kinds[DAMAGED] == 5 and len(report.problems) == 5, report.problems
    assert "all/0 (a/big.jpg): stored image is 800x600, over the max side 256 the dataset was packed with" \
        in report.problems
    report = verify(str(out), str(mixed_tree), workers=1)
    assert report.kinds[DIFFERS] == 5 and report.kinds[DAMAGED] == 5, report.problems
    assert "all/7 (b/wide.png): stored as it is, but the source is over the max side 256 and must be stored " \
           "re-encoded" in report.problems


def test_convert_re_encodes_and_carries_the_record(mixed_tree, tmp_path):
    plain = tmp_path / "plain.lmdb"
    pack(str(mixed_tree), "lmdb", str(plain), workers=1, progress=False)
    small = tmp_path / "small.h5"
    convert(str(plain), "hdf5", str(small), workers=2, progress=False, max_side=256)
    assert read_metadata(small).reencode == {"max_side": 256, "quality": 90, "counts": {"all": 5}}
    assert verify(str(small), str(mixed_tree), workers=1).ok
    again = tmp_path / "again.lmdb"  # no --max-side: the records and their record carry over
    convert(str(small), "lmdb", str(again), workers=1, progress=False)
    assert read_metadata(again).reencode == read_metadata(small).reencode and stored(again) == stored(small)
    larger = tmp_path / "larger.lmdb"  # a larger limit re-encodes nothing
    convert(str(small), "lmdb", str(larger), workers=1, progress=False, max_side=512)
    assert read_metadata(larger).reencode["max_side"] == 256 and stored(larger) == stored(small)
    smaller = tmp_path / "smaller.wds"  # a smaller one re-encodes again: compared with SRC under the new limit
    convert(str(small), "wds", str(smaller), workers=1, progress=False, max_side=150, quality=80)
    assert read_metadata(smaller).reencode == {"max_side": 150, "quality": 80, "counts": {"all": 7}}
    report = verify(str(smaller), str(mixed_tree), workers=1)
    assert report.ok, report.problems


def test_metadata_reencode_round_trips_and_is_checked():
    meta = Metadata.from_json(_metadata_json(), "test")
    assert meta.reencode is None  # written without it: nothing re-encoded
    meta.reencode = {"max_side": 320, "quality": 90, "counts": {"train": 3}}
    assert Metadata.from_json(meta.to_json(), "test").reencode == meta.reencode
    for bad in ({"max_side": 0, "quality": 90, "counts": {}}, {"max_side": 320, "quality": 101, "counts": {}},
                {"max_side": 320, "quality": 90, "counts": {"val": 1}},
                {"max_side": 320, "quality": 90, "counts": {"train": 5}},  # more than the split holds
                {"max_side": 320, "quality": 90}, [320, 90]):
        meta.reencode = bad
        with pytest.raises(FormatError, match="reencode"):
            meta.to_json()


def test_metadata_without_a_checksum_may_not_claim_re_encoding():
    d = json.loads(_metadata_json())
    del d["crc32"]
    assert Metadata.from_dict(dict(d), "old").reencode is None
    d["reencode"] = {"max_side": 320, "quality": 90, "counts": {}}
    with pytest.raises(FormatError, match="unknown key"):
        Metadata.from_dict(d, "old")


def _metadata_json() -> str:
    from packer.records import SplitInfo

    return Metadata(format="lmdb", classes=["a"], splits={"train": SplitInfo(3, 30, [3])}).to_json().decode()


def test_cli_options_info_and_help(mixed_tree, tmp_path):
    runner = CliRunner()
    out = tmp_path / "out.lmdb"
    result = runner.invoke(main, ["pack", str(mixed_tree), "--to", "lmdb", "-o", str(out), "--quality", "80"])
    assert result.exit_code == 2 and "pass --max-side" in result.output
    result = runner.invoke(main, ["pack", str(mixed_tree), "--to", "lmdb", "-o", str(out), "--max-side", "0"])
    assert result.exit_code == 2 and not out.exists()
    result = runner.invoke(main, ["pack", str(mixed_tree), "--to", "lmdb", "-o", str(out), "--max-side", "256",
                                  "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert "re-encoded: 5 images over 256 px (JPEG quality 90)" in runner.invoke(main, ["info", str(out)]).output
    result = runner.invoke(main, ["verify", str(out), "--against", str(mixed_tree), "--workers", "1"])
    assert result.exit_code == 0 and "(3 byte for byte; 5 re-encoded, by their source's digest and their size)" in result.output
    for command in ("pack", "convert"):
        text = " ".join(runner.invoke(main, [command, "--help"]).output.split())
        assert "--max-side" in text and "byte for byte" in text and "--quality" in text


def test_the_resolution_benchmark_measures_every_variant(mixed_tree, tmp_path, capsys):
    from benchmarks.suites import resolution

    result = tmp_path / "result.json"
    resolution.main([str(mixed_tree), "--work", str(tmp_path / "work"), "--sides", "full,256", "--repeats", "1",
                     "--pack-repeats", "1", "--sample", "8", "--workers", "1", "--json", str(result)])
    table = capsys.readouterr().out
    assert "| full | 0 of 8 |" in table and "| max-side-256 | 5 of 8 |" in table
    facts = json.loads(result.read_text())
    assert facts["packs"]["max-side-256"]["image_bytes"] < facts["packs"]["full"]["image_bytes"]
    assert all(rate["rrc224_per_s"] > 0 and rate["decode_per_s"] > 0 for rate in facts["reads"].values())


@pytest.fixture
def forms_tree(tmp_path) -> Path:
    """SRC/<class>/...: JPEGs in every common form (baseline 4:2:0 at quality 95, 4:4:4,
    progressive, grayscale, CMYK, EXIF-rotated 4:4:4) and a PNG."""
    src = tmp_path / "forms"

    def jpeg(image: Image.Image, **options) -> bytes:
        buf = io.BytesIO()
        image.save(buf, "JPEG", **options)
        return buf.getvalue()

    exif = Image.Exif()
    exif[ORIENTATION] = 6
    write(src / "a" / "420.jpg", jpeg(photo(300, 200), quality=95, subsampling=2))
    write(src / "a" / "444.jpg", jpeg(photo(300, 200, seed=1), quality=95, subsampling=0))
    write(src / "a" / "progressive.jpg", jpeg(photo(320, 240, seed=2), quality=90, progressive=True))
    write(src / "b" / "gray.jpg", jpeg(photo(200, 300, "L", seed=3), quality=90))
    write(src / "b" / "cmyk.jpg", jpeg(photo(200, 150, "CMYK", seed=4), quality=90))
    write(src / "b" / "rotated.jpg", jpeg(photo(300, 100, seed=5), quality=90, subsampling=0, exif=exif))
    write(src / "b" / "flat.png", encoded(photo(100, 80, seed=6), "PNG"))
    return src


def test_baseline_420_keeps_images_in_the_form_and_re_encodes_the_others_at_their_size(forms_tree, tmp_path):
    from packer.jpeg_form import jpeg_form

    out = tmp_path / "b420.lmdb"
    pack(str(forms_tree), "lmdb", str(out), workers=2, progress=False, baseline_420=True)
    found = stored(out)
    for relpath in ("a/420.jpg", "b/gray.jpg"):  # already baseline 4:2:0 or gray: byte for byte
        assert found[relpath] == (forms_tree / relpath).read_bytes()
    for relpath, size in (("a/444.jpg", (300, 200)), ("a/progressive.jpg", (320, 240)), ("b/cmyk.jpg", (200, 150)),
                          ("b/rotated.jpg", (100, 300)), ("b/flat.png", (100, 80))):
        assert found[relpath] != (forms_tree / relpath).read_bytes()
        assert opened(found[relpath]).size == size, relpath  # its size, upright
    assert all(jpeg_form(data).baseline_420 for data in found.values())
    assert mean_difference(opened(found["a/444.jpg"]), photo(300, 200, seed=1)) < 3
    meta = read_metadata(out)
    assert meta.reencode == {"max_side": 65535, "quality": 90, "counts": {"all": 5}, "form": "baseline-420"}
    # Packers that predate the form read "reencode" with exactly these keys; the form sits beside it.
    written = meta.to_dict()
    assert set(written["reencode"]) == {"max_side", "quality", "counts"} and written["reencode_form"] == "baseline-420"
    assert verify(str(out), workers=1).ok
    report = verify(str(out), str(forms_tree), workers=1)
    assert report.ok, report.problems


def test_baseline_420_combines_with_max_side(forms_tree, tmp_path):
    out = tmp_path / "both.wds"
    pack(str(forms_tree), "wds", str(out), workers=1, progress=False, baseline_420=True, max_side=250, quality=80)
    found = stored(out)
    assert opened(found["a/420.jpg"]).size == (250, 167)  # in the form, but over the side
    assert opened(found["a/444.jpg"]).size == (250, 167)
    assert found["b/gray.jpg"] != (forms_tree / "b/gray.jpg").read_bytes()  # 300 px high
    assert opened(found["b/cmyk.jpg"]).size == (200, 150)  # within the side, not in the form
    assert read_metadata(out).reencode == {"max_side": 250, "quality": 80, "counts": {"all": 7}, "form": "baseline-420"}
    assert verify(str(out), str(forms_tree), workers=1).ok


def test_verify_finds_records_not_in_the_recorded_form(forms_tree, tmp_path):
    import lmdb

    out = tmp_path / "plain.lmdb"
    pack(str(forms_tree), "lmdb", str(out), workers=1, progress=False)
    meta = read_metadata(out)
    meta.reencode = {"max_side": 65535, "quality": 90, "counts": {"all": 0}, "form": "baseline-420"}
    env = lmdb.open(str(out), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"__meta__", meta.to_json())
    env.close()
    report = verify(str(out), workers=1)
    assert report.kinds[DAMAGED] == 5, report.problems
    assert any("(a/444.jpg): stored image is a baseline 8-bit YCbCr 4:4:4 JPEG, but the dataset was packed with "
               "--baseline-420" in problem for problem in report.problems)
    assert any("(a/progressive.jpg): stored image is a progressive" in problem for problem in report.problems)
    assert any("(b/flat.png): stored image is not a JPEG" in problem for problem in report.problems)
    report = verify(str(out), str(forms_tree), workers=1)
    assert report.kinds[DIFFERS] == 5, report.problems
    assert any("(b/cmyk.jpg): stored as it is, but the source is not baseline 4:2:0 and must be stored re-encoded"
               in problem for problem in report.problems)


def test_convert_to_baseline_420_adds_its_counts_and_refuses_a_smaller_side_after_it(forms_tree, tmp_path):
    small = tmp_path / "small.lmdb"
    pack(str(forms_tree), "lmdb", str(small), workers=1, progress=False, max_side=250)  # 420, 444, progressive, gray
    both = tmp_path / "both.h5"
    convert(str(small), "hdf5", str(both), workers=1, progress=False, baseline_420=True)
    # The 4 re-encoded under 250 px are in the form already; cmyk, rotated and the PNG are re-encoded now.
    assert read_metadata(both).reencode == {"max_side": 250, "quality": 90, "counts": {"all": 7},
                                            "form": "baseline-420"}
    assert verify(str(both), str(forms_tree), workers=1).ok
    again = tmp_path / "again.lmdb"  # nothing left to re-encode: the record stands
    convert(str(both), "lmdb", str(again), workers=1, progress=False, baseline_420=True, max_side=300)
    assert read_metadata(again).reencode == read_metadata(both).reencode and stored(again) == stored(both)
    refused = tmp_path / "refused.lmdb"
    with pytest.raises(PackError, match="packed with --baseline-420, which does not record which records"):
        convert(str(both), "lmdb", str(refused), workers=1, progress=False, max_side=200)
    assert not refused.exists()


def test_metadata_reencode_form_is_checked():
    meta = Metadata.from_json(_metadata_json(), "test")
    meta.reencode = {"max_side": 65535, "quality": 90, "counts": {"train": 3}, "form": "baseline-420"}
    assert Metadata.from_json(meta.to_json(), "test").reencode == meta.reencode
    meta.reencode["form"] = "progressive"
    with pytest.raises(FormatError, match="reencode_form"):
        meta.to_json()
    d = json.loads(_metadata_json())
    d["reencode_form"] = "baseline-420"  # without a reencode object
    d["crc32"] = metadata_crc({k: v for k, v in d.items() if k != "crc32"})
    with pytest.raises(FormatError, match="no reencode object"):
        Metadata.from_dict(d, "test")


def test_cli_baseline_420_and_info_forms(forms_tree, tmp_path):
    runner = CliRunner()
    out = tmp_path / "out.lmdb"
    result = runner.invoke(main, ["pack", str(forms_tree), "--to", "lmdb", "-o", str(out), "--baseline-420",
                                  "--quality", "85", "--workers", "1"])
    assert result.exit_code == 0, result.output
    text = runner.invoke(main, ["info", str(out)]).output
    assert "re-encoded: 5 images not baseline 4:2:0 (JPEG quality 85)" in text
    assert "JPEG forms: 100% decodable by GPU JPEG engines" in text
    plain = tmp_path / "plain.lmdb"
    assert runner.invoke(main, ["pack", str(forms_tree), "--to", "lmdb", "-o", str(plain)]).exit_code == 0
    facts = json.loads(runner.invoke(main, ["info", "--json", str(plain)]).output)
    # 420, gray and 444 (the rotated one too) are baseline; progressive, CMYK and the PNG are not.
    assert facts["forms"]["hardware"] == 4 and facts["forms"]["baseline_420"] == 2 and facts["forms"]["jpeg"] == 6
    for command in ("pack", "convert"):
        assert "--baseline-420" in " ".join(runner.invoke(main, [command, "--help"]).output.split())


def test_the_resolution_benchmark_measures_the_baseline_420_variants(forms_tree, tmp_path, capsys):
    from benchmarks.suites import resolution

    result = tmp_path / "result.json"
    resolution.main([str(forms_tree), "--work", str(tmp_path / "work"), "--sides", "full,b420,250+b420",
                     "--repeats", "1", "--pack-repeats", "1", "--sample", "7", "--workers", "1", "--every-q90",
                     "--json", str(result)])
    table = capsys.readouterr().out
    assert "| baseline-420 | 5 of 7 |" in table and "| max-side-250+baseline-420 | 7 of 7 |" in table
    assert "| every-q90 | 7 of 7 |" in table and "- (sample only)" in table
    reads = json.loads(result.read_text())["reads"]
    assert set(reads) == {"full", "baseline-420", "max-side-250+baseline-420", "every-q90"}
    assert all(rate["rrc224_per_s"] > 0 and rate["sample_bytes"] > 0 for rate in reads.values())


@pytest.mark.parametrize("options", [{"baseline_420": True}, {"max_side": 64}])
def test_a_cut_jpeg_with_its_end_marker_put_back_is_refused_not_laundered(tmp_path, options):
    """Pillow's decode greys the missing half over; re-encoded, it would be a valid JPEG that
    verify could not tell from the photo. A strict decode refuses it first: --on-error says."""
    src = tmp_path / "src"
    write(src / "a" / "cut.jpg", cut_with_end_marker(noisy_jpeg_444(128)))
    write(src / "a" / "whole.jpg", noisy_jpeg_444(128, seed=1))
    with pytest.raises(PackError, match=r"a/cut.jpg: corrupt JPEG \(.*premature end.*not re-encoded"):
        pack(str(src), "lmdb", str(tmp_path / "failed.lmdb"), progress=False, workers=1, **options)
    result = pack(str(src), "lmdb", str(tmp_path / "o.lmdb"), progress=False, workers=1, on_error="skip", **options)
    assert [entry["path"] for entry in result.metadata.skipped] == ["a/cut.jpg"] and result.metadata.count == 1
    assert verify(str(tmp_path / "o.lmdb"), str(src)).ok


def test_verify_against_catches_a_re_encoded_source_replaced_by_another_of_the_same_size(mixed_tree, tmp_path):
    out = tmp_path / "out.lmdb"
    pack(str(mixed_tree), "lmdb", str(out), workers=1, progress=False, max_side=256)
    assert verify(str(out), str(mixed_tree), workers=1).compared == {
        "byte for byte": 3, "re-encoded, by their source's digest and their size": 5}
    write(mixed_tree / "a" / "big.jpg", encoded(photo(800, 600, seed=8)))  # another photo, the same size
    report = verify(str(out), str(mixed_tree), workers=1)
    assert report.kinds[DIFFERS] == 1, report.problems
    assert "a/big.jpg): re-encoded from another file: the source digest it carries" in report.problems[0]


def test_a_record_re_encoded_again_keeps_its_original_sources_digest(mixed_tree, tmp_path):
    first, second = tmp_path / "first.lmdb", tmp_path / "second.wds"
    pack(str(mixed_tree), "lmdb", str(first), workers=1, progress=False, max_side=512)
    convert(str(first), "wds", str(second), workers=1, progress=False, max_side=256)
    report = verify(str(second), str(mixed_tree), workers=1)
    assert report.ok and report.compared["re-encoded, by their source's digest and their size"] == 5, report.problems
