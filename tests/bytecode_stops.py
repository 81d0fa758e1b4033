"""A Ctrl-C at every bytecode: a trace function raises KeyboardInterrupt where a stop
signal's handler could, to show that a consumer's teardown ends wherever it lands.

Python runs a signal's handler in the main thread between two bytecodes, wherever it is;
one raised just after `with condition:` took its lock leaves the lock held, and the
threads that need it (and a teardown that waits for them) wait forever. A trace function
with opcode events (sys.settrace, frame.f_trace_opcodes) can raise at any one of them.
"""
from __future__ import annotations

import sys
import threading
from itertools import count
from pathlib import Path

TEARDOWN_S = 15.0  # a teardown taking longer than this counts as hung


def raising_at(bytecode: int, spared: tuple, raised: list):
    """A trace function that raises KeyboardInterrupt at the given bytecode this thread runs
    from now on, once. Bytecodes run inside a function named in `spared` are not counted:
    one that holds stop signals off (packer.engine.stop_signals_deferred) is safe from them."""
    seen = 0

    def trace(frame, event, arg):
        nonlocal seen
        frame.f_trace_opcodes = True
        if event == "opcode" and not raised and not runs_inside(frame, spared):
            if seen == bytecode:
                raised.append(f"{frame.f_code.co_name} in {Path(frame.f_code.co_filename).name}")
                raise KeyboardInterrupt
            seen += 1
        return trace
    return trace


def runs_inside(frame, names: tuple) -> bool:
    while frame is not None:
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back
    return False


def interrupted_at_every_bytecode(start, spared: tuple = ()) -> list[str]:
    """For k = 0, 1, ...: take two items of start(), raise KeyboardInterrupt at the k-th
    bytecode on the way to the third, close the iterator, and require all that to end
    within TEARDOWN_S. Returns where each KeyboardInterrupt was raised, in order."""
    places = []
    for bytecode in count():
        raised: list = []
        failed: list = []

        def take_and_interrupt():
            try:
                loaded = start()
                next(loaded), next(loaded)
                sys.settrace(raising_at(bytecode, spared, raised))
                try:
                    next(loaded)
                except KeyboardInterrupt:
                    pass
                finally:
                    sys.settrace(None)
                loaded.close()
            except BaseException as exc:  # e.g. a lock released that was never taken
                failed.append(exc)

        consumer = threading.Thread(target=take_and_interrupt, daemon=True)
        consumer.start()
        consumer.join(TEARDOWN_S)
        assert not consumer.is_alive(), f"hung after a KeyboardInterrupt at bytecode {bytecode}: {raised}"
        assert not failed, f"after a KeyboardInterrupt at bytecode {bytecode} ({raised}): {failed[0]!r}"
        if not raised:  # the third item came in fewer bytecodes than k: every one was tried
            return places
        places += raised
