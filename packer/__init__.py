"""packer: pack ImageFolder trees of JPEGs into LMDB, HDF5 or WebDataset shards."""
from .command_stops import take_early

take_early()  # first, before the imports below take their few tenths of a second

from .api import pack
from .errors import BadImageError, CorruptDataError, FormatError, OutputExistsError, PackError, SourceError
from .formats import FORMATS, detect_format, open_reader
from .scan import scan_source
from .version import __version__
from .writing import PackResult

__all__ = [
    "FORMATS", "BadImageError", "CorruptDataError", "FormatError", "OutputExistsError", "PackError", "PackResult",
    "SourceError", "detect_format", "open_reader", "pack", "scan_source", "__version__",
]
