"""The HDF5 file a Reader reads, through h5py and a plain descriptor for preads: opened in each
process on first use, locally (one h5py file per process and file, checked to be the file the
reader read the metadata of) or over a packer.remote byte source, and closed in a thread where
closing cannot deadlock h5py (_orphans)."""
from __future__ import annotations

import contextlib
import functools
import threading

import h5py

from ..errors import CorruptDataError, FormatError
from ..remote import source as remote_source
from . import _handle, _io
from ._tables import dataset_identity, replaced_error

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def open_file(path: str, identity: tuple) -> h5py.File:
    """The HDF5 file at path, checked to be the file with this identity."""
    # locking=False: HDF5's file locks fail on NFS and other network filesystems, and the
    # file is immutable. rdcc_nbytes=0: read exactly the requested bytes (module docstring).
    try:
        f = h5py.File(path, "r", locking=False, rdcc_nbytes=0)
    except OSError as exc:
        raise CorruptDataError(f"{path}: cannot open the HDF5 file ({exc}); it is damaged or was not "
                               "fully copied (re-pack it, or restore it from a copy)", path) from exc
    if dataset_identity(path) != identity:  # replaced between reading its identity and opening it
        f.close()
        raise replaced_error(path)
    return f


# Handles of remote readers that were garbage-collected: closed by the next thread that opens
# a remote file. A finalizer runs in whatever thread the collector runs in, fsspec's IO thread
# included, and closing an h5py file there deadlocks when another thread holds h5py's lock
# while it waits for that IO thread to fetch bytes for h5py.
# A local file's last close does the same (it closes the shared h5py file), so a reader
# finalized off the main thread is orphaned too, local or remote: its close (a callable) is
# run by the next open, in the opening thread.
_orphans: list = []


def close_orphans() -> None:
    while _orphans:
        close = _orphans.pop()
        with contextlib.suppress(Exception):
            close()


def open_remote_file(source) -> h5py.File:
    """h5py's view of a remote HDF5 file, read through source (a packer.remote byte source)."""
    close_orphans()
    if source.pread(len(HDF5_SIGNATURE), 0) != HDF5_SIGNATURE:
        raise FormatError(f"{source.url}: not an HDF5 file", source.url)
    try:
        return h5py.File(remote_source.SourceFile(source), "r", rdcc_nbytes=0)
    except OSError as exc:
        if isinstance(exc, remote_source.RemoteError):
            raise
        raise CorruptDataError(f"{source.url}: cannot open the HDF5 file ({exc}); it is damaged or was not "
                               "fully uploaded (upload it again)", source.url) from exc


def close_file(f: h5py.File) -> None:
    f.close()


class HDF5File:
    """An HDF5 Reader's handle, (h5py file, its split's images dataset, descriptor), opened and
    closed for LazyHandle (the Reader gives path, split, identity, remote, open_shared and
    open_identified)."""

    def _open(self):
        close_orphans()
        if self.remote is None:
            f, fd = self.open_shared(open_file, close_file)
        else:
            fd = self.open_identified()
            f = open_remote_file(fd)
        try:
            images = f[self.split]["images"]
            if not isinstance(images, h5py.Dataset):
                raise KeyError("not a dataset")
        except (KeyError, OSError, ValueError) as exc:
            self._close((f, None, fd))
            raise CorruptDataError(f"{self.path}: no readable {self.split}/images dataset ({exc}); "
                                   "the file is damaged, re-pack it", self.path) from exc
        return f, images, fd

    def __del__(self):
        if self.exiting:  # see LazyHandle.exiting
            return
        if self.is_open and (self.remote is not None or threading.current_thread() is not threading.main_thread()):
            _orphans.append(functools.partial(self._close_handle, self._handle, self.path, self.identity,
                                              self.remote is None))  # see _orphans
            self._handle = None
            return
        super().__del__()

    @staticmethod
    def _close_handle(handle, path: str, identity, local: bool) -> None:
        _io.close(handle[2])
        if local:
            _handle.release(path, identity)
        else:
            handle[0].close()

    def _close(self, handle) -> None:
        self._close_handle(handle, self.path, self.identity, self.remote is None)

