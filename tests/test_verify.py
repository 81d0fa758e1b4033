from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from packer import FORMATS, pack
from packer.cli import main
from packer.verify import verify

from conftest import jpeg_bytes, write
from test_scan import as_unprivileged, public_tmp  # noqa: F401  (public_tmp is a fixture)


@pytest.fixture(params=list(FORMATS))
def packed_tree(request, image_tree, tmp_path):
    out = tmp_path / f"v{FORMATS[request.param].extension}"
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


def test_a_class_folder_added_or_gone_is_named_even_empty(packed_tree):
    """Every file is the same, but a pack of SRC now would number its labels differently."""
    src, out = packed_tree
    (src / "aardvark").mkdir()  # sorts first: every other class would move up by one
    report = verify(str(out), str(src), workers=1)
    assert report.problems == ["classes differ: packed 4, SRC now has 5 (added 'aardvark', gone none): a pack of "
                               "SRC now would number its labels differently"]
    assert "changed since packing: re-pack it" in report.advice[0]


def test_a_split_folder_src_cannot_list_now_is_a_note_and_its_files_unreadable(public_tmp):
    """Not "splits differ", "classes differ" (val's own class is not gone) or "not packed"."""
    src = public_tmp / "src"
    for relpath in ("train/a/1.jpg", "train/b/2.jpg", "val/a/3.jpg", "val/b/4.jpg", "val/c/5.jpg"):
        write(src / relpath, jpeg_bytes(len(relpath) + ord(relpath[-5])))
    for path in [src, *src.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    out = public_tmp / "d.lmdb"
    pack(str(src), "lmdb", str(out), progress=False, workers=1)
    assert verify(str(out), str(src), workers=1).ok  # as root: imports everything it loads lazily
    (src / "val").chmod(0)
    report = as_unprivileged(lambda: verify(str(out), str(src), workers=1).to_dict(), [src / "val"])
    assert report["problems_by_kind"] == {"SRC file unreadable": 3}, report
    assert report["notes"] == ["val: cannot read folder (Permission denied): its 3 packed files were checked one "
                               "by one, but files added to it since packing cannot be seen; fix its permissions"]


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


def set_first_label(fmt: str, packed, label: int) -> None:
    """Write label into record 0's entry of the split's label table, as damage would."""
    import h5py
    import lmdb
    import numpy as np

    from packer.formats.wds import RECORD
    from test_fuzz_metadata import restamp_table_crc
    if fmt == "lmdb":
        env = lmdb.open(str(packed), subdir=True, lock=False, map_size=1 << 30)
        with env.begin(write=True) as txn:
            labels = np.frombuffer(txn.get(b"all/labels"), "<i4").copy()
            labels[0] = label
            txn.put(b"all/labels", labels.tobytes())
        env.close()
        restamp_table_crc(fmt, packed, "all", "labels", labels.tobytes())
    elif fmt == "hdf5":
        with h5py.File(packed, "r+") as f:
            f["all/labels"][0] = label
            raw = f["all/labels"][:].astype("<i4").tobytes()
        restamp_table_crc(fmt, packed, "all", "labels", raw)
    else:
        records = np.fromfile(packed / "all" / "records.bin", RECORD)
        records["label"][0] = label
        records.tofile(packed / "all" / "records.bin")
        restamp_table_crc(fmt, packed, "all", "records", records.tobytes())


@pytest.mark.parametrize("label", [99, -7, -1])
def test_labels_naming_no_class_are_reported_not_raised(packed_tree, label):
    src, out = packed_tree
    fmt = {".lmdb": "lmdb", ".h5": "hdf5", ".wds": "wds"}[out.suffix]
    set_first_label(fmt, out, label)
    report = verify(str(out), str(src), workers=1)
    assert not report.ok
    assert any("label" in p and str(label) in p for p in report.problems), report.problems


def test_split_count_disagreeing_with_the_tables_is_reported(packed_tree):
    from test_fuzz_metadata import rewrite_metadata
    src, out = packed_tree
    fmt = {".lmdb": "lmdb", ".h5": "hdf5", ".wds": "wds"}[out.suffix]

    def drop_one(obj):
        split = obj["splits"]["all"]
        split["count"] -= 1
        split["class_counts"][0] -= 1
        obj["count"] -= 1
    rewrite_metadata(fmt, out, drop_one)
    report = verify(str(out), workers=1)
    # Reported once (by verify, or by the reader's own table check), and no record is read.
    assert len(report.problems) == 1 and report.problems[0].startswith("split all: "), report.problems
    assert "18" in report.problems[0] and "19" in report.problems[0]
    assert report.checked == 0


@pytest.fixture
def wrong_folder(tmp_path):
    """A folder of 300 images that share no file with image_tree: the wrong --against."""
    root = tmp_path / "elsewhere"
    for i in range(300):
        write(root / f"class{i % 3}" / f"other_{i:03d}.jpg", jpeg_bytes(9000 + i % 7))
    return root


def test_a_wrong_against_folder_is_summed_up_not_listed_file_by_file(image_tree, tmp_path, wrong_folder):
    out = tmp_path / "w.lmdb"
    pack(str(image_tree), "lmdb", str(out), progress=False, workers=1)
    result = CliRunner().invoke(main, ["verify", str(out), "--against", str(wrong_folder), "--workers", "1"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert sum(line.startswith("error: ") for line in lines) == 20  # the first problems, not 320 lines
    assert "... and 300 more problems" in result.stderr
    assert "problems: 300 in SRC but not packed, 19 packed but not in SRC, 1 classes differ" in result.stderr
    assert (f"to do: no packed file is in {wrong_folder}: is --against the folder it was packed from? "
            f"(the metadata says {image_tree})") in result.stderr
    assert len(lines) < 30
    assert "record/s" not in result.stderr  # no progress bar when stderr is not a terminal


def test_verify_json_is_one_object_on_stdout(image_tree, tmp_path, wrong_folder):
    out = tmp_path / "j.lmdb"
    pack(str(image_tree), "lmdb", str(out), progress=False, workers=1)
    bad = CliRunner().invoke(main, ["verify", str(out), "--against", str(wrong_folder), "--json", "--workers", "1"])
    assert bad.exit_code == 1
    facts = json.loads(bad.stdout)
    assert facts["ok"] is False and facts["checked"] == 19 and facts["problem_count"] == 320
    assert facts["problems_by_kind"] == {"in SRC but not packed": 300, "packed but not in SRC": 19, "classes differ": 1}
    assert len(facts["first_problems"]) == 20 and "is --against the folder" in facts["advice"][0]
    good = CliRunner().invoke(main, ["verify", str(out), "--against", str(image_tree), "--json"])
    assert good.exit_code == 0
    assert json.loads(good.stdout) == {"path": str(out), "against": str(image_tree), "ok": True, "checked": 19,
                                       "problem_count": 0, "problems_by_kind": {}, "first_problems": [],
                                       "notes": [], "advice": [], "compared": {"byte for byte": 19}}


def test_verify_shows_progress_when_asked(image_tree, tmp_path, capsys):
    out = tmp_path / "p.lmdb"
    pack(str(image_tree), "lmdb", str(out), progress=False, workers=1)
    capsys.readouterr()
    assert verify(str(out), workers=1, progress=True).ok
    assert "19/19" in capsys.readouterr().err
    assert verify(str(out), workers=1).ok  # None: a bar only on a terminal, and pytest's stderr is not one
    assert "19/19" not in capsys.readouterr().err


def test_damage_is_counted_and_answered_with_what_to_do(image_tree, tmp_path):
    out = tmp_path / "k.lmdb"
    pack(str(image_tree), "lmdb", str(out), progress=False, workers=1)
    db = out / "data.mdb"
    blob = bytearray(db.read_bytes())
    blob[blob.find((image_tree / "cat" / "gray.jpeg").read_bytes()) + 200] ^= 0x55
    db.write_bytes(bytes(blob))
    report = verify(str(out), workers=1)
    assert report.kinds == {"damaged": 1}
    assert report.advice == ["the dataset is damaged: restore it from a copy, or re-pack it from its source"]
