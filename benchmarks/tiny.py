"""Scale study on synthetic packs of tiny records, up to 10^8: what a record costs a reader.

    python -m benchmarks.scale tiny --records 20000 1281167 10000000 100000000 --workdir /tmp/tiny

Each pack holds `records` records of a few bytes (the record's number), 1,000 classes in
runs, written by the format's own Writer (no ImageFolder tree: 10^8 files would not fit a
machine's inodes, and what is measured here is what the pack's tables and the sampler
cost per record, which the records' size does not change). For each size it measures, in
fresh processes:
- the pack: wall time, records/s, the packer's peak RSS (the kernel's high-water mark);
- open: a fresh process's open_reader(...).open(), which maps the tables reads use
  (imports left out; reads check the blocks they use, check_tables every table whole);
- first batch: a shuffled make_loader (ShuffleSampler, 2 workers, batch 256) from the
  dataset's construction to its first batch;
- memory after 10,000 random reads: the main process's and each worker's USS
  (Private_Clean + Private_Dirty, /proc/PID/smaps_rollup);
  with --stream (a WebDataset pack), a WDSDataset streamed through a shuffle buffer in
  place of the map-style Dataset and its sampler, and 10,000 samples streamed;
- resume: the loader's state after those reads, loaded into a loader on 2 ranks (rank
  1's), to its first batch, against the same loader started afresh on 2 ranks: PAIRS
  pairs in each of the 3 probe processes, taking turns at which runs first; the figure
  is the median of the pairs' ratios, with their quartiles.
WORKDIR/tiny.json holds every figure, WORKDIR/tiny.md the table, with the 400M and 1B
rows extrapolated from each figure's least-squares slope over the sizes measured.

`python -m benchmarks.scale tiny-sampler` times each sampler alone over a plain dataset
of 10^9 items: its first indexes on rank 3 of 8, and its first after resuming that
rank's state half-way through the epoch on 3 ranks, with the peak memory they allocate.
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from .processes import MB, log, memory, open_seconds, timed_process

CLASSES = 1000
BATCH = 256
READS = 10_000  # random reads before memory is measured
CHUNK = 1 << 16  # records generated at a time: a few MB of temporaries
PATH_WIDTH = 16  # "c0000/0000000000": every path the same length, so offsets are a formula
EXTRAPOLATE = (400_000_000, 1_000_000_000)
STREAM_BUFFER = 1000  # --stream: each worker's shuffle buffer, in samples
LAION_SHARDS, LAION_PER_SHARD = 41_455, 10_000  # LAION-400M's WebDataset layout
PAIRS = 7  # fresh starts and resumes on 2 ranks timed in each probe process, in pairs


def mapped_chunks(chunks, folder: str) -> mmap.mmap:
    """The bytes of chunks written to an unlinked file in folder and mapped read-only: a
    table as large as the records, off the heap."""
    with tempfile.TemporaryFile(dir=folder) as f:
        size = 0
        for chunk in chunks:
            f.write(chunk)
            size += len(chunk)
        f.flush()
        return mmap.mmap(f.fileno(), max(size, 1), access=mmap.ACCESS_READ)


def labels_of(first: int, stop: int, records: int) -> np.ndarray:
    return (np.arange(first, stop, dtype=np.int64) * CLASSES // records).astype(np.int32)


def path_chunks(records: int):
    for first in range(0, records, CHUNK):
        stop = min(records, first + CHUNK)
        yield b"\0".join(b"c%04d/%010d" % (label, i) for i, label in
                         zip(range(first, stop), labels_of(first, stop, records).tolist())) + (b"\0" if stop < records
                                                                                                else b"")


def write_tiny_pack(out: str, records: int, fmt: str = "hdf5", options: dict | None = None) -> None:
    """A pack of `records` tiny records at out, streamed: flat memory at any size (options:
    the format's writer options, e.g. WebDataset's max_count)."""
    from packer import checksum as record_checksums
    from packer.records import Metadata, PathTable, SplitInfo
    from packer.formats._tables import drop_pages
    from packer.version import __version__
    from packer.writing import now_utc, write_dataset

    folder = os.path.dirname(os.path.abspath(out))
    kind = record_checksums.DEFAULT
    labels = np.frombuffer(mapped_chunks((labels_of(a, min(records, a + CHUNK), records).tobytes()
                                          for a in range(0, records, CHUNK)), folder), np.int32, records)
    offsets = np.frombuffer(mapped_chunks(((np.arange(a, min(records, a + CHUNK) + (a + CHUNK >= records),
                                                      dtype=np.int64) * (PATH_WIDTH + 1)).tobytes()
                                           for a in range(0, records, CHUNK)), folder), np.int64, records + 1)
    paths = PathTable(mapped_chunks(path_chunks(records), folder), offsets)

    def fill(writer) -> Metadata:
        writer.begin_split("train", expected_count=records)
        checksum, add, nbytes = record_checksums.function(kind), writer.add, 0
        named = fmt == "lmdb"  # an LMDB record's header holds its path, which reads check against the table
        for first in range(0, records, CHUNK):
            stop = min(records, first + CHUNK)
            for i, label in zip(range(first, stop), labels[first:stop].tolist()):
                data = i.to_bytes(5, "little")
                add(data, label, f"c{label:04d}/{i:010d}" if named else "", checksum(data))
            nbytes += 5 * (stop - first)
            drop_pages(labels)  # read once: out of RSS (they stay in the page cache)
        writer.end_split(labels, paths)
        counts = sum(np.bincount(labels_of(a, min(records, a + CHUNK), records), minlength=CLASSES)
                     for a in range(0, records, CHUNK))
        return Metadata(format=fmt, classes=[f"c{k:04d}" for k in range(CLASSES)],
                        splits={"train": SplitInfo(records, nbytes, [int(c) for c in counts])},
                        source="synthetic", created=now_utc(), packer_version=__version__,
                        params={"format": fmt, "synthetic": True}, checksum=kind)

    write_dataset(fmt, out, True, options, fill, kind)


def batch_size_of(batch: list) -> int:
    """A collate_fn for raw records: what is measured is reading them, not collating."""
    return len(batch)


def dataset_of(out: str, stream: bool):
    """The pack's map-style Dataset, or with stream its WDSDataset (a WebDataset pack streamed
    through a shuffle buffer of STREAM_BUFFER samples per worker)."""
    import readers

    if stream:
        return readers.WDSDataset(out, decode="raw", shuffle=STREAM_BUFFER)
    return readers.open_dataset(out, decode="raw")


def first_batch_s(out: str, stream: bool = False, **env) -> tuple[float, object]:
    """Seconds from a dataset's construction to a shuffled make_loader's first batch, and the
    loader's iterator (its workers alive), under RANK/WORLD_SIZE env."""
    import readers

    os.environ.update({key: str(value) for key, value in env.items()})
    start = time.perf_counter()
    loader = readers.make_loader(dataset_of(out, stream), BATCH, workers=2, seed=0, collate_fn=batch_size_of)
    batches = iter(loader)
    next(batches)
    return time.perf_counter() - start, (loader, batches)


class Items:
    """A plain map-style dataset of n items (no packer reader): the sampler alone is measured."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def sampler_start(kind, n: int = 10 ** 9, indexes: int = BATCH) -> dict:
    """Seconds and traced peak MB to a sampler's first `indexes`, fresh on rank 3 of 8 and
    resumed half-way through the epoch on rank 1 of 3."""
    import tracemalloc

    tracemalloc.start()
    start = time.perf_counter()
    sampler = kind(Items(n), seed=0, rank=3, world_size=8)
    first = [index for _, index in zip(range(indexes), sampler)]
    fresh = time.perf_counter() - start
    state = {**sampler.state_dict(), "position": n // 16}
    start = time.perf_counter()
    resumed = kind(Items(n), seed=0, rank=1, world_size=3)
    resumed.load_state_dict(state)
    after = [index for _, index in zip(range(indexes), resumed)]
    found = {"sampler": kind.__name__, "records": n, "first_s": fresh, "resumed_s": time.perf_counter() - start,
             "peak_mb": tracemalloc.get_traced_memory()[1] / MB}
    tracemalloc.stop()
    assert len(set(first)) == len(set(after)) == indexes
    return found


def laion_index(out: str, shards: int = LAION_SHARDS, per_shard: int = LAION_PER_SHARD) -> str:
    """A packer WebDataset folder whose index lists `shards` shards of `per_shard` samples:
    a one-shard tiny pack, its index's shard list repeated (no other shard is written; a
    stream's plan and resume read the list alone)."""
    write_tiny_pack(out, CLASSES, "wds", {"max_count": CLASSES})
    with open(os.path.join(out, "index.json"), encoding="utf-8") as f:
        index = json.load(f)
    entry = index["wds"]["splits"]["train"]
    one = entry["shards"][0]
    entry["shards"] = [{**one, "name": f"train/shard-{k:06d}.tar", "count": per_shard} for k in range(shards)]
    with open(os.path.join(out, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f)
    return out


def shard_list_cost(workdir: str, world_size: int = 8) -> dict:
    """What a WDSDataset holds for its shard list at LAION-400M's layout (run as
    `tiny-shards`, a fresh process): traced bytes kept by the dataset, and the peak of its
    plan on one rank and on rank 0 of world_size, and of a resume's plan on world_size
    after a pass on 3 ranks of 2 workers (1,000 batches of BATCH each, shuffle buffer 1,000)."""
    import tracemalloc

    import readers
    from readers.wds_elastic import rank_plan

    out = laion_index(os.path.join(workdir, "laion-index.wds"))
    tracemalloc.start()
    dataset = readers.WDSDataset(out, shuffle=1000)
    found = {"shards": LAION_SHARDS, "per_shard": LAION_PER_SHARD, "world_size": world_size,
             "dataset_mb": tracemalloc.get_traced_memory()[0] / MB}
    for name, ranks, history in (("plan_1_rank", 1, []), (f"plan_rank_0_of_{world_size}", world_size, []),
                                 (f"resume_rank_0_of_{world_size}", world_size,
                                  [{"world_size": 3, "workers": 2, "batches": 1000, "batch_size": BATCH,
                                    "drop_last": False}])):
        tracemalloc.reset_peak()
        start, before = time.perf_counter(), tracemalloc.get_traced_memory()[0]
        plan = rank_plan(dataset, 0, ranks, history)
        found[name] = {"s": time.perf_counter() - start, "tasks": len(plan),
                       "kept_mb": (tracemalloc.get_traced_memory()[0] - before) / MB,
                       "peak_mb": (tracemalloc.get_traced_memory()[1] - before) / MB}
        del plan
    tracemalloc.stop()
    found["dataset_bytes_per_shard"] = found["dataset_mb"] * MB / LAION_SHARDS
    return found


def children() -> list[int]:
    """This process's child processes: the DataLoader's workers."""
    pid = os.getpid()
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def probe(out: str, stream: bool = False) -> dict:
    """Everything measured in the reading process (run as `tiny-probe`, a fresh process)."""
    import readers

    found = {}
    found["first_batch_s"], (loader, batches) = first_batch_s(out, stream)
    read = BATCH
    while read < READS:
        read += next(batches)
    found["main"] = memory("self")
    found["workers"] = [memory(pid) for pid in children()]
    state = loader.state_dict()
    del batches, loader
    found["start_pairs"] = start_pairs(out, stream, state)
    found["read"] = read
    return found


def timed_start(out: str, stream: bool, state: dict | None = None) -> float:
    """Seconds from a dataset's construction to the first batch of its shuffled make_loader
    on rank 1 of 2, started afresh or, given a state, resumed from it. The garbage of the
    runs before is collected first and the loader's workers shut down after, both untimed:
    a collection of this process's heap takes a tenth of a second, as long as a run."""
    import gc

    import readers

    gc.collect()
    os.environ.update(RANK="1", WORLD_SIZE="2")
    start = time.perf_counter()
    loader = readers.make_loader(dataset_of(out, stream), BATCH, workers=2, seed=0, collate_fn=batch_size_of)
    if state is not None:
        loader.load_state_dict(state)
    batches = iter(loader)
    next(batches)
    seconds = time.perf_counter() - start
    del batches, loader
    return seconds


def start_pairs(out: str, stream: bool, state: dict, pairs: int = PAIRS) -> list[list[float]]:
    """[fresh start s, resume s] of `pairs` pairs on rank 1 of 2, the pairs taking turns at
    which runs first: the second of a pair finds the pages the first read cached."""
    found = []
    for k in range(pairs):
        if k % 2:
            resumed = timed_start(out, stream, state)
            fresh = timed_start(out, stream)
        else:
            fresh = timed_start(out, stream)
            resumed = timed_start(out, stream, state)
        found.append([fresh, resumed])
    return found


def resume_figures(pairs: list[list[float]]) -> dict:
    """A size's resume figures from every pair its probes ran: the median fresh start and
    resume, and the median of the pairs' ratios with their quartiles (each ratio is of two
    runs a moment apart, so a load that comes and goes moves both)."""
    fresh, resumed = np.array(pairs, np.float64).T
    ratios = resumed / fresh
    return {"fresh_2_ranks_s": float(np.median(fresh)), "resume_2_ranks_s": float(np.median(resumed)),
            "resume_ratio": float(np.median(ratios)),
            "resume_ratio_quartiles": [float(q) for q in np.percentile(ratios, [25, 75])], "resume_pairs": pairs}


def bytes_of(out: str) -> int:
    """The pack's size: its file, or every file of its folder (WebDataset)."""
    if not os.path.isdir(out):
        return os.path.getsize(out)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(out) for name in names)


def measure(workdir: str, records: int, fmt: str, keep: bool, stream: bool = False) -> dict:
    out = os.path.join(workdir, f"tiny-{records}.{fmt}")
    packed = timed_process([sys.executable, "-m", "benchmarks.scale", "tiny-pack", out, "--records", str(records),
                            "--format", fmt])
    log(f"tiny {records}: packed in {packed['wall_s']:.0f} s, peak RSS {packed['peak_rss_mb']:.0f} MB")
    probes = []
    for _ in range(3):
        result = timed_process([sys.executable, "-m", "benchmarks.scale", "tiny-probe", out]
                               + ["--stream"] * stream)
        probes.append(json.loads(result["output"].strip().splitlines()[-1]))
    found = probes[int(np.argsort([p["first_batch_s"] for p in probes])[1])]  # the median run's
    found.update(resume_figures([pair for p in probes for pair in p.pop("start_pairs")]))
    found.update(open_seconds(out))
    found.update(records=records, format=fmt, stream=stream, pack_s=packed["wall_s"], pack_peak_rss_mb=packed["peak_rss_mb"],
                 pack_peak_anon_mb=packed["peak_anon_mb"],
                 pack_rate=records / packed["wall_s"], pack_bytes=bytes_of(out))
    if keep:
        pass
    elif os.path.isdir(out):
        shutil.rmtree(out)
    else:
        os.remove(out)
    log(f"tiny {records}: {json.dumps(found)}")
    return found


def resume_ratio(r: dict) -> str:
    """A row's resume against a fresh start: the median of its pairs' ratios (quartiles in
    brackets), or for an extrapolated row or one measured before pairs, of its two figures."""
    if "resume_ratio" not in r:
        return f"{r['resume_2_ranks_s'] / r['fresh_2_ranks_s']:.2f}"
    low, high = r["resume_ratio_quartiles"]
    return f"{r['resume_ratio']:.2f} ({low:.2f}-{high:.2f})"


COLUMNS = (("pack s", lambda r: f"{r['pack_s']:.0f}"), ("records/s", lambda r: f"{r['pack_rate']:,.0f}"),
           ("pack peak RSS MB (anon)", lambda r: f"{r['pack_peak_rss_mb']:.0f} ({r['pack_peak_anon_mb']:.0f})"),
           ("open s", lambda r: f"{r['open_s']:.3f}"),
           ("first batch s", lambda r: f"{r['first_batch_s']:.2f}"),
           ("main USS MB", lambda r: f"{r['main']['uss_mb']:.1f}"),
           ("worker USS MB", lambda r: " / ".join(f"{w['uss_mb']:.1f}" for w in r["workers"])),
           ("worker private dirty MB", lambda r: " / ".join(f"{w['private_dirty_mb']:.1f}" for w in r["workers"])),
           ("start on 2 ranks s", lambda r: f"{r['fresh_2_ranks_s']:.2f}"),
           ("resume on 2 ranks s", lambda r: f"{r['resume_2_ranks_s']:.2f}"),
           ("resume / start", resume_ratio))



SCALARS = ("pack_s", "pack_peak_rss_mb", "pack_peak_anon_mb", "open_s", "first_batch_s", "fresh_2_ranks_s",
           "resume_2_ranks_s")


def extrapolated(rows: list[dict], records: int) -> dict:
    """A row at `records` from each figure's least-squares slope over every size measured
    (no one size's noise decides it). A slope below zero is noise about a figure that does
    not grow: that figure is carried flat from the largest size, not extrapolated to shrink."""
    ordered = sorted(rows, key=lambda r: r["records"])
    high, sizes = ordered[-1], np.array([r["records"] for r in ordered], np.float64)

    def at(values: list[float], last: float) -> float:
        slope = max(0.0, float(np.polyfit(sizes, np.array(values, np.float64), 1)[0]))
        return last + slope * (records - high["records"])

    row = {key: at([r[key] for r in ordered], high[key]) for key in SCALARS}
    row.update(records=records, extrapolated=True, pack_rate=records / row["pack_s"],
               main={"uss_mb": at([r["main"]["uss_mb"] for r in ordered], high["main"]["uss_mb"])},
               workers=[{key: at([r["workers"][w][key] for r in ordered], worker[key])
                         for key in ("uss_mb", "private_dirty_mb")} for w, worker in enumerate(high["workers"])])
    return row


def table(rows: list[dict]) -> str:
    lines = ["| records | " + " | ".join(name for name, _ in COLUMNS) + " |",
             "| --- |" + " --- |" * len(COLUMNS)]
    measured = [r for r in rows if not r.get("extrapolated")]
    shown = measured + ([extrapolated(measured, n) for n in EXTRAPOLATE] if len(measured) >= 2 else [])
    for r in shown:
        name = f"{r['records']:,}" + (" (extrapolated)" if r.get("extrapolated") else "")
        lines.append(f"| {name} | " + " | ".join(show(r) for _, show in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def markdown(results: dict) -> str:
    """The results page's table of a committed tiny.json (docs/sync.py), and with a stream's
    results, its shard list's cost at LAION-400M's layout."""
    shards = results.get("shard_list")
    if shards is None:
        return table(results["rows"])
    lines = [f"\nShard list at {shards['shards']:,} shards of {shards['per_shard']:,} samples (`tiny-shards`): "
             f"the dataset keeps {shards['dataset_mb']:.1f} MB traced ({shards['dataset_bytes_per_shard']:.0f} bytes "
             "a shard).\n", "| plan | s | tasks | kept MB | peak MB |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {name.replace('_', ' ')} | {shards[name]['s']:.2f} | {shards[name]['tasks']:,} | "
              f"{shards[name]['kept_mb']:.1f} | {shards[name]['peak_mb']:.1f} |"
              for name in shards if isinstance(shards[name], dict)]
    return table(results["rows"]) + "\n".join(lines) + "\n"


def run(workdir: str, counts: list[int], fmt: str, keep: bool, stream: bool = False) -> list[dict]:
    os.makedirs(workdir, exist_ok=True)
    rows = [measure(workdir, records, fmt, keep, stream) for records in counts]
    results = {"rows": rows, "mb": MB}
    if stream:
        shards = timed_process([sys.executable, "-m", "benchmarks.scale", "tiny-shards", "--workdir", workdir])
        results["shard_list"] = json.loads(shards["output"].strip().splitlines()[-1])
    with open(os.path.join(workdir, "tiny.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(workdir, "tiny.md"), "w") as f:
        f.write(table(rows))
    return rows
