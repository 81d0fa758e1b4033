"""Credentials in URLs never reach output: packer.errors.redact on every surface that shows a
URL, checked against real servers on loopback (nginx, moto; tests/servers.py)."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import jpeg_bytes, write
from packer import pack
from packer.cli import main
from packer.errors import PackError, redact, redacted
from packer.formats import open_reader
from packer.records import Metadata, SplitInfo

SECRET = "Pa55-SECRET-w0rd"
# The query parameters of a presigned S3 URL, a SAS URL and a token URL, each holding a secret.
QUERY = (f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={SECRET}1&X-Amz-Security-Token={SECRET}2"
         f"&X-Amz-Signature={SECRET}3&sig={SECRET}4&token={SECRET}5&sv=2021-08-06")


def with_credentials(url: str) -> str:
    """url (http://host:port/...) with a user and password in it."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://alice:{SECRET}@{rest}"


@pytest.mark.parametrize("text, expected", [
    (f"http://alice:{SECRET}@host/data.lmdb: no such object", "http://***@host/data.lmdb: no such object"),
    (f"s3://bucket/x.lmdb?{QUERY}", "s3://bucket/x.lmdb?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
     "&X-Amz-Security-Token=***&X-Amz-Signature=***&sig=***&token=***&sv=2021-08-06"),
    (f"URL('https://u:{SECRET}@[::1]:8443/a?x=1#frag')", "URL('https://***@[::1]:8443/a?x=1#frag')"),
    (f"two: http://a:{SECRET}@h/1, http://h/2?access_token={SECRET}.", "two: http://***@h/1, "
     "http://h/2?access_token=***."),
    ("s3://bucket/key@v2/file and /local/path@x", "s3://bucket/key@v2/file and /local/path@x"),
], ids=["userinfo", "presigned", "repr-ipv6", "sentence", "no-credentials"])
def test_redact_hides_the_user_part_and_secret_parameters_only(text, expected):
    assert redact(text) == expected
    assert redact(redact(text)) == expected


def test_a_credential_cut_by_a_length_limit_is_still_hidden():
    from packer.remote.errors import describe

    text = describe(OSError(f"{'x' * 250} http://alice:{SECRET}@host/a"))
    assert SECRET[:4] not in text


@pytest.fixture
def served(tmp_path, nginx) -> tuple[Path, str]:
    """(root, base_url with user and password) of an nginx serving an LMDB and a WDS dataset."""
    root = tmp_path / "root"
    root.mkdir()
    src = tmp_path / "src"
    for c in ("ant", "bee"):
        for i in range(3):
            write(src / "train" / c / f"{c}{i}.jpg", jpeg_bytes(i + (10 if c == "bee" else 0)))
    pack(str(src), "lmdb", str(root / "data.lmdb"), progress=False)
    pack(str(src), "wds", str(root / "data.wds"), progress=False)
    return root, with_credentials(nginx(root).base_url)


def assert_hidden(*outputs: str) -> None:
    for text in outputs:
        assert SECRET not in text, text


def test_info_errors_name_the_url_without_its_credentials(served):
    _, base = served
    for url in (f"{base}/absent.lmdb", f"{base.replace('alice:' + SECRET + '@', '')}/absent.lmdb?{QUERY}"):
        proc = subprocess.run([sys.executable, "-m", "packer", "info", url], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 1
        assert_hidden(proc.stdout, proc.stderr)
        assert "absent.lmdb" in proc.stderr and "***" in proc.stderr


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_info_output_shows_the_url_without_its_credentials(served, as_json):
    _, base = served
    url = f"{base}/data.lmdb"
    result = CliRunner().invoke(main, ["info", url] + (["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    assert_hidden(result.output)
    if as_json:
        facts = json.loads(result.output)
        assert facts["path"] == redact(url) and facts["count"] == 6
    else:
        assert f"{redact(url)}: lmdb" in result.output


@pytest.mark.parametrize("where", ["dataset", "object"])
def test_the_url_in_a_remote_error_and_its_traceback_is_redacted(served, where):
    from packer.remote.source import Remote

    _, base = served
    with pytest.raises(PackError) as caught:
        if where == "dataset":
            open_reader(f"{base}/absent.lmdb", "train")
        else:  # the backend's own error (its message holds the whole URL) is what a traceback chains
            Remote().info(f"{base}/absent.bin?{QUERY}")
    assert "***" in str(caught.value)
    assert_hidden(str(caught.value), repr(caught.value), "".join(traceback.format_exception(caught.value)))


def test_a_dataset_and_its_reader_show_the_url_without_credentials(served):
    from readers import LMDBDataset

    _, base = served
    dataset = LMDBDataset(f"{base}/data.lmdb", "train", decode="raw")
    assert len(dataset) == 6 and bytes(dataset[0][0])
    assert_hidden(repr(dataset), repr(dataset.reader.remote), repr(dataset.reader.open_identified()))
    assert "***@" in repr(dataset)


def test_warnings_and_the_log_records_they_become_show_no_credentials(served, tmp_path):
    from readers import WDSDataset

    root, base = served
    shards = sorted((root / "data.wds" / "train").glob("shard-*.tar"))
    (root / "damaged.tar").write_bytes(b"not a tar header " * 64)
    urls = [f"{base}/data.wds/train/{shard.name}" for shard in shards] + [f"{base}/damaged.tar?{QUERY}"]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("py.warnings")
    logger.addHandler(handler)
    logging.captureWarnings(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            logging.captureWarnings(True)  # catch_warnings restored showwarning: route it to logging again
            dataset = WDSDataset(urls, decode="raw", on_error="skip")
            assert len(list(dataset)) == 6
    finally:
        logging.captureWarnings(False)
        logger.removeHandler(handler)
    logged = [record.getMessage() for record in records]
    assert any("damaged.tar" in message and "skipped this shard" in message for message in logged), logged
    assert_hidden(*logged)


def test_written_metadata_holds_no_credentials(tmp_path):
    """Metadata is the dataset's, shared with it: a URL that reaches params or source (the
    API takes any value there) is written redacted, through the format's own writer."""
    from packer.formats import read_metadata
    from packer.pack import write_dataset

    url = f"https://alice:{SECRET}@labels.example/val.csv?{QUERY}"
    meta = Metadata(format="lmdb", classes=["ant"], splits={"train": SplitInfo(0, 0, [0], True)}, source=url,
                    created="2026-01-01T00:00:00Z", packer_version="0", params={"labels": {"file": url}})
    out = tmp_path / "meta.lmdb"
    write_dataset("lmdb", str(out), False, None, lambda writer: meta)
    raw = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert SECRET.encode() not in raw
    found = read_metadata(str(out))
    assert found.source == redact(url) and found.params["labels"]["file"] == redact(url)
    assert redacted({"a": [url, 3, None]}) == {"a": [redact(url), 3, None]}


def test_a_url_refused_by_a_local_only_command_is_redacted():
    result = CliRunner().invoke(main, ["verify", f"https://alice:{SECRET}@host/x.lmdb"])
    assert result.exit_code == 2 and "***@host" in result.output
    assert_hidden(result.output)


def test_pack_to_a_url_reports_it_without_credentials(tmp_path, s3_bucket):
    src = tmp_path / "src"
    write(src / "ant" / "a.jpg", jpeg_bytes(1))
    out = f"{s3_bucket.url}/x.lmdb?X-Amz-Security-Token={SECRET}"
    result = CliRunner().invoke(main, ["pack", str(src), "--to", "lmdb", "-o", out, "--json",
                                       "--storage-options", json.dumps(s3_bucket.storage_options)])
    assert result.exit_code == 1 and "X-Amz-Security-Token=***" in result.output
    assert_hidden(result.output)


LOGGED = """
import logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s %(message)s")
from packer.cli import main
sys.argv = ["packer", *sys.argv[1:]]
main()
"""


def debug_logged(*args: str) -> subprocess.CompletedProcess:
    """`packer ARGS` in a process whose Python logging prints every DEBUG line of every library."""
    return subprocess.run([sys.executable, "-c", LOGGED, *args], capture_output=True, text=True, timeout=120)


def test_no_credential_reaches_a_debug_log_over_http(served):
    """fsspec's HTTP filesystem logs each URL it requests: the user, password and query go
    to it as request options, so its lines name the object without them."""
    _, base = served
    bare = base.replace("alice:" + SECRET + "@", "")
    found = debug_logged("info", f"{base}/data.lmdb")
    assert found.returncode == 0, found.stderr[-2000:]
    assert f"{bare}/data.lmdb" in found.stderr  # the lines are there, naming the object
    assert_hidden(found.stdout, found.stderr)
    absent = debug_logged("info", f"{bare}/absent.lmdb?{QUERY}")
    assert absent.returncode == 1 and f"{bare}/absent.lmdb" in absent.stderr
    assert_hidden(absent.stdout, absent.stderr)


def test_no_credential_reaches_a_debug_log_over_s3(tmp_path, s3_auth_server):
    from servers import new_bucket, storage_options

    bucket = new_bucket(s3_auth_server.endpoint_url, s3_auth_server.credentials)
    src = tmp_path / "src"
    for i in range(2):
        write(src / "a" / f"{i}.jpg", jpeg_bytes(i))
    options = storage_options(s3_auth_server.endpoint_url, s3_auth_server.credentials)
    done = debug_logged("pack", str(src), "--to", "lmdb", "-o", f"{bucket.url}/x.lmdb", "--storage-options",
                        json.dumps(options))
    assert done.returncode == 0, done.stderr[-2000:]
    found = debug_logged("info", f"{bucket.url}/x.lmdb", "--storage-options", json.dumps(options))
    assert found.returncode == 0 and "botocore" in found.stderr, found.stderr[-2000:]
    for text in (done.stderr, found.stderr):
        assert s3_auth_server.credentials[1] not in text
