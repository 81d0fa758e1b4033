"""Reading from object storage: records/s in random, block and streaming order, read from
local files, over loopback HTTP and over a slow link, beside what that link can carry.

    python -m benchmarks.remote --work /var/tmp/remote-bench [--corpus DIR] [--images 4000]
        [--delay 0.010] [--rate 125e6] [--records 1500] [--workers 2] [--raw-only]
        [--repeat 3] [--sources link] [--orders block stream]

The dataset (an ImageFolder at --corpus, made with packer.synth if missing) is packed once
into LMDB (shuffled, so blocks mix classes) and WebDataset under --work. nginx serves
--work on 127.0.0.1 (tests/servers.NginxServer) and a Link proxy in front of it imitates a
network (tests/servers.Link: --delay seconds each way, --rate bytes/s shared; the defaults
are 1 Gbit/s with a 20 ms round trip). Then, for each source (local, loopback, link):

  random   readers.LMDBDataset by URL, make_loader(order="random"): one ranged read per record
  block    the same with order="block": shuffled runs of stored records, fetched ahead by
           blocks into a block cache (cache_dir: a new, empty one for each run)
  stream   readers.WDSDataset by URL: whole shards in sequence, the next ones in flight

each in a fresh process (no cache carried over), decode="raw" (bytes only: the remote
path is measured, not the JPEG decoder): --random-records records in random order, the
whole split (or --records) in block and stream order, so that the whole dataset crosses
the link. records/s and "MB/s 1st" count from the first batch on (what was fetched ahead
while it waited counts too); "with start" and MB/s count from the loader's start (worker
start-up, each worker's opening and the first fetches included). The main process opens
the dataset before that (open_s): over the link, one more fraction counts it too. Each
read is run --repeat times and the median reported (every run is in the JSON); over the
link each MB/s is also given as a fraction of the link's. The link's own limit is measured with plain HTTP: large ranged GETs on 4 connections (MB/s)
and record-sized ranged GETs at random offsets on --workers x 8 keep-alive connections
(GET/s). --raw-only measures only that (no packer reader involved). Local reads run with
the page cache warm (the files were just written): they are the ceiling, not a disk figure.
Figures are printed as a table and written to --work/remote-results.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the servers the remote tests use

ORDERS = ("random", "block", "stream")
SOURCES = ("local", "loopback", "link")
BATCH = 32
BIG_RANGE = 32 << 20


def count_batch(batch):
    """collate_fn: (records, bytes) of a batch of raw (bytes, label) samples."""
    return len(batch), sum(len(sample[0]) for sample in batch)


def measure(source: str, order: str, records: int, workers: int, cache_dir: str | None) -> dict:
    """records/s reading `records` records of source in order (run in a fresh process)."""
    import readers

    opened = time.perf_counter()
    if order == "stream":
        dataset = readers.WDSDataset(source, split="train", decode="raw")
        loader = readers.make_loader(dataset, BATCH, workers=workers, collate_fn=count_batch, drop_last=False)
    else:
        remote = {"cache_dir": cache_dir} if cache_dir else {}
        dataset = readers.LMDBDataset(source, split="train", decode="raw", **remote)
        loader = readers.make_loader(dataset, BATCH, workers=workers, order=order, collate_fn=count_batch,
                                     drop_last=False)
    got = nbytes = first_count = first_bytes = 0
    first = None
    start = time.perf_counter()
    for count, size in loader:
        got += count
        nbytes += size
        if first is None:  # opening, worker start-up and the first fetches: reported apart
            first, first_count, first_bytes = time.perf_counter(), count, size
        if records and got >= records:
            break
    end = time.perf_counter()
    return {"records": got, "mb": nbytes / 1e6, "seconds": end - start, "open_s": start - opened,
            "first_batch_s": first - start,
            "records_per_s": (got - first_count) / max(end - first, 1e-9),
            "epoch_records_per_s": got / (end - start), "mb_per_s": nbytes / 1e6 / (end - start),
            "mb_per_s_from_first": (nbytes - first_bytes) / 1e6 / max(end - first, 1e-9)}


def median_run(runs: list[dict]) -> dict:
    """The run of median MB/s with start, with every run's figures beside it."""
    good = sorted((r for r in runs if "error" not in r), key=lambda r: r["mb_per_s"])
    if not good:
        return runs[0]
    chosen = dict(good[(len(good) - 1) // 2])
    if len(runs) > 1:
        chosen["runs"] = runs
    return chosen


def run_measure(source: str, order: str, records: int, workers: int, work: Path) -> dict:
    """measure() in a fresh process; block order over a URL reads ahead into an empty block cache."""
    cache = ""
    if order == "block" and "://" in source:
        cache = tempfile.mkdtemp(prefix="cache-", dir=work)
    command = [sys.executable, "-m", "benchmarks.remote", "measure", source, order, str(records), str(workers), cache]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def ranged_get(connection: http.client.HTTPConnection, path: str, start: int, size: int) -> int:
    connection.request("GET", path, headers={"Range": f"bytes={start}-{start + size - 1}"})
    response = connection.getresponse()
    data = response.read()
    if response.status != 206:
        raise RuntimeError(f"{path}: HTTP {response.status} for a range")
    return len(data)


def link_limits(port: int, path: str, file_size: int, record_size: int, connections: int, seconds: float = 8.0) -> dict:
    """Plain HTTP over 127.0.0.1:port: MB/s of large ranged GETs on 4 connections, and GET/s
    of record-sized ones at random offsets on `connections` keep-alive connections."""
    def bulk(index: int) -> int:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        moved, offset = 0, (index * BIG_RANGE) % max(1, file_size - BIG_RANGE)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            moved += ranged_get(connection, path, offset, min(BIG_RANGE, file_size - offset))
            offset = (offset + 4 * BIG_RANGE) % max(1, file_size - BIG_RANGE)
        connection.close()
        return moved

    def small(index: int) -> int:
        rng = random.Random(index)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        gets, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            ranged_get(connection, path, rng.randrange(0, file_size - record_size), record_size)
            gets += 1
        connection.close()
        return gets

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        start = time.perf_counter()
        moved = sum(pool.map(bulk, range(4)))
        bulk_s = time.perf_counter() - start
    with concurrent.futures.ThreadPoolExecutor(connections) as pool:
        start = time.perf_counter()
        gets = sum(pool.map(small, range(connections)))
        small_s = time.perf_counter() - start
    return {"bulk_mb_per_s": moved / bulk_s / 1e6, "record_gets_per_s": gets / small_s, "connections": connections,
            "record_size": record_size}


def prepare(work: Path, corpus: Path | None, images: int) -> tuple[Path, Path, dict]:
    """The LMDB and WDS packs under work (made once), and facts about them."""
    from packer import pack
    from packer.formats import read_metadata

    corpus = corpus or work / "corpus"
    if not corpus.is_dir():
        from packer.synth import make_corpus

        classes = 20
        make_corpus(str(corpus / "train"), classes=classes, per_class=max(1, images // classes), seed=0)
    lmdb_path, wds_path = work / "data.lmdb", work / "data.wds"
    if not lmdb_path.exists():
        pack(str(corpus), "lmdb", str(lmdb_path), shuffle=True, shuffle_seed=0)
    if not wds_path.exists():
        pack(str(corpus), "wds", str(wds_path))
    meta = read_metadata(str(lmdb_path))
    return lmdb_path, wds_path, {"records": meta.count, "bytes": meta.bytes, "mean_record": meta.bytes // meta.count}


def table(results: dict) -> str:
    lines = [f"{'source':<10} {'order':<8} {'records':>8} {'records/s':>10} {'with start':>11} {'MB/s':>7} "
             f"{'MB/s 1st':>9} {'first batch s':>14}"]
    link_mb = results["limits"].get("link", {}).get("bulk_mb_per_s")
    for source, orders in results["reads"].items():
        for order, found in orders.items():
            if "error" in found:
                lines.append(f"{source:<10} {order:<8} error: {found['error']}")
                continue
            lines.append(f"{source:<10} {order:<8} {found['records']:>8} {found['records_per_s']:>10.0f} "
                         f"{found['epoch_records_per_s']:>11.0f} {found['mb_per_s']:>7.1f} "
                         f"{found['mb_per_s_from_first']:>9.1f} {found['first_batch_s']:>14.2f}")
            if source == "link" and link_mb and order != "random":
                runs = ", ".join(f"{r['mb_per_s'] / link_mb:.2f}" for r in found.get("runs", [found]) if "error" not in r)
                opening = found["mb"] / (found["seconds"] + found["open_s"])
                lines.append(f"{'':<10} {order:<8} = {found['mb_per_s'] / link_mb:.2f}x the link with start "
                             f"(runs: {runs}), {found['mb_per_s_from_first'] / link_mb:.2f}x from the first batch, "
                             f"{opening / link_mb:.2f}x counting the main process's opening "
                             f"({found['open_s']:.2f} s) too")
    for name, limit in results["limits"].items():
        lines.append(f"{name} limit (plain HTTP): {limit['bulk_mb_per_s']:.0f} MB/s in 32 MiB ranges on 4 "
                     f"connections; {limit['record_gets_per_s']:.0f} record-sized GET/s on {limit['connections']} "
                     f"connections (= records/s for random order, {limit['record_size']} B each)")
    return "\n".join(lines)


SOURCE_ROWS = {"local": "local files (page cache warm)", "loopback": "loopback HTTP (nginx)"}


def markdown(results: dict) -> str:
    """The results page's table of a run: random order's records/s, block and stream order's
    records/s and MB/s with start (worker start-up and read-ahead counted), per source."""
    link = results["link"]
    rows = dict(SOURCE_ROWS, link=f"link, {link['rate_bytes_per_s'] * 8 / 1e9:g} Gbit/s, "
                                  f"{link['delay_s'] * 2e3:g} ms")
    lines = ["| source | random, records/s | block, records/s with start (MB/s) | "
             "stream, records/s with start (MB/s) |", "| --- | --- | --- | --- |"]
    for source, orders in results["reads"].items():
        cells = [f"{orders['random']['epoch_records_per_s']:,.0f}"]
        cells += [f"{orders[order]['epoch_records_per_s']:,.0f} ({orders[order]['mb_per_s']:,.0f})"
                  for order in ("block", "stream")]
        lines.append(f"| {rows[source]} | " + " | ".join(cells) + " |")
    facts = results["dataset"]
    lines += ["", f"{facts['records']:,} records of {facts['mean_record'] / 1e3:.0f} KB ({facts['bytes'] / 1e6:.0f} MB), "
              f"{results['workers']} workers, `decode=\"raw\"`; the median of each read's runs."]
    for name, limit in results["limits"].items():
        lines.append(f"The {name}'s limit (plain HTTP): {limit['bulk_mb_per_s']:.0f} MB/s in 32 MiB ranges on 4 "
                     f"connections; {limit['record_gets_per_s']:.0f} record-sized GET/s on {limit['connections']} "
                     "connections.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--corpus", type=Path)
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--delay", type=float, default=0.010, help="one-way latency of the link, seconds")
    parser.add_argument("--rate", type=float, default=125e6, help="the link's bandwidth, bytes/s each way")
    parser.add_argument("--records", type=int, default=0, help="records read in block and stream order "
                        "[default: the whole split, so that the whole dataset crosses the link]")
    parser.add_argument("--random-records", type=int, default=600, help="records read in random order")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--raw-only", action="store_true", help="measure the link with plain HTTP only")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each read, the median reported")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    args = parser.parse_args(argv)
    from servers import Link, NginxServer

    args.work.mkdir(parents=True, exist_ok=True)
    lmdb_path, wds_path, facts = prepare(args.work, args.corpus, args.images)
    server = NginxServer(args.work).start()
    link = Link(server.port, delay=args.delay, rate=args.rate).start()
    results = {"dataset": facts, "link": {"delay_s": args.delay, "rate_bytes_per_s": args.rate},
               "workers": args.workers, "reads": {}, "limits": {}}
    try:
        data_size = (lmdb_path / "data.mdb").stat().st_size
        for name, port in (("loopback", server.port), ("link", link.port)):
            results["limits"][name] = link_limits(port, "/data.lmdb/data.mdb", data_size, facts["mean_record"],
                                                  args.workers * 8)
        if not args.raw_only:
            sources = {"local": (str(lmdb_path), str(wds_path)),
                       "loopback": (server.url("data.lmdb"), server.url("data.wds")),
                       "link": (link.url("data.lmdb"), link.url("data.wds"))}
            for name in args.sources:
                lmdb_source, wds_source = sources[name]
                results["reads"][name] = {
                    order: median_run([run_measure(wds_source if order == "stream" else lmdb_source, order,
                                                   args.random_records if order == "random" else args.records,
                                                   args.workers, args.work) for _ in range(max(1, args.repeat))])
                    for order in args.orders}
    finally:
        link.close()
        server.close()
    print(table(results))
    (args.work / "remote-results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "measure":
        print(json.dumps(measure(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] or None)))
        sys.exit(0)
    sys.exit(main())
