"""The checks of a metadata object's fields as it is read (packer.records.Metadata): each takes
an untrusted value and returns it checked, or raises _Invalid saying which field holds what and
what it should hold; Metadata turns that into a FormatError naming the dataset. Field meanings
are in packer.records' docstring; the checks that need its definitions (the crc32 recipe,
SplitInfo) stay there. A `splits` argument here maps split names to SplitInfo."""
from __future__ import annotations

import re

from . import checksum as record_checksums
from .errors import FormatError

MAX_RECORDS = 2**31 - 1  # per split: labels and storage orders are int32 tables
MAX_BYTES = 2**63 - 1  # per split: image offsets are int64
MAX_PARTS = 1_000_000  # parts a source may be packed in
FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")
MAX_SIDE = 65535  # a JPEG's largest dimension: the largest "reencode" max_side
REENCODE_FORM = "baseline-420"  # the one "reencode_form" (packer.jpeg_form.BASELINE_420)


class _Invalid(Exception):
    """One thing wrong with a metadata object; Metadata turns it into a FormatError."""


def _count(value, what: str, limit: int) -> int:
    if type(value) is not int or not 0 <= value <= limit:  # bool is an int subclass: not a count
        raise _Invalid(f"{what} is {_show(value)}, not a whole number from 0 to {limit}")
    return value


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{what} is {_show(value)}, not a string")
    return value


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checksum_kind(value, version: int, where: str) -> str:
    """The record checksum kind: a string is one this packer computes, or the dataset was
    written by a newer packer (FormatError: upgrade); anything else is damage."""
    if not isinstance(value, str):
        raise _Invalid(f"checksum is {_show(value)}, not the name of a record checksum kind")
    if value not in record_checksums.KINDS:
        raise FormatError(f"{where or 'dataset'}: its records carry {_show(value)} checksums, a kind this packer "
                          f"does not know (it knows {', '.join(record_checksums.KINDS)}); upgrade packer to read it",
                          where or None)
    if value != record_checksums.CRC32 and version < 2:
        raise _Invalid(f"checksum is {value!r} in format version {version} (it needs version 2)")
    return value


def _classes(value) -> list[str]:
    if not isinstance(value, list):
        raise _Invalid(f"classes is {_show(value)}, not a list")
    for name in value:
        if not isinstance(name, str) or not name or "\0" in name or "/" in name:
            raise _Invalid(f"class name {_show(name)} is not a folder name (a non-empty string without "
                           '"/" or NUL)')
    if len(set(value)) != len(value):
        raise _Invalid("classes holds a name twice")
    return list(value)


def _skipped(value) -> list[dict]:
    if not isinstance(value, list):
        raise _Invalid(f"skipped is {_show(value)}, not a list")
    for entry in value:
        if (not isinstance(entry, dict) or not {"path", "reason"} <= entry.keys()
                or not all(isinstance(v, str) for v in entry.values())):
            raise _Invalid(f"skipped entry {_show(entry)} is not an object of strings with a path and a reason")
    return value


def _params(value) -> dict:
    if not isinstance(value, dict):
        raise _Invalid(f"params is {_show(value)}, not an object")
    origin = value.get("converted_from")
    if origin is not None and not (isinstance(origin, dict) and isinstance(origin.get("path"), str)
                                   and isinstance(origin.get("format"), str)):
        raise _Invalid(f"params.converted_from is {_show(origin)}, not an object with a path and a format")
    return value


def part_bounds(total: int, index: int, count: int) -> tuple[int, int]:
    """The [start, stop) of the source's `total` listed files that part `index` of `count` holds."""
    return index * total // count, (index + 1) * total // count


def split_bounds(listed: dict[str, int], start: int, stop: int) -> dict[str, tuple[int, int]]:
    """[start, stop) of the whole source (splits in sorted name order, one after the other)
    as a [start, stop) within each split's listing; a split outside it gets an empty range."""
    bounds, offset = {}, 0
    for name in sorted(listed):
        size = listed[name]
        bounds[name] = (min(max(start - offset, 0), size), min(max(stop - offset, 0), size))
        offset += size
    return bounds


def _fingerprint(value, what: str) -> str:
    if not isinstance(value, str) or not FINGERPRINT.fullmatch(value):
        raise _Invalid(f"{what} is {_show(value)}, not sha256: and 64 hex digits")
    return value


def _part(value: dict, splits: dict) -> None:
    """A part's facts: its index, its range and each split's range, all consistent."""
    count = value["count"]
    index = _count(value.get("index"), "parts.index", count - 1)
    _text(value.get("host"), "parts.host")
    entries = value.get("splits")
    if not isinstance(entries, dict) or sorted(entries) != sorted(splits):
        raise _Invalid(f"parts.splits is {_show(entries)}, not an object with one entry per split "
                       f"({', '.join(sorted(splits))})")
    listed = {}
    for name, entry in entries.items():
        what = f"parts.splits[{name!r}]"
        if not isinstance(entry, dict):
            raise _Invalid(f"{what} is {_show(entry)}, not an object")
        listed[name] = _count(entry.get("listed"), f"{what}.listed", MAX_RECORDS)
    total = value["total"]
    if sum(listed.values()) != total:
        raise _Invalid(f"parts.total is {total}, but the splits list {sum(listed.values())} files")
    start, stop = part_bounds(total, index, count)
    if (value.get("start"), value.get("stop")) != (start, stop):
        raise _Invalid(f"parts.start and parts.stop are {_show(value.get('start'))} and "
                       f"{_show(value.get('stop'))}, not the [{start}, {stop}) that part {index} of {count} "
                       f"of {total} files holds")
    for name, (first, end) in split_bounds(listed, start, stop).items():
        entry, what = entries[name], f"parts.splits[{name!r}]"
        if (entry.get("start"), entry.get("stop")) != (first, end):
            raise _Invalid(f"{what} start and stop are {_show(entry.get('start'))} and {_show(entry.get('stop'))}, "
                           f"not the [{first}, {end}) its part's range gives")
        at = entry.get("skipped_at")
        if (not isinstance(at, list) or any(type(i) is not int for i in at)
                or any(not 0 <= i < end - first for i in at) or any(a >= b for a, b in zip(at, at[1:]))):
            raise _Invalid(f"{what}.skipped_at is {_show(at)}, not increasing positions in [0, {end - first})")
        if splits[name].count != end - first - len(at):
            raise _Invalid(f"split {name!r} holds {splits[name].count} records, but its part range holds "
                           f"{end - first} files of which {len(at)} were left out")


def _merged(value: dict, count: int) -> None:
    """A merged dataset's provenance: one entry per part, in index order."""
    entries = value["merged"]
    if not isinstance(entries, list) or len(entries) != value["count"]:
        raise _Invalid(f"parts.merged is {_show(entries)}, not a list of the {value['count']} parts")
    for index, entry in enumerate(entries):
        what = f"parts.merged[{index}]"
        if not isinstance(entry, dict) or entry.get("index") != index:
            raise _Invalid(f"{what} is {_show(entry)}, not an object for part {index}")
        for key in ("path", "host", "created"):
            _text(entry.get(key), f"{what}.{key}")
        _count(entry.get("count"), f"{what}.count", MAX_BYTES)
    held = sum(entry["count"] for entry in entries)
    if held != count:
        raise _Invalid(f"parts.merged counts {held} records, but the dataset holds {count}")
    if value["total"] < count:
        raise _Invalid(f"parts.total is {value['total']}, fewer than the {count} records held")


def _parts(value, splits: dict) -> dict:
    """The optional "parts" object (module docstring): a part, or a merge of parts."""
    if not isinstance(value, dict) or ("index" in value) == ("merged" in value):
        raise _Invalid(f"parts is {_show(value)}, not an object with either an index or a merged list")
    _fingerprint(value.get("fingerprint"), "parts.fingerprint")
    _count(value.get("count"), "parts.count", MAX_PARTS)
    if value["count"] < 1:
        raise _Invalid("parts.count is 0")
    _count(value.get("total"), "parts.total", MAX_BYTES)
    if "index" in value:
        _part(value, splits)
    else:
        _merged(value, sum(s.count for s in splits.values()))
    return value


def _reencode(value, splits: dict, form=None) -> dict | None:
    if value is None:
        if form is not None:
            raise _Invalid(f"reencode_form is {_show(form)}, but there is no reencode object")
        return None
    if form is not None and form != REENCODE_FORM:
        raise _Invalid(f"reencode_form is {_show(form)}, not {REENCODE_FORM!r}")
    if not isinstance(value, dict) or set(value) != {"max_side", "quality", "counts"}:
        raise _Invalid(f"reencode is {_show(value)}, not an object with max_side, quality and counts")
    if _count(value["max_side"], "reencode max_side", MAX_SIDE) < 1:
        raise _Invalid("reencode max_side is 0")
    if _count(value["quality"], "reencode quality", 100) < 1:
        raise _Invalid("reencode quality is 0")
    counts = value["counts"]
    if not isinstance(counts, dict) or not set(counts) <= set(splits):
        raise _Invalid(f"reencode counts is {_show(counts)}, not an object keyed by the dataset's splits")
    for name, count in counts.items():
        _count(count, f"reencode count of split {name!r}", splits[name].count)
    found = {"max_side": value["max_side"], "quality": value["quality"], "counts": dict(counts)}
    if form is not None:
        found["form"] = form
    return found
