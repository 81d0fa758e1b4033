"""Writing datasets to object storage, and the loopback servers the remote tests run against."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import class_sorted_tree
from packer.cli import main
from packer.errors import PackError
from packer.remote import is_url, parse_url

ROOT = Path(__file__).resolve().parents[1]
EXTENSION = {"lmdb": ".lmdb", "hdf5": ".h5", "wds": ".wds"}


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def options_json(bucket) -> str:
    return json.dumps(bucket.storage_options)


def s3fs_of(bucket):
    s3fs = pytest.importorskip("s3fs")
    return s3fs.S3FileSystem(skip_instance_cache=True, **bucket.storage_options)


def download(bucket, key: str, local: Path) -> Path:
    """The dataset at s3://bucket/key, fetched to local (for packer verify, independent of any remote reader)."""
    fs = s3fs_of(bucket)
    if fs.isfile(f"{bucket.name}/{key}"):
        fs.get_file(f"{bucket.name}/{key}", str(local))
    else:
        local.mkdir()
        for path in fs.find(f"{bucket.name}/{key}/"):
            relative = path[len(f"{bucket.name}/{key}/"):]
            if relative != "packer.json":
                (local / relative).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(path, str(local / relative))
    return local


def assert_verifies(bucket, key: str, src: Path, tmp_path: Path) -> None:
    from packer.verify import verify

    report = verify(str(download(bucket, key, tmp_path / ("fetched-" + key.replace("/", "-")))), str(src))
    assert report.ok and report.checked > 0, report.problems


# --- the servers themselves (tests/servers.py) --------------------------------------


def test_moto_server_stores_objects_through_s3fs(s3_bucket):
    s3fs = pytest.importorskip("s3fs")
    fs = s3fs.S3FileSystem(**s3_bucket.storage_options)
    fs.pipe(f"{s3_bucket.name}/a/b.bin", b"0123456789")
    assert fs.cat_file(f"{s3_bucket.name}/a/b.bin", start=2, end=5) == b"234"
    assert s3_bucket.keys() == ["a/b.bin"]


def test_a_killed_s3_server_refuses_and_a_restart_serves_the_same_objects(s3_server):
    from servers import new_bucket

    bucket = new_bucket(s3_server.endpoint_url)
    bucket.client().put_object(Bucket=bucket.name, Key="k", Body=b"kept")
    s3_server.kill()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(s3_server.endpoint_url, timeout=5)
    s3_server.restart()
    assert bucket.client().get_object(Bucket=bucket.name, Key="k")["Body"].read() == b"kept"


def test_nginx_serves_byte_ranges_and_restarts_on_its_port(http_root, nginx):
    root, base_url = http_root
    (root / "d").mkdir()
    (root / "d" / "x.bin").write_bytes(bytes(range(256)) * 4)
    request = urllib.request.Request(f"{base_url}/d/x.bin", headers={"Range": "bytes=10-19"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 206 and response.read() == bytes(range(10, 20))
    server = nginx(root, log_requests=True)
    with urllib.request.urlopen(urllib.request.Request(server.url("d/x.bin"), headers={"Range": "bytes=5-9"})) as r:
        assert r.read() == bytes(range(5, 10))
    (served,) = server.requests(at_least=1)
    assert served["path"] == "/d/x.bin" and served["range"] == "bytes=5-9" and served["bytes"] == 5
    assert served["status"] == 206
    server.kill()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url("d/x.bin"), timeout=5)
    server.restart()
    with urllib.request.urlopen(server.url("d/x.bin"), timeout=5) as response:
        assert response.read() == bytes(range(256)) * 4


def test_nginx_limit_rate_throttles_each_connection(tmp_path, nginx):
    import time

    (tmp_path / "big.bin").write_bytes(b"\0" * 500_000)
    server = nginx(tmp_path, limit_rate=200_000)
    start = time.perf_counter()
    with urllib.request.urlopen(server.url("big.bin"), timeout=10) as response:
        assert len(response.read()) == 500_000
    # nginx lets one second's worth through at once, then 200 kB/s: about 1.5 s for 500 kB,
    # where unthrottled loopback takes milliseconds.
    assert time.perf_counter() - start > 1.0


def test_a_link_adds_its_latency_to_each_request_and_caps_the_bandwidth(tmp_path, nginx, link):
    (tmp_path / "small.bin").write_bytes(b"s")
    (tmp_path / "big.bin").write_bytes(b"\0" * 2_000_000)
    server = nginx(tmp_path)
    slow = link(server.port, delay=0.05, rate=2_000_000)

    def fetch(url):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=20) as response:
            data = response.read()
        return data, time.perf_counter() - start

    assert fetch(server.url("small.bin"))[1] < 0.05
    data, seconds = fetch(slow.url("small.bin"))
    # A new connection: one round trip for the handshake, one for the request (2 x 2 x 50 ms).
    assert data == b"s" and seconds >= 0.19
    data, seconds = fetch(slow.url("big.bin"))
    assert len(data) == 2_000_000 and seconds >= 1.0  # 2 MB at 2 MB/s


# --- URLs -----------------------------------------------------------------------------


@pytest.mark.parametrize("path, expected", [
    ("s3://bucket/a/b.lmdb", ("s3", "bucket", "a/b.lmdb")),
    ("S3://bucket", ("s3", "bucket", "")),
    ("https://host:8080/x/y.h5", ("https", "host:8080", "x/y.h5")),
    ("gs://b/k/", ("gs", "b", "k")),
])
def test_urls_are_parsed_into_scheme_bucket_and_key(path, expected):
    assert is_url(path) and tuple(parse_url(path)) == expected


@pytest.mark.parametrize("path", ["/data/x.lmdb", "x.lmdb", "file:///x", "s3:/bucket", "", None, 3])
def test_local_paths_are_not_urls(path):
    assert not is_url(path)


def test_a_url_without_bucket_is_refused():
    with pytest.raises(ValueError, match="no bucket"):
        parse_url("s3:///key")


# --- writing: pack and convert to s3:// ----------------------------------------------


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_pack_uploads_every_format_whole_and_nothing_else(fmt, image_tree, s3_bucket, tmp_path):
    key = "sets/ds" + EXTENSION[fmt]
    staging = tmp_path / "staging"
    staging.mkdir()
    result = cli("pack", image_tree, "--to", fmt, "-o", f"{s3_bucket.url}/{key}",
                 "--storage-options", options_json(s3_bucket), "--staging-dir", staging)
    assert result.exit_code == 0, result.output
    assert f"into {s3_bucket.url}/{key}" in result.output
    keys = s3_bucket.keys()
    assert not [k for k in keys if ".partial-" in k] and list(staging.iterdir()) == []  # both stagings gone
    if fmt == "hdf5":
        assert keys == [key]
    else:
        manifest = json.loads(s3fs_of(s3_bucket).cat_file(f"{s3_bucket.name}/{key}/packer.json"))
        assert manifest["packer_remote"] == 1 and manifest["format"] == fmt
        sizes = {k[len(key) + 1:]: size for k, size in
                 ((k, s3fs_of(s3_bucket).size(f"{s3_bucket.name}/{k}")) for k in keys) if k != f"{key}/packer.json"}
        assert manifest["objects"] == sizes
        assert {"lmdb": "data.mdb", "wds": "index.json"}[fmt] in sizes
    assert_verifies(s3_bucket, key, image_tree, tmp_path)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_what_pack_uploads_reads_back_by_url_byte_for_byte(fmt, split_tree, s3_bucket):
    from packer.formats import open_reader, read_metadata

    url = f"{s3_bucket.url}/rt{EXTENSION[fmt]}"
    assert cli("pack", split_tree, "--to", fmt, "-o", url, "--storage-options", options_json(s3_bucket)).exit_code == 0
    assert read_metadata(url, storage_options=s3_bucket.storage_options).format == fmt
    for split in ("train", "val"):
        reader = open_reader(url, split, storage_options=s3_bucket.storage_options)
        try:
            assert len(reader) == len(list((split_tree / split).rglob("*.jpg")))
            for index in range(len(reader)):
                data, _ = reader.read_image(index)
                assert data == (split_tree / reader.paths[index]).read_bytes()
        finally:
            reader.close()


def test_a_large_file_goes_up_in_parts(tmp_path, s3_bucket, monkeypatch):
    import re

    from conftest import jpeg_bytes, write
    from packer import upload

    monkeypatch.setattr(upload, "PART_SIZE", 5 << 20)  # S3's smallest part
    src = tmp_path / "large"
    for i in range(10):  # noise JPEGs of about 1.2 MB: a 12 MB dataset
        write(src / "c" / f"{i}.jpg", jpeg_bytes(i, size=(1000, 1000), quality=95))
    local = tmp_path / "big.h5"
    assert cli("pack", src, "--to", "hdf5", "-o", local).exit_code == 0
    target = upload.open_target(f"{s3_bucket.url}/big.h5", s3_bucket.storage_options)
    stage = upload.new_owner().path(target.path, upload.PARTIAL)
    upload.upload(target, str(local), "hdf5", stage)
    staged = s3_bucket.client().head_object(Bucket=s3_bucket.name, Key=stage.split("/", 1)[1] + "/big.h5")
    assert staged["ContentLength"] == local.stat().st_size
    assert re.fullmatch(r'"[0-9a-f]{32}-3"', staged["ETag"])  # S3's mark of a 3-part upload: 5 + 5 + 2 MB
    upload.publish(target, stage, "hdf5", {}, replacing=False)  # a server-side copy of a multipart object
    assert_verifies(s3_bucket, "big.h5", src, tmp_path)


def test_convert_uploads_a_local_pack(split_tree, s3_bucket, tmp_path):
    local = tmp_path / "local.lmdb"
    assert cli("pack", split_tree, "--to", "lmdb", "-o", local).exit_code == 0
    result = cli("convert", local, "--to", "wds", "-o", f"{s3_bucket.url}/conv.wds",
                 "--storage-options", options_json(s3_bucket))
    assert result.exit_code == 0, result.output
    assert "converted" in result.output and f"{s3_bucket.url}/conv.wds" in result.output
    assert_verifies(s3_bucket, "conv.wds", split_tree, tmp_path)


# --- the library takes a URL as the command line does (packer.destination) ---------------


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_the_library_packs_to_a_url(fmt, split_tree, s3_bucket, tmp_path):
    import packer

    staging = tmp_path / "staging"
    staging.mkdir()
    url = f"{s3_bucket.url}/lib{EXTENSION[fmt]}"
    result = packer.pack(str(split_tree), fmt, url, storage_options=s3_bucket.storage_options,
                         staging_dir=str(staging), workers=1)
    assert result.out == url and result.metadata.count == len(list(split_tree.rglob("*.jpg")))
    assert list(staging.iterdir()) == [] and not [k for k in s3_bucket.keys() if ".partial-" in k]
    assert_verifies(s3_bucket, f"lib{EXTENSION[fmt]}", split_tree, tmp_path)
    with pytest.raises(packer.OutputExistsError, match="already exists"):
        packer.pack(str(split_tree), fmt, url, storage_options=s3_bucket.storage_options)


def test_the_library_converts_and_merges_to_urls(split_tree, s3_bucket, tmp_path):
    from packer import pack
    from packer.convert import convert
    from packer.formats import read_metadata
    from packer.merge import merge

    options = s3_bucket.storage_options
    parts = [pack(str(split_tree), "lmdb", str(tmp_path / f"p{i}.lmdb"), part=f"{i}/2", workers=1).out
             for i in range(2)]
    merged = merge(parts, f"{s3_bucket.url}/merged.lmdb", workers=1, storage_options=options)
    assert merged.out == f"{s3_bucket.url}/merged.lmdb"
    assert_verifies(s3_bucket, "merged.lmdb", split_tree, tmp_path)
    converted = convert(parts[0], "wds", f"{s3_bucket.url}/p0.wds", workers=1, storage_options=options)
    assert converted.out == f"{s3_bucket.url}/p0.wds"
    assert read_metadata(converted.out, storage_options=options).count == read_metadata(parts[0]).count > 0


# --- a folder and a store refuse the same OUTs (packer.destination's two kinds) ----------


def out_of_kind(kind: str, bucket, tmp_path: Path, name: str) -> tuple[str, dict]:
    """OUT named name in a folder or in the bucket, and the keywords the library needs for it."""
    if kind == "folder":
        (tmp_path / "outs").mkdir(exist_ok=True)
        return str(tmp_path / "outs" / name), {}
    return f"{bucket.url}/{name}", {"storage_options": bucket.storage_options}


def place_users_file(kind: str, bucket, out: str) -> None:
    """A user's own file at OUT/readme.txt: OUT exists and is no dataset."""
    if kind == "folder":
        Path(out).mkdir(parents=True)
        (Path(out) / "readme.txt").write_bytes(b"mine")
    else:
        s3fs_of(bucket).pipe_file(f"{out[len('s3://'):]}/readme.txt", b"mine")


def refusal(how: str, pipeline: str, src: str, out: str, force: bool, remote: dict) -> str:
    """The refusal, by the library or the command line, of pipeline (pack or convert) writing src to OUT."""
    if how == "library":
        import packer
        from packer.convert import convert

        write = packer.pack if pipeline == "pack" else convert
        with pytest.raises(packer.OutputExistsError) as caught:
            write(src, "lmdb" if pipeline == "pack" else "wds", out, force=force, workers=1, **remote)
        return str(caught.value)
    args = [pipeline, src, "--to", "lmdb" if pipeline == "pack" else "wds", "-o", out]
    args += ["--force"] if force else []
    args += ["--storage-options", json.dumps(remote["storage_options"])] if remote else []
    result = cli(*args)
    assert result.exit_code == 1, result.output
    return result.output.strip().removeprefix("Error: ")


def said(text: str, out: str) -> str:
    """The refusal's own words: OUT's name taken out, and up to what each kind found there."""
    return text.replace(out, "OUT").split(": it ")[0]


@pytest.mark.parametrize("pipeline", ["pack", "convert"])
@pytest.mark.parametrize("how", ["library", "cli"])
def test_a_folder_and_a_store_refuse_the_same_outs(how, pipeline, flat_tree, image_tree, s3_bucket, tmp_path):
    import packer

    src = str(flat_tree) if pipeline == "pack" else packer.pack(str(flat_tree), "lmdb", str(tmp_path / "src.lmdb"),
                                                                workers=1).out
    words = {}
    for kind in ("folder", "s3"):
        existing, remote = out_of_kind(kind, s3_bucket, tmp_path, "existing")
        packer.pack(str(image_tree), "hdf5", existing, workers=1, **remote)
        users, _ = out_of_kind(kind, s3_bucket, tmp_path, "users")
        place_users_file(kind, s3_bucket, users)
        words[kind] = [said(refusal(how, pipeline, src, existing, False, remote), existing),
                       said(refusal(how, pipeline, src, users, True, remote), users)]
    assert words["folder"] == words["s3"], words
    assert words["s3"][0].startswith("OUT already exists (pass --force") and \
        words["s3"][1] == "OUT exists and is not a packer dataset"
    assert sorted(os.listdir(tmp_path / "outs")) == ["existing", "users"]  # nothing else written, nor staged


def test_merge_refuses_an_existing_folder_and_url_alike(flat_tree, s3_bucket, tmp_path):
    import packer
    from packer.merge import merge

    parts = [packer.pack(str(flat_tree), "lmdb", str(tmp_path / f"p{i}.lmdb"), part=f"{i}/2", workers=1).out
             for i in range(2)]
    words = []
    for kind in ("folder", "s3"):
        out, remote = out_of_kind(kind, s3_bucket, tmp_path, "merged")
        merge(parts, out, workers=1, **remote)
        with pytest.raises(packer.OutputExistsError) as caught:
            merge(parts, out, workers=1, **remote)
        words.append(said(str(caught.value), out))
    assert words[0] == words[1] and words[0].startswith("OUT already exists (pass --force"), words


def test_a_staging_dir_inside_the_source_is_refused_as_an_out_inside_it_is(flat_tree, s3_bucket, tmp_path):
    import packer

    inside = flat_tree / "scratch"
    inside.mkdir()
    with pytest.raises(PackError, match=f"OUT lies inside {flat_tree}, which it is made from"):
        packer.pack(str(flat_tree), "lmdb", str(inside / "x.lmdb"), workers=1)
    with pytest.raises(PackError, match=f"OUT lies inside {flat_tree}, which it is made from.*--staging-dir"):
        packer.pack(str(flat_tree), "lmdb", f"{s3_bucket.url}/x.lmdb", staging_dir=str(inside),
                    storage_options=s3_bucket.storage_options, workers=1)
    assert list(inside.iterdir()) == [] and s3_bucket.keys() == []


@pytest.mark.parametrize("url, expected", [
    ("https://example.com/x.lmdb", "read-only"),
    ("s3://bucket-only", "name the dataset inside the bucket"),
])
def test_the_library_refuses_unwritable_urls_before_packing(url, expected, flat_tree, tmp_path):
    import packer

    with pytest.raises(PackError, match=expected):
        packer.pack(str(flat_tree), "lmdb", url, staging_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == [flat_tree]  # nothing packed


def test_the_library_refuses_store_options_for_a_local_out(flat_tree, tmp_path):
    import packer

    with pytest.raises(PackError, match="storage_options apply to an out given as a URL"):
        packer.pack(str(flat_tree), "lmdb", str(tmp_path / "x.lmdb"), storage_options={"anon": True})
    assert not (tmp_path / "x.lmdb").exists()


def test_an_existing_dataset_is_refused_without_force_and_replaced_with_it(flat_tree, image_tree, s3_bucket, tmp_path):
    url, options = f"{s3_bucket.url}/ds", options_json(s3_bucket)
    assert cli("pack", image_tree, "--to", "wds", "-o", url, "--storage-options", options).exit_code == 0
    before = s3_bucket.keys()
    refused = cli("pack", flat_tree, "--to", "lmdb", "-o", url, "--storage-options", options_json(s3_bucket))
    assert refused.exit_code == 1 and "already exists" in refused.output and "--force" in refused.output
    assert s3_bucket.keys() == before
    # --force: another format replaces it, and none of the old objects stays behind.
    replaced = cli("pack", flat_tree, "--to", "lmdb", "-o", url, "--force", "--storage-options", options)
    assert replaced.exit_code == 0, replaced.output
    assert s3_bucket.keys() == ["ds/data.mdb", "ds/packer.json"]
    assert_verifies(s3_bucket, "ds", flat_tree, tmp_path)


def force_over_an_object(bucket, src: Path, out_key: str, key: str, data: bytes):
    """The result of packer pack SRC -o s3://bucket/out_key --force where the bucket holds
    only key (data); it must leave that object alone."""
    s3fs_of(bucket).pipe_file(f"{bucket.name}/{key}", data)
    result = cli("pack", src, "--to", "lmdb", "-o", f"{bucket.url}/{out_key}", "--force",
                 "--storage-options", options_json(bucket))
    assert bucket.keys() == [key]
    return result


def test_force_replaces_only_a_dataset(flat_tree, s3_bucket):
    result = force_over_an_object(s3_bucket, flat_tree, "notes", "notes/readme.txt", b"mine")
    assert result.exit_code == 1 and "not a packer dataset" in result.output


def hdf5_model_bytes(tmp_path: Path) -> bytes:
    import h5py
    import numpy as np

    with h5py.File(tmp_path / "model.h5", "w") as f:  # a user's model, as h5py or Keras saves one
        f.create_dataset("dense/kernel", data=np.ones((4, 4), np.float32))
    return (tmp_path / "model.h5").read_bytes()


# Look-alikes at s3://bucket/<out>: the objects the bucket holds, and what the refusal says was found.
REMOTE_LOOK_ALIKES = {
    "data.mdb and a user's file": ({"proj/data.mdb": b"", "proj/thesis.tex": b"x"}, "proj", "a data.mdb without valid"),
    "a user's HDF5 model": ({"model.h5": None}, "model.h5", "an HDF5 object without valid packer metadata"),
    "index.json {}": ({"w/index.json": b"{}", "w/train/a.tar": b"t"}, "w", "an index.json without valid"),
    "index.json with a count": ({"w/index.json": b'{"count": 3}'}, "w", "an index.json without valid"),
    "index.json that does not parse": ({"w/index.json": b"{not json"}, "w", "an index.json without valid"),
}


@pytest.mark.parametrize("kind", list(REMOTE_LOOK_ALIKES))
def test_force_refuses_a_remote_look_alike_and_keeps_it(kind, flat_tree, s3_bucket, tmp_path):
    objects, out, found = REMOTE_LOOK_ALIKES[kind]
    fs = s3fs_of(s3_bucket)
    for key, data in objects.items():
        fs.pipe_file(f"{s3_bucket.name}/{key}", hdf5_model_bytes(tmp_path) if data is None else data)
    result = cli("pack", flat_tree, "--to", "wds", "-o", f"{s3_bucket.url}/{out}", "--force",
                 "--storage-options", options_json(s3_bucket))
    assert result.exit_code == 1 and "not a packer dataset: it " in result.output and found in result.output, \
        result.output
    assert s3_bucket.keys() == sorted(objects)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_force_refuses_a_remote_dataset_with_a_users_object_beside_its_own(fmt, flat_tree, s3_bucket):
    url, options = f"{s3_bucket.url}/ds", options_json(s3_bucket)
    assert cli("pack", flat_tree, "--to", fmt, "-o", url, "--storage-options", options).exit_code == 0
    s3fs_of(s3_bucket).pipe_file(f"{s3_bucket.name}/ds/thesis.tex", b"chapter one")
    before = s3_bucket.keys()
    result = cli("pack", flat_tree, "--to", "lmdb", "-o", url, "--force", "--storage-options", options)
    named = f"({url}/thesis.tex)," if fmt == "hdf5" else f"and also {url}/thesis.tex,"  # under an object / a folder
    assert result.exit_code == 1 and f"{named} which packer did not write" in result.output, result.output
    assert s3_bucket.keys() == before


@pytest.mark.parametrize("url, expected", [
    ("https://example.com/x.lmdb", "read-only"),
    ("s3://bucket-only", "name the dataset inside the bucket"),
    ("s3://b/x.partial-host-1-abc", "reserved"),
    ("s3://b/set[ab].lmdb", "holds [ ], which object-store tools read as wildcards"),  # would reach seta.lmdb
    ("s3://b/runs/*/x.lmdb", "holds *, which"),
])
def test_unwritable_urls_are_refused_before_packing(url, expected, flat_tree):
    result = cli("pack", flat_tree, "--to", "lmdb", "-o", url)
    assert result.exit_code == 1 and expected in result.output and url.rstrip("/") in result.output


@pytest.mark.parametrize("command", ["verify", "convert"])
def test_commands_that_read_local_datasets_only_say_so_for_a_url(command):
    args = [command, "s3://b/x.lmdb"] + (["--to", "hdf5"] if command == "convert" else [])
    result = cli(*args)
    assert result.exit_code == 2 and f"s3://b/x.lmdb: {command} reads a local dataset only; download it first" \
        in result.output, result.output


def test_storage_options_are_refused_without_echoing_them(flat_tree, tmp_path):
    secret = '{"key": "AKIAEXAMPLE", "secret": "SuperSecret123",}'  # a trailing comma: not JSON
    for args in (["info", "s3://b/x.lmdb"], ["pack", flat_tree, "--to", "lmdb", "-o", "s3://b/x.lmdb"]):
        result = cli(*args, "--storage-options", secret)
        assert result.exit_code == 2 and "not JSON (Expecting property name" in result.output, result.output
        assert "SuperSecret123" not in result.output and "AKIAEXAMPLE" not in result.output
    local = cli("info", tmp_path, "--storage-options", '{"anon": true}')  # a local path: a usage error, no traceback
    assert local.exit_code == 2 and "--storage-options applies to a PACKED given as a URL" in local.output


def test_a_missing_staging_dir_is_named_before_packing(flat_tree, s3_bucket, tmp_path):
    result = cli("pack", flat_tree, "--to", "lmdb", "-o", f"{s3_bucket.url}/x.lmdb", "--storage-options",
                 options_json(s3_bucket), "--staging-dir", tmp_path / "missing")
    assert result.exit_code == 1 and str(tmp_path / "missing") in result.output and "--staging-dir" in result.output
    assert s3_bucket.keys() == []


def test_remote_options_for_a_local_out_are_refused(flat_tree, tmp_path):
    result = cli("pack", flat_tree, "--to", "lmdb", "-o", tmp_path / "x.lmdb", "--staging-dir", tmp_path)
    assert result.exit_code == 2 and "--staging-dir" in result.output


@pytest.mark.parametrize("raw, what", [
    (b"not json", "not JSON"),
    (b'{"packer_remote": 2, "format": "lmdb", "objects": {"data.mdb": 1}}', "packer_remote"),
    (b'{"packer_remote": 1, "format": "zip", "objects": {"data.mdb": 1}}', "format"),
    (b'{"packer_remote": 1, "format": "lmdb", "objects": {}}', "no objects"),
    (b'{"packer_remote": 1, "format": "wds", "objects": {"../escape": 1}}', "object name"),
    (b'{"packer_remote": 1, "format": "wds", "objects": {"/abs": 1}}', "object name"),
    (b'{"packer_remote": 1, "format": "wds", "objects": {"a//b": 1}}', "object name"),
    (b'{"packer_remote": 1, "format": "wds", "objects": {"index.json": -1}}', "size"),
    (b'{"packer_remote": 1, "format": "wds", "objects": {"index.json": true}}', "size"),
])
def test_a_hostile_manifest_is_refused(raw, what):
    from packer.upload import parse_manifest

    with pytest.raises(PackError, match=f"s3://b/x/packer.json: not a valid packer manifest .*{what}"):
        parse_manifest(raw, "s3://b/x/packer.json")


def test_force_refuses_a_damaged_manifest_at_out(flat_tree, s3_bucket):
    result = force_over_an_object(s3_bucket, flat_tree, "x.lmdb", "x.lmdb/packer.json",
                                  b'{"packer_remote": 1, "objects": 5}')
    assert result.exit_code == 1 and "not a valid packer manifest" in result.output


# --- errors name the URL and what to check ---------------------------------------------


def write(url, src, storage_options, retries=1, packed=None, **kwargs):
    """A local pack written to url through packer.destination.StoreDestination, as pack() writes it;
    packed (a list) gets each local path packed."""
    from packer.destination import StoreDestination
    from packer.pack import pack

    def pack_locally(local, force):
        if packed is not None:
            packed.append(local)
        return pack(str(src), "lmdb", local, force=force)

    destination = StoreDestination(url, storage_options=storage_options, retries=retries, **kwargs)
    return destination.write("lmdb", [str(src)], pack_locally)


def test_a_missing_bucket_is_named(flat_tree, s3_bucket):
    from packer.remote.errors import RemoteError

    url = "s3://no-such-bucket-here/x.lmdb"
    with pytest.raises(RemoteError, match="bucket no-such-bucket-here does not exist") as caught:
        write(url, flat_tree, s3_bucket.storage_options)
    assert url in str(caught.value) and s3_bucket.endpoint_url in str(caught.value)


def test_wrong_credentials_are_named_before_packing(flat_tree, s3_auth_server, tmp_path):
    from packer.remote.errors import RemoteError
    from servers import new_bucket, storage_options

    bucket = new_bucket(s3_auth_server.endpoint_url, s3_auth_server.credentials)
    wrong = storage_options(s3_auth_server.endpoint_url, ("AKIAWRONGWRONGWRONG0", "not-the-secret"))
    packed, staging = [], tmp_path / "staging"
    staging.mkdir()
    with pytest.raises(RemoteError, match="access refused") as caught:
        write(f"{bucket.url}/x.lmdb", flat_tree, wrong, packed=packed, staging_dir=str(staging))
    message = str(caught.value)
    assert f"{bucket.url}/x.lmdb" in message and "credentials" in message
    assert packed == [] and list(staging.iterdir()) == []  # refused before packing
    # The same checks pass with the right ones (moto's signature check refuses some of
    # s3fs's listings even then, so a whole write cannot run on this server).
    from packer import upload

    target = upload.open_target(f"{bucket.url}/x.lmdb", bucket.storage_options, retries=1)
    upload.check_bucket(target)
    upload.put_bytes(target, f"{bucket.name}/probe", b"ok")
    assert bucket.keys() == ["probe"]


def test_a_dead_endpoint_is_named(flat_tree):
    from packer.remote.errors import RemoteError
    from servers import free_port, storage_options

    endpoint = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(RemoteError, match="cannot be reached") as caught:
        write("s3://bucket/x.lmdb", flat_tree, storage_options(endpoint), retries=2)
    assert endpoint in str(caught.value) and "s3://bucket/x.lmdb" in str(caught.value)
    assert time.monotonic() - start < 30


def test_a_server_that_never_answers_is_named(flat_tree):
    import socket

    from packer.remote.errors import RemoteError
    from servers import storage_options

    with socket.socket() as silent:  # takes connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        options = {**storage_options(endpoint), "config_kwargs": {"read_timeout": 0.5, "connect_timeout": 0.5}}
        with pytest.raises(RemoteError, match="did not answer in time") as caught:
            write("s3://bucket/x.lmdb", flat_tree, options, retries=1)
    assert endpoint in str(caught.value) and "s3://bucket/x.lmdb" in str(caught.value)


def test_storage_options_the_store_refuses_are_named(flat_tree, s3_bucket):
    result = cli("pack", flat_tree, "--to", "lmdb", "-o", f"{s3_bucket.url}/x.lmdb",
                 "--storage-options", json.dumps({**s3_bucket.storage_options, "no_such_option": 1}))
    assert result.exit_code == 1 and "no_such_option" in result.output and "storage options" in result.output


def test_a_restarted_server_is_retried_until_it_answers(flat_tree, s3_server, tmp_path):
    from servers import new_bucket

    bucket = new_bucket(s3_server.endpoint_url)
    s3_server.kill()
    restarter = threading.Timer(1.0, s3_server.restart)
    restarter.start()
    try:
        result = write(f"{bucket.url}/x.lmdb", flat_tree, bucket.storage_options, retries=8)
    finally:
        restarter.join()
    assert result.out == f"{bucket.url}/x.lmdb"
    assert_verifies(bucket, "x.lmdb", flat_tree, tmp_path)


# --- interrupted uploads ---------------------------------------------------------------


# `packer pack` as `python -m packer.cli` runs it, but each upload thread stops once
# PAUSE_AFTER objects are up, after printing "paused" once: the upload is then under way
# and stays so until the test kills it or sends SIGINT or SIGTERM (the threads go on, as
# they would have, and the main thread gets the command's own handling of the signal),
# however fast the machine is. SIGUSR1 resumes the upload alone, to finish as it would have.
PAUSED_CLI = """
import signal, sys, threading
from packer import upload
from packer.cli import main

pause_after, done, lock, resume = int(sys.argv.pop(1)), [0], threading.Lock(), threading.Event()
put, upload_all = upload.put, upload.upload

def put_then_pause(target, local, path):
    put(target, local, path)
    with lock:
        done[0] += 1
        if done[0] == pause_after:
            print("paused", flush=True)
        pausing = done[0] >= pause_after
    if pausing:
        resume.wait()

def resuming(handler):
    def resume_then_handle(signum, frame):
        resume.set()
        handler(signum, frame)
    return resume_then_handle

def upload_resuming_on_a_signal(*args, **kwargs):
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    for signum, handler in previous.items():
        signal.signal(signum, resuming(handler))
    try:
        return upload_all(*args, **kwargs)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

upload.put, upload.upload = put_then_pause, upload_resuming_on_a_signal
signal.signal(signal.SIGUSR1, lambda signum, frame: resume.set())
main(sys.argv[1:], prog_name="packer")
"""


def start_upload(src: Path, url: str, bucket, *extra: str, options_from_env: bool = False,
                 pause_after: int | None = None) -> subprocess.Popen:
    """packer pack SRC --to wds -o URL in a child process, one shard per record (many objects
    to upload); the store's options on the command line, or in fsspec's FSSPEC_S3_* variables.
    pause_after: the upload stops once that many objects are up (until SIGUSR1, SIGINT or SIGTERM),
    and the child prints "paused" on its stdout."""
    runner = [sys.executable, "-m", "packer.cli"] if pause_after is None else \
        [sys.executable, "-c", PAUSED_CLI, str(pause_after)]
    command = [*runner, "pack", str(src), "--to", "wds", "-o", url, "--max-count", "1", *extra]
    env = dict(os.environ)
    if options_from_env:
        env.update(FSSPEC_S3_ENDPOINT_URL=bucket.endpoint_url, FSSPEC_S3_KEY=bucket.storage_options["key"],
                   FSSPEC_S3_SECRET=bucket.storage_options["secret"])
    else:
        command += ["--storage-options", json.dumps(bucket.storage_options)]
    return subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env,
                            stdout=None if pause_after is None else subprocess.PIPE)


def wait_until_paused(proc: subprocess.Popen) -> None:
    """Return once a child started with pause_after says its upload paused; fail if it ends first."""
    for line in proc.stdout:
        if line == "paused\n":
            return
    proc.wait()
    raise AssertionError(f"the upload ended (exit code {proc.returncode}) before it paused: {proc.stderr.read()}")


def watch(bucket, out_key: str, proc: subprocess.Popen, until) -> list[list[str]]:
    """List the bucket over and over while proc runs, until until(keys) holds; every listing
    must show OUT either absent or whole (its manifest and every object it names)."""
    fs = s3fs_of(bucket)
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        keys = bucket.keys()
        seen.append(keys)
        at_out = {k[len(out_key) + 1:] for k in keys if k.startswith(out_key + "/")}
        if "packer.json" in at_out:
            try:
                manifest = json.loads(fs.cat_file(f"{bucket.name}/{out_key}/packer.json"))
            except FileNotFoundError:  # deleted since the listing: a replace began
                manifest = None
            # Only a listing the manifest was read within is one state: a publish between the
            # listing and the read pairs the new manifest with the old objects.
            if manifest is not None and bucket.keys() == keys:
                assert set(manifest["objects"]) | {"packer.json"} == at_out
        if until(keys) or proc.poll() is not None:
            return seen
        time.sleep(0.03)
    raise AssertionError(f"nothing happened in a minute: {seen[-1:]}")


def many_records(tmp_path: Path, per_class: int = 14) -> Path:
    return class_sorted_tree(tmp_path / "many", classes=3, per_class=per_class)


def test_a_killed_upload_leaves_no_dataset_and_the_rerun_cleans_up(tmp_path, s3_bucket):
    src = many_records(tmp_path)
    url = f"{s3_bucket.url}/ds.wds"
    proc = start_upload(src, url, s3_bucket, pause_after=10)
    try:
        wait_until_paused(proc)  # ten objects up, the rest waiting
        watch(s3_bucket, "ds.wds", proc, lambda keys: sum(".partial-" in k for k in keys) >= 10)
        assert proc.poll() is None, proc.stderr.read()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = s3_bucket.keys()
    assert left and all(k.startswith("ds.wds.partial-") for k in left)
    rerun = cli("pack", src, "--to", "wds", "-o", url, "--storage-options", options_json(s3_bucket))
    assert rerun.exit_code == 0, rerun.output
    assert "left by an interrupted pack" in rerun.output
    assert not [k for k in s3_bucket.keys() if ".partial-" in k]
    assert_verifies(s3_bucket, "ds.wds", src, tmp_path)


def test_a_replace_never_shows_a_mixed_or_partial_dataset(tmp_path, s3_bucket, flat_tree):
    src = many_records(tmp_path)
    url = f"{s3_bucket.url}/ds.wds"
    assert cli("pack", flat_tree, "--to", "wds", "-o", url, "--storage-options", options_json(s3_bucket)).exit_code == 0
    proc = start_upload(src, url, s3_bucket, "--force", pause_after=10)
    try:
        wait_until_paused(proc)  # the replacement half up, beside the old dataset
        under_way = watch(s3_bucket, "ds.wds", proc, lambda keys: sum(".partial-" in k for k in keys) >= 10)
        assert proc.poll() is None, proc.stderr.read()
        os.kill(proc.pid, signal.SIGUSR1)  # the upload goes on, and publishes
        watch(s3_bucket, "ds.wds", proc, lambda keys: False)  # every listing checked, until it exits
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert any("ds.wds/packer.json" in keys for keys in under_way)  # the old dataset stood while it ran
    assert not [k for k in s3_bucket.keys() if ".partial-" in k]
    assert_verifies(s3_bucket, "ds.wds", src, tmp_path)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_during_upload_deletes_the_staging(tmp_path, s3_bucket, signum):
    src = many_records(tmp_path)
    proc = start_upload(src, f"{s3_bucket.url}/ds.wds", s3_bucket, options_from_env=True, pause_after=10)
    wait_until_paused(proc)  # ten objects up, the rest waiting
    watch(s3_bucket, "ds.wds", proc, lambda keys: sum(".partial-" in k for k in keys) >= 10)
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1] == ("interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"), err
    assert s3_bucket.keys() == []


def test_a_finished_upload_killed_while_replacing_is_finished_by_the_next_run(tmp_path, s3_bucket, flat_tree):
    from packer import upload
    from packer.staging import HOST, Owner

    src = many_records(tmp_path)
    url = f"{s3_bucket.url}/ds.wds"
    assert cli("pack", flat_tree, "--to", "wds", "-o", url, "--storage-options", options_json(s3_bucket)).exit_code == 0
    # The state a writer killed between deleting the old dataset and publishing the new
    # one leaves: its complete upload beside OUT, OUT no dataset. A dead pid owns it.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = Owner(HOST, int(dead.stdout), "0123456789abcdef")
    target = upload.open_target(url, s3_bucket.storage_options)
    local = tmp_path / "new.wds"
    assert cli("pack", src, "--to", "wds", "-o", local).exit_code == 0
    stage = owner.path(target.path, upload.PARTIAL)
    upload.upload(target, str(local), "wds", stage)
    upload.remove_old(target, keep_object=False)
    assert not [k for k in s3_bucket.keys() if k.startswith("ds.wds/")]
    rerun = cli("pack", src, "--to", "wds", "-o", url, "--storage-options", options_json(s3_bucket))
    assert rerun.exit_code == 1 and "already exists" in rerun.output and "finished writing" in rerun.output
    assert not [k for k in s3_bucket.keys() if ".partial-" in k]
    assert_verifies(s3_bucket, "ds.wds", src, tmp_path)


# --- the retry policy -----------------------------------------------------------------


def test_backoff_doubles_from_the_first_wait_up_to_the_cap_with_jitter():
    from packer.remote.retry import JITTER, Backoff

    waits = list(Backoff(attempts=7, first=0.25, factor=2, cap=4).waits())
    assert len(waits) == 6
    for wait, base in zip(waits, [0.25, 0.5, 1, 2, 4, 4]):
        assert base * (1 - JITTER) <= wait <= base * (1 + JITTER)


def test_transient_errors_are_retried_and_refusals_are_not(s3_bucket):
    from packer.remote.errors import RemoteError
    from packer.remote.retry import with_retries

    calls, slept = [], []

    def refused_twice(timeout):
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError(111, "Connection refused")
        return "answer"

    assert with_retries("s3://b/k", refused_twice, retries=3, sleep=slept.append) == "answer"
    assert len(calls) == 3 and len(slept) == 2
    # A real 404 from the server: reported at once, naming the URL.
    fs = s3fs_of(s3_bucket)
    calls.clear()

    def missing(timeout):
        calls.append(1)
        return fs.cat_file(f"{s3_bucket.name}/no/such/key")

    with pytest.raises(RemoteError, match="no such object") as caught:
        with_retries(f"{s3_bucket.url}/no/such/key", missing, retries=5, sleep=slept.append)
    assert len(calls) == 1 and f"{s3_bucket.url}/no/such/key" in str(caught.value)
    assert caught.value.kind == "missing"


def test_giving_up_says_it_retried(s3_bucket):
    from packer.remote.errors import RemoteError
    from packer.remote.retry import with_retries

    def down(timeout):
        raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(RemoteError, match=r"cannot be reached.*\(retried\)"):
        with_retries("s3://b/k", down, retries=2, storage_options=s3_bucket.storage_options, sleep=lambda s: None)


def test_a_ctrl_c_at_any_bytecode_of_an_upload_s_waiting_leaves_no_thread_behind():
    # The pool's submit, as_completed and a future's result took locks the upload threads
    # need: a KeyboardInterrupt just after one left it held, and leaving the pool waited forever.
    from bytecode_stops import interrupted_at_every_bytecode
    from packer.upload import run_all

    def then_upload():
        yield from (None, None)
        yield run_all([lambda: time.sleep(0.001) for _ in range(3)])

    places = interrupted_at_every_bytecode(then_upload, spared=("submitted", "settle", "cancel"))
    assert len(places) >= 10 and any("run_all" in place for place in places), places
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("packer-upload")]
