"""Writing a dataset to object storage (s3://...) with the guarantee a local write has:
nothing at OUT looks like a dataset until it is complete, and a failed write leaves nothing.

A remote dataset at OUT (http(s):// URLs are read-only) is these objects:

  hdf5   the one object OUT                                      (entry: OUT itself)
  lmdb   OUT/data.mdb, OUT/packer.json                           (entry: OUT/data.mdb)
  wds    OUT/index.json, OUT/<split>/shard-NNNNNN.tar,           (entry: OUT/index.json)
         OUT/<split>/records.bin, paths.bin, path_offsets.bin, wids-index.json,
         order.bin,
         OUT/packer.json

OUT/packer.json, for the folder formats, is the completion marker and the manifest,
written last (packer.remote.manifest). A dataset is complete when its
packer.json exists; one copied by hand (a local pack synced to a bucket, or served by a web
server) has none and is known by its entry object, which this writer never leaves at OUT
without the rest. An object whose name holds `.partial-` is a write in progress: never
read it.

How a write goes (packer.destination.StoreDestination, upload_dataset):
1. Check OUT before packing: a writable URL naming a key, the bucket there and the
   credentials accepted (a probe object written into the staging prefix), OUT absent, or
   with --force a dataset packer wrote (packer.replaceable; here: its metadata checked and
   no object under OUT/ that its packer.json, or its format, does not name). Settle what dead writers left (below).
2. Pack into a local staging folder (staging_dir, default $TMPDIR) as a local pack does.
3. Upload every file to the staging prefix OUT.partial-<host>-<pid>-<token>/ beside OUT
   (fsspec put: multipart for large files, several files at once), packer.json last.
4. Publish, by server-side copies: when replacing, first delete OUT's packer.json and entry
   object (the old dataset stops being one), then its other objects; copy the data
   objects, then the entry object, then packer.json. An hdf5 dataset is one copy, atomic.
5. Delete the staging prefix.
On an error or Ctrl-C before publishing, the staging prefix is deleted and OUT is as it
was. One during publishing a new OUT deletes what was copied; one while replacing keeps the
complete staging (the old dataset is gone by then) and says to run again. A process killed
outright cleans nothing: the next write to OUT from the same host removes a dead writer's
staging prefix, or, when its staging was complete (holds packer.json, or is an hdf5
object) and OUT is not a dataset, publishes it first (finishing the interrupted swap).
Leftovers of other hosts are left alone, with a note.

Every request goes through packer.remote.retry: transient errors are retried with backoff,
others become a RemoteError naming the URL and what to check.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import posixpath
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import replaceable
from .engine import STOP_LOOK_S, stop_signals_deferred
from .errors import FormatError, PackError
from .formats import FORMATS, detect_remote, folder_formats
from .interrupts import Interrupted
from .remote import is_url, manifest, parse_url
from .remote import source as remote_source
from .remote.errors import MISSING, NO_BUCKET, RemoteError, endpoint_of
from .remote.manifest import MANIFEST, MANIFEST_LIMIT, manifest_bytes, safe_key
from .remote.retry import DEADLINE, MIN_RATE, RETRIES, bounded, split_deadline, with_retries
from .remote.schemes import Scheme, scheme_for
from .remote.source import one_attempt
from .staging import OWNED, PARTIAL, Leftover, Owner, new_owner

PROBE = ".writing"  # the first object of a staging prefix: proves the bucket takes writes
THREADS = 8  # objects uploaded or copied at once
PART_SIZE = 64 << 20  # multipart parts of a large object (S3: at least 5 MiB, at most 10,000 parts)
EXTRA = "packer[remote]"


@dataclass
class Target:
    """A remote OUT: its URL, the fsspec filesystem and the path in it, and how to retry."""

    url: str
    fs: object
    path: str  # bucket/key, as fsspec names it
    storage_options: dict
    retries: int = RETRIES
    deadline: float = DEADLINE

    def call(self, what: str, fn: Callable, doing: str = "writing", size: int = 0, request: str = ""):
        """fn(seconds left), retried (packer.remote.retry) within the deadline, a second more
        per MIN_RATE bytes of size moved, in a worker thread: see run_all."""
        def attempt():
            return with_retries(what, fn, self.retries, doing, self.storage_options,
                                deadline=self.deadline + size / MIN_RATE, what=request)

        if threading.current_thread() is not threading.main_thread():
            return attempt()
        result = []
        run_all([lambda: result.append(attempt())])
        return result[0]

    def run(self, path: str, method: str, *args, doing: str = "writing", size: int = 0, **kwargs):
        """self.fs.method(*args, **kwargs) on the object at path, as call() makes it: each
        attempt bounded by the time left."""
        fn = getattr(self.fs, method)
        return self.call(self.url_of(path), lambda timeout: fn(*args, **kwargs, **bounded(self.fs, timeout)),
                         doing, size, f"({method})")

    def url_of(self, path: str) -> str:
        return f"{parse_url(self.url).scheme}://{path}"

    @property
    def scheme(self) -> Scheme:
        """What OUT's scheme supports (packer.remote.schemes)."""
        return scheme_for(parse_url(self.url).scheme)


def filesystem(url: str, storage_options: dict | None):
    """(fsspec filesystem, path) for url; s3 requests get one attempt each from botocore,
    since packer's retry policy (packer.remote.retry) is the one that retries."""
    try:
        import fsspec.core
    except ImportError as exc:
        raise PackError(f"{url}: writing to object storage needs fsspec and s3fs: pip install '{EXTRA}'",
                        url) from exc
    try:
        return fsspec.core.url_to_fs(url, **one_attempt(url, storage_options))
    except ImportError as exc:
        raise PackError(f"{url}: writing there needs a package packer's remote extra installs ({exc}): "
                        f"pip install '{EXTRA}'", url) from exc


GLOB_CHARACTERS = "*?[]"


def open_target(url: str, storage_options: dict | None = None, retries: int = RETRIES) -> Target:
    """The Target for OUT url, or a PackError saying why packer cannot write there."""
    if not is_url(url):
        raise PackError(f"{url}: not a URL (s3://bucket/key)", url)
    parsed = parse_url(url)
    if not scheme_for(parsed.scheme).writable:
        raise PackError(f"{url}: {parsed.scheme}:// URLs are read-only (a web server takes no uploads); write to "
                        "s3://bucket/key, or pack locally and serve the folder", url)
    if not parsed.key or any(part in ("", ".", "..") for part in parsed.key.split("/")):
        raise PackError(f"{url}: name the dataset inside the bucket, e.g. {parsed.scheme}://{parsed.bucket}/"
                        "imagenet.lmdb", url)
    if ".partial-" in parsed.key:
        raise PackError(f"{url}: names with '.partial-' are reserved for uploads in progress; choose another", url)
    glob = sorted(set(GLOB_CHARACTERS) & set(parsed.key))
    if glob:  # fsspec's rm, copy and find take them as patterns: a write would reach other datasets' objects
        raise PackError(f"{url}: the name holds {' '.join(glob)}, which object-store tools read as wildcards "
                        "(removing or replacing it could reach other keys); choose a name without * ? [ ]", url)
    url = str(parsed)
    deadline, storage_options = split_deadline(storage_options)
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache()  # fsspec reuses a filesystem per options: forget listings an earlier write saw
    if hasattr(fs, "retries") and isinstance(fs.retries, int):
        fs.retries = 1  # s3fs retries timeouts itself: leave retrying to packer.remote.retry
    return Target(url, fs, path.rstrip("/"), storage_options, retries, deadline)


# --- what is at OUT ------------------------------------------------------------------


def check_bucket(target: Target) -> None:
    """Fail now, before packing, if the bucket is missing or the credentials are refused."""
    bucket = target.path.split("/", 1)[0]
    if not target.scheme.bucket_check:
        return
    try:
        target.call(target.url, lambda timeout: target.fs.call_s3("head_bucket", Bucket=bucket,
                                                                  **bounded(target.fs, timeout)))
    except RemoteError as exc:
        if exc.kind in (MISSING, NO_BUCKET):  # HEAD has no body: a 404 is all S3 says
            where = endpoint_of(target.storage_options)
            raise RemoteError(f"{target.url}: the bucket {bucket} does not exist at {where}: check the bucket name "
                              "and the endpoint_url (packer writes into an existing bucket; create it first)",
                              target.url, NO_BUCKET) from exc
        raise


def exists(target: Target, path: str) -> bool:
    return bool(target.run(path, "exists", path))


def is_file(target: Target, path: str) -> bool:
    return bool(target.run(path, "isfile", path))


def remote_dataset(target: Target, path: str | None = None) -> str | None:
    """The format of the complete dataset at path (default OUT), or None if there is none, as
    readers detect it (packer.formats.detect_remote): its packer.json, else its entry object (a
    dataset copied by hand), else a one-file format's object, by its signature."""
    url = target.url_of(path or target.path)
    try:
        return detect_remote(url, remote_source.remote_for(url, storage_options=target.storage_options))
    except FormatError:
        return None


def as_object(fmt) -> str:
    """A one-file format's held_as at a URL: "an HDF5 object", where a local one is "an HDF5 file"."""
    return fmt.held_as.rsplit(" ", 1)[0] + " object"


def parse_manifest(raw: bytes, url: str) -> dict:
    """packer.remote.manifest.parse_manifest, taking the folder formats registered now."""
    return manifest.parse_manifest(raw, url, folder_formats())


def read_manifest(target: Target, path: str) -> dict | None:
    """path/packer.json, checked, or None where there is none."""
    where = f"{path}/{MANIFEST}"
    if not is_file(target, where):
        return None
    raw = target.run(where, "cat_file", where, start=0, end=MANIFEST_LIMIT + 1, doing="reading")
    return parse_manifest(raw, target.url_of(where))


def refuse_existing(target: Target, force: bool, notes: list[str] = ()) -> None:
    """As packer.output.refuse_existing: no OUT without force, and force replaces only a dataset."""
    replaceable.refuse_existing(target.url, exists(target, target.path), force, lambda: replace_problem(target),
                                "objects", notes)


def replace_problem(target: Target) -> str | None:
    """What keeps the objects at OUT from being a dataset packer wrote, as packer.replaceable
    asks of a local one, or None: its metadata read back checked, and under OUT/ no object
    but those its packer.json (or, copied by hand, its format) names."""
    fmt = remote_dataset(target)
    found = target.call(target.url, lambda timeout: target.fs.find(target.path + "/", **bounded(target.fs, timeout)),
                        doing="reading")
    under = sorted(path[len(target.path) + 1:] for path in found if path.startswith(target.path + "/"))
    if fmt is None:
        kinds = " or ".join(fmt.title for fmt in FORMATS.values() if fmt.signature is not None)
        held = f"holds {replaceable.listing(under)}" if under else f"is an object that is not {kinds}"
        entries = [MANIFEST, *(fmt.entry for fmt in FORMATS.values() if fmt.entry is not None)]
        return f"{held}, with no {', '.join(entries[:-1])} or {entries[-1]}"
    found = FORMATS[fmt]
    if not found.directory and under:  # an object at OUT and others under OUT/: a replace would delete those
        shown = replaceable.listing([target.url_of(f"{target.path}/{name}") for name in under])
        return f"is {as_object(found)} with other objects under its name too ({shown}), which packer did not write"
    what = found.held_as if found.directory else as_object(found)
    remote = remote_source.remote_for(target.url, storage_options=target.storage_options)
    try:
        meta, allowed = found.read_url(target.url, remote)
    except PackError as exc:
        return f"holds {what} without valid packer metadata ({exc})"
    listed = read_manifest(target, target.path)
    if listed is not None:
        allowed = {*listed["objects"], MANIFEST}
    return replaceable.metadata_problem(meta, fmt, what) or replaceable.unexpected(
        [target.url_of(f"{target.path}/{name}") for name in under if name not in allowed], fmt)


# --- leftovers of dead writers ---------------------------------------------------------


def stagings(target: Target) -> list[Leftover]:
    """The staging prefixes beside OUT, whoever left them."""
    parent, name = posixpath.split(target.path)
    if target.scheme.listing == "delimiter":
        bucket, _, key = target.path.partition("/")
        prefix = key + ".partial-"
        found = []
        for page in target.call(target.url, lambda timeout: list_prefixes(target, bucket, prefix, timeout),
                                doing="reading", request="(a listing of staging prefixes)"):
            found.append(f"{bucket}/{page.rstrip('/')}")
    else:
        found = [path.rstrip("/") for path in
                 target.run(target.path, "glob", f"{target.path}.partial-*", doing="reading")]
    result = []
    for path in found:
        rest = posixpath.basename(path)[len(name):]
        match = OWNED.fullmatch(rest)
        if match and match["stage"] == PARTIAL and posixpath.dirname(path) == parent:
            result.append(Leftover(path, PARTIAL, match["host"], int(match["pid"])))
    return result


def list_prefixes(target: Target, bucket: str, prefix: str, timeout: float) -> list[str]:
    """The 'folders' under bucket/prefix* (one level), by S3's delimiter listing, within timeout seconds."""
    found, token = [], None
    ends = time.monotonic() + timeout
    while True:
        kwargs = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
        if token:
            kwargs["ContinuationToken"] = token
        page = target.fs.call_s3("list_objects_v2", **kwargs, **bounded(target.fs, ends - time.monotonic()))
        found.extend(item["Prefix"] for item in page.get("CommonPrefixes", []))
        if not page.get("IsTruncated"):
            return found
        token = page.get("NextContinuationToken")


def staged_dataset(target: Target, stage: str) -> tuple[str, dict] | None:
    """(format, objects) of a complete staging prefix, or None if its upload did not finish."""
    found = read_manifest(target, stage)
    if found is not None:
        return found["format"], found["objects"]
    single = f"{stage}/{posixpath.basename(target.path)}"  # a one-file format's object appears whole, or not at all
    fmt = remote_dataset(target, single)
    return (fmt, {}) if fmt is not None and not FORMATS[fmt].directory else None


def tidy(target: Target) -> tuple[list[str], list[str]]:
    """Settle what dead writers left beside OUT; (URLs removed, notes for the user)."""
    removed, notes = [], []
    found = stagings(target)
    notes.extend(f"left {target.url_of(stage.path)} alone: it belongs to a pack on host {stage.host} "
                 f"(pid {stage.pid}); if no pack to {target.url} is running there, delete it"
                 for stage in found if not stage.here)
    gone = [stage for stage in found if stage.owner_gone()]
    if gone and remote_dataset(target) is None:
        for stage in gone:
            staged = staged_dataset(target, stage.path)
            if staged is not None:
                publish(target, stage.path, staged[0], staged[1], replacing=exists(target, target.path))
                notes.append(f"finished writing {target.url}: published the complete upload "
                             f"{target.url_of(stage.path)}, left by an interrupted pack")
                break
    for stage in gone:
        remove(target, stage.path)
        removed.append(target.url_of(stage.path))
    return removed, notes


# --- upload and publish --------------------------------------------------------------


def remove(target: Target, path: str) -> None:
    """Delete path and everything under it, if there is anything."""
    def rm(timeout: float):
        with contextlib.suppress(FileNotFoundError):
            target.fs.rm(path, recursive=True, **bounded(target.fs, timeout))
        target.fs.invalidate_cache(path)

    target.call(target.url_of(path), rm)
    if exists(target, path):  # S3 lists are consistent, but a store that is not says so here
        target.call(target.url_of(path), rm)


def local_files(local: str) -> dict[str, str]:
    """{key relative to the dataset: local file} of the dataset at local (a file or a folder)."""
    if os.path.isfile(local):
        return {"": local}
    files = {}
    for folder, dirnames, filenames in os.walk(local):
        dirnames.sort()
        for filename in sorted(filenames):
            path = os.path.join(folder, filename)
            key = os.path.relpath(path, local).replace(os.sep, "/")
            if os.path.islink(path) or not os.path.isfile(path) or not safe_key(key):
                raise PackError(f"{path}: not a file packer writes into a dataset; cannot upload {local}", path)
            files[key] = path
    return files


def ordered(fmt: str, keys) -> list[str]:
    """Data objects first, the entry object last: a reader that finds the entry finds the rest."""
    entry = FORMATS[fmt].entry
    return sorted(keys, key=lambda key: (key == entry, key))


def run_all(jobs: list[Callable[[], None]]) -> None:
    """Run jobs THREADS at a time in worker threads; the first error cancels what has not
    started and is raised once the running ones end.

    Every request runs in a worker thread, never in the main thread (Target.call): a Ctrl-C
    there would stop only the waiting, and fsspec would finish a request it had started
    after the clean-up. Leaving the pool waits for those, so the clean-up comes after them.
    """
    if not jobs:
        return
    with concurrent.futures.ThreadPoolExecutor(min(THREADS, len(jobs)), thread_name_prefix="packer-upload") as pool:
        futures = submitted(pool, jobs)
        try:
            pending = set(futures)
            while pending:
                pending = settle(pending)
        except BaseException:
            cancel(futures)
            raise


# The pool's submit, a future's wait and result, and its cancel each take a lock the pool's
# threads need: a Ctrl-C or SIGTERM raised just after one is taken would leave it held, and
# leaving the pool would wait forever. Each runs with stop signals held off (packer.engine).

def submitted(pool: concurrent.futures.Executor, jobs: list) -> list:
    with stop_signals_deferred():
        return [pool.submit(job) for job in jobs]


def settle(pending: set) -> set:
    """The futures of pending still running after STOP_LOOK_S at most; a failed one's error is raised."""
    with stop_signals_deferred():
        done, left = concurrent.futures.wait(pending, STOP_LOOK_S, concurrent.futures.FIRST_EXCEPTION)
        for future in done:
            future.result()
    return left


def cancel(futures: list) -> None:
    with stop_signals_deferred():
        for future in futures:
            future.cancel()


def upload(target: Target, local: str, fmt: str, stage: str) -> dict[str, int]:
    """Put the dataset at local under stage, packer.json last; the manifest's objects."""
    files = local_files(local)
    if not FORMATS[fmt].directory or "" in files:
        key = posixpath.basename(target.path)
        put(target, files[""], f"{stage}/{key}")
        return {}
    objects = {key: os.path.getsize(path) for key, path in files.items()}
    keys = ordered(fmt, objects)
    entry = FORMATS[fmt].entry
    run_all([lambda key=key: put(target, files[key], f"{stage}/{key}") for key in keys if key != entry])
    if entry in files:
        put(target, files[entry], f"{stage}/{entry}")
    put_bytes(target, f"{stage}/{MANIFEST}", manifest_bytes(fmt, objects))
    return objects


def put(target: Target, local: str, path: str) -> None:
    """Upload one file: on S3 in one PUT below two parts' size, else as a multipart upload
    (s3fs aborts it on failure, so no parts are left behind)."""
    size = os.path.getsize(local)
    options = {"chunksize": part_size(size)} if target.scheme.multipart else {}
    target.run(path, "put_file", local, path, size=size, **options)


def part_size(size: int) -> int:
    """PART_SIZE, or larger where the object needs more than S3's 10,000 parts."""
    return max(PART_SIZE, -(-size // 10_000))


def put_bytes(target: Target, path: str, data: bytes) -> None:
    target.run(path, "pipe_file", path, data, size=len(data))


def copy(target: Target, source: str, path: str, size: int = 0) -> None:
    target.run(path, "copy", source, path, size=size)


def publish(target: Target, stage: str, fmt: str, objects: dict[str, int], replacing: bool) -> None:
    """Copy the complete upload at stage into OUT, entry object and packer.json last (step 4)."""
    out = target.path
    if replacing:
        remove_old(target, keep_object=not FORMATS[fmt].directory)
    if not FORMATS[fmt].directory:  # one copy: the object at OUT is the old one or the new one, never neither
        single = f"{stage}/{posixpath.basename(out)}"
        copy(target, single, out, target.run(single, "size", single, doing="reading"))
        return
    entry = FORMATS[fmt].entry
    keys = ordered(fmt, objects)
    run_all([lambda key=key: copy(target, f"{stage}/{key}", f"{out}/{key}", objects[key])
             for key in keys if key != entry])
    if entry in objects:
        copy(target, f"{stage}/{entry}", f"{out}/{entry}", objects[entry])
    copy(target, f"{stage}/{MANIFEST}", f"{out}/{MANIFEST}")


def remove_old(target: Target, keep_object: bool) -> None:
    """Delete the dataset at OUT, packer.json and entry object first so that it stops being
    one at once; keep_object keeps an object at OUT itself (a copy is about to replace it)."""
    out = target.path
    for first in (MANIFEST, *(fmt.entry for fmt in FORMATS.values() if fmt.entry is not None)):
        delete_object(target, f"{out}/{first}")
    rest = target.run(out, "find", out + "/", doing="reading")
    if rest:
        target.run(out, "rm", rest)
    if not keep_object:
        delete_object(target, out)
    target.fs.invalidate_cache(out)


def delete_object(target: Target, path: str) -> None:
    """Delete one object if it is there (deleting a missing key is no error in S3)."""
    def rm(timeout: float):
        with contextlib.suppress(FileNotFoundError):
            target.fs.rm_file(path, **bounded(target.fs, timeout))

    target.call(target.url_of(path), rm)


def upload_dataset(local: str, url: str, fmt: str, *, force: bool = False, storage_options: dict | None = None,
                   retries: int = RETRIES, target: Target | None = None, checked: bool = False) -> list[str]:
    """Publish the local dataset at local (format fmt) at url with the guarantee of the module
    docstring; the notes for the user (leftovers settled). checked: the caller has just
    checked the bucket and OUT and settled the leftovers (packer.destination.StoreDestination)."""
    target = target or open_target(url, storage_options, retries)
    owner = new_owner()
    stage = owner.path(target.path, PARTIAL)
    removed, notes = [], []
    if not checked:
        check_bucket(target)
        removed, notes = tidy(target)
        refuse_existing(target, force, notes)
    published = False
    try:
        put_bytes(target, f"{stage}/{PROBE}", owner_note(owner))
        objects = upload(target, local, fmt, stage)
        refuse_existing(target, force)  # it may have appeared while we were uploading
        replacing = exists(target, target.path)
        published = replacing  # from the first deletion on, the old dataset is gone: keep the upload
        try:
            publish(target, stage, fmt, objects, replacing)
        except BaseException:
            if not replacing:
                with contextlib.suppress(Exception):
                    remove(target, target.path)
            raise
        published = False
        remove(target, stage)
    except BaseException as exc:
        if published:
            raise interrupted_swap(target, stage, exc) from exc
        with contextlib.suppress(Exception):
            remove(target, stage)
        raise
    return [f"removed {url}, left by an interrupted pack" for url in removed] + notes


def interrupted_swap(target: Target, stage: str, exc: BaseException) -> BaseException:
    """The error for a replace cut short: the new dataset is whole in the staging prefix."""
    again = (f"{target.url}: replacing the dataset was cut short ({type(exc).__name__}); the new one is complete "
             f"at {target.url_of(stage)}, and running the same command again from this host finishes it")
    if isinstance(exc, KeyboardInterrupt):
        return SwapInterrupted(target.url, again, getattr(exc, "signum", signal.SIGINT))
    return PackError(f"{again} ({exc})", target.url)


class SwapInterrupted(Interrupted):
    """Ctrl-C or SIGTERM while replacing a remote dataset: the old one is gone, the new one is staged."""

    def __init__(self, out: str, message: str, signum: int = signal.SIGINT):
        KeyboardInterrupt.__init__(self, message)
        self.out, self.signum = out, int(signum)


def owner_note(owner: Owner) -> bytes:
    return json.dumps({"host": owner.host, "pid": owner.pid, "token": owner.token}).encode()
