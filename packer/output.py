"""Owns the output path: the checks on OUT, a staging sibling while writing, a recoverable swap.

A write goes to `OUT.partial-<owner>` beside OUT, owner being `<host>-<pid>-<token>`. Once
the dataset is whole it is renamed `OUT.complete-<owner>`, the mark that it is finished,
and swapped in: an existing OUT is renamed `OUT.old-<owner>`, the complete one renamed to
OUT, and the old one removed (a file replacing a file is one atomic rename). On an error
the staging is removed. A process killed outright cannot clean up, so every run first
settles what dead writers left beside its OUT (tidy): if OUT is missing, a complete
staging is moved in (the swap is finished) or else an old dataset is moved back (rolled
back); every other leftover of a dead owner is removed. OUT is never left missing while
a complete dataset sits beside it.

Only leftovers whose owner is provably gone are touched: same host, pid not alive
(packer.staging, which the remote upload shares, says who owns a name). On a
shared file system a leftover of another host is left alone, with a warning. Names from
older versions (`OUT.partial-<pid>`, and `OUT.old-<pid>` beside one) carry no host: only
the pair, a swap those versions left half done, is settled; a lone `OUT.partial-<pid>`
could be anyone's folder, and is named in a warning, never removed. Nor is any leftover
that is a source of this write, or holds or lies in one.

Before any of that, check_target refuses an OUT that is a source, inside one or holding
one (compared by device and inode, so symlinks and bind mounts cannot hide it), and
--force replaces only a dataset packer provably wrote (packer.replaceable), never other
files or folders.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from dataclasses import dataclass, field
from typing import Iterator

import lmdb

from . import interrupts, replaceable
from .errors import FormatError, PackError
from .formats import detect_format
from .staging import COMPLETE, LEGACY, OLD, OWNED, PARTIAL, Leftover, Owner, new_owner

# Errors of a failed write. py-lmdb reports a failed system call as lmdb.Error("<path>:
# <strerror>"), without an errno.
IO_ERRORS = (OSError, lmdb.Error)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


@dataclass
class Tidied:
    """What settling OUT's leftovers did: paths removed, and notes for the user."""

    removed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def remove_path(path: str) -> bool:
    """Remove a file, link or folder if it is there; False if it could not be removed."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):  # checked first: removing a missing path on a read-only mount is EROFS
            os.remove(path)
    except OSError:
        return False
    return True


def leftovers(out: str) -> list[Leftover]:
    """The staging, complete and old paths beside OUT, by whatever process they were left."""
    folder, name = os.path.split(out)
    try:
        entries = os.listdir(folder)
    except OSError:  # nothing to settle; writing there reports the real problem
        return []
    found = []
    for entry in entries:
        if not entry.startswith(name + "."):
            continue
        rest = entry[len(name):]
        match = OWNED.fullmatch(rest) or LEGACY.fullmatch(rest)
        if match:
            found.append(Leftover(os.path.join(folder, entry), match["stage"],
                                  match.groupdict().get("host"), int(match["pid"])))
    return found


def is_dataset(path: str) -> bool:
    try:
        detect_format(path)
    except (FormatError, OSError):
        return False
    return True


def newest_first(found: list[Leftover]) -> list[Leftover]:
    def mtime(leftover: Leftover) -> int:
        try:
            return os.lstat(leftover.path).st_mtime_ns
        except OSError:
            return 0

    return sorted(found, key=mtime, reverse=True)


def finished(leftover: Leftover, gone: list[Leftover]) -> bool:
    """Whether a dead writer's leftover is a complete new dataset."""
    if leftover.stage == COMPLETE:
        return True
    # Older versions moved OUT aside only once the new one was whole, so their partial
    # beside an old of the same pid is complete.
    return leftover.host is None and leftover.stage == PARTIAL and legacy_beside(gone, OLD, leftover.pid)


def legacy_beside(found: list[Leftover], stage: str, pid: int) -> bool:
    """Whether found holds an older version's `OUT.<stage>-<pid>`."""
    return any(other.host is None and other.stage == stage and other.pid == pid for other in found)


def restore(out: str, gone: list[Leftover]) -> tuple[Leftover, str] | None:
    """With OUT missing: move in a dead writer's complete dataset, else move its old one back."""
    complete = [leftover for leftover in gone if finished(leftover, gone)]
    old = [leftover for leftover in gone if leftover.stage == OLD]
    for leftover in newest_first(complete) + newest_first(old):
        if not is_dataset(leftover.path):
            continue
        try:
            os.replace(leftover.path, out)
        except OSError:
            continue
        if leftover in complete:
            return leftover, (f"finished replacing {out}: moved in the complete dataset {leftover.path}, "
                              "left by an interrupted pack")
        return leftover, f"restored {out} from {leftover.path}, left by an interrupted pack"
    return None


def ours(leftover: Leftover, found: list[Leftover]) -> bool:
    """Whether packer surely made this path. An older version's name (`OUT.partial-<pid>`,
    `OUT.old-<pid>`) could be a user's own: only the pair of one pid is that version's."""
    if leftover.host is not None:
        return True
    other = OLD if leftover.stage == PARTIAL else PARTIAL
    return legacy_beside(found, other, leftover.pid)


def overlaps(path: str, sources: list[str]) -> bool:
    """Whether path is one of sources, holds one or lies in one."""
    return any(depth_of(source, path) is not None or depth_of(path, source) is not None for source in sources)


def left_alone(out: str, found: list[Leftover], sources: list[str]) -> list[str]:
    """Notes for the leftovers that tidy may not touch, and that look like packer's."""
    notes = []
    for leftover in found:
        if leftover.here and not leftover.owner_gone():  # a running pack's (this one's own parts too)
            continue
        remove = f"remove it (rm -rf '{leftover.path}')"
        if overlaps(leftover.path, sources):
            notes.append(f"left {leftover.path} alone: it is named like a leftover of a pack to {out}, but this "
                         f"write reads from it; rename it if it is not one")
        elif not leftover.here:
            notes.append(f"left {leftover.path} alone: it belongs to a pack on host {leftover.host} "
                         f"(pid {leftover.pid}); if no pack to {out} is running there, {remove}")
        elif not ours(leftover, found) and leftover.stage == PARTIAL:
            notes.append(f"left {leftover.path} alone: older packers named their staging so, but it may be "
                         f"yours; if it is an interrupted pack's, {remove}")
    return notes


def tidy(out: str, sources: list[str] = ()) -> Tidied:
    """Settle what interrupted writes to OUT left beside it (see the module docstring); a
    leftover that is one of sources, or holds or lies in one, is never touched."""
    found = leftovers(out)
    gone = [leftover for leftover in found
            if ours(leftover, found) and leftover.owner_gone() and not overlaps(leftover.path, sources)]
    tidied = Tidied(notes=left_alone(out, found, sources))
    if not os.path.lexists(out):
        restored = restore(out, gone)
        if restored:
            gone.remove(restored[0])
            tidied.notes.append(restored[1])
    for leftover in gone:
        if remove_path(leftover.path):
            tidied.removed.append(leftover.path)
        else:
            tidied.notes.append(f"could not remove {leftover.path}, left by an interrupted pack; remove it "
                                f"(rm -rf '{leftover.path}')")
    return tidied


def lineage(path: str) -> Iterator[str]:
    """path, then each folder above it up to the root."""
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def depth_of(folder: str, path: str) -> int | None:
    """How many levels above path folder is (0: the same), or None if not above it.

    Compared by device and inode, so symlinks, bind mounts and `..` cannot hide a match.
    """
    try:
        wanted = os.stat(folder)
    except OSError:
        return None
    for depth, above in enumerate(lineage(os.path.realpath(path))):
        with contextlib.suppress(OSError):
            if os.path.samestat(os.stat(above), wanted):
                return depth
    return None


def refuse_overlap(out: str, source: str) -> None:
    """Refuse an OUT that is source, lies inside it or holds it: writing there destroys it."""
    depth = depth_of(source, out)
    if depth == 0:
        raise PackError(f"{source}: writing OUT at {out} would write over it; pass -o OUT to write elsewhere", out)
    if depth is not None:
        raise PackError(f"{out}: OUT lies inside {source}, which it is made from; pass -o with a path outside "
                        "it", out)
    if depth_of(out, source) is not None:
        raise PackError(f"{out}: OUT holds {source}, which it is made from, and replacing OUT would delete it; "
                        "pass -o with a path outside it", out)


def refuse_missing_folder(out: str) -> None:
    folder = os.path.dirname(out)
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.lexists(folder) else "does not exist"
        raise PackError(f"{folder}: the folder to write OUT {out} in {what}; create it (mkdir -p) or choose "
                        "-o elsewhere", out)


def refuse_existing(out: str, force: bool, notes: list[str] = ()) -> None:
    """Refuse an existing OUT without force, and with force anything but a dataset packer wrote."""
    replaceable.refuse_existing(out, os.path.lexists(out), force, lambda: replaceable.problem(out),
                                "files or folders", notes)


def check_target(out: str, sources: list[str], force: bool) -> Tidied:
    """Check that OUT (absolute) may be written from sources, after settling its leftovers."""
    for source in sources:
        refuse_overlap(out, os.fspath(source))
    refuse_missing_folder(out)
    tidied = tidy(out, [os.fspath(source) for source in sources])
    refuse_existing(out, force, tidied.notes)
    return tidied


@contextlib.contextmanager
def staged(out: str, force: bool, directory: bool) -> Iterator[str]:
    """Yield a staging path; publish it at OUT only if the block completes."""
    refuse_existing(out, force)
    owner = new_owner()
    stage = owner.path(out, PARTIAL)
    try:
        if directory:  # inside the try: an interrupt that lands just after mkdir still cleans up
            os.mkdir(stage)
        yield stage
        interrupts.check_pending()  # a Ctrl-C dropped while the writer finished
        publish(stage, out, force, owner)
    except BaseException:  # KeyboardInterrupt too: never leave a partial dataset behind
        remove_path(stage)
        remove_path(owner.path(out, COMPLETE))
        raise


def publish(stage: str, out: str, force: bool, owner: Owner) -> None:
    refuse_existing(out, force)  # it may have appeared while we were writing
    complete = owner.path(out, COMPLETE)
    interrupts.hold_stops(out)  # past here nothing is undone: a stop signal waits for the end
    os.replace(stage, complete)  # from here on, a later run finishes the swap if this one dies
    if not os.path.lexists(out) or not (os.path.isdir(complete) or os.path.isdir(out)):
        os.replace(complete, out)
        return
    # os.replace cannot put a folder over a folder (or a file over one): move the old one
    # aside first. A kill between the two renames leaves OUT missing beside the complete
    # dataset, which the next run moves in (tidy).
    old = owner.path(out, OLD)
    os.replace(out, old)
    try:
        os.replace(complete, out)
    except BaseException:
        if not os.path.lexists(out):
            os.replace(old, out)
        raise
    remove_path(old)


def error_code(exc: BaseException) -> int | None:
    """The errno of a failed write, from an OSError or from the strerror text of a library's error."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    text = str(exc)
    return next((code for code in NO_SPACE + NOT_WRITABLE if os.strerror(code) in text), None)


def write_error(exc: BaseException, out: str, fmt: str) -> PackError:
    """The PackError for an I/O error met while writing OUT: what failed, and what to do."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        reason = f"{exc.strerror}: {exc.filename}"
    else:
        reason = str(exc) or type(exc).__name__
    code = error_code(exc)
    if code in NO_SPACE:
        return PackError(f"{out}: writing the {fmt} dataset failed ({reason}); nothing was written at OUT "
                         "(free some space or choose -o elsewhere)", out)
    if code in NOT_WRITABLE:
        return PackError(f"{out}: OUT is not writable ({reason}); nothing was written there (make "
                         f"{os.path.dirname(out)} writable or choose -o elsewhere)", out)
    return PackError(f"{out}: writing the {fmt} dataset failed ({reason}); nothing was written at OUT", out)
