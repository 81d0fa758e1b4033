"""What a format module provides, written down once: every module in packer.formats ends
with a FORMAT = Format(...) that fills all of it, and pack, convert, merge, verify, info,
the CLI, detection, --force, remote upload and readers' Datasets use nothing else of it.
The registry, packer.formats.FORMATS, is one dict literal: {name: FORMAT}.

The Reader(path, split=None, check_crc=True, **remote) a format provides reads one split
by index: packer.formats._reader.SplitReader is its base (count, split choice, checksum
kind, identity of the dataset file); the format adds _open/_close (its handle, opened
lazily in each process), labels, paths and read_record(i) -> (bytes, label), calling
check_data (or checking record_digest itself) unless check_crc is off.

The Writer protocol a format implements (pack() drives it, in this order):
  Writer(stage, options)        stage: the path to write (a folder made for DIRECTORY
                                formats, a file path otherwise); options: writer_options()
  begin_split(name, expected_count=None)  before a split's first record; expected_count:
                                the records pack() will add at most (fewer when files are
                                skipped), for writers that size their output by it (wds'
                                auto shard size); None when unknown
  add(data, label, relpath, crc)  each record, in the order it is stored
  end_split(labels, paths, order=None)  labels/paths in ImageFolder order; order[j], only
                                when the split was written shuffled, is the ImageFolder
                                rank of the j-th record added
  finish(metadata)              the dataset is complete (then published at OUT)
  abort()                       writing failed or was interrupted (the stage is removed)
A Writer may also have `warnings`, a list of strings pack() adds to PackResult.warnings
after the last split (the CLI prints each as `warning: ...`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import FormatError, PackError

SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes in `1GB`, `256MB`, `512KB` (powers of 1000), `1GiB` (powers of 1024) or `4096`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: use a byte count or a number with one of "
                         "KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")
    size = int(float(match.group(1)) * SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return size


def positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{value!r} is not a positive integer")
    return value


def check_format_named(meta, where: str, formats: dict) -> None:
    """Refuse metadata whose format names none of formats (the registry): packer.records checks
    only the name's form, since it sits below the formats."""
    if meta.format not in formats:
        raise FormatError(f"{where}: bad packer metadata: format is {meta.format!r}, not one of {', '.join(formats)}; "
                          "the dataset is damaged or was not written by packer, re-pack it from its source", where)


@dataclass(frozen=True)
class Option:
    """One writer option: its keyword (the CLI spells it --shard-size for shard_size), how a
    given value is parsed and checked (ValueError with the reason), its default (None: not
    set), and one line of help."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Format:
    """A packed format: its name (the CLI's --to), where it writes, what it can do, and its parts."""

    name: str
    extension: str  # appended to SRC for the default OUT
    aliases: tuple[str, ...]  # other spellings --to accepts (the names users know it by)
    directory: bool  # OUT is a folder (else one file)
    Writer: type
    Reader: type  # Reader(path, split=None, check_crc=True): one split, random access
    detect: Callable[[str], bool]  # whether a path holds this format
    read_metadata: Callable[[str], Any]  # packer.records.Metadata of a dataset of this format
    shuffled_by_default: bool = False  # written in a seeded permutation unless asked not to
    writes_shuffled: bool = True  # the Writer takes end_split(order=...)
    options: tuple[Option, ...] = field(default=())
    # Container-level problems verify adds to the per-record ones (wds: shard sizes, SHA-256s).
    check_files: Callable[[str], list[str]] = lambda path: []
    # Per split, facts `packer info` adds to the metadata's ({split: {key: value}}; wds: its shards).
    info_facts: Callable[[str, Any], dict] = lambda path, remote: {}
    # --- how a dataset of this format is known without reading it (detection, --force, upload) ---
    title: str = ""  # how messages name it: "LMDB"
    held_as: str = ""  # what --force found at OUT, in its refusals: "a data.mdb", "an HDF5 file"
    # A folder format's entry file: its mark at a URL, where nothing is listed, and the object
    # an upload copies last (packer.upload), so a reader that finds it finds the rest.
    entry: str | None = None
    signature: bytes | None = None  # a one-file format's first bytes, its mark at a URL
    # (Metadata, the names under OUT/ the dataset holds) of the dataset at a URL, read through a
    # packer.remote Remote: info and --force read the one, a replace may delete only the others.
    read_remote: Callable[[str, Any], tuple[Any, set[str]]] | None = None
    # What in a local dataset of this format, its metadata read and checked, packer did not
    # write (a phrase completing "OUT exists and ..."), or None: --force replaces only its own.
    foreign: Callable[[str, Any], str | None] = lambda path, meta: None

    def read_url(self, url: str, remote) -> tuple[Any, set[str]]:
        """read_remote's answer, or a PackError for a format that is read from local paths only."""
        if self.read_remote is None:
            raise PackError(f"{url}: {self.name} datasets are read from local paths only (this format has no "
                            "reader for object storage); copy the dataset to a local folder", url)
        return self.read_remote(url, remote)

    def writer_options(self, given: dict | None) -> dict:
        """given (name -> value; None values count as not given), parsed and checked, with
        every option's default filled in; a name this format does not take is refused,
        listing the ones it does."""
        known = {option.name: option for option in self.options}
        given = {name: value for name, value in (given or {}).items() if value is not None}
        unknown = sorted(set(given) - set(known))
        if unknown:
            takes = ", ".join(known) or "none"
            raise PackError(f"{', '.join(unknown)}: not an option of the {self.name} writer (it takes: {takes})")
        options = {}
        for name, option in known.items():
            try:
                options[name] = option.parse(given[name]) if name in given else option.default
            except ValueError as exc:
                raise PackError(f"{self.name} writer option {name}: {exc}") from exc
        return options
