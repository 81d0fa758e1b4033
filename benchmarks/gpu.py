"""`python -m benchmarks gpu`: the GPU proof (issue 20) in one or two short commands, every
result written into one flat folder as it is obtained.

    python -m benchmarks gpu prepare                  # here, with network: benchmarks/transfer.py
    python -m benchmarks gpu --out DIR [--steps tests,nvjpeg,handover] [--images N] [--quick]

Each step runs a suite of benchmarks/suites/ (each also runs alone, with --help), in this
order (`--steps` picks some; `corpus` runs whenever a later step needs it):
  env      what the machine has: torch, CUDA, the GPU, packer's dependencies (benchmarks.machine)
  tests    cuda_tests.py: the CUDA tests (pytest, a junit report)
  corpus   corpus.py: --images ImageNet-like JPEGs made from the carried photos by
           make_corpus.py, packed to LMDB; without the tool, packer.synth's, and it says so
  feed     feed.py on that LMDB: ResNet-50, channels_last, bf16, batch 256, make_loader vs
           torch's DataLoader defaults (and + workers), GPU utilisation by NVML
  nvjpeg   gpu_decode.py: decode + crop + resize through gpu_decode against bare batched
           torchvision.io.decode_jpeg(device="cuda") on the same bytes and the CPU workers
  handover pin_handover.py --pin: the training thread's GIL stalls while torch's pin thread
           frees each batch, with the batch's shared memory given back first and without
  disk     disk_depth.py: the disk's cold random reads by reads in flight
  pack     pack_profile.py: pack LMDB and WDS on every core against `tar cf`, cold, with the
           CPU each process used and a cProfile of the packing process (pack-profile.txt)
  suite    `python -m benchmarks run --device cuda` on the corpus, sized to the time left
  threads  thread_workers.py: 16 threads (in one background process, and in the trainer)
           against 16 worker processes, decode + RandomResizedCrop(224)
  scaling  scaling.py: e2e warm (no step) with 1, 2, 4, 8, 16 workers over workers x the
           per-core decode + crop rate, and against as many lone processes at once

This module is the orchestration: each step is timed, logged and recorded whatever happens
to it: a failed step records its error and the next one runs. `--time-budget` (seconds for
the whole command) skips a step that cannot fit and bounds the ones that run, so a command
ends inside the time a machine is lent for; results are rewritten after every step, so a
command killed early still leaves them.

Files in --out (flat, at most 8): gpu-results.json (everything), gpu.log, summary.md (the
tables), tests.xml, nvjpeg-profile.txt (torch.profiler's tables of the GPU decoder),
pack-profile.txt, suite.json, suite.md and suite.png.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import threading
import time
import traceback

from . import machine, transfer
from .suites import cuda_tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The suite and threads before scaling: a study stopped by the time limit loses its whole JSON,
# while scaling saves each row as it goes, so it takes what is left.
STEPS = ("env", "tests", "corpus", "feed", "nvjpeg", "handover", "disk", "pack", "suite", "threads", "scaling")
NEEDS_CORPUS = ("feed", "nvjpeg", "disk", "pack", "scaling", "suite", "threads")
# About how long each step needs at least, in seconds, on the GPU machine (--quick: a fifth).
MIN_SECONDS = {"env": 5, "tests": 60, "corpus": 60, "feed": 90, "nvjpeg": 45, "handover": 60, "disk": 40,
               "pack": 40, "scaling": 90, "suite": 120, "threads": 60}
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

    def note(self, message: str) -> None:
        """What a suite calls after each result: saved, so a command stopped later keeps it, and logged."""
        self.save()
        self.log(message)

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
    env.setdefault("PACKER_SHARED_DATA", os.path.join(ROOT, transfer.CARRY, "data"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ------------------------------------------------------------------ the steps: each runs a suite

def step_env(run: Run, args) -> None:
    with run.step("env") as entry:
        entry["packages"] = machine.packages()
        entry["cuda"] = machine.describe_cuda()
        entry["device"] = args.device
        missing = [k for k in ("lmdb", "simplejpeg", "deflate", "h5py", "PIL", "numpy") if not entry["packages"][k]]
        if missing:
            entry["status"] = "error"
            entry["error"] = (f"packer's dependencies missing: {', '.join(missing)}: install the carried wheels "
                              f"first (python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl "
                              f"and PYTHONPATH=/tmp/site)")
        run.log(json.dumps({"cuda": entry["cuda"], "packages": entry["packages"]}))


def step_tests(run: Run, args) -> None:
    with run.step("tests") as entry:
        xml = os.path.join(run.out, "tests.xml")
        cmd = cuda_tests.pytest_command(args.tests, xml, ROOT)
        code = run.stream(cmd, min(args.tests_timeout, run.left() - MARGIN_S))
        entry.update(command=cmd[1:], exit_code=code)
        if os.path.exists(xml):
            entry.update(cuda_tests.junit_counts(xml))
        if code != 0:
            entry["status"] = "error"
            entry["error"] = "pytest was stopped by the time budget" if code == -9 else f"pytest exited {code}"
        import torch

        if not torch.cuda.is_available():
            entry["note"] = "no CUDA: the CUDA tests skipped (their reasons are in skip_reasons)"


def step_corpus(run: Run, args, ctx: dict) -> None:
    """Makes (or reuses) the corpus and its LMDB pack; fills ctx["folder"] and ctx["lmdb"]."""
    with run.step("corpus") as entry:
        from .suites import corpus

        folder, lmdb = corpus.prepare(entry, args.workdir, args.images, args.seed, args.corpus, args.corpus_tool,
                                      args.synthetic, run.left() - MARGIN_S, run.stream, child_env())
        ctx.update(folder=folder, lmdb=lmdb)
        run.log(f"corpus: {entry['images']} images in {folder} ({entry['made_by']}); LMDB {lmdb}")


def step_feed(run: Run, args, ctx: dict, summary: dict) -> None:
    with run.step("feed") as entry:
        import torch

        from .suites import feed

        device = torch.device(args.device)
        quick = args.quick or device.type == "cpu"
        batch = min(args.batch, 8) if device.type == "cpu" else args.batch
        steps, warmup = (8, 2) if quick else (60, 10)
        per_case = max(10.0, min(args.feed_seconds, (run.left() - MARGIN_S - 20) / len(args.feed_cases)))
        entry["config"] = {"batch": batch, "steps": steps, "warmup": warmup, "max_seconds_per_case": per_case,
                           "model": args.feed_model, "size": args.feed_size}

        def partial(out):
            entry.update(out)
            run.save()
            last = out["results"][-1]
            run.log(f"feed {last['case']}: " + json.dumps({k: v for k, v in last.items() if k != "case"}))

        feed.feed_check(ctx["lmdb"], device, batch, steps, warmup, workers=args.workers,
                        max_seconds=per_case, on_result=partial, model_name=args.feed_model,
                        size=args.feed_size, cases=args.feed_cases)
        summary["feed"] = feed.table(entry["results"])
        if device.type == "cpu":
            entry["note"] = "CPU smoke run with a small model: the plumbing, not the claim"
        if any("error" in r for r in entry["results"]):
            entry["status"] = "error"
            entry["error"] = "; ".join(f"{r['case']}: {r['error']}" for r in entry["results"] if "error" in r)


def step_nvjpeg(run: Run, args, ctx: dict, summary: dict) -> None:
    if not args.device.startswith("cuda"):
        run.skip("nvjpeg", "no CUDA")
        return
    with run.step("nvjpeg") as entry:
        from .suites import gpu_decode

        rates_to_take = 5 + 2 * len(args.nvjpeg_chunks)  # bare, crop x2, CPU workers, hybrid; two per chunk size
        per_rate = (run.left() - MARGIN_S - 30) / rates_to_take
        seconds = 3.0 if args.quick else max(3.0, min(args.nvjpeg_seconds, per_rate))
        gpu_decode.measure(entry, ctx["lmdb"], args.device, args.batch, args.nvjpeg_images, args.nvjpeg_chunks,
                           seconds, args.workers, os.path.join(run.out, "nvjpeg-profile.txt"), run.note)
        summary["nvjpeg"] = gpu_decode.table(entry)
        if gpu_decode.errors(entry):
            entry["status"], entry["error"] = "error", gpu_decode.errors(entry)


def step_scaling(run: Run, args, ctx: dict, summary: dict) -> None:
    with run.step("scaling") as entry:
        from .suites import scaling

        scaling.measure(entry, ctx["folder"], ctx["lmdb"], args.device, os.path.join(args.workdir, "scaling"),
                        quick=args.quick, seed=args.seed, seconds_left=lambda: run.left() - MARGIN_S,
                        note=run.note)
        summary["scaling"] = scaling.table(entry)


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


def step_pack(run: Run, args, ctx: dict, summary: dict) -> None:
    """Pack on every core against tar cf, cold, and where the pack's time goes (benchmarks/suites/pack_profile.py)."""
    study_step(run, args, summary, "pack", "pack_profile.py", [
        ctx["folder"], "--workdir", os.path.join(args.workdir, "pack"), "--repeats", "1",
        "--profile", os.path.join(run.out, "pack-profile.txt")])


def step_threads(run: Run, args, ctx: dict, summary: dict) -> None:
    """16 thread workers against 16 worker processes (benchmarks/suites/thread_workers.py)."""
    study_step(run, args, summary, "threads", "thread_workers.py", [
        ctx["lmdb"], "--workers", "16", "--batch", "16" if args.quick else "256",
        "--batches", "8" if args.quick else "30", "--repeats", "1" if args.quick else "3"])


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
    for name in STEPS:
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
             "pack": step_pack, "scaling": step_scaling, "suite": step_suite, "threads": step_threads}[name](
                run, args, ctx, summary)
        write_summary(run, summary)
    run.results["seconds"] = round(time.monotonic() - run.started, 1)
    run.save()
    write_summary(run, summary)
    failed = [k for k, s in run.results["steps"].items() if s.get("status") == "error"]
    run.log(f"done in {run.results['seconds']} s; results in {run.out}" +
            (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


DESCRIPTION = """\
Measure packer on the GPU machine it runs on and write every result into one folder
(--out) as it is obtained: what the machine has, the CUDA tests, a ResNet-50 fed by
make_loader against torch's DataLoader defaults, GPU JPEG decoding against the CPU
workers, the pinned hand-over, the disk's random reads, packing, the benchmark suite and
the read rate by worker count. --steps picks steps, --time-budget bounds the whole
command (a step that cannot fit is skipped), and a failed step is recorded while the next
one runs. `gpu prepare`, on a machine with network, gathers into this checkout the
wheels, photos and corpus tool that a GPU machine without network needs.

steps: """ + ", ".join(STEPS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    def csv(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [n for n in names if n not in STEPS]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEPS)}")
        return names

    p.add_argument("action", nargs="?", choices=("run", "prepare"), default="run",
                   help="run the steps (default), or prepare: gather here, from a machine with network, the "
                        "wheels, photos and corpus tool that a GPU machine without network needs")
    p.add_argument("--out", help="the folder the results are written into, step by step (required to run)")
    p.add_argument("--steps", type=csv, default=list(STEPS),
                   help=f"the steps to run, comma-separated (default: all): {', '.join(STEPS)}")
    p.add_argument("--images", type=int, default=20000, help="corpus size (default: 20000)")
    p.add_argument("--quick", action="store_true", help="short runs everywhere: a check of the plumbing")
    p.add_argument("--time-budget", type=float, default=570.0,
                   help="seconds for the whole command: steps that cannot fit are skipped (default: 570)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--workers", type=int, help="loader workers (default: the usable cores)")
    p.add_argument("--batch", type=int, default=256, help="feed and nvJPEG batch size (default: 256)")
    p.add_argument("--feed-seconds", type=float, default=45.0, help="at most this long per feed case (45)")
    p.add_argument("--feed-model", choices=("resnet50", "resnet18"), default="resnet50",
                   help="the feed's model (resnet18: the frontier's faster step)")
    p.add_argument("--feed-size", type=int, default=224, help="the feed's crop side (160: ResNet-50's faster step)")
    p.add_argument("--feed-cases", type=lambda v: [c for c in v.split(",") if c],
                   default=["defaults", "defaults+workers", "make_loader"],
                   help="the feed's loaders: defaults, defaults+workers, make_loader, make_loader_gpu_decode, "
                        "make_loader_hybrid (default: the first three)")
    p.add_argument("--nvjpeg-seconds", type=float, default=10.0, help="at most this long per nvJPEG rate (10)")
    p.add_argument("--nvjpeg-images", type=int, default=4096, help="images decoded by the nvJPEG rates (4096)")
    p.add_argument("--nvjpeg-chunks", type=lambda v: [int(c) for c in v.split(",")], default=[0, 64],
                   help="GPUDecoder chunk sizes to measure, 0 = the whole batch in one decode (default: 0,64)")
    p.add_argument("--suite", choices=("auto", *SUITE_PRESETS), default="auto",
                   help="the suite's size; auto: the largest that fits the time left")
    p.add_argument("--tests", nargs="+", default=cuda_tests.CUDA_TESTS,
                   help="pytest arguments for the tests step (default: suites/cuda_tests.py's list)")
    p.add_argument("--tests-timeout", type=float, default=240.0,
                   help="seconds the tests step may take (default: 240)")
    p.add_argument("--workdir", default="/var/tmp/packer-gpu", help="corpus, packs and suite data (kept)")
    p.add_argument("--corpus", help="an ImageFolder tree to use instead of making one")
    p.add_argument("--corpus-tool", help="the make_corpus.py that makes the corpus from photos (default: the "
                                         "one prepare gathered; without it, packer.synth's corpus)")
    p.add_argument("--synthetic", action="store_true", help="make the corpus with packer.synth, not from photos")
    p.add_argument("--seed", type=int, default=0, help="the corpus's and the runs' seed (default: 0)")
    p.add_argument("--shared", help="prepare: the shared data folder (default: $PACKER_SHARED_DATA, ../shared/data)")
    p.add_argument("--root", default=ROOT, help="prepare: the checkout to fill (default: this one)")
    p.add_argument("--no-download", action="store_true", help="prepare: skip the wheels (no network)")


def main(args, argv: list[str]) -> int:
    if args.action == "prepare":
        return transfer.prepare(args.root, args.shared, download=not args.no_download)
    if not args.out:
        print("python -m benchmarks gpu: --out DIR is required", file=sys.stderr)
        return 2
    if args.images < 2 or args.time_budget <= 0 or args.batch < 1:
        print("--images must be >= 2, --time-budget > 0, --batch >= 1", file=sys.stderr)
        return 2
    from .suites import feed

    unknown = sorted(set(args.feed_cases) - set(feed.CASES) - set(feed.GPU_CASES))
    if unknown or not args.feed_cases:
        print(f"--feed-cases: unknown {', '.join(unknown) or '(none given)'}; cases: "
              f"{', '.join(feed.CASES + tuple(feed.GPU_CASES))}", file=sys.stderr)
        return 2
    return run_steps(args, argv)
