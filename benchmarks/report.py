"""Turns a results dict into the ratio figures, a Markdown table and an optional PNG chart."""
from __future__ import annotations

from packer.formats import FORMATS

from .measures import MEASURES
from .names import CACHE_STATES



def median(case: dict | None) -> float | None:
    if case and case.get("status") == "ok":
        return case["median"]
    return None


def case_of(entry: dict, measure: str, state: str) -> dict:
    """A source entry's case for (measure, cache state); {} where it did not run."""
    return entry.get("measures", {}).get(measure, {}).get(state) or {}


def figure(results: dict, source: str, measure: str, state: str) -> float | None:
    return median(case_of(results.get("sources", {}).get(source, {}), measure, state))


def divide(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(results: dict) -> dict:
    """Per source: packed/folder for every measure and cache state, pack/tar, e2e/(workers x ceiling)."""
    out = {}
    ceiling = median(results.get("ceiling"))
    workers = max(1, results["config"]["workers"])
    tar = median(results.get("pack", {}).get("tar"))
    for name, entry in results.get("sources", {}).items():
        if not entry.get("available"):
            continue
        r = {}
        if name != "folder":
            for m in MEASURES:
                for s in CACHE_STATES:
                    r[f"{m}_{s}_vs_folder"] = vs_folder(results, name, m, s)
        if name in FORMATS:  # a row named for the format packed for it
            r["pack_vs_tar"] = divide(median(results.get("pack", {}).get(name)), tar)
        for s in CACHE_STATES:
            r[f"e2e_{s}_vs_ceiling"] = divide(figure(results, name, "e2e", s),
                                              workers * ceiling if ceiling else None)
        warm = case_of(entry, "raw", "warm")
        if warm.get("status") == "ok" and "memory_copy" in warm:
            r["raw_warm_vs_memory"] = divide(warm["median"], warm["memory_copy"]["median"])
        if warm.get("status") == "ok" and "bare_read" in warm:
            r["raw_warm_vs_bare_read"] = divide(warm["median"], warm["bare_read"]["median"])
        r.update(checked_ratios(results, name))
        for m in ("block", "loader"):  # a cold read's MB/s over the disk's sequential rate
            case = case_of(entry, m, "cold")
            if case.get("status") == "ok" and "mb_per_s" in case:
                r[f"{m}_cold_vs_disk"] = divide(case["mb_per_s"]["median"], median(results.get("disk")))
        out[name] = r
    return out


def vs_folder(results: dict, name: str, measure: str, state: str) -> float | None:
    """A source's figure over the folder's: the median of the per-round ratios where the cell
    ran round by round (case.run_cell), else the ratio of the two medians."""
    rounds = case_of(results["sources"][name], measure, state).get("vs_folder")
    if rounds and figure(results, name, measure, state) is not None:
        return rounds["median"]
    return divide(figure(results, name, measure, state), figure(results, "folder", measure, state))


def round_ratio_note(results: dict) -> list[str]:
    """How the ratios of interleaved cells were taken, with each source's range of per-round ratios."""
    lines = []
    for measure in MEASURES:
        ranges = []
        for name, entry in results["sources"].items():
            cases = [case_of(entry, measure, s).get("vs_folder") for s in results["config"]["cache"]]
            if any(cases):
                ranges.append(f"{name} " + " / ".join("–" if not c else f"{c['min']:.2f}-{c['max']:.2f}"
                                                      for c in cases))
        if ranges:
            lines.append(f"{measure} ×folder: the sources of each cell ran interleaved, round by round (each round "
                         "one seed, so the map-style sources read the same images with the same crops); the ratio "
                         f"is the median of the per-round ratios, whose range (cold / warm) was: {', '.join(ranges)}.")
    cpu = [(name, c) for name, entry in results["sources"].items()
           if (c := case_of(entry, "e2e", "warm").get("cpu_ms_per_sample")) and c.get("workers")]
    if cpu:
        shares = [f"{name} {case['cpu_vs_folder']['median']:.2f} ({case['cpu_vs_folder']['min']:.2f}-"
                  f"{case['cpu_vs_folder']['max']:.2f})" for name, entry in results["sources"].items()
                  if (case := case_of(entry, "e2e", "warm")).get("cpu_vs_folder")]
        lines.append("e2e warm, CPU per sample over the timed window (ms, median; main process + loader workers): "
                     + ", ".join(f"{name} {c['main']['median']:.2f} + {c['workers']['median']:.2f}" for name, c in cpu)
                     + "." + (f" The folder's CPU per sample over each source's, round by round (median, range; "
                              f"> 1: the source costs less): {', '.join(shares)}." if shares else ""))
    return lines


def checked_ratios(results: dict, name: str) -> dict:
    """Checked raw reads (the readers' default) over unchecked ones, per cache state: the
    median of the runs' paired ratios (measures.PairedCheckedRead), or, in results written
    before the pairing, the checked median over the raw case's."""
    out = {}
    for s in CACHE_STATES:
        case = case_of(results["sources"][name], "checked", s)
        if case:
            paired = case.get("vs_raw")
            out[f"checked_{s}_vs_raw"] = paired["median"] if paired and case.get("status") == "ok" else \
                divide(figure(results, name, "checked", s), figure(results, name, "raw", s))
    return out


def checked_note(results: dict) -> list[str]:
    """The CRC check's cost as a line of the notes: checked raw reads as a share of unchecked."""
    shares = [f"{name} {' / '.join(one(r.get(f'checked_{s}_vs_raw')) for s in CACHE_STATES)}"
              for name, r in results["ratios"].items() if any(k.endswith("_vs_raw") for k in r)]
    if not shares:
        return []
    return ["checked: raw reads with each record's checksum checked (the pack's kind), as Datasets read by default (raw turns the "
            f"check off); as a share of raw (cold / warm): {', '.join(shares)}."]


def rate(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}"


def cell(case: dict | None, marks: list[str]) -> str:
    if not case:
        return "–"
    if case.get("status") == "error":
        marks.append(f"{case['source']} {case['measure']} {case.get('cache') or ''}: error: {case['error']}")
        return "error"
    text = rate(case["median"])
    if case.get("spread") and len(case.get("runs", [])) > 1:
        text += f" ±{case['spread'] / 2:.0%}"
    if case.get("note"):  # a cache check that failed, or a run too short to leave start-up out
        marks.append(f"{case['source']} {case['measure']} {case['cache']}: {case['note']}")
        text += " †"
    return text


def ratio_pair(r: dict, measure: str) -> str:
    pair = [r.get(f"{measure}_{s}_vs_folder") for s in CACHE_STATES]
    return " / ".join("–" if x is None else f"{x:.2f}" for x in pair)


def one(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def loader_head(measures: list[str]) -> list[str]:
    """The plain-DataLoader ratio column, where that measure ran."""
    return ["loader ×folder (cold / warm)"] if "loader" in measures else []


def markdown(results: dict) -> str:
    """The table (rows: sources; columns: measures, then ratios) and the notes that qualify it."""
    config = results["config"]
    marks: list[str] = []
    states = config["cache"]
    measures = config["measures"]
    head = ["source"] + [f"{m} {s}" for m in measures for s in states]
    if "e2e" in measures and "warm" in states:
        head.append("e2e warm: waiting")
    head += ["pack s", "raw ×folder (cold / warm)"] + loader_head(measures) + [
        "decode ×folder (cold / warm)", "e2e ×folder (cold / warm)", "pack / tar", "e2e warm / (W × ceiling)"]
    if "block" in measures and "cold" in states:
        head.append("block cold / disk")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    na = []
    for name, entry in results["sources"].items():
        if not entry["available"]:
            na.append(f"{name}: n/a ({entry['reason']})")
            lines.append("| " + " | ".join([name] + ["n/a"] * (len(head) - 1)) + " |")
            continue
        row = [name]
        for m in measures:
            for s in states:
                row.append(cell(entry["measures"].get(m, {}).get(s), marks))
        if "e2e" in measures and "warm" in states:
            wait = entry["measures"].get("e2e", {}).get("warm", {}).get("wait_fraction")
            row.append("–" if not wait else f"{wait['median']:.0%}")
        pack = results["pack"].get(name, {}) if name in FORMATS else {}
        row.append(f"{pack['median']:.2f}" if pack.get("status") == "ok" else "–")
        r = results["ratios"].get(name, {})
        row += [ratio_pair(r, "raw")] + [ratio_pair(r, "loader") for _ in loader_head(measures)] + [
            ratio_pair(r, "decode"), ratio_pair(r, "e2e"), one(r.get("pack_vs_tar")), one(r.get("e2e_warm_vs_ceiling"))]
        if "block" in measures and "cold" in states:
            row.append(one(r.get("block_cold_vs_disk")))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += notes(results, na, marks)
    return "\n".join(lines)


def notes(results: dict, na: list[str], marks: list[str]) -> list[str]:
    config, m = results["config"], results["machine"]
    corpus = config["corpus"]
    out = ["Figures are samples/s, median of "
           f"{config['repeat']} timed run(s) of ≤{config['budget']:g} s after an untimed warm-up; ± is half the "
           "range. raw/decode/augment run in one process on one core; e2e uses "
           f"{config['workers']} loader worker(s), batch {config['batch_size']}, device {config['device']}"
           + ("; loader is raw bytes through a plain DataLoader(shuffle=True) with as many workers and batch: no "
              "packer sampler, so only the dataset's own batch read-ahead (__getitems__) hints reads"
              if "loader" in config["measures"] else "") + "."]
    ceiling = results.get("ceiling", {})
    if ceiling.get("status") == "ok":
        out.append(f"Ceiling: bare single-core decode {rate(ceiling['median'])} images/s (libjpeg-turbo, "
                   f"in-memory bytes); W = {config['workers']}.")
    disk = results.get("disk", {})
    if disk.get("status") == "ok":
        out.append(f"Disk: sequential read of the largest packed file from a cold cache, 8 MB reads with 64 MB "
                   f"hinted ahead: "
                   f"{disk['median']:,.0f} MB/s (±{(disk.get('spread') or 0) / 2:.0%}); `block cold / disk` divides "
                   "a row's block-order MB/s by it.")
        shares = [f"{name} {one(r['loader_cold_vs_disk'])}" for name, r in results["ratios"].items()
                  if r.get("loader_cold_vs_disk") is not None]
        if shares:
            out.append("loader cold, MB/s over the disk's sequential rate (how near a cold read through the plain "
                       f"DataLoader comes to what the disk can deliver): {', '.join(shares)}.")
    elif disk.get("status") == "error":
        out.append(f"Disk: error: {disk['error']}")
    memory = [(name, case["memory_copy"]["median"], results["ratios"].get(name, {}).get("raw_warm_vs_memory"))
              for name, entry in results["sources"].items()
              if (case := case_of(entry, "raw", "warm")).get("memory_copy")]
    if memory:
        out.append("Memory copy, the reference for raw warm rows, timed before each of their runs: each record's "
                   "bytes copied out of RAM into a new bytes object, random order, one core (records/s, median; "
                   "raw warm as a share of it): "
                   + ", ".join(f"{name} {rate(copy)} ({one(share)})" for name, copy, share in memory) + ".")
    bare = [(name, case["bare_read"]["median"], results["ratios"].get(name, {}).get("raw_warm_vs_bare_read"))
            for name, entry in results["sources"].items() if (case := case_of(entry, "raw", "warm")).get("bare_read")]
    if bare:
        out.append("Bare read, the floor for packed raw warm rows, timed before each of their runs on the same cached "
                   "pages: os.pread of each record's stored bytes where the reader places them, no reader code, "
                   "random order, one core (records/s, median; raw warm as a share of it): "
                   + ", ".join(f"{name} {rate(floor)} ({one(share)})" for name, floor, share in bare) + ".")
    out += checked_note(results)
    out += round_ratio_note(results)
    mix = results.get("mixing")
    if mix:
        out.append(f"Batch mixing (mean class entropy per batch of {mix['batch_size']}, bits, on the packed "
                   f"{'shuffled' if mix['storage_shuffled'] else 'ImageFolder'}-order storage): random order "
                   f"{mix['random']:.2f}, block order (block {mix['block_size']}, window {mix['window']}) "
                   f"{mix['block']:.2f}, storage order {mix['storage_order']:.2f}.")
    opens = [f"{name} {case['open_s']['median'] * 1e3:,.1f} ms" for name, entry in results["sources"].items()
             if (case := case_of(entry, "raw", "warm")).get("open_s")]
    if opens:
        out.append("Opening a dataset and its tables, once per process, is timed apart from the rates "
                   f"(raw, warm, median): {', '.join(opens)}.")
    tar = results["pack"].get("tar", {})
    if tar.get("status") == "ok":
        out.append(f"tar cf + fsync of the folder: {tar['median']:.2f} s; packs use {config['workers']} worker(s); "
                   f"source {tar.get('cache', 'warm')} in the page cache before each run.")
    for measure in ("augment", "e2e"):
        hows, step = {}, None
        for name, entry in results["sources"].items():
            for case in entry.get("measures", {}).get(measure, {}).values():
                if case.get("status") == "ok":
                    hows.setdefault(case["how"], []).append(name)
                    step = case.get("step")
                    break
        if step:
            out.append(f"e2e step: {step}.")
        out += [f"{measure} for {', '.join(names)}: {how}." for how, names in hows.items()]
    wds = results["pack"].get("wds", {})
    if wds.get("status") == "ok":
        size = wds["options"].get("shard_size")
        out.append(f"wds: {wds['shards']} shard(s)" + (f", packed with shard_size={size / 1e6:.0f} MB (aiming at two "
                   "shards per loader worker, none under 16 MB)" if size else "") + ".")
        if wds["shards"] < config["workers"]:
            out.append(f"wds has fewer shards than loader workers: {config['workers'] - wds['shards']} worker(s) sat "
                       "idle in its e2e rows.")
    for name, pack in results["pack"].items():
        if pack.get("status") == "error":
            out.append(f"pack {name}: error: {pack['error']}")
    out += na
    if marks:
        out.append("† and errors:")
        out += [f"- {x}" for x in marks]
    out += results.get("notes", [])
    if m.get("memory_reclaim"):
        out.append(f"Memory reclaim on this machine: {'; '.join(m['memory_reclaim'])}. It can drop cached pages, "
                   "between cases and during a run (a warm run that reads slowly then ends with pages gone and is "
                   "marked †), or hand the memory behind them back to the host, which moves warm figures.")
    gpu = m.get("gpu") or "no GPU"
    ram = f"{m['ram_bytes'] / 2**30:.0f} GiB RAM" if m.get("ram_bytes") else "RAM unknown"
    disk = m.get("disk", {})
    out.append(f"Machine: {m['cpu']}, {m['cpus_usable']} usable CPUs, {ram}, {gpu}; torch {m.get('torch')} "
               f"(CUDA {m.get('cuda')}); disk {disk.get('device')} ({disk.get('fstype')}"
               f"{', rotational' if disk.get('rotational') else ''}). Corpus: {corpus['images']:,} images, "
               f"{corpus['bytes'] / 1e6:,.0f} MB{' (generated)' if corpus['generated'] else ''}.")
    return out


def progress_line(case: dict) -> str:
    where = f"{case['source'] or '-':>20} {case['measure']:8} {case.get('cache') or '':5}"
    if case["status"] != "ok":
        return f"{where} {case['status']}: {case.get('error', '')[:300]}"
    extra = f"  waiting {case['wait_fraction']['median']:.0%}" if "wait_fraction" in case else ""
    note = f"  ({case['note']})" if case.get("note") else ""
    return f"{where} {case['median']:10,.0f} {case.get('unit', 'samples/s')}{extra}{note}"


def pack_line(fmt: str, case: dict) -> str:
    if case["status"] != "ok":
        return f"{'pack ' + fmt:>20} {case['status']}: {case.get('error') or case.get('reason')}"
    return f"{'pack ' + fmt:>20} {case['median']:8.2f} s  ({case['bytes'] / 1e6:,.0f} MB)"


def chart(results: dict, path: str) -> str:
    """Write a grouped bar chart of every measure; returns what happened, for stderr."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib not installed (pip install 'packer[plot]')"
    config = results["config"]
    names = [n for n, e in results["sources"].items() if e["available"]]
    measures = config["measures"]
    fig, axes = plt.subplots(1, len(measures), figsize=(4 * len(measures), 4), squeeze=False)
    width = 0.8 / max(1, len(config["cache"]))
    for ax, m in zip(axes[0], measures):
        for k, s in enumerate(config["cache"]):
            values = [figure(results, n, m, s) or 0 for n in names]
            ax.bar([i + k * width for i in range(len(names))], values, width, label=s)
        ax.set_title(m)
        ax.set_xticks([i + width * (len(config["cache"]) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("samples/s")
    axes[0][0].legend()
    corpus = config["corpus"]
    fig.suptitle(f"packer benchmarks: {corpus['images']:,} images, {config['workers']} workers, "
                 f"{config['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
