"""The command line's parameter types (--to, --part, sizes, JSON, paths or URLs) and the options
several commands share (writer, re-encoding, checksum and remote options); a bad value is a usage
error (exit 2)."""
from __future__ import annotations

import json

import click

from .errors import FormatError, PackError, redact
from .formats import FORMATS, format_named, parse_size
from .reencode import MAX_SIDE_LIMIT


class ByteSize(click.ParamType):
    """A size such as 1GB, 256MB, 512KB or a plain byte count."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def writer_option_flags() -> dict[str, tuple]:
    """Every writer option of any format, by name: (the Option, the formats that take it)."""
    flags: dict[str, tuple] = {}
    for fmt in FORMATS.values():
        for option in fmt.options:
            flags[option.name] = (option, flags.get(option.name, (option, ()))[1] + (fmt.name,))
    return flags


def click_type(option):
    """The click type that parses option's value with its own parse (one validation for both)."""
    if option.parse is parse_size:
        return ByteSize()
    return click.IntRange(min=1) if option.default is None or isinstance(option.default, int) else str


def shard_options(command):
    """The writer options of every format (from packer.formats: each Format lists its own),
    and the write order options that pack and convert share."""
    options = [click.option(option.flag, option.name, type=click_type(option),
                            help=f"{', '.join(owners)}: {option.help}.")
               for option, owners in writer_option_flags().values()]
    options += [
        click.option("--shuffle-seed", type=click.IntRange(min=0),
                     help="Write samples in the permutation this seed gives, so reading in storage order "
                          "sees mixed classes [wds: on, seed 0; lmdb, hdf5: off]."),
        click.option("--no-shuffle", is_flag=True, help="Write samples in ImageFolder order [the default "
                     "for lmdb and hdf5]."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def writer_options(fmt, shuffle_seed, no_shuffle, **given) -> dict:
    """pack()/convert() keyword arguments from the writer and order options, refusing an
    option the chosen format does not take (a usage error, naming who does)."""
    flags = writer_option_flags()
    wrong = [flags[name] for name, value in given.items() if value is not None and fmt not in flags[name][1]]
    if wrong:
        owners = sorted({owner for _, formats in wrong for owner in formats})
        raise click.UsageError(f"{', '.join(option.flag for option, _ in wrong)}: only for "
                               f"{' or '.join('--to ' + o for o in owners)}, not --to {fmt}")
    if shuffle_seed is not None and no_shuffle:
        raise click.UsageError("--shuffle-seed and --no-shuffle contradict each other: pass one")
    shuffle = False if no_shuffle else (True if shuffle_seed is not None else None)
    return {"options": given, "shuffle": shuffle, "shuffle_seed": shuffle_seed or 0}


def reencode_options(command):
    """--max-side, --baseline-420 and --quality, which pack and convert share (packer.reencode)."""
    command = click.option("--quality", type=click.IntRange(1, 100),
                           help="JPEG quality of the images --max-side or --baseline-420 re-encodes "
                                "[default: 90].")(command)
    command = click.option("--baseline-420", "baseline_420", is_flag=True,
                           help="Store every image as a baseline (not progressive) 8-bit JPEG, YCbCr 4:2:0 or "
                                "grayscale: the form cheapest to decode, which GPU JPEG engines take "
                                "(docs/resolution.md). Images already in it are stored byte for byte, the others "
                                "re-encoded at their size (combines with --max-side).")(command)
    return click.option("--max-side", type=click.IntRange(1, MAX_SIDE_LIMIT),
                        help="Re-encode as JPEG each image whose long side, upright by its EXIF orientation, is "
                             "over N pixels, to N (aspect ratio kept, Lanczos, stored upright): less to decode "
                             "per sample (docs/resolution.md). Every other image is stored byte for byte, as "
                             "without it; verify --against checks re-encoded ones by size. [default: store every "
                             "image byte for byte]", metavar="N")(command)


def checksum_option(command):
    """--checksum, which pack and convert share (packer.checksum)."""
    from .checksum import DEFAULT, KINDS

    return click.option("--checksum", type=click.Choice(KINDS), default=DEFAULT, show_default=True,
                        help="Each record's checksum, checked on every read: xxh3 (the low 32 bits of XXH3-64, "
                             "the cheapest to check) or crc32 (zlib's CRC-32, for other tools that check "
                             "CRC-32).")(command)


def reencode_args(max_side, quality, baseline_420=False) -> dict:
    if quality is not None and max_side is None and not baseline_420:
        raise click.UsageError("--quality sets the JPEG quality of the images --max-side or --baseline-420 "
                               "re-encodes: pass --max-side or --baseline-420")
    return {"max_side": max_side, "quality": quality, "baseline_420": baseline_420}


class FormatName(click.ParamType):
    """--to: a format's name or one of its aliases (h5, webdataset, ...), given as its name."""

    name = "|".join(FORMATS)

    def convert(self, value, param, ctx):
        try:
            return format_named(value).name
        except FormatError as exc:
            self.fail(str(exc), param, ctx)


class PartOption(click.ParamType):
    """--part I/N, checked as the command line is read: a malformed one is a usage error."""

    name = "I/N"

    def convert(self, value, param, ctx):
        from .cut import PartSpec, part_spec

        if isinstance(value, PartSpec):
            return value
        try:
            return part_spec(value)
        except PackError as exc:
            self.fail(str(exc), param, ctx)


class JSONObject(click.ParamType):
    """A JSON object given on the command line (--storage-options)."""

    name = "json"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            found = json.loads(value)
        except ValueError as exc:  # the value is not echoed: it may hold a secret key
            self.fail(f"not JSON ({exc})", param, ctx)
        if not isinstance(found, dict):
            self.fail(f"not a JSON object (a JSON {type(found).__name__})", param, ctx)
        return found


class PathOrURL(click.Path):
    """An existing path, or a URL (s3://, https://...) passed through unchecked."""

    def convert(self, value, param, ctx):
        from .remote import is_url

        return value if is_url(value) else super().convert(value, param, ctx)


class LocalPath(click.Path):
    """An existing local path; a URL is refused saying the command reads local datasets only."""

    def convert(self, value, param, ctx):
        from .remote import is_url

        if isinstance(value, str) and is_url(value):
            self.fail(f"{redact(value)}: {ctx.info_name} reads a local dataset only; download it first (e.g. aws s3 "
                      f"sync URL DIR), or read it where it is with `packer info` and the readers", param, ctx)
        return super().convert(value, param, ctx)


def deadline_option(command):
    """--deadline: how long one remote request may take, its retries included (packer.remote.retry)."""
    return click.option("--deadline", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
                        help="With a URL: seconds one remote request may take, retries included (`packer info`: "
                             "the whole command), before the command fails naming it [default: 90; or storage "
                             "options' \"deadline\"].")(command)


def with_deadline(storage_options: dict | None, deadline: float | None) -> dict | None:
    """storage_options with --deadline in them (the library's one way to set it)."""
    return storage_options if deadline is None else {**(storage_options or {}), "deadline": deadline}


def remote_options(command):
    """-o s3://bucket/key: where to pack before uploading, and how to reach the store."""
    command = deadline_option(command)
    command = click.option("--storage-options", type=JSONObject(),
                           help="With -o URL: fsspec/s3fs options as a JSON object, e.g. '{\"client_kwargs\": "
                                "{\"endpoint_url\": \"http://minio:9000\"}}' [default: from AWS_* and "
                                "FSSPEC_S3_* variables].")(command)
    return click.option("--staging-dir", type=click.Path(file_okay=False),
                        help="With -o URL: the folder to pack in before uploading; it must hold the whole "
                             "dataset [default: $TMPDIR].")(command)
