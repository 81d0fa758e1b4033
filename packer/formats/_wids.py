"""The wids index a WebDataset split carries (<split>/wids-index.json): the split's shards as
webdataset's indexed reader (wids.ShardListDataset) loads them, its bytes and its check.

Written from the split's entry in index.json, so verify checks it against that entry:
the same shards in the same order, their sample counts, and the classes."""
from __future__ import annotations

import json
import os

from ..records import PATH_ENCODING_ERRORS

WIDS_INDEX = "wids-index.json"
MAX_WIDS_INDEX_BYTES = 64 << 20


def wids_index(split: str, entry: dict, classes: list[str]) -> dict:
    """The split's shard list in the shape wids.ShardListDataset loads, urls relative to the file."""
    return {"wids_version": 1, "name": split, "classes": list(classes),
            "shardlist": [{"url": shard["name"].partition("/")[2], "nsamples": shard["count"]}
                          for shard in entry["shards"]]}


def wids_index_bytes(split: str, entry: dict, classes: list[str]) -> bytes:
    return json.dumps(wids_index(split, entry, classes), ensure_ascii=False, indent=1).encode(
        "utf-8", PATH_ENCODING_ERRORS)


def long_names_warning(split: str, count: int, first: str | None) -> str | None:
    """The warning for a split whose member names need PAX records (count of them, the first
    one's path): webdataset (tarfile), tar and packer's readers read them; wids 0.1's reader
    takes the ustar field alone, cut or mangled, and then misgroups the split."""
    if not count:
        return None
    return (f"split {split}: {count} sample(s) have names that are not ASCII or are over 100 bytes as tar members "
            f"(first: {first!r}); webdataset.WebDataset, tar and packer's readers read them, but "
            "wids.ShardListDataset (which reads only the ustar name field) misreads this split: rename those "
            "files to short ASCII names before packing if you read it with wids")


def wids_index_problems(path: str, split: str, entry: dict, classes: list[str], index_name: str) -> list[str]:
    """The split's wids index must list exactly its shards, counts and classes (what the
    writer wrote from the split's entry in index_name)."""
    name = entry["wids_index"]
    try:
        with open(os.path.join(path, name), "rb") as f:
            raw = f.read(MAX_WIDS_INDEX_BYTES + 1)
    except OSError as exc:
        return [f"{name}: cannot read the wids index ({exc.strerror or exc}); re-pack the dataset"]
    try:
        found = json.loads(raw.decode("utf-8", PATH_ENCODING_ERRORS))
    except (ValueError, RecursionError) as exc:
        return [f"{name}: the wids index is not JSON ({str(exc)[:80]}); re-pack the dataset"]
    if found != wids_index(split, entry, classes):
        return [f"{name}: the wids index does not list the split's shards, sample counts and classes as "
                f"{index_name} does (changed or damaged); re-pack the dataset"]
    return []
