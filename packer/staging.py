"""Who owns a staging path: the owner in its name (host, PID namespace, pid, a token for one write),
and whether that owner is provably gone.

Shared by a local OUT (packer.output: `OUT.partial-<owner>` beside it) and a remote one
(packer.upload: the staging prefix `OUT.partial-<owner>/`), so both tell a dead writer's
leftover from a running one's the same way. Only the same host may judge: the host is the host
name, and, in a PID namespace of its own (a container), that namespace, since containers that
share a host name (host networking) do not see each other's pids.
"""
from __future__ import annotations

import os
import re
import secrets
import socket
from dataclasses import dataclass

PARTIAL, COMPLETE, OLD = "partial", "complete", "old"
INIT_PID_NAMESPACE = 0xEFFFFFFC  # the inode of the host's own PID namespace (Linux's PROC_PID_INIT_INO)


def host_id() -> str:
    """This host as staging names carry it: its name, with its PID namespace where that is not
    the host's own, so a pid is only checked by a process that sees the same pids."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "localhost"
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux, or no /proc: pids are the host's
        return name
    return name if namespace == INIT_PID_NAMESPACE else f"{name}.pidns{namespace}"


HOST = host_id()
OWNED = re.compile(r"\.(?P<stage>partial|complete|old)-(?P<host>[A-Za-z0-9._-]+)-(?P<pid>\d+)-[0-9a-f]{16}")
LEGACY = re.compile(r"\.(?P<stage>partial|old)-(?P<pid>\d+)")


@dataclass(frozen=True)
class Owner:
    """Who writes a staging path: this host, this process, and a token for this one write."""

    host: str
    pid: int
    token: str

    def path(self, out: str, stage: str) -> str:
        return f"{out}.{stage}-{self.host}-{self.pid}-{self.token}"


@dataclass(frozen=True)
class Leftover:
    """A staging, complete or old path found beside OUT (a folder's sibling, or a store's
    prefix), and whether its owner is provably gone."""

    path: str
    stage: str
    host: str | None  # None: a local name from an older version, which had no host in it
    pid: int

    @property
    def here(self) -> bool:
        """Whether this host may judge the owner: its own, or an older version's local name."""
        return self.host in (None, HOST)

    def owner_gone(self) -> bool:
        return self.here and not pid_alive(self.pid)


def new_owner() -> Owner:
    return Owner(HOST, os.getpid(), secrets.token_hex(8))


def pid_alive(pid: int) -> bool:
    """Whether pid names a live process on this host (a pid checked only where HOST matches the owner's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    except OverflowError:  # no such pid can exist
        return False
    return True
