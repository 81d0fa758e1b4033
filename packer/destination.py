"""Where a write goes: a folder on this machine, or a key in an object store (s3://bucket/key).

pack, convert and merge write through a Destination, chosen from the OUT string alone
(destination_for), so the library takes a URL as the command line does. Each kind owns the
whole life of its OUT: the checks before anything is written (a source never overwritten,
--force replacing only a dataset packer wrote), settling what dead writers left beside OUT,
staging, and publishing the complete dataset.

- FolderDestination: checked and settled in place (packer.output.check_target: OUT not a
  source, its folder there, leftovers settled, an existing OUT refused unless --force and
  a dataset packer wrote), then written through packer.output's staging sibling and swap.
- StoreDestination: checked and settled at the store first (bucket, credentials, OUT,
  leftovers: packer.upload), written into a local staging folder through a
  FolderDestination there, then uploaded and published (packer.upload.upload_dataset); the
  folder is removed either way.

write(fmt, sources, into) refuses what OUT may not be before anything is written, then runs
into(local, force), the pipeline's own write to a local path, and returns its PackResult
naming OUT as the user gave it, with the notes of the settling. The pipelines check nothing
about OUT themselves: a folder and a store refuse the same things, each its own way.
"""
from __future__ import annotations

import dataclasses
import os
import posixpath
import shutil
import tempfile
from typing import Any, Callable, Protocol

from .errors import PackError
from .interrupts import Interrupted
from .output import check_target
from .remote import is_url
from .remote.retry import RETRIES

# A pipeline's write to a local path: into(local out, force) -> its PackResult (packer.writing).
WriteLocal = Callable[[str, bool], Any]


class Destination(Protocol):
    """An OUT that a pipeline writes a dataset to."""

    out: str

    def write(self, fmt: str, sources: list[str], into: WriteLocal) -> Any:
        """Refuse an OUT that may not be written from sources (the paths the pipeline reads),
        then into(local path, force): the pipeline writing fmt; its result, naming OUT."""


class FolderDestination:
    """OUT on a file system: checked and settled there, then written in place (packer.output
    stages and swaps it)."""

    def __init__(self, out: str | os.PathLike, force: bool = False):
        self.out = os.path.abspath(os.fspath(out))
        self.force = force

    def write(self, fmt: str, sources: list[str], into: WriteLocal) -> Any:
        tidied = check_target(self.out, [os.fspath(source) for source in sources], self.force)
        result = into(self.out, self.force)
        return dataclasses.replace(result, warnings=tidied.notes + result.warnings,
                                   removed_stale=tidied.removed + result.removed_stale)


class StoreDestination:
    """OUT in an object store: checked there, packed in a local staging folder, uploaded."""

    def __init__(self, url: str, force: bool = False, staging_dir: str | os.PathLike | None = None,
                 storage_options: dict | None = None, retries: int = RETRIES):
        self.out, self.force = url, force
        self.staging_dir = None if staging_dir is None else os.fspath(staging_dir)
        self.storage_options, self.retries = storage_options, retries

    def write(self, fmt: str, sources: list[str], into: WriteLocal) -> Any:
        """Fail before packing if OUT cannot take the dataset; else pack it locally, then
        upload and publish it (packer.upload's module docstring says how)."""
        from . import upload

        target = upload.open_target(self.out, self.storage_options, self.retries)
        upload.check_bucket(target)
        removed, notes = upload.tidy(target)
        upload.refuse_existing(target, self.force, notes)
        check_writable(target)
        folder = make_staging_dir(self.staging_dir, target)
        try:
            local = os.path.join(folder, posixpath.basename(target.path))
            result = self.write_local(FolderDestination(local), fmt, sources, into, folder, target.url)
            notes += upload.upload_dataset(local, self.out, fmt, force=self.force, target=target, checked=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return dataclasses.replace(result, out=target.url, warnings=notes + result.warnings,
                                   removed_stale=removed + result.removed_stale)

    @staticmethod
    def write_local(local: FolderDestination, fmt: str, sources: list[str], into: WriteLocal, folder: str,
                    url: str) -> Any:
        """The write to the local staging folder, its errors naming the URL: a stop is the URL's, a
        problem in the folder says where it is (--staging-dir inside a source is refused there)."""
        try:
            return local.write(fmt, sources, into)
        except Interrupted:
            raise Interrupted(url) from None
        except PackError as exc:
            if folder not in str(exc):
                raise
            raise PackError(f"{exc} [{url} is packed in {folder} before it is uploaded; --staging-dir "
                            "(or TMPDIR) chooses where]", exc.path) from exc


def destination_for(out: str | os.PathLike | None, default: Callable[[], str], *, force: bool = False,
                    staging_dir: str | os.PathLike | None = None, storage_options: dict | None = None,
                    retries: int = RETRIES) -> Destination:
    """The Destination that OUT names: a URL (s3://bucket/key) is a store, anything else a folder
    path (None: default(), the pipeline's default OUT beside its source). staging_dir and
    storage_options apply to a URL only."""
    if out is not None and is_url(os.fspath(out)):
        return StoreDestination(os.fspath(out), force, staging_dir, storage_options, retries)
    given = [name for name, value in (("staging_dir", staging_dir), ("storage_options", storage_options))
             if value is not None]
    if given:
        raise PackError(f"{' and '.join(given)} apply to an out given as a URL (s3://bucket/key) only, not to "
                        f"{out if out is not None else 'the default out, a local path'}")
    return FolderDestination(default() if out is None else out, force)


def check_writable(target) -> None:
    """Write and delete a probe object beside OUT: refused credentials fail now, not after the pack."""
    from .staging import PARTIAL, new_owner
    from .upload import PROBE, put_bytes, remove

    probe = new_owner().path(target.path, PARTIAL)
    put_bytes(target, f"{probe}/{PROBE}", b"")
    remove(target, probe)


def make_staging_dir(staging_dir: str | None, target) -> str:
    parent = staging_dir or tempfile.gettempdir()
    if not os.path.isdir(parent):
        raise PackError(f"{parent}: the staging folder to pack {target.url} in before uploading does not exist; "
                        "create it or pass --staging-dir (or TMPDIR) elsewhere", parent)
    try:
        return tempfile.mkdtemp(prefix="packer-upload-", dir=parent)
    except OSError as exc:
        raise PackError(f"{parent}: cannot make a staging folder there ({exc.strerror}); pass --staging-dir "
                        "with a writable folder that can hold the whole dataset", parent) from exc
