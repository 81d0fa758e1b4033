from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from packer import FORMATS, pack
from packer.cli import main
from packer.verify import verify

from conftest import jpeg_bytes, write


@pytest.fixture(params=list(FORMATS))
def packed_tree(request, image_tree, tmp_path):
    out = tmp_path / f"v{FORMATS[request.param].EXTENSION}"
    pack(str(image_tree), request.param, str(out), progress=False, workers=1)
    return image_tree, out


def test_intact_dataset_verifies_against_its_source(packed_tree):
    src, out = packed_tree
    report = verify(str(out), str(src), workers=2)
    assert report.ok, report.problems
    assert report.checked == 19
    result = CliRunner().invoke(main, ["verify", str(out), "--against", str(src)])
    assert result.exit_code == 0 and "ok: 19 records intact" in result.stderr


def test_changed_added_and_removed_source_files_are_named(packed_tree):
    src, out = packed_tree
    (src / "cat" / "img_1.JPEG").write_bytes(jpeg_bytes(12345))
    write(src / "dog house" / "added.jpg", jpeg_bytes(777))
    (src / "v1.2" / "img_0.JPEG").unlink()
    report = verify(str(out), str(src), workers=1)
    text = "\n".join(report.problems)
    assert "cat/img_1.JPEG): differs from the source file" in text
    assert "dog house/added.jpg: in SRC but not packed" in text
    assert "v1.2/img_0.JPEG: packed but no longer in SRC" in text
    assert len(report.problems) == 3
    result = CliRunner().invoke(main, ["verify", str(out), "--against", str(src)])
    assert result.exit_code == 1 and "3 problem(s)" in result.stderr


def test_skipped_files_are_reported_as_skipped_not_missing(bad_tree, tmp_path):
    out = tmp_path / "b.lmdb"
    pack(str(bad_tree), "lmdb", str(out), on_error="skip", progress=False)
    report = verify(str(out), str(bad_tree))
    assert report.ok, report.problems
    assert sum("skipped at pack time" in n for n in report.notes) == 4


def test_damaged_record_fails_verify_naming_the_record(image_tree, tmp_path):
    out = tmp_path / "d.lmdb"
    pack(str(image_tree), "lmdb", str(out), progress=False)
    target = (image_tree / "cat" / "gray.jpeg").read_bytes()
    db = out / "data.mdb"
    blob = bytearray(db.read_bytes())
    offset = blob.find(target)
    blob[offset + 200] ^= 0x55
    db.write_bytes(bytes(blob))
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 1
    assert "cat/gray.jpeg): checksum mismatch" in result.stderr


def test_info_reports_disk_size(image_tree, tmp_path):
    out = tmp_path / "i.lmdb"
    pack(str(image_tree), "lmdb", str(out), progress=False)
    facts = json.loads(CliRunner().invoke(main, ["info", str(out), "--json"]).stdout)
    assert facts["disk_bytes"] >= facts["bytes"] > 0
