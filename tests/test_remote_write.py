"""Writing datasets to object storage, and the loopback servers the remote tests run against."""
from __future__ import annotations

import urllib.request
import urllib.error

import pytest

from packer.remote import is_url, parse_url


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
    server = nginx(root)
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


# --- URLs -----------------------------------------------------------------------------


@pytest.mark.parametrize("path, expected", [
    ("s3://bucket/a/b.lmdb", ("s3", "bucket", "a/b.lmdb")),
    ("S3://bucket", ("s3", "bucket", "")),
    ("https://host:8080/x/y.h5", ("https", "host:8080", "x/y.h5")),
])
def test_urls_are_parsed_into_scheme_bucket_and_key(path, expected):
    assert is_url(path) and tuple(parse_url(path)) == expected


@pytest.mark.parametrize("path", ["/data/x.lmdb", "x.lmdb", "file:///x", "s3:/bucket", "", None, 3])
def test_local_paths_are_not_urls(path):
    assert not is_url(path)


def test_a_url_without_bucket_is_refused():
    with pytest.raises(ValueError, match="no bucket"):
        parse_url("s3:///key")
