"""The columns of the table: what is timed for a source, as small cases in MEASURES.

Every measure follows one shape (ffcv's): setup() does the untimed work once, run()
is one timed run of at most `budget` seconds that builds its own readers and closes
them afterwards (an open LMDB map would keep its pages cached), and the caller adds
the warm-up and the repeats. Rates are samples per second.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.utils.data

from packer.formats import will_need
from packer.check import IMAGE_EXTENSIONS

from . import cache


@dataclass
class Options:
    budget: float = 1.0  # seconds per timed run (a cold or e2e run also ends when the data does)
    warmup: float = 0.25  # seconds of untimed warm-up per case
    repeat: int = 3
    batch_size: int = 64
    workers: int = 2
    device: str = "cpu"
    step_ms: float = 20.0  # the synthetic training step per batch in the end-to-end measure
    seed: int = 0


RAW_MODES = ("raw", "checked")  # bytes only; "checked" with each record's checksum checked


class ItemLoop:
    """One process pulls samples one at a time: raw bytes, decoded uint8 RGB, or augmented.

    order "random" is a permutation (shard order for shards); "block" walks a map-style
    source with readers.BlockShuffleSampler (only sources with `blocks` take it). A run
    reads `epochs` passes over the data at most (None: as many as the budget allows, each
    in its epoch's order) and ends with them or with its budget, whichever comes first.
    """

    def __init__(self, mode: str, description: str, order: str = "random"):
        self.mode, self.description, self.order = mode, description, order

    def setup(self, source, ctx: dict, opts: Options):
        return self

    def run(self, source, ctx: dict, opts: Options, budget: float, seed: int, epochs: int | None = 1) -> dict:
        opening = time.perf_counter()
        samples = source.samples(ctx, self.mode, seed, self.order, epochs)  # listing, opening: reported apart
        open_s = time.perf_counter() - opening
        n = nbytes = 0
        try:
            start = time.perf_counter()
            for sample in samples:
                n += 1
                if self.mode in RAW_MODES:
                    nbytes += len(sample)
                if time.perf_counter() - start >= budget:
                    break
            seconds = time.perf_counter() - start
        finally:
            close = getattr(samples, "close", None)
            if close is not None:
                close()
        out = {"samples": n, "seconds": seconds, "open_s": open_s}
        if self.mode in RAW_MODES:
            out["mb_per_s"] = nbytes / 1e6 / seconds
        return out


class PairedCheckedRead(ItemLoop):
    """Checked raw reads timed against unchecked ones in the same run: one random order
    (readers.ShuffleSampler, with its read-ahead hints) is read in blocks of BLOCK records,
    alternately through a Dataset with the check on and one with it off (the first side
    alternates too). Each side's rate is its records over its own time, and "vs_raw" is the
    checked rate over the unchecked one of the same run: the two read the same file, cache
    state and moment, so a drift in the machine's speed between runs minutes apart (cases
    run one after the other) falls on both alike. The check costs a few microseconds in a
    read of a dozen; separate runs drifted more than that.
    """

    BLOCK = 256

    def __init__(self, description: str):
        super().__init__("checked", description)

    def run(self, source, ctx: dict, opts: Options, budget: float, seed: int, epochs: int | None = 1) -> dict:
        import readers

        from .sources import _epochs

        opening = time.perf_counter()
        sides = {"checked": source.open(ctx, "raw", checked=True), "raw": source.open(ctx, "raw")}
        for dataset in sides.values():
            dataset.open()
        open_s = time.perf_counter() - opening
        order = readers.ShuffleSampler(sides["checked"], seed=seed)
        counts = {name: [0, 0, 0.0] for name in sides}  # samples, bytes, seconds
        try:
            for epoch in _epochs(epochs):
                order.set_epoch(epoch)
                if self.read_blocks(iter(order), sides, counts, budget):
                    break
        finally:
            for dataset in sides.values():
                dataset.close()
        (n, nbytes, seconds), (n_raw, _, seconds_raw) = counts["checked"], counts["raw"]
        raw_rate = n_raw / seconds_raw if n_raw else None  # a one-record dataset reads checked only
        return {"samples": n, "seconds": seconds, "open_s": open_s, "mb_per_s": nbytes / 1e6 / seconds,
                "raw_rate": raw_rate, "vs_raw": n / seconds / raw_rate if raw_rate else None}

    def read_blocks(self, indexes, sides: dict, counts: dict, budget: float) -> bool:
        """Read one pass of indexes block by block, alternating sides; True once both sides'
        time together reaches budget. A small dataset takes smaller blocks, so that one pass
        reads both sides twice."""
        size = max(1, min(self.BLOCK, len(sides["checked"]) // 4))
        turn = 0
        while True:
            name = ("checked", "raw")[(turn + turn // 2) % 2]  # checked, raw, raw, checked, ...
            dataset, tally = sides[name], counts[name]
            start = time.perf_counter()
            block = list(itertools.islice(indexes, size))  # timed: drawing indexes sends the sampler's hints
            if not block:
                return False
            for i in block:
                tally[1] += len(dataset[i][0])
            tally[2] += time.perf_counter() - start
            tally[0] += len(block)
            turn += 1
            if counts["checked"][2] + counts["raw"][2] >= budget:
                return True


def count_bytes(batch: list) -> tuple[int, int]:
    """A DataLoader collate for raw samples: (samples, bytes) of the batch. Run in the
    worker, so the loader measure times reading, not sending the bytes between processes."""
    return len(batch), sum(len(sample[0]) for sample in batch)


class PlainLoaderRead(ItemLoop):
    """Raw reads through a plain torch DataLoader: the ImageFolder drop-in as the README
    writes it, DataLoader(ds, batch_size, shuffle=True, num_workers=W), with no packer
    sampler and no make_loader. The only change is the collate (count_bytes): training
    decodes in the worker, so what leaves it is small either way.

    shuffle=True is a RandomSampler; a warm run, which reads passes until its budget is
    spent, asks that sampler for many passes' worth, so the workers are forked once. As in
    the e2e measure, the timed window opens once every worker has delivered a batch:
    start-up (forking, opening the dataset) is left out and reported as open_s.
    """

    PASSES_WARM = 1000  # more than any budget reads: the run stops on time

    def __init__(self, description: str):
        super().__init__("raw", description)

    def loader(self, dataset, opts: Options, seed: int, epochs: int | None):
        sampler = torch.utils.data.RandomSampler(dataset, num_samples=len(dataset) * (epochs or self.PASSES_WARM),
                                                 generator=torch.Generator().manual_seed(seed))
        return torch.utils.data.DataLoader(dataset, batch_size=opts.batch_size, sampler=sampler,
                                           num_workers=opts.workers, collate_fn=count_bytes)

    def run(self, source, ctx: dict, opts: Options, budget: float, seed: int, epochs: int | None = 1) -> dict:
        dataset = source.open(ctx, "raw")
        fill = max(1, opts.workers)
        counts = {"all": [0, 0], "window": [0, 0]}  # samples, bytes
        batches, opened, it = 0, None, None
        try:
            start = time.perf_counter()
            it = iter(self.loader(dataset, opts, seed, epochs))
            for samples, size in it:
                batches += 1
                for key in ("all", "window") if opened is not None else ("all",):
                    counts[key][0] += samples
                    counts[key][1] += size
                if batches == fill:  # every worker has delivered: the window opens
                    opened = time.perf_counter()
                elif opened is not None and time.perf_counter() - opened >= budget:
                    break
            end = time.perf_counter()
        finally:
            del it  # shuts the workers down
            getattr(dataset, "close", lambda: None)()
        key, since = ("window", opened) if opened is not None and counts["window"][0] else ("all", start)
        seconds = end - since
        out = {"samples": counts[key][0], "seconds": seconds, "mb_per_s": counts[key][1] / 1e6 / seconds,
               "open_s": since - start}
        if key == "all":
            out["note"] = f"only {batches} batch(es): start-up included in the timing"
        return out


def repetitions_for(work, seconds: float, calibrate_s: float = 0.1) -> int:
    """How many repetitions make work(k) last `seconds`, timed over at least calibrate_s
    (one matmul can take microseconds, too short to time alone)."""
    k, elapsed = 1, 0.0
    while elapsed < calibrate_s:
        k *= 2
        start = time.perf_counter()
        work(k)
        elapsed = time.perf_counter() - start
    return max(1, round(seconds / (elapsed / k)))


def make_step(device: torch.device, ms: float):
    """(step, description): a fixed amount of work per batch standing in for training."""
    if ms <= 0:
        return (lambda: None), "no step (data loading alone)"
    if device.type == "cuda":
        a = torch.randn(2048, 2048, device=device, dtype=torch.float16)

        def matmuls(k: int) -> None:
            for _ in range(k):
                a @ a
            torch.cuda.synchronize(device)  # the step ends when the GPU is done, not when queued

        matmuls(5)
        k = repetitions_for(matmuls, ms / 1000)
        return (lambda: matmuls(k)), f"GPU step: {k} fp16 2048x2048 matmuls + synchronize (~{ms:g} ms per batch)"
    return (lambda: time.sleep(ms / 1000)), f"CPU stand-in for a GPU step: sleep {ms:g} ms per batch"


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def to_device(batch, device: torch.device):
    """(images, labels) uint8 from a plain DataLoader -> normalised float32 images on device.

    The same work readers.CUDAPrefetcher does for make_loader's batches, done the simple
    way (a synchronous copy), so every e2e row delivers the same thing to the step.
    """
    images, labels = batch[0], batch[1]
    images = images.to(device)
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255
    return (images.float() - mean) / std, labels.to(device)


def batch_len(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)):
        return batch_len(batch[0])
    if isinstance(batch, dict):
        return batch_len(next(iter(batch.values())))
    return len(batch)


def children_cpu() -> dict[int, float] | None:
    """{pid: user + system CPU seconds} of this process's live children (the loader's
    workers), from /proc; None where /proc cannot say (not Linux)."""
    try:
        pids = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(pid) for pid in f.read().split())
    except OSError:
        return None
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after the name, which may hold spaces
        except OSError:  # gone meanwhile
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


class CPUClock:
    """CPU seconds spent by this process and by its children over a window: a run's cost
    in CPU, which on a shared machine moves far less than its wall time."""

    def __init__(self):
        self.main, self.children = time.process_time(), children_cpu()

    def since(self) -> tuple[float, float | None]:
        """(main process, children alive at both ends) CPU seconds since the clock started."""
        main = time.process_time() - self.main
        now = children_cpu()
        if self.children is None or now is None:
            return main, None
        return main, sum(now[pid] - cpu for pid, cpu in self.children.items() if pid in now)


class EndToEnd:
    """Batches through the training loader onto the device, each followed by a fixed step.

    Reports samples/s arriving on the device, the fraction of wall time the step loop
    spent waiting for the next batch, and the CPU time per sample over the timed window,
    of the main process and of the loader workers (CPUClock): on a machine shared with
    other work, wall time moves with the neighbours, CPU time per sample far less. The timed window opens once every worker has
    delivered a batch: start-up (forking workers, opening files, filling the pipeline)
    is excluded like the warm-up and reported apart as startup_s, since it is paid once
    per epoch and would otherwise weigh more the shorter the budget.
    """

    description = "end to end: loader -> device, with a fixed step per batch"

    def setup(self, source, ctx: dict, opts: Options):
        self.device = torch.device(opts.device)
        self.step, self.step_description = make_step(self.device, opts.step_ms)
        return self

    def run(self, source, ctx: dict, opts: Options, budget: float, seed: int) -> dict:
        # Untimed: datasets and loader objects, no data read. The run's seed fixes the shuffle and (below) the
        # workers' seeds, so sources run with one seed decode the same images with the same crops.
        loader = source.loader(ctx, replace(opts, seed=seed))
        torch.manual_seed(seed)
        fill = max(1, opts.workers)
        counts = {"all": [0, 0.0], "window": [0, 0.0]}  # samples, seconds waited
        batches = 0
        opened = None
        it = None
        try:
            start = time.perf_counter()
            it = iter(loader.batches)
            while True:
                t0 = time.perf_counter()
                if batches == fill:
                    opened, clock = t0, CPUClock()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                if not loader.on_device:
                    batch = to_device(batch, self.device)
                if self.device.type == "cuda":
                    # The step before ended synchronized, so this waits only for this batch's copy
                    # (and on-device preparation): data time, which the step would otherwise absorb.
                    torch.cuda.current_stream(self.device).synchronize()
                waited = time.perf_counter() - t0
                batches += 1
                for key in ("all", "window") if opened is not None else ("all",):
                    counts[key][0] += batch_len(batch)
                    counts[key][1] += waited
                self.step()
                if opened is not None and time.perf_counter() - opened >= budget:
                    break
            end = time.perf_counter()
            cpu = clock.since() if opened is not None else None
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
            del it  # a DataLoader iterator shuts its workers down when dropped
            loader.close()
        out = {"batches": batches, "how": loader.how, "step": self.step_description}
        if opened is not None and counts["window"][0]:
            seconds, n = end - opened, counts["window"][0]
            main, workers = cpu
            return {**out, "samples": n, "seconds": seconds, "wait_fraction": counts["window"][1] / seconds,
                    "startup_s": opened - start, "cpu_ms_per_sample": {
                        "main": 1e3 * main / n, "workers": None if workers is None else 1e3 * workers / n}}
        # Too few batches to leave start-up out: time the whole pass and say so.
        seconds = end - start
        return {**out, "samples": counts["all"][0], "seconds": seconds, "wait_fraction": counts["all"][1] / seconds,
                "startup_s": None, "note": f"only {batches} batch(es): start-up included in the timing"}


class Ceiling:
    """Bare libjpeg-turbo decode of in-memory JPEGs on one core: the ceiling for decode rows."""

    description = "single-core decode of in-memory JPEG bytes (readers.decode_array)"
    MAX_FILES = 512  # enough variety of sizes; bounded memory on a large corpus

    def setup(self, source, ctx: dict, opts: Options):
        from readers import decode_array

        self.decode = decode_array
        files = [p for p in cache.data_files(ctx["folder"]) if p.lower().endswith(IMAGE_EXTENSIONS)]
        stride = max(1, len(files) // self.MAX_FILES)
        self.blobs = []
        for path in files[::stride][: self.MAX_FILES]:
            with open(path, "rb") as f:
                self.blobs.append(f.read())
        return self

    def run(self, source, ctx: dict, opts: Options, budget: float, seed: int) -> dict:
        n = 0
        start = time.perf_counter()
        while True:
            self.decode(self.blobs[n % len(self.blobs)])
            n += 1
            if time.perf_counter() - start >= budget:
                break
        return {"samples": n, "seconds": time.perf_counter() - start}


class DiskLimit:
    """The disk's sequential read rate: the largest packed file read cold, front to back.

    8 MB reads with the kernel asked (POSIX_FADV_WILLNEED) to fetch 64 MB ahead: the
    fastest one stream reads here (1.1-1.2 GB/s, against 0.6-1.0 for plain 8 MB reads
    like dd's), so block-order reads are held to the disk's real limit. Figures are MB/s.
    """

    description = "sequential read of the largest packed file from a cold cache, 8 MB reads, 64 MB hinted ahead (MB/s)"
    READ = 8 << 20
    AHEAD = 64 << 20

    def setup(self, source, ctx: dict, opts: Options):
        files = [p for fmt in sorted(ctx["packed"]) for p in cache.data_files(ctx["packed"][fmt])]
        if not files:
            raise RuntimeError("no packed file to read")
        self.path = max(files, key=os.path.getsize)
        return self

    def run(self, source, ctx: dict, opts: Options, budget: float, seed: int) -> dict:
        cache.evict([self.path])
        nbytes = hinted = 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            start = time.perf_counter()
            while time.perf_counter() - start < budget:
                if hinted < nbytes + self.AHEAD:
                    will_need(fd, hinted, self.AHEAD)
                    hinted += self.AHEAD
                got = len(os.read(fd, self.READ))
                if not got:
                    break
                nbytes += got
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
        return {"samples": nbytes / 1e6, "seconds": seconds}


class MemoryCopy:
    """The reference for warm raw rows: each record's bytes copied out of RAM into a new
    bytes object, in random order, on one core, in the same Python loop shape as a read.

    What a warm raw read would cost with no file system and no reader in the way (it is
    a read's memcpy, malloc and loop, without the syscall and the page-cache lookup).
    Timed just before each warm raw run, so a row can be read against the machine's
    memory speed at that moment: on a shared virtual machine it drifts by 20% or more
    over minutes. Record sizes are the corpus files' sizes; the buffer is far larger than
    any CPU cache, and fixed, so memory stays flat whatever the corpus size.
    """

    description = "copy of each record's bytes out of a 256 MiB buffer in RAM, random order, one core"
    BUFFER = 256 << 20

    def __init__(self, sizes: list[int]):
        self.sizes = [min(n, self.BUFFER) for n in sizes]
        self.buffer = b"\x5a" * self.BUFFER  # written, so every page is its own (zeros would share one)

    @classmethod
    def of_corpus(cls, folder: str) -> "MemoryCopy":
        files = [p for p in cache.data_files(folder) if p.lower().endswith(IMAGE_EXTENSIONS)]
        if not files:
            raise RuntimeError(f"no images under {folder} to size the memory-copy reference")
        return cls([os.path.getsize(p) for p in files])

    def rate(self, budget: float, seed: int) -> float:
        """Records copied per second over about `budget` seconds."""
        rng = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(self.sizes), generator=rng).tolist()
        starts = torch.randint(0, self.BUFFER, (len(order),), generator=rng).tolist()
        copies = [(start % (self.BUFFER - self.sizes[i] + 1), self.sizes[i]) for i, start in zip(order, starts)]
        buffer, n = self.buffer, 0
        start = time.perf_counter()
        while True:
            for at, size in copies:
                buffer[at:at + size]
                n += 1
                if n % 256 == 0 and time.perf_counter() - start >= budget:
                    return n / (time.perf_counter() - start)


class BareRead:
    """The floor for a packed source's warm raw row: `os.pread` of each record's stored
    bytes where the format's reader says they lie (Reader.record_extents), with no reader
    code around it, in random order, on one core.

    Timed just before each warm raw run, on the pages that run will read, so a slow row
    can be told apart: slow pages make this slow too (the memory-copy reference says how
    fast RAM is, this one how fast copying out of the page cache is), while the row's
    share of it is what the reader and sampler themselves cost. A random sample of at
    most MAX_RECORDS records, so memory stays flat whatever the dataset size.
    """

    description = ("os.pread of each record's stored bytes at its offset, no reader code, random order, one core "
                   "(packed map-style rows)")
    MAX_RECORDS = 1 << 16

    @classmethod
    def rate_of(cls, source, ctx: dict, budget: float, seed: int) -> float | None:
        """Records read per second over about `budget` seconds; None for a source whose reader
        cannot place records in its files (the folder: a file per record)."""
        if not hasattr(source, "open"):  # the peers: no packer reader
            return None
        dataset = source.open(ctx, "raw")
        try:
            return cls.rate_of_dataset(dataset, budget, seed)
        finally:
            getattr(dataset, "close", lambda: None)()

    @classmethod
    def rate_of_dataset(cls, dataset, budget: float, seed: int) -> float | None:
        """As rate_of, for a readers Dataset the caller opened and closes."""
        reader = getattr(dataset, "reader", None)
        if not hasattr(reader, "record_extents"):  # the folder's: a file per record
            return None
        dataset.open()
        rng = np.random.default_rng(seed)
        sample = rng.permutation(len(dataset))[:cls.MAX_RECORDS]
        extents = list(reader.record_extents(sample))
        return cls.time(extents, budget) if extents else None

    @staticmethod
    def time(extents: list[tuple[int, int, int]], budget: float) -> float:
        pread, n = os.pread, 0
        start = time.perf_counter()
        while True:
            for fd, offset, length in extents:
                pread(fd, length, offset)
                n += 1
                if n % 256 == 0 and time.perf_counter() - start >= budget:
                    return n / (time.perf_counter() - start)


MEASURES = {
    "raw": ItemLoop("raw", "raw read: bytes only (random order for map-style, shard order for shards)"),
    "block": ItemLoop("raw", "raw read in readers.BlockShuffleSampler order (map-style sources)", order="block"),
    "checked": PairedCheckedRead("raw read with each record's checksum checked, the readers' default (packed "
                                 "map-style sources), timed against unchecked reads of the same run, block by block"),
    "loader": PlainLoaderRead("raw read through a plain DataLoader(shuffle=True, num_workers=W) (map-style sources)"),
    "decode": ItemLoop("decode", "read + decode to uint8 RGB"),
    "augment": ItemLoop("augment", "read + decode + RandomResizedCrop(224) + flip"),
    "e2e": EndToEnd(),
}
# Measures only map-style sources take (those with `blocks`).
MAP_ONLY = ("block", "loader")
CEILING = Ceiling()
DISK = DiskLimit()
