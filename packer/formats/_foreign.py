"""How a format's `foreign` hook words what packer did not write in a dataset at OUT, which
keeps --force from replacing it (packer.replaceable, packer.remote.upload)."""
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
