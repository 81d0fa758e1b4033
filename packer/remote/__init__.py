"""Datasets in object storage: s3://, https:// (any fsspec) URLs read through fsspec, written by upload.

Which objects a remote dataset consists of, and how a writer publishes them so that a
reader never sees half of one, is in packer.upload's docstring. This module only
tells a URL from a local path; it imports no fsspec, so local use never needs it.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple

from ..errors import redact
from . import forked  # noqa: F401  (registers the at-fork hooks that keep a child off its parent's connections)
from .schemes import LOCAL

# Any scheme fsspec may open (s3://, gs://, https://, ...), but not file://, which is a local path.
SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")


class URL(NamedTuple):
    """A parsed dataset URL: scheme, bucket (the host for http), and key (no leading '/')."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"


def is_url(path) -> bool:
    """Whether path names a remote dataset (s3://, https://, ...) rather than a local one."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    match = SCHEME.match(path) if isinstance(path, str) else None
    return bool(match) and match["scheme"].lower() not in LOCAL


def scheme_of(url: str) -> str:
    """url's scheme, lower-cased ("" for a local path)."""
    match = SCHEME.match(url)
    return match["scheme"].lower() if match else ""


def parse_url(url: str) -> URL:
    """Split s3://bucket/key/parts (or https://host:port/path) into a URL; ValueError if it is none."""
    if not is_url(url):
        raise ValueError(redact(f"{url}: not a URL such as s3://bucket/key or https://host/path"))
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(redact(f"{url}: the URL names no bucket or host"))
    return URL(scheme.lower(), bucket, key.strip("/"))
