"""A WebDataset pack's index.json: read, checked field by field, the files it names, and what `info` shows of it.

The index holds the dataset's Metadata plus "wds", the shard index (layout in wds's
docstring). It names only files of its own dataset: shard_index_problem refuses any name
but <split>/<name>.tar and the split's own tables at the names the writer gives them, and
any that resolves (through a symlink) outside the dataset folder."""
from __future__ import annotations

import json
import os

from ..errors import FormatError
from ..records import MAX_METADATA_BYTES, Metadata, parse_json, split_name_problem
from ..remote import source as remote_source
from ._files import entry_problem, outside_problem
from ._foreign import unexpected, unnamed
from ._wids import WIDS_INDEX

INDEX = "index.json"
# 2: members named by content (jpg, not the source's jpeg), and <split>/wids-index.json.
LAYOUT_VERSION = 2
PACKER_INDEX_KEYS = {"format", "format_version", "count", "classes", "splits", "packer_version", "wds"}


def read_bounded(f) -> bytes:
    """The file's bytes, at most MAX_METADATA_BYTES + 1 (parse_json refuses more): read(n)
    allocates n bytes before it reads, so n is the file's size where that is smaller."""
    return f.read(min(os.fstat(f.fileno()).st_size, MAX_METADATA_BYTES) + 1)


def foreign_index(path: str) -> bool:
    """Whether path's index.json is another tool's (a wids shard list beside the shards): a
    JSON object with keys, none of them packer's. One that does not parse, or is empty,
    counts as packer's, so that its damage is reported."""
    try:
        with open(os.path.join(path, INDEX), "rb") as f:
            index = json.loads(read_bounded(f))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(index, dict) and bool(index) and not PACKER_INDEX_KEYS & set(index)


def load_index(path: str) -> dict:
    """The parsed index.json of the dataset at path, checked (see open_index)."""
    return open_index(path)[0]


def open_index(path: str, remote=None) -> tuple[dict, Metadata]:
    """The parsed index.json and its Metadata, checked: the metadata field by field, and
    every file the "wds" section names is where the writer puts it, inside path.
    remote: the packer.remote Remote to read a URL with."""
    where = os.path.join(path, INDEX)
    try:
        if remote is not None:
            raw = remote.read_object(where, MAX_METADATA_BYTES)
        else:
            with open(where, "rb") as f:
                raw = read_bounded(f)
    except remote_source.RemoteError as exc:
        if not remote_source.missing(exc):
            raise
        raise FormatError(f"{path}: not a packer WebDataset folder (no {INDEX} at {where})", path) from exc
    except FileNotFoundError as exc:
        raise FormatError(f"{path}: not a packer WebDataset folder (no {INDEX}); for shards written by "
                          "other tools use readers.WDSDataset, which counts samples by scanning", path) from exc
    except OSError as exc:
        raise FormatError(f"{where}: cannot read the index ({exc.strerror or exc})", path) from exc
    index = parse_json(raw, where, INDEX)
    meta = Metadata.from_dict(index, where, container_keys=("wds",))
    problem = shard_index_problem(index["wds"] if "wds" in index else None, meta, None if remote else path)
    if problem:
        raise FormatError(f"{where}: {problem}; the index is damaged or was crafted, re-pack the dataset", path)
    return index, meta


def shard_index_problem(section, meta: Metadata, path: str) -> str | None:
    """What is wrong with the index's "wds" section, or None."""
    if not isinstance(section, dict) or not isinstance(section.get("splits"), dict):
        return 'no "wds" object with the splits\' shards'
    version = section.get("layout_version")
    if type(version) is not int or not 1 <= version <= LAYOUT_VERSION:
        return f"layout_version {version!r} is not one this packer reads (1 to {LAYOUT_VERSION}; upgrade packer?)"
    splits = section["splits"]
    if sorted(splits) != sorted(meta.splits):
        return f"the shard index lists splits {sorted(splits)}, the metadata {sorted(meta.splits)}"
    for split, entry in splits.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
            return f"split {split!r} has no list of shards"
        if entry.get("records") != f"{split}/records.bin" or entry.get("paths") != f"{split}/paths.bin":
            return (f"split {split!r} names its tables {entry.get('records')!r} and {entry.get('paths')!r}, "
                    f"not {split}/records.bin and {split}/paths.bin")
        wids = entry.get("wids_index")
        if (version >= 2 or wids is not None) and wids != f"{split}/{WIDS_INDEX}":
            return f"split {split!r} names its wids index {wids!r:.80}, not {split}/{WIDS_INDEX}"
        for key, name in (("order", "order.bin"), ("path_offsets", "path_offsets.bin"), ("positions", "positions.bin")):
            if entry.get(key) not in (None, f"{split}/{name}"):
                return f"split {split!r} names its {key} table {entry[key]!r:.80}, not {split}/{name}"
        for shard in entry["shards"]:
            problem = entry_problem(shard, split, ".tar", split_name_problem)
            if problem:
                return problem
    return None if path is None else outside_problem(path, named_files(section))  # None: remote: just names


def named_files(section: dict) -> list[str]:
    """Every file a checked "wds" section names, relative to the dataset folder."""
    files = []
    for entry in section["splits"].values():
        files += [entry["records"], entry["paths"], *(shard["name"] for shard in entry["shards"])]
        files += [entry[key] for key in ("wids_index", "order", "path_offsets", "positions") if entry.get(key) is not None]
    return files


def info_facts(path: str, remote=None) -> dict:
    """Per split, for `packer info`, its shards (readers cut an epoch's shard order into one share per rank): their count,
    and the total, smallest and largest shard bytes (from the index)."""
    facts = {}
    for split, entry in open_index(path, remote)[0]["wds"]["splits"].items():
        sizes = [shard["bytes"] for shard in entry["shards"]]
        facts[split] = {"shards": {"shards": len(sizes), "bytes": sum(sizes), "min_bytes": min(sizes, default=0),
                                   "max_bytes": max(sizes, default=0)}}
    return facts


def read_remote(url: str, remote) -> tuple[Metadata, set[str]]:
    """(Metadata, index.json and the files it names) of the WDS dataset at url."""
    index, meta = open_index(url, remote)
    return meta, {INDEX, *named_files(index["wds"])}


def foreign(path: str, meta: Metadata) -> str | None:
    """Anything in a checked WDS folder that its index does not name."""
    return unexpected(unnamed(path, {INDEX, *named_files(load_index(path)["wds"])}), "wds")
