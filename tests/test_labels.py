"""Label files for a flat split (ImageNet's official val/): every shape, good and broken."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from packer import pack
from packer.cli import main
from packer.errors import SourceError
from packer.formats import open_reader, read_metadata
from packer.scan import scan_source

from conftest import jpeg_bytes, needs_prlimit, run_capped, write

WNIDS = ["n01440764", "n01443537", "n01484850"]
VAL = [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, 7)]
# The class of each val image, as ImageNet's label files would give it.
TRUTH = {name: WNIDS[i % 3] for i, name in enumerate(VAL)}


@pytest.fixture
def imagenet_tree(tmp_path) -> Path:
    """train/<wnid>/... with class folders, and ImageNet's flat val/ beside it."""
    root = tmp_path / "imagenet"
    seed = iter(range(5000, 6000))
    for wnid in WNIDS:
        for i in range(2):
            write(root / "train" / wnid / f"{wnid}_{i}.JPEG", jpeg_bytes(next(seed)))
    for name in VAL:
        write(root / "val" / name, jpeg_bytes(next(seed)))
    return root


def loc_csv(entries: dict[str, str]) -> str:
    rows = "".join(f"{Path(name).stem},{wnid} 12 34 200 300 {wnid} 1 2 3 4\n" for name, wnid in entries.items())
    return "ImageId,PredictionString\n" + rows


def label_file(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def val_labels(packed: Path) -> dict[str, str]:
    meta = read_metadata(str(packed))
    reader = open_reader(str(packed), "val")
    try:
        return {p.split("/")[-1]: meta.classes[int(l)] for p, l in zip(reader.paths, reader.labels)}
    finally:
        reader.close()


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_flat_val_beside_labeled_train_is_packed_unlabeled_with_a_warning(imagenet_tree, tmp_path):
    result = run("pack", imagenet_tree, "--to", "lmdb", "-o", tmp_path / "o.lmdb", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert ("warning: val/: 6 images with no class folders, packed unlabeled (label -1); "
            "pass --labels FILE to label them") in result.stderr


def test_images_with_no_class_folder_anywhere_are_warned_about_naming_the_layout(tmp_path):
    # A class folder given as SRC by mistake: one image, packed unlabeled, said so and how to fix it.
    src = tmp_path / "n01440764"
    write(src / "n01440764_10026.JPEG", jpeg_bytes(1))
    result = run("pack", src, "--to", "lmdb", "-o", tmp_path / "o.lmdb", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert (f"warning: {src}: 1 image and no class folders, packed unlabeled (label -1). packer expects "
            "ImageFolder's layout, SRC/<class>/<image>") in result.stderr
    assert "if this is one class's folder, pack the folder above it" in result.stderr
    assert "packed 1 image (all 1; 0 classes," in result.stderr


@pytest.mark.parametrize("shape", ["loc", "csv-names", "csv-indexes", "json-names", "json-indexes"])
def test_each_keyed_shape_labels_val_in_the_train_class_list(imagenet_tree, tmp_path, shape):
    contents = {
        "loc": ("LOC_val_solution.csv", loc_csv(TRUTH)),
        "csv-names": ("val.csv", "filename,class\n" + "".join(f"{n},{c}\n" for n, c in TRUTH.items())),
        "csv-indexes": ("val.csv", "".join(f"val/{n},{WNIDS.index(c)}\n" for n, c in TRUTH.items())),
        "json-names": ("val.json", json.dumps(TRUTH)),
        "json-indexes": ("val.json", json.dumps({n: WNIDS.index(c) for n, c in TRUTH.items()})),
    }
    labels = label_file(tmp_path, *contents[shape])
    out = tmp_path / "o.lmdb"
    result = pack(str(imagenet_tree), "lmdb", str(out), labels=str(labels), workers=1, progress=False)
    assert not any("no class folders" in w for w in result.warnings)
    assert val_labels(out) == TRUTH
    meta = read_metadata(str(out))
    assert meta.classes == WNIDS and meta.splits["val"].labeled
    assert meta.splits["val"].class_counts == [2, 2, 2]
    recorded = meta.params["labels"]
    assert recorded["file"] == labels.name
    assert recorded["sha256"] == hashlib.sha256(labels.read_bytes()).hexdigest()


def test_a_list_of_indexes_needs_an_explicit_base(imagenet_tree, tmp_path):
    # ILSVRC2012_validation_ground_truth.txt's shape: one 1-based index per line, files in sorted order.
    text = "".join(f"{WNIDS.index(TRUTH[n]) + 1}\n" for n in sorted(VAL))
    labels = label_file(tmp_path, "ILSVRC2012_validation_ground_truth.txt", text)
    with pytest.raises(SourceError, match=r"only accepted with --labels-index-base 0\|1.*synset order"):
        pack(str(imagenet_tree), "lmdb", str(tmp_path / "a.lmdb"), labels=str(labels), workers=1)
    assert not (tmp_path / "a.lmdb").exists()
    out = tmp_path / "b.lmdb"
    pack(str(imagenet_tree), "lmdb", str(out), labels=str(labels), labels_index_base=1, workers=1)
    assert val_labels(out) == TRUTH
    assert read_metadata(str(out)).params["labels"]["index_base"] == 1


@pytest.mark.parametrize("text, error", [
    ("1\n2\n3\n", r"3 class indexes for the 6 images of val/"),
    ("1\n2\n3\n4\n2\n1\n", r"line 4: class index 4 outside 1 to 3"),
    ("0\n1\n2\n0\n1\n2\n", r"line 1: class index 0 outside 1 to 3"),
])
def test_a_wrong_list_of_indexes_is_refused(imagenet_tree, tmp_path, text, error):
    labels = label_file(tmp_path, "gt.txt", text)
    with pytest.raises(SourceError, match=error):
        pack(str(imagenet_tree), "lmdb", str(tmp_path / "o.lmdb"), labels=str(labels), labels_index_base=1)


def test_index_base_with_a_keyed_file_is_refused(imagenet_tree, tmp_path):
    labels = label_file(tmp_path, "val.json", json.dumps(TRUTH))
    with pytest.raises(SourceError, match="applies to a list of class indexes"):
        pack(str(imagenet_tree), "lmdb", str(tmp_path / "o.lmdb"), labels=str(labels), labels_index_base=0)
    refused = run("pack", imagenet_tree, "--to", "lmdb", "--labels-index-base", "1")
    assert refused.exit_code == 2 and "--labels-index-base applies to a --labels file" in refused.stderr


BROKEN = {
    "unknown class": ("val.csv", "".join(f"{n},{c}\n" for n, c in TRUTH.items()).replace("n01484850", "n09999999", 1),
                      r"val.csv: row 3: class 'n09999999' is not one of the 3 class folders.*cannot add classes"),
    "index past the classes": ("val.json", json.dumps({VAL[0]: 3}), r"class index 3 outside 0 to 2"),
    "path outside the split": ("val.csv", f"../../etc/passwd,{WNIDS[0]}\n", r"row 1: '../../etc/passwd' is not a file name inside"),
    "absolute path": ("val.json", json.dumps({"/etc/passwd": WNIDS[0]}), r"'/etc/passwd' is not a file name inside"),
    "control character": ("val.json", json.dumps({"a\nb.JPEG": WNIDS[0]}), r"is not a file name inside"),
    "labeled twice": ("val.csv", f"{VAL[0]},{WNIDS[0]}\n{VAL[0]},{WNIDS[1]}\n", r"row 2: .* labeled twice"),
    "not UTF-8": ("val.csv", b"\xff\xfe\x00bad,\x81\n", r"not UTF-8 text"),
    "NUL bytes": ("val.csv", b"a.JPEG,n01440764\x00\n", r"NUL bytes"),
    "bad JSON": ("val.json", '{"a.JPEG": ', r"not valid JSON"),
    "JSON array": ("val.json", json.dumps([VAL[0], WNIDS[0]]), r"must be one object"),
    "JSON nested": ("val.json", "[" * 100000 + "]" * 100000, r"not valid JSON|must be one object"),
    "JSON class not a name": ("val.json", json.dumps({VAL[0]: [1]}), r"class must be a name or an index, not list"),
    "JSON boolean class": ("val.json", json.dumps({VAL[0]: True}), r"not bool"),
    "three columns": ("val.csv", f"{VAL[0]},{WNIDS[0]},x\n", r"row 1: expected two columns"),
    "LOC without class": ("LOC.csv", "ImageId,PredictionString\nILSVRC2012_val_00000001,\n", r"row 2: expected ImageId"),
    "empty": ("val.csv", "\n\n", r"label file is empty"),
    "names no image": ("val.csv", f"other.JPEG,{WNIDS[0]}\n", r"names none of the images of the flat split"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_label_files_are_refused_naming_the_problem(imagenet_tree, tmp_path, case):
    name, content, error = BROKEN[case]
    labels = label_file(tmp_path, name, content)
    out = tmp_path / "o.lmdb"
    with pytest.raises(SourceError, match=error):
        pack(str(imagenet_tree), "lmdb", str(out), labels=str(labels), workers=1)
    assert not out.exists()
    cli = run("pack", imagenet_tree, "--to", "lmdb", "-o", out, "--labels", labels)
    assert cli.exit_code == 1 and "Traceback" not in cli.output
    assert str(labels) in cli.stderr


def test_a_fifo_or_huge_label_file_is_refused_without_reading_it(imagenet_tree, tmp_path):
    fifo = tmp_path / "labels.csv"
    os.mkfifo(fifo)  # opening it for reading would block forever
    with pytest.raises(SourceError, match="not a regular file"):
        scan_source(imagenet_tree, labels=str(fifo))
    huge = tmp_path / "huge.csv"
    with open(huge, "wb") as f:
        f.truncate(600 * 2**20)  # sparse: costs no disk
    with pytest.raises(SourceError, match="larger than 512 MB"):
        scan_source(imagenet_tree, labels=str(huge))


def test_an_image_without_a_label_fails_or_is_skipped(imagenet_tree, tmp_path):
    partial = {n: c for n, c in TRUTH.items() if n != VAL[2]}
    labels = label_file(tmp_path, "LOC_val_solution.csv", loc_csv(partial))
    with pytest.raises(SourceError, match=rf"val/{VAL[2]}: no label in LOC_val_solution.csv .*--on-error skip"):
        pack(str(imagenet_tree), "lmdb", str(tmp_path / "a.lmdb"), labels=str(labels), workers=1)
    out = tmp_path / "b.lmdb"
    pack(str(imagenet_tree), "lmdb", str(out), labels=str(labels), on_error="skip", workers=1)
    assert val_labels(out) == partial
    assert read_metadata(str(out)).skipped == [
        {"path": f"val/{VAL[2]}", "split": "val", "reason": "no label in LOC_val_solution.csv"}]


def test_names_of_no_image_are_reported(imagenet_tree, tmp_path):
    extra = {**TRUTH, "ILSVRC2012_val_00050000.JPEG": WNIDS[0]}
    labels = label_file(tmp_path, "LOC_val_solution.csv", loc_csv(extra))
    result = run("pack", imagenet_tree, "--to", "lmdb", "-o", tmp_path / "o.lmdb", "--labels", labels, "--json")
    assert result.exit_code == 0, result.output
    assert ("LOC_val_solution.csv: 1 name(s) match no image of the split (first: ILSVRC2012_val_00050000)"
            in result.stderr)
    facts = json.loads(result.stdout)  # --json: one object on stdout, the rest on stderr
    assert facts["splits"]["val"]["labeled"] and facts["params"]["labels"]["shape"] == "loc"
    assert any("match no image" in w for w in facts["warnings"])


def test_labels_with_no_flat_split_are_refused(tmp_path, split_tree):
    labels = label_file(tmp_path, "val.csv", "a0.jpg,a\n")
    with pytest.raises(SourceError, match="every split .* has class folders"):
        scan_source(split_tree, labels=str(labels))


def test_verify_against_the_source_accepts_labels_from_a_file(imagenet_tree, tmp_path):
    from packer.verify import verify

    labels = label_file(tmp_path, "val.json", json.dumps(TRUTH))
    out = tmp_path / "o.lmdb"
    pack(str(imagenet_tree), "lmdb", str(out), labels=str(labels), workers=1)
    report = verify(str(out), str(imagenet_tree), workers=1)
    assert report.ok, report.problems
    assert any("labels came from val.json" in n for n in report.notes)


@pytest.mark.parametrize("header", ["filename,class", "filename,class_name", "image,label", "path,wnid",
                                    "File Name,Category"])
def test_a_csv_header_is_known_by_its_content_whatever_its_words(imagenet_tree, tmp_path, header):
    labels = label_file(tmp_path, "val.csv", header + "\n" + "".join(f"{n},{c}\n" for n, c in TRUTH.items()))
    out = tmp_path / "o.lmdb"
    pack(str(imagenet_tree), "lmdb", str(out), labels=str(labels), workers=1, progress=False)
    assert val_labels(out) == TRUTH


def test_a_first_row_naming_an_image_or_a_class_is_data_not_a_header(imagenet_tree, tmp_path):
    # No header: the first row is a label like the others, and is applied.
    labels = label_file(tmp_path, "val.csv", "".join(f"{n},{c}\n" for n, c in TRUTH.items()))
    out = tmp_path / "o.lmdb"
    pack(str(imagenet_tree), "lmdb", str(out), labels=str(labels), workers=1, progress=False)
    assert val_labels(out) == TRUTH
    # A first row with an image's name and an unknown class is a mistake, reported as one.
    bad = label_file(tmp_path, "bad.csv", f"{VAL[0]},n09999999\n" + "".join(f"{n},{c}\n" for n, c in TRUTH.items()))
    with pytest.raises(SourceError, match=r"row 1: class 'n09999999' is not one of the 3 class folders"):
        pack(str(imagenet_tree), "lmdb", str(tmp_path / "b.lmdb"), labels=str(bad), workers=1, progress=False)


def imagenet_shaped_csv(path: Path, size: int, labelled: dict[str, str]) -> Path:
    """A filename,class CSV of about size bytes, ImageNet's shape (1,000 classes named in turn,
    about 40 bytes a row): labelled's rows first, then rows naming images that are not there."""
    with open(path, "w") as f:
        f.write("".join(f"{name},{wnid}\n" for name, wnid in labelled.items()))
        row = 0
        while f.tell() < size:
            f.write("".join(f"ILSVRC2012_val_{row + k:08d}.png,{WNIDS[(row + k) % 3]}\n" for k in range(20000)))
            row += 20000
    return path


@needs_prlimit
def test_a_large_label_file_is_parsed_in_memory_bounded_by_the_images_it_labels(imagenet_tree, tmp_path):
    """An 8 MB CSV under a cap of 48 MiB over the interpreter's: read as a stream, keeping only
    the rows naming an image of the split (the whole text, its lines and rows took ~25 bytes
    a byte). The rows naming no image are counted in the warning."""
    csv_file = imagenet_shaped_csv(tmp_path / "val.csv", 8 * 2**20, TRUTH)
    done = run_capped(tmp_path, "from packer.scan import scan_source",
                      "source = scan_source(sys.argv[1], labels=sys.argv[2])\n"
                      "print(source.splits['val'].labels.tolist(), source.warnings)",
                      [str(imagenet_tree), str(csv_file)], 48 * 2**20)
    assert (done.returncode, done.stderr) == (0, "")
    rows = sum(1 for _ in open(csv_file)) - len(TRUTH)
    assert done.stdout.startswith(str([WNIDS.index(TRUTH[name]) for name in VAL]))
    assert f"val.csv: {rows} name(s) match no image of the split (first: ILSVRC2012_val_00000000.png" in done.stdout


@pytest.mark.parametrize("shape", ["json", "csv-crlf", "loc", "integers"])
def test_a_label_file_of_many_chunks_parses_as_it_did_whole(tmp_path, shape):
    """Files of 3 MB, parsed a 1 MiB chunk at a time: tokens and line endings cut at a
    chunk's end, a byte-order mark, every entry found once (checked against the text parsed
    whole by json or by lines)."""
    from packer.labels import CHUNK, read_label_file

    names = [f"dir {i % 7}/img_{i:07d}.JPEG" for i in range(70000)]
    truth = {name: WNIDS[(i * 7) % 3] for i, name in enumerate(names)}
    if shape == "json":
        text = json.dumps(truth, indent=1)
    elif shape == "csv-crlf":
        text = "filename,class\r\n" + "".join(f'"{n}",{c}\r\n' for n, c in truth.items())
    elif shape == "loc":
        text = loc_csv(truth)
    else:
        text = "".join(f"{WNIDS.index(c) + 1}\n" for c in truth.values()) * 16  # 2 bytes a line
    path = label_file(tmp_path, "labels.txt", "\ufeff" + text)
    assert path.stat().st_size > 2 * CHUNK
    found = read_label_file(path, WNIDS, 1 if shape == "integers" else None)
    if shape == "integers":
        assert list(found.by_position) == [WNIDS.index(c) for c in truth.values()] * 16
    else:
        key = (lambda n: Path(n).stem) if shape == "loc" else (lambda n: n)
        assert found.by_key == {key(n): WNIDS.index(c) for n, c in truth.items()}
    assert found.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
