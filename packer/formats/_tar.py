"""Tar as WebDataset uses it: reproducible members for writing, samples out of any shard for reading.

Writing: every member is a regular file with fixed mtime, mode, owner and group, in PAX
format (plain ustar headers for ASCII names under 100 bytes, a PAX `path` record before
the header otherwise), so the same input always gives the same bytes and the shard
lists with `tar tf`. Each shard ends with the two zero blocks POSIX requires, without
padding to a 10 KiB record (every reader accepts that, and it keeps sizes exact).

Reading parses headers one block at a time instead of using tarfile's stream mode,
because tarfile ends iteration silently when an archive is cut at a block boundary or
holds a garbage header: a shard cut short would be a short epoch nobody notices. Here
a shard must end with a zero block, or reading raises CorruptDataError naming the
shard and the byte offset. Accepted from other tools: gzip-compressed shards (any name;
detected by magic bytes), `./` prefixes, directory and other non-file entries
(skipped), PAX and GNU long names.
"""
from __future__ import annotations

import gzip
import tarfile
import zlib
from typing import IO, Iterator, NamedTuple

from ..errors import CorruptDataError

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
END_OF_ARCHIVE = bytes(2 * BLOCK)
GZIP_MAGIC = b"\x1f\x8b"
# 2000-01-01T00:00:00Z: any constant makes shards reproducible; 0 makes some tools warn.
MTIME = 946684800
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp")


def tar_header(name: str, size: int) -> bytes:
    """tarfile's header block(s) for a regular file with our fixed fields."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = MTIME
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


_TEMPLATE = tar_header("x", 0)
_MAX_USTAR_SIZE = 8**11 - 1


def header(name: str, size: int) -> bytes:
    """Identical to tar_header(name, size), but for the common case (ASCII name of at most
    100 bytes, so one ustar block) it patches a template: tarfile takes about 60 us per
    header, a third of the writer's time per sample."""
    if not (name.isascii() and len(name) <= 100 and size <= _MAX_USTAR_SIZE):
        return tar_header(name, size)
    block = bytearray(_TEMPLATE)
    block[0:100] = name.encode("ascii").ljust(100, b"\0")
    block[124:136] = b"%011o\0" % size
    block[148:156] = b" " * 8  # the checksum is computed with its own field as spaces
    block[148:155] = b"%06o\0" % sum(block)
    return bytes(block)


def member(name: str, data: bytes) -> tuple[bytes, int]:
    """One regular-file member as bytes (header, data, padding) and where its data starts."""
    head = header(name, len(data))
    return b"".join((head, data, bytes(-len(data) % BLOCK))), len(head)


class Member(NamedTuple):
    name: str
    data: bytes | None  # None when the caller asked to skip data
    offset: int  # of the member's first header block, in the (decompressed) tar


class Sample(NamedTuple):
    key: str
    parts: dict[str, bytes | None]  # lowercased suffix -> member bytes
    offset: int


def open_shard(path: str) -> tuple[IO[bytes], bool]:
    """A binary stream of the tar inside path, and whether it was gzip-compressed."""
    raw = open(path, "rb")
    if raw.read(2) == GZIP_MAGIC:
        raw.seek(0)
        return gzip.GzipFile(fileobj=raw, mode="rb"), True
    raw.seek(0)
    return raw, False


def split_name(name: str) -> tuple[str, str] | None:
    """(key, lowercased suffix) the way webdataset splits a member name, or None (no suffix).

    The key runs to the first dot of the last path component; a leading `./` is dropped
    (tar's spelling of "relative to here", not part of any key).
    """
    while name.startswith("./"):
        name = name[2:]
    folder, _, base = name.rpartition("/")
    stem, dot, suffix = base.partition(".")
    if not dot or not stem:
        return None
    return (f"{folder}/{stem}" if folder else stem), suffix.lower()


def pax_records(raw: bytes) -> dict[str, str]:
    """Parse PAX extended-header records: b"<len> <key>=<value>\\n"."""
    records, pos = {}, 0
    while pos < len(raw):
        space = raw.index(b" ", pos)
        length = int(raw[pos:space])
        key, _, value = raw[space + 1:pos + length - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def iter_members(stream: IO[bytes], where: str, read_data: bool = True) -> Iterator[Member]:
    """Regular-file members of a tar stream, in order; raises CorruptDataError on damage."""
    offset = 0
    long_name = None
    pax: dict[str, str] = {}
    while True:
        block = read_exact(stream, BLOCK, where, offset, "header")
        if block == ZERO_BLOCK:
            return
        header_at = offset
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise CorruptDataError(f"{where}: no valid tar header at byte {offset} ({exc}); the shard is "
                                   "damaged (re-create it, or read with on_error='skip')", where) from exc
        offset += BLOCK
        size = int(pax.get("size", info.size))
        padded = size + (-size % BLOCK)
        if info.type in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME):
            raw = read_exact(stream, padded, where, offset, "extended header")[:size]
            if info.type == tarfile.XHDTYPE:
                pax = pax_records(raw)
            else:
                long_name = raw.rstrip(b"\0").decode("utf-8", "surrogateescape")
            offset += padded
            continue
        name = pax.get("path") or long_name or info.name
        long_name, pax = None, {}
        if info.isreg() and read_data:
            data = read_exact(stream, padded, where, offset, f"member {name!r}")[:size]
        else:
            skip(stream, padded, where, offset, name)
            data = None
        offset += padded
        if info.isreg():
            yield Member(name, data, header_at)


def read_exact(stream: IO[bytes], n: int, where: str, offset: int, what: str) -> bytes:
    try:
        data = stream.read(n)
    except (EOFError, OSError, zlib.error) as exc:  # gzip: cut short, or bad compressed data
        raise CorruptDataError(f"{where}: cannot decompress at byte {offset} of the tar ({exc}); the shard "
                               "is damaged or truncated (re-create it, or read with on_error='skip')",
                               where) from exc
    if len(data) < n:
        raise CorruptDataError(f"{where}: truncated at byte {offset + len(data)}: the file ends inside the "
                               f"{what} that starts at byte {offset} (re-create the shard, or read with "
                               "on_error='skip')", where)
    return data


def skip(stream: IO[bytes], n: int, where: str, offset: int, name: str) -> None:
    if n and stream.seekable() and not isinstance(stream, gzip.GzipFile):  # gzip can only read through
        # Land on the member's last byte: reading it proves the file is long enough (a seek
        # past the end succeeds silently).
        stream.seek(n - 1, 1)
        n = 1
    while n:
        n -= len(read_exact(stream, min(n, 1 << 20), where, offset, f"member {name!r}"))


def iter_samples(path: str, read_data: bool = True) -> Iterator[Sample]:
    """Samples (consecutive members sharing a key) of the shard at path, webdataset's grouping.

    Skipped as webdataset skips them: names without a suffix and top-level `__name__`
    members. A repeated suffix within one key is an error, as in webdataset.
    """
    stream, compressed = open_shard(path)
    where = f"{path} (gzip)" if compressed else path
    key, parts, start = None, {}, 0
    with stream:
        for m in iter_members(stream, where, read_data):
            split = split_name(m.name)
            if split is None or ("/" not in split[0] and split[0].startswith("__") and split[0].endswith("__")):
                continue
            if split[0] != key:
                if key is not None:
                    yield Sample(key, parts, start)
                key, parts, start = split[0], {}, m.offset
            if split[1] in parts:
                raise CorruptDataError(f"{where}: member {m.name!r} at byte {m.offset} repeats suffix "
                                       f"{split[1]!r} of sample {key!r} (two files with one key)", where)
            parts[split[1]] = m.data
    if key is not None:
        yield Sample(key, parts, start)


def image_suffix(parts: dict) -> str | None:
    """The first member suffix that names an image (`jpg`, `png`, also `input.jpg`), or None."""
    for suffix in parts:
        if suffix.rpartition(".")[2] in IMAGE_SUFFIXES:
            return suffix
    return None


def count_samples(path: str) -> int:
    """Samples with an image member in the shard at path (reads headers only when uncompressed)."""
    return sum(image_suffix(s.parts) is not None for s in iter_samples(path, read_data=False))
