"""The names the command line offers: measures, cache states and packer's sources, kept free
of torch so that `compare`, `trend` and every `--help` start without importing it."""
from __future__ import annotations

from packer.formats import FORMATS

# measures.MEASURES holds one measure per name, in this order (the table's columns).
MEASURE_NAMES = ("raw", "block", "checked", "loader", "decode", "augment", "e2e")
CACHE_STATES = ("cold", "warm")
PACKER_SOURCES = ("folder", *FORMATS)
