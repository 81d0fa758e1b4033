"""What went wrong with a remote object, in words: the URL, the cause, and what to check.

fsspec backends raise their own kinds: s3fs turns S3's error codes into FileNotFoundError
and PermissionError (keeping botocore's ClientError, with the code, as the cause), botocore
and aiohttp raise their own connection and timeout errors, HTTP servers answer with a
status. classify() reads the whole chain of causes and sorts it into one of a few kinds;
failure() words the error for the kind, and is_transient() says whether trying again can
help (packer.remote.retry).
"""
from __future__ import annotations

import asyncio
import os
import socket

from ..errors import PackError, redact
from . import scheme_of
from .schemes import retried_codes, scheme_for

MISSING, NO_BUCKET, DENIED, UNREACHABLE, TIMEOUT, SERVER, OTHER = (
    "missing", "no-bucket", "denied", "unreachable", "timeout", "server", "other")
TRANSIENT = (UNREACHABLE, TIMEOUT, SERVER)

DENIED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                "AllAccessDisabled", "AccountProblem", "Forbidden", "403"}
MISSING_CODES = {"NoSuchKey", "NotFound", "404", "NoSuchUpload"}
SERVER_CODES = retried_codes()  # packer.remote.schemes: which codes each store sends for "try later"
# Names of exception classes (botocore, aiohttp, urllib3, fsspec) met when a server cannot be
# reached or stops answering; matched by name so this module imports none of them.
UNREACHABLE_NAMES = {"EndpointConnectionError", "ClientConnectorError", "ClientConnectionError",
                     "ServerDisconnectedError", "ClientOSError", "ConnectionClosedError", "ProxyConnectionError",
                     "HTTPClientError", "NewConnectionError", "ProtocolError", "IncompleteRead",
                     "ClientPayloadError", "ResponseParserError", "ServerConnectionError"}
TIMEOUT_NAMES = {"ConnectTimeoutError", "ReadTimeoutError", "FSTimeoutError", "ServerTimeoutError",
                 "ConnectionTimeoutError", "SocketTimeoutError"}


class RemoteError(PackError):
    """A remote object cannot be read or written: missing, refused, or the server does not answer."""

    def __init__(self, message: str, path: str | None = None, kind: str = OTHER):
        super().__init__(message, path)
        self.kind = kind


def chain(exc: BaseException):
    """exc and its causes and contexts, each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def error_code(exc: BaseException) -> str | None:
    """S3's error code (botocore ClientError) or the HTTP status (aiohttp, fsspec's http), as text."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        code = error.get("Code") or (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code:
            return str(code)
    status = getattr(exc, "status", None) or getattr(exc, "code", None)
    if isinstance(status, int) and 400 <= status < 600:
        return str(status)
    return None


def classify(exc: BaseException) -> str:
    """The kind of a failed remote access (one of MISSING ... OTHER), from exc's whole chain."""
    kinds = [kind_of(one) for one in chain(exc)]
    if isinstance(exc, FileNotFoundError) and error_code(exc) is None:
        # fsspec's HTTP backend raises FileNotFoundError for a server it cannot reach or that
        # times out, with that error as the cause: the cause decides (a 404 carries its code).
        for kind in (TIMEOUT, UNREACHABLE):
            if kind in kinds[1:] and MISSING not in kinds[1:]:
                return kind
    for kind in (NO_BUCKET, DENIED, MISSING, TIMEOUT, UNREACHABLE, SERVER):
        if kind in kinds:
            return kind
    return OTHER


def kind_of(exc: BaseException) -> str | None:
    code = error_code(exc)
    name = type(exc).__name__
    if code == "NoSuchBucket" or "bucket does not exist" in str(exc):
        return NO_BUCKET
    if code in DENIED_CODES or isinstance(exc, PermissionError):
        return DENIED
    if code in MISSING_CODES or isinstance(exc, FileNotFoundError):
        return MISSING
    if code in SERVER_CODES:
        return SERVER
    if name in TIMEOUT_NAMES or isinstance(exc, (TimeoutError, asyncio.TimeoutError, socket.timeout)):
        return TIMEOUT
    if name in UNREACHABLE_NAMES or isinstance(exc, (ConnectionError, socket.gaierror)):
        return UNREACHABLE
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether trying again can succeed: the server was unreachable, slow or failing, not a refusal."""
    if isinstance(exc, RemoteError):
        return exc.kind in TRANSIENT
    if isinstance(exc, (ValueError, TypeError, ImportError, NotImplementedError)):
        return False
    return classify(exc) in TRANSIENT


def endpoint_of(storage_options: dict | None) -> str:
    """Where requests go, for messages: the endpoint_url given, or the provider's default."""
    options = storage_options or {}
    endpoint = (options.get("client_kwargs") or {}).get("endpoint_url") or options.get("endpoint_url") \
        or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return endpoint or "the default endpoint (AWS S3; set client_kwargs.endpoint_url for another store)"


def cause(exc: BaseException) -> BaseException | None:
    """exc, to chain under the RemoteError that reports it; None (a traceback without it) where
    the text of exc or of any exception it chains holds a URL credential, which a traceback
    would print as it is (backends put the whole URL in their messages)."""
    for one in chain(exc):
        text = f"{one} {one!r}"
        if redact(text) != text:
            return None
    return exc


def describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return redact(f"{type(exc).__name__}: {text}")[:300]  # redacted first: a cut URL hides its '@'



def failure(url: str, exc: BaseException, doing: str = "reading", storage_options: dict | None = None,
            retried: bool = False) -> RemoteError:
    """The RemoteError for an access to url that failed for good: what happened, what to check."""
    if isinstance(exc, RemoteError):
        return exc
    kind = classify(exc)
    scheme = scheme_for(scheme_of(url))
    endpoint = endpoint_of(storage_options) if scheme.names_endpoint else None
    at = f" at {endpoint}" if endpoint else ""
    if kind == NO_BUCKET:
        hint = f"the bucket does not exist{at}: check the bucket name in the URL and the endpoint_url"
        if doing == "writing":
            hint += " (packer writes into an existing bucket; create it first)"
    elif kind == DENIED:
        hint = scheme.denied_advice.format(at=at, verb=doing[:-3])
    elif kind == MISSING:
        hint = "no such object: check the URL (bucket, key, host) and that the dataset was uploaded whole"
    elif kind in (UNREACHABLE, TIMEOUT):
        what = "did not answer in time" if kind == TIMEOUT else "cannot be reached"
        where = endpoint or "the server"
        hint = f"{where} {what}: check the endpoint_url and the network, and that the server is up"
    elif kind == SERVER:
        hint = "the server kept failing (an error status or throttling): try again later"
    elif isinstance(exc, TypeError):
        hint = "the storage options were refused: check storage_options (--storage-options)"
    else:
        hint = f"{doing} failed"
    again = " (retried)" if retried and kind in TRANSIENT else ""
    return RemoteError(f"{url}: {hint}{again} ({describe(exc)})", url, kind)
