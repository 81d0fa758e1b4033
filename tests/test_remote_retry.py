"""Every remote operation ends by its deadline, retries included (packer.remote.retry):
against servers on loopback that take the connection and then never answer, or answer a
byte a second (tests/servers.py: StallingServer), and one that refuses connections."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from conftest import jpeg_bytes, write
from packer.cli import main
from packer.errors import PackError
from packer.remote import retry
from packer.remote.errors import RemoteError
from packer.remote.source import Remote
from packer import pack
from servers import free_port, new_bucket

DEADLINE = 1.0  # the servers here never finish an answer: any deadline is reached
SLACK = 6.0  # seconds past the deadline a test allows: fsspec checks its timeout once a second


@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_a_read_ends_at_its_deadline_naming_the_url_the_request_and_the_time(stalling, mode):
    server = stalling(mode)
    url = f"{server.base_url}/data.lmdb/data.mdb"
    start = time.monotonic()
    with pytest.raises(RemoteError) as caught:
        Remote(storage_options={"deadline": DEADLINE}).info(url)
    took = time.monotonic() - start
    assert DEADLINE - 0.5 <= took < DEADLINE + SLACK
    message = str(caught.value)
    assert caught.value.kind == "timeout" and message.startswith(f"{url}: reading its size did not finish within "
                                                                 f"the {DEADLINE:g} s deadline (1 attempt(s) over")
    assert "--deadline" in message and server.accepted() >= 1


@pytest.mark.parametrize("mode", ["silent", "trickle"])
@pytest.mark.parametrize("how", ["flag", "storage-options"])
def test_packer_info_ends_at_the_deadline_it_is_given(stalling, mode, how):
    server = stalling(mode)
    url = f"{server.base_url}/data.lmdb"
    given = ["--deadline", str(DEADLINE)] if how == "flag" else ["--storage-options",
                                                                 json.dumps({"deadline": DEADLINE})]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "packer", "info", url, *given], capture_output=True, text=True,
                          timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 1 and took < DEADLINE + SLACK + 5  # + the interpreter's start
    assert f"{url}/packer.json: reading its size did not finish within the {DEADLINE:g} s deadline" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_streamed_shard_ends_at_its_deadline(stalling):
    from readers import WDSDataset

    server = stalling("trickle")
    start = time.monotonic()
    message = rf"shard-000000\.tar: reading its size did not finish within the {DEADLINE:g} s"
    with pytest.raises(RemoteError, match=message):
        list(WDSDataset([f"{server.base_url}/shard-000000.tar"], decode="raw", storage_options={"deadline": DEADLINE}))
    assert time.monotonic() - start < DEADLINE + SLACK


def test_an_upload_ends_at_its_deadline(stalling, tmp_path, fake_aws_env):
    server = stalling("silent")
    src = tmp_path / "src"
    write(src / "ant" / "a.jpg", jpeg_bytes(1))
    options = {"client_kwargs": {"endpoint_url": server.base_url}}
    start = time.monotonic()
    result = CliRunner().invoke(main, ["pack", str(src), "--to", "lmdb", "-o", "s3://bucket/x.lmdb", "--deadline",
                                       str(DEADLINE), "--storage-options", json.dumps(options)])
    assert result.exit_code == 1 and time.monotonic() - start < DEADLINE + SLACK
    assert f"did not finish within the {DEADLINE:g} s deadline" in result.output and "s3://bucket/x.lmdb" in result.output


def test_the_deadline_bounds_the_retries_of_a_server_that_refuses():
    url = f"http://127.0.0.1:{free_port()}/data.mdb"  # nothing listens: each attempt is refused at once
    start = time.monotonic()
    with pytest.raises(RemoteError) as caught:
        Remote(storage_options={"deadline": 1.0}, retries=50).info(url)
    assert time.monotonic() - start < 1.0 + 1.0
    assert caught.value.kind == "unreachable"
    assert "cannot be reached" in str(caught.value) and "gave up reading its size at the 1 s deadline" in str(caught.value)


def test_the_default_deadline_ends_a_silent_server_within_two_minutes():
    remote = Remote()
    assert remote.deadline == retry.DEADLINE < 120
    assert "deadline=90" in repr(remote)


@pytest.mark.parametrize("value", [0, -1, "soon", True, float("inf")])
def test_a_deadline_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(PackError, match="deadline must be a positive number of seconds"):
        Remote(storage_options={"deadline": value})


def test_the_cli_refuses_a_deadline_without_a_url(tmp_path):
    result = CliRunner().invoke(main, ["info", str(tmp_path), "--deadline", "5"])
    assert result.exit_code == 2 and "--deadline applies to a PACKED given as a URL" in result.output
    result = CliRunner().invoke(main, ["info", "http://h/x.lmdb", "--deadline", "0"])
    assert result.exit_code == 2 and "--deadline" in result.output


WHOLE = 4.0  # packer info's deadline in the test below: each of its requests alone takes less


def test_packer_info_is_bounded_as_a_whole_not_request_by_request(s3_endpoint, link, tmp_path):
    """Over a slow link every request of `packer info` ends well within the deadline, and all
    of them together would take several times it: the command ends at the deadline all the same."""
    import s3fs

    src = tmp_path / "src"
    for i in range(4):
        write(src / f"c{i % 2}" / f"{i}.jpg", jpeg_bytes(i))
    pack(str(src), "lmdb", str(tmp_path / "x.lmdb"), progress=False, workers=1)
    bucket = new_bucket(s3_endpoint)
    s3fs.S3FileSystem(**bucket.storage_options).put(str(tmp_path / "x.lmdb"), f"{bucket.name}/x.lmdb", recursive=True)
    slow = link(int(s3_endpoint.rsplit(":", 1)[1]), delay=0.25, rate=4000)
    options = {**bucket.storage_options, "client_kwargs": {**bucket.storage_options["client_kwargs"],
                                                          "endpoint_url": slow.base_url}}
    url = f"{bucket.url}/x.lmdb"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "packer", "info", url, "--deadline", str(WHOLE), "--storage-options",
                           json.dumps(options)], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 1 and took < WHOLE + SLACK + 5, (took, proc.stderr)  # + the interpreter's start
    assert f"did not finish within the {WHOLE:g} s deadline of the whole operation" in proc.stderr, proc.stderr
