"""A forked child's hands off its parent's remote connections.

fsspec runs every async backend (http(s), s3, gs, ...) on one event loop of its own, in a
thread. A child forked from a process that has read a URL (a DataLoader worker, a
multiprocessing child) inherits that loop, its epoll instance and its pooled connections,
and fsspec, seeing a new process, drops the filesystems it inherited: their finalizers then
close the inherited connections through the inherited loop. The epoll instance is the very
one the parent's loop waits on (fork shares it), so each close takes the parent's connection
out of the parent's loop: the parent's next request on it is sent, answered, and never read,
until the socket read timeout gives up (a minute by default), once per such connection.

So in the child, just after fork, the inherited loop gets an epoll instance of its own and
each of its sockets is swapped for /dev/null: whatever the child does with what it inherited
(unregister, close, a TLS close_notify) no longer reaches the parent's loop or connections.
"""
from __future__ import annotations

import os
import selectors
import sys

_parents_loop = None  # fsspec's loop as it was when this process forked


def note_loop() -> None:
    """Before fork: remember fsspec's loop (fsspec forgets it in the child)."""
    global _parents_loop
    asyn = sys.modules.get("fsspec.asyn")  # never imported here: no loop without it
    _parents_loop = asyn.loop[0] if asyn is not None else None


def isolate_inherited_loop() -> None:
    """In the child: the inherited loop's selector and sockets replaced, the parent's left as they are."""
    global _parents_loop
    loop, _parents_loop = _parents_loop, None
    selector = getattr(loop, "_selector", None)  # asyncio's selector loops; others (uvloop) have none to share
    if selector is None or loop.is_closed():
        return
    fds = list(selector.get_map())
    loop._selector = selectors.DefaultSelector()
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            os.dup2(devnull, fd)  # the child's copy of the descriptor, not the parent's socket
    finally:
        os.close(devnull)
    selector.close()  # the child's copy of the shared epoll descriptor
    if getattr(loop, "_thread_id", None) is not None:
        loop._thread_id = None  # is_running() is False: the finalizers close the connections at once


def clear_note() -> None:
    global _parents_loop
    _parents_loop = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=note_loop, after_in_child=isolate_inherited_loop, after_in_parent=clear_note)
