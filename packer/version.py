"""packer's version, in one place: the package, the CLI and every dataset's metadata carry it."""
__version__ = "0.1.0"
