"""The one exception family the library raises; the CLI maps it to exit code 1."""
from __future__ import annotations


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


class FormatError(PackError):
    """A path is not a packed dataset, or not one this version can read."""
