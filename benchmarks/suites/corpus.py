"""The corpus a GPU run measures: ImageNet-like JPEGs made from the shared photos, packed to LMDB.

    python benchmarks/suites/corpus.py --workdir DIR [--images 20000] [--seed 0]
                                       [--corpus-tool make_corpus.py | --synthetic | --corpus TREE]

make_corpus.py (given, carried in .carry/tools/, or the shared one beside
$PACKER_SHARED_DATA) makes --images JPEGs from the photos it finds; without it,
packer.synth's synthetic images stand in, and the record says so. A stamp beside the
folder (corpus-N.json) lets a later command on the same machine reuse the corpus and
its pack. Prints the record (folder, LMDB, how it was made) as JSON; the GPU studies
(gpu_decode.py, scaling.py, feed.py --lmdb) take its folder and LMDB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.run import corpus_shape  # noqa: E402
from packer import scan_source  # noqa: E402
from packer.pack import pack  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[2])
CARRIED_TOOL = os.path.join(".carry", "tools", "make_corpus.py")  # where benchmarks.transfer puts it


def run_quietly(cmd: list[str], timeout: float, env: dict | None = None) -> int:
    """The default `stream`: runs cmd, stopped after `timeout` seconds (exit code -9)."""
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, timeout=max(1.0, timeout)).returncode
    except subprocess.TimeoutExpired:
        return -9


def corpus_tool(given: str | None = None, root: str = ROOT) -> str | None:
    """make_corpus.py: `given`, the carried copy, or the shared one beside the checkout."""
    shared = os.environ.get("PACKER_SHARED_DATA")
    for path in (given, os.path.join(root, CARRIED_TOOL),
                 shared and os.path.join(os.path.dirname(os.path.abspath(shared)), "tools", "make_corpus.py")):
        if path and os.path.isfile(path):
            return path
    return None


def make_photo_corpus(tool: str, folder: str, n: int, seed: int, timeout: float, stream=run_quietly,
                      env: dict | None = None) -> dict:
    """Runs make_corpus.py into folder; returns its stats, the sources by path."""
    classes, per_class = corpus_shape(n)
    tmp = folder + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, tool, "--out", tmp, "--classes", str(classes), "--per-class", str(per_class),
           "--seed", str(seed), "--workers", str(os.cpu_count() or 1)]
    code = stream(cmd, timeout, env=env)
    if code != 0:
        raise RuntimeError(f"{os.path.basename(tool)} exited {code}")
    stats_path = os.path.join(tmp, "corpus_stats.json")
    with open(stats_path) as f:
        stats = json.load(f)
    # Kept out of the ImageFolder tree (the suite would scan it), beside it instead.
    shutil.move(stats_path, folder + ".stats.json")
    os.replace(tmp, folder)
    return {k: v for k, v in stats.items() if k != "sources"} | {"sources": [s["path"] for s in stats["sources"]]}


def make_folder(entry: dict, folder: str, images: int, seed: int, tool: str | None, synthetic: bool,
                timeout: float, stream, env) -> None:
    """A fresh corpus in folder, by the tool or packer.synth, recorded in entry."""
    from packer.synth import make_corpus

    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.monotonic()
    if tool:
        entry["stats"] = make_photo_corpus(tool, folder, images, seed, timeout, stream, env)
        entry["made_by"] = f"{tool} from the photos it found (see stats.sources)"
    else:
        classes, per_class = corpus_shape(images)
        make_corpus(folder, classes=classes, per_class=per_class, seed=seed, workers=os.cpu_count() or 1)
        entry["made_by"] = "packer.synth (synthetic images)"
        if not synthetic:
            entry["note"] = ("make_corpus.py was not found (.carry/tools/ or --corpus-tool): the corpus is "
                             "synthetic, not made from the shared photos as issue 20 asks")
    entry["make_seconds"] = round(time.monotonic() - t0, 1)


def prepare(entry: dict, workdir: str, images: int, seed: int = 0, given: str | None = None,
            tool: str | None = None, synthetic: bool = False, timeout: float = 3600.0, stream=run_quietly,
            env: dict | None = None) -> tuple[str, str]:
    """Makes (or reuses) the corpus and its LMDB pack, recording how in entry. Returns (folder, lmdb)."""
    folder = given or os.path.join(workdir, f"corpus-{images}")
    stamp = folder + ".json"
    tool = None if given or synthetic else corpus_tool(tool)
    want = {"images": images, "seed": seed, "tool": os.path.basename(tool) if tool else "packer.synth"}
    if given:
        entry["made_by"] = f"given: {folder}"
    elif os.path.isdir(folder) and os.path.exists(stamp) and json.load(open(stamp)) == want:
        entry["made_by"] = f"reused ({want['tool']}, made by an earlier command on this machine)"
    else:
        make_folder(entry, folder, images, seed, tool, synthetic, timeout, stream, env)
        with open(stamp, "w") as f:
            json.dump(want, f)
    entry["folder"], entry["images"] = folder, scan_source(folder).count
    lmdb = os.path.join(workdir, "given.lmdb" if given else f"corpus-{images}.lmdb")
    if not (os.path.exists(lmdb) and entry["made_by"].startswith("reused")):
        shutil.rmtree(lmdb, ignore_errors=True)
        t0 = time.monotonic()
        pack(folder, "lmdb", lmdb, workers=os.cpu_count() or 1, progress=False, force=True)
        entry["pack_seconds"] = round(time.monotonic() - t0, 1)
    entry["lmdb"] = lmdb
    return folder, lmdb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--workdir", required=True, help="where the corpus and its LMDB go (kept, reused)")
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--corpus-tool", help="make_corpus.py (default: .carry/tools/, else the shared one)")
    how.add_argument("--synthetic", action="store_true", help="packer.synth's images, not the photos")
    how.add_argument("--corpus", help="an ImageFolder tree to pack instead of making one")
    args = p.parse_args(argv)
    if args.images < 2:
        p.error("--images must be >= 2")
    os.makedirs(args.workdir, exist_ok=True)
    entry: dict = {}
    prepare(entry, os.path.abspath(args.workdir), args.images, args.seed, args.corpus, args.corpus_tool,
            args.synthetic)
    print(json.dumps(entry, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
