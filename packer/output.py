"""Owns the output path: a staging sibling while packing, an atomic rename when complete.

Nothing ever appears at OUT until the dataset is whole. A pack writes into
`OUT.partial-<pid>` and renames it into place with os.replace; on any error the staging
path is removed. A process killed with SIGKILL cannot clean up, so every run first
removes the staging paths of processes that no longer exist.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator

from .errors import OutputExistsError

PARTIAL = ".partial-"


def staging_path(out: str) -> str:
    return f"{out}{PARTIAL}{os.getpid()}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def remove_stale(out: str) -> list[str]:
    """Remove staging paths beside OUT left by dead processes; return what was removed."""
    folder, name = os.path.split(os.path.abspath(out))
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(folder):
            if not entry.startswith(name + PARTIAL):
                continue
            pid = entry[len(name + PARTIAL):]
            if pid.isdigit() and not pid_alive(int(pid)):
                remove_path(os.path.join(folder, entry))
                removed.append(os.path.join(folder, entry))
    return removed


def refuse_existing(out: str, force: bool) -> None:
    if os.path.lexists(out) and not force:
        raise OutputExistsError(f"{out} already exists (pass --force to replace it, or -o to write elsewhere)",
                                out)


@contextlib.contextmanager
def staged(out: str, force: bool, directory: bool) -> Iterator[str]:
    """Yield a staging path; publish it at OUT only if the block completes."""
    refuse_existing(out, force)
    stage = staging_path(out)
    remove_path(stage)
    try:
        if directory:  # inside the try: an interrupt that lands just after mkdir still cleans up
            os.makedirs(stage)
        yield stage
        publish(stage, out, force)
    except BaseException:  # KeyboardInterrupt too: never leave a partial dataset behind
        remove_path(stage)
        raise


def publish(stage: str, out: str, force: bool) -> None:
    refuse_existing(out, force)  # it may have appeared while we were packing
    if os.path.lexists(out):
        # os.replace cannot replace a non-empty folder: move the old one aside first, so
        # that OUT is never missing a dataset for longer than two renames.
        old = f"{out}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(stage, out)
        remove_path(old)
    else:
        os.replace(stage, out)
