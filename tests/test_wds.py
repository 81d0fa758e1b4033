"""WebDataset shards: layout, interop both ways with the webdataset library and tar, and WDSDataset."""
from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import zlib
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from torch.utils.data import DataLoader

import readers
from packer import CorruptDataError, FormatError, PackError, pack
from packer.cli import main
from packer.errors import ReplacedError
from packer.formats import _shards, _tables, _tar, wds
from packer.verify import verify
from readers import WDSDataset

from conftest import SHARED_DATA, jpeg_bytes, write

ROOT = Path(__file__).resolve().parents[1]


def pack_wds(src: Path, out: Path, max_count: int | None = None, **kwargs) -> Path:
    if max_count is not None:
        kwargs["options"] = {"max_count": max_count}
    pack(str(src), "wds", str(out), workers=1, progress=False, **kwargs)
    return out


def shard_files(out: Path, split: str = "all") -> list[Path]:
    return sorted((out / split).glob("*.tar"))


def digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@pytest.fixture
def even_tree(tmp_path) -> Path:
    """24 distinct JPEGs in 4 classes: with --max-count 3, eight equal shards."""
    root = tmp_path / "even"
    for i in range(24):
        write(root / f"c{i % 4}" / f"img_{i:02d}.jpg", jpeg_bytes(5000 + i, size=(16, 16)))
    return root


# --- keys and layout ---------------------------------------------------------------------

@pytest.mark.parametrize("relpath, key", [
    ("cat/img_0.JPEG", "cat/img_0_JPEG"),
    ("v1.2/img.v2.final.jpg", "v1.2/img%2Ev2%2Efinal_jpg"),
    ("dog house/名前 with space.jpg", "dog house/名前 with space_jpg"),
    ("a/100%.png", "a/100%25_png"),
    ("flat.jpg", "flat_jpg"),
])
def test_keys_have_no_dot_in_the_last_component_and_split_back_as_webdataset_does(relpath, key):
    assert wds.sample_key(relpath) == key
    member = f"{key}.{wds.source_suffix(relpath)}"
    webdataset_tariterators = pytest.importorskip("webdataset.tariterators")
    assert webdataset_tariterators.base_plus_ext(member) == (key, relpath.rpartition(".")[2].lower())


def test_keys_are_unique_for_same_stem_with_other_extension_or_case():
    names = ["d/x.jpg", "d/x.png", "d/x.JPG", "d/x_jpg.jpg", "d/x.jpg.jpg", "d/x%2Ejpg.jpg", "d/x_.jpg"]
    keys = [wds.sample_key(n) for n in names]
    assert len(set(keys)) == len(names)
    assert all("." not in k.rpartition("/")[2] for k in keys)


def test_non_utf8_file_names_round_trip(tmp_path):
    src = tmp_path / "nonutf8"
    folder = os.fsencode(src) + b"/cl\xffass"
    os.makedirs(folder)
    with open(folder + b"/im\xfeg.jpg", "wb") as f:
        f.write(jpeg_bytes(9))
    out = pack_wds(src, tmp_path / "n.wds")
    reader = wds.Reader(str(out))
    assert reader.read(0)[2] == "cl\udcffass/im\udcfeg.jpg" and reader.classes == ["cl\udcffass"]
    assert [label for _, label in WDSDataset(out, decode="raw")] == [0]
    assert verify(str(out), str(src), workers=1).ok


@pytest.mark.parametrize("name", ["a", "x" * 100, "x" * 101, "cat/img_0_JPEG.jpeg", "ünï/名前_jpg.jpg",
                                  "dog house/100%25_png.json", "tab\there.cls"])
@pytest.mark.parametrize("size", [0, 1, 511, 512, 123_456_789, 8**11 - 1, 8**11])
def test_fast_tar_header_is_byte_identical_to_tarfile(name, size):
    assert _tar.header(name, size) == _tar.tar_header(name, size)


def test_shard_digests_hashed_beside_the_writer_match_the_files(image_tree, tmp_path, monkeypatch):
    """The SHA-256 of each shard runs on a helper thread, BATCH samples at a time with at
    most PENDING batches queued: with batches of 2 and a queue of 1 the writer waits on
    the hash every few samples, and every shard's digest still matches its file (a last
    partial batch included); the helper thread is gone when the pack ends."""
    import threading

    from packer.formats import wds as wds_format

    monkeypatch.setattr(wds_format.ShardDigest, "BATCH", 2)
    monkeypatch.setattr(wds_format.ShardDigest, "PENDING", 1)
    out = pack_wds(image_tree, tmp_path / "t.wds", max_count=7)
    entries = json.loads((out / "index.json").read_text())["wds"]["splits"]["all"]["shards"]
    assert len(entries) == 3
    for shard, entry in zip(shard_files(out), entries):
        assert hashlib.sha256(shard.read_bytes()).hexdigest() == entry["sha256"]
    assert not [t for t in threading.enumerate() if t.name.startswith("shard-sha256")]


def test_shards_list_with_tarfile_and_tar(image_tree, tmp_path):
    out = pack_wds(image_tree, tmp_path / "t.wds", max_count=5)
    shards = shard_files(out)
    index = json.loads((out / "index.json").read_text())
    entries = index["wds"]["splits"]["all"]["shards"]
    assert [e["name"] for e in entries] == [f"all/shard-{i:06d}.tar" for i in range(4)]
    assert [e["count"] for e in entries] == [5, 5, 5, 4]
    names = []
    for shard, entry in zip(shards, entries):
        assert shard.stat().st_size == entry["bytes"]
        assert hashlib.sha256(shard.read_bytes()).hexdigest() == entry["sha256"]
        with tarfile.open(shard) as tar:
            members = tar.getmembers()
        assert all(m.isreg() and m.mtime == _tar.MTIME and m.uid == 0 for m in members)
        names += [m.name for m in members]
        if shutil.which("tar"):
            listed = subprocess.run(["tar", "tf", str(shard)], capture_output=True, check=True).stdout
            assert listed.decode().splitlines() == [m.name for m in members]
    assert len(names) == 19 * 3
    # named by content: the PNG named .JPEG is a png member, every JPEG (.jpeg, .JPG) a jpg one
    assert {n.rpartition(".")[2] for n in names} == {"jpg", "png", "cls", "json"}


def test_shard_size_bounds_every_shard_that_holds_more_than_one_sample(imagenet_sample, tmp_path):
    out = pack_wds(imagenet_sample, tmp_path / "s.wds", options={"shard_size": "1MB"})
    shards = json.loads((out / "index.json").read_text())["wds"]["splits"]["all"]["shards"]
    assert len(shards) > 5 and sum(s["count"] for s in shards) == 125
    assert all(s["bytes"] <= 1_000_000 for s in shards if s["count"] > 1)


@pytest.mark.parametrize("text, size", [("1GB", 10**9), ("256MB", 256 * 10**6), ("512KB", 512_000),
                                        ("4096", 4096), ("1GiB", 2**30), ("1.5 mb", 1_500_000)])
def test_parse_size_accepts_units_and_plain_bytes(text, size):
    assert wds.parse_size(text) == size


def test_parse_size_rejects_nonsense_listing_the_units():
    with pytest.raises(ValueError, match="KB, MB, GB"):
        wds.parse_size("12 parsecs")


def test_repacking_gives_identical_shards(image_tree, tmp_path):
    a = pack_wds(image_tree, tmp_path / "a.wds", max_count=4)
    b = pack_wds(image_tree, tmp_path / "b.wds", max_count=4)
    assert [p.read_bytes() for p in shard_files(a)] == [p.read_bytes() for p in shard_files(b)]


def test_shuffled_shards_mix_classes_and_no_shuffle_keeps_imagefolder_order(image_tree, tmp_path):
    folder = readers.FolderDataset(image_tree, decode="raw")
    in_order = [folder[i][0] for i in range(len(folder))]
    plain = pack_wds(image_tree, tmp_path / "p.wds", shuffle=False)
    assert [d for d, _ in WDSDataset(plain, decode="raw")] == in_order
    mixed = pack_wds(image_tree, tmp_path / "m.wds", shuffle_seed=7)
    stored = [d for d, _ in WDSDataset(mixed, decode="raw")]
    assert stored != in_order and sorted(stored) == sorted(in_order)
    assert json.loads((mixed / "index.json").read_text())["params"]["shuffle_seed"] == 7
    # The map-style view stays in ImageFolder order whatever the shard order.
    assert [wds.Reader(str(mixed)).read(i)[0] for i in range(len(folder))] == in_order


def test_cli_shard_options_are_refused_for_other_formats(image_tree, tmp_path):
    result = CliRunner().invoke(main, ["pack", str(image_tree), "--to", "lmdb", "-o", str(tmp_path / "x"),
                                       "--shard-size", "1MB"])
    assert result.exit_code == 2 and "only for --to wds" in result.output
    assert not (tmp_path / "x").exists()
    result = CliRunner().invoke(main, ["pack", str(image_tree), "--to", "wds", "--shard-size", "lots"])
    assert result.exit_code == 2 and "not a size" in result.output


def test_skipped_files_are_listed_in_imagefolder_order_and_verify_notes_them(bad_tree, tmp_path):
    out = pack_wds(bad_tree, tmp_path / "b.wds", on_error="skip", shuffle_seed=11)
    skipped = [e["path"] for e in json.loads((out / "index.json").read_text())["skipped"]]
    assert skipped == sorted(skipped) and len(skipped) == 4
    assert len(list(WDSDataset(out, decode="raw"))) == 3
    report = verify(str(out), str(bad_tree), workers=1)
    assert report.ok, report.problems
    assert sum("skipped at pack time" in n for n in report.notes) == 4


def test_library_refuses_to_shuffle_a_format_without_the_flag(image_tree, tmp_path, monkeypatch):
    import dataclasses

    from packer.formats import FORMATS

    monkeypatch.setitem(FORMATS, "lmdb", dataclasses.replace(FORMATS["lmdb"], writes_shuffled=False))
    with pytest.raises(PackError, match="cannot be written shuffled.*wds"):
        pack(str(image_tree), "lmdb", str(tmp_path / "x.lmdb"), shuffle=True, progress=False)
    assert not (tmp_path / "x.lmdb").exists()


def test_cli_packs_with_shard_options_and_info_and_verify_work(image_tree, tmp_path):
    out = tmp_path / "c.wds"
    result = CliRunner().invoke(main, ["pack", str(image_tree), "--to", "wds", "-o", str(out), "--max-count", "6",
                                       "--no-shuffle", "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert len(shard_files(out)) == 4
    facts = json.loads(CliRunner().invoke(main, ["info", str(out), "--json"]).stdout)
    assert facts["format"] == "wds" and facts["count"] == 19 and facts["params"]["shuffle_seed"] is None
    result = CliRunner().invoke(main, ["verify", str(out), "--against", str(image_tree)])
    assert result.exit_code == 0 and "ok: 19 records intact" in result.stderr


def test_verify_names_a_damaged_or_truncated_shard(image_tree, tmp_path):
    out = pack_wds(image_tree, tmp_path / "v.wds", max_count=5)
    last = shard_files(out)[-1]
    last.write_bytes(last.read_bytes()[:-2048])
    problems = "\n".join(verify(str(out), workers=1).problems)
    assert "all/shard-000003.tar: " in problems and "the index says" in problems
    assert "truncated" in problems


# --- interop: out to the webdataset library ----------------------------------------------

def test_official_webdataset_yields_the_folder_images_and_labels(image_tree, tmp_path):
    webdataset = pytest.importorskip("webdataset")
    out = pack_wds(image_tree, tmp_path / "o.wds", max_count=4)
    assert (out / "all" / "positions.bin").is_file()  # shuffled: its tables lie beside the shards, in no tar
    folder = readers.FolderDataset(image_tree)
    position = {p: i for i, p in enumerate(folder.paths)}
    seen = []
    for sample in webdataset.WebDataset([str(p) for p in shard_files(out)], shardshuffle=False).decode("pil"):
        relpath = sample["json"]["path"]
        image = next(v for k, v in sample.items() if k in ("jpg", "png"))
        expected, label = folder[position[relpath]]
        assert sample["cls"] == label
        assert image.convert("RGB").tobytes() == expected.tobytes()
        seen.append(relpath)
    assert sorted(seen) == sorted(folder.paths)


# --- interop: in from other writers ------------------------------------------------------

def test_reads_the_real_gzip_shard_as_it_is():
    shard = SHARED_DATA / "webdataset-testdata" / "sample.tgz"
    if not shard.is_file():
        pytest.skip(f"{shard} is not present (set PACKER_SHARED_DATA)")
    ds = WDSDataset(shard)
    assert len(ds) == 90
    samples = list(ds)
    assert len(samples) == 90
    assert all(im.size == (28, 28) and im.mode == "RGB" for im, _ in samples)
    assert set(label for _, label in samples) == set(range(10))
    webdataset = pytest.importorskip("webdataset")
    official = [s["cls"] for s in webdataset.WebDataset(str(shard), shardshuffle=False).decode("pil")]
    assert [label for _, label in samples] == official


def test_reads_shards_written_by_webdataset_shardwriter(tmp_path):
    webdataset = pytest.importorskip("webdataset")
    images = [jpeg_bytes(6000 + i, size=(8, 8)) for i in range(20)]
    with webdataset.ShardWriter(str(tmp_path / "sw-%06d.tar"), maxcount=7, verbose=0) as sink:
        for i, data in enumerate(images):
            sink.write({"__key__": f"sample{i:04d}", "jpg": data, "cls": i % 3})
    pattern = str(tmp_path / "sw-{000000..000002}.tar")
    for source in (pattern, tmp_path, sorted(tmp_path.glob("sw-*.tar"))):
        ds = WDSDataset(source, decode="raw")
        assert len(ds) == 20
        assert list(ds) == [(data, i % 3) for i, data in enumerate(images)]


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_reads_a_plain_tar_of_a_folder_with_dot_slash_names_and_folders(tmp_path, mode):
    src = tmp_path / "plain"
    files = {"a/x.jpg": jpeg_bytes(1), "a/deeper/y.png": jpeg_bytes(2, fmt="PNG"), "b/z.v2.jpeg": jpeg_bytes(3)}
    for name, data in files.items():
        write(src / name, data)
    write(src / "README", b"no suffix: not a sample")
    write(src / "b" / "notes.txt", b"no image member: not a sample")
    shard = tmp_path / "plain.tar"
    with tarfile.open(shard, mode) as tar:
        tar.add(src, arcname=".")
    with tarfile.open(shard) as tar:
        assert "./a" in tar.getnames() and "./a/x.jpg" in tar.getnames()
    ds = WDSDataset(shard, decode="raw")
    assert len(ds) == 3
    assert sorted(data for data, _ in ds) == sorted(files.values())
    assert {label for _, label in ds} == {-1}


# --- distribution, epochs, shuffling -----------------------------------------------------

def collect(ds, workers: int = 2, context: str | None = None) -> list[str]:
    loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=context)
    return [digest(data) for data, _ in loader]


def test_every_sample_once_across_ranks_and_workers(even_tree, tmp_path):
    out = pack_wds(even_tree, tmp_path / "e.wds", max_count=3)
    everything = sorted(digest(data) for data, _ in WDSDataset(out, decode="raw"))
    assert len(everything) == 24 == len(set(everything))
    per_rank = []
    for rank in range(2):
        ds = WDSDataset(out, decode="raw", shuffle=5, seed=3, rank=rank, world_size=2)
        assert len(ds) == 12
        per_rank.append(collect(ds))
    assert [len(r) for r in per_rank] == [12, 12]
    assert sorted(per_rank[0] + per_rank[1]) == everything


def test_uneven_shards_pad_every_rank_to_the_same_length_by_repeating(image_tree, tmp_path, monkeypatch):
    out = pack_wds(image_tree, tmp_path / "u.wds", max_count=3)  # shards of 3,3,3,3,3,3,1
    everything = Counter(digest(data) for data, _ in WDSDataset(out, decode="raw"))
    monkeypatch.setenv("WORLD_SIZE", "3")
    per_rank = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        ds = WDSDataset(out, decode="raw")
        per_rank.append(collect(ds))
        assert len(per_rank[-1]) == len(ds)
    assert len({len(r) for r in per_rank}) == 1  # equal lengths: DDP cannot hang
    seen = Counter(d for r in per_rank for d in r)
    assert set(seen) == set(everything)  # nothing dropped
    assert sum(seen.values()) - len(everything) == 3 * len(per_rank[0]) - 19  # only padding repeats


def test_more_ranks_than_shards_still_gives_every_rank_samples(tmp_path):
    shard = SHARED_DATA / "webdataset-testdata" / "sample.tgz"
    if not shard.is_file():
        pytest.skip("sample.tgz is not present")
    everything = [digest(data) for data, _ in WDSDataset(shard, decode="raw")]
    per_rank = [[digest(data) for data, _ in WDSDataset(shard, decode="raw", rank=r, world_size=4)]
                for r in range(4)]
    each = -(-len(everything) // 4)  # the one shard is cut among the ranks, not dealt whole to one
    assert [len(r) for r in per_rank] == [each] * 4
    handed = [d for r in per_rank for d in r]
    assert set(handed) == set(everything) and len(handed) - len(everything) == 4 * each - len(everything) < 4


def test_a_ranks_epoch_length_is_the_same_every_epoch(tmp_path):
    """Uneven shards, shuffled: whichever order an epoch deals them in, every rank's pass has
    the same length, epoch after epoch (Lightning reads a loader's length once)."""
    out, counts = tmp_path / "uneven", [9, 2, 7, 1, 5]
    out.mkdir()
    for shard, count in enumerate(counts):
        with tarfile.open(out / f"shard-{shard}.tar", "w") as tar:
            for i in range(count):
                for suffix, data in (("jpg", jpeg_bytes(100 * shard + i, size=(8, 8))), ("cls", b"0")):
                    member = tarfile.TarInfo(f"s{shard}_{i}.{suffix}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
    for world_size in (2, 3):
        for rank in range(world_size):
            ds = WDSDataset(out, decode="raw", shuffle=4, seed=1, rank=rank, world_size=world_size)
            lengths = set()
            for epoch in range(6):
                ds.set_epoch(epoch)
                lengths.add(len(list(ds)))
            assert lengths == {-(-sum(counts) // world_size)} == {len(ds)}


def ddp_rank(rank: int, world_size: int, out: str, init_file: str, results: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        ds = WDSDataset(out, decode="raw", shuffle=4)
        assert pickle.loads(pickle.dumps(ds)).rank == rank  # what a spawned DataLoader worker gets
        digests = [digest(data) for data, _ in ds]
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (len(ds), digests))
        if rank == 0:
            Path(results).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def test_ranks_come_from_torch_distributed_when_initialised(even_tree, tmp_path, monkeypatch):
    import torch.multiprocessing

    out = pack_wds(even_tree, tmp_path / "d.wds", max_count=4)  # 6 shards of 4
    monkeypatch.setenv("WORLD_SIZE", "1")  # must lose to the process group
    results = tmp_path / "ranks.json"
    torch.multiprocessing.spawn(ddp_rank, args=(2, str(out), str(tmp_path / "init"), str(results)), nprocs=2)
    (len0, seen0), (len1, seen1) = json.loads(results.read_text())
    assert len0 == len1 == len(seen0) == len(seen1) == 12
    assert sorted(seen0 + seen1) == sorted(digest(d) for d, _ in WDSDataset(out, decode="raw"))


def test_set_epoch_reshuffles_deterministically(even_tree, tmp_path):
    out = pack_wds(even_tree, tmp_path / "s.wds", max_count=3)

    def order(epoch, seed=0):
        ds = WDSDataset(out, decode="raw", shuffle=8, seed=seed)
        ds.set_epoch(epoch)
        return [digest(d) for d, _ in ds]

    assert order(1) == order(1)
    assert order(1) != order(2)
    assert order(1, seed=5) != order(1)
    assert sorted(order(1)) == sorted(order(2))
    unshuffled = WDSDataset(out, decode="raw")
    unshuffled.set_epoch(9)
    assert [digest(d) for d, _ in unshuffled] == [digest(d) for d, _ in WDSDataset(out, decode="raw")]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_under_fork_and_spawn(even_tree, tmp_path, context):
    out = pack_wds(even_tree, tmp_path / "w.wds", max_count=5)
    ds = WDSDataset(out, decode="tensor", shuffle=4)
    assert len(ds) == 24
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context)
    batches = list(loader)
    assert sum(len(labels) for _, labels in batches) == 24
    assert batches[0][0].shape == (4, 3, 16, 16)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_set_epoch_reaches_persistent_workers(even_tree, tmp_path, context):
    out = pack_wds(even_tree, tmp_path / "p.wds", max_count=3)
    ds = WDSDataset(out, decode="raw", shuffle=8, seed=1)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context=context)
    seen = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        seen.append([digest(d) for d, _ in loader])
    fresh = WDSDataset(out, decode="raw", shuffle=8, seed=1)
    fresh.set_epoch(1)
    assert seen[1] != seen[0]
    # Epoch 1 in the same workers as in new ones; new ones forked, since the order is the
    # seed's, the epoch's and the worker's, not the start method's (and spawning costs seconds).
    assert seen[1] == collect(fresh, context="fork")


def test_dataset_pickles_and_yields_the_same(even_tree, tmp_path):
    ds = WDSDataset(pack_wds(even_tree, tmp_path / "k.wds"), decode="raw", shuffle=6, seed=2)
    ds.set_epoch(3)
    clone = pickle.loads(pickle.dumps(ds))
    assert list(clone) == list(ds)
    mapped = readers.WDSMapDataset(tmp_path / "k.wds", decode="raw")
    mapped[0]
    assert pickle.loads(pickle.dumps(mapped))[5] == mapped[5]


# --- damage -----------------------------------------------------------------------------

def test_truncated_shard_raises_naming_the_shard_and_offset(image_tree, tmp_path):
    out = pack_wds(image_tree, tmp_path / "x.wds", max_count=5)
    shard = shard_files(out)[1]
    blob = shard.read_bytes()
    shard.write_bytes(blob[:len(blob) // 2 + 100])
    with pytest.raises(CorruptDataError, match=r"shard-000001\.tar: truncated at byte \d+"):
        list(WDSDataset(out, decode="raw"))


def test_shard_cut_at_a_block_boundary_is_not_a_silent_short_epoch(image_tree, tmp_path):
    out = pack_wds(image_tree, tmp_path / "y.wds", max_count=5)
    shard = shard_files(out)[0]
    with tarfile.open(shard) as tar:
        cut = tar.getmembers()[-3].offset  # drop the last sample, end blocks and all
    shard.write_bytes(shard.read_bytes()[:cut])
    with pytest.raises(CorruptDataError, match=r"shard-000000\.tar"):
        list(WDSDataset(out, decode="raw"))
    # The sample before the cut is still open when the damage shows (its members may be
    # missing), so skipping loses it too, and says so.
    with pytest.warns(RuntimeWarning, match=r"shard-000000\.tar.* 2 sample\(s\) short this epoch"):
        assert len(list(WDSDataset(out, decode="raw", on_error="skip"))) == 17


def test_foreign_shard_with_a_garbage_header_names_the_offset(tmp_path):
    shard = tmp_path / "g.tar"
    with tarfile.open(shard, "w") as tar:
        for i in range(3):
            info = tarfile.TarInfo(f"k{i}.jpg")
            data = jpeg_bytes(i)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    blob = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:
        second = tar.getmembers()[1].offset
    blob[second:second + 20] = b"garbage garbage garb"
    shard.write_bytes(bytes(blob))
    with pytest.raises(CorruptDataError, match=rf"g\.tar: no valid tar header at byte {second}"):
        len(WDSDataset(shard))


def test_corrupt_gzip_shard_is_reported(tmp_path):
    src = SHARED_DATA / "webdataset-testdata" / "sample.tgz"
    if not src.is_file():
        pytest.skip("sample.tgz is not present")
    blob = src.read_bytes()
    shard = tmp_path / "cut.tgz"
    shard.write_bytes(blob[:len(blob) // 2])
    with pytest.raises(CorruptDataError, match=r"cut\.tgz \(gzip\): cannot decompress"):
        len(WDSDataset(shard))


def test_subprocess_cli_packs_wds(image_tree, tmp_path):
    out = tmp_path / "sub.wds"
    subprocess.run([sys.executable, "-m", "packer.cli", "pack", str(image_tree), "--to", "wds", "-o", str(out),
                    "--shard-size", "20KB", "--shuffle-seed", "3", "--workers", "1"], cwd=ROOT, check=True,
                   capture_output=True)
    assert len(shard_files(out)) > 2
    assert zlib.crc32((out / "all" / "paths.bin").read_bytes()) == zlib.crc32(
        "\0".join(readers.FolderDataset(image_tree).paths).encode())


def as_worker(monkeypatch, worker_id: int, workers: int) -> None:
    info = type("WorkerInfo", (), {"id": worker_id, "num_workers": workers})()
    monkeypatch.setattr("torch.utils.data.get_worker_info", lambda: info)
    monkeypatch.setattr("readers.wds.keep_heap_in_worker", lambda: False)  # no worker: leave this process's malloc


@pytest.mark.parametrize("parsed", [False, True], ids=["by index", "parsed"])
def test_workers_share_a_shard_each_reading_its_own_run(even_tree, tmp_path, monkeypatch, parsed):
    out = pack_wds(even_tree, tmp_path / "one.wds")  # one shard of 24 for five workers
    if parsed:
        (out / "all" / "records.bin").write_bytes(b"damaged")  # the index does not load: shards are parsed
    whole = [digest(data) for data, _ in WDSDataset(out, decode="raw")]
    runs = []
    for worker_id in range(5):
        as_worker(monkeypatch, worker_id, 5)
        runs.append([digest(data) for data, _ in WDSDataset(out, decode="raw")])
    assert [len(run) for run in runs] == [5, 5, 5, 5, 4]
    assert [d for run in runs for d in run] == whole  # each sample once, in the shard's order


def test_a_shard_cut_before_a_workers_run_begins_says_where_it_ended(even_tree, tmp_path, monkeypatch):
    out = pack_wds(even_tree, tmp_path / "one.wds")  # one shard of 24: worker 1 of 2 reads samples 12-23
    shard = shard_files(out)[0]
    with tarfile.open(shard) as whole:
        members = [(m, whole.extractfile(m).read()) for m in whole.getmembers()]
    keys = list(dict.fromkeys(m.name.split(".")[0] for m, _ in members))[:5]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as cut:  # a whole tar of the first 5 samples
        for member, data in members:
            if member.name.split(".")[0] in keys:
                cut.addfile(member, io.BytesIO(data))
    as_worker(monkeypatch, 1, 2)
    with pytest.raises(CorruptDataError, match=r"ended after 5 samples, 24 expected"):
        list(WDSDataset(out, decode="raw"))


def test_a_worker_left_without_a_sample_says_how_to_fix_it(even_tree, tmp_path, monkeypatch):
    out = pack_wds(even_tree, tmp_path / "one.wds")
    as_worker(monkeypatch, 24, 25)
    with pytest.warns(RuntimeWarning, match="worker 24 of 25 on rank 0 has no sample to read .* use fewer workers"):
        assert list(WDSDataset(out, decode="raw")) == []


@pytest.mark.filterwarnings("ignore::readers.LoaderWarning")  # drop_last drops a share of so small a set
@pytest.mark.parametrize("world_size, workers, batch_size, drop_last", [
    (2, 2, 4, False), (4, 3, 4, False), (4, 3, 8, True), (3, 2, 2, True)])
def test_every_rank_makes_the_same_number_of_batches(image_tree, tmp_path, world_size, workers, batch_size,
                                                      drop_last):
    """Each DataLoader worker batches its own stream, ending in its own partial batch: equal
    sample counts per rank are not enough for DDP, the workers' runs must match across ranks.
    Uneven shards (3, 3, 3, 3, 3, 3, 1) dealt whole to workers made 7, 7, 8, 7 batches."""
    out = pack_wds(image_tree, tmp_path / "u.wds", max_count=3)
    everything = {digest(data) for data, _ in WDSDataset(out, decode="raw")}
    batches, seen = [], set()
    for rank in range(world_size):
        ds = WDSDataset(out, decode="raw", shuffle=4, rank=rank, world_size=world_size)
        loader = readers.make_loader(ds, batch_size, workers=workers, drop_last=drop_last, collate_fn=list,
                                     multiprocessing_context="fork")
        got = list(loader)
        batches.append(len(got))
        assert len(loader) == len(got)  # the loader's length is the real step count
        seen.update(digest(data) for batch in got for data, _ in batch)
    assert len(set(batches)) == 1, batches
    if not drop_last:
        assert seen == everything


# --- stored checksums and labels --------------------------------------------------------

def image_extents(out: Path) -> list[tuple[Path, int, int, str]]:
    """(shard, data offset, size, relative path) of every packed image, from the index."""
    reader = wds.Reader(str(out))
    return [(out / reader.shards[r["shard"]], int(r["offset"]), int(r["size"]), reader.paths[i])
            for i, r in enumerate(reader.records)]


def test_stream_reader_checks_the_stored_crc_of_every_image(even_tree, tmp_path):
    out = pack_wds(even_tree, tmp_path / "crc.wds")
    extents = image_extents(out)
    shard = extents[0][0]
    clean = shard.read_bytes()
    rng = __import__("random").Random(7)
    for _ in range(40):  # one flipped byte anywhere in any image: never a silent wrong image
        where, offset, size, relpath = rng.choice(extents)
        at = offset + rng.randrange(size)
        blob = bytearray(clean)
        blob[at] ^= 1 << rng.randrange(8)
        shard.write_bytes(bytes(blob))
        # Read by the index: the sample is named by shard, split and index, and its path.
        by_index = rf"shard-000000\.tar sample all/\d+ \({relpath}\): checksum mismatch"
        with pytest.raises(CorruptDataError, match=by_index):
            list(WDSDataset(out, decode="raw"))
        # Parsed (the shards alone): by shard and key; the .json member holds the checksum.
        key = wds.sample_key(relpath)
        with pytest.raises(CorruptDataError, match=rf"shard-000000\.tar: {key} \({relpath}\): checksum mismatch"):
            list(WDSDataset(str(shard), decode="raw"))
    with pytest.warns(RuntimeWarning, match=rf"\({relpath}\): checksum mismatch.*skipped this sample"):
        assert len(list(WDSDataset(out, decode="raw", on_error="skip"))) == 23
    assert len(list(WDSDataset(out, decode="raw", check_crc=False))) == 24


@pytest.mark.parametrize("shuffle", [0, 5])
def test_a_packer_folder_streams_by_its_index_the_samples_parsing_gives(imagenet_sample, tmp_path, shuffle):
    out = pack_wds(imagenet_sample, tmp_path / "s.wds", max_count=9)
    shards = [str(p) for p in shard_files(out)]
    by_index = WDSDataset(out, decode="raw", shuffle=shuffle, seed=3)
    parsed = WDSDataset(shards, decode="raw", shuffle=shuffle, seed=3)  # no index: every header parsed
    for epoch in (0, 1):
        by_index.set_epoch(epoch)
        parsed.set_epoch(epoch)
        got = list(by_index)
        assert by_index.index_reader() is not None and parsed.index_reader() is None
        assert len(got) == 125 and got == list(parsed)
    assert [label for _, label in got] != sorted(label for _, label in got)  # packed shuffled: a real order


@pytest.mark.parametrize("large", [False, True], ids=["checked as mapped", "checked on a mismatch"])
@pytest.mark.parametrize("table", ["records.bin", "paths.bin"])
def test_a_stream_whose_index_fails_its_check_parses_its_shards(even_tree, tmp_path, monkeypatch, table, large):
    # records.bin is CRC-checked as it is mapped up to CRC_AT_OPEN (a limit of 0 stands in for
    # a larger table); a larger one is checked whole when a sample fails its checksum, which a
    # damaged record's checksum makes it do. A stream does not read paths.bin.
    if large:
        monkeypatch.setattr(_tables, "CRC_AT_OPEN", 0)
    out = pack_wds(even_tree, tmp_path / "i.wds", max_count=3)
    expected = list(WDSDataset(out, decode="raw"))
    damaged = out / "all" / table
    blob = bytearray(damaged.read_bytes())
    blob[5] ^= 0xFF  # the table fails its CRC-32 (records.bin: record 0's checksum); the shards are whole
    damaged.write_bytes(bytes(blob))
    stream = WDSDataset(out, decode="raw")
    assert list(stream) == expected
    assert (stream.index_reader() is None) == (table == "records.bin")


def test_a_folder_of_other_tools_shards_is_read_as_such(even_tree, tmp_path):
    out = pack_wds(even_tree, tmp_path / "i.wds", max_count=3)
    foreign = tmp_path / "shards"
    foreign.mkdir()
    for shard in shard_files(out):
        shutil.copy(shard, foreign / shard.name)  # no index.json: not a packer folder
    assert len(list(WDSDataset(foreign, decode="raw"))) == 24
    with pytest.raises(FormatError, match=r"shards/train: no such folder; .* is a folder of shards, not a packer "
                                          r"dataset, and split='train' names a sub-folder of it"):
        WDSDataset(foreign, split="train")
    # Another tool's index.json beside the shards (wids' shard list) does not make it a packer folder.
    (foreign / "index.json").write_text(json.dumps({"__kind__": "wids-shard-index-v1", "wids_version": 1,
                                                    "shardlist": [{"url": "shard-000000.tar", "nsamples": 3}]}))
    assert len(list(WDSDataset(foreign, decode="raw"))) == 24
    (foreign / "index.json").write_text("{not json")  # damaged: could be packer's, so it is refused
    with pytest.raises(FormatError, match="index.json.* is not valid JSON"):
        WDSDataset(foreign)


def test_pack_warns_of_names_wids_cannot_read(even_tree, image_tree, tmp_path):
    plain = pack(str(even_tree), "wds", str(tmp_path / "plain.wds"), workers=1, progress=False)
    assert not [w for w in plain.warnings if "wids" in w]
    odd = pack(str(image_tree), "wds", str(tmp_path / "odd.wds"), workers=1, progress=False)  # ünïcode/...
    [warning] = [w for w in odd.warnings if "wids" in w]
    assert warning.startswith("split all: 4 sample(s) have names that are not ASCII") and "'ünïcode/" in warning


def test_shards_without_packer_json_are_read_unchecked(tmp_path):
    webdataset = pytest.importorskip("webdataset")
    images = [jpeg_bytes(7000 + i, size=(8, 8)) for i in range(4)]
    with webdataset.TarWriter(str(tmp_path / "other.tar")) as sink:
        for i, data in enumerate(images):
            sink.write({"__key__": f"s{i}", "jpg": data, "cls": i, "json": {"caption": "a cat", "crc": "x"}})
    assert list(WDSDataset(tmp_path / "other.tar", decode="raw")) == [(d, i) for i, d in enumerate(images)]


def hand_made_shard(path: Path, samples: list[tuple[str, bytes, bytes, dict]]) -> Path:
    """A shard written member by member: (key, image, .cls bytes, json fields) per sample."""
    blob = b"".join(_tar.member(f"{key}.jpg", image)[0] + _tar.member(f"{key}.cls", cls)[0]
                    + _tar.member(f"{key}.json", json.dumps(meta, sort_keys=True).encode())[0]
                    for key, image, cls, meta in samples)
    path.write_bytes(blob + _tar.END_OF_ARCHIVE)
    return path


def test_label_in_the_json_must_agree_with_the_cls_member(tmp_path):
    a, b = jpeg_bytes(1, size=(8, 8)), jpeg_bytes(2, size=(8, 8))
    meta = lambda data, **extra: {"crc32": zlib.crc32(data), "path": "c/x.jpg", **extra}  # noqa: E731
    good = hand_made_shard(tmp_path / "good.tar", [("k0", a, b"3", meta(a, label=3)), ("k1", b, b"1", meta(b))])
    assert list(WDSDataset(good, decode="raw")) == [(a, 3), (b, 1)]  # no label in the json: accepted as before
    flipped = hand_made_shard(tmp_path / "flip.tar", [("k0", a, b"7", meta(a, label=3)), ("k1", b, b"1", meta(b))])
    with pytest.raises(CorruptDataError, match=r"flip\.tar: k0 \(c/x\.jpg\): label 7 from the \.cls member, 3 in"):
        list(WDSDataset(flipped, decode="raw"))
    with pytest.warns(RuntimeWarning, match=r"flip\.tar: k0 .* skipped this sample"):
        assert list(WDSDataset(flipped, decode="raw", on_error="skip")) == [(b, 1)]
    lost = hand_made_shard(tmp_path / "lost.tar", [("k0", a, b"x", meta(a, label=3))])
    with pytest.raises(CorruptDataError, match=r"lost\.tar: k0: \.cls member b'x' is not an integer"):
        list(WDSDataset(lost, decode="raw"))


def test_a_damaged_packer_json_is_reported(tmp_path):
    a = jpeg_bytes(1, size=(8, 8))
    shard = hand_made_shard(tmp_path / "j.tar", [("k0", a, b"0", {"crc32": zlib.crc32(a), "path": "x.jpg"})])
    blob = shard.read_bytes()
    shard.write_bytes(blob.replace(b'"crc32": ', b'"crc32":{'))  # same length: the tar stays whole
    with pytest.raises(CorruptDataError, match=r"j\.tar: k0: the \.json member is damaged"):
        list(WDSDataset(shard, decode="raw"))


# --- layout 2: members named by content, auto shard size, wids index, info -------------

def test_members_are_named_by_content_as_webdataset_recipes_expect(tmp_path):
    src = tmp_path / "kinds"
    files = {"c/a.JPEG": jpeg_bytes(1), "c/b.jpeg": jpeg_bytes(2), "c/png_named.JPEG": jpeg_bytes(3, fmt="PNG"),
             "c/d.webp": jpeg_bytes(4, fmt="WEBP"), "c/e.BMP": jpeg_bytes(5, fmt="BMP"),
             "c/f.tif": jpeg_bytes(6, fmt="TIFF"), "c/g.ppm": jpeg_bytes(7, fmt="PPM"),
             "c/h.pgm": jpeg_bytes(8, mode="L", fmt="PPM"), "c/gray_named.ppm": jpeg_bytes(9, mode="L", fmt="PPM")}
    for name, data in files.items():
        write(src / name, data)
    out = pack_wds(src, tmp_path / "k.wds")
    with tarfile.open(shard_files(out)[0]) as tar:
        images = [m.name for m in tar.getmembers() if not m.name.endswith((".cls", ".json"))]
    assert sorted(images) == sorted(["c/a_JPEG.jpg", "c/b_jpeg.jpg", "c/png_named_JPEG.png", "c/d_webp.webp",
                                     "c/e_BMP.bmp", "c/f_tif.tiff", "c/g_ppm.ppm", "c/h_pgm.pgm",
                                     "c/gray_named_ppm.ppm"])
    reader = wds.Reader(str(out))
    assert [reader.read(i)[0] for i in range(len(reader))] == [files[p] for p in reader.paths]


def test_unknown_content_packed_unchecked_keeps_the_lowercased_extension(tmp_path):
    src = tmp_path / "raw"
    write(src / "c" / "x.TIF", b"not an image at all")
    write(src / "c" / "y.JPG", jpeg_bytes(1))
    out = tmp_path / "r.wds"
    pack(str(src), "wds", str(out), workers=1, progress=False, check="none")
    with tarfile.open(shard_files(out)[0]) as tar:
        assert {m.name for m in tar.getmembers()} >= {"c/x_TIF.tif", "c/y_JPG.jpg"}
    assert sorted(label for _, label in WDSDataset(out, decode="raw")) == [0, 0]  # the stream reader finds both


def test_official_webdataset_recipe_and_webloader_read_the_imagenet_sample(imagenet_sample, tmp_path):
    webdataset = pytest.importorskip("webdataset")
    out = pack_wds(imagenet_sample, tmp_path / "i.wds")  # every option at its default
    urls = [str(p) for p in shard_files(out)]
    assert len(urls) >= 2  # the auto shard size gives the 125 images several shards
    reader = wds.Reader(str(out))
    labels = dict(zip(reader.paths, reader.labels.tolist()))
    pairs = list(webdataset.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("jpg", "cls", "json"))
    assert len(pairs) == 125
    assert all(image.size[0] > 0 and label == labels[meta["path"]] for image, label, meta in pairs)
    # timm's default image key picks the jpg member
    assert len(list(webdataset.WebDataset(urls, shardshuffle=False).to_tuple("jpg;png;webp", "cls"))) == 125
    dataset = webdataset.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("jpg", "cls").map_tuple(
        lambda image: image.size, int)
    seen = list(webdataset.WebLoader(dataset, batch_size=None, num_workers=2))
    assert sorted(label for _, label in seen) == sorted(reader.labels.tolist())


def test_timm_default_image_key_finds_every_image(imagenet_sample, tmp_path):
    try:
        from timm.data.readers.reader_wds import ReaderWds
    except ImportError as exc:
        pytest.skip(f"timm (with its WebDataset reader) is not installed ({exc})")
    key = inspect.signature(ReaderWds.__init__).parameters.get("input_key")
    if key is None or not isinstance(key.default, str):
        pytest.skip("this timm's ReaderWds has no default input_key")
    webdataset = pytest.importorskip("webdataset")
    out = pack_wds(imagenet_sample, tmp_path / "t.wds")
    urls = [str(p) for p in shard_files(out)]
    pairs = list(webdataset.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple(key.default, "cls"))
    assert len(pairs) == 125


def old_layout_pack(src: Path, out: Path, monkeypatch, **kwargs) -> Path:
    """A pack as layout 1 wrote it: members keep the lowercased extension, no wids index."""
    with monkeypatch.context() as patch:
        patch.setattr(wds, "member_suffix", lambda data, relpath: wds.source_suffix(relpath))
        patch.setattr(wds, "LAYOUT_VERSION", 1)
        pack_wds(src, out, **kwargs)
    index = json.loads((out / "index.json").read_text())
    for entry in index["wds"]["splits"].values():
        (out / entry.pop("wids_index")).unlink()
    (out / "index.json").write_text(json.dumps(index))
    return out


def test_layout_1_packs_still_read_everywhere(imagenet_sample, tmp_path, monkeypatch):
    out = old_layout_pack(imagenet_sample, tmp_path / "old.wds", monkeypatch, max_count=40)
    with tarfile.open(shard_files(out)[0]) as tar:
        assert tar.getmembers()[0].name.endswith("_JPEG.jpeg")
    new = pack_wds(imagenet_sample, tmp_path / "new.wds", max_count=40)
    assert json.loads((out / "index.json").read_text())["wds"]["layout_version"] == 1
    old_reader, new_reader = wds.Reader(str(out)), wds.Reader(str(new))
    assert [old_reader.read(i) for i in range(125)] == [new_reader.read(i) for i in range(125)]
    assert verify(str(out), workers=1).ok
    stream = sorted((label, image.tobytes()) for image, label in WDSDataset(out, decode="pil"))
    assert stream == sorted((label, image.tobytes()) for image, label in WDSDataset(new, decode="pil"))


def test_layout_2_index_must_name_its_wids_index_inside_the_split(image_tree, tmp_path):
    out = pack_wds(image_tree, tmp_path / "w.wds")
    index = json.loads((out / "index.json").read_text())
    for wrong in (None, "all/records.bin", "../outside.json", "other/wids-index.json"):
        entry = dict(index["wds"]["splits"]["all"])
        if wrong is None:
            del entry["wids_index"]
        else:
            entry["wids_index"] = wrong
        crafted = {**index, "wds": {**index["wds"], "splits": {"all": entry}}}
        (out / "index.json").write_text(json.dumps(crafted))
        with pytest.raises(PackError, match="names its wids index .* not all/wids-index.json"):
            wds.load_index(str(out))


def test_a_wids_index_leading_outside_the_dataset_is_refused(image_tree, tmp_path):
    out = pack_wds(image_tree, tmp_path / "w.wds")
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((out / "all" / "wids-index.json").read_bytes())
    (out / "all" / "wids-index.json").unlink()
    (out / "all" / "wids-index.json").symlink_to(outside)
    with pytest.raises(PackError, match="all/wids-index.json leads outside the dataset folder"):
        wds.load_index(str(out))


@pytest.mark.parametrize("damage", ["count", "url", "classes", "not json", "missing"])
def test_verify_finds_a_wids_index_that_disagrees_with_the_shards(image_tree, tmp_path, damage):
    out = pack_wds(image_tree, tmp_path / "w.wds", max_count=5)
    where = out / "all" / "wids-index.json"
    described = json.loads(where.read_text())
    if damage == "count":
        described["shardlist"][1]["nsamples"] += 1
    elif damage == "url":
        described["shardlist"][0]["url"] = "/etc/passwd"
    elif damage == "classes":
        described["classes"].reverse()
    where.write_text(json.dumps(described))
    if damage == "not json":
        where.write_bytes(where.read_bytes()[:-3])
    if damage == "missing":
        where.unlink()
    problems = "\n".join(verify(str(out), workers=1).problems)
    assert "all/wids-index.json: " in problems and "re-pack the dataset" in problems


def test_auto_shard_size_targets_64_shards_between_4mb_and_1gb():
    assert wds.auto_shard_size(110_000, 125) == wds.MIN_AUTO_SHARD_SIZE
    assert wds.auto_shard_size(110_000, 50_000) == 110_000 * 50_000 // 64
    assert wds.auto_shard_size(110_000, 1_281_167) == wds.MAX_AUTO_SHARD_SIZE


def test_balanced_shard_count_is_the_size_rule_rounded_up_for_common_rank_counts():
    assert wds.balanced_shard_count(110_000, 125) == 12  # the size rule alone: 4 shards of 4 MB
    assert wds.balanced_shard_count(110_000, 50_000) == 72  # 64
    assert wds.balanced_shard_count(110_000, 1_281_167) == 144  # 141 of 1 GB
    assert wds.balanced_shard_count(100_000, 115) == 6  # 12 would make shards under 1 MB
    assert wds.balanced_shard_count(100_000, 30) == 2
    assert wds.balanced_shard_count(5_000, 5) == 1  # shards of 1 MB at least, where rounding up
    assert wds.balanced_shard_count(500_000, 40) == 12
    assert wds.balanced_shard_count(5_000_000, 5) == 5  # never an empty shard


def test_default_split_is_balanced_so_ranks_pad_little(tmp_path, monkeypatch):
    monkeypatch.setattr(_shards, "MIN_BALANCED_SHARD_SIZE", 1)  # a tiny corpus rounded up as a large one is
    tree = tmp_path / "src"
    for i in range(60):  # sizes from one to ~20 pages: the shards must not follow bytes
        write(tree / f"c{i % 3}" / f"{i:02d}.jpg", jpeg_bytes(i, size=(16 + 4 * i, 16 + 4 * i)))
    out = pack_wds(tree, tmp_path / "b.wds")
    counts = [s["count"] for s in json.loads((out / "index.json").read_text())["wds"]["splits"]["all"]["shards"]]
    assert counts == [5] * 12
    for world in (2, 3, 4):
        assert len(WDSDataset(str(out), rank=0, world_size=world)) * world == 60  # no sample repeated
    capped = pack_wds(tree, tmp_path / "u.wds", max_count=7)  # a count set: the user's cut
    counts = [s["count"] for s in json.loads((capped / "index.json").read_text())["wds"]["splits"]["all"]["shards"]]
    assert counts == [7] * 8 + [4]


def test_default_shard_size_gives_several_shards_none_over_the_auto_size(imagenet_sample, tmp_path):
    out = pack_wds(imagenet_sample, tmp_path / "d.wds")
    index = json.loads((out / "index.json").read_text())
    shards = index["wds"]["splits"]["all"]["shards"]
    assert index["wds"]["shard_size"] is None and len(shards) >= 3
    assert all(s["bytes"] <= wds.MIN_AUTO_SHARD_SIZE for s in shards)
    assert sum(s["count"] for s in shards) == 125


def test_too_few_shards_for_the_cores_is_a_warning_saying_how_to_get_more(image_tree, tmp_path, monkeypatch):
    monkeypatch.setattr(_shards, "available_cores", lambda: 8)
    result = pack(str(image_tree), "wds", str(tmp_path / "few.wds"), workers=1, progress=False)
    assert any("split all: 1 shard(s) for 19 samples, fewer than this machine's 8 cores" in w
               and "--max-count 2" in w for w in result.warnings), result.warnings
    result = pack(str(image_tree), "wds", str(tmp_path / "many.wds"), workers=1, progress=False,
                  options={"max_count": 2})
    assert not any("shard(s)" in w for w in result.warnings)
    cli = CliRunner().invoke(main, ["pack", str(image_tree), "--to", "wds", "-o", str(tmp_path / "c.wds"),
                                    "--workers", "1"])
    assert cli.exit_code == 0 and "warning: split all: 1 shard(s)" in cli.stderr


def test_info_shows_shard_count_and_sizes_per_split(image_tree, tmp_path):
    out = pack_wds(image_tree, tmp_path / "n.wds", max_count=5)
    entries = json.loads((out / "index.json").read_text())["wds"]["splits"]["all"]["shards"]
    sizes = [e["bytes"] for e in entries]
    facts = json.loads(CliRunner().invoke(main, ["info", str(out), "--json"]).stdout)
    assert facts["splits"]["all"]["shards"] == {"shards": 4, "bytes": sum(sizes), "min_bytes": min(sizes),
                                                "max_bytes": max(sizes)}
    text = CliRunner().invoke(main, ["info", str(out)]).stdout
    mb = [f"{size / 1e6:.1f}" for size in (sum(sizes), min(sizes), max(sizes))]
    assert f"    4 shard(s), {mb[0]} MB, {mb[1]} to {mb[2]} MB each" in text


def test_on_error_speaks_the_cli_vocabulary(image_tree, tmp_path):
    out = tmp_path / "v.wds"
    pack(str(image_tree), "wds", str(out), progress=False, workers=1)
    assert WDSDataset(out, decode="raw").on_error == "fail"
    assert WDSDataset(out, decode="raw", on_error="raise").on_error == "fail"  # the older spelling
    assert WDSDataset(out, decode="raw", on_error="skip").on_error == "skip"
    with pytest.raises(ValueError, match="on_error must be one of fail, skip"):
        WDSDataset(out, decode="raw", on_error="ignore")


# --- a stream across a replacement (pack --force) ----------------------------------------

def cats_and_dogs(root: Path, classes: tuple[str, str], seed: int) -> Path:
    """8 JPEGs, the same file names under either class list, other images for each seed."""
    for i in range(8):
        write(root / classes[i // 4] / f"img_{i}.jpg", jpeg_bytes(seed + i, size=(16, 16)))
    return root


def stream_labels(loader) -> list[tuple[str, int]]:
    return sorted((digest(data), int(label)) for data, label in loader)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_stream_over_a_replaced_dataset_refuses_to_read_it(tmp_path, context):
    """The second epoch after pack --force replaced the folder (same shard names and counts,
    other classes) raises, in every worker (two forked ones), and in one started afresh
    (spawn; forkserver, too, unpickles the Dataset in a process that shares nothing with this
    one); it never labels the new images with the old class list."""
    old = cats_and_dogs(tmp_path / "old", ("cat", "dog"), 100)
    new = cats_and_dogs(tmp_path / "new", ("ant", "cat"), 200)
    out = pack_wds(old, tmp_path / "d.wds", max_count=2)
    ds = WDSDataset(out, decode="raw")
    assert ds.classes == ["cat", "dog"]
    loader = DataLoader(ds, batch_size=None, num_workers=2 if context == "fork" else 1,
                        multiprocessing_context=context)
    expected = sorted((digest(p.read_bytes()), ds.classes.index(p.parent.name)) for p in old.rglob("*.jpg"))
    assert stream_labels(loader) == expected
    shards = [p.name for p in shard_files(out)]
    pack_wds(new, out, max_count=2, force=True)
    assert [p.name for p in shard_files(out)] == shards and len(WDSDataset(out)) == len(ds)
    with pytest.raises(ReplacedError, match=r"index\.json was replaced since this Dataset was created"):
        stream_labels(loader)
    with pytest.raises(ReplacedError):  # in this process too (no workers)
        list(ds)
    assert WDSDataset(out).classes == ["ant", "cat"]  # a Dataset made after reads the new one


def test_a_stream_skipping_damage_still_refuses_a_replaced_dataset(tmp_path):
    """on_error='skip' skips damage, not a replacement: no epoch of warnings and no samples."""
    out = pack_wds(cats_and_dogs(tmp_path / "old", ("cat", "dog"), 100), tmp_path / "d.wds", max_count=2)
    ds = WDSDataset(out, decode="raw", on_error="skip")
    pack_wds(cats_and_dogs(tmp_path / "new", ("ant", "cat"), 200), out, max_count=2, force=True)
    with pytest.raises(ReplacedError, match="was replaced"):
        list(ds)


def test_a_parsed_packer_shard_with_a_label_outside_the_classes_names_the_shard(tmp_path):
    """A shard the index does not describe is parsed, and its .cls labels are checked
    against the class list (here 2 classes, a label 7)."""
    out = pack_wds(cats_and_dogs(tmp_path / "src", ("cat", "dog"), 100), tmp_path / "d.wds", max_count=2)
    shard = shard_files(out)[0]
    members = []
    with tarfile.open(shard) as tar:
        for info in tar.getmembers():
            data = tar.extractfile(info).read()
            if info.name.endswith(".cls"):
                data = b"7"
            elif info.name.endswith(".json"):
                meta = json.loads(data)
                data = json.dumps({**meta, "label": 7}).encode()
            members.append((info.name, data))
    members.append(("__pad__.txt", b"a member that makes the shard another size than the index says"))
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(CorruptDataError, match=rf"{shard.name}: .*label 7 is outside the 2 classes"):
        list(WDSDataset(out, decode="raw"))
