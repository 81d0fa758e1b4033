"""A streamed WebDataset sample's label, and the checksum and label packer stored in its .json
member, checked as WDSDataset reads it (other tools' .json members are left alone)."""
from __future__ import annotations

import json

from packer import checksum as record_checksums
from packer.errors import CorruptDataError
from packer.records import PATH_ENCODING_ERRORS


def sample_label(where: str, parts: dict, image_suffix: str, check_crc: bool, classes: int = 0) -> int:
    """The sample's label (-1 without a .cls member), checked against packer's .json member
    and, where the class list is known (classes > 0), to be one of its indexes."""
    label = -1
    if parts.get("cls") is not None:
        try:
            label = int(parts["cls"])
        except ValueError as exc:
            raise CorruptDataError(f"{where}: .cls member {parts['cls'][:40]!r} is not an integer label; the "
                                   "shard is damaged (re-create it, or read with on_error='skip')", where) from exc
        if classes and not 0 <= label < classes:
            raise CorruptDataError(f"{where}: label {label} is outside the {classes} classes of the dataset's "
                                   f"index (0 to {classes - 1}); the shard is not this dataset's or is damaged "
                                   "(re-pack, or read with on_error='skip')", where)
    meta = parts.get("json")
    # Other tools' .json members hold their own fields: only packer's (with a checksum kind's key) are checked.
    if check_crc and meta is not None and any(key in meta for key in KIND_KEYS):
        check_stored(where, parts[image_suffix], label, meta)
    return label


# The .json keys that name a record checksum kind (packer.checksum), as they appear in the member.
KIND_KEYS = tuple(b'"%s"' % kind.encode() for kind in record_checksums.KINDS)


def stored_checksum(stored) -> tuple[str, int] | None:
    """(kind, value) of the record checksum a parsed .json member holds; None in another tool's."""
    if isinstance(stored, dict):
        for kind in record_checksums.KINDS:
            if type(stored.get(kind)) is int:
                return kind, stored[kind]
    return None


def check_stored(where: str, image: bytes, label: int, meta: bytes) -> None:
    """Raise unless the image's checksum (of the kind its key names: crc32 or xxh3), and the
    label when the json has one, match packer's json.

    A json whose checksum (or label) is not an integer is another tool's, and is not checked."""
    try:
        stored = json.loads(meta.decode("utf-8", PATH_ENCODING_ERRORS))
    except (ValueError, RecursionError) as exc:
        raise CorruptDataError(f"{where}: the .json member is damaged ({exc}; {meta[:60]!r}), so the image "
                               "cannot be checked (re-create the shard, or read with on_error='skip')", where) from exc
    found = stored_checksum(stored)
    if found is None:
        return
    kind, value = found
    path = stored.get("path")
    if record_checksums.record_checksum(image, kind) != value:
        raise CorruptDataError(f"{where} ({path}): checksum mismatch, the stored image is damaged (run packer verify; "
                               "re-pack from the source, or read with on_error='skip')", where)
    if type(stored.get("label")) is int and stored["label"] != label:
        raise CorruptDataError(f"{where} ({path}): label {label} from the .cls member, {stored['label']} in the "
                               ".json member; the shard is damaged (re-pack from the source, or read with "
                               "on_error='skip')", where)
