"""How a format's `foreign` hook words what packer did not write in a dataset at OUT, which
keeps --force from replacing it (packer.replaceable, packer.upload)."""
from __future__ import annotations

import os
import stat

SHOWN_NAMES = 5


def not_a_file(path: str) -> str | None:
    """Packer writes regular files: a link or anything else in their place is not its."""
    return None if stat.S_ISREG(os.lstat(path).st_mode) else f"holds {path}, which is not a regular file"


def unexpected(paths: list[str], fmt: str) -> str | None:
    if not paths:
        return None
    return f"holds a {fmt} dataset and also {listing(paths)}, which packer did not write"


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


def unnamed(path: str, named: set[str]) -> list[str]:
    """Every entry under the folder path that is not one of the named files (relative, "/"-separated,
    as an index names them) or the folders holding them, or is not a regular file."""
    folders = {name.split("/", 1)[0] for name in named if "/" in name}
    extra = []
    for root, dirs, files in os.walk(path, onerror=lambda exc: extra.append(f"{exc.filename} (cannot be listed)")):
        relative = os.path.relpath(root, path)
        for name in dirs + files:
            entry = name if relative == "." else f"{relative}/{name}"
            full = os.path.join(root, name)
            if entry in folders and os.path.isdir(full) and not os.path.islink(full):
                continue
            if entry not in named or not_a_file(full):
                extra.append(full)
        dirs[:] = [name for name in dirs if (name if relative == "." else f"{relative}/{name}") in folders]
    return extra
