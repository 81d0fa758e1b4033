"""Packing in parts: pack --part I/N, merge, and pack(executor=) on local processes.

A merge must give what a single pack of the source gives: the same records in the same
order with the same labels, classes, splits and left-out files, and for wds the very
bytes of every shard and table. Merge refuses, by name, anything that is not all the
parts of one pack.
"""
from __future__ import annotations

import concurrent.futures
import filecmp
import json
import multiprocessing
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from packer import FORMATS, FormatError, PackError, open_reader, pack
from packer.cli import main
from packer.formats import read_metadata
from packer.merge import merge
from packer.cut import PartSpec, cut_source, part_spec, source_fingerprint
from packer.parts import first_failure, settled
from packer.records import Metadata, metadata_crc
from packer.scan import scan_source

from conftest import jpeg_bytes, write


def records(path) -> dict[str, list]:
    """Every split's records in index order, each (bytes, label, path), checked against the tables."""
    found = {}
    for split in read_metadata(path).splits:
        reader = open_reader(path, split)
        try:
            found[split] = [reader.read(i) for i in range(len(reader))]
            assert [r[1] for r in found[split]] == reader.labels.tolist()
            assert [r[2] for r in found[split]] == list(reader.paths)
        finally:
            reader.close()
    return found


def same_dataset(merged, single) -> None:
    """merged holds what single holds, record for record; metadata equal but for its making."""
    assert records(merged) == records(single)
    a, b = read_metadata(merged), read_metadata(single)
    assert (a.format, a.classes, a.splits, a.skipped, a.source) == (b.format, b.classes, b.splits, b.skipped, b.source)
    drop = {"workers"}
    assert {k: v for k, v in a.params.items() if k not in drop} == {k: v for k, v in b.params.items() if k not in drop}


def same_bytes(merged: Path, single: Path) -> None:
    """Every file of a wds dataset but index.json (metadata: created, parts) is byte-identical."""
    for folder in sorted(p for p in single.iterdir() if p.is_dir()):
        names = sorted(p.name for p in folder.iterdir())
        assert names == sorted(p.name for p in (merged / folder.name).iterdir())
        match, mismatch, errors = filecmp.cmpfiles(folder, merged / folder.name, names, shallow=False)
        assert mismatch == [] and errors == [] and len(match) == len(names) > 1


def pack_parts(src, fmt, folder: Path, n: int, **kwargs) -> list[str]:
    ext = FORMATS[fmt].extension
    return [pack(str(src), fmt, str(folder / f"p{i}{ext}"), part=f"{i}/{n}", progress=False, workers=1,
                 **kwargs).out for i in range(n)]


def single_pack(src, fmt, folder: Path, **kwargs) -> Path:
    out = folder / f"single{FORMATS[fmt].extension}"
    pack(str(src), fmt, str(out), progress=False, workers=1, **kwargs)
    return out


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".partial-" in p.name or ".complete-" in p.name)


@pytest.fixture
def parts_dir(tmp_path) -> Path:
    folder = tmp_path / "parts"
    folder.mkdir()
    return folder


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_merged_parts_equal_a_single_pack(split_tree, tmp_path, parts_dir, fmt):
    single = single_pack(split_tree, fmt, tmp_path)
    paths = pack_parts(split_tree, fmt, parts_dir, 4)
    merged = tmp_path / f"merged{FORMATS[fmt].extension}"
    result = merge(list(reversed(paths)), str(merged), workers=1, progress=False)
    same_dataset(merged, single)
    if fmt == "wds":  # shuffled by default: the merge writes the single pack's permutation
        assert read_metadata(merged).params["shuffle_seed"] == 0
        same_bytes(merged, single)
    provenance = result.metadata.parts
    assert [p["index"] for p in provenance["merged"]] == [0, 1, 2, 3]
    assert [p["path"] for p in provenance["merged"]] == paths
    assert sum(p["count"] for p in provenance["merged"]) == result.metadata.count == 16
    assert read_metadata(merged).parts == provenance
    report = CliRunner().invoke(main, ["verify", str(merged), "--against", str(split_tree), "--workers", "1"])
    assert report.exit_code == 0, report.output


def test_each_part_is_a_contiguous_slice_of_the_whole_tree_and_a_dataset_of_its_own(split_tree, parts_dir):
    whole = scan_source(split_tree)
    order = [(name, p, int(l)) for name in sorted(whole.splits)
             for p, l in zip(whole.splits[name].paths, whole.splits[name].labels)]
    paths = pack_parts(split_tree, "lmdb", parts_dir, 3)
    seen = []
    for i, path in enumerate(paths):
        meta = read_metadata(path)
        facts = meta.parts
        assert (facts["index"], facts["count"], facts["total"]) == (i, 3, 16)
        assert (facts["start"], facts["stop"]) == (i * 16 // 3, (i + 1) * 16 // 3)
        assert meta.classes == whole.classes and sorted(meta.splits) == ["train", "val"]  # empty splits kept
        held = [(split, p, label) for split, recs in records(path).items() for _, label, p in recs]
        assert held == order[facts["start"]:facts["stop"]]
        seen += held
    assert seen == order
    assert len({read_metadata(p).parts["fingerprint"] for p in paths}) == 1


def test_a_wds_part_is_shuffled_within_itself(split_tree, parts_dir):
    """Index order is ImageFolder order; storage order is the part's own seeded permutation."""
    from packer.pack import write_order

    path = Path(pack_parts(split_tree, "wds", parts_dir, 2)[0])
    reader = open_reader(path, "train")
    try:
        assert list(reader.paths) == [f"train/{c}/{c}{i}.jpg" for c in "ab" for i in range(4)]
        assert reader.storage_order().tolist() == write_order(8, "train", 0).tolist()
    finally:
        reader.close()


def test_merge_reproduces_left_out_files_and_their_places(bad_tree, tmp_path, parts_dir):
    """Bad files are left out of parts and merge alike: the skipped list and every index match."""
    single = single_pack(bad_tree, "wds", tmp_path, on_error="skip")
    paths = pack_parts(bad_tree, "wds", parts_dir, 3, on_error="skip")
    assert sum(len(e["skipped_at"]) for p in paths for e in read_metadata(p).parts["splits"].values()) == 4
    merged = tmp_path / "merged.wds"
    merge(paths, str(merged), workers=2, progress=False)
    same_dataset(merged, single)
    assert len(read_metadata(merged).skipped) == 4
    same_bytes(merged, single)


def test_more_parts_than_files_gives_empty_parts_that_still_merge(flat_tree, tmp_path, parts_dir):
    single = single_pack(flat_tree, "hdf5", tmp_path)
    paths = pack_parts(flat_tree, "hdf5", parts_dir, 7)
    assert [read_metadata(p).count for p in paths] == [0, 1, 1, 0, 1, 1, 1]
    merged = tmp_path / "merged.h5"
    merge(paths, str(merged), workers=1, progress=False)
    same_dataset(merged, single)


def test_fingerprint_follows_names_labels_and_sizes_not_where_the_tree_is(split_tree, tmp_path):
    first = source_fingerprint(scan_source(split_tree))
    copy = shutil.copytree(split_tree, tmp_path / "elsewhere")
    assert source_fingerprint(scan_source(copy)) == first
    (copy / "train" / "a" / "a0.jpg").write_bytes(jpeg_bytes(1, size=(80, 80)))  # same name, new size
    assert source_fingerprint(scan_source(copy)) != first
    os.rename(copy / "val" / "c" / "c1.jpg", copy / "val" / "c" / "c9.jpg")
    second = source_fingerprint(scan_source(copy))
    os.rename(copy / "val" / "c" / "c9.jpg", copy / "val" / "a" / "c9.jpg")  # another class
    assert source_fingerprint(scan_source(copy)) not in (first, second)


def test_cut_ranges_cover_every_file_once(split_tree):
    whole = scan_source(split_tree)
    for n in (1, 2, 5, 16, 20):
        held = 0
        for i in range(n):
            part, cut = cut_source(whole, PartSpec(i, n))
            held += sum(len(s) for s in part.splits.values())
            assert sum(s["stop"] - s["start"] for s in cut.splits.values()) == cut.stop - cut.start
        assert held == whole.count


@pytest.mark.parametrize("given,problem", [("4/4", "from 0 to 3"), ("-1/4", "I/N"), ("1/0", "from 1"),
                                           ("x", "I/N"), ("1/2/3", "I/N"), ((True, 2), "whole numbers")])
def test_bad_part_specs_are_refused_saying_why(given, problem):
    with pytest.raises(PackError, match=problem):
        part_spec(given)


def test_part_and_parts_are_exclusive(split_tree, tmp_path):
    with pytest.raises(PackError, match="one or the other"):
        pack(str(split_tree), "lmdb", str(tmp_path / "x.lmdb"), part="0/2", parts=2)


# Merge refusals: each names the part at fault.


@pytest.fixture
def four_parts(split_tree, parts_dir) -> list[str]:
    return pack_parts(split_tree, "lmdb", parts_dir, 4)


def refused(paths, out, match: str, kind=PackError) -> str:
    with pytest.raises(kind, match=match) as caught:
        merge([str(p) for p in paths], str(out), workers=1, progress=False)
    assert not Path(out).exists() and leftovers(Path(out).parent) == []
    return str(caught.value)


def test_merge_refuses_a_missing_part(four_parts, tmp_path):
    message = refused(four_parts[:2] + four_parts[3:], tmp_path / "m.lmdb", "1 of the 4 parts missing")
    assert "part(s) 2 " in message and "--part I/4" in message


def test_merge_refuses_a_part_given_twice(four_parts, tmp_path):
    link = tmp_path / "same.lmdb"
    os.symlink(four_parts[1], link)
    message = refused(four_parts + [link], tmp_path / "m.lmdb", "given twice")
    assert f"as {str(four_parts[1])!r} and as {str(link)!r}" in message
    again = os.path.join(os.path.dirname(four_parts[1]), "..", os.path.basename(os.path.dirname(four_parts[1])),
                         os.path.basename(four_parts[1]))  # the same path through ".."
    message = refused(four_parts + [again], tmp_path / "m2.lmdb", "given twice")
    assert f"as {again!r}" in message


def test_merge_refuses_two_copies_of_one_part(four_parts, tmp_path):
    copy = shutil.copytree(four_parts[2], tmp_path / "copy.lmdb")
    message = refused(four_parts + [copy], tmp_path / "m.lmdb", "both hold part 2 of 4")
    assert str(copy) in message and four_parts[2] in message


def test_merge_refuses_overlapping_parts_of_another_count(split_tree, four_parts, tmp_path):
    other = pack(str(split_tree), "lmdb", str(tmp_path / "half.lmdb"), part="1/2", progress=False, workers=1).out
    message = refused(four_parts[:2] + [other], tmp_path / "m.lmdb", "overlap")
    assert other in message and "part 1 of 2" in message


def test_merge_refuses_a_part_of_a_changed_source(split_tree, four_parts, tmp_path):
    (split_tree / "val" / "a" / "a0.jpg").write_bytes(jpeg_bytes(7, size=(90, 70)))
    again = pack(str(split_tree), "lmdb", str(tmp_path / "p3-again.lmdb"), part="3/4", progress=False,
                 workers=1).out
    message = refused(four_parts[:3] + [again], tmp_path / "m.lmdb", "another source")
    assert again in message


def test_merge_refuses_parts_packed_with_other_options(split_tree, four_parts, tmp_path):
    other = pack(str(split_tree), "lmdb", str(tmp_path / "p3-none.lmdb"), part="3/4", check="none",
                 progress=False, workers=1).out
    message = refused(four_parts[:3] + [other], tmp_path / "m.lmdb", "other options")
    assert "check='none' vs 'header'" in message and other in message


def test_parts_packed_with_max_side_merge_into_the_single_re_encoded_pack(split_tree, tmp_path, parts_dir):
    single = single_pack(split_tree, "lmdb", tmp_path, max_side=32, quality=80)
    merged = tmp_path / "merged.lmdb"
    merge(pack_parts(split_tree, "lmdb", parts_dir, 3, max_side=32, quality=80), str(merged), workers=1,
          progress=False)
    same_dataset(merged, single)
    assert read_metadata(merged).reencode == read_metadata(single).reencode
    assert read_metadata(merged).reencode["counts"] == {"train": 12, "val": 4}


def test_merge_refuses_parts_re_encoded_differently(split_tree, four_parts, tmp_path):
    other = pack(str(split_tree), "lmdb", str(tmp_path / "p3-small.lmdb"), part="3/4", max_side=32,
                 progress=False, workers=1).out
    message = refused(four_parts[:3] + [other], tmp_path / "m.lmdb", "other --max-side")
    assert other in message and "(32, 90)" in message


def test_merge_refuses_parts_packed_with_another_form(split_tree, four_parts, tmp_path):
    other = pack(str(split_tree), "lmdb", str(tmp_path / "p3-b420.lmdb"), part="3/4", baseline_420=True,
                 progress=False, workers=1).out
    message = refused(four_parts[:3] + [other], tmp_path / "m.lmdb", "other --max-side/--baseline-420")
    assert "(65535, 90, 'baseline-420') vs None" in message


def test_merge_refuses_parts_of_another_format(split_tree, four_parts, tmp_path):
    other = pack(str(split_tree), "hdf5", str(tmp_path / "p3.h5"), part="3/4", progress=False, workers=1).out
    refused(four_parts[:3] + [other], tmp_path / "m.lmdb", "every part must be packed --to the same format")


@pytest.mark.parametrize("stage", ["partial", "complete"])
def test_merge_refuses_a_half_written_part_by_name(four_parts, tmp_path, stage):
    half = Path(f"{four_parts[3]}.{stage}-otherhost-4242-0123456789abcdef")
    shutil.copytree(four_parts[3], half)
    message = refused(four_parts[:3] + [half], tmp_path / "m.lmdb", "half-written part")
    assert str(half) in message
    shutil.rmtree(half)


def test_merge_refuses_what_is_not_a_part(split_tree, four_parts, tmp_path):
    whole = single_pack(split_tree, "lmdb", tmp_path)
    refused(four_parts[1:] + [whole], tmp_path / "m.lmdb", "packed in one piece", FormatError)
    merged = merge(four_parts, str(tmp_path / "merged.lmdb"), workers=1, progress=False).out
    refused(four_parts[1:] + [merged], tmp_path / "m.lmdb", "a merge of parts", FormatError)
    refused([tmp_path / "nowhere.lmdb"], tmp_path / "m.lmdb", "no such part")
    refused([], tmp_path / "m.lmdb", "needs the parts")


def test_merge_refuses_an_existing_out_without_force(four_parts, tmp_path):
    out = tmp_path / "m.lmdb"
    merge(four_parts, str(out), workers=1, progress=False)
    with pytest.raises(PackError, match="already exists"):
        merge(four_parts, str(out), workers=1, progress=False)
    merge(four_parts, str(out), workers=1, progress=False, force=True)


# Parts whose metadata was edited with its checksum recomputed: what each declares is
# cross-checked against the other parts and against what it holds.


def edit_wds_part(path: str, change) -> str:
    """Rewrite a wds part's index.json by change(index), its crc32 recomputed: an edit no checksum sees."""
    where = Path(path) / "index.json"
    index = json.loads(where.read_text())
    change(index)
    index["crc32"] = metadata_crc(index, ("wds",))
    where.write_text(json.dumps(index))
    return path


def part_of_another_source(src: Path, of: list[str], folder: Path, index: int = 3) -> str:
    """Part index/4 of src, its fingerprint edited to be that of the parts in of."""
    fingerprint = read_metadata(of[0]).parts["fingerprint"]
    other = pack(str(src), "wds", str(folder / f"forged{index}.wds"), part=f"{index}/4", progress=False, workers=1).out
    return edit_wds_part(other, lambda index: index["parts"].update(fingerprint=fingerprint))


@pytest.fixture
def four_wds_parts(split_tree, parts_dir) -> list[str]:
    return pack_parts(split_tree, "wds", parts_dir, 4)


def test_merge_refuses_a_part_of_another_source_with_the_fingerprint_copied(four_wds_parts, tmp_path):
    other = tmp_path / "other"  # the same splits and file counts, other classes
    for cls in ["ant", "bee", "cat"]:
        for i in range(4):
            write(other / "train" / cls / f"{cls}{i}.jpg", jpeg_bytes(4000 + i))
    for cls in ["ant", "cat"]:
        for i in range(2):
            write(other / "val" / cls / f"{cls}{i}.jpg", jpeg_bytes(4100 + i))
    forged = part_of_another_source(other, four_wds_parts, tmp_path)
    message = refused(four_wds_parts[:3] + [forged], tmp_path / "m.wds", "gives classes as")
    assert message.startswith(f"{forged}: ") and "['ant', 'bee', 'cat']" in message


def test_merge_refuses_a_part_of_a_source_with_one_more_file(split_tree, four_wds_parts, tmp_path):
    bigger = shutil.copytree(split_tree, tmp_path / "bigger")
    write(bigger / "train" / "c" / "c9.jpg", jpeg_bytes(99))
    forged = part_of_another_source(bigger, four_wds_parts, tmp_path)  # was an IndexError in plan_split
    message = refused(four_wds_parts[:3] + [forged], tmp_path / "m.wds",
                      r"file count \(parts.total\) as 17, but .*gives 16")
    assert forged in message


def test_merge_refuses_a_part_that_moves_files_between_splits(four_wds_parts, tmp_path):
    def move(index):  # train lists one more, val one fewer: the same total
        index["parts"]["splits"]["train"]["listed"] += 1
        index["parts"]["splits"]["val"]["listed"] -= 1
        bounds = {"train": (0, 13), "val": (13, 16)}
        start, stop = index["parts"]["start"], index["parts"]["stop"]
        for name, (first, end) in bounds.items():
            index["parts"]["splits"][name].update(start=min(max(start - first, 0), end - first),
                                                  stop=min(max(stop - first, 0), end - first))
    forged = edit_wds_part(four_wds_parts[0], move)
    Metadata.from_dict(json.loads((Path(forged) / "index.json").read_text()), "here", ("wds",))  # valid alone
    refused(four_wds_parts, tmp_path / "m.wds", "gives files each split lists as")


def test_merge_refuses_a_part_whose_class_counts_are_not_what_it_holds(four_wds_parts, tmp_path):
    def rotate(index):
        counts = index["splits"]["train"]["class_counts"]
        index["splits"]["train"]["class_counts"] = counts[1:] + counts[:1]
    counts = read_metadata(four_wds_parts[1]).splits["train"].class_counts
    assert counts != counts[1:] + counts[:1]
    forged = edit_wds_part(four_wds_parts[1], rotate)
    message = refused(four_wds_parts, tmp_path / "m.wds", "records per class, but its metadata lists", FormatError)
    assert message.startswith(f"{forged}: split train")


# The "parts" metadata: checked when read.


def tampered(meta: Metadata, change) -> dict:
    d = json.loads(json.dumps(meta.to_dict()))
    change(d["parts"])
    d["crc32"] = metadata_crc(d)
    return d


@pytest.mark.parametrize("change,problem", [
    (lambda p: p.update(start=p["start"] + 1), "not the"),
    (lambda p: p["splits"]["train"].update(stop=p["splits"]["train"]["stop"] + 1), "its part.s range"),
    (lambda p: p["splits"]["train"].update(skipped_at=[0]), "left out"),
    (lambda p: p["splits"]["train"].update(skipped_at=["x"]), "increasing positions"),
    (lambda p: p.update(index=7), "parts.index"),
    (lambda p: p.update(fingerprint="md5:1"), "sha256"),
    (lambda p: p.update(merged=[]), "either an index or a merged list"),
    (lambda p: p["splits"].pop("val"), "one entry per split"),
    (lambda p: p["splits"]["val"].update(listed=99), "parts.total"),
])
def test_damaged_part_metadata_is_refused(four_parts, change, problem):
    meta = read_metadata(four_parts[1])
    Metadata.from_dict(tampered(meta, lambda p: None), "here")  # unchanged: accepted
    with pytest.raises(FormatError, match=problem):
        Metadata.from_dict(tampered(meta, change), "here")


def test_damaged_merge_provenance_is_refused(four_parts, tmp_path):
    meta = read_metadata(merge(four_parts, str(tmp_path / "m.lmdb"), workers=1, progress=False).out)
    with pytest.raises(FormatError, match="parts.merged counts"):
        Metadata.from_dict(tampered(meta, lambda p: p["merged"][0].update(count=99)), "here")
    with pytest.raises(FormatError, match="not an object for part 1"):
        Metadata.from_dict(tampered(meta, lambda p: p["merged"][1].update(index=3)), "here")


def test_a_dataset_packed_in_one_piece_has_no_parts_key(split_tree, tmp_path):
    assert "parts" not in read_metadata(single_pack(split_tree, "lmdb", tmp_path)).to_dict()


# The command line.


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_part_then_merge_then_info(split_tree, tmp_path):
    for i in range(3):
        result = run("pack", split_tree, "--to", "wds", "--part", f"{i}/3", "--workers", "1")
        assert result.exit_code == 0, result.output
    names = sorted(p.name for p in split_tree.parent.glob("splits.part-*"))
    assert names == [f"splits.part-0000{i}-of-00003.wds" for i in range(3)]
    out = tmp_path / "merged.wds"
    result = run("merge", *sorted(split_tree.parent.glob("splits.part-*")), "-o", out, "--workers", "1", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["parts"]["count"] == 3
    assert run("verify", out, "--against", split_tree, "--workers", "1").exit_code == 0
    info = run("info", out).output
    assert "merged from 3 parts of source sha256:" in info and "part 2: " in info
    info = run("info", split_tree.parent / "splits.part-00001-of-00003.wds").output
    assert "part 1 of 3 (counted from 0)" in info and "files 5-10 of 16 (train 5-10 of 12)" in info


def test_cli_refuses_a_bad_part_and_mixed_options(split_tree):
    result = run("pack", split_tree, "--to", "lmdb", "--part", "3/3")
    assert result.exit_code == 2 and "from 0 to 2" in result.output  # a usage error, as every bad option value
    result = run("pack", split_tree, "--to", "lmdb", "--part", "x")
    assert result.exit_code == 2 and "give it as I/N" in result.output
    assert not list(split_tree.parent.glob("*.lmdb"))
    result = run("pack", split_tree, "--to", "lmdb", "--part", "0/3", "--parts", "3")
    assert result.exit_code == 2 and "one or the other" in result.output


def test_cli_merge_names_a_missing_part(split_tree, tmp_path):
    paths = pack_parts(split_tree, "lmdb", tmp_path, 3)
    result = run("merge", paths[0], paths[2], "-o", tmp_path / "m.lmdb")
    assert result.exit_code == 1 and "part(s) 1 " in result.output


# pack(executor=): the parts run on a concurrent.futures Executor, then are merged.


def test_pack_on_a_process_pool_equals_a_single_pack(split_tree, tmp_path):
    single = single_pack(split_tree, "wds", tmp_path)
    out = tmp_path / "pooled.wds"
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        result = pack(str(split_tree), "wds", str(out), executor=pool, parts=3, workers=1, progress=False)
    assert result.metadata.parts["count"] == 3
    same_dataset(out, single)
    same_bytes(out, single)
    assert leftovers(tmp_path) == []


def test_parts_without_an_executor_run_on_local_processes(split_tree, tmp_path):
    single = single_pack(split_tree, "lmdb", tmp_path)
    out = tmp_path / "local.lmdb"
    pack(str(split_tree), "lmdb", str(out), parts=2, workers=1, progress=False)
    same_dataset(out, single)
    assert leftovers(tmp_path) == []


def test_a_failing_part_is_reported_by_name_and_leaves_nothing(split_tree, tmp_path):
    (split_tree / "val" / "c" / "c1.jpg").write_bytes(b"")  # the last file: in part 1 of 2 only
    out = tmp_path / "bad.lmdb"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with pytest.raises(PackError, match=r"part 1/2: val/c/c1.jpg: empty file .*--on-error skip") as caught:
            pack(str(split_tree), "lmdb", str(out), executor=pool, parts=2, workers=1, progress=False)
    assert type(caught.value).__name__ == "BadImageError"
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_dead_worker_is_reported_by_name_and_leaves_nothing(split_tree, tmp_path):
    """A process pool whose worker is killed (os._exit) breaks: the part is named, OUT stays absent."""
    out = tmp_path / "dead.lmdb"
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        dying = DyingPool(pool)
        with pytest.raises(PackError, match=r"part [01]/2 .*executor broke.*worker processes died"):
            pack(str(split_tree), "lmdb", str(out), executor=dying, parts=2, workers=1, progress=False)
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_pack_in_parts_says_nothing_of_its_own_staging(split_tree, tmp_path):
    result = run("pack", split_tree, "--to", "lmdb", "--parts", "2", "--workers", "1", "-o", tmp_path / "p.lmdb")
    assert result.exit_code == 0, result.output
    assert "left " not in result.stderr and "warning" not in result.stderr, result.stderr


def test_a_bug_in_one_part_is_raised_before_another_parts_packing_error():
    """Both finished by the time they are looked at: the bug keeps its traceback and names
    the other part, whichever has the lower index."""
    tasks = [SimpleNamespace(spec=PartSpec(i, 2), out=f"part{i}") for i in range(2)]
    futures = {concurrent.futures.Future(): task for task in tasks}
    failed, buggy = futures
    failed.set_exception(FileNotFoundError(2, "No such file or directory", "part0/x"))
    buggy.set_exception(ZeroDivisionError("division by zero"))
    chosen = first_failure({0: settled_error(failed, tasks[0])}, futures)
    assert isinstance(chosen, ZeroDivisionError)
    assert "also failed: part 0" in chosen.__notes__
    assert any(note.startswith("raised by part 1/2 (part1)") for note in chosen.__notes__)


def settled_error(future, task) -> PackError:
    with pytest.raises(PackError) as caught:
        settled(future, task)
    return caught.value


def test_a_part_that_raises_a_bug_keeps_its_traceback_and_names_the_part(split_tree, tmp_path):
    """Not a packing error and not a death: the exception itself, noted with its part, so its
    traceback shows (the CLI prints tracebacks for bugs); nothing is left."""
    out = tmp_path / "bug.lmdb"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with pytest.raises(ZeroDivisionError) as caught:
            pack(str(split_tree), "lmdb", str(out), executor=DyingPool(pool, divide_by_zero), parts=2, workers=1,
                 progress=False)
    assert any(note.startswith("raised by part 0/2 (") for note in caught.value.__notes__)
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_part_whose_system_call_fails_names_the_part_and_what_failed(split_tree, tmp_path):
    out = tmp_path / "oserror.lmdb"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with pytest.raises(PackError, match=r"part 0/2 \(.*\): FileNotFoundError in its worker: .*gone.*mended"):
            pack(str(split_tree), "lmdb", str(out), executor=DyingPool(pool, open_gone), parts=2, workers=1,
                 progress=False)
    assert not out.exists() and leftovers(tmp_path) == []


def divide_by_zero(task):
    return 1 / 0


def open_gone(task):
    return open(os.path.join(task.out, "gone"), "rb")


class DyingPool(concurrent.futures.Executor):
    """Forwards to pool, but part 0 runs through fail (picklable) instead; without fail, the
    worker given part 0 exits before packing it."""

    def __init__(self, pool, fail=None):
        self.pool, self.fail = pool, fail

    def submit(self, fn, *args, **kwargs):
        if args[0].spec.index == 0:
            return self.pool.submit(os._exit, 3) if self.fail is None else self.pool.submit(self.fail, *args)
        return self.pool.submit(fn, *args, **kwargs)
