"""The one exception family the library raises (the CLI maps it to exit code 1), and how the
untrusted names in messages and warnings are shown: escaped, and with URL credentials redacted."""
from __future__ import annotations

import json
import re
from urllib.parse import unquote_plus

# Characters a terminal acts on instead of showing: C0 and C1 controls, DEL, and the
# bidirectional overrides that reorder a line. Names and texts read from a dataset (class
# names, paths, metadata) or a source's file names are untrusted: printed, they are escaped.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


# A URL inside any text: scheme://, then up to a space, a quote or an angle bracket that ends
# it in a message, a repr or JSON, less the punctuation of the sentence after it ("URL: why").
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s'\"<>`]*?)(?=[:;,.)\]]*(?:[\s'\"<>`]|$))")
# Query parameters that carry a secret: presigned S3 (both signature versions), GCS, Azure SAS,
# and the usual token and key spellings. Compared lower-cased; any name containing one of
# SECRET_PARTS counts too.
SECRET_PARAMS = {"x-amz-signature", "x-amz-credential", "x-amz-security-token", "signature", "awsaccesskeyid",
                 "x-goog-signature", "x-goog-credential", "googleaccessid", "sig", "key", "apikey", "code"}
SECRET_PARTS = ("token", "secret", "password", "passwd", "signature", "credential", "api_key", "access_key")
REDACTED = "***"


def redact(text) -> str:
    """text with the credentials of every URL in it replaced by ***: the user and password
    (`https://***@host/...`) and the value of each query parameter that carries a secret
    (SECRET_PARAMS, SECRET_PARTS). Everything else is left as it is, so the URL still says
    which object was meant. The one function every place that shows a URL goes through:
    errors, warnings, reprs, progress, --json output and written metadata."""
    return _URL.sub(_redacted_url, str(text))


def redacted(value):
    """A JSON value (metadata, --json output) with redact() applied to every string in it."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redacted(key): redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(item) for item in value]
    return value


def _redacted_url(match: re.Match) -> str:
    rest = match["rest"]
    authority_end = len(rest)
    for mark in "/?#":
        found = rest.find(mark)
        if found != -1:
            authority_end = min(authority_end, found)
    user_end = rest.rfind("@", 0, authority_end)
    if user_end != -1:
        rest = REDACTED + rest[user_end:]
    query = rest.find("?")
    if query != -1:
        end = rest.find("#", query)
        end = len(rest) if end == -1 else end
        params = [_redacted_param(param) for param in rest[query + 1:end].split("&")]
        rest = rest[:query + 1] + "&".join(params) + rest[end:]
    return match["scheme"] + rest


def _redacted_param(param: str) -> str:
    name, equals, value = param.partition("=")
    key = unquote_plus(name).lower()
    if equals and value and (key in SECRET_PARAMS or any(part in key for part in SECRET_PARTS)):
        return f"{name}={REDACTED}"
    return param


def shown(text) -> str:
    """text with URL credentials redacted and every character in _UNSHOWN written as its
    escape (\\x1b): one line, shown as it is spelled (a name holding a newline cannot make
    a line of its own)."""
    return _UNSHOWN.sub(lambda m: m.group().encode("unicode_escape").decode(), redact(text))


def json_shown(value) -> str:
    """value as JSON text, names as they are (for scripts), with every character in _UNSHOWN
    written as its JSON escape (\\u202e): json.dumps escapes only C0 controls, and --json
    output printed to a terminal must not reorder or retitle it either."""
    return _UNSHOWN.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


def escaping(format_warning):
    """A warnings.formatwarning that escapes the message as shown() does, then formats it as
    format_warning does (escaping twice changes nothing)."""
    def formatted(message, category, filename, lineno, line=None):
        return format_warning(shown(message), category, filename, lineno, line)

    return formatted


class PackError(Exception):
    """Base class: a message that names the input, what is wrong and what to do."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(redact(message))  # messages end up in logs, tracebacks and issues
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
