"""A folder format's data files ("shards"), each named by its index with a record count, a size
and a SHA-256: written durably, hashed as they are written, kept inside the folder, and checked
against the index. Shared by the formats whose index lists files (wds); the index's own shape
and what a shard holds stay with the format."""
from __future__ import annotations

import hashlib
import os
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from ..cores import available_cores
from ..crc import crc32
from ..errors import CorruptDataError


def write_synced(where: str, data: bytes) -> None:
    with open(where, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_synced_chunks(where: str, chunks) -> int:
    """Write the chunks (bytes-like) to a new file at where, synced; their CRC-32 as one table."""
    value = 0
    with open(where, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            value = crc32(chunk, value)
        f.flush()
        os.fsync(f.fileno())
    return value


def file_digest(path: str) -> str:
    """The SHA-256 of the file at path, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ShardDigest:
    """The SHA-256 of a file's bytes, hashed in write order on one helper thread.

    hashlib releases the GIL, so the hash runs beside the writer's next records instead of
    in its path. Blobs go to the thread BATCH at a time (one hand-over per batch, not per
    record), and at most PENDING batches wait, so memory stays flat when it falls behind.
    """

    BATCH = 32
    PENDING = 4

    def __init__(self, thread: ThreadPoolExecutor):
        self.thread, self.digest, self.pending, self.batch = thread, hashlib.sha256(), deque(), []

    def update(self, blob: bytes) -> None:
        self.batch.append(blob)
        if len(self.batch) >= self.BATCH:
            self.hand_over()

    def hand_over(self) -> None:
        if len(self.pending) >= self.PENDING:
            self.pending.popleft().result()
        self.pending.append(self.thread.submit(self.hash_all, self.batch))
        self.batch = []

    def hash_all(self, blobs: list) -> None:
        for blob in blobs:
            self.digest.update(blob)

    def hexdigest(self) -> str:
        if self.batch:
            self.hand_over()
        while self.pending:
            self.pending.popleft().result()
        return self.digest.hexdigest()


def entry_problem(entry, folder: str, suffix: str, name_problem) -> str | None:
    """What is wrong with an index's entry for one file, {"name": "<folder>/<file><suffix>",
    "count": n, "bytes": n, "sha256": hex}, or None; name_problem(file) says why a file name
    is refused (None: accepted)."""
    if not isinstance(entry, dict):
        return f"split {folder!r}: shard entry {entry!r:.60} is not an object"
    name = entry.get("name")
    parent, _, file = name.partition("/") if isinstance(name, str) else ("", "", "")
    if parent != folder or name_problem(file) or not file.endswith(suffix):
        return f"split {folder!r}: shard name {name!r:.80} is not {folder}/<name>{suffix}"
    for key in ("count", "bytes"):
        if type(entry.get(key)) is not int or entry[key] < 0:
            return f"shard {name}: {key} {entry.get(key)!r:.40} is not a whole number"
    if not isinstance(entry.get("sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
        return f"shard {name}: sha256 {entry.get('sha256')!r:.80} is not 64 hex digits"
    return None


def outside_problem(path: str, names: list[str]) -> str | None:
    """A named file that resolves outside the dataset folder (through a symlink), or None."""
    root = os.path.realpath(path)
    for name in names:
        real = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([root, real]) != root:
            return f"{name} leads outside the dataset folder (to {real}); a dataset only reads its own files"
    return None


def file_problems(path: str, entry: dict) -> list[str]:
    """The entry's file under path (there), not the size or not the SHA-256 the index gives."""
    where = os.path.join(path, entry["name"])
    if os.path.getsize(where) != entry["bytes"]:
        return [f"{entry['name']}: {os.path.getsize(where)} bytes, the index says {entry['bytes']}"]
    if file_digest(where) != entry["sha256"]:
        return [f"{entry['name']}: SHA-256 differs from the index (the shard changed or is damaged)"]
    return []


def shards_problems(path: str, checks: list, count_records) -> list[str]:
    """The problems of each (entry, table_count) in checks (shard_problems), shards hashed by
    threads (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max(1, available_cores())) as pool:
        return [problem for found in pool.map(lambda check: checked_shard(path, *check, count_records), checks)
                for problem in found]


def checked_shard(path: str, shard: dict, table_count: int | None, count_records) -> list[str]:
    try:
        return shard_problems(path, shard, table_count, count_records)
    except OSError as exc:
        return [f"{shard['name']}: cannot read the shard ({exc.strerror or exc})"]


def shard_problems(path: str, shard: dict, table_count: int | None, count_records) -> list[str]:
    """A shard's problems: missing, size, SHA-256, then its record count, which table_count (the
    records the format's tables put in it) gives when the shard is intact, and
    count_records(file) otherwise (parsing it, to say what is wrong)."""
    where = os.path.join(path, shard["name"])
    if not os.path.isfile(where):
        return [f"{shard['name']}: shard missing"]
    problems = file_problems(path, shard)
    if not problems and table_count is not None:
        found = table_count
    else:
        try:
            found = count_records(where)
        except CorruptDataError as exc:
            return problems + [str(exc)]
    if found != shard["count"]:
        problems.append(f"{shard['name']}: {found} samples, the index says {shard['count']}")
    return problems
