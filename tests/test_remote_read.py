"""Reading packed datasets by URL: moto's S3 server and nginx on loopback (tests/servers.py),
compared byte for byte with the same packs read locally."""
from __future__ import annotations

import collections
import hashlib
import itertools
import multiprocessing
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch.utils.data

from conftest import jpeg_bytes, write
from packer import pack
from packer.errors import CorruptDataError, FormatError
from packer.formats import hdf5, open_reader, read_metadata
from packer.remote import source as remote_source
from packer.remote.cache import BlockCache, parse_bytes
from readers import BlockShuffleSampler, HDF5Dataset, LMDBDataset, WDSDataset, WDSMapDataset, make_loader
from servers import NginxServer, new_bucket, nginx_binary, require_moto

FORMATS = {"lmdb": ".lmdb", "hdf5": ".h5", "wds": ".wds"}
BLOCK = "32KiB"
# One try per request inside s3fs/botocore, so a dead server is reported in seconds.
FAST_FAIL = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5}}


def tree(root: Path) -> Path:
    """train/val splits, 3 classes, images of 10-60 KB: tens of 32 KiB blocks per dataset."""
    seed = iter(range(5000, 6000))
    for split, per_class in (("train", 20), ("val", 3)):
        for c in ("ant", "bee", "cat"):
            for i in range(per_class):
                size = (96 + 40 * (i % 5), 80 + 40 * (i % 3))
                write(root / split / c / f"{c}{i}.jpg", jpeg_bytes(next(seed), size=size, quality=95))
    return root


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("remote-packs")
    src = tree(base / "src")
    out = {}
    for fmt, ext in FORMATS.items():
        out[fmt] = base / f"data{ext}"
        options = {"max_count": 10} if fmt == "wds" else None
        pack(str(src), fmt, str(out[fmt]), progress=False, options=options, shuffle=fmt != "hdf5", shuffle_seed=1)
    return out


def upload(fs, local: Path, url: str) -> None:
    fs.put(str(local), url, recursive=local.is_dir())


@pytest.fixture(scope="module")
def s3(packs, s3_endpoint):
    """(bucket URL, storage_options) holding every pack, uploaded with s3fs's put."""
    require_moto()
    import s3fs

    bucket = new_bucket(s3_endpoint)
    options = {**bucket.storage_options, **FAST_FAIL}
    fs = s3fs.S3FileSystem(**options)
    for fmt, local in packs.items():
        upload(fs, local, f"{bucket.name}/{local.name}")
    return bucket.url, options


@pytest.fixture(scope="module")
def http(packs):
    """Base URL of an nginx serving the packs' folder."""
    if nginx_binary() is None:
        pytest.skip("nginx is not installed (apt-get install nginx-light)")
    server = NginxServer(next(iter(packs.values())).parent).start()
    yield server.base_url
    server.close()


def same_as_local(remote, local) -> None:
    """Every record, label, path and class of a remote Reader equal the local one's."""
    assert (remote.count, remote.split, remote.classes) == (local.count, local.split, local.classes)
    assert np.array_equal(remote.labels, local.labels)
    assert list(remote.paths) == list(local.paths)
    for i in range(local.count):
        assert remote.read(i) == local.read(i), i


def splits_of(local_path: Path) -> list[str]:
    return sorted(read_metadata(str(local_path)).splits)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_byte_exact_from_s3(packs, s3, fmt, tmp_path):
    bucket, options = s3
    url = f"{bucket}/{packs[fmt].name}"
    for split in splits_of(packs[fmt]):
        remote = open_reader(url, split, storage_options=options, cache_dir=tmp_path / "cache", block_size=BLOCK)
        assert remote.path == url
        same_as_local(remote, open_reader(str(packs[fmt]), split))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_byte_exact_over_http(packs, http, fmt):
    url = f"{http}/{packs[fmt].name}"
    for split in splits_of(packs[fmt]):
        same_as_local(open_reader(url, split, block_size=BLOCK), open_reader(str(packs[fmt]), split))


@pytest.mark.parametrize("Dataset, fmt", [(LMDBDataset, "lmdb"), (HDF5Dataset, "hdf5"), (WDSMapDataset, "wds")])
def test_datasets_take_urls_and_storage_options(packs, s3, Dataset, fmt):
    bucket, options = s3
    remote = Dataset(f"{bucket}/{packs[fmt].name}", "val", decode="raw", storage_options=options, block_size=BLOCK)
    local = Dataset(str(packs[fmt]), "val", decode="raw")
    assert remote.classes == local.classes and np.array_equal(remote.targets, local.targets)
    for i in range(len(local)):
        assert remote[i][0] == local[i][0] and remote[i][1] == local[i][1]


def dataset_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cached", [False, True], ids=["exact-reads", "block-cache"])
def test_opening_reads_the_tables_not_the_whole_dataset(packs, http, fmt, cached, tmp_path):
    """Opening (metadata, tables, chunk map) fetches a small part of the dataset; reading
    every record then fetches the rest, counted by the sources themselves."""
    before = remote_source.fetched()[0]
    cache = {"cache_dir": tmp_path / "cache"} if cached else {}
    reader = open_reader(f"{http}/{packs[fmt].name}", "train", block_size=BLOCK, **cache).open()
    opened = remote_source.fetched()[0] - before
    total = dataset_bytes(packs[fmt])
    assert 0 < opened < total / 4, (opened, total)
    for i in range(reader.count):
        reader.read_image(i)
    assert remote_source.fetched()[0] - before > total / 2  # the records did come over the wire


def cache_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and f.name != ".lock")


def test_cache_limit_holds_and_a_second_epoch_reads_the_cache(packs, s3, tmp_path):
    bucket, options = s3
    url = f"{bucket}/{packs['hdf5'].name}"
    limit = 5 * parse_bytes(BLOCK, "block")
    small = open_reader(url, "train", storage_options=options, cache_dir=tmp_path / "small", cache_limit=limit,
                        block_size=BLOCK)
    local = open_reader(str(packs["hdf5"]), "train")
    for i in range(small.count):
        assert small.read_image(i) == local.read_image(i)
        assert cache_bytes(tmp_path / "small") <= limit
    assert cache_bytes(tmp_path / "small") > limit // 2  # it was used, up to its limit

    big = open_reader(url, "train", storage_options=options, cache_dir=tmp_path / "big", cache_limit="1GB",
                      block_size=BLOCK)
    for i in range(big.count):
        big.read_image(i)
    before = remote_source.fetched()
    again = open_reader(url, "train", storage_options=options, cache_dir=tmp_path / "big", cache_limit="1GB",
                        block_size=BLOCK)
    for i in range(again.count):
        assert again.read_image(i) == local.read_image(i)
    assert remote_source.fetched()[0] == before[0]  # every byte from the cache (only HEADs went out)


def test_a_replaced_object_never_reads_old_blocks(packs, s3, tmp_path):
    """The object's identity is in the cache key: new content at the URL, new blocks."""
    import s3fs

    bucket, options = s3
    fs = s3fs.S3FileSystem(**options)
    url = f"{bucket}/replaced.h5"
    fs.put(str(packs["hdf5"]), url)
    cache = {"storage_options": options, "cache_dir": tmp_path / "cache", "block_size": BLOCK}
    first = open_reader(url, "val", **cache)
    first.read_image(0)
    keys_before = {p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()}
    other = tree(tmp_path / "other-src")
    write(other / "val" / "ant" / "extra.jpg", jpeg_bytes(1, size=(200, 150)))
    pack(str(other), "hdf5", str(tmp_path / "other.h5"), progress=False)
    fs.put(str(tmp_path / "other.h5"), url)
    second = open_reader(url, "val", **cache)
    same_as_local(second, open_reader(str(tmp_path / "other.h5"), "val"))
    assert {p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()} - keys_before
    first.close()
    with pytest.raises(CorruptDataError, match="replaced"):
        first.read_image(0)  # reopening the old reader finds another object at its URL


def read_all_records(url: str, options: dict, cache_dir: str, limit: int, first: int) -> list[str]:
    """In a child process: every record of the split, in storage order from position first
    on (round), as SHA-256 by index."""
    reader = open_reader(url, "val", storage_options=options, cache_dir=cache_dir, cache_limit=limit,
                         block_size=BLOCK)
    digests = [""] * reader.count
    for position in np.roll(np.arange(reader.count), -first).tolist():
        index = int(reader.storage_order()[position])
        digests[index] = hashlib.sha256(reader.read_image(index)[0]).hexdigest()
    return digests


def check_blocks(cache: Path, local_file: Path, block: int) -> int:
    """Every block file in cache equals its range of local_file (one object cached); count them."""
    data = local_file.read_bytes()
    blocks = [p for p in cache.rglob("*") if p.is_file() and p.name != ".lock"]
    assert not [p for p in blocks if ".tmp." in p.name]
    for p in blocks:
        k = int(p.name)
        assert p.read_bytes() == data[k * block:(k + 1) * block], p
    return len(blocks)


def test_two_processes_share_the_cache_under_eviction(packs, s3, tmp_path):
    bucket, options = s3
    url = f"{bucket}/{packs['lmdb'].name}"
    block = parse_bytes(BLOCK, "block")
    limit = 3 * block  # far less than the split: the two evict each other's blocks all along
    local = open_reader(str(packs["lmdb"]), "val")
    expected = [hashlib.sha256(local.read_image(i)[0]).hexdigest() for i in range(local.count)]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.starmap(read_all_records, [(url, options, str(tmp_path / "cache"), limit, first)
                                                  for first in (0, local.count // 2)])
    assert results == [expected, expected]
    assert cache_bytes(tmp_path / "cache") <= limit
    assert check_blocks(tmp_path / "cache", packs["lmdb"] / "data.mdb", block) > 0


def test_dataloader_workers_share_the_cache(packs, s3, tmp_path):
    bucket, options = s3
    cache = tmp_path / "cache"
    remote = HDF5Dataset(f"{bucket}/{packs['hdf5'].name}", "train", decode="raw", storage_options=options,
                         cache_dir=cache, cache_limit="10MB", block_size=BLOCK)
    local = HDF5Dataset(str(packs["hdf5"]), "train", decode="raw")
    loader = torch.utils.data.DataLoader(remote, batch_size=None, num_workers=2, shuffle=True,
                                         multiprocessing_context="fork")
    seen = {}
    for (data, label) in loader:
        seen[hashlib.sha256(bytes(data)).hexdigest()] = int(label)
    assert seen == {hashlib.sha256(local[i][0]).hexdigest(): local[i][1] for i in range(len(local))}
    assert check_blocks(cache, packs["hdf5"], parse_bytes(BLOCK, "block")) > 0


def test_block_order_hints_fetch_ahead_into_the_cache(packs, s3, tmp_path):
    """will_need (BlockShuffleSampler's hint) fetches the blocks in the background; the
    reads that follow are served from the cache, with no request of their own."""
    bucket, options = s3
    reader = open_reader(f"{bucket}/{packs['lmdb'].name}", "train", storage_options=options,
                         cache_dir=tmp_path / "cache", block_size=BLOCK).open()
    before = remote_source.fetched()
    reader.will_need(0, reader.count)
    assert remote_source.in_flight() > 0
    deadline = time.monotonic() + 60
    while remote_source.in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert remote_source.fetched()[1] > before[1]  # fetched by the background threads
    before = remote_source.fetched()
    local = open_reader(str(packs["lmdb"]), "train")
    for position in range(reader.count):
        index = int(reader.storage_order()[position])
        assert reader.read_image(index) == local.read_image(index)
    assert remote_source.fetched() == before


def test_a_damaged_cache_block_is_fetched_again(packs, s3, tmp_path):
    bucket, options = s3
    url = f"{bucket}/{packs['wds'].name}"
    cache = tmp_path / "cache"
    reader = open_reader(url, "train", storage_options=options, cache_dir=cache, block_size=BLOCK)
    local = open_reader(str(packs["wds"]), "train")
    for i in range(reader.count):
        reader.read_image(i)
    shards = [p for p in cache.rglob("*") if p.is_file() and p.name.isdigit() and p.stat().st_size > 4096]
    for p in shards:  # flip a byte in the middle of every cached block (same length: looks whole)
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        p.write_bytes(bytes(raw))
    before = remote_source.fetched()[1]
    for i in range(reader.count):
        assert reader.read_image(i) == local.read_image(i)
    assert remote_source.fetched()[1] > before  # damaged records were fetched again, past the cache


def test_a_damaged_remote_record_is_reported_after_one_more_fetch(packs, s3, tmp_path):
    import s3fs

    bucket, options = s3
    local = hdf5.Reader(str(packs["hdf5"]), "val")
    position = local.position(2)
    at = int(local.file_offsets()[position]) + 10
    raw = bytearray(packs["hdf5"].read_bytes())
    raw[at] ^= 0xFF
    (tmp_path / "bad.h5").write_bytes(bytes(raw))
    url = f"{bucket}/bad-{tmp_path.name}.h5"
    s3fs.S3FileSystem(**options).put(str(tmp_path / "bad.h5"), url)
    reader = open_reader(url, "val", storage_options=options, block_size=BLOCK).open()  # tables loaded
    assert reader.read_image(1) == local.read_image(1)
    before = remote_source.fetched()[1]
    with pytest.raises(CorruptDataError, match="checksum mismatch.*read twice"):
        reader.read_image(2)
    assert remote_source.fetched()[1] - before == 2  # the record, and once more past the cache


def test_missing_datasets_and_objects_name_the_url(s3, http):
    bucket, options = s3
    with pytest.raises(FormatError, match=f"{bucket}/nothing.lmdb: no packed dataset there"):
        open_reader(f"{bucket}/nothing.lmdb", storage_options=options)
    with pytest.raises(FormatError, match=f"{http}/nothing.h5: no such file"):
        hdf5.Reader(f"{http}/nothing.h5")
    with pytest.raises(remote_source.RemoteError, match="no such object: check the URL") as info:
        remote_source.Remote(options).open(f"{bucket}/nothing")
    assert info.value.kind == "missing"


def test_remote_options_for_a_local_path_are_refused(packs):
    with pytest.raises(ValueError, match="only apply to a dataset named by URL"):
        open_reader(str(packs["lmdb"]), cache_dir="/tmp/x")


def test_without_fsspec_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(ImportError, match=r"pip install 'packer\[remote\]'"):
        open_reader("s3://bucket/x.lmdb")


def test_cache_sizes_parse():
    assert parse_bytes("50GB", "x") == 50 * 10**9 and parse_bytes("512MiB", "x") == 512 << 20
    assert parse_bytes(4096, "x") == 4096 and parse_bytes("1.5 KB", "x") == 1500
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots", "cache_limit")


def test_a_block_larger_than_the_limit_is_not_kept(tmp_path):
    cache = BlockCache(str(tmp_path), 100)
    cache.write("k", 0, b"x" * 101)
    cache.write("k", 1, b"y" * 60)
    cache.write("k", 2, b"z" * 60)  # evicts block 1, the least recently used
    assert not cache.has("k", 0, 101) and not cache.has("k", 1, 60) and cache.has("k", 2, 60)
    assert cache.read("k", 2, 60, 10, 20) == b"z" * 10
    assert cache.read("k", 2, 61, 0, 10) is None  # a block of the wrong length is not trusted


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_a_server_dying_mid_epoch_gives_a_clear_error_and_a_restart_resumes(packs, s3_server, nginx, kind):
    if kind == "s3":
        import s3fs

        bucket = new_bucket(s3_server.endpoint_url)
        options = {**bucket.storage_options, **FAST_FAIL}
        s3fs.S3FileSystem(**options).put(str(packs["lmdb"]), f"{bucket.name}/data.lmdb", recursive=True)
        url, server = f"{bucket.url}/data.lmdb", s3_server
    else:
        server = nginx(packs["lmdb"].parent)
        url, options = f"{server.base_url}/data.lmdb", {}
    reader = open_reader(url, "train", storage_options=options)  # no cache: every record is a request
    reader.remote.retries = 2
    local = open_reader(str(packs["lmdb"]), "train")
    half = reader.count // 2
    for i in range(half):
        assert reader.read_image(i) == local.read_image(i)
    server.kill()
    with pytest.raises(remote_source.RemoteError, match=f"{url}/data.mdb: .*cannot be reached") as info:
        reader.read_image(half)
    assert "check the endpoint_url and the network" in str(info.value) and "(retried)" in str(info.value)
    server.restart()
    for i in range(half, reader.count):
        assert reader.read_image(i) == local.read_image(i)


def test_transient_failures_are_retried(packs, nginx):
    """The server is down when a read starts and back a moment later: the read succeeds."""
    server = nginx(packs["hdf5"].parent)
    reader = open_reader(f"{server.base_url}/{packs['hdf5'].name}", "val").open()
    local = open_reader(str(packs["hdf5"]), "val")
    server.kill()
    threading.Timer(0.4, server.start).start()
    assert reader.read_image(0) == local.read_image(0)  # retried with backoff: 0.25 s, 0.5 s, ...


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_wdsdataset_streams_remote_shards(packs, s3, http, kind):
    bucket, options = s3
    base, options = (bucket, options) if kind == "s3" else (http, None)
    url = f"{base}/{packs['wds'].name}"
    local = [(bytes(x), y) for x, y in WDSDataset(str(packs["wds"]), "train", decode="raw")]
    remote = WDSDataset(url, "train", decode="raw", storage_options=options, prefetch_shards=2)
    assert len(remote) == len(local) and len(remote.shards) > 2
    assert [(bytes(x), y) for x, y in remote] == local
    shard_urls = [f"{url}/train/shard-{{000000..{len(remote.shards) - 1:06d}}}.tar"]
    counted = WDSDataset(shard_urls, decode="raw", storage_options=options)  # no index: counted by streaming
    assert counted.counts == remote.counts
    assert sorted(bytes(x) for x, _ in counted) == sorted(x for x, _ in local)


def test_wdsdataset_reports_a_dead_server_naming_the_shard(packs, nginx):
    server = nginx(packs["wds"].parent)
    dataset = WDSDataset(f"{server.base_url}/{packs['wds'].name}", "train", decode="raw")
    dataset.remote.retries = 1
    server.kill()
    with pytest.raises(remote_source.RemoteError, match=r"shard-000000\.tar: the server cannot be reached"):
        list(dataset)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_store_that_answers_403_for_missing_keys_still_opens_a_dataset(packs, nginx, fmt):
    """S3 answers 403, not 404, for a missing key to a reader that may not list the bucket
    (a public bucket, a CDN): the format's probes that meet one go on to the next."""
    server = nginx(packs[fmt].parent, missing_as=403)
    url = f"{server.base_url}/{packs[fmt].name}"
    assert read_metadata(url).count == read_metadata(str(packs[fmt])).count
    with pytest.raises(remote_source.RemoteError, match="access refused by the web server") as refused:
        read_metadata(f"{server.base_url}/nothing.lmdb")  # nothing there: all that can be known
    assert "AWS" not in str(refused.value)  # no S3 credentials to check for a web server


def test_a_dead_s3_endpoint_is_tried_once_per_attempt_of_packers_own():
    """packer.remote.retry retries; botocore and s3fs retrying inside each of its attempts
    made 34 connections and some 50 s before the error, where the docs say about 8 s."""
    accepted = []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def reset_every_connection():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=reset_every_connection, daemon=True).start()
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:"
                                                                            f"{server.getsockname()[1]}"}}
    # LMDBDataset("s3://bucket/x.lmdb") asks first for data.mdb's size, with the default 6 of
    # packer's attempts and 8 s of waits between them: 3 attempts count connections as well.
    retries = 3
    try:
        with pytest.raises(remote_source.RemoteError, match="cannot be reached: check the endpoint_url"):
            remote_source.Remote(storage_options=options, retries=retries).info("s3://bucket/x.lmdb/data.mdb")
    finally:
        server.close()
    # Each of packer's attempts makes a few connections (2-4 here, with the load);
    # botocore's and s3fs's retries inside each attempt made 34 over 6 attempts.
    assert 1 <= len(accepted) <= 4 * retries


@pytest.mark.parametrize("fmt", FORMATS)
def test_packer_info_reads_a_remote_dataset(packs, s3, fmt):
    import json

    from click.testing import CliRunner

    from packer.cli import main

    bucket, options = s3
    url = f"{bucket}/{packs[fmt].name}"
    result = CliRunner().invoke(main, ["info", url, "--json", "--storage-options", json.dumps(options)])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    local = json.loads(CliRunner().invoke(main, ["info", str(packs[fmt]), "--json"]).output)
    assert facts["path"] == url and facts["disk_bytes"] is None
    # The JPEG forms census reads records: info does it for a local dataset only (docs/cli.md).
    assert "forms" in local and "forms" not in facts
    assert {k: v for k, v in facts.items() if k not in ("path", "disk_bytes")} == \
        {k: v for k, v in local.items() if k not in ("path", "disk_bytes", "forms")}


def test_the_manifest_names_the_format_and_a_bad_one_is_refused(packs, s3):
    import json

    import s3fs

    from packer.errors import PackError
    from packer.formats import detect_format

    bucket, options = s3
    fs = s3fs.S3FileSystem(**options)
    url = f"{bucket}/with-manifest.lmdb"
    upload(fs, packs["lmdb"], url)
    size = (packs["lmdb"] / "data.mdb").stat().st_size
    fs.pipe(f"{url}/packer.json", json.dumps({"packer_remote": 1, "format": "lmdb",
                                               "objects": {"data.mdb": size}}).encode())
    assert detect_format(url, storage_options=options) == "lmdb"
    same_as_local(open_reader(url, "val", storage_options=options), open_reader(str(packs["lmdb"]), "val"))
    fs.pipe(f"{url}/packer.json", json.dumps({"packer_remote": 1, "format": "lmdb",
                                               "objects": {"../escape": 1}}).encode())
    with pytest.raises(PackError, match="not a valid packer manifest"):
        open_reader(url, "val", storage_options=options)


def test_refused_credentials_are_named(packs, s3_auth_server):
    from servers import storage_options

    bucket = new_bucket(s3_auth_server.endpoint_url, s3_auth_server.credentials)
    bucket.client().put_object(Bucket=bucket.name, Key="x.h5", Body=packs["hdf5"].read_bytes())
    url = f"{bucket.url}/x.h5"
    # (moto's signature check refuses some of s3fs's listings even with the right keys, so
    # only the refusal is read here)
    wrong = {**storage_options(s3_auth_server.endpoint_url, ("AKIAWRONGWRONGWRONG0", "not-the-secret")), **FAST_FAIL}
    with pytest.raises(remote_source.RemoteError, match=f"{url}.*access refused.*check the credentials") as info:
        open_reader(url, "val", storage_options=wrong)
    assert info.value.kind == "denied"


def hold_fetch_lock(root: str, held, release) -> None:
    """In a child process: hold block 0's fetch lock until told to let go."""
    cache = BlockCache(root, 1 << 20)
    fd = cache.lock_fetch("k", 0)
    held.set()
    release.wait(30)
    cache.write("k", 0, b"x" * 10)
    cache.unlock_fetch("k", 0, fd)


def test_one_process_at_a_time_fetches_a_block(tmp_path):
    """A block's fetch lock is held across processes: a read-ahead (wait=False) leaves the
    block to the holder, a read waits for it and then finds the block published; the
    lock's file is gone once released, so no stray file stays in the cache."""
    context = multiprocessing.get_context("fork")
    held, release = context.Event(), context.Event()
    child = context.Process(target=hold_fetch_lock, args=(str(tmp_path), held, release))
    child.start()
    try:
        assert held.wait(30)
        cache = BlockCache(str(tmp_path), 1 << 20)
        assert cache.lock_fetch("k", 0, wait=False) is None
        threading.Timer(0.2, release.set).start()
        fd = cache.lock_fetch("k", 0)  # waits for the child to publish the block and let go
        assert release.is_set()
        assert cache.read("k", 0, 10, 0, 10) == b"x" * 10
        cache.unlock_fetch("k", 0, fd)
    finally:
        release.set()
        child.join(30)
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == ["0000000000"]
    assert cache.used() == 10


def test_block_order_over_a_slow_link_fetches_each_block_once(packs, nginx, link, tmp_path):
    """make_loader(order="block") with two workers: the main process's read-ahead and the
    workers' own reads and hints share one cache_dir, and no block crosses the link twice
    (each ranged GET of data.mdb is asked once); the cached blocks equal the local file."""
    server = nginx(packs["lmdb"].parent, log_requests=True)
    slow = link(server.port, delay=0.02, rate=20e6)  # fetches long enough to overlap
    cache = tmp_path / "cache"
    remote = LMDBDataset(slow.url(packs["lmdb"].name), "train", decode="raw", cache_dir=cache, block_size=BLOCK)
    local = LMDBDataset(str(packs["lmdb"]), "train", decode="raw")
    loader = make_loader(remote, 4, workers=2, order="block", collate_fn=list, drop_last=False,
                         multiprocessing_context="fork")
    seen = sorted(hashlib.sha256(bytes(data)).hexdigest() for batch in loader for data, _ in batch)
    assert seen == sorted(hashlib.sha256(local[i][0]).hexdigest() for i in range(len(local)))
    ranges = [r["range"] for r in server.requests() if r["method"] == "GET" and r["path"].endswith("/data.mdb")]
    assert ranges and all(ranges)
    twice = [r for r, n in collections.Counter(ranges).items() if n > 1]
    assert not twice, f"fetched more than once: {twice}"
    assert check_blocks(cache, packs["lmdb"] / "data.mdb", parse_bytes(BLOCK, "block")) == len(ranges)


def test_block_order_starts_fetching_when_the_epoch_is_set(packs, s3, tmp_path):
    """BlockShuffleSampler.set_epoch (which make_loader's loader calls before it starts its
    workers) starts fetching the pass's first two windows: their records then read from
    the cache, with no request of their own."""
    bucket, options = s3
    dataset = LMDBDataset(f"{bucket}/{packs['lmdb'].name}", "train", decode="raw", storage_options=options,
                          cache_dir=tmp_path / "cache", block_size=BLOCK)
    dataset.open()
    sampler = BlockShuffleSampler(dataset, block_size=4, window=2, seed=3)
    before = remote_source.fetched()
    sampler.set_epoch(1)
    deadline = time.monotonic() + 60
    while remote_source.in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert remote_source.fetched()[1] > before[1]
    first_two_windows = list(itertools.islice(iter(sampler), 2 * 2 * 4))
    # Drawing these indexes sent the read-ahead for the third window: let it land before
    # counting, so that only the reads below could add to the count.
    while remote_source.in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    fetched = remote_source.fetched()
    local = LMDBDataset(str(packs["lmdb"]), "train", decode="raw")
    for index in first_two_windows:
        assert dataset[index][0] == local[index][0]
    assert remote_source.fetched() == fetched


def test_a_fetch_lock_is_released_though_a_child_forked_while_it_was_held(tmp_path):
    """A DataLoader forks its workers while read-ahead threads hold fetch locks: each child
    shares the locked file, and closing it in the parent alone would leave the lock held
    (and whoever waits on it stuck) for as long as the child lives."""
    cache = BlockCache(str(tmp_path), 1 << 20)
    fd = cache.lock_fetch("k", 0)
    context = multiprocessing.get_context("fork")
    done = context.Event()
    child = context.Process(target=done.wait, args=(60,))
    child.start()
    try:
        waiter = threading.Thread(target=lambda: cache.unlock_fetch("k", 0, cache.lock_fetch("k", 0)))
        waiter.start()
        time.sleep(0.2)  # the waiter is blocked on the held lock
        cache.write("k", 0, b"y" * 5)
        cache.unlock_fetch("k", 0, fd)
        waiter.join(10)
        assert not waiter.is_alive(), "the lock stayed held by the forked child"
    finally:
        done.set()
        child.join(30)


def test_block_order_read_ahead_keeps_the_cache_limit(packs, s3, tmp_path):
    """Read-ahead in the main process and two workers, through a cache far smaller than the
    split: blocks are evicted before some are read (a reader that waited for a block's
    fetch then fetches it again), every record still reads byte-exact, the limit holds
    and no fetch lock is left behind."""
    bucket, options = s3
    cache = tmp_path / "cache"
    limit = 4 * parse_bytes(BLOCK, "block")
    remote = LMDBDataset(f"{bucket}/{packs['lmdb'].name}", "train", decode="raw", storage_options=options,
                         cache_dir=cache, cache_limit=limit, block_size=BLOCK)
    local = LMDBDataset(str(packs["lmdb"]), "train", decode="raw")
    loader = make_loader(remote, 4, workers=2, order="block", collate_fn=list, drop_last=False,
                         multiprocessing_context="fork")
    seen = sorted(hashlib.sha256(bytes(data)).hexdigest() for batch in loader for data, _ in batch)
    assert seen == sorted(hashlib.sha256(local[i][0]).hexdigest() for i in range(len(local)))
    deadline = time.monotonic() + 60
    while remote_source.in_flight() and time.monotonic() < deadline:  # the main process's read-ahead
        time.sleep(0.05)
    assert cache_bytes(cache) <= limit
    assert check_blocks(cache, packs["lmdb"] / "data.mdb", parse_bytes(BLOCK, "block")) > 0


@pytest.fixture
def readers_own_http_timeouts(monkeypatch):
    """The suite's fsspec HTTP configuration (servers.bounded_http_waits) taken away, so
    the readers' own default applies, as it does for users."""
    import fsspec.config
    for name in ("http", "https"):
        monkeypatch.delitem(fsspec.config.conf, name, raising=False)


def test_a_silent_http_server_is_reported_as_a_timeout_not_waited_on(readers_own_http_timeouts, monkeypatch):
    """A server that takes the connection and never answers: the read gives up after
    HTTP_TIMEOUTS (aiohttp alone would wait 5 minutes a try) and names the URL."""
    monkeypatch.setattr(remote_source, "HTTP_TIMEOUTS", {"sock_connect": 2.0, "sock_read": 0.5})
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/silent.lmdb/data.mdb"
        start = time.monotonic()
        with pytest.raises(remote_source.RemoteError) as caught:
            remote_source.Remote(retries=2).info(url)
    assert time.monotonic() - start < 20
    assert caught.value.kind == "timeout" and url in str(caught.value)


def test_the_http_read_timeouts_give_way_to_the_callers_client_kwargs(readers_own_http_timeouts):
    timeout = remote_source.with_http_timeouts("https://host/x.h5", {})["client_kwargs"]["timeout"]
    assert (timeout.total, timeout.sock_connect, timeout.sock_read) == (None, 10.0, 60.0)
    own = {"client_kwargs": {"headers": {"Authorization": "Bearer t"}}}
    assert remote_source.with_http_timeouts("https://host/x.h5", own) is own
    assert remote_source.with_http_timeouts("s3://bucket/x.h5", {}) == {}


def drop_inherited_filesystems(url: str) -> None:
    """What a forked DataLoader worker does first: a filesystem of its own (fsspec drops the
    ones it inherited) and a collection (their finalizers close the inherited connections)."""
    import gc

    remote_source.filesystem(url, {})
    gc.collect()


def test_a_forked_child_leaves_the_parents_http_connections_working(packs, http, readers_own_http_timeouts,
                                                                     monkeypatch):
    """A child forked after a read over HTTP shares its parent's event loop's epoll instance:
    closing the connections it inherited took the parent's pooled connection out of the
    parent's loop, whose next request on it then waited for the socket read timeout."""
    monkeypatch.setattr(remote_source, "HTTP_TIMEOUTS", {"sock_connect": 2.0, "sock_read": 5.0})
    remote = remote_source.Remote(retries=1)
    url = f"{http}/{packs['hdf5'].name}"
    size = remote.identity(url)[1]  # leaves a connection in the pool
    child = multiprocessing.get_context("fork").Process(target=drop_inherited_filesystems, args=(url,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    start = time.monotonic()
    assert remote.identity(url)[1] == size  # on the pooled connection: no timeout, no retry
    assert time.monotonic() - start < 2.5


def test_a_wdsdataset_stream_refuses_a_dataset_replaced_at_its_url(packs, s3, tmp_path):
    """A packer folder uploaded again over the one a WDSDataset was made of (other classes)
    is refused, as the local stream refuses one replaced by pack --force."""
    import s3fs

    bucket, options = s3
    fs = s3fs.S3FileSystem(**options)
    url = f"{bucket}/replaced.wds"
    fs.put(str(packs["wds"]), url, recursive=True)
    dataset = WDSDataset(url, "val", decode="raw", storage_options=options)
    assert len(list(dataset)) == len(dataset)
    other = tmp_path / "other"
    for i, c in enumerate(("ant", "bee", "cat", "dog") * 3):
        write(other / "val" / c / f"{c}{i}.jpg", jpeg_bytes(7000 + i))
    pack(str(other), "wds", str(tmp_path / "other.wds"), progress=False, options={"max_count": 10})
    fs.put(f"{tmp_path / 'other.wds'}/", url, recursive=True)  # its files over the old ones, not a folder inside
    with pytest.raises(CorruptDataError, match=r"index\.json was replaced since this Dataset was created"):
        list(dataset)
