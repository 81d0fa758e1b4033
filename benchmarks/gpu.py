"""`python -m benchmarks gpu`: the GPU proof (issue 20) in one or two short commands, every
result written into one flat folder as it is obtained.

    python -m benchmarks gpu prepare                  # here, with network: fills .whl/ and .carry/
    python -m benchmarks gpu --out DIR [--steps tests,nvjpeg,handover] [--images N] [--quick]

Steps, in this order (`--steps` picks some; `corpus` runs whenever a later step needs it):
  env      what the machine has: torch, CUDA, the GPU, torchvision, NVML, packer's dependencies
  tests    the CUDA tests (pytest, a junit report)
  corpus   --images ImageNet-like JPEGs made from the carried photos by make_corpus.py
           (.carry/tools/, reading .carry/data/imagenet-sample), packed to LMDB; without the
           tool, packer.synth's synthetic corpus, and the results say so
  feed     benchmarks/suites/feed.py on that LMDB: ResNet-50, channels_last, bf16, batch 256,
           make_loader vs torch's DataLoader defaults (and + workers), GPU utilisation by NVML
  nvjpeg   decode + crop + resize through gpu_decode against bare batched
           torchvision.io.decode_jpeg(device="cuda") on the same bytes and the CPU workers
  handover benchmarks/suites/pin_handover.py --pin: how long the training thread is kept
           from the GIL while torch's pin thread frees each batch, with the batch's shared
           memory given back first (make_loader's WorkerBatch) and without
  disk     benchmarks/suites/disk_depth.py: the disk's cold random reads by reads in flight
  suite    `python -m benchmarks run --device cuda` on the corpus, sized to the time left
  scaling  e2e warm (no step) with 1, 2, 4, 8, 16 workers over workers x the per-core
           decode + crop rate (the suite's own cases, in fresh processes)

Each step is timed, logged and recorded whatever happens to it: a failed step records its
error and the next one runs. `--time-budget` (seconds for the whole command) skips a step
that cannot fit and bounds the ones that run, so a command ends inside a 10-minute limit;
results are rewritten after every step, so a command killed early still leaves them.

Files in --out (flat, at most 8): gpu-results.json (everything), gpu.log, summary.md (the
tables), tests.xml, nvjpeg-profile.txt (torch.profiler's tables of the GPU decoder), suite.json,
suite.md and suite.png.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARRY = ".carry"  # photos and the corpus tool, ignored by git, carried to the GPU machine
WHEELS = ".whl"
# The suite before scaling: a suite stopped by the time limit loses its whole JSON, while
# scaling saves each row as it goes, so it takes what is left.
STEPS = ("env", "tests", "corpus", "feed", "nvjpeg", "handover", "disk", "suite", "scaling")
NEEDS_CORPUS = ("feed", "nvjpeg", "disk", "scaling", "suite")
# The tests that do something different where CUDA is present (grep tests/ for cuda).
CUDA_TESTS = ["tests/test_gpu.py", "tests/test_nvjpeg.py", "tests/test_resize.py", "tests/test_collate.py",
              "tests/test_loader.py", "tests/test_handover.py",
              "tests/test_benchmarks.py::test_cuda_is_used_when_present_and_its_absence_is_reported"]
# About how long each step needs at least, in seconds, on the GPU machine (--quick: a fifth).
MIN_SECONDS = {"env": 5, "tests": 60, "corpus": 60, "feed": 90, "nvjpeg": 45, "handover": 60, "disk": 40,
               "scaling": 90, "suite": 120}
SCALING_WORKERS = (1, 2, 4, 8, 16)
MARGIN_S = 20  # left free at the end of the budget: writing results, the machine's transfers


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


class Run:
    """The results folder: gpu-results.json rewritten after every change, gpu.log appended."""

    def __init__(self, out: str, budget: float, argv: list[str]):
        os.makedirs(out, exist_ok=True)
        self.out, self.budget, self.started = out, budget, time.monotonic()
        self.log_path = os.path.join(out, "gpu.log")
        self.results = {"schema": 1, "created": now(), "command": ["python", "-m", "benchmarks", "gpu", *argv],
                        "time_budget_s": budget, "steps": {}}
        self._lock = threading.Lock()
        self.save()

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def log(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - self.started:5.0f}s] {message}"
        print(line, file=sys.stderr, flush=True)
        with self._lock, open(self.log_path, "a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        path = os.path.join(self.out, "gpu-results.json")
        with self._lock:
            with open(path + ".tmp", "w") as f:
                json.dump(self.results, f, indent=1, default=str)
            os.replace(path + ".tmp", path)

    def record(self, step: str, **fields) -> dict:
        entry = self.results["steps"].setdefault(step, {})
        entry.update(fields)
        self.save()
        return entry

    @contextlib.contextmanager
    def step(self, name: str):
        """Times the step and records it: ok, or the error and its traceback (never raised)."""
        self.log(f"--- {name} (time left {self.left():.0f} s)")
        entry = self.record(name, status="running", started=now())
        t0 = time.monotonic()
        try:
            yield entry
            if entry.get("status") == "running":
                entry["status"] = "ok"
        except Exception as exc:  # a failed step is a result; the next step runs
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}",
                         traceback=traceback.format_exc(limit=-6))
            self.log(f"{name}: ERROR {type(exc).__name__}: {exc}")
        entry["seconds"] = round(time.monotonic() - t0, 1)
        self.save()
        self.log(f"{name}: {entry['status']} in {entry['seconds']} s")

    def skip(self, name: str, reason: str) -> None:
        self.record(name, status="skipped", reason=reason)
        self.log(f"--- {name}: skipped: {reason}")

    def stream(self, cmd: list[str], timeout: float, stdout_path: str | None = None, env: dict | None = None) -> int:
        """Runs cmd, its stderr (and stdout, unless stdout_path takes it) into the log and the
        console; stopped (its whole process group) after `timeout` seconds. Returns the exit code."""
        self.log("$ " + " ".join(cmd))
        out = open(stdout_path, "w") if stdout_path else None
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or child_env(), stdout=out or subprocess.PIPE,
                                stderr=subprocess.PIPE if out else subprocess.STDOUT, text=True,
                                start_new_session=True)
        pipe = proc.stderr if out else proc.stdout

        def pump():
            with open(self.log_path, "a") as log:
                for line in pipe:
                    sys.stderr.write(line)
                    log.write(line)
                    log.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            self.log(f"stopped after {timeout:.0f} s (the time budget)")
            return -9
        finally:
            reader.join(timeout=5)
            if out:
                out.close()
        return proc.returncode


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.setdefault("PACKER_SHARED_DATA", os.path.join(ROOT, CARRY, "data"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ------------------------------------------------------------------ env

def versions() -> dict:
    """What the machine offers, and which of packer's needs are missing (None = not importable)."""
    import importlib
    import warnings

    found = {}
    for name in ("torch", "torchvision", "numpy", "PIL", "lmdb", "h5py", "simplejpeg", "deflate", "webdataset",
                 "wids", "braceexpand", "pynvml", "matplotlib", "pytest", "click", "tqdm"):
        try:
            module = importlib.import_module(name)
            with warnings.catch_warnings():  # click deprecates __version__
                warnings.simplefilter("ignore")
                found[name] = getattr(module, "__version__", "present")
        except Exception as exc:  # ImportError, or a broken binary wheel
            found[name] = None if isinstance(exc, ImportError) else f"broken: {type(exc).__name__}: {exc}"
    return found


def cpu_topology() -> dict:
    """The CPU model and how many hardware threads share a core (2: SMT siblings halve a
    core's decode rate when both run)."""
    out = {}
    try:
        with open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") as f:
            siblings = f.read().strip()
        out["cpu0_thread_siblings"] = siblings
        out["threads_per_core"] = sum(len(range(int(a), int(b or a) + 1)) for a, _, b in
                                      (part.partition("-") for part in siblings.split(",")))
        with open("/proc/cpuinfo") as f:
            out["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                                    None)
    except (OSError, ValueError):
        pass
    return out


def describe_cuda() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
            **cpu_topology()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count, cudnn=torch.backends.cudnn.version())
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:
        info["torchvision"] = None
    return info


def step_env(run: Run, args) -> None:
    with run.step("env") as entry:
        entry["packages"] = versions()
        entry["cuda"] = describe_cuda()
        entry["device"] = args.device
        missing = [k for k in ("lmdb", "simplejpeg", "deflate", "h5py", "PIL", "numpy") if not entry["packages"][k]]
        if missing:
            entry["status"] = "error"
            entry["error"] = (f"packer's dependencies missing: {', '.join(missing)}: install the carried wheels "
                              f"first (python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl "
                              f"and PYTHONPATH=/tmp/site)")
        run.log(json.dumps({"cuda": entry["cuda"], "packages": entry["packages"]}))


# ------------------------------------------------------------------ tests

def junit_counts(path: str) -> dict:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                        if c.find("failure") is not None or c.find("error") is not None]
    counts["skip_reasons"] = sorted({(c.find("skipped").get("message") or "")[:200] for s in suites
                                     for c in s.iter("testcase") if c.find("skipped") is not None})
    return counts


def tests_rootdir(tests: list[str]) -> str:
    """The inner pytest's rootdir, which names the tests in the junit report: the repository for
    its own tests, else the folder holding the given ones. Left to pytest, it is the common
    ancestor of the clone and the tests, so a clone under /tmp named a test under /tmp by its path."""
    files = [os.path.abspath(os.path.join(ROOT, t.split("::")[0])) for t in tests if not t.startswith("-")]
    if not files:
        return ROOT
    common = os.path.commonpath([os.path.dirname(f) for f in files])
    return ROOT if common == ROOT or common.startswith(ROOT + os.sep) else common


def step_tests(run: Run, args) -> None:
    with run.step("tests") as entry:
        xml = os.path.join(run.out, "tests.xml")
        timeout = min(args.tests_timeout, run.left() - MARGIN_S)
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}",
               f"--rootdir={tests_rootdir(args.tests)}", *args.tests]
        code = run.stream(cmd, timeout)
        entry.update(command=cmd[1:], exit_code=code)
        if os.path.exists(xml):
            entry.update(junit_counts(xml))
        if code != 0:
            entry["status"] = "error"
            entry["error"] = "pytest was stopped by the time budget" if code == -9 else f"pytest exited {code}"
        import torch

        if not torch.cuda.is_available():
            entry["note"] = "no CUDA: the CUDA tests skipped (their reasons are in skip_reasons)"


# ------------------------------------------------------------------ corpus

def corpus_tool(args) -> str | None:
    """make_corpus.py: --corpus-tool, the carried copy, or the shared one beside the checkout."""
    shared = os.environ.get("PACKER_SHARED_DATA")
    for path in (args.corpus_tool, os.path.join(ROOT, CARRY, "tools", "make_corpus.py"),
                 shared and os.path.join(os.path.dirname(os.path.abspath(shared)), "tools", "make_corpus.py")):
        if path and os.path.isfile(path):
            return path
    return None


def make_photo_corpus(run: Run, tool: str, folder: str, n: int, seed: int, timeout: float) -> dict:
    from .run import corpus_shape

    classes, per_class = corpus_shape(n)
    tmp = folder + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, tool, "--out", tmp, "--classes", str(classes), "--per-class", str(per_class),
           "--seed", str(seed), "--workers", str(os.cpu_count() or 1)]
    code = run.stream(cmd, timeout, env=child_env())
    if code != 0:
        raise RuntimeError(f"{os.path.basename(tool)} exited {code}")
    stats_path = os.path.join(tmp, "corpus_stats.json")
    with open(stats_path) as f:
        stats = json.load(f)
    # Kept out of the ImageFolder tree (the suite would scan it), beside it instead.
    shutil.move(stats_path, folder + ".stats.json")
    os.replace(tmp, folder)
    return {k: v for k, v in stats.items() if k != "sources"} | {"sources": [s["path"] for s in stats["sources"]]}


def step_corpus(run: Run, args, ctx: dict) -> None:
    """Makes (or reuses) the corpus and its LMDB pack; fills ctx["folder"] and ctx["lmdb"]."""
    with run.step("corpus") as entry:
        from packer import scan_source
        from packer.pack import pack

        folder = args.corpus or os.path.join(args.workdir, f"corpus-{args.images}")
        stamp = folder + ".json"
        tool = None if args.corpus or args.synthetic else corpus_tool(args)
        want = {"images": args.images, "seed": args.seed, "tool": os.path.basename(tool) if tool else "packer.synth"}
        if args.corpus:
            entry["made_by"] = f"given: {folder}"
        elif os.path.isdir(folder) and os.path.exists(stamp) and json.load(open(stamp)) == want:
            entry["made_by"] = f"reused ({want['tool']}, made by an earlier command on this machine)"
        else:
            shutil.rmtree(folder, ignore_errors=True)
            t0 = time.monotonic()
            if tool:
                entry["stats"] = make_photo_corpus(run, tool, folder, args.images, args.seed,
                                                   run.left() - MARGIN_S)
                entry["made_by"] = f"{tool} from the photos it found (see stats.sources)"
            else:
                from packer.synth import make_corpus

                from .run import corpus_shape

                classes, per_class = corpus_shape(args.images)
                make_corpus(folder, classes=classes, per_class=per_class, seed=args.seed,
                            workers=os.cpu_count() or 1)
                entry["made_by"] = "packer.synth (synthetic images)"
                if not args.synthetic:
                    entry["note"] = ("make_corpus.py was not found (.carry/tools/ or --corpus-tool): the corpus is "
                                     "synthetic, not made from the shared photos as issue 20 asks")
            entry["make_seconds"] = round(time.monotonic() - t0, 1)
            with open(stamp, "w") as f:
                json.dump(want, f)
        entry["folder"], entry["images"] = folder, scan_source(folder).count
        lmdb = os.path.join(args.workdir, f"corpus-{args.images}.lmdb") if not args.corpus else \
            os.path.join(args.workdir, "given.lmdb")
        if not (os.path.exists(lmdb) and entry["made_by"].startswith("reused")):
            shutil.rmtree(lmdb, ignore_errors=True)
            t0 = time.monotonic()
            pack(folder, "lmdb", lmdb, workers=os.cpu_count() or 1, progress=False, force=True)
            entry["pack_seconds"] = round(time.monotonic() - t0, 1)
        entry["lmdb"] = lmdb
        ctx.update(folder=folder, lmdb=lmdb)
        run.log(f"corpus: {entry['images']} images in {folder} ({entry['made_by']}); LMDB {lmdb}")


# ------------------------------------------------------------------ feed

def step_feed(run: Run, args, ctx: dict, summary: dict) -> None:
    with run.step("feed") as entry:
        import torch

        from .suites import feed

        device = torch.device(args.device)
        quick = args.quick or device.type == "cpu"
        batch = min(args.batch, 8) if device.type == "cpu" else args.batch
        steps, warmup = (8, 2) if quick else (60, 10)
        per_case = max(10.0, min(args.feed_seconds, (run.left() - MARGIN_S - 20) / 3))
        entry["config"] = {"batch": batch, "steps": steps, "warmup": warmup, "max_seconds_per_case": per_case}

        def partial(out):
            entry.update(out)
            run.save()
            last = out["results"][-1]
            run.log(f"feed {last['case']}: " + json.dumps({k: v for k, v in last.items() if k != "case"}))

        feed.feed_check(ctx["lmdb"], device, batch, steps, warmup, workers=args.workers,
                        max_seconds=per_case, on_result=partial)
        summary["feed"] = feed.table(entry["results"])
        if device.type == "cpu":
            entry["note"] = "CPU smoke run with a small model: the plumbing, not the claim"
        if any("error" in r for r in entry["results"]):
            entry["status"] = "error"
            entry["error"] = "; ".join(f"{r['case']}: {r['error']}" for r in entry["results"] if "error" in r)


# ------------------------------------------------------------------ nvjpeg

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
    import torch
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
    import torch

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


def step_nvjpeg(run: Run, args, ctx: dict, summary: dict) -> None:
    import torch

    if not args.device.startswith("cuda"):
        run.skip("nvjpeg", "no CUDA")
        return
    with run.step("nvjpeg") as entry:
        from torchvision.io import ImageReadMode, decode_jpeg

        import readers
        from readers.buffers import EncodedBatch
        from readers.nvjpeg import GPUDecoder

        from .suites.feed import Utilisation
        from .suites.gpu_host import crop_window_by_window

        device = torch.device(args.device)
        entry["torchvision"] = __import__("torchvision").__version__
        rates_to_take = 4 + 2 * len(args.nvjpeg_chunks)
        seconds = 3.0 if args.quick else max(3.0, min(10.0, (run.left() - MARGIN_S - 30) / rates_to_take))
        dataset = readers.LMDBDataset(ctx["lmdb"], decode="raw")
        count = min(len(dataset), args.nvjpeg_images)
        blobs = [bytes(dataset[i][0]) for i in range(count)]
        dataset.close()
        batch = args.batch
        # Each batch as make_loader's workers hand it over (one buffer), made beforehand; the
        # bare decode gets views of the same buffers.
        batches = [EncodedBatch.of(blobs[i:i + batch]) for i in range(0, count - batch + 1, batch)] \
            or [EncodedBatch.of(blobs)]
        tensors = [encoded.tensors() for encoded in batches]
        entry["config"] = {"images": count, "batch": batch, "seconds_per_rate": seconds}
        rates = entry.setdefault("rates", {})

        def measure(name, fn, **extra):
            util = Utilisation(device).start()
            try:
                rate, n, elapsed = timed(fn, seconds)
                rates[name] = {"samples_per_s": rate, "images": n, "seconds": elapsed, **extra, **util.stop()}
            except Exception as exc:
                util.stop()
                rates[name] = {"error": f"{type(exc).__name__}: {exc}"}
            run.save()
            run.log(f"nvjpeg {name}: {json.dumps(rates[name])}")

        cursor = {"i": 0}

        def next_index():
            cursor["i"] = (cursor["i"] + 1) % len(batches)
            return cursor["i"]

        def bare():
            out = decode_jpeg(tensors[next_index()], mode=ImageReadMode.RGB, device=device)
            torch.cuda.synchronize(device)
            return len(out)

        measure("bare_decode_jpeg", bare, what=f"torchvision.io.decode_jpeg(list of {batch} tensors, "
                                             f"device='cuda'), decode only, tensors made beforehand")
        crop = readers.RandomResizedCrop(224, flip=0.5)
        decoded = decode_jpeg(tensors[0], mode=ImageReadMode.RGB, device=device)

        def transform_only():
            out = readers.transforms.transform_batch(crop, decoded)
            torch.cuda.synchronize(device)
            return len(out)

        held = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        measure("crop_resize_only", transform_only, what=f"RandomResizedCrop(224, flip=0.5) on {len(decoded)} "
                                                         f"images nvJPEG decoded beforehand, batched (no decode)")
        if "samples_per_s" in rates["crop_resize_only"]:  # the resize's own GPU memory, beside the decoded images
            rates["crop_resize_only"]["peak_mib"] = (torch.cuda.max_memory_allocated(device) - held) / 2 ** 20

        def window_by_window():
            out = crop_window_by_window(crop, decoded)
            torch.cuda.synchronize(device)
            return len(out)

        measure("crop_resize_window_by_window", window_by_window,
                what="the same, with an F.interpolate per window (the form readers.resize replaced)")
        for chunk in args.nvjpeg_chunks:
            decoder = GPUDecoder(crop, device, chunk=chunk or None)

            def gpu_decoder(decoder=decoder):
                out = decoder(batches[next_index()])
                torch.cuda.synchronize(device)
                return len(out)

            measure(f"gpu_decoder_chunk{chunk}" if chunk else "gpu_decoder", gpu_decoder,
                    what=f"{decoder!r} on the same bytes (EncodedBatch): decode + crop + resize, in-process")
        workers = args.workers or readers.loader.default_workers()
        cases = [(f"make_loader_gpu_decode_chunk{c}" if c else "make_loader_gpu_decode", {"decode": "raw"},
                  {"gpu_decode": GPUDecoder(crop, device, chunk=c or None)}) for c in args.nvjpeg_chunks]
        cases.append(("make_loader_cpu_workers", {"decode": "raw", "transform": crop}, {}))
        for name, dataset_args, extra in cases:
            util, ds = Utilisation(device), None
            try:
                ds = readers.LMDBDataset(ctx["lmdb"], **dataset_args)
                loader = readers.make_loader(ds, batch, device=device, workers=workers, mean=readers.IMAGENET_MEAN,
                                             std=readers.IMAGENET_STD, **extra)
                util.start()
                rate = loader_rate(loader, seconds, skip=max(2, workers))
                rates[name] = {"samples_per_s": rate, "workers": workers, **util.stop(),
                               "what": f"make_loader(LMDB, {workers} workers, device='cuda', "
                                       f"{'gpu_decode=' + repr(extra['gpu_decode']) if extra else 'RandomResizedCrop in the workers'})"}
            except Exception as exc:  # one path failing is a result; the next is still measured
                util.stop()
                rates[name] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                if ds is not None:
                    ds.close()
            run.save()
            run.log(f"nvjpeg {name}: {json.dumps(rates[name])}")
        profile_decoders(run, entry, [GPUDecoder(crop, device, chunk=c or None) for c in args.nvjpeg_chunks],
                         lambda: batches[next_index()], device)
        # Last: a C call through ctypes, so that if it crashed the rates are already saved.
        entry["library"] = nvjpeg_library()
        run.log(f"nvjpeg library: {json.dumps(entry['library'])}")
        bare_rate = rates.get("bare_decode_jpeg", {}).get("samples_per_s")
        for name in rates:
            if bare_rate and "samples_per_s" in rates[name] and name != "bare_decode_jpeg":
                rates[name]["vs_bare"] = rates[name]["samples_per_s"] / bare_rate
        jpg = rates.get("bare_decode_jpeg", {}).get("jpg_util")
        entry["hardware_decoder_used"] = (None if jpg is None else jpg["max"] > 0)
        entry["goal"] = "gpu_decode >= 0.9 x the bare batched decode rate"
        summary["nvjpeg"] = nvjpeg_table(entry)
        if any("error" in r for r in rates.values()):
            entry["status"] = "error"
            entry["error"] = "; ".join(f"{k}: {r['error']}" for k, r in rates.items() if "error" in r)


def profile_decoders(run: Run, entry: dict, decoders: list, next_batch, device) -> None:
    """Five batches through each decoder under torch.profiler: per batch totals into entry,
    the ops' tables into nvjpeg-profile.txt. A failure is recorded, never raised."""
    import torch

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
        run.log(f"nvjpeg profile {decoder!r}: {json.dumps(found[repr(decoder)])}")
    with open(os.path.join(run.out, "nvjpeg-profile.txt"), "w") as f:
        f.write("\n\n".join(sections))
    run.save()


def nvjpeg_table(entry: dict) -> str:
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
    lib = entry.get("library", {})
    lines.append(f"\nlibnvjpeg {lib.get('version')}: hardware backend "
                 f"{lib.get('hardware_backend_status', lib.get('reason'))}; JPEG engines seen busy during the bare "
                 f"decode: {entry.get('hardware_decoder_used')}")
    return "\n".join(lines)


# ------------------------------------------------------------------ scaling

def step_scaling(run: Run, args, ctx: dict, summary: dict) -> None:
    with run.step("scaling") as entry:
        from .measures import Options
        from .run import run_children

        cores = os.cpu_count() or 1
        counts = sorted({min(w, cores) for w in SCALING_WORKERS})
        # Long timed runs: the e2e window opens with each worker's prefetched batches already
        # queued (up to 2 x workers x 64 samples), which a short run would count as speed.
        budget, repeat = (1.0, 1) if args.quick else (5.0, 2)
        suite_ctx = {"folder": ctx["folder"], "packed": {"lmdb": ctx["lmdb"]}}
        base = dict(budget=budget, warmup=0.5, repeat=repeat, batch_size=64, device=args.device, step_ms=0.0,
                    seed=args.seed)
        entry["config"] = {**base, "workers": counts, "source": "lmdb", "cache": "warm",
                           "what": "e2e warm, no step: make_loader(LMDB) to the device; per-core rate: the "
                                   "augment measure (read + decode + RandomResizedCrop(224) + flip, one process)"}
        work = os.path.join(args.workdir, "scaling")
        os.makedirs(work, exist_ok=True)
        per_core = run_children([[{"source": "lmdb", "measure": "augment", "cache": "warm"}],
                                 [{"source": None, "measure": "ceiling", "cache": None}]],
                                suite_ctx, Options(workers=1, **base), work)
        entry["per_core"] = per_core[0]
        entry["ceiling"] = per_core[1]
        rate = per_core[0].get("median")
        if not rate:
            raise RuntimeError(f"the per-core decode+crop rate failed: {per_core[0].get('error')}")
        rows = entry.setdefault("rows", [])
        for w in counts:
            if run.left() < MARGIN_S + 10 + 2 * budget * repeat:
                entry["note"] = f"stopped before {w} workers: the time budget"
                break
            (case,) = run_children([[{"source": "lmdb", "measure": "e2e", "cache": "warm"}]], suite_ctx,
                                   Options(workers=w, **base), work)
            got = case.get("median")
            try:
                parallel = parallel_rate(ctx["lmdb"], w)
            except Exception as exc:  # the baseline failing leaves the loader's row standing
                parallel, entry["parallel_error"] = None, f"{type(exc).__name__}: {exc}"
            rows.append({"workers": w, "samples_per_s": got, "fraction": got / (w * rate) if got else None,
                         "parallel_samples_per_s": parallel,
                         "parallel_fraction": parallel / (w * rate) if parallel else None,
                         "fraction_of_parallel": got / parallel if got and parallel else None,
                         "wait_fraction": (case.get("wait_fraction") or {}).get("median"),
                         "status": case["status"], "error": case.get("error")})
            run.save()
            run.log(f"scaling {w} workers: {json.dumps(rows[-1])}")
        entry["goal"] = "fraction >= 0.9 at 16 workers"
        summary["scaling"] = scaling_table(entry)


def decode_for(lmdb: str, start_at: float, seconds: float, seed: int) -> float:
    """One process of the parallel baseline: read + decode + RandomResizedCrop(224) + flip of
    LMDB records in a random order, busy until start_at (so every process runs when the
    timing opens), then counted for `seconds`. Returns its images/s."""
    import numpy as np
    import torch

    import readers

    torch.set_num_threads(1)  # as in a loader worker
    torch.manual_seed(seed)
    dataset = readers.LMDBDataset(lmdb, decode="raw", transform=readers.RandomResizedCrop(224, flip=0.5))
    order = np.random.default_rng(seed).permutation(len(dataset))
    i = n = 0
    while time.time() < start_at:
        dataset[int(order[i % len(order)])]
        i += 1
    t0 = time.time()
    while (t := time.time()) < start_at + seconds:
        dataset[int(order[(i + n) % len(order)])]
        n += 1
    dataset.close()
    return n / (t - t0)


def parallel_rate(lmdb: str, processes: int, seconds: float = 4.0, lead: float = 4.0) -> float:
    """images/s of `processes` independent decode+crop processes at once: what the machine's
    cores give together (turbo, shared caches, SMT), with no loader in the way."""
    import multiprocessing

    start_at = time.time() + lead  # spawn and imports take a second or two
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        rates = pool.starmap(decode_for, [(lmdb, start_at, seconds, seed) for seed in range(processes)])
    return sum(rates)


def scaling_table(entry: dict) -> str:
    rows = entry.get("rows", [])
    per_core = entry["per_core"].get("median") or 0

    def cells(key, fmt, missing="–"):
        return " | ".join(missing if r.get(key) is None else format(r[key], fmt) for r in rows)

    lines = ["| | " + " | ".join(f"{r['workers']} workers" for r in rows) + " |", "|---|" + "---:|" * len(rows),
             f"| e2e warm, samples/s | {cells('samples_per_s', ',.0f', 'error')} |",
             f"| ÷ (workers × per-core {per_core:,.0f}/s) | {cells('fraction', '.2f')} |",
             f"| as many lone decode+crop processes at once, images/s | {cells('parallel_samples_per_s', ',.0f')} |",
             f"| their ÷ (workers × per-core) | {cells('parallel_fraction', '.2f')} |",
             f"| e2e ÷ the lone processes at once | {cells('fraction_of_parallel', '.2f')} |"]
    return "\n".join(lines)


# ------------------------------------------------------------------ suite

# The suite's size, largest first: the step picks the first that fits the time left.
SUITE_PRESETS = {
    "full": {"formats": "folder,lmdb,hdf5,wds", "measures": "raw,decode,augment,e2e", "cache": "cold,warm",
             "peers": True, "repeat": 3, "budget": 3.0},
    "standard": {"formats": "folder,lmdb,hdf5,wds", "measures": "raw,decode,e2e", "cache": "cold,warm",
                 "peers": False, "repeat": 2, "budget": 2.0},
    # The cells issue 17's goals are measured on (checked reads, the plain DataLoader, e2e),
    # on that machine's disk and cores: run only when named (NAMED_ONLY).
    "defaults": {"formats": "folder,lmdb,hdf5,wds", "measures": "checked,loader,e2e", "cache": "cold,warm",
                 "peers": False, "repeat": 2, "budget": 1.5},
    "small": {"formats": "folder,lmdb,wds", "measures": "decode,e2e", "cache": "cold,warm", "peers": False,
              "repeat": 2, "budget": 2.0},
    "minimal": {"formats": "folder,lmdb", "measures": "e2e", "cache": "warm", "peers": False, "repeat": 1,
                "budget": 1.0},
}


NAMED_ONLY = ("defaults",)  # presets --suite auto never picks


def suite_seconds(preset: dict, case_start: float = 4.0, pack_s: float = 6.0) -> float:
    """A rough duration: every case a fresh process, a warm-up and the timed runs (each with its
    cache preparation), plus packing every format `repeat` times and the tar reference."""
    formats = preset["formats"].split(",")
    sources = len(formats) + ("wds" in formats) + 2 * preset["peers"]  # wds adds "wds (map)"
    cases = sources * len(preset["measures"].split(",")) * len(preset["cache"].split(",")) + 2
    per_case = case_start + 0.25 + preset["repeat"] * (preset["budget"] + 2.0)
    return cases * per_case + (len(formats) * preset["repeat"] + 1) * pack_s


def sized_preset(left: float) -> str:
    """The largest preset (--suite auto) whose estimate fits in 0.8 of left seconds, among
    those not NAMED_ONLY; "minimal" when none does."""
    fitting = [k for k, p in SUITE_PRESETS.items() if k not in NAMED_ONLY and suite_seconds(p) <= 0.8 * left]
    return fitting[0] if fitting else "minimal"


SCALING_RESERVE_S = 120  # what scaling needs after the suite (a per-core case and five e2e cases)


def step_disk(run: Run, args, ctx: dict, summary: dict) -> None:
    """The disk's cold random-read curve by reads in flight (benchmarks/suites/disk_depth.py)
    on the corpus's LMDB pack: what bounds the plain loader's cold ratio over the folder there."""
    study_step(run, args, summary, "disk", "disk_depth.py", [
        ctx["lmdb"], "--repeats", "1" if args.quick else "3", "--seconds", "0.3" if args.quick else "1.5"])


def step_handover(run: Run, args, ctx: dict, summary: dict) -> None:
    """The training thread's GIL stalls while the pin thread frees each batch
    (benchmarks/suites/pin_handover.py; torch's own pin thread where CUDA is)."""
    workers = str(min(8, os.cpu_count() or 1))
    study_step(run, args, summary, "handover", "pin_handover.py", [
        "--workers", workers, "--repeats", "1" if args.quick else "5", "--batches", "6" if args.quick else "40",
        "--batch", "32" if args.quick else "256",
        *(["--pin"] if args.device.startswith("cuda") else [])])


def study_step(run: Run, args, summary: dict, step: str, script: str, script_args: list) -> None:
    """Run benchmarks/suites/<script>: its runs go into gpu-results.json, its table into summary.md."""
    with run.step(step) as entry:
        # Kept in the workdir: the figures go into gpu-results.json and the table into summary.md.
        name = os.path.splitext(script)[0]
        table, runs = os.path.join(args.workdir, name + ".md"), os.path.join(args.workdir, name + ".json")
        cmd = [sys.executable, os.path.join("benchmarks", "suites", script), *script_args, "--json", runs]
        entry["command"] = cmd[1:]
        code = run.stream(cmd, run.left() - MARGIN_S, stdout_path=table)
        entry["exit_code"] = code
        if code != 0:
            entry["status"] = "error"
            entry["error"] = f"{script} exited {code}"
        else:
            entry["runs"] = json.load(open(runs))["runs"]
            summary[step] = open(table).read()


def step_suite(run: Run, args, ctx: dict, summary: dict) -> None:
    with run.step("suite") as entry:
        reserve = SCALING_RESERVE_S * (0.2 if args.quick else 1.0) if "scaling" in args.steps else 0.0
        left = run.left() - MARGIN_S - 15 - reserve
        name = sized_preset(left) if args.suite == "auto" else args.suite
        preset = dict(SUITE_PRESETS[name])
        if args.quick:
            preset.update(repeat=1, budget=min(preset["budget"], 0.5))
        cmd = [sys.executable, "-m", "benchmarks", "run", "--data", ctx["folder"], "--device", args.device,
               "--formats", preset["formats"], "--measures", preset["measures"], "--cache", preset["cache"],
               "--repeat", str(preset["repeat"]), "--budget", str(preset["budget"]),
               "--workdir", os.path.join(args.workdir, "suite"), "--out", os.path.join(run.out, "suite.json"),
               "--chart", os.path.join(run.out, "suite.png")]
        if args.workers:
            cmd += ["--workers", str(args.workers)]
        if not preset["peers"]:
            cmd.append("--no-peers")
        entry.update(preset=name, estimated_s=round(suite_seconds(preset)), command=cmd[1:])
        # Sized to leave scaling its time, but not stopped for it: a stopped suite writes nothing.
        code = run.stream(cmd, run.left() - MARGIN_S, stdout_path=os.path.join(run.out, "suite.md"))
        entry["exit_code"] = code
        if code != 0:
            entry["status"] = "error"
            entry["error"] = "stopped by the time budget" if code == -9 else f"benchmarks run exited {code}"
        elif os.path.exists(os.path.join(run.out, "suite.md")):
            summary["suite"] = open(os.path.join(run.out, "suite.md")).read()


# ------------------------------------------------------------------ prepare (here, with network)

# What the GPU machine lacks of packer's core, readers and bench needs: carried as wheels, at
# the versions installed here. Everything else they require is on the machine already.
CARRIED_PACKAGES = ("lmdb", "simplejpeg", "deflate", "braceexpand", "webdataset", "wids")
MACHINE_HAS = {"numpy", "pyyaml", "pillow", "h5py", "click", "tqdm", "torch", "torchvision", "typing-extensions",
               "fsspec", "psutil", "xxhash", "nvidia-ml-py", "pytest", "matplotlib", "filelock", "packaging"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
CARRY_LIMIT = 64 << 20
SETUP = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
         ".whl/*.whl && export PYTHONPATH=/tmp/site || exit; export PACKER_SHARED_DATA=$PWD/.carry/data "
         "PYTHONUNBUFFERED=1; ")
# Two commands of at most 10 minutes each; a fresh machine each time (it stays warm 30 s only).
# The feed check's goal was met on the first H100 run: the time goes to what is still open
# (nvJPEG, the pin thread's handover, scaling; issue 17's cells on that disk and cores).
COMMANDS = (SETUP + "python3 -m benchmarks gpu --out $OUT --steps tests,nvjpeg,handover,scaling --time-budget 560",
            SETUP + "python3 -m benchmarks gpu --out $OUT --steps disk,suite --suite defaults --time-budget 560")


def normalise_name(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_requirements(path: str) -> list[str]:
    """The distributions a wheel requires (Requires-Dist, extras left out)."""
    import re
    import zipfile

    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8", "replace").splitlines()
    needs = []
    for line in lines:
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            needs.append(normalise_name(re.split(r"[ ;<>=!~\[(]", line.split(":", 1)[1].strip())[0]))
    return needs


def download_wheel(name: str, version: str, dest: str) -> str:
    """pip download of one cp312 manylinux wheel (or a pure-Python one); returns its path."""
    before = set(os.listdir(dest))
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", "-d", dest, f"{name}=={version}"]
    extra = [f"manylinux_2_{n}_x86_64" for n in (24, 31, 34, 35)]
    for platforms in (PLATFORMS, PLATFORMS + tuple(extra)):
        cmd = base + [a for p in platforms for a in ("--platform", p)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            prefix = normalise_name(name) + "-"
            new = sorted(set(os.listdir(dest)) - before) or [f for f in os.listdir(dest)
                                                              if normalise_name(f).startswith(prefix)]
            return os.path.join(dest, new[0])
    raise RuntimeError(f"pip download {name}=={version} for cp312 manylinux failed: {proc.stderr.strip()[-800:]}")


def git_exclude(root: str, patterns: list[str]) -> str:
    """Adds patterns to the repository's info/exclude (shared by its worktrees); returns its path."""
    common = subprocess.run(["git", "-C", root, "rev-parse", "--git-common-dir"], capture_output=True, text=True,
                            check=True).stdout.strip()
    path = os.path.join(root if not os.path.isabs(common) else "", common, "info", "exclude")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    have = open(path).read().split("\n") if os.path.exists(path) else []
    with open(path, "a") as f:
        for pattern in patterns:
            if pattern not in have:
                f.write(("" if not have or have[-1] == "" else "\n") + pattern + "\n")
                have = [pattern, ""]
    return path


def travelling_bytes(root: str, carried: list[str]) -> int:
    """Bytes the device tool sends: tracked and untracked-not-ignored files, plus the carried folders."""
    listed = subprocess.run(["git", "-C", root, "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True,
                            check=True).stdout.split(b"\0")
    total = sum(os.path.getsize(os.path.join(root, p.decode())) for p in listed
                if p and os.path.isfile(os.path.join(root, p.decode())))
    for folder in carried:
        for base, _, files in os.walk(os.path.join(root, folder)):
            total += sum(os.path.getsize(os.path.join(base, f)) for f in files)
    return total


def prepare(args) -> int:
    """Fills ROOT/.whl (wheels) and ROOT/.carry (photos, corpus tool), ignores both, checks the
    size that travels, and prints the `run` calls to paste."""
    import importlib.metadata

    root = os.path.abspath(args.root)
    shared = os.path.abspath(args.shared or os.environ.get("PACKER_SHARED_DATA")
                             or os.path.join(os.path.dirname(root), "shared", "data"))
    photos = os.path.join(shared, "imagenet-sample")
    tool = os.path.join(os.path.dirname(shared), "tools", "make_corpus.py")
    for path, what in ((photos, "the ImageNet sample photos"), (tool, "make_corpus.py")):
        if not os.path.exists(path):
            print(f"prepare: {path} is missing ({what}); set PACKER_SHARED_DATA or --shared to the shared data "
                  f"folder (its tools/ beside it)", file=sys.stderr)
            return 2
    exclude = git_exclude(root, [f"/{WHEELS}/", f"/{CARRY}/"])
    carry = os.path.join(root, CARRY)
    shutil.rmtree(carry, ignore_errors=True)
    # The layout make_corpus.py expects: tools/make_corpus.py reads ../data/imagenet-sample.
    shutil.copytree(photos, os.path.join(carry, "data", "imagenet-sample"))
    for extra in ("imagenet-sample.sha256", "README.md", "webdataset-testdata"):
        src = os.path.join(shared, extra)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(carry, "data", extra))
        elif os.path.isfile(src):
            shutil.copy2(src, os.path.join(carry, "data", extra))
    os.makedirs(os.path.join(carry, "tools"))
    shutil.copy2(tool, os.path.join(carry, "tools", "make_corpus.py"))
    print(f"{carry}: photos from {photos}, make_corpus.py from {tool}")
    wheels = os.path.join(root, WHEELS)
    if not args.no_download:
        shutil.rmtree(wheels, ignore_errors=True)
        os.makedirs(wheels)
        got = {}
        for name in CARRIED_PACKAGES:
            version = importlib.metadata.version(name)
            got[normalise_name(name)] = download_wheel(name, version, wheels)
            print(f"  {os.path.basename(got[normalise_name(name)])}")
        missing = sorted({need for path in got.values() for need in wheel_requirements(path)}
                         - set(got) - MACHINE_HAS)
        if missing:
            print(f"prepare: the wheels require {', '.join(missing)}, which neither travel nor are known to be on "
                  f"the GPU machine: add them to CARRIED_PACKAGES", file=sys.stderr)
            return 1
    size = travelling_bytes(root, [WHEELS, CARRY])
    print(f"ignored through {exclude}: /{WHEELS}/ and /{CARRY}/")
    print(f"travelling: {size / 2**20:.1f} MiB of the {CARRY_LIMIT >> 20} MiB limit")
    if size > CARRY_LIMIT:
        print("prepare: over the limit: remove untracked files from the checkout", file=sys.stderr)
        return 1
    print("\nOn the GPU machine, two calls of the device tool `run` (each about 10 minutes):")
    for command in COMMANDS:
        assert len(command) <= 2000
        print(json.dumps({"command": command, "carry": [WHEELS, CARRY], "timeout_s": 600}))
    return 0


# ------------------------------------------------------------------ the command

def write_summary(run: Run, summary: dict) -> None:
    parts = [f"# GPU run {run.results['created']}", "", "`" + " ".join(run.results["command"]) + "`", ""]
    env = run.results["steps"].get("env", {}).get("cuda", {})
    parts += [f"Machine: {env.get('gpu', 'no GPU')}, {env.get('cpu_count')} CPUs, torch {env.get('torch')} "
              f"(CUDA {env.get('cuda_build')}), torchvision {env.get('torchvision')}.", ""]
    parts += ["| step | status | seconds | note |", "|---|---|---:|---|"]
    for name, s in run.results["steps"].items():
        note = s.get("error") or s.get("reason") or s.get("note") or ""
        parts.append(f"| {name} | {s.get('status')} | {s.get('seconds', '')} | {note} |")
    for name in ("feed", "nvjpeg", "handover", "scaling", "disk", "suite"):
        if name in summary:
            parts += ["", f"## {name}", "", summary[name]]
    with open(os.path.join(run.out, "summary.md"), "w") as f:
        f.write("\n".join(parts) + "\n")


def run_steps(args, argv: list[str]) -> int:
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available here; running on the CPU", file=sys.stderr)
        args.device = "cpu"
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    run = Run(os.path.abspath(args.out), args.time_budget, argv)
    run.results["device"] = args.device
    wanted = [s for s in STEPS if s in args.steps]
    if any(s in NEEDS_CORPUS for s in wanted) and "corpus" not in wanted:
        wanted.insert(wanted.index(next(s for s in wanted if s in NEEDS_CORPUS)), "corpus")
    ctx, summary = {}, {}
    scale = 0.2 if args.quick else 1.0
    for name in ["env"] + [s for s in wanted if s != "env"]:
        if name != "env" and run.left() < MARGIN_S + scale * MIN_SECONDS[name]:
            run.skip(name, f"{run.left():.0f} s left of --time-budget {args.time_budget:.0f}; the step needs "
                           f"about {scale * MIN_SECONDS[name]:.0f}")
            continue
        if name in NEEDS_CORPUS and "lmdb" not in ctx:
            run.skip(name, "no corpus (the corpus step failed or was skipped)")
            continue
        if name == "env":
            step_env(run, args)
        elif name == "tests":
            step_tests(run, args)
        elif name == "corpus":
            step_corpus(run, args, ctx)
        else:
            {"feed": step_feed, "nvjpeg": step_nvjpeg, "handover": step_handover, "disk": step_disk,
             "scaling": step_scaling, "suite": step_suite}[name](
                run, args, ctx, summary)
        write_summary(run, summary)
    run.results["seconds"] = round(time.monotonic() - run.started, 1)
    run.save()
    write_summary(run, summary)
    failed = [k for k, s in run.results["steps"].items() if s.get("status") == "error"]
    run.log(f"done in {run.results['seconds']} s; results in {run.out}" +
            (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    def csv(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [n for n in names if n not in STEPS]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEPS)}")
        return names

    p.add_argument("action", nargs="?", choices=("run", "prepare"), default="run",
                   help="run the steps (default), or prepare: fill .whl/ and .carry/ here for the GPU machine")
    p.add_argument("--out", help="the results folder (on the device machine: $OUT)")
    p.add_argument("--steps", type=csv, default=list(STEPS), help=f"comma-separated, from {','.join(STEPS)}")
    p.add_argument("--images", type=int, default=20000, help="corpus size (default: 20000)")
    p.add_argument("--quick", action="store_true", help="short runs everywhere: a check of the plumbing")
    p.add_argument("--time-budget", type=float, default=570.0,
                   help="seconds for the whole command (default: 570, inside a 10-minute limit)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--workers", type=int, help="loader workers (default: the usable cores)")
    p.add_argument("--batch", type=int, default=256, help="feed and nvJPEG batch size (default: 256)")
    p.add_argument("--feed-seconds", type=float, default=45.0, help="at most this long per feed case (45)")
    p.add_argument("--nvjpeg-images", type=int, default=4096, help="images decoded by the nvJPEG rates (4096)")
    p.add_argument("--nvjpeg-chunks", type=lambda v: [int(c) for c in v.split(",")], default=[0, 64],
                   help="GPUDecoder chunk sizes to measure, 0 = the whole batch in one decode (default: 0,64)")
    p.add_argument("--suite", choices=("auto", *SUITE_PRESETS), default="auto",
                   help="the suite's size; auto: the largest that fits the time left")
    p.add_argument("--tests", nargs="+", default=CUDA_TESTS, help="pytest arguments for the tests step")
    p.add_argument("--tests-timeout", type=float, default=240.0)
    p.add_argument("--workdir", default="/var/tmp/packer-gpu", help="corpus, packs and suite data (kept)")
    p.add_argument("--corpus", help="an ImageFolder tree to use instead of making one")
    p.add_argument("--corpus-tool", help="make_corpus.py (default: .carry/tools/make_corpus.py)")
    p.add_argument("--synthetic", action="store_true", help="make the corpus with packer.synth, not from photos")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared", help="prepare: the shared data folder (default: $PACKER_SHARED_DATA, ../shared/data)")
    p.add_argument("--root", default=ROOT, help="prepare: the checkout to fill (default: this one)")
    p.add_argument("--no-download", action="store_true", help="prepare: skip the wheels (no network)")


def main(args, argv: list[str]) -> int:
    if args.action == "prepare":
        return prepare(args)
    if not args.out:
        print("python -m benchmarks gpu: --out DIR is required", file=sys.stderr)
        return 2
    if args.images < 2 or args.time_budget <= 0 or args.batch < 1:
        print("--images must be >= 2, --time-budget > 0, --batch >= 1", file=sys.stderr)
        return 2
    return run_steps(args, argv)
