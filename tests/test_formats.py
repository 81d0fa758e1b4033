"""One suite for every packed format: round trips, ImageFolder equivalence, workers, pickling."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import readers
from packer import FORMATS, open_reader, pack
from packer.formats import detect_format

DATASETS = {"lmdb": "LMDBDataset", "hdf5": "HDF5Dataset", "wds": "WDSMapDataset"}  # map-style readers by format


def dataset_class(fmt):
    name = DATASETS.get(fmt)
    if name is None or not hasattr(readers, name):
        pytest.skip(f"{fmt} has no map-style Dataset")
    return getattr(readers, name)


@pytest.fixture(params=list(FORMATS))
def fmt(request):
    return request.param


def as_list(batch):
    return batch


def packed(src: Path, fmt: str, tmp_path: Path, **kwargs) -> Path:
    out = tmp_path / f"packed{FORMATS[fmt].extension}"
    pack(str(src), fmt, str(out), workers=2, progress=False, **kwargs)
    return out


def test_round_trip_is_byte_exact_with_labels_and_paths(image_tree, tmp_path, fmt):
    out = packed(image_tree, fmt, tmp_path)
    assert detect_format(out) == fmt
    folder = readers.FolderDataset(image_tree, decode="raw")
    reader = open_reader(out)
    assert len(reader) == len(folder) == 19
    for i in range(len(folder)):
        data, label, relpath = reader.read(i)
        assert relpath == folder.paths[i]
        assert data == (image_tree / relpath).read_bytes()
        assert label == folder.targets[i]
        assert reader.read_image(i) == (data, label) == folder.reader.read_image(i)
    assert reader.labels.tolist() == folder.targets.tolist()
    assert list(reader.paths) == list(folder.paths)
    assert reader.classes == folder.classes


def test_splits_are_opened_by_name(split_tree, tmp_path, fmt):
    out = packed(split_tree, fmt, tmp_path)
    with pytest.raises(Exception, match="pass split="):
        open_reader(out)
    with pytest.raises(Exception, match="no split 'test'"):
        open_reader(out, "test")
    for split in ("train", "val"):
        reader = open_reader(out, split)
        folder = readers.FolderDataset(split_tree, split=split, decode="raw")
        assert [reader.read(i)[2] for i in range(len(reader))] == list(folder.paths)
        assert reader.labels.tolist() == folder.targets.tolist()
        assert reader.classes == ["a", "b", "c"]


def test_unlabeled_folder_round_trips_with_label_minus_one(flat_tree, tmp_path, fmt):
    reader = open_reader(packed(flat_tree, fmt, tmp_path))
    assert [reader.read(i)[1] for i in range(len(reader))] == [-1] * 5


def test_real_imagenet_images_round_trip(imagenet_sample, tmp_path, fmt):
    out = packed(imagenet_sample, fmt, tmp_path)
    reader = open_reader(out)
    assert len(reader) == 125
    for i in range(len(reader)):
        data, label, relpath = reader.read(i)
        assert data == (imagenet_sample / relpath).read_bytes()
        assert reader.classes[label] == relpath.split("/")[0]


def test_dataset_is_a_drop_in_for_the_folder(image_tree, tmp_path, fmt):
    cls = dataset_class(fmt)
    out = packed(image_tree, fmt, tmp_path)
    folder, ds = readers.FolderDataset(image_tree), cls(out)
    assert ds.classes == folder.classes and ds.class_to_idx == folder.class_to_idx
    assert len(ds) == len(folder)
    for i in range(len(ds)):
        (a, la), (b, lb) = ds[i], folder[i]
        assert la == lb and a.mode == b.mode == "RGB" and a.tobytes() == b.tobytes()
    tensor = cls(out, decode="tensor")[0][0]
    assert tensor.dtype == torch.uint8 and tensor.shape[0] == 3
    assert cls(out, decode="raw")[0][0] == (image_tree / folder.paths[0]).read_bytes()
    assert cls(out, transform=lambda im: im.size)[0][0] == folder[0][0].size


def test_dataset_opens_nothing_until_first_access_and_pickles_either_way(image_tree, tmp_path, fmt):
    cls = dataset_class(fmt)
    ds = cls(packed(image_tree, fmt, tmp_path), decode="raw")
    assert not ds.reader.is_open
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[3] == ds[3]
    assert ds.reader.is_open
    clone = pickle.loads(pickle.dumps(ds))
    assert not clone.reader.is_open
    assert clone[5] == ds[5]


def test_open_prepares_reads_ahead_of_the_first_and_is_dropped_by_pickling(image_tree, tmp_path, fmt, monkeypatch):
    cls = dataset_class(fmt)
    ds = cls(packed(image_tree, fmt, tmp_path), decode="raw")
    assert ds.open() is ds and ds.reader.is_open
    expected = [(image_tree / p).read_bytes() for p in ds.paths]  # the path table: loaded on first use
    loaded = vars(ds.reader).copy()
    # Nothing left to open or load: the reads that follow find everything in place.
    monkeypatch.setattr(type(ds.reader), "_open", lambda self: pytest.fail("opened again after open()"))
    assert [ds[i][0] for i in range(len(ds))] == expected
    assert {k: v is None for k, v in vars(ds.reader).items()} == {k: v is None for k, v in loaded.items()}
    monkeypatch.undo()
    clone = pickle.loads(pickle.dumps(ds))
    assert not clone.reader.is_open and clone[2] == ds[2]


# Spawned workers with persistent=True read a first epoch as new ones do, then a second:
# spawn with persistent=False would only repeat that first epoch, at a torch import a worker.
@pytest.mark.parametrize("context, persistent", [("fork", False), ("fork", True), ("spawn", True)])
def test_dataloader_workers_read_everything_under_fork_and_spawn(image_tree, tmp_path, fmt, context, persistent):
    cls = dataset_class(fmt)
    ds = cls(packed(image_tree, fmt, tmp_path), decode="raw")
    assert len(ds) == 19
    ds[0]  # the parent holds an open handle when the workers fork
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context,
                        persistent_workers=persistent, collate_fn=as_list)
    for _ in range(2 if persistent else 1):  # a second epoch reuses persistent workers
        seen = [item for batch in loader for item in batch]
        assert [data for data, _ in seen] == [ds[i][0] for i in range(len(ds))]
        assert [label for _, label in seen] == ds.targets.tolist()


def test_corrupt_record_raises_naming_it(image_tree, tmp_path, fmt):
    out = packed(image_tree, fmt, tmp_path)
    reader = open_reader(out)
    data, _, relpath = reader.read(4)
    reader.close()
    files = [out] if out.is_file() else [p for p in out.rglob("*") if p.is_file()]
    hits = [(f, f.read_bytes().find(data)) for f in files if f.read_bytes().find(data) >= 0]
    assert hits, "the stored image bytes are expected verbatim in the file"
    path, offset = hits[0]
    blob = bytearray(path.read_bytes())
    blob[offset + len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(Exception, match=rf"{relpath}.*checksum mismatch"):
        open_reader(out).read(4)
    assert open_reader(out, check_crc=False).read(4)[0] != data


def test_memory_per_sample_index_is_numpy(image_tree, tmp_path, fmt):
    reader = open_reader(packed(image_tree, fmt, tmp_path))
    assert isinstance(reader.labels, np.ndarray) and reader.labels.dtype == np.int32
    assert isinstance(reader.paths.offsets, np.ndarray)


def test_open_dataset_picks_the_format_s_map_style_dataset(split_tree, tmp_path, fmt):
    out = packed(split_tree, fmt, tmp_path)
    ds = readers.open_dataset(out, "val", decode="raw")
    assert type(ds) is dataset_class(fmt)
    assert [ds[i][0] for i in range(len(ds))] == [(split_tree / p).read_bytes() for p in ds.paths]


def test_every_format_fills_the_contract():
    from packer.formats import FORMATS, Format

    for name, fmt in FORMATS.items():
        assert isinstance(fmt, Format) and fmt.name == name
        assert fmt.extension.startswith(".") and callable(fmt.detect) and callable(fmt.read_metadata)
        for method in ("begin_split", "add", "end_split", "finish", "abort"):
            assert callable(getattr(fmt.Writer, method)), (name, method)
        assert callable(fmt.check_files) and isinstance(fmt.options, tuple)


def test_writer_options_are_checked_against_the_format(tmp_path):
    from packer.errors import PackError
    from packer.formats import FORMATS
    from packer.pack import pack

    assert FORMATS["wds"].writer_options({"shard_size": "1MB"}) == {"shard_size": 10**6, "max_count": None}
    with pytest.raises(PackError, match=r"shardsize: not an option of the wds writer \(it takes: shard_size, "
                                        r"max_count\)"):
        FORMATS["wds"].writer_options({"shardsize": "1MB"})
    with pytest.raises(PackError, match=r"shard_size: not an option of the lmdb writer \(it takes: none\)"):
        pack(str(tmp_path), "lmdb", str(tmp_path / "x.lmdb"), options={"shard_size": 10})
    with pytest.raises(PackError, match="wds writer option max_count: 0 is not a positive integer"):
        FORMATS["wds"].writer_options({"max_count": 0})
    assert not (tmp_path / "x.lmdb").exists()
