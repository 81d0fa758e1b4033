"""packer: pack ImageFolder trees of JPEGs into LMDB, HDF5 or WebDataset shards."""
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
