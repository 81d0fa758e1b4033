"""packer: pack ImageFolder trees of JPEGs into LMDB, HDF5 or WebDataset shards."""
__version__ = "0.1.0"

from .errors import BadImageError, CorruptDataError, FormatError, OutputExistsError, PackError, SourceError
from .formats import FORMATS, detect_format, open_reader
from .pack import pack
from .scan import scan_source

__all__ = [
    "FORMATS", "BadImageError", "CorruptDataError", "FormatError", "OutputExistsError", "PackError",
    "SourceError", "detect_format", "open_reader", "pack", "scan_source", "__version__",
]
