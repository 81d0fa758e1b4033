"""The one exception family the library raises (the CLI maps it to exit code 1), and how the
untrusted names in messages and warnings are shown."""
from __future__ import annotations

import re

# Characters a terminal acts on instead of showing: C0 and C1 controls, DEL, and the
# bidirectional overrides that reorder a line. Names and texts read from a dataset (class
# names, paths, metadata) or a source's file names are untrusted: printed, they are escaped.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def shown(text) -> str:
    """text with every character in _UNSHOWN written as its escape (\\x1b): one line, shown
    as it is spelled (a name holding a newline cannot make a line of its own)."""
    return _UNSHOWN.sub(lambda m: m.group().encode("unicode_escape").decode(), str(text))


def escaping(format_warning):
    """A warnings.formatwarning that escapes the message as shown() does, then formats it as
    format_warning does (escaping twice changes nothing)."""
    def formatted(message, category, filename, lineno, line=None):
        return format_warning(shown(message), category, filename, lineno, line)

    return formatted


class PackError(Exception):
    """Base class: a message that names the input, what is wrong and what to do."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class SourceError(PackError):
    """The source folder cannot be packed as given (layout, permissions)."""


class BadImageError(PackError):
    """One source file is not a usable image (empty, truncated, not an image, unreadable)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}", path)
        self.reason = reason


class OutputExistsError(PackError):
    """The output path exists and --force was not given."""


class CorruptDataError(PackError):
    """A packed dataset is damaged: bad checksum, bad header, missing record.

    reason, where given, is the message without the leading name of what failed, so a
    caller that knows a better name (a Dataset knows the record's path; a decoder given
    bytes does not) can say it again with that name."""

    def __init__(self, message: str, path: str | None = None, reason: str | None = None):
        super().__init__(message, path)
        self.reason = reason


class ReplacedError(CorruptDataError):
    """A dataset was replaced at its path (pack --force) since the Dataset reading it was
    made: reading on would mix the two, so no on_error setting skips past it."""


class FormatError(PackError):
    """A path is not a packed dataset, or not one this version can read."""
