"""The HDF5 layout as documented in the README, read with h5py alone; HDF5-specific failure modes.

Round trips, FolderDataset equivalence, fork/spawn DataLoaders, pickling and checksum
damage are covered for every format (hdf5 included) by test_formats.py.
"""
from __future__ import annotations

import json
import os
import zlib

import h5py
import numpy as np
import pytest
import xxhash
from click.testing import CliRunner

import readers
from packer.formats import _tables
from packer import CorruptDataError, FormatError, open_reader, pack
from packer.cli import main
from packer.formats import _hdf5_file, hdf5 as hdf5_format

from conftest import jpeg_bytes



def packed(src, tmp_path, name="d.h5", workers=1, **kwargs):
    out = tmp_path / name
    pack(str(src), "hdf5", str(out), progress=False, workers=workers, **kwargs)
    return out


# Each record checksum kind as another tool computes it, and the format version it is written with.
KINDS = {"crc32": (zlib.crc32, 1), "xxh3": (lambda b: xxhash.xxh3_64_intdigest(b) & 0xFFFFFFFF, 2)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_layout_is_readable_with_h5py_and_json_alone(split_tree, tmp_path, kind):
    out = packed(split_tree, tmp_path, checksum=kind)
    record_sum, version = KINDS[kind]
    with h5py.File(out, "r", locking=False, rdcc_nbytes=0) as f:
        meta = json.loads(f.attrs["packer_metadata"])
        assert meta["format"] == "hdf5" and meta["format_version"] == version
        assert meta.get("checksum", "crc32") == kind
        assert list(f.attrs["classes"]) == meta["classes"] == ["a", "b", "c"]
        assert sorted(f) == sorted(meta["splits"]) == ["train", "val"]
        for split, info in meta["splits"].items():
            g = f[split]
            assert sorted(g) == ["crc32", "images", "labels", "offsets", "path_offsets", "paths"]
            images, offsets, labels, crcs = g["images"], g["offsets"][:], g["labels"][:], g["crc32"][:]
            assert images.dtype == np.uint8 and images.chunks == (256 << 10,) and images.compression is None
            assert (offsets.dtype, labels.dtype, crcs.dtype) == (np.int64, np.int32, np.uint32)
            paths = g["paths"][:].tobytes().decode("utf-8").split("\0")
            assert len(offsets) == info["count"] + 1 and offsets[-1] == images.shape[0]
            assert len(labels) == len(crcs) == len(paths) == info["count"]
            path_offsets = g["path_offsets"][:]
            assert path_offsets.dtype == np.uint64 and len(path_offsets) == info["count"] + 1
            assert [len(p.encode()) for p in paths] == (np.diff(path_offsets.astype(np.int64)) - 1).tolist()
            for i, relpath in enumerate(paths):
                image = images[offsets[i]:offsets[i + 1]].tobytes()
                assert image == (split_tree / relpath).read_bytes()
                assert record_sum(image) == crcs[i]
                assert meta["classes"][labels[i]] == relpath.split("/")[1]


def test_nothing_in_the_file_needs_pickle(image_tree, tmp_path):
    out = packed(image_tree, tmp_path)
    kinds = []
    with h5py.File(out, "r", locking=False) as f:
        f.visititems(lambda name, obj: kinds.append(obj.dtype.kind) if isinstance(obj, h5py.Dataset) else None)
        assert set(f.attrs) == {"packer_metadata", "classes"}
    assert set(kinds) <= {"u", "i"}  # numbers only: no opaque, object or vlen data


def test_records_spanning_chunks_and_flushes_read_back_exactly(image_tree, tmp_path, monkeypatch):
    # Tiny chunks and flushes: every image crosses chunk boundaries and several flushes.
    monkeypatch.setattr(hdf5_format, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(hdf5_format, "FLUSH_BYTES", 3000)
    out = packed(image_tree, tmp_path)
    reader = open_reader(out)
    with h5py.File(out, "r", locking=False) as f:
        assert f["all/images"].chunks == (1000,)
    folder = readers.FolderDataset(image_tree, decode="raw")
    assert [reader.read(i) for i in range(len(reader))] == [folder.reader.read(i) for i in range(len(folder))]


def test_real_images_decode_like_the_folder(imagenet_sample, tmp_path):
    out = packed(imagenet_sample, tmp_path, workers=2)
    ds, folder = readers.HDF5Dataset(out, decode="numpy"), readers.FolderDataset(imagenet_sample, decode="numpy")
    assert ds.targets.tolist() == folder.targets.tolist() and list(ds.paths) == list(folder.paths)
    for i in range(0, len(ds), 7):  # grayscale ones included: the sample holds 23
        (a, la), (b, lb) = ds[i], folder[i]
        assert la == lb and a.shape == b.shape and np.array_equal(a, b)


def test_forked_child_opens_its_own_file_and_parent_keeps_reading(image_tree, tmp_path):
    reader = open_reader(packed(image_tree, tmp_path))
    expected = reader.read(3)
    parent_file = reader.handle()[0]
    pid = os.fork()
    if pid == 0:  # the child: must not touch the parent's h5py objects
        try:
            ok = reader.read(3) == expected and reader.handle()[0] is not parent_file
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert reader.read(3) == expected and reader.handle()[0] is parent_file


@pytest.mark.parametrize("checksums", [True, False])
@pytest.mark.parametrize("large", [False, True])
def test_damaged_offsets_are_reported_not_misread(image_tree, tmp_path, checksums, large, monkeypatch):
    # A table up to CRC_AT_OPEN is CRC-checked whole when a reader opens it; a larger one (large:
    # a limit of 0 stands in for it) is range-checked a block at a time as reads use it, and
    # CRC-checked whole by check_tables (packer verify). An older pack has no CRC: the range check.
    if large:
        monkeypatch.setattr(_tables, "CRC_AT_OPEN", 0)
    out = packed(image_tree, tmp_path)
    with h5py.File(out, "r+", locking=False) as f:
        f["all/offsets"][5] = 10 ** 9
        if not checksums:
            del f["all"].attrs["checksums"]
    if checksums and not large:
        with pytest.raises(CorruptDataError, match="all/offsets: checksum mismatch"):
            open_reader(out).read(0)
    else:
        reader = open_reader(out).open()  # nothing is read whole at open: no error yet
        with pytest.raises(CorruptDataError, match=r"all/offsets: entries 0\.\.\d+ do not describe"):
            reader.read(0)
    message = "all/offsets: checksum mismatch" if checksums else r"all/offsets: entries 0\.\.\d+ do not describe"
    with pytest.raises(CorruptDataError, match=message):
        open_reader(out).check_tables()


def test_truncated_file_is_reported_with_its_path(image_tree, tmp_path):
    out = packed(image_tree, tmp_path)
    data = out.read_bytes()
    out.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptDataError, match=rf"{out}: cannot open the HDF5 file.*re-pack"):
        open_reader(out)


def test_foreign_hdf5_file_is_not_mistaken_for_a_packed_one(tmp_path):
    out = tmp_path / "other.h5"
    with h5py.File(out, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(FormatError, match="without packer metadata"):
        open_reader(out)


def test_verify_names_a_damaged_hdf5_record(image_tree, tmp_path):
    out = packed(image_tree, tmp_path)
    target = (image_tree / "cat" / "gray.jpeg").read_bytes()
    blob = bytearray(out.read_bytes())
    offset = blob.find(target)
    blob[offset + len(target) // 2] ^= 0xFF
    out.write_bytes(bytes(blob))
    result = CliRunner().invoke(main, ["verify", str(out), "--workers", "1"])
    assert result.exit_code == 1
    assert "cat/gray.jpeg): checksum mismatch" in result.stderr and "1 problem(s)" in result.stderr


def test_class_names_that_are_not_utf8_survive(tmp_path):
    src = tmp_path / "src"
    folder = os.path.join(os.fsencode(src), b"caf\xe9-latin1")
    os.makedirs(folder)
    with open(os.path.join(folder, b"x.jpg"), "wb") as f:
        f.write(jpeg_bytes(1))
    reader = open_reader(packed(src, tmp_path))
    name = os.fsdecode(b"caf\xe9-latin1")
    assert reader.classes == [name] and reader.read(0)[2] == name + "/x.jpg"
    with h5py.File(reader.path, "r", locking=False) as f:
        assert list(f.attrs["classes"]) == [name]


def test_records_are_read_by_pread_through_the_chunk_map(image_tree, tmp_path):
    out = packed(image_tree, tmp_path)
    reader = open_reader(out)
    chunks = reader.chunks()
    with h5py.File(out, "r", locking=False) as f:
        images = f["all/images"]
        assert chunks is not None and len(chunks) == -(-images.shape[0] // images.chunks[0])
        assert [images.id.get_chunk_info(k).byte_offset for k in range(len(chunks))] == chunks.tolist()
    for i in range(len(reader)):
        data, _, relpath = reader.read(i)
        assert data == (image_tree / relpath).read_bytes()
    reader.close()


def rewrite_chunks(out, rewritten, chunk: int, order) -> None:
    """Copy a pack with its images in chunks of `chunk` bytes, written (so stored) in `order`."""
    with h5py.File(out, "r") as src, h5py.File(rewritten, "w", libver=hdf5_format.LIBVER) as dst:
        for name, value in src.attrs.items():
            dst.attrs[name] = value
        images = src["all/images"][()]
        for name, obj in src["all"].items():
            if name != "images":
                dst.create_dataset(f"all/{name}", data=obj[()])
        target = dst.create_dataset("all/images", shape=images.shape, dtype=np.uint8, chunks=(chunk,),
                                    maxshape=(None,))
        for k in order(-(-len(images) // chunk)):
            piece = images[k * chunk:(k + 1) * chunk]
            target.id.write_direct_chunk((k * chunk,), np.pad(piece, (0, chunk - len(piece))).tobytes())


def test_records_across_chunks_stored_apart_are_read_in_runs(image_tree, tmp_path, monkeypatch):
    # Chunks stored in reverse order (as another tool may write them): a record crossing
    # into the next chunk is then two runs apart in the file.
    out = packed(image_tree, tmp_path)
    monkeypatch.setattr(hdf5_format, "CHUNK_BYTES", 4096)  # records of a few KB span one or two
    rewritten = tmp_path / "reversed.h5"
    rewrite_chunks(out, rewritten, hdf5_format.CHUNK_BYTES, lambda n: reversed(range(n)))
    reader = hdf5_format.Reader(str(rewritten))
    file_offsets = reader.file_offsets()
    assert file_offsets is not None and (file_offsets < 0).any() and (file_offsets >= 0).any()
    for i in range(len(reader)):
        data, _, relpath = reader.read(i)
        assert data == (image_tree / relpath).read_bytes()
    reader.close()


def test_a_record_over_several_adjacent_chunks_is_one_pread(image_tree, tmp_path, monkeypatch):
    # Chunks of 1 KiB stored in order, except one moved to the end of the file: records
    # span several chunks, one run in the file unless they touch the moved chunk.
    out = packed(image_tree, tmp_path)
    chunk = 1024
    monkeypatch.setattr(hdf5_format, "CHUNK_BYTES", chunk)
    rewritten = tmp_path / "small-chunks.h5"
    moved = 20
    rewrite_chunks(out, rewritten, chunk, lambda n: [k for k in range(n) if k != moved] + [moved])
    reader = hdf5_format.Reader(str(rewritten))
    offsets, _ = reader.index()
    chunks, file_offsets, fd = reader.chunks().tolist(), reader.file_offsets(), reader.handle()[2]
    spans = [range(int(a) // chunk, (int(b) - 1) // chunk + 1) for a, b in zip(offsets[:-1], offsets[1:])]
    one_run = [all(chunks[k + 1] == chunks[k] + chunk for k in span[:-1]) for span in spans]
    assert ((file_offsets >= 0) == np.array(one_run)).all()
    assert not all(one_run) and any(moved in span and len(span) > 1 for span in spans)
    assert sum(len(span) >= 3 and run for span, run in zip(spans, one_run)) > 3
    for i in range(len(reader)):
        data, _, relpath = reader.read(i)
        expected = (image_tree / relpath).read_bytes()
        assert data == expected
        if file_offsets[i] >= 0:
            assert os.pread(fd, len(expected), int(file_offsets[i])) == expected
    reader.close()


def test_a_file_cut_short_is_reported_not_read(image_tree, tmp_path):
    # The tables are mapped from the file (as LMDB's data.mdb is): a reader that has them
    # must not touch them once the file is cut short in place (SIGBUS, docs/safety.md), but
    # every reader that opens the file after, in any process, reports it.
    out = packed(image_tree, tmp_path)
    reader = open_reader(out)
    reader.read(0)  # tables and chunk map loaded
    last = len(reader) - 1
    offsets, _ = reader.index()
    cut = int(reader.chunks()[int(offsets[last]) // hdf5_format.CHUNK_BYTES]) + 10
    reader.close()
    os.truncate(out, cut)
    with pytest.raises(CorruptDataError, match="damaged or was not fully copied|truncated"):
        open_reader(out).read(last)


def test_a_file_rewritten_with_compressed_chunks_is_read_through_h5py(image_tree, tmp_path):
    out = packed(image_tree, tmp_path)
    rewritten = tmp_path / "gz.h5"
    with h5py.File(out, "r") as src, h5py.File(rewritten, "w") as dst:
        for name, value in src.attrs.items():
            dst.attrs[name] = value
        for name, obj in src["all"].items():
            kwargs = {"compression": "gzip", "chunks": (hdf5_format.CHUNK_BYTES,), "maxshape": (None,)} \
                if name == "images" else {}
            dst.create_dataset(f"all/{name}", data=obj[()], **kwargs)
    reader = open_reader(rewritten)
    assert reader.chunks() is None
    for i in range(len(reader)):
        data, _, relpath = reader.read(i)
        assert data == (image_tree / relpath).read_bytes()
    reader.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd (Linux)")
def test_a_reader_finalized_off_the_main_thread_leaves_its_close_to_the_next_open(split_tree, tmp_path):
    """A finalizer runs in whatever thread the collector runs in, fsspec's IO thread
    included; closing an h5py file there deadlocks when the main thread holds h5py's lock
    while it waits for that thread (seen in CI: a local reader collected during a remote
    read). So a reader finalized off the main thread only hands its close over; the next
    open, in its own thread, runs it."""
    import gc
    import threading

    path = packed(split_tree, tmp_path)

    def open_fds():  # descriptors on this pack's files: other tests' threads open and close their own
        def target(fd):
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed since the listing
                return ""
        return sum(target(fd).startswith(os.path.realpath(path)) for fd in os.listdir("/proc/self/fd"))

    gc.collect()  # earlier tests' garbage, some holding descriptors, goes now, not mid-count
    _hdf5_file.close_orphans()
    before = open_fds()
    reader = open_reader(path, "train")
    reader.read_image(0)
    fd = reader.handle()[2]
    assert open_fds() > before  # the count sees the reader's own descriptors
    holder = [reader]
    del reader
    finalizer = threading.Thread(target=lambda: (holder.clear(), gc.collect()))
    finalizer.start()
    finalizer.join()
    assert len(_hdf5_file._orphans) == 1
    os.fstat(fd)  # still open: nothing was closed in that thread
    again = open_reader(path, "train")
    again.read_image(0)  # the open runs the orphaned close
    assert _hdf5_file._orphans == []
    again.close()
    del again  # its mapped tables go with it
    gc.collect()
    assert open_fds() == before # the orphan's descriptor and h5py file were closed too
