"""The `packer` command's stop signals outside the command itself: while its modules import,
and after it has finished.

A command takes Ctrl-C and SIGTERM its own way once it runs (packer.interrupts; 130 and 143).
Before that, Python's defaults apply: a KeyboardInterrupt traceback, or death by SIGTERM
(status -15). Importing packer and parsing the command line take a few tenths of a second,
in which nothing has been written, so a stop signal there exits at once, with one line and
the command's status. After the command has finished (its result printed, OUT whole or left
alone), the interpreter's shutdown ignores stop signals: it ends in moments, and a signal
there would only turn a finished command's status into a kill. A program that imports
packer keeps its own signals: this applies only when packer runs as the command.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_finished = False  # the command's outcome is decided (finished())


def run_as_command() -> bool:
    """Whether this process is the `packer` command (its script, or `python -m packer`); not
    a process it spawned, which multiprocessing gives the command's sys.argv."""
    argv = list(getattr(sys, "orig_argv", []))
    if "--multiprocessing-fork" in argv:
        return False
    by_module = any(argv[k:k + 2] == ["-m", "packer"] for k in range(len(argv) - 1))
    return by_module or os.path.basename(sys.argv[0] if sys.argv else "") == "packer"


def exit_early(signum, frame) -> None:
    """Before the command runs: nothing is written yet, so stop now, as the command would.
    Put back by a handler's restore after the command finished, it does nothing."""
    if _finished:
        return
    os.write(2, b"interrupted\n" if signum == signal.SIGINT else
             f"stopped by {signal.Signals(signum).name}\n".encode())
    os._exit(128 + signum)


def take_early() -> None:
    """Packer's first act as the command: stop signals exit at once until hand_over()."""
    if run_as_command() and threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                signal.signal(signum, exit_early)


def hand_over() -> None:
    """The command starts: Ctrl-C raises KeyboardInterrupt again, for the command to handle
    (SIGTERM's early handler is replaced by stop_signals_as_interrupts)."""
    if signal.getsignal(signal.SIGINT) is exit_early:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def finished() -> None:
    """The command's work is done (OUT published, or its result known): what it prints from
    here, and the shutdown, ignore stop signals, so its status stands."""
    global _finished
    if run_as_command() and threading.current_thread() is threading.main_thread():
        _finished = True
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
