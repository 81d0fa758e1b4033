"""A remote dataset's manifest, OUT/packer.json: the completion marker and the list of objects
that a folder format's upload writes last (packer.upload), and that detection and
--force read back (packer.formats.detect_remote) as an untrusted file.

{"packer_remote": 1, "format": "<a folder format: lmdb, wds>", "objects": {"<key relative to OUT/>": <size in bytes>, ...}},
itself not listed. A one-file format's dataset (hdf5) is one object, OUT itself, and has none.
"""
from __future__ import annotations

import json

from ..errors import PackError

MANIFEST = "packer.json"
MANIFEST_VERSION = 1
MANIFEST_LIMIT = 64 << 20  # bytes: a manifest names each object once, in a few dozen bytes


def parse_manifest(raw: bytes, url: str, formats) -> dict:
    """A packer.json's content, checked: an untrusted file (see the module docstring).
    formats: the names a manifest may give, the folder formats (packer.formats.folder_formats)."""
    def bad(what: str) -> PackError:
        return PackError(f"{url}: not a valid packer manifest ({what}); the dataset is damaged or was not "
                         "written by packer", url)

    if len(raw) > MANIFEST_LIMIT:
        raise bad(f"{len(raw)} bytes")
    try:
        found = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"not JSON: {exc}") from exc
    if not isinstance(found, dict) or found.get("packer_remote") != MANIFEST_VERSION:
        raise bad(f"packer_remote is not {MANIFEST_VERSION}")
    if found.get("format") not in formats:  # a one-file dataset is one object, with no manifest
        raise bad(f"format {found.get('format')!r}")
    objects = found.get("objects")
    if not isinstance(objects, dict) or not objects:
        raise bad("no objects")
    for key, size in objects.items():
        if not safe_key(key):
            raise bad(f"object name {key!r}")
        if type(size) is not int or size < 0:
            raise bad(f"size {size!r} of {key!r}")
    return found


def safe_key(key) -> bool:
    """A relative object name that stays inside the dataset."""
    return (isinstance(key, str) and 0 < len(key) <= 1024 and not key.startswith("/") and "\\" not in key
            and "\0" not in key and all(part not in ("", ".", "..") for part in key.split("/"))
            and key != MANIFEST)


def manifest_bytes(fmt: str, objects: dict[str, int]) -> bytes:
    return json.dumps({"packer_remote": MANIFEST_VERSION, "format": fmt, "objects": objects},
                      sort_keys=True, separators=(",", ":")).encode()
