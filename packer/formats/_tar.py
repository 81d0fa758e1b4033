"""Tar as WebDataset uses it: reproducible members for writing, named as webdataset keys and
suffixes (the rules: packer.formats.wds), samples out of any shard for reading.

Writing: every member is a regular file with fixed mtime, mode, owner and group, in PAX
format (plain ustar headers for ASCII names of at most 100 bytes, a PAX `path` record before
the header otherwise), so the same input always gives the same bytes and the shard
lists with `tar tf`. Each shard ends with the two zero blocks POSIX requires, without
padding to a 10 KiB record (every reader accepts that, and it keeps sizes exact).

Reading parses headers one block at a time instead of using tarfile's stream mode,
because tarfile ends iteration silently when an archive is cut at a block boundary or
holds a garbage header: a shard cut short would be a short epoch nobody notices. Here
a shard must end with a zero block, or reading raises CorruptDataError naming the
shard and the byte offset. Accepted from other tools: gzip-compressed shards (any name;
detected by magic bytes), `./` prefixes, directory and other non-file entries
(skipped; as in tarfile, links, directories, devices and FIFOs carry no data whatever
their size field says), PAX and GNU long names.

Every number in a header is untrusted. A size must be non-negative and below 2^63, a
PAX `size` ASCII digits, a PAX record's length must cover its own `<len> ` prefix,
stay within the record block and end at a newline, and an extended header (PAX
records, GNU long name) is at most 1 MiB. For a plain file every read and seek is
checked against the file's length before it happens; a gzip stream, whose length is
unknown until it ends, is read in 1 MiB chunks, and a member kept in memory may not
inflate past 64 MiB at more than 100x the compressed bytes it was read from (images are
compressed already: a tar of them gzips at about 1x; gzip can reach ~1000x, so a small
shard could otherwise fill memory). Each header moves the offset forward by at least one
block, so no input can make reading loop, and any violation is a CorruptDataError naming
the shard and offset.

Plain headers (what packer writes: a regular file in ustar or GNU form, no prefix, every
number field octal digits then spaces or NULs, a correct unsigned checksum) are parsed
by plain_header(); every other header (damaged, unusual, or after a PAX record or GNU
long name) goes to tarfile's parser, which decides and words the error, so both paths
give the same members and errors.
"""
from __future__ import annotations

import gzip
import io
import os
import re
import stat
import tarfile
import zlib
from typing import IO, Iterator, NamedTuple

from ..check import IMAGE_SUFFIXES, sniff
from ..errors import BadImageError, CorruptDataError
from ..source_io import open_regular_file

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
END_OF_ARCHIVE = bytes(2 * BLOCK)
GZIP_MAGIC = b"\x1f\x8b"
# 2000-01-01T00:00:00Z: any constant makes shards reproducible; 0 makes some tools warn.
MTIME = 946684800
# Bounds on what a header may declare: sizes fit a signed 64-bit offset, and an extended
# header (PAX records, a GNU long name) is small; larger is damage, not data.
MAX_SIZE = 2**63 - 1
MAX_EXTENDED = 1 << 20
CHUNK = 1 << 20  # gzip streams are read at most this much at a time
# A kept member of a gzip stream past BOMB_FLOOR bytes may be at most BOMB_RATIO times
# the compressed bytes read for it (see the docstring).
BOMB_FLOOR = 64 << 20
BOMB_RATIO = 100
EXTENDED_TYPES = (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_PAX_HEAD = re.compile(rb"([0-9]{1,9}) ")
_PAX_SIZE = re.compile(r"[0-9]{1,19}")


def _octal_field(width: int, group: bool = False) -> bytes:
    """A number field that tarfile reads as octal: digits, then only spaces and NULs (a
    strict subset of what it accepts; leading spaces, signs and base-256 go the slow way)."""
    field = b"|".join(b"[0-7]{%d}[ \\x00]{%d}" % (digits, width - digits) for digits in range(width, -1, -1))
    return (b"(" if group else b"(?:") + field + b")"


# A plain header from byte 100 through the first byte of the prefix: mode, uid, gid,
# (size), mtime, (checksum), type "0" (a regular file), link name, POSIX or GNU magic
# and version, user and group names, device numbers, an empty prefix.
_PLAIN = re.compile(b"".join((
    _octal_field(8), _octal_field(8), _octal_field(8), _octal_field(12, True), _octal_field(12),
    _octal_field(8, True), b"0", b".{100}", b"(?:ustar\\x0000|ustar  \\x00)", b".{64}",
    _octal_field(8), _octal_field(8), b"\\x00")), re.DOTALL)
_PLAIN_END = 346


# Content sniffed by packer.check.sniff -> the member suffix webdataset recipes expect.
CONTENT_SUFFIX = {"jpeg": "jpg", "png": "png", "webp": "webp", "bmp": "bmp", "tiff": "tiff"}
PNM_SUFFIXES = ("ppm", "pgm")


def _escape(text: str) -> str:
    return text.replace("%", "%25").replace(".", "%2E")


def sample_key(relpath: str) -> str:
    """The webdataset key of a relative path: folders kept, `<stem>_<ext>` with no dot."""
    folder, _, name = relpath.rpartition("/")
    stem, dot, ext = name.rpartition(".")
    if not dot:
        stem, ext = name, ""
    last = f"{_escape(stem)}_{_escape(ext).replace('_', '%5F')}"
    return f"{folder}/{last}" if folder else last


def source_suffix(relpath: str) -> str:
    name = relpath.rpartition("/")[2]
    return name.rpartition(".")[2].lower() if "." in name else "bin"


def member_suffix(data: bytes, relpath: str) -> str:
    """The image member's suffix: named by content (JPEG -> jpg), else by the file's extension."""
    kind = sniff(data)
    if kind in CONTENT_SUFFIX:
        return CONTENT_SUFFIX[kind]
    own = source_suffix(relpath)
    if kind == "pnm" and own not in PNM_SUFFIXES:
        return "pgm" if data[1:2] in b"25" else "ppm"
    return own


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


def fits_ustar(name: str) -> bool:
    """Whether name fits a plain ustar header (ASCII, at most 100 bytes) without a PAX
    `path` record, which readers that take only the ustar name field miss (wids 0.1)."""
    return name.isascii() and len(name) <= 100


def header(name: str, size: int) -> bytes:
    """Identical to tar_header(name, size), but for the common case (ASCII name of at most
    100 bytes, so one ustar block) it patches a template: tarfile takes about 60 us per
    header, a third of the writer's time per sample."""
    if not (fits_ustar(name) and size <= _MAX_USTAR_SIZE):
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


class Sample(NamedTuple):
    key: str
    parts: dict[str, bytes | None]  # lowercased suffix -> member bytes
    offset: int


def open_shard(path: str, opener=None) -> tuple[IO[bytes], bool]:
    """A binary stream of the tar inside path, and whether it was gzip-compressed.
    opener(path): a raw binary stream of path, not seekable (a remote shard, streamed)."""
    if opener is not None:
        raw = io.BufferedReader(opener(path), CHUNK)
        if raw.peek(2)[:2] == GZIP_MAGIC:
            return gzip.GzipFile(fileobj=Counted(raw), mode="rb"), True
        return raw, False
    try:
        fd, _ = open_regular_file(path)  # a FIFO in a shard's place would block open() forever
    except OSError as exc:
        raise CorruptDataError(f"{path}: cannot open the shard ({exc.strerror}); check that it exists and is "
                               "readable, or read with on_error='skip'", path) from exc
    except BadImageError as exc:
        raise CorruptDataError(f"{path}: the shard is {exc.reason}; put the shard's file back, or read with "
                               "on_error='skip'", path) from exc
    raw = open(fd, "rb")
    if raw.read(2) == GZIP_MAGIC:
        raw.seek(0)
        return gzip.GzipFile(fileobj=Counted(raw), mode="rb"), True
    raw.seek(0)
    return raw, False


class Counted:
    """A binary stream that counts the bytes read from it: what a gzip stream has taken in."""

    def __init__(self, raw: IO[bytes]):
        self.raw, self.count = raw, 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.count += len(data)
        return data

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


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


def damaged(where: str, what: str) -> CorruptDataError:
    return CorruptDataError(f"{where}: {what}; the shard is damaged (re-create it, or read with on_error='skip')",
                            where)


class TarStream:
    """A tar stream that knows its offset and, for a plain file, its length.

    Every size in a header is untrusted, so each read and seek is checked against the
    length first (a crafted size fails before anything is allocated); a gzip stream,
    whose length is unknown until it ends, is read in bounded chunks.
    """

    def __init__(self, stream: IO[bytes], where: str):
        self.stream, self.where, self.offset = stream, where, 0
        self.end = None
        source = getattr(stream, "fileobj", None) if isinstance(stream, gzip.GzipFile) else None
        self.compressed = source if isinstance(source, Counted) else None  # what a gzip stream took in
        if not isinstance(stream, gzip.GzipFile) and stream.seekable():
            try:
                status = os.fstat(stream.fileno())
                if stat.S_ISREG(status.st_mode):
                    self.end = status.st_size - stream.tell()
            except (OSError, AttributeError, io.UnsupportedOperation):  # not a file (a BytesIO)
                pass

    def read(self, n: int, what: str) -> bytes:
        if self.end is None:
            data = b"".join(self.inflated(n, what))
        else:
            if self.offset + n > self.end:
                self.check_room(n, what)
            data = self.raw_read(n, what)
        if len(data) < n:
            self.check_length(len(data), n, what)
        self.offset += n
        return data

    def member(self, size: int, name: str, keep: bool) -> bytes | None:
        """A member's size bytes of data (None unless keep), then past its padding.

        Local files read exactly size bytes and seek over the padding: no copy of the data."""
        padded = size + (-size % BLOCK)
        if self.end is None:
            if keep:
                return self.read(padded, f"member {name!r}")[:size]
            self.skip(padded, f"member {name!r}")
            return None
        if self.offset + padded > self.end:
            self.check_room(padded, f"member {name!r}")
        data, past = None, padded
        if keep:
            data = self.raw_read(size, "")
            if len(data) < size:
                self.check_length(len(data), size, f"member {name!r}")
            past -= size
        if past:
            self.stream.seek(past, 1)
        self.offset += padded
        return data

    def skip(self, n: int, what: str) -> None:
        if self.end is None:
            self.check_length(sum(len(chunk) for chunk in self.chunks(n, what)), n, what)
        else:
            self.check_room(n, what)
            self.stream.seek(n, 1)
        self.offset += n

    def chunks(self, n: int, what: str) -> Iterator[bytes]:
        while n:
            chunk = self.raw_read(min(n, CHUNK), what)
            if not chunk:
                return
            yield chunk
            n -= len(chunk)

    def inflated(self, n: int, what: str) -> Iterator[bytes]:
        """chunks(n, what) of a stream of unknown length, to be held in memory: past
        BOMB_FLOOR bytes at more than BOMB_RATIO times the compressed input, refused."""
        if self.compressed is None:  # not gzip: every byte held was in the stream
            yield from self.chunks(n, what)
            return
        taken, held = self.compressed.count, 0
        for chunk in self.chunks(n, what):
            held += len(chunk)
            if held > BOMB_FLOOR and held > BOMB_RATIO * (self.compressed.count - taken):
                raise damaged(self.where, f"the {what} at byte {self.offset} inflates to more than {held} bytes "
                                          f"from {self.compressed.count - taken} compressed: over {BOMB_RATIO}x "
                                          f"is a decompression bomb, not images")
            yield chunk

    def check_room(self, n: int, what: str) -> None:
        if self.end is not None and self.offset + n > self.end:
            raise CorruptDataError(f"{self.where}: truncated at byte {self.end}: the file ends inside the {what} "
                                   f"that starts at byte {self.offset} and needs {n} bytes (re-create the "
                                   "shard, or read with on_error='skip')", self.where)

    def check_length(self, got: int, n: int, what: str) -> None:
        if got < n:
            raise CorruptDataError(f"{self.where}: truncated at byte {self.offset + got}: the file ends inside "
                                   f"the {what} that starts at byte {self.offset} (re-create the shard, or read "
                                   "with on_error='skip')", self.where)

    def raw_read(self, n: int, what: str) -> bytes:
        try:
            return self.stream.read(n)
        except (EOFError, OSError, zlib.error) as exc:  # gzip: cut short, or bad compressed data
            raise CorruptDataError(f"{self.where}: cannot decompress at byte {self.offset} of the tar ({exc}); the "
                                   "shard is damaged or truncated (re-create it, or read with on_error='skip')",
                                   self.where) from exc


def pax_records(raw: bytes, where: str = "<pax>", offset: int = 0) -> dict[str, str]:
    """Parse PAX extended-header records: b"<len> <key>=<value>\\n", <len> counting the whole record."""
    records, pos = {}, 0
    raw = raw.rstrip(b"\0")  # some writers pad the record block with NULs
    while pos < len(raw):
        match = _PAX_HEAD.match(raw, pos)
        length = int(match.group(1)) if match else 0
        stop = pos + length
        if match is None or length <= match.end() - pos or stop > len(raw) or raw[stop - 1] != 0x0A:
            raise damaged(where, f"bad PAX record at byte {pos} of the extended header at byte {offset} "
                                 f"({raw[pos:pos + 40]!r})")
        key, eq, value = raw[match.end():stop - 1].partition(b"=")
        if not eq or not key:
            raise damaged(where, f"PAX record without a key at byte {pos} of the extended header at byte {offset}")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = stop
    return records


def plain_header(block: bytes) -> tuple[str, int] | None:
    """(name, size) of a plain regular-file header, exactly as tarfile.TarInfo.frombuf
    reads them, or None when the block is anything else (parse_header then decides)."""
    match = _PLAIN.fullmatch(block, 100, _PLAIN_END)
    if match is None:
        return None
    size_field, checksum_field = match.groups()
    # Adler-32's low half is 1 + the byte sum mod 65521: exact for 256 bytes (at most 65280).
    total = (zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2
    # tarfile's checksum counts its own field as eight spaces (8 * 32 = 256).
    if int(checksum_field.rstrip(b" \0") or b"0", 8) != total - sum(checksum_field) + 256:
        return None  # a bad checksum, or a signed-char one: tarfile's path words or accepts it
    end = block.find(0, 0, 100)
    name = block[:end if end >= 0 else 100].decode("utf-8", "surrogateescape")
    return name, int(size_field.rstrip(b" \0") or b"0", 8)


def parse_header(block: bytes, where: str, offset: int) -> tarfile.TarInfo:
    try:
        return tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError as exc:
        raise damaged(where, f"no valid tar header at byte {offset} ({exc})") from exc


def member_size(info: tarfile.TarInfo, pax: dict[str, str], where: str, offset: int) -> int:
    """The member's data size (a PAX `size` record overrides the header's), validated."""
    size = info.size
    if "size" in pax:
        if not _PAX_SIZE.fullmatch(pax["size"]):
            raise damaged(where, f"PAX size {pax['size'][:40]!r} for the header at byte {offset} is not a byte count")
        size = int(pax["size"])
    if not 0 <= size <= MAX_SIZE:
        raise damaged(where, f"the tar header at byte {offset} declares size {size}")
    return size


def iter_members(stream: IO[bytes], where: str, read_data: bool = True) -> Iterator[tuple[str, bytes | None, int]]:
    """Regular-file members of a tar stream, in order, as (name, data or None when not read,
    offset of the member's first header block); raises CorruptDataError on damage.

    Every header moves the offset forward by at least one block, so no input loops."""
    tar = TarStream(stream, where)
    read, member = tar.read, tar.member
    long_name = None
    pax: dict[str, str] = {}
    while True:
        header_at = tar.offset
        block = read(BLOCK, "header")
        # A PAX record or GNU long name describes the next member: tarfile's path applies it.
        plain = None if pax or long_name is not None else plain_header(block)
        if plain is not None:
            name, size = plain
            yield name, member(size, name, read_data), header_at
            continue
        if block == ZERO_BLOCK:
            return
        info = parse_header(block, where, header_at)
        extended = info.type in EXTENDED_TYPES
        size = member_size(info, {} if extended else pax, where, header_at)  # PAX records describe the member
        padded = size + (-size % BLOCK)
        if extended:
            if size > MAX_EXTENDED:
                raise damaged(where, f"extended header at byte {header_at} declares {size} bytes, more than "
                                     f"{MAX_EXTENDED} (no name or record set needs that much)")
            raw = tar.read(padded, "extended header")[:size]
            if info.type == tarfile.GNUTYPE_LONGNAME:
                long_name = raw.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif info.type != tarfile.GNUTYPE_LONGLINK:  # a link target: no member name
                pax = pax_records(raw, where, header_at)
            continue
        name = pax.get("path") or long_name or info.name
        long_name, pax = None, {}
        if info.isreg():
            yield name, member(size, name, read_data), header_at
        else:
            # As tarfile: links, directories, devices and FIFOs have no data whatever their size says.
            tar.skip(padded if info.type not in tarfile.SUPPORTED_TYPES else 0, f"member {name!r}")


def iter_samples(path: str, read_data: bool = True, opener=None) -> Iterator[Sample]:
    """Samples (consecutive members sharing a key) of the shard at path, webdataset's grouping.

    Skipped as webdataset skips them: names without a suffix and top-level `__name__`
    members. A repeated suffix within one key is an error, as in webdataset.
    """
    stream, compressed = open_shard(path, opener)
    where = f"{path} (gzip)" if compressed else path
    key, parts, start = None, {}, 0
    with stream:
        for name, data, offset in iter_members(stream, where, read_data):
            split = split_name(name)
            if split is None:
                continue
            member_key, suffix = split
            if member_key != key:
                if member_key.startswith("__") and member_key.endswith("__") and "/" not in member_key:
                    continue
                if key is not None:
                    yield Sample(key, parts, start)
                key, parts, start = member_key, {}, offset
            if suffix in parts:
                raise CorruptDataError(f"{where}: member {name!r} at byte {offset} repeats suffix "
                                       f"{suffix!r} of sample {key!r} (two files with one key)", where)
            parts[suffix] = data
    if key is not None:
        yield Sample(key, parts, start)


def image_suffix(parts: dict) -> str | None:
    """The first member suffix that names an image (`jpg`, `png`, also `input.jpg`), or None."""
    for suffix in parts:
        if suffix.rpartition(".")[2] in IMAGE_SUFFIXES:
            return suffix
    return None


def count_samples(path: str, opener=None) -> int:
    """Samples with an image member in the shard at path (reads headers only when uncompressed
    and local: a stream from opener is read through)."""
    return sum(image_suffix(s.parts) is not None for s in iter_samples(path, read_data=False, opener=opener))
