"""GPU decode against the bare batched nvJPEG decode of the same bytes, and against the CPU workers.

    python benchmarks/suites/gpu_decode.py PACK.lmdb [--batch 256] [--images 4096] [--chunks 0,64]
                                           [--seconds 5] [--workers N] [--profile FILE] [--json out.json]

Rates, each over about `--seconds` after a warm-up call, with GPU and JPEG-engine
utilisation sampled by NVML (benchmarks/suites/feed.py's Utilisation):

  bare_decode_jpeg              torchvision.io.decode_jpeg(list of tensors, device="cuda"):
                                decode only, the batches' tensors made beforehand
  crop_resize_only              RandomResizedCrop(224, flip=0.5) on images decoded beforehand,
                                batched (readers.resize), and its peak GPU memory
  crop_resize_window_by_window  the same with an F.interpolate per window (what it replaced)
  gpu_decoder[_chunkN]          readers.nvjpeg.GPUDecoder on the same bytes (EncodedBatch):
                                decode + crop + resize in-process, per --chunks (0: whole batch)
  make_loader_gpu_decode[...]   make_loader(gpu_decode=GPUDecoder) on the LMDB, --workers workers
  make_loader_cpu_workers       make_loader with the crop in the CPU workers
  make_loader_hybrid            make_loader(gpu_decode="hybrid"): each batch split between the
                                workers and nvJPEG, tuned online (readers.hybrid); its goal is
                                >= 0.9 x (make_loader_gpu_decode + make_loader_cpu_workers), and
                                the split it settled on and the rates it measured are recorded

Each rate other than the bare decode is also given as a fraction of it (vs_bare; the goal is
>= 0.9). Then each GPUDecoder runs five batches under torch.profiler (--profile: its ops'
tables), and libnvjpeg's version and whether its hardware backend exists are read through
ctypes, last, so that a crash there leaves the rates recorded. Needs CUDA and torchvision.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import readers  # noqa: E402
from benchmarks.suites.feed import Utilisation  # noqa: E402
from benchmarks.suites.gpu_host import crop_window_by_window  # noqa: E402
from readers.buffers import EncodedBatch  # noqa: E402

GOAL = "gpu_decode >= 0.9 x the bare batched decode rate"
HYBRID_GOAL = "make_loader_hybrid >= 0.9 x (make_loader_gpu_decode + make_loader_cpu_workers)"


def nothing(message: str) -> None:
    """The default `note`: a caller that saves results as they come passes its own."""


def loaded_nvjpeg() -> str | None:
    """The libnvjpeg this process has loaded (torchvision's, once it has decoded), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libnvjpeg" in line}
    except OSError:
        return None
    return sorted(paths)[0] if paths else None


def nvjpeg_library() -> dict:
    """libnvjpeg's version and whether its hardware backend (the A100/H100 JPEG engines) can be
    created on this GPU: the same nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE) call torchvision's
    batched decoder makes first (it falls back to the default backend on ARCH_MISMATCH), made
    through the library torchvision loaded. Call it after a decode_jpeg on the GPU."""
    import ctypes

    path = loaded_nvjpeg()
    try:
        lib = ctypes.CDLL(path or "libnvjpeg.so")
    except OSError as exc:
        return {"library": path, "reason": f"libnvjpeg not loadable: {exc}"}
    out = {"library": path or "libnvjpeg.so (torchvision had not loaded one)"}
    version = []
    for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        value = ctypes.c_int()
        if lib.nvjpegGetProperty(prop, ctypes.byref(value)) == 0:
            version.append(str(value.value))
    out["version"] = ".".join(version) or None
    handle = ctypes.c_void_p()
    status = lib.nvjpegCreateEx(3, None, None, 0, ctypes.byref(handle))  # 3 = NVJPEG_BACKEND_HARDWARE
    out["hardware_backend"] = status == 0
    out["hardware_backend_status"] = {0: "available", 7: "arch mismatch: no hardware decoder on this GPU",
                                      8: "internal error"}.get(status, f"nvjpeg status {status}")
    if status == 0:
        lib.nvjpegDestroy(handle)
    return out


def timed(fn, seconds: float, warm: int = 1) -> tuple[float, int, float]:
    """(images/s, images, seconds): fn() returns how many images it did; called `warm` times
    untimed, then until `seconds` have passed."""
    for _ in range(warm):
        fn()
    n, start = 0, time.perf_counter()
    while True:
        n += fn()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return n / elapsed, n, elapsed


def profile_calls(fn, calls: int, cuda: bool) -> tuple[dict, str]:
    """fn() `calls` times under torch.profiler, after one call untraced: per call, the wall
    time, the host's time inside torch ops and the device's kernel time (each op's self
    time, summed), and the ops' table sorted by each. Kernel time well under the wall time
    means the GPU waits on the host."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    ops = prof.key_averages()
    totals = {"calls": calls, "wall_ms_per_call": wall / calls * 1e3,
              "host_op_ms_per_call": sum(op.self_cpu_time_total for op in ops) / calls / 1e3,
              "device_ms_per_call": sum(op.self_device_time_total for op in ops) / calls / 1e3}
    tables = ops.table(sort_by="self_cpu_time_total", row_limit=20)
    if cuda:
        tables += "\n" + ops.table(sort_by="self_device_time_total", row_limit=20)
    return totals, tables


def loader_rate(loader, seconds: float, skip: int) -> float:
    """samples/s of batches arriving on the device over about `seconds`, epoch after epoch,
    after `skip` batches of start-up."""
    n, start, seen = 0, None, 0
    while start is None or time.perf_counter() - start < seconds:
        it = iter(loader)
        try:
            for images, labels in it:
                torch.cuda.current_stream().synchronize()
                seen += 1
                if start is None:
                    if seen >= skip:
                        start = time.perf_counter()
                    continue
                n += len(labels)
                if time.perf_counter() - start >= seconds:
                    break
        finally:
            del it  # shuts the workers down
        if seen == 0:
            raise RuntimeError("the loader yielded no batch")
    return n / (time.perf_counter() - start)

class Batches:
    """The first `images` records' bytes as make_loader's workers hand them over (one buffer per
    batch), made beforehand so that no rate counts the reading; next() cycles through them."""

    def __init__(self, lmdb: str, images: int, batch: int):
        dataset = readers.LMDBDataset(lmdb, decode="raw")
        try:
            blobs = [bytes(dataset[i][0]) for i in range(min(len(dataset), images))]
        finally:
            dataset.close()
        self.images, self.batch = len(blobs), batch
        self.encoded = [EncodedBatch.of(blobs[i:i + batch]) for i in range(0, len(blobs) - batch + 1, batch)] \
            or [EncodedBatch.of(blobs)]
        self.tensors = [encoded.tensors() for encoded in self.encoded]  # what the bare decode takes
        self.i = 0

    def next_index(self) -> int:
        self.i = (self.i + 1) % len(self.encoded)
        return self.i

    def next(self) -> EncodedBatch:
        return self.encoded[self.next_index()]


class Rates:
    """entry["rates"], each rate timed with utilisation sampled; a failing rate is recorded as its error."""

    def __init__(self, entry: dict, device, seconds: float, note):
        self.rates, self.device, self.seconds, self.note = entry.setdefault("rates", {}), device, seconds, note

    def done(self, name: str) -> None:
        self.note(f"nvjpeg {name}: {json.dumps(self.rates[name])}")

    def measure(self, name: str, fn, **extra) -> None:
        util = Utilisation(self.device).start()
        try:
            rate, n, elapsed = timed(fn, self.seconds)
            self.rates[name] = {"samples_per_s": rate, "images": n, "seconds": elapsed, **extra, **util.stop()}
        except Exception as exc:
            util.stop()
            self.rates[name] = {"error": f"{type(exc).__name__}: {exc}"}
        self.done(name)


def in_process_rates(rates: Rates, batches: Batches, chunks: list[int], crop) -> None:
    """The bare decode, the crop alone (batched and window by window) and each GPUDecoder, on the
    same bytes in this process."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from readers.nvjpeg import GPUDecoder

    device = rates.device

    def synced(fn):
        def call():
            out = fn()
            torch.cuda.synchronize(device)
            return len(out)
        return call

    rates.measure("bare_decode_jpeg", synced(lambda: decode_jpeg(batches.tensors[batches.next_index()],
                                                                  mode=ImageReadMode.RGB, device=device)),
                  what=f"torchvision.io.decode_jpeg(list of {batches.batch} tensors, device='cuda'), "
                       f"decode only, tensors made beforehand")
    decoded = decode_jpeg(batches.tensors[0], mode=ImageReadMode.RGB, device=device)
    held = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    rates.measure("crop_resize_only", synced(lambda: readers.transforms.transform_batch(crop, decoded)),
                  what=f"RandomResizedCrop(224, flip=0.5) on {len(decoded)} images nvJPEG decoded beforehand, "
                       f"batched (no decode)")
    if "samples_per_s" in rates.rates["crop_resize_only"]:  # the resize's own GPU memory, beside the decoded images
        rates.rates["crop_resize_only"]["peak_mib"] = (torch.cuda.max_memory_allocated(device) - held) / 2 ** 20
    rates.measure("crop_resize_window_by_window", synced(lambda: crop_window_by_window(crop, decoded)),
                  what="the same, with an F.interpolate per window (the form readers.resize replaced)")
    for chunk in chunks:
        decoder = GPUDecoder(crop, device, chunk=chunk or None)
        rates.measure(f"gpu_decoder_chunk{chunk}" if chunk else "gpu_decoder",
                      synced(lambda decoder=decoder: decoder(batches.next())),
                      what=f"{decoder!r} on the same bytes (EncodedBatch): decode + crop + resize, in-process")


def loader_rates(rates: Rates, lmdb: str, batch: int, chunks: list[int], crop, workers: int) -> None:
    """make_loader on the LMDB: with gpu_decode per chunk size, and with the crop in the CPU workers."""
    from readers.hybrid import HybridDecoder
    from readers.nvjpeg import GPUDecoder

    device = rates.device
    cases = [(f"make_loader_gpu_decode_chunk{c}" if c else "make_loader_gpu_decode", {"decode": "raw"},
              {"gpu_decode": GPUDecoder(crop, device, chunk=c or None)}) for c in chunks]
    cases.append(("make_loader_cpu_workers", {"decode": "raw", "transform": crop}, {}))
    hybrid = HybridDecoder(GPUDecoder(crop, device))
    cases.append(("make_loader_hybrid", {"decode": "raw"}, {"gpu_decode": hybrid}))
    for name, dataset_args, extra in cases:
        util, ds = Utilisation(device), None
        try:
            ds = readers.LMDBDataset(lmdb, **dataset_args)
            loader = readers.make_loader(ds, batch, device=device, workers=workers, mean=readers.IMAGENET_MEAN,
                                         std=readers.IMAGENET_STD, **extra)
            util.start()
            rate = loader_rate(loader, rates.seconds, skip=max(2, workers))
            how = "gpu_decode=" + repr(extra["gpu_decode"]) if extra else "RandomResizedCrop in the workers"
            rates.rates[name] = {"samples_per_s": rate, "workers": workers, **util.stop(),
                                 "what": f"make_loader(LMDB, {workers} workers, device='cuda', {how})"}
        except Exception as exc:  # one path failing is a result; the next is still measured
            util.stop()
            rates.rates[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            if ds is not None:
                ds.close()
        if name == "make_loader_hybrid" and "error" not in rates.rates[name]:
            tuner = hybrid.tuner
            rates.rates[name].update(cpu_share=tuner.fraction, cpu_share_target=tuner.target(),
                                     tuner_cpu_rate=tuner.cpu_rate, tuner_engine_rate=tuner.engine_rate)
        rates.done(name)


def hybrid_goal(rates: dict) -> dict | None:
    """The hybrid loader's rate against the engine's loader rate plus the CPU workers' (item 2's goal)."""
    parts = [rates.get(k, {}).get("samples_per_s") for k in
             ("make_loader_hybrid", "make_loader_gpu_decode", "make_loader_cpu_workers")]
    if not all(parts):
        return None
    hybrid, engine, cpu = parts
    return {"goal": HYBRID_GOAL, "vs_sum": hybrid / (engine + cpu), "sum_samples_per_s": engine + cpu}


def measure(entry: dict, lmdb: str, device, batch: int = 256, images: int = 4096, chunks=(0, 64),
            seconds: float = 5.0, workers: int | None = None, profile_path: str | None = None, note=nothing) -> None:
    """Fills entry with every rate, the profile, the library and the goal, calling note(message)
    after each, so a caller can save what is done before a later part fails."""
    from readers.nvjpeg import GPUDecoder

    device = torch.device(device)
    entry["torchvision"] = __import__("torchvision").__version__
    batches = Batches(lmdb, images, batch)
    entry["config"] = {"images": batches.images, "batch": batch, "seconds_per_rate": seconds}
    rates, crop = Rates(entry, device, seconds, note), readers.RandomResizedCrop(224, flip=0.5)
    in_process_rates(rates, batches, list(chunks), crop)
    loader_rates(rates, lmdb, batch, list(chunks), crop, workers or readers.loader.default_workers())
    profile_decoders(entry, [GPUDecoder(crop, device, chunk=c or None) for c in chunks], batches.next, device,
                     profile_path, note)
    # Last: a C call through ctypes, so that if it crashed the rates are already saved.
    entry["library"] = nvjpeg_library()
    note(f"nvjpeg library: {json.dumps(entry['library'])}")
    bare_rate = rates.rates.get("bare_decode_jpeg", {}).get("samples_per_s")
    for name, rate in rates.rates.items():
        if bare_rate and "samples_per_s" in rate and name != "bare_decode_jpeg":
            rate["vs_bare"] = rate["samples_per_s"] / bare_rate
    jpg = rates.rates.get("bare_decode_jpeg", {}).get("jpg_util")
    entry["hardware_decoder_used"] = None if jpg is None else jpg["max"] > 0
    entry["goal"] = GOAL
    entry["hybrid"] = hybrid_goal(rates.rates)


def profile_decoders(entry: dict, decoders: list, next_batch, device, path: str | None, note=nothing) -> None:
    """Five batches through each decoder under torch.profiler: per batch totals into entry,
    the ops' tables into `path`. A failure is recorded, never raised."""
    sections, found = [], entry.setdefault("profile", {})
    for decoder in decoders:
        def call(decoder=decoder):
            decoder(next_batch())
            torch.cuda.synchronize(device)

        try:
            found[repr(decoder)], tables = profile_calls(call, 5, cuda=True)
            sections.append(f"== {decoder!r}: {json.dumps(found[repr(decoder)])}\n{tables}")
        except Exception as exc:
            found[repr(decoder)] = {"error": f"{type(exc).__name__}: {exc}"}
        note(f"nvjpeg profile {decoder!r}: {json.dumps(found[repr(decoder)])}")
    if path:
        Path(path).write_text("\n\n".join(sections))


def errors(entry: dict) -> str | None:
    """The failed rates, one line; None when every rate was measured."""
    failed = [f"{k}: {r['error']}" for k, r in entry.get("rates", {}).items() if "error" in r]
    return "; ".join(failed) or None


def table(entry: dict) -> str:
    """The rates as Markdown, with the library's facts under them."""
    lines = ["| path | samples/s | × bare | GPU util | JPEG engine util |", "|---|---:|---:|---:|---:|"]
    for name, r in entry["rates"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} | | | |")
            continue
        util, jpg = r.get("gpu_util"), r.get("jpg_util")
        vs_bare = r.get("vs_bare", 1.0 if name.startswith("bare") else None)
        lines.append(f"| {name} | {r['samples_per_s']:,.0f} | {'–' if vs_bare is None else format(vs_bare, '.2f')} "
                     f"| {'–' if not util else format(util['mean'], '.0f') + '%'} "
                     f"| {'–' if not jpg else format(jpg['mean'], '.0f') + '%'} |")
    hybrid = entry.get("hybrid")
    if hybrid:
        share = entry["rates"]["make_loader_hybrid"]
        lines.append(f"\nhybrid: {hybrid['vs_sum']:.2f} x (GPU decode + CPU workers: "
                     f"{hybrid['sum_samples_per_s']:,.0f}/s), CPU share settled at {share['cpu_share']:.2f} "
                     f"(target {share['cpu_share_target'] or 0:.2f}); goal {hybrid['goal']}")
    lib = entry.get("library", {})
    lines.append(f"\nlibnvjpeg {lib.get('version')}: hardware backend "
                 f"{lib.get('hardware_backend_status', lib.get('reason'))}; JPEG engines seen busy during the bare "
                 f"decode: {entry.get('hardware_decoder_used')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("lmdb", help="a packer LMDB of JPEGs")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--images", type=int, default=4096, help="records decoded by the in-process rates")
    p.add_argument("--chunks", type=lambda v: [int(c) for c in v.split(",")], default=[0, 64],
                   help="GPUDecoder chunk sizes, 0 = the whole batch in one decode (default: 0,64)")
    p.add_argument("--seconds", type=float, default=5.0, help="per rate")
    p.add_argument("--workers", type=int, help="make_loader's workers (default: its own)")
    p.add_argument("--profile", help="write the profiler's tables here")
    p.add_argument("--json", help="write the rates here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA: every rate here is a GPU's")
    entry: dict = {}
    measure(entry, args.lmdb, "cuda", args.batch, args.images, args.chunks, args.seconds, args.workers,
            args.profile, note=lambda message: print(message, file=sys.stderr))
    print(table(entry))
    if args.json:
        Path(args.json).write_text(json.dumps(entry, indent=1))
    return 1 if errors(entry) else 0


if __name__ == "__main__":
    sys.exit(main())
