"""The packed formats: each module owns one on-disk layout (writer, reader, detect)."""
from __future__ import annotations

import os

from ..errors import FormatError
from ..remote import source as remote_source
from ..remote.errors import DENIED
from ..remote.manifest import MANIFEST, parse_manifest
from . import hdf5, lmdb, wds
from ._contract import Format, Option, check_format_named, parse_size
# Page-cache and page control, for tools that read packed files (or hand pages on) themselves.
from ._io import CAN_ADVISE, MADV_REMOVE, advise_pages, evict, will_need
# Whether a dataset file is still the one a reader opened (a pack --force replaces it).
from ._dataset_files import current_identity
from ._reader import SplitReader
from ._tables import replaced_error

# The registry: one entry per format (its module's FORMAT), keyed by the CLI spelling (--to lmdb).
# A new format is one module, one entry here and one line in docs/layout.md's module map
# (docs/formats.md, "Adding a format"); code of your own adds one with FORMATS[name] = its FORMAT.
FORMATS: dict[str, Format] = {"lmdb": lmdb.FORMAT, "hdf5": hdf5.FORMAT, "wds": wds.FORMAT}
# A Reader built directly (packer.formats.lmdb.Reader(path)) refuses metadata naming no format
# in this same dict, formats added to it included: SplitReader sits below the registry, so the
# registry is handed to it here rather than imported there.
SplitReader.formats = FORMATS


__all__ = ["CAN_ADVISE", "FORMATS", "Format", "MADV_REMOVE", "Option", "ReaderCache", "advise_pages",
           "current_identity", "default_output", "detect_format", "evict", "format_named", "open_reader",
           "parse_size", "read_metadata", "replaced_error", "will_need"]


def format_named(name: str) -> Format:
    """The Format called name (the CLI's --to, an alias too), or a PackError listing the ones there are."""
    spelled = name.lower()
    for fmt in FORMATS.values():
        if spelled == fmt.name or spelled in fmt.aliases:
            return fmt
    raise FormatError(f"{name!r} is not a format; choose one of: {spellings()}")


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


def detect_remote(url: str, remote) -> str:
    """The name of the format stored at url: its packer.json's (the manifest packer's upload
    writes last, checked), else by each format's mark (Format.entry, a HEAD; Format.signature,
    a read of its first bytes), for a dataset copied by hand; the format whose extension url
    ends with is tried first, then entry files before signatures."""
    url = url.rstrip("/")
    # S3 answers 403, not 404, for a missing key to a reader not allowed to list the bucket
    # (a public bucket, a CDN): a refused probe is passed over, and raised only if no probe finds one.
    refused = None
    try:
        raw = remote.read_object(remote_source.join(url, MANIFEST), 64 << 20)
        return parse_manifest(raw, url, folder_formats())["format"]
    except remote_source.RemoteError as exc:
        if not (remote_source.missing(exc) or exc.kind == DENIED):
            raise
        refused = exc if exc.kind == DENIED else None
    for fmt in sorted(FORMATS.values(), key=lambda fmt: (not url.endswith(fmt.extension), fmt.entry is None)):
        try:
            if marked(fmt, url, remote):
                return fmt.name
        except remote_source.RemoteError as exc:
            if exc.kind != DENIED:
                raise
            refused = refused or exc
    if refused is not None:
        raise refused
    entries = " or ".join(fmt.entry for fmt in FORMATS.values() if fmt.entry)
    files = " or ".join(fmt.held_as for fmt in FORMATS.values() if fmt.signature)
    raise FormatError(f"{url}: no packed dataset there (no {entries} under it, and not {files}); check the URL, "
                      "and that the dataset was uploaded whole", url)


def marked(fmt: Format, url: str, remote) -> bool:
    """Whether url bears fmt's mark: its entry file inside, or its signature at the start."""
    if fmt.entry is not None:
        return remote.exists(remote_source.join(url, fmt.entry))
    if fmt.signature is not None:
        return remote.exists(url) and remote.open(url).pread(len(fmt.signature), 0) == fmt.signature
    return False


def folder_formats() -> list[str]:
    """The formats whose remote datasets carry a manifest: folders (a one-file format is one object)."""
    return [fmt.name for fmt in FORMATS.values() if fmt.directory]


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
        meta = FORMATS[detect_remote(path, reader)].read_url(path, reader)[0]
    else:
        meta = FORMATS[detect_format(path)].read_metadata(path)
    check_format_named(meta, path, FORMATS)
    return meta


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
