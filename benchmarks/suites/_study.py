"""What the cache studies share: a packed dataset to read, repeats, a JSON record, and
posix_fadvise to evict with."""
from __future__ import annotations

import argparse

from benchmarks import cache


def parser(doc: str, repeats: int) -> argparse.ArgumentParser:
    """PACKED, --repeats and --json; the study adds its own options."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("packed", help="a packer LMDB, HDF5 or wds dataset")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--json", help="write the runs here")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if not cache.CAN_EVICT:
        p.error("evicting the page cache needs posix_fadvise (Linux)")
    return args
