"""Mixtures (readers.mix): read rate against one source, memory and state against the record
count, and how close each batch is to the weights.

    python -m benchmarks.mix rate --what mix|same|mix1|single|pair [--copies 16] [--repeats 3] [--workdir DIR]
    python -m benchmarks.mix rate --what mix --vs pair|single [--rounds 15]
    python -m benchmarks.mix memory --records 20000 1281167
    python -m benchmarks.mix spread [--records 1281167] [--weight 0.7 | --weights 0.5 0.3 0.2] [--ranks 1 2 3 8]

`rate`: make_loader (batches of 64, raw bytes, a collate that sums their sizes) over one
LMDB pack of the ImageNet sample in ../shared/data copied `copies` times ("single"); over a
readers.Mix of two LMDB packs holding half of those classes each, weighted by their sizes
("mix"); over the same two packs, one loader each in turn ("pair": the mixture's files and
bytes without mixing); over a Mix of two sources that are the one pack, half an epoch each
("same": two sources in one file); or over a Mix of the one pack ("mix1": the mixing code's
own cost). Every record once an epoch (once a source's pass for "same"), random order.
Prints the samples/s of an epoch with 2 workers and the CPU microseconds per sample with
none, the heap kept as a worker keeps it (readers.heap), medians of the repeats after one
warm epoch; whole-process pairs of the commands are timed against each other from outside
(docs/mixing.md). With --vs, the two in one process, an epoch of each in turn (paired
rounds: see paired()), the ratio of their rates a round, median and range: the figure to
quote on a shared machine, whose load moves the times of separate runs more than a few
percent.

`memory`: a Mix of two synthetic sources (0.7/0.3; sizes N and N/3) at each record count:
the peak RSS growth of building the sampler and walking a whole epoch on rank 0 of 8, and
the JSON size of its state. `spread`: the count of the first source in every full batch
of 256 (or --batch) of an epoch, weights 0.7/0.3 (or --weight, or --weights for several
sources), on 1, 2, 3 and 8 ranks (or --ranks), every rank's batches: min, max, mean and
stdev, and each source's range.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHARED = Path(os.environ.get("PACKER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
BATCH, WORKERS = 64, 2


class Synthetic(torch.utils.data.Dataset):
    """n records made on demand: the sampler's cost, not the storage's."""

    def __init__(self, n: int):
        self.n, self.classes = n, ["thing"]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return index.to_bytes(8, "little"), 0


def sizes(batch) -> np.ndarray:
    """The batch's bytes and samples: an epoch's sum(loader) counts both."""
    return np.array([sum(len(sample[0]) for sample in batch), len(batch)])


def packs(workdir: Path, copies: int) -> Path:
    """workdir/single.lmdb (every class), workdir/a.lmdb and b.lmdb (half the classes each)."""
    from packer import pack

    done = workdir / f"packs-{copies}"
    if (done / "b.lmdb").exists():
        return done
    if not (SHARED / "imagenet-sample").is_dir():
        raise SystemExit(f"benchmarks.mix rate: {SHARED / 'imagenet-sample'} is absent; set PACKER_SHARED_DATA to the "
                         "folder holding imagenet-sample/")
    classes = sorted(p for p in (SHARED / "imagenet-sample").iterdir() if p.is_dir())
    halves = {"a": classes[:len(classes) // 2], "b": classes[len(classes) // 2:]}
    done.mkdir(parents=True, exist_ok=True)
    for name, chosen in [("single", classes), *halves.items()]:
        tree = workdir / f"tree-{name}-{copies}"
        shutil.rmtree(tree, ignore_errors=True)
        for folder in chosen:
            for image in folder.iterdir():
                for k in range(copies):
                    target = tree / folder.name / f"{k}-{image.name}"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(image.read_bytes())
        pack(str(tree), "lmdb", str(done / f"{name}.lmdb"), workers=1, progress=False, force=True)
        shutil.rmtree(tree)
    return done


def datasets(what: str, root: Path) -> list:
    """What `rate --what` reads, as the datasets its loaders walk (two for "pair")."""
    import readers

    def pack(name: str):
        return readers.LMDBDataset(root / f"{name}.lmdb", decode="raw")

    if what == "single":
        return [pack("single")]
    if what == "pair":  # the two packs the mixture reads, one loader each, in turn: the same files
        return [pack("a"), pack("b")]
    if what == "same":  # two sources over the one pack, half an epoch each: the same file, no Python between
        one = pack("single")
        return [readers.Mix({"first": one, "second": pack("single")}, epoch_size=len(one))]
    if what == "mix1":  # the mixing code's own cost: a mixture of the one pack
        return [readers.Mix({"all": pack("single")})]
    return [readers.Mix({name: pack(name) for name in "ab"})]


def loaders_of(data: list, workers: int) -> list:
    import readers

    # Every record once an epoch, the last batch short: the same bytes an epoch, whatever the split.
    return [readers.make_loader(one, BATCH, workers=workers, collate_fn=sizes, drop_last=False) for one in data]


def epoch(loaders: list) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds of this process, bytes, samples) of one epoch of each loader in turn."""
    wall, own = time.perf_counter(), time.process_time()
    total, samples = sum(sum(loader) for loader in loaders).tolist()
    return time.perf_counter() - wall, time.process_time() - own, total, samples


def rate(what: str, copies: int, repeats: int, workdir: Path) -> dict:
    from readers.heap import keep_heap

    data = datasets(what, packs(workdir, copies))
    rates, cpu, total, samples = [], [], 0, 0
    for workers, figures in ((WORKERS, rates), (0, cpu)):
        if not workers:  # the heap as a DataLoader worker keeps it: else page faults of freed records swamp the figure
            keep_heap()
        loaders = loaders_of(data, workers)
        for repeat in range(repeats + 1):
            wall, own, total, samples = epoch(loaders)
            if repeat:  # the first warms the page cache and starts the workers
                figures.append(samples / wall if workers else 1e6 * own / samples)
    # With workers the rate (wall clock); in one process (workers=0) the CPU time per sample, which
    # a loaded machine disturbs far less: the cost the mixture adds, whatever else runs.
    return {"figure": f"rate-{what}", "samples_per_s": round(statistics.median(rates)),
            "cpu_us_per_sample": round(statistics.median(cpu), 1), "bytes": total, "samples": samples,
            "repeats": repeats}


def paired(what: str, vs: str, copies: int, rounds: int, workdir: Path) -> dict:
    """`what` against `vs` in one process (workers=0, the heap kept), an epoch of each in turn
    for `rounds` rounds (the pair's order swapped every round, so a drift of the machine's
    speed weighs on both alike): each round's ratio of rates from the CPU time per sample
    (vs's over what's: above 1, `what` is faster), and from the wall clock; medians and
    ranges. A shared machine slows both of a round alike, so the ratio holds where the
    times themselves move; `what` against itself (two loaders of it) shows the spread."""
    from readers.heap import keep_heap

    root = packs(workdir, copies)
    keep_heap()
    loaders = [loaders_of(datasets(name, root), 0) for name in (what, vs)]
    for both in loaders:  # warm: the page cache, each source's first batch
        epoch(both)
    cpu, wall, per, same_bytes = [], [], ([], []), True
    for r in range(rounds):
        took = [None, None]
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            seconds, own, total, samples = epoch(loaders[k])
            took[k] = (1e6 * seconds / samples, 1e6 * own / samples, total)
            per[k].append(took[k][1])
        same_bytes = same_bytes and took[0][2] == took[1][2]
        cpu.append(took[1][1] / took[0][1])
        wall.append(took[1][0] / took[0][0])
    return {"figure": f"rate-{what}-vs-{vs}", "rounds": rounds, "same_bytes_every_round": same_bytes,
            "ratio_cpu": summary(cpu), "ratio_wall": summary(wall),
            "cpu_us_per_sample": {"what": summary(per[0], 2), "vs": summary(per[1], 2)}}


def summary(values: list[float], digits: int = 3) -> dict:
    """Median, range and quartiles."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "q1": round(float(np.percentile(values, 25)), digits),
            "q3": round(float(np.percentile(values, 75)), digits)}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory(records: int) -> dict:
    from readers import Mix, MixSampler

    before = peak_rss_mb()
    mix = Mix({"imagenet": Synthetic(records), "web": Synthetic(records // 3)}, weights={"imagenet": 0.7, "web": 0.3})
    sampler = MixSampler(mix, rank=0, world_size=8)
    begin, walked = time.perf_counter(), sum(1 for _ in sampler)
    seconds = time.perf_counter() - begin
    return {"figure": "memory", "records": records, "epoch_size": mix.epoch_size, "walked": walked,
            "peak_rss_growth_mb": round(peak_rss_mb() - before, 1), "state_bytes": len(json.dumps(sampler.state_dict())),
            "indexes_per_s": round(walked / seconds)}


def spread(records: int, weight: float, ranks: list[int], batch: int = 256, weights: list[float] | None = None) -> list[dict]:
    """The first source's count in every full batch of every rank (min, max, mean, stdev), and
    each source's range: two sources of `records` and a third of it at `weight`, 1 - weight,
    or as many sources as `weights` (sized by their weights, `records` in all)."""
    from readers import Mix, MixSampler

    weights = weights or [weight, 1 - weight]
    sizes = [records, records // 3] if len(weights) == 2 else [max(1, round(records * w)) for w in weights]
    names = [chr(ord("a") + k) for k in range(len(weights))]
    mix = Mix({n: Synthetic(k) for n, k in zip(names, sizes)}, weights=dict(zip(names, weights)))
    out = []
    for world_size in ranks:
        counts = []
        for rank in range(world_size):
            sources = mix.source_of(list(MixSampler(mix, rank=rank, world_size=world_size, keyed=False)))
            full = sources[:len(sources) // batch * batch].reshape(-1, batch)
            counts.append(np.stack([(full == s).sum(1) for s in range(len(weights))], axis=1))
        c = np.concatenate(counts)
        first = c[:, 0]
        out.append({"figure": "spread", "records": mix.epoch_size, "world_size": world_size, "batch": batch,
                    "batches": len(c), "weights": [round(w, 4) for w in mix.weights],
                    "expected": round(mix.weights[0] * batch, 1), "min": int(first.min()), "max": int(first.max()),
                    "mean": round(float(first.mean()), 2), "stdev": round(float(first.std()), 2),
                    "per_source": [[int(c[:, s].min()), int(c[:, s].max())] for s in range(len(weights))]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("rate")
    r.add_argument("--what", choices=("mix", "same", "mix1", "single", "pair"), required=True)
    r.add_argument("--copies", type=int, default=16)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--vs", choices=("mix", "same", "mix1", "single", "pair"),
                   help="time --what against this, in one process, epochs in turn (paired rounds)")
    r.add_argument("--rounds", type=int, default=15, help="paired rounds (with --vs)")
    r.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "packer-mix-bench")
    m = sub.add_parser("memory")
    m.add_argument("--records", type=int, nargs="+", default=[20_000, 1_281_167])
    s = sub.add_parser("spread")
    s.add_argument("--records", type=int, default=1_281_167)
    s.add_argument("--weight", type=float, default=0.7, help="the first source's weight")
    s.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 8])
    s.add_argument("--batch", type=int, default=256)
    s.add_argument("--weights", type=float, nargs="+", help="several sources' weights, in place of --weight")
    args = parser.parse_args()
    if args.command == "rate":
        args.workdir.mkdir(parents=True, exist_ok=True)
        if args.vs:
            print(json.dumps(paired(args.what, args.vs, args.copies, args.rounds, args.workdir)))
        else:
            print(json.dumps(rate(args.what, args.copies, args.repeats, args.workdir)))
    elif args.command == "memory":
        for n in args.records:  # each in a fresh process would isolate peaks; growth is what is shown
            print(json.dumps(memory(n)), flush=True)
    else:
        for row in spread(args.records, args.weight, args.ranks, args.batch, args.weights):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
