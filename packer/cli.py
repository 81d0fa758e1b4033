"""The `packer` command: parses options, calls the library, turns PackError into exit code 1."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import tempfile
import time
import warnings

import click

from .api import pack
from .check import CHECKS, MAX_PIXELS
from .cli_options import (STORAGE_OPTIONS_HELP, FormatName, JSONObject, LocalPath, PartOption, PathOrURL,
                          checksum_option, deadline_option, reencode_args, reencode_options, remote_options,
                          shard_options, with_deadline, writer_options)
from .command_stops import finished, hand_over
from .errors import PackError, escaping, json_shown, redacted, shown
from .formats import FORMATS, spellings
from .interrupts import Interrupted, how_stopped, late_stops, stop_signals_as_interrupts
from .reencode import MAX_SIDE_LIMIT
from .scan import ON_ERROR, plural
from .version import __version__
from .writing import PackResult


def library_errors(fn):
    """The one place where library errors become CLI errors (exit 1, message on stderr)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PackError as exc:
            raise click.ClickException(shown(str(exc))) from exc
        except OSError as exc:  # a path the library could not use; bugs (TypeError...) stay tracebacks
            raise click.ClickException(shown(os_error_message(exc))) from exc

    return wrapper


def os_error_message(exc: OSError) -> str:
    """`PATH: what went wrong`, as the system reports it."""
    what = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None:
        return what
    paths = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else f"{exc.filename}"
    return f"{paths}: {what}"


@contextlib.contextmanager
def escaped_warnings():
    """Warnings printed while a command runs (a shard skipped, extents dropped) name paths
    from the dataset too: their messages are escaped as say's (worker processes escape
    their own: packer.engine)."""
    plain = warnings.formatwarning
    warnings.formatwarning = escaping(plain)
    try:
        yield
    finally:
        warnings.formatwarning = plain


def say(message: str) -> None:
    """One line on stderr: a message or an error, whatever the names in it hold."""
    click.echo(shown(message), err=True)


def echo_shown(line: str) -> None:
    """One line of output on stdout, escaped as say's."""
    click.echo(shown(line))


def echo_json(facts: dict) -> None:
    """--json: one JSON object on stdout, URL credentials redacted and unshowable characters
    escaped, as everywhere else."""
    click.echo(json_shown(redacted(facts)))


class PackerGroup(click.Group):
    """The command group; Ctrl-C in any command exits 130 (128 + SIGINT, as shells expect) with
    one line, where click would print "Aborted!" and exit 1; SIGTERM takes the same way
    out (packer.interrupts) and exits 143 (128 + SIGTERM)."""

    def invoke(self, ctx):
        late_stops()  # forget any a previous command in this process noted
        try:
            with stop_signals_as_interrupts(), escaped_warnings():
                try:
                    hand_over()
                    done = super().invoke(ctx)
                except KeyboardInterrupt as exc:
                    signum = getattr(exc, "signum", signal.SIGINT)
                    say(str(exc) if isinstance(exc, Interrupted) else how_stopped(signum))
                    ctx.exit(128 + signum)
                for signum in dict.fromkeys(late_stops()):
                    say(f"{how_stopped(signum)} after the dataset was published: it is complete, and its tidying "
                        "was finished, not cut short")
                return done
        finally:
            finished()


@click.group(cls=PackerGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="packer")
def main():
    """Pack folders of JPEGs into LMDB, HDF5 or WebDataset shards, and check them."""


def refuse_remote_options(out, staging_dir, storage_options, deadline=None) -> None:
    """The options that apply to an OUT given as a URL only, refused for a local one."""
    from .remote import is_url

    if out is not None and is_url(out):
        return
    given = [name for name, value in (("--staging-dir", staging_dir), ("--storage-options", storage_options),
                                      ("--deadline", deadline)) if value is not None]
    if given:
        raise click.UsageError(f"{' and '.join(given)} apply to -o with a URL (s3://bucket/key) only")


@main.command("pack", short_help="Pack an ImageFolder tree into LMDB, HDF5 or WebDataset shards.")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.option("--to", "fmt", type=FormatName(), required=True, help=f"Output format: {spellings()}.")
@click.option("-o", "--out", type=click.Path(), help="Output path, or s3://bucket/key to upload [default: SRC + "
              ".lmdb/.h5/.wds].")
@click.option("--workers", type=click.IntRange(min=1), help="Readers working ahead of the writer: threads for the "
              "header check, processes for --check full [default: the usable cores].")
@click.option("--on-error", type=click.Choice(ON_ERROR), default="fail", show_default=True,
              help="fail: stop at the first bad file; skip: leave bad files out and record them.")
@click.option("--check", type=click.Choice(CHECKS), default="header", show_default=True,
              help="header: format, header and end marker; full: decode every image; none.")
@click.option("--max-pixels", type=click.IntRange(min=1), default=MAX_PIXELS, show_default=True,
              help="header, full: refuse an image whose header claims more pixels (a decompression "
                   "bomb guard; the default is Pillow's limit).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--labels", "labels", type=click.Path(exists=True, dir_okay=False),
              help="Label the flat (unlabeled) split, e.g. ImageNet's val/, from this file: LOC_val_solution.csv, "
                   "a filename,class CSV, a JSON object, or class indexes with --labels-index-base.")
@click.option("--labels-index-base", type=click.Choice(["0", "1"]),
              help="--labels is a list of class indexes (one per line, files in sorted name order) into packer's "
                   "sorted class list, counted from 0 or 1.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout (for scripts).")
@click.option("--part", "part", type=PartOption(), metavar="I/N", help="Pack only part I (counted from 0) of N, a "
              "dataset of its own; `packer merge` joins the N parts "
              "[default OUT: SRC.part-0000I-of-0000N + extension].")
@click.option("--parts", "parts", type=click.IntRange(min=1), help="Pack in N parts run in parallel (local "
              "processes, or --dask), then merge them into OUT.")
@click.option("--dask", "dask", metavar="ADDRESS", help="Run the parts on this Dask scheduler "
              "(tcp://host:8786; needs packer[dask]); SRC and OUT's folder must be on a file system every "
              "worker shares, at the same paths [--parts default: the cluster's threads].")
@reencode_options
@checksum_option
@remote_options
@shard_options
@library_errors
def pack_command(src, fmt, out, workers, on_error, check, max_pixels, force, labels, labels_index_base, as_json,
                 part, parts, dask, max_side, quality, baseline_420, checksum, staging_dir, storage_options,
                 deadline, **shards):
    """Pack the ImageFolder tree SRC into one dataset file or folder.

    Every image is stored byte for byte, except those --max-side or --baseline-420 re-encodes.
    """
    if labels_index_base is not None and labels is None:
        raise click.UsageError("--labels-index-base applies to a --labels file: pass one")
    if part is not None and (parts is not None or dask is not None):
        raise click.UsageError("--part packs one part; --parts and --dask pack them all: pass one or the other")
    kwargs = dict(workers=workers, on_error=on_error, check=check, force=force, max_pixels=max_pixels,
                  labels=labels, labels_index_base=None if labels_index_base is None else int(labels_index_base),
                  part=part, parts=parts, **reencode_args(max_side, quality, baseline_420), checksum=checksum,
                  **writer_options(fmt, **shards))
    refuse_remote_options(out, staging_dir, storage_options, deadline)
    kwargs.update(staging_dir=staging_dir, storage_options=with_deadline(storage_options, deadline))
    if dask is not None:
        with dask_client(dask) as client:
            result = pack(src, fmt, out, executor=client.get_executor(pure=False), **kwargs)
    else:
        result = pack(src, fmt, out, **kwargs)
    finished()
    report_pack(result)
    if as_json:
        echo_json(pack_facts(result))


def dask_client(address: str):
    """A Client of the Dask scheduler at address, or a PackError saying why there is none."""
    try:
        from distributed import Client
    except ImportError as exc:
        raise PackError("--dask needs Dask's distributed scheduler: pip install 'packer[dask]'") from exc
    try:
        refused_at_once(address)
        return Client(address, timeout="30s")
    except (OSError, TimeoutError, ValueError) as exc:
        raise PackError(f"{address}: cannot reach a Dask scheduler there ({type(exc).__name__}: {exc}); "
                        "check the address (tcp://HOST:8786) and that the scheduler is running") from exc


def refused_at_once(address: str) -> None:
    """Raise the OSError of a tcp:// address that refuses connections, where Dask would retry for 30 s."""
    from urllib.parse import urlsplit

    found = urlsplit(address)
    if found.scheme == "tcp" and found.hostname and found.port:
        import socket

        socket.create_connection((found.hostname, found.port), timeout=10).close()


def report_pack(result: PackResult, verb: str = "packed") -> None:
    for path in result.removed_stale:
        say(f"removed {path}, left by an interrupted pack")
    for warning in result.warnings:
        say(f"warning: {warning}")
    meta = result.metadata
    for entry in meta.skipped:
        say(f"skipped {entry['path']}: {entry['reason']}")
    splits = ", ".join(f"{name} {s.count}" for name, s in meta.splits.items())
    say(f"{verb} {plural(meta.count, 'image')} ({splits}; {plural(len(meta.classes), 'class', 'classes')}, "
        f"{meta.bytes / 1e6:.1f} MB, "
        f"{len(meta.skipped)} skipped) into {result.out} in {result.seconds:.1f} s: "
        f"{result.files_per_s:.0f} files/s, {result.mb_per_s:.0f} MB/s")


def pack_facts(result: PackResult) -> dict:
    """pack --json: the metadata plus where it went, how long it took and the warnings."""
    return {**result.metadata.to_dict(), "path": result.out, "seconds": round(result.seconds, 3),
            "warnings": result.warnings, "removed_stale": result.removed_stale}


@main.command("convert", short_help="Convert a packed dataset to another format.")
@click.argument("packed", type=LocalPath(exists=True))
@click.option("--to", "fmt", type=FormatName(), required=True, help=f"Output format: {spellings()}.")
@click.option("-o", "--out", type=click.Path(),
              help="Output path, or s3://bucket/key to upload [default: PACKED with its extension replaced "
                   "by .lmdb/.h5/.wds].")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--workers", type=click.IntRange(min=1), help="Processes reading and checking the records "
              "[default: the usable cores].")
@reencode_options
@checksum_option
@remote_options
@shard_options
@library_errors
def convert_command(packed, fmt, out, force, workers, max_side, quality, baseline_420, checksum, staging_dir,
                    storage_options, deadline, **shards):
    """Convert the packed dataset PACKED to another format, byte for byte (except the
    records --max-side or --baseline-420 re-encodes).

    Reads PACKED only: the folder it was packed from is not needed.
    """
    from .convert import convert

    refuse_remote_options(out, staging_dir, storage_options, deadline)
    result = convert(packed, fmt, out, workers=workers, force=force, **reencode_args(max_side, quality, baseline_420),
                     checksum=checksum, **writer_options(fmt, **shards), staging_dir=staging_dir,
                     storage_options=with_deadline(storage_options, deadline))
    finished()
    report_pack(result, verb="converted")


@main.command("merge", short_help="Merge the parts of a --part I/N pack into one dataset.")
@click.argument("parts", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--out", type=click.Path(), required=True, help="Output path of the merged dataset.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--workers", type=click.IntRange(min=1), help="Processes reading and checking the parts' records "
              "[default: the usable cores].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout (for scripts).")
@library_errors
def merge_command(parts, out, force, workers, as_json):
    """Merge PARTS, the parts of one source packed with --part I/N, into the dataset a single pack gives.

    Give every part (any order): each is refused by name if it is missing, given twice,
    half-written, or of another source, format or options.
    """
    from .merge import merge

    result = merge(list(parts), out, force=force, workers=workers)
    finished()
    report_pack(result, verb="merged")
    if as_json:
        echo_json(pack_facts(result))


@main.command("info", short_help="Show what a packed dataset (a path or a URL) holds.")
@click.argument("packed", type=PathOrURL(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
@click.option("--storage-options", type=JSONObject(), help=f"For a URL: {STORAGE_OPTIONS_HELP}")
@deadline_option
@library_errors
def info_command(packed, as_json, storage_options, deadline):
    """Show what the packed dataset PACKED (a path, or a URL: s3://bucket/x.lmdb) holds."""
    from .remote import is_url
    from .verify import info

    given = [name for name, value in (("--storage-options", storage_options), ("--deadline", deadline))
             if value is not None]
    if given and not is_url(packed):
        raise click.UsageError(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to a PACKED "
                               "given as a URL (s3://bucket/key) only")
    options = with_deadline(storage_options, deadline)
    if is_url(packed):
        from .remote.retry import split_deadline, within

        with within(split_deadline(options)[0]):  # the whole command, not each of its requests
            facts = info(packed, options)
    else:
        facts = info(packed, options)
    if as_json:
        echo_json(facts)
        return
    echo_shown(f"{facts['path']}: {facts['format']} (format version {facts['format_version']}, "
               f"{facts.get('checksum', 'crc32')} record checksums), "
               f"{facts['count']} images, {facts['bytes'] / 1e6:.1f} MB of images, "
               + ("remote, nothing listed" if facts["disk_bytes"] is None else f"{facts['disk_bytes'] / 1e6:.1f} MB on disk"))
    for name, split in facts["splits"].items():
        kind = "" if split["labeled"] else " (unlabeled)"
        echo_shown(f"  split {name}: {split['count']} images{kind}")
        shards = split.get("shards")
        if shards:
            echo_shown(f"    {shards['shards']} shard(s), {shards['bytes'] / 1e6:.1f} MB, "
                       f"{shards['min_bytes'] / 1e6:.1f} to {shards['max_bytes'] / 1e6:.1f} MB each")
    listed = ", ".join(facts["classes"][:10]) + (" ..." if len(facts["classes"]) > 10 else "")
    echo_shown(f"  classes: {len(facts['classes'])} ({listed})")
    echo_shown(f"  source: {facts['source']}, created {facts['created']} by packer {facts['packer_version']}")
    origin = facts["params"].get("converted_from")
    if origin:
        echo_shown(f"  converted from: {origin['path']} ({origin['format']})")
    for line in parts_lines(facts.get("parts")):
        echo_shown(line)
    echo_shown(f"  parameters: {json.dumps(facts['params'])}")
    for line in reencode_lines(facts):
        echo_shown(line)
    echo_shown(f"  skipped: {len(facts['skipped'])}")
    for entry in facts["skipped"]:
        echo_shown(f"    {entry['path']}: {entry['reason']}")


def reencode_lines(facts: dict) -> list[str]:
    """info's lines on re-encoded images (packer.reencode) and the images' JPEG forms (packer.jpeg_form)."""
    from .jpeg_form import form_summary

    lines = []
    reencoded = facts.get("reencode")
    if reencoded:
        which = " or ".join(([f"over {reencoded['max_side']} px"] if reencoded["max_side"] < MAX_SIDE_LIMIT else [])
                            + (["not baseline 4:2:0"] if facts.get("reencode_form") else []))
        lines.append(f"  re-encoded: {sum(reencoded['counts'].values())} images {which} "
                     f"(JPEG quality {reencoded['quality']}); the others are byte-identical to the source")
    if facts.get("forms"):
        lines.append(f"  JPEG forms: {form_summary(facts['forms'])}")
    return lines


def parts_lines(parts: dict | None) -> list[str]:
    """info's lines on a part, or on the parts a dataset was merged from."""
    if not parts:
        return []
    source = f"source {parts['fingerprint'][:19]}..."
    if "merged" in parts:
        lines = [f"  merged from {parts['count']} parts of {source}:"]
        lines += [f"    part {p['index']}: {p['count']} images from {p['path']} (host {p['host']}, {p['created']})"
                  for p in parts["merged"]]
        return lines
    ranges = ", ".join(f"{name} {s['start']}-{s['stop']} of {s['listed']}" for name, s in parts["splits"].items()
                       if s["stop"] > s["start"])
    return [f"  part {parts['index']} of {parts['count']} (counted from 0) of {source}, packed on {parts['host']}: "
            f"files {parts['start']}-{parts['stop']} of {parts['total']} ({ranges or 'none'})"]


@main.command("verify", short_help="Re-read every record; exit 1 on damage or difference.")
@click.argument("packed", type=LocalPath(exists=True))
@click.option("--against", type=click.Path(exists=True, file_okay=False),
              help="Also check that every file of this source folder is packed, byte-identical.")
@click.option("--check", type=click.Choice(CHECKS), default="full", show_default=True,
              help="How each stored image is checked besides its record checksum (the pack's --checksum: "
                   "xxh3 or crc32): header: format, header and end marker; full: decode every image; none.")
@click.option("--workers", type=click.IntRange(min=1), help="Processes checking the records "
              "[default: the usable cores].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout (for scripts).")
@library_errors
def verify_command(packed, against, check, workers, as_json):
    """Re-read every record of PACKED; exit 1 on any damage or difference."""
    from .verify import COMPARISONS, verify

    report = verify(packed, against, check=check, workers=workers)
    report_verify(report)
    if as_json:
        echo_json({"path": os.path.abspath(packed), "against": against, **report.to_dict()})
    if not report.ok:
        raise click.ClickException(f"{packed}: {len(report.problems)} problem(s) in {report.checked} records")
    versus = f", identical to {against}" if against else ""
    if against and report.reencoded:
        versus += " (" + "; ".join(f"{report.compared[how]} {how}" for how in COMPARISONS if report.compared[how]) + ")"
    say(f"ok: {report.checked} records intact{versus}")


SHOWN_PROBLEMS = 20


def report_verify(report) -> None:
    """The notes, the first problems, a count per kind and what to do, on stderr."""
    for note in report.notes[:SHOWN_PROBLEMS]:
        say(f"note: {note}")
    if len(report.notes) > SHOWN_PROBLEMS:
        say(f"note: ... and {len(report.notes) - SHOWN_PROBLEMS} more notes")
    for found in report.problems[:SHOWN_PROBLEMS]:
        say(f"error: {found}")
    if len(report.problems) > SHOWN_PROBLEMS:
        say(f"... and {len(report.problems) - SHOWN_PROBLEMS} more problems (--json lists the counts)")
    if report.problems:
        say("problems: " + ", ".join(f"{count} {kind}" for kind, count in report.kinds.most_common() if count))
    for line in report.advice:
        say(f"to do: {line}")


@main.command("doctor", short_help="Measure a training read of PATH, stage by stage.")
@click.argument("path", type=LocalPath(exists=True))
@click.option("--split", help="The split to measure [default: train, or the only one].")
@click.option("--workers", type=click.IntRange(min=1), help="Worker processes for the whole-read rate "
              "[default: the usable cores].")
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True,
              help="Batch size, to give the ceiling in batches a second.")
@click.option("--target-rate", type=click.FloatRange(min=0, min_open=True),
              help="The samples/s a GPU needs: what it would take is named if the ceiling is below it.")
@click.option("--seconds", type=click.FloatRange(min=1, max=600), default=20, show_default=True,
              help="Time to spend measuring, over all stages.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
@library_errors
def doctor_command(path, split, workers, batch_size, target_rate, seconds, as_json):
    """Measure what a training read of PATH (a source folder or a packed dataset) costs here,
    stage by stage, and name what would feed a GPU faster (docs/diagnose.md)."""
    from .doctor import examine, render

    report = examine(path, split=split, workers=workers, batch_size=batch_size, target_rate=target_rate,
                     seconds=seconds)
    if as_json:
        click.echo(json.dumps(report, ensure_ascii=False))
        return
    for line in render(report):
        echo_shown(line)


@main.command("demo", short_help="Make, pack, verify and read back a synthetic dataset.")
@click.option("--dir", "folder", type=click.Path(file_okay=False),
              help="Where to write the demo files [default: a temporary folder, removed after].")
@click.option("--images", type=click.IntRange(min=10), default=1000, show_default=True,
              help="How many images to generate: 10 classes of N // 10 each.")
@click.option("--to", "fmt", type=FormatName(), default="lmdb", show_default=True,
              help=f"The format to pack the demo into: {spellings()}.")
@library_errors
def demo_command(folder, images, fmt):
    """Generate an ImageNet-style folder, pack it, verify it, read it back; print samples/s."""
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="packer-demo-") as tmp:
            run_demo(tmp, images, fmt)
    else:
        run_demo(folder, images, fmt)


def run_demo(folder: str, images: int, fmt: str) -> None:
    from .demo import read_rates
    from .synth import make_corpus
    from .verify import verify

    src = os.path.join(folder, "imagenet-demo")
    out = src + FORMATS[fmt].extension
    per_class = images // 10
    say(f"1/4 writing {10 * per_class} synthetic JPEGs (10 classes of {per_class}) to {src}")
    start = time.perf_counter()
    make_corpus(src, classes=10, per_class=per_class, workers=os.cpu_count() or 1)
    say(f"    {time.perf_counter() - start:.1f} s")
    say(f"2/4 packing into {out}")
    report_pack(pack(src, fmt, out, force=True))
    say("3/4 verifying against the source")
    report = verify(out, src)
    if not report.ok:
        raise PackError(f"demo verification failed: {'; '.join(report.problems)}")
    say(f"    ok: {report.checked} records byte-identical to the source")
    say("4/4 reading back through readers (random order, 1 process)")
    for comparison in read_rates(src, out):
        (folder, folder_rate), (packed, packed_rate) = comparison.rates
        click.echo(f"    {comparison.what:<22} {folder:<14} {folder_rate:7.0f} {comparison.unit}   "
                   f"{packed:<14} {packed_rate:7.0f} {comparison.unit}   {packed_rate / folder_rate:.1f}x")
    say("    Cold reads are where packing wins: one file read at known offsets instead of a file per image. "
        "Decoding costs the same from any source: spread it over workers with readers.make_loader.")


if __name__ == "__main__":
    sys.exit(main())
