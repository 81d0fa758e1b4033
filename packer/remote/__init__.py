"""Datasets in object storage: s3:// and http(s):// URLs read through fsspec, written by upload.

Which objects a remote dataset consists of, and how a writer publishes them so that a
reader never sees half of one, is in packer.remote.upload's docstring. This module only
tells a URL from a local path; it imports no fsspec, so local use never needs it.
"""
from __future__ import annotations

import os
from typing import NamedTuple

SCHEMES = ("s3", "http", "https")


class URL(NamedTuple):
    """A parsed dataset URL: scheme, bucket (the host for http), and key (no leading '/')."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"


def is_url(path) -> bool:
    """Whether path names a remote dataset (s3://, http://, https://) rather than a local one."""
    if not isinstance(path, str):
        path = os.fspath(path) if isinstance(path, os.PathLike) else None
        if not isinstance(path, str):
            return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def parse_url(url: str) -> URL:
    """Split s3://bucket/key/parts (or http(s)://host:port/path) into a URL; ValueError if it is none."""
    if not is_url(url):
        raise ValueError(f"{url}: not an s3://, http:// or https:// URL")
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url}: the URL names no bucket or host")
    return URL(scheme.lower(), bucket, key.strip("/"))
