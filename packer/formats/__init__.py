"""The packed formats: each module owns one on-disk layout (writer, reader, detect)."""
from __future__ import annotations

import os

from ..errors import FormatError
from ..remote import source as remote_source
from ..remote.errors import DENIED
from ..remote.manifest import MANIFEST, parse_manifest
from . import hdf5, lmdb, wds
from ._contract import Format, Option, parse_size
from ._io import CAN_ADVISE, evict, will_need  # page-cache control, for tools that read packed files themselves

# One entry per format (its module's FORMAT); the key is the CLI spelling (--to lmdb).
FORMATS: dict[str, Format] = {module.FORMAT.name: module.FORMAT for module in (lmdb, hdf5, wds)}
# Every spelling --to accepts, aliases included (h5, webdataset, ...), to its format's name.
FORMAT_SPELLINGS: dict[str, str] = {spelling: f.name for f in FORMATS.values() for spelling in (f.name, *f.aliases)}


__all__ = ["CAN_ADVISE", "FORMATS", "FORMAT_SPELLINGS", "Format", "Option", "ReaderCache", "default_output",
           "detect_format", "evict", "format_named", "open_reader", "parse_size", "read_metadata", "will_need"]


def format_named(name: str) -> Format:
    """The Format called name (the CLI's --to, an alias too), or a PackError listing the ones there are."""
    if name.lower() not in FORMAT_SPELLINGS:
        raise FormatError(f"{name!r} is not a format; choose one of: {spellings()}")
    return FORMATS[FORMAT_SPELLINGS[name.lower()]]


def spellings() -> str:
    """The formats and their aliases, for help and errors: 'lmdb (mdb), hdf5 (h5, hdf), ...'."""
    return ", ".join(f"{f.name} ({', '.join(f.aliases)})" if f.aliases else f.name for f in FORMATS.values())


def detect_format(path: str | os.PathLike, **remote) -> str:
    """The name of the format stored at path (a URL too: remote as for open_reader)."""
    path = os.fspath(path)
    if remote_source.is_url(path):
        return detect_remote(path, remote_source.remote_for(path, **remote))
    if not os.path.exists(path):
        raise FormatError(f"{path}: no such file or folder", path)
    for name, fmt in FORMATS.items():
        if fmt.detect(path):
            return name
    raise FormatError(f"{path}: not a packed dataset (expected one of: {', '.join(FORMATS)}; "
                      "create one with `packer pack SRC --to FORMAT`)", path)


# What marks each format at a URL, where nothing can be listed: a file inside the folder
# (LMDB, WDS) or the file's own signature (HDF5). The extension is tried first.
REMOTE_MARKS = (("lmdb", "data.mdb"), ("wds", "index.json"), ("hdf5", None))


def detect_remote(url: str, remote) -> str:
    """The name of the format stored at url: its packer.json's (the manifest packer's upload
    writes last, checked), else by a HEAD (or an 8-byte read) per format tried, for a
    dataset copied by hand."""
    url = url.rstrip("/")
    # S3 answers 403, not 404, for a missing key to a reader not allowed to list the bucket
    # (a public bucket, a CDN): a refused probe is passed over, and raised only if no probe finds one.
    refused = None
    try:
        return parse_manifest(remote.read_object(remote_source.join(url, MANIFEST), 64 << 20), url)["format"]
    except remote_source.RemoteError as exc:
        if not (remote_source.missing(exc) or exc.kind == DENIED):
            raise
        refused = exc if exc.kind == DENIED else None
    marks = sorted(REMOTE_MARKS, key=lambda mark: not url.endswith(FORMATS[mark[0]].extension))
    for name, inside in marks:
        try:
            if inside is not None:
                if remote.exists(remote_source.join(url, inside)):
                    return name
            elif remote.exists(url) and remote.open(url).pread(8, 0) == hdf5.HDF5_SIGNATURE:
                return name
        except remote_source.RemoteError as exc:
            if exc.kind != DENIED:
                raise
            refused = refused or exc
    if refused is not None:
        raise refused
    raise FormatError(f"{url}: no packed dataset there (no data.mdb or index.json under it, and not an HDF5 "
                      "file); check the URL, and that the dataset was uploaded whole", url)


def open_reader(path: str | os.PathLike, split: str | None = None, **options):
    """A torch-free Reader for one split of the dataset at path, whatever its format.

    path may be a URL (s3://, gs://, https://): storage_options, cache_dir, cache_limit
    and block_size among options then say how to read it (packer.remote.source.Remote)."""
    path = os.fspath(path)
    remote = {key: options[key] for key in REMOTE_OPTIONS if key in options}
    return FORMATS[detect_format(path, **remote)].Reader(path, split, **options)


REMOTE_OPTIONS = ("storage_options", "cache_dir", "cache_limit", "block_size")


def default_output(src: str, fmt: str) -> str:
    return os.path.abspath(os.fspath(src)).rstrip(os.sep) + FORMATS[fmt].extension


def read_metadata(path: str | os.PathLike, **remote):
    """The Metadata of the dataset at path, whatever its format (a URL too: remote as for
    open_reader)."""
    path = os.fspath(path)
    if remote_source.is_url(path):
        reader = remote_source.remote_for(path, **remote)
        fmt = detect_remote(path, reader)
        if fmt == "lmdb":
            return lmdb.remote_metadata(path, reader)[2]
        if fmt == "hdf5":
            return hdf5.remote_metadata(path, reader)[1]
        return wds.open_index(path, reader)[1]
    return FORMATS[detect_format(path)].read_metadata(path)


class ReaderCache:
    """One dataset's Readers by split, each opened on first use and kept.

    Picklable without its readers, so a pool worker that receives it opens its own once
    and keeps them for all the tasks it runs.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.readers: dict = {}

    def __getitem__(self, split: str):
        reader = self.readers.get(split)
        if reader is None:
            reader = self.readers[split] = open_reader(self.path, split)
        return reader

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers = {}

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.path, self.readers = state["path"], {}
