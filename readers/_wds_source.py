"""Where a WDSDataset's shards are: a `packer pack --to wds` folder (its index.json gives the
shards, their sample counts and the classes), a folder of shards, or shard paths and brace
patterns, local or at URLs (packer.remote), resolved to one shard list."""
from __future__ import annotations

import os

from packer.errors import FormatError
from packer.formats import wds, wds_shards
from packer.remote import source as remote_source

from ._pack_identity import index_identity

SHARD_SUFFIXES = (".tar", ".tgz", ".tar.gz")


def remote_of(path_or_urls, storage_options: dict | None):
    """The packer.remote Remote to read remote shards with, or None for local ones (all of
    one kind: a list mixing them is refused)."""
    names = [path_or_urls] if isinstance(path_or_urls, (str, os.PathLike)) else list(path_or_urls)
    remote = [remote_source.is_url(os.fspath(name)) for name in names]
    if any(remote) and not all(remote):
        raise FormatError("WDSDataset: the shards mix URLs and local paths; give one kind", None)
    if not any(remote):
        if storage_options is not None:
            raise ValueError("storage_options only apply to shards named by URL (s3://, gs://, https://...)")
        return None
    return remote_source.Remote(storage_options)


def resolve_remote(path_or_urls, split: str | None, remote) -> tuple[list[str], list[int] | None, list[str],
                                                                    str | None, str]:
    """resolve() for URLs: a packer folder (its index.json), else shard URLs or brace patterns,
    each checked to exist (one HEAD each)."""
    if isinstance(path_or_urls, (str, os.PathLike)):
        url = os.fspath(path_or_urls).rstrip("/")
        if not url.endswith(SHARD_SUFFIXES) and "{" not in url:
            indexed = wds_shards.indexed_split(url, split, remote)
            return ([remote_source.join(url, name) for name in indexed.shards], indexed.counts, indexed.classes,
                    indexed.split, index_identity(indexed))
        urls = expand_braces(url)
    else:
        urls = [u for url in path_or_urls for u in expand_braces(os.fspath(url))]
    missing = [u for u in urls if not remote.exists(u)]
    if missing:
        raise FormatError(f"{missing[0]}: no such shard ({len(missing)} of {len(urls)} missing); check the URL and "
                          "that the shards were uploaded", missing[0])
    return urls, None, [], split, ""


def resolve(path_or_urls, split: str | None, remote=None) -> tuple[list[str], list[int] | None, list[str],
                                                                   str | None, str]:
    """(shard paths, their sample counts or None, class names, split, the pack's identity:
    readers._pack_identity, "" for shards not in a packer folder) for any accepted source."""
    if remote is not None:
        return resolve_remote(path_or_urls, split, remote)
    if isinstance(path_or_urls, (str, os.PathLike)):
        path = os.fspath(path_or_urls)
        if packed_folder(path) is not None:
            indexed = wds_shards.indexed_split(path, split)
            return ([os.path.join(path, name) for name in indexed.shards], indexed.counts, indexed.classes,
                    indexed.split, index_identity(indexed))
        if os.path.isdir(path):
            folder = os.path.join(path, split) if split else path
            if not os.path.isdir(folder):
                raise FormatError(f"{folder}: no such folder; {path} is a folder of shards, not a packer dataset, "
                                  f"and split={split!r} names a sub-folder of it: pass the folder that holds the "
                                  "shards, with no split", folder)
            shards = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(SHARD_SUFFIXES))
            if not shards:
                raise FormatError(f"{folder}: no shards ({', '.join(SHARD_SUFFIXES)} files) in this folder", folder)
            return shards, None, [], split, ""
        urls = expand_braces(path)
    else:
        urls = [u for url in path_or_urls for u in expand_braces(os.fspath(url))]
    missing = [u for u in urls if not os.path.isfile(u)]
    if missing:
        raise FormatError(f"{missing[0]}: no such shard ({len(missing)} of {len(urls)} missing; only local "
                          "files are read)", missing[0])
    return urls, None, [], split, ""


def index_file_of(path_or_urls, remote) -> str | None:
    """The index.json of the packer folder path_or_urls names (local or at a URL), else None."""
    if remote is not None:
        if isinstance(path_or_urls, (str, os.PathLike)):
            url = os.fspath(path_or_urls).rstrip("/")
            if not url.endswith(SHARD_SUFFIXES) and "{" not in url:
                return remote_source.join(url, wds.INDEX)
        return None
    folder = packed_folder(path_or_urls)
    return None if folder is None else os.path.join(os.path.abspath(folder), wds.INDEX)


def packed_folder(path_or_urls) -> str | None:
    """path_or_urls when it is a local `packer pack --to wds` folder, else None."""
    if isinstance(path_or_urls, (str, os.PathLike)):
        path = os.fspath(path_or_urls)
        if os.path.isdir(path) and wds.detect(path):
            return path
    return None


def expand_braces(pattern: str) -> list[str]:
    if "{" not in pattern:
        return [pattern]
    import braceexpand

    return list(braceexpand.braceexpand(pattern))
