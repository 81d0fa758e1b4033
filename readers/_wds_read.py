"""The reading stages of a WDSDataset's stream: a worker's tasks (runs of shards' samples) to
their shards, opened in order (streamed ahead when remote), and each shard to its checked
(where, image bytes, label) samples.

A local packer folder's shard is read through its index (packer.formats.wds_shards.read_stored:
one pread per image, no tar header parsed); any other shard, or a packer shard the index does
not describe, is parsed (packer.formats.wds_shards.iter_samples), its .json member checked."""
from __future__ import annotations

import bisect
import itertools
import os
import warnings
from typing import Iterable, Iterator

import numpy as np

from packer.errors import CorruptDataError, PackError, ReplacedError
from packer.formats import current_identity, replaced_error, wds, wds_shards

from ._stream import Task
from ._wds_checks import sample_label


def count_or_skip(ds, path: str) -> int:
    """The samples of the shard at path, counted by parsing it; 0 for a damaged one with
    on_error="skip" (warned: it is left out of every epoch)."""
    try:
        return wds_shards.count_samples(path, opener(ds, [path]))
    except CorruptDataError as exc:
        if ds.on_error == "fail":
            raise
        warnings.warn(f"{exc}; skipped this shard, its samples are left out of every epoch", RuntimeWarning,
                      stacklevel=3)
        return 0


def opener(ds, paths: list[str]):
    """How wds_shards.iter_samples opens these shards, read in this order: None (local files) or
    streams started ahead (remote)."""
    if ds.remote is None:
        return None
    from packer.remote.stream import ShardsAhead

    return ShardsAhead(ds.remote, paths, ds.prefetch_shards)


def read_tasks(ds, tasks: Iterable[Task], numbered: bool = False) -> Iterator:
    """(where, image bytes, label) of every image sample of the tasks' shards, in order, checked;
    numbered: (the task's place in tasks, the sample)."""
    tasks = list(tasks)
    shards = opener(ds, [ds.shards[task.shard] for task in tasks])
    try:
        if numbered:
            yield from task_samples(ds, tasks, shards)
        else:
            for _, sample in task_samples(ds, tasks, shards):
                yield sample
    finally:
        if shards is not None:
            shards.close()


def task_samples(ds, tasks: list[Task], shards) -> Iterator[tuple[int, tuple[str, bytes, int]]]:
    """(k, sample) of the tasks' samples, task k's; tasks one after another in one shard (a
    resumed pass's one-sample runs, what the saved shuffle buffers held) are read in one pass
    (one_pass), the rest of them, from where that pass stopped, task by task (task_run)."""
    k = 0
    while k < len(tasks):
        end = k + 1
        while end < len(tasks) and tasks[end].shard == tasks[k].shard:
            end += 1
        sizes = [ds.task_size(task) for task in tasks[k:end]]
        at, read = k, 0  # the task the pass is in, and its samples read
        for sample in one_pass(ds, tasks[k:end], sizes) if end - k > 1 else ():
            while read == sizes[at - k]:
                at, read = at + 1, 0
            read += 1
            yield at, sample
        for j in range(at, end):
            task = tasks[j]
            if j == at and read:
                if read == sizes[j - k]:
                    continue
                task = Task(task.shard, task.start + read, task.stop)
            for sample in task_run(ds, task, shards):
                yield j, sample
        k = end


def one_pass(ds, tasks: list[Task], sizes: list[int]) -> Iterator[tuple[str, bytes, int]]:
    """The samples of tasks of one shard, read in one pass where the index reads the shard
    (wds_shards.read_stored_runs), as task_run reads them; it stops before a sample that fails
    its checks or past the shard's end, for task_run to read from there, and fail or warn."""
    shard, reader = tasks[0].shard, index_reader(ds)
    if reader is None or not reader.as_indexed(shard):
        return
    starts = np.array([task.start for task in tasks], np.int64)
    try:
        for index, image, label in wds_shards.read_stored_runs(reader, shard, starts, starts + sizes):
            if isinstance(image, CorruptDataError):
                return
            yield SampleName(reader, index), image, label
    except CorruptDataError:
        return


def task_run(ds, task: Task, shards) -> Iterator[tuple[str, bytes, int]]:
    """The task's samples, its shard's cut at the task's ends; damage fails the stream or,
    with on_error="skip", leaves out the sample or the rest of its shard, warned."""
    path, expected = ds.shards[task.shard], ds.shard_counts()[task.shard]
    wanted = expected if task.stop is None else task.stop
    got = task.start  # the shard's samples passed, counted from its first
    try:
        for where, image, label in ds.shard_samples(task.shard, shards, task.start, task.stop):
            got += 1
            if image is not None:
                yield where, image, label
            elif ds.on_error == "fail":
                raise label
            else:
                warnings.warn(f"{label}; skipped this sample, 1 sample short this epoch", RuntimeWarning,
                              stacklevel=2)
            if got == wanted:
                break
        if got < wanted:
            raise CorruptDataError(f"{path}: ended after {got} samples, {expected} expected; the shard "
                                   "is truncated or was replaced (re-create it, or read with "
                                   "on_error='skip')", path)
    except ReplacedError:
        raise  # not damage to skip: every shard from here on is the other dataset's
    except CorruptDataError as exc:
        if ds.on_error == "fail":
            raise
        warnings.warn(f"{exc}; skipped the rest of this shard, {wanted - got} sample(s) short this epoch",
                      RuntimeWarning, stacklevel=2)


def read_ordinals(ds, tasks: list[Task], sizes: list[int], start: int, keep) -> Iterator[tuple[int, tuple]]:
    """(ordinal, sample) of the tasks' samples numbered from 0 whose ordinal is in `keep`
    or at least `start`; a task holding none of them is skipped unread."""
    wanted = sorted(set(keep))
    kept = set(wanted)
    firsts = list(itertools.accumulate(sizes, initial=0))
    due = [k for k in range(len(tasks)) if firsts[k + 1] > start
           or bisect.bisect_left(wanted, firsts[k]) < bisect.bisect_left(wanted, firsts[k + 1])]
    passed = [0] * len(due)  # each due task's samples read: a sample's ordinal counts its task's
    for j, sample in read_tasks(ds, [tasks[k] for k in due], numbered=True):
        ordinal = firsts[due[j]] + passed[j]
        passed[j] += 1
        if ordinal >= start or ordinal in kept:
            yield ordinal, sample


def check_replaced(ds) -> None:
    """Raise the project's error if the packer folder was replaced (pack --force) since
    the Dataset read its index: its shards would be read under a stale class list."""
    if ds.index_file is not None and current_identity(ds.index_file, ds.remote) != ds.identity:
        raise replaced_error(ds.index_file)


def shard_samples(ds, shard: int, shards, start: int = 0, stop: int | None = None
                  ) -> Iterator[tuple[str, bytes | None, int | CorruptDataError]]:
    """(where, image bytes, label) of each image sample of the shard from its start-th,
    in order: by the index, to before its stop-th (None: to its end); parsed, on to the
    end unless its caller stops. A sample failing its checks comes as (where, None, the
    error). Damage that ends the shard raises.

    Read by the index where it describes the shard: each image is one pread at the offset
    records.bin gives, checked against the table's checksum, its label from the table, so no
    tar header or .cls/.json member is parsed: the same samples, at the cost of a read by
    index. Parsed otherwise, as is a packer shard whose index does not load or whose size
    is not the one the index gives (cut short, replaced): parsing says where the damage is."""
    reader = index_reader(ds)
    if reader is not None and reader.as_indexed(shard):
        return indexed_samples(ds, reader, shard, start, stop)
    return parsed_samples(ds, shard, shards, start)


class SampleName:
    """An indexed sample's name in messages, "<folder>: <relative path>" as the map-style
    Datasets name a record: the path is looked up when a message needs it, as those do, so
    a stream never loads the path table."""

    __slots__ = ("reader", "index")

    def __init__(self, reader: wds.Reader, index: int):
        self.reader, self.index = reader, index

    def __str__(self) -> str:
        return f"{self.reader.path}: {self.reader.path_of(self.index)}"


def indexed_samples(ds, reader: wds.Reader, shard: int, start: int, stop: int | None) -> Iterator:
    for passed, (index, image, label) in enumerate(wds_shards.read_stored(reader, shard, start, stop), start):
        if isinstance(image, CorruptDataError):
            if index_damaged(reader):  # the record's checksum, not the image: the shard's tar says
                ds._index = False
                yield from parsed_samples(ds, shard, None, passed)
                return
            yield SampleName(reader, index), None, image
        else:
            yield SampleName(reader, index), image, label


def index_damaged(reader: wds.Reader) -> bool:
    """Whether records.bin fails its CRC-32 or checks: looked at when a sample fails its
    checksum (a pass over the mapped table, once), since streaming checks only each shard's
    records (stored_in) and a table of up to 64 MiB as it is mapped."""
    try:
        reader.records
    except PackError:
        return True
    return False


def parsed_samples(ds, shard: int, shards, start: int) -> Iterator:
    path = ds.shards[shard]
    passed = 0
    opened = False
    for sample in wds_shards.iter_samples(path, opener=shards):
        if not opened:  # checked once the shard is open: then the shard read is the dataset's checked
            check_replaced(ds)
            opened = True
        suffix = wds_shards.image_suffix(sample.parts)
        if suffix is None:
            continue
        if passed < start:  # another worker's (or an earlier task's) samples: parsed past, not checked
            passed += 1
            continue
        where = f"{path}: {sample.key}"
        try:
            yield where, sample.parts[suffix], sample_label(where, sample.parts, suffix, ds.check_crc,
                                                            len(ds.classes))
        except CorruptDataError as exc:
            yield where, None, exc
    if not opened:
        check_replaced(ds)
    if passed < start:
        raise CorruptDataError(f"{path}: ended after {passed} samples, {ds.shard_counts()[shard]} expected; "
                               "the shard is truncated or was replaced (re-create it, or read with "
                               "on_error='skip')", path)


def index_reader(ds) -> wds.Reader | None:
    """This process's reader of the packer folder's index, opened for streaming (kept in
    ds._index); None for other shards, and where the index does not load or lists other shards."""
    if ds._index is None:
        ds._index = False
        if ds.packed is not None:
            try:
                reader = wds.Reader(ds.packed, ds.split, check_crc=ds.check_crc)
            except PackError:
                return None
            if reader.identity != ds.identity:  # its tables and labels are another dataset's
                raise replaced_error(ds.index_file)
            try:  # records.bin mapped, CRC-checked now when small; damage means parsing
                reader.record_blocks()
            except PackError:
                return None
            if [os.path.join(ds.packed, name) for name in reader.shards] == ds.shards:
                reader.advise("sequential")
                ds._index = reader
    return ds._index or None
