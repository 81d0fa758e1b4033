"""Real object-storage servers on loopback for the remote tests: moto's S3 server and nginx.

Both run as child processes on 127.0.0.1 at a free port, so a test talks to them over
real sockets with real HTTP, the way s3fs tests itself, and can kill one outright
(SIGKILL: the next connection is refused) and restart it on the same port.

- S3 (moto's standalone server, `moto[server]`): `s3_endpoint` (session) is its
  endpoint_url; `s3_bucket` is a fresh, empty bucket with the `storage_options` s3fs
  takes; `s3_server` is a private server (one per test) that the test may kill and
  restart; `s3_auth_server` (session) checks credentials (others get 403). moto keeps objects in
  memory, so MotoServer.kill/stop first snapshot every object to disk and the restarted
  server loads them before it takes a connection: it serves what the dead one held.
- HTTP (nginx, Debian's nginx or nginx-light): `http_root` is (root_dir, base_url) of a
  per-test nginx serving root_dir (Range requests are built in for static files);
  `nginx` is a factory, nginx(root, limit_rate=...) -> NginxServer, for servers with a
  per-connection bandwidth limit or to kill and restart. Tests skip, saying why, where
  nginx is not installed.
- A link (Link, or the `link` fixture: link(upstream_port, delay=..., rate=...)): a TCP
  proxy in a child process that imitates a network between client and server: each byte
  arrives `delay` seconds after it left (each way, so a request's round trip is 2 x delay,
  and a new connection's handshake one more round trip), and all connections together
  move at most `rate` bytes/s each way, with enough in flight to fill that link. (netem
  would do this in the kernel, but needs the sch_netem module, which some kernels lack.)

The classes work without pytest too (benchmarks/remote.py starts them the same way).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = ["bounded_http_waits", "fake_aws_env", "s3_endpoint", "s3_bucket", "s3_server", "s3_auth_server", "http_root",
           "nginx", "link", "stalling", "MotoServer", "NginxServer", "Link", "S3Bucket", "free_port", "FAKE_AWS_ENV"]

HOST = "127.0.0.1"
AUTH_SETUP = ("create_user", "create_access_key", "put_user_policy")  # the requests moto lets through unsigned
AUTH_POLICY = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'
START_TIMEOUT = 30.0
# Credentials moto accepts (it checks none); set so no real ones are ever picked up.
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "packer-test-key",
    "AWS_SECRET_ACCESS_KEY": "packer-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookup, which would wait on a timeout
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class PortTaken(RuntimeError):
    """Another process listens on the port a server was to take (free_port's port was
    taken between its check and the server's bind: other test sessions run beside this one)."""


def listening_sockets(port: int) -> set[str] | None:
    """The inodes of the sockets listening on HOST:port, from /proc/net/tcp; None without /proc."""
    try:
        table = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    local = f"{socket.inet_aton(HOST)[::-1].hex().upper()}:{port:04X}"
    return {fields[9] for fields in map(str.split, table) if fields[1] == local and fields[3] == "0A"}


def holds_socket(pid: int, inodes: set[str]) -> bool:
    """Whether process pid has one of the sockets inodes open."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return True
    return False


def is_listening(port: int, proc: subprocess.Popen) -> bool:
    """Whether proc itself listens on port: a connection there reaches proc, not some other
    server that took the port (then this is False however many connections succeed)."""
    inodes = listening_sockets(port)
    if inodes is None:  # no /proc: any listener will do
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return True
        return False
    return bool(inodes) and holds_socket(proc.pid, inodes)


def wait_listening(port: int, proc: subprocess.Popen, what: str, log: Path | None = None, log_from: int = 0) -> None:
    """Return once proc listens on port; fail naming what and its log (from byte log_from)
    if it never does, with PortTaken if the port was in use."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if is_listening(port, proc):
            return
        time.sleep(0.01)
    detail = log.read_bytes()[log_from:][-2000:].decode(errors="replace") if log and log.exists() else ""
    kill_process(proc)
    error = PortTaken if "address already in use" in detail.lower() else RuntimeError
    raise error(f"{what} did not start listening on {HOST}:{port} (exit code {proc.returncode}); log:\n{detail}")


def log_size(log: Path) -> int:
    return log.stat().st_size if log.exists() else 0


def wait_closed(port: int) -> None:
    """Return once nothing accepts on port any more (a killed server's socket is gone)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=0.5).close()
        except OSError:
            return
        time.sleep(0.02)


def kill_process(proc: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        # The server leads its own process group: nginx's workers die with its master.
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- S3: moto ------------------------------------------------------------------------


class ServerProcess:
    """A server run as a child process on a fixed port: restartable there, closed with its files.

    A server given no port takes a free one, and another if that one is taken before the
    server binds it; once it has listened, its port is fixed (restart() comes back there)."""

    proc: subprocess.Popen | None = None
    files: Path  # the folder its config, logs and state live in
    port: int
    port_fixed: bool = False  # True once given or once listened on

    def launch(self) -> None:
        """Start the process and return once it listens on self.port (PortTaken if in use)."""
        raise NotImplementedError

    def start(self):
        for _ in range(5):
            try:
                self.launch()
                break
            except PortTaken:
                if self.port_fixed:
                    raise
                self.port = free_port()
        else:
            raise PortTaken(f"{type(self).__name__}: five free ports in a row were taken before the server bound them")
        self.port_fixed = True
        return self

    def restart(self):
        """Start again on the same port (a dead server's clients reconnect to the same URL)."""
        kill_process(self.proc)
        return self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        kill_process(self.proc)
        shutil.rmtree(self.files, ignore_errors=True)


class MotoServer(ServerProcess):
    """moto's S3-compatible server as a child process on 127.0.0.1:port."""

    def __init__(self, port: int | None = None, log_dir: str | None = None, auth: bool = False):
        self.auth = auth
        self.credentials = (FAKE_AWS_ENV["AWS_ACCESS_KEY_ID"], FAKE_AWS_ENV["AWS_SECRET_ACCESS_KEY"])
        self.port, self.port_fixed = port or free_port(), port is not None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="packer-moto-"))
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def log(self) -> Path:
        return self.log_dir / f"moto-{self.port}.log"

    def start(self) -> "MotoServer":
        super().start()
        if self.auth:
            self.make_user()
        return self

    def launch(self) -> None:
        env = {**os.environ, **FAKE_AWS_ENV}
        if self.auth:  # moto checks keys and signatures once its first requests (ours: a user, a key) are done
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(len(AUTH_SETUP))
        log_from = log_size(self.log)
        with open(self.log, "ab") as log:
            # The objects of a killed server are back before the new one takes a connection.
            self.proc = subprocess.Popen([sys.executable, __file__, "moto", str(self.port), str(self.snapshot_dir)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        wait_listening(self.port, self.proc, "moto's S3 server", self.log, log_from)

    def make_user(self) -> None:
        """With auth: an IAM user allowed all of S3, whose key pair becomes self.credentials."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint_url, region_name=FAKE_AWS_ENV["AWS_DEFAULT_REGION"])
        iam.create_user(UserName="packer")
        key = iam.create_access_key(UserName="packer")["AccessKey"]
        iam.put_user_policy(UserName="packer", PolicyName="s3", PolicyDocument=AUTH_POLICY)
        self.credentials = (key["AccessKeyId"], key["SecretAccessKey"])

    def client(self):
        import boto3  # moto depends on it
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=FAKE_AWS_ENV["AWS_DEFAULT_REGION"],
                            aws_access_key_id=self.credentials[0], aws_secret_access_key=self.credentials[1],
                            config=Config(retries={"max_attempts": 1}))

    @property
    def snapshot_dir(self) -> Path:
        return self.log_dir / "snapshot"

    def take_snapshot(self) -> None:
        """Copy every bucket's objects to snapshot_dir/<bucket>/<quoted key>, for the next start."""
        client = self.client()
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        self.snapshot_dir.mkdir()
        for bucket in client.list_buckets().get("Buckets", []):
            name = bucket["Name"]
            (self.snapshot_dir / name).mkdir()
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
                for item in page.get("Contents", []):
                    data = client.get_object(Bucket=name, Key=item["Key"])["Body"].read()
                    (self.snapshot_dir / name / urllib.parse.quote(item["Key"], safe="")).write_bytes(data)

    def kill(self, keep_objects: bool = True) -> None:
        """SIGKILL the server (after snapshotting its objects, unless keep_objects is False)."""
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        if keep_objects and self.running:
            self.take_snapshot()
        kill_process(self.proc)
        wait_closed(self.port)

    def stop(self, keep_objects: bool = True) -> None:
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        if keep_objects and self.running:
            self.take_snapshot()
        kill_process(self.proc, signal.SIGTERM)
        wait_closed(self.port)

    @property
    def files(self) -> Path:
        return self.log_dir


@dataclass
class S3Bucket:
    """A fresh bucket on a moto server: s3fs.S3FileSystem(**storage_options) reaches it."""

    name: str
    endpoint_url: str
    storage_options: dict = field(default_factory=dict)
    _client: object = field(default=None, init=False, repr=False, compare=False)

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    def client(self):
        """A boto3 client of the bucket's server, made once (making one takes a good part of a CPU second
        under load, and tests that watch an upload list the bucket many times a second)."""
        import boto3
        from botocore.config import Config

        if self._client is None:
            self._client = boto3.client("s3", endpoint_url=self.endpoint_url,
                                        region_name=FAKE_AWS_ENV["AWS_DEFAULT_REGION"],
                                        aws_access_key_id=self.storage_options["key"],
                                        aws_secret_access_key=self.storage_options["secret"],
                                        config=Config(retries={"max_attempts": 1}))
        return self._client

    def keys(self) -> list[str]:
        keys = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.name):
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return sorted(keys)


def storage_options(endpoint_url: str, credentials: tuple[str, str] | None = None) -> dict:
    key, secret = credentials or (FAKE_AWS_ENV["AWS_ACCESS_KEY_ID"], FAKE_AWS_ENV["AWS_SECRET_ACCESS_KEY"])
    return {"key": key, "secret": secret,
            "client_kwargs": {"endpoint_url": endpoint_url, "region_name": FAKE_AWS_ENV["AWS_DEFAULT_REGION"]}}


def new_bucket(endpoint_url: str, credentials: tuple[str, str] | None = None) -> S3Bucket:
    """A fresh bucket; credentials: a key pair the server knows (MotoServer(auth=True).credentials)."""
    bucket = S3Bucket(f"packer-test-{uuid.uuid4().hex[:12]}", endpoint_url, storage_options(endpoint_url, credentials))
    bucket.client().create_bucket(Bucket=bucket.name)
    return bucket


def require_moto() -> None:
    for module in ("moto.server", "boto3", "s3fs"):
        try:
            __import__(module)
        except ImportError as exc:
            pytest.skip(f"the S3 tests need moto[server] and s3fs ({exc}); install them with "
                        "python -m pip install -c lock/test.txt -e '.[test]'")


# fsspec's HTTP filesystem leaves aiohttp's timeout at its default, 5 minutes for a whole
# request: a request stuck on a loopback server would stall the suite that long (and
# packer's retries, one stall per try). No test waits half a minute for a byte on loopback.
HTTP_TIMEOUTS = {"sock_connect": 5, "sock_read": 30}


@pytest.fixture(scope="session", autouse=True)
def bounded_http_waits():
    """HTTP filesystems that fsspec makes without client_kwargs of their own give up on a
    connection after HTTP_TIMEOUTS seconds without progress (a transient error: retried)."""
    try:
        import aiohttp
        import fsspec.config
    except ImportError:
        yield
        return
    before = fsspec.config.conf.get("http")
    fsspec.config.conf["http"] = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, **HTTP_TIMEOUTS)},
                                  **(before or {})}
    yield
    if before is None:
        fsspec.config.conf.pop("http", None)
    else:
        fsspec.config.conf["http"] = before


@pytest.fixture(scope="session")
def fake_aws_env():
    with pytest.MonkeyPatch.context() as patch:
        for name, value in FAKE_AWS_ENV.items():
            patch.setenv(name, value)
        patch.delenv("AWS_PROFILE", raising=False)
        patch.delenv("AWS_SESSION_TOKEN", raising=False)
        patch.setenv("NO_PROXY", ",".join(filter(None, [os.environ.get("NO_PROXY"), HOST])))
        yield


@pytest.fixture(scope="session")
def s3_endpoint(fake_aws_env) -> str:
    """endpoint_url of a moto S3 server shared by the session (do not kill it: see s3_server)."""
    require_moto()
    server = MotoServer().start()
    yield server.endpoint_url
    server.close()


@pytest.fixture
def s3_bucket(s3_endpoint) -> S3Bucket:
    """A fresh, empty bucket on the session's server."""
    return new_bucket(s3_endpoint)


@pytest.fixture
def s3_server(fake_aws_env) -> MotoServer:
    """A moto server for this test alone, to kill (server.kill()) and restart (server.restart())."""
    require_moto()
    server = MotoServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def s3_auth_server(fake_aws_env) -> MotoServer:
    """A moto server that checks credentials: server.credentials are accepted, other keys refused (403).
    Shared by the session (do not kill it); make a bucket of your own on it with new_bucket."""
    require_moto()
    server = MotoServer(auth=True).start()
    yield server
    server.close()


# --- HTTP: nginx ---------------------------------------------------------------------


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                          if os.access(p, os.X_OK)), None)


class NginxServer(ServerProcess):
    """nginx serving root read-only over HTTP on 127.0.0.1:port, from a config in its own
    folder (no daemon, no system paths). limit_rate (bytes/s, per connection) throttles it;
    missing_as answers a missing file with that status (403: as S3 to a reader that may not
    list the bucket)."""

    def __init__(self, root: str | os.PathLike, port: int | None = None, limit_rate: int | None = None,
                 binary: str | None = None, log_requests: bool = False, missing_as: int | None = None):
        self.log_requests, self.missing_as = log_requests, missing_as
        self.binary = binary or nginx_binary()
        if self.binary is None:
            raise FileNotFoundError("nginx is not installed (apt-get install nginx-light)")
        self.root = Path(root).resolve()
        self.port, self.port_fixed = port or free_port(), port is not None
        self.limit_rate = limit_rate
        self.prefix = Path(tempfile.mkdtemp(prefix="packer-nginx-"))
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def url(self, relative: str) -> str:
        return f"{self.base_url}/{relative.lstrip('/')}"

    @property
    def error_log(self) -> Path:
        return self.prefix / "error.log"

    @property
    def access_log(self) -> Path:
        return self.prefix / "access.log"

    def requests(self, at_least: int = 0, timeout: float = 5.0) -> list[dict]:
        """With log_requests: each request served so far, in order: connection (its number),
        nth (requests on that connection so far), status, method, path, range, bytes sent.
        nginx logs a request just after its response is sent: at_least waits for that many."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.logged()
            if len(found) >= at_least or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    def logged(self) -> list[dict]:
        found = []
        if self.access_log.exists():
            for line in self.access_log.read_text().splitlines():
                connection, nth, status, method, path, rest = line.split(" ", 5)
                range_, _, sent = rest.rpartition(" ")
                found.append({"connection": int(connection), "nth": int(nth), "status": int(status), "method": method,
                              "path": path, "range": "" if range_ == '"-"' else range_.strip('"'), "bytes": int(sent)})
        return found

    def config(self) -> str:
        # As root, nginx's workers would drop to nobody, who cannot read a pytest tmp dir.
        user = "user root;" if os.geteuid() == 0 else ""
        temp = "\n".join(f"    {kind}_temp_path {self.prefix}/{kind};"
                         for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        throttle = f"limit_rate {self.limit_rate};" if self.limit_rate else ""
        if self.missing_as:
            throttle += f" try_files $uri ={self.missing_as};"
        access = (f"log_format packer '$connection $connection_requests $status $request_method $uri "
                  f"\"$http_range\" $body_bytes_sent';\n    access_log {self.access_log} packer;"
                  if self.log_requests else "access_log off;")
        return f"""
{user}
worker_processes 2;
pid {self.prefix}/nginx.pid;
error_log {self.error_log} warn;
events {{ worker_connections 256; }}
http {{
    {access}
{temp}
    sendfile on;
    keepalive_requests 100000;
    server {{
        listen {HOST}:{self.port};
        root {self.root};
        location / {{ autoindex off; {throttle} }}
    }}
}}
"""

    def launch(self) -> None:
        conf = self.prefix / "nginx.conf"
        conf.write_text(self.config())
        log_from = log_size(self.error_log)
        with open(self.error_log, "ab") as log:
            self.proc = subprocess.Popen([self.binary, "-p", str(self.prefix), "-e", str(self.error_log),
                                          "-c", str(conf), "-g", "daemon off;"],
                                         stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        wait_listening(self.port, self.proc, "nginx", self.error_log, log_from)

    def kill(self) -> None:
        """SIGKILL nginx and its workers: open connections drop, new ones are refused."""
        kill_process(self.proc)
        wait_closed(self.port)

    @property
    def files(self) -> Path:
        return self.prefix


@pytest.fixture
def nginx():
    """Factory: nginx(root, limit_rate=None, port=None, log_requests=False, missing_as=None) -> a started NginxServer,
    stopped after the test; with log_requests, server.requests() lists what it served."""
    if nginx_binary() is None:
        pytest.skip("nginx is not installed, so the HTTP tests cannot run a server (apt-get install nginx-light; "
                    ".ci/run installs it when run as root)")
    servers = []

    def start(root, limit_rate: int | None = None, port: int | None = None, log_requests: bool = False,
              missing_as: int | None = None) -> NginxServer:
        server = NginxServer(root, port=port, limit_rate=limit_rate, log_requests=log_requests,
                             missing_as=missing_as).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def http_root(tmp_path, nginx) -> tuple[Path, str]:
    """(root_dir, base_url): files written under root_dir are served at base_url/<relative path>."""
    root = tmp_path / "http-root"
    root.mkdir()
    return root, nginx(root).base_url


# --- a slow link: latency and bandwidth between client and server ---------------------


class Link(ServerProcess):
    """A TCP proxy on 127.0.0.1:port to 127.0.0.1:upstream with delay seconds of one-way
    latency and rate bytes/s (each way, shared by all connections): see run_link."""

    def __init__(self, upstream: int, delay: float = 0.010, rate: float = 125e6, port: int | None = None):
        self.upstream, self.delay, self.rate = upstream, delay, rate
        self.port, self.port_fixed = port or free_port(), port is not None
        self.proc: subprocess.Popen | None = None
        self.log = Path(tempfile.mkstemp(prefix="packer-link-", suffix=".log")[1])

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def url(self, relative: str) -> str:
        return f"{self.base_url}/{relative.lstrip('/')}"

    def launch(self) -> None:
        log_from = log_size(self.log)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, __file__, "link", str(self.port), str(self.upstream),
                                          repr(self.delay), repr(self.rate)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        wait_listening(self.port, self.proc, "the link proxy", self.log, log_from)

    def close(self) -> None:
        kill_process(self.proc)
        self.log.unlink(missing_ok=True)


@pytest.fixture
def link():
    """Factory: link(upstream_port, delay=0.010, rate=125e6) -> a started Link, closed after the test."""
    links = []

    def start(upstream: int, delay: float = 0.010, rate: float = 125e6) -> Link:
        started = Link(upstream, delay, rate).start()
        links.append(started)
        return started

    yield start
    for started in links:
        started.close()


CHUNK = 256 << 10
IN_FLIGHT = 64  # chunks queued per direction of a connection: 16 MiB, over a 1 Gbit/s x 20 ms link's 2.5 MB


def run_link(port: int, upstream: int, delay: float, rate: float) -> None:
    """Serve the link until killed. A chunk read from one side leaves when the link (one per
    direction, shared by every connection) has sent what was queued before it, taking
    len/rate seconds, and is written to the other side delay seconds after it left."""
    import asyncio

    free_at = {"up": 0.0, "down": 0.0}  # when each direction of the link is next idle

    async def pipe(reader, writer, direction: str) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(IN_FLIGHT)

        async def send() -> None:
            while True:
                arrival, data = await queue.get()
                if data is None:
                    break
                wait = arrival - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.write_eof()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                leaves = max(loop.time(), free_at[direction]) + len(data) / rate
                free_at[direction] = leaves
                await queue.put((leaves + delay, data))
        except OSError:
            pass
        await queue.put((0.0, None))
        with contextlib.suppress(OSError):
            await sender

    async def handle(client_reader, client_writer) -> None:
        await asyncio.sleep(2 * delay)  # the handshake's round trip
        try:
            server_reader, server_writer = await asyncio.open_connection(HOST, upstream)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer, "up"), pipe(server_reader, client_writer, "down"),
                             return_exceptions=True)
        for writer in (client_writer, server_writer):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, HOST, port, reuse_address=True, backlog=512)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# --- servers that accept and then do not answer ----------------------------------------


class StallingServer(ServerProcess):
    """A TCP server on 127.0.0.1:port that accepts every connection and reads the request, then
    answers never (mode "silent") or an HTTP response one byte a second ("trickle"), so no
    socket read timeout ever fires: see run_stalling."""

    def __init__(self, mode: str):
        self.mode = mode
        self.port, self.port_fixed = free_port(), False
        self.proc: subprocess.Popen | None = None
        self.log = Path(tempfile.mkstemp(prefix="packer-stall-", suffix=".log")[1])

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def launch(self) -> None:
        log_from = log_size(self.log)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, __file__, "stall", str(self.port), self.mode],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        wait_listening(self.port, self.proc, f"the {self.mode} server", self.log, log_from)

    def accepted(self) -> int:
        """Connections accepted so far (one line each in the log)."""
        return self.log.read_text().count("accepted")

    def close(self) -> None:
        kill_process(self.proc)
        self.log.unlink(missing_ok=True)


@pytest.fixture
def stalling():
    """Factory: stalling("silent" | "trickle") -> a started StallingServer, closed after the test."""
    servers = []

    def start(mode: str) -> StallingServer:
        started = StallingServer(mode).start()
        servers.append(started)
        return started

    yield start
    for started in servers:
        started.close()


TRICKLE = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"x" * 100000  # a header that never ends


def run_stalling(port: int, mode: str) -> None:
    """Accept until killed; each connection gets silence, or TRICKLE at one byte a second."""
    import asyncio

    async def serve(reader, writer):
        print("accepted", flush=True)
        try:
            await reader.read(65536)
            if mode == "silent":
                await asyncio.sleep(3600)
            for i in range(len(TRICKLE)):
                writer.write(TRICKLE[i:i + 1])
                await writer.drain()
                await asyncio.sleep(1.0)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def main():
        server = await asyncio.start_server(serve, HOST, port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def run_moto(port: int, snapshot: Path) -> None:
    """moto's S3 server on port, holding the objects snapshot/<bucket>/<quoted key> from the start."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import main

    if snapshot.is_dir():
        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        for bucket in sorted(snapshot.iterdir()):
            backend.create_bucket(bucket.name, FAKE_AWS_ENV["AWS_DEFAULT_REGION"])
            for item in sorted(bucket.iterdir()):
                backend.put_object(bucket.name, urllib.parse.unquote(item.name), item.read_bytes())
    main(["-H", HOST, "-p", str(port)])


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "link":
    run_link(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "stall":
    run_stalling(int(sys.argv[2]), sys.argv[3])
if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "moto":
    run_moto(int(sys.argv[2]), Path(sys.argv[3]))
