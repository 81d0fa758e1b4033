"""Hand-edited and damaged metadata, fuzzed: packer must work or raise its own errors.

A small real dataset is packed in every format; its metadata (LMDB's __meta__ value,
HDF5's packer_metadata attribute, WDS's index.json) is then replaced by thousands of
mutants: JSON-level edits (keys deleted, wrong types, huge, negative and float numbers,
deep nesting, unsafe names, unicode), each with its crc32 left stale, recomputed (as an
attacker would) or dropped, and byte-level damage of the serialised text. For each one,
`info`, `verify`, opening every split's reader and reading a record, and `convert` must
succeed or raise a PackError, write nothing outside their output, and leave no handle
open. The loop runs in a child process, so a crash (a signal) or a hang (a per-case
watchdog) fails the test instead of killing pytest.

PACKER_FUZZ_CASES=N sets the cases per format (default 100); PACKER_FUZZ_SEED the seed.
Run it directly for a report: python tests/test_fuzz_metadata.py [cases] [seed].
"""
from __future__ import annotations

import faulthandler
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

import h5py
import lmdb
import numpy as np

HERE = Path(__file__).resolve().parent
CASE_SECONDS = 60  # the watchdog: far above a normal case (a fraction of a second)
META_KEY = b"__meta__"
META_ATTR = "packer_metadata"
CONTAINER_KEYS = {"lmdb": (), "hdf5": (), "wds": ("wds",)}
EXTENSIONS = {"lmdb": ".lmdb", "hdf5": ".h5", "wds": ".wds"}


# ---- reading and writing a real dataset's metadata, the way a hand edit would -------------

def documented_crc(obj: dict, container_keys=()) -> int:
    """The metadata checksum by the recipe in packer/records.py's docstring, written out
    independently of packer's own code."""
    rest = {k: v for k, v in obj.items() if k != "crc32" and k not in container_keys}
    text = json.dumps(rest, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return zlib.crc32(text.encode("utf-8", "surrogateescape")) & 0xFFFFFFFF


def read_raw(fmt: str, path: str) -> bytes:
    if fmt == "lmdb":
        env = lmdb.open(path, readonly=True, lock=False, subdir=True)
        try:
            with env.begin() as txn:
                return bytes(txn.get(META_KEY))
        finally:
            env.close()
    if fmt == "hdf5":
        with h5py.File(path, "r") as f:
            raw = f.attrs[META_ATTR]
        return raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else bytes(raw)
    return Path(path, "index.json").read_bytes()


def write_raw(fmt: str, path: str, raw, kind: str = "text") -> None:
    """Store raw as the dataset's metadata. kind (HDF5 only): "text" (a UTF-8 string, as
    packer writes it), "fixed" (fixed-length bytes) or "number" (not text at all)."""
    if fmt == "lmdb":
        env = lmdb.open(path, subdir=True, lock=False, map_size=os.path.getsize(Path(path, "data.mdb"))
                        + len(raw) + (64 << 20))
        try:
            with env.begin(write=True) as txn:
                txn.put(META_KEY, raw)
        finally:
            env.close()
    elif fmt == "hdf5":
        with h5py.File(path, "r+") as f:
            if kind == "number":
                f.attrs[META_ATTR] = np.arange(3)
            elif kind == "fixed" or b"\0" in raw:  # variable-length strings cannot hold NUL
                f.attrs[META_ATTR] = np.bytes_(raw)
            else:
                f.attrs.create(META_ATTR, raw, dtype=h5py.string_dtype("utf-8"))
    else:
        Path(path, "index.json").write_bytes(raw)


def rewrite_metadata(fmt: str, path, edit) -> None:
    """Apply edit(obj) to the parsed metadata and store it back, with its crc32 recomputed
    when it has one (so the edit, not the checksum, is what a reader must catch)."""
    obj = json.loads(read_raw(fmt, str(path)).decode("utf-8", "surrogateescape"))
    edit(obj)
    if "crc32" in obj:
        obj["crc32"] = documented_crc(obj, CONTAINER_KEYS[fmt])
    write_raw(fmt, str(path), json.dumps(obj, ensure_ascii=False, indent=1).encode("utf-8", "surrogateescape"))


def restamp_table_crc(fmt: str, path, split: str, table: str, raw: bytes) -> None:
    """Store raw's CRC-32 as table's checksum where the pack keeps table checksums, as an
    attacker editing that table would (so the edit, not the checksum, is what is caught)."""
    crc = zlib.crc32(raw) & 0xFFFFFFFF
    if fmt == "lmdb":
        env = lmdb.open(str(path), subdir=True, lock=False,
                        map_size=os.path.getsize(Path(path, "data.mdb")) + (64 << 20))
        with env.begin(write=True) as txn:
            stored = txn.get(f"{split}/checksums".encode())
            if stored is not None:
                crcs = json.loads(stored)
                crcs[table] = crc
                txn.put(f"{split}/checksums".encode(), json.dumps(crcs, sort_keys=True, separators=(",", ":")).encode())
        env.close()
    elif fmt == "hdf5":
        with h5py.File(path, "r+") as f:
            stored = f[split].attrs.get("checksums")
            if stored is not None:
                crcs = json.loads(stored)
                crcs[table] = crc
                f[split].attrs["checksums"] = json.dumps(crcs, sort_keys=True, separators=(",", ":"))
    else:
        def restamp(obj):
            entry = obj["wds"]["splits"][split]
            if f"{table}_crc32" in entry:
                entry[f"{table}_crc32"] = crc
        rewrite_metadata(fmt, path, restamp)


# ---- the dataset -----------------------------------------------------------------------------

def tiny_jpeg(seed: int) -> bytes:
    import io

    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG")
    return buf.getvalue()


def build_source(root: Path) -> Path:
    """train (3 classes) and val (2 of them), labeled; test, unlabeled; one bad file, skipped."""
    seed = 0
    for split, classes in (("train", "abc"), ("val", "ac")):
        for cls in classes:
            for i in range(2):
                seed += 1
                target = root / split / f"class {cls}" / f"{cls}{i}.jpg"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tiny_jpeg(seed))
    (root / "train" / "class a" / "broken.jpg").write_bytes(b"not a jpeg")
    (root / "test").mkdir()
    for i in range(2):
        (root / "test" / f"t{i}.jpg").write_bytes(tiny_jpeg(100 + i))
    return root


def pack_all(src: Path, folder: Path) -> dict[str, Path]:
    from packer import pack
    packed = {}
    for fmt, ext in EXTENSIONS.items():
        packed[fmt] = folder / f"pristine{ext}"
        # crc32 records: metadata without a "checksum" key, as every packer wrote it before kinds,
        # so the cases of older metadata (no "crc32" key) hold (test_checksum covers "checksum").
        pack(str(src), fmt, str(packed[fmt]), workers=1, progress=False, on_error="skip", checksum="crc32")
    return packed


# ---- mutants ----------------------------------------------------------------------------------

NASTY_VALUES = [None, True, False, 0, -1, -5, 1, 2**31, 2**63, 10**30, -(10**30), 1.5, 0.0, float("nan"),
                float("inf"), "", "x", "lmdb", "../../escape", "/x", ".", "..", ".hidden", "a/b", "a\\b", "\0",
                "a\0b", "\n", "名前", "\udcff", "\ud800", "x" * 300, [], {}, [1, 2, 3], [-1], ["a", "a"],
                {"a": 1}, {"path": 1, "reason": None}, [[[[[[]]]]]]]
NASTY_NAMES = ["../../escape", "/x", "/tmp", ".", "..", "", ".hidden", "a/b", "a\\b", "\0", "x\ny", "名前",
               "\udcff", "x" * 300, "train", "val", "test", "all", "wds", "crc32", "crc33"]


def deep(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def nodes(value, path=()):
    """Every (path, value) in a JSON tree."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from nodes(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from nodes(v, path + (i,))


def parent_of(obj, path):
    for step in path[:-1]:
        obj = obj[step]
    return obj


def mutate_tree(obj, rng: random.Random) -> str:
    """Edit obj in place; returns a description of the edit."""
    candidates = [(p, v) for p, v in nodes(obj) if p]
    if not candidates:
        return "nothing to edit"
    path, value = rng.choice(candidates)
    parent, last = parent_of(obj, path), path[-1]
    op = rng.choice(["delete", "replace", "replace", "rename", "append", "deepen", "swap", "number"])
    if op == "delete":
        del parent[last]
    elif op == "replace":
        parent[last] = rng.choice(NASTY_VALUES + [deep(rng.choice([20, 99, 100, 101, 300]))])
    elif op == "rename" and isinstance(parent, dict):
        new = rng.choice(NASTY_NAMES)
        parent[new] = parent.pop(last)
        return f"rename {path} -> {new!r}"
    elif op == "append" and isinstance(value, (list, dict)):
        if isinstance(value, list):
            value.append(rng.choice(NASTY_VALUES) if not value or rng.random() < 0.5 else value[0])
        else:
            value[rng.choice(NASTY_NAMES)] = rng.choice(NASTY_VALUES)
    elif op == "deepen":
        parent[last] = [value]
    elif op == "swap":
        other_path, other = rng.choice(candidates)
        if other_path[:len(path)] != path and path[:len(other_path)] != other_path:
            parent[last], parent_of(obj, other_path)[other_path[-1]] = other, value
    elif op == "number" and type(value) is int:
        parent[last] = value + rng.choice([-1, 1, -value - 1, 2**31, 2**32])
    else:
        parent[last] = rng.choice(NASTY_VALUES)
    return f"{op} {path}"


def serialise(obj, rng: random.Random) -> bytes:
    indent = rng.choice([None, 1])
    try:
        text = json.dumps(obj, ensure_ascii=rng.random() < 0.3, indent=indent)
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that only a \u escape can hold
        return json.dumps(obj, indent=indent).encode()


def damage_bytes(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    data = bytearray(raw)
    op = rng.choice(["flip", "flip", "truncate", "insert", "nest", "number", "delete"])
    at = rng.randrange(len(data) + 1)
    if op == "flip":
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif op == "truncate":
        del data[at:]
    elif op == "insert":
        data[at:at] = rng.randbytes(rng.randint(1, 8))
    elif op == "nest":
        data[at:at] = b"[" * rng.choice([1000, 200_000])
    elif op == "number":
        digits = [i for i, b in enumerate(data) if 48 <= b <= 57]
        if digits:
            i = rng.choice(digits)
            data[i:i + 1] = rng.choice([b"1e400", b"-5", b"9" * 5000, b"1.5", b"NaN", b"-0"])
    else:
        del data[at:at + rng.randint(1, 20)]
    return bytes(data), f"bytes {op} at {at}"


def mutant(fmt: str, pristine: bytes, rng: random.Random) -> tuple[bytes, str, str]:
    """(metadata bytes, description, HDF5 storage kind)."""
    kind = "text"
    if fmt == "hdf5":
        kind = rng.choices(["text", "fixed", "number"], [0.8, 0.15, 0.05])[0]
    if rng.random() < 0.25:
        raw, what = damage_bytes(pristine, rng)
        return raw, what, kind
    obj = json.loads(pristine.decode("utf-8", "surrogateescape"))
    what = "; ".join(mutate_tree(obj, rng) for _ in range(rng.choice([1, 1, 1, 2, 3])))
    crc = rng.choice(["stale", "recomputed", "recomputed", "dropped"])
    if isinstance(obj, dict) and crc != "stale":
        obj.pop("crc32", None)
        if crc == "recomputed":
            try:
                obj["crc32"] = documented_crc(obj, CONTAINER_KEYS[fmt])
            except (UnicodeEncodeError, RecursionError):
                pass
    return serialise(obj, rng), f"{what} (crc {crc})", kind


# ---- one case ---------------------------------------------------------------------------------

def listing(root: Path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root) for f in dirs + files}


def exercise(fmt: str, path: str, out: str) -> list[str]:
    """Run every operation on the dataset at path; returns what each did ("ok" or the
    PackError class). Anything else propagates."""
    from packer.convert import convert
    from packer.errors import PackError
    from packer.formats import open_reader, read_metadata
    from packer.verify import info, verify

    outcomes = []

    def attempt(name, fn):
        try:
            fn()
            outcomes.append(f"{name}:ok")
        except PackError as exc:
            outcomes.append(f"{name}:{type(exc).__name__}")

    def read_every_split():
        meta = read_metadata(path)
        for split in meta.splits:
            reader = open_reader(path, split)
            try:
                reader.paths, reader.labels
                if len(reader):
                    reader.read(0)
                    reader.read(len(reader) - 1)
            finally:
                reader.close()

    attempt("info", lambda: info(path))
    attempt("verify", lambda: verify(path, workers=1))
    attempt("read", read_every_split)
    target = {"lmdb": "wds", "hdf5": "wds", "wds": "lmdb"}[fmt]
    attempt("convert", lambda: convert(path, target, out, workers=1, progress=False))
    return outcomes


def run_case(fmt: str, pristine: Path, work: Path, raw: bytes, kind: str) -> list[str]:
    from packer.formats import _handle

    dataset = work / "case" / "d" / f"data{EXTENSIONS[fmt]}"
    out = work / "case" / "d" / "out" / f"converted{EXTENSIONS[{'wds': 'lmdb'}.get(fmt, 'wds')]}"
    shutil.rmtree(work / "case", ignore_errors=True)
    dataset.parent.mkdir(parents=True)
    out.parent.mkdir()  # convert writes into an existing folder
    (shutil.copytree if pristine.is_dir() else shutil.copyfile)(pristine, dataset)
    write_raw(fmt, str(dataset), raw, kind)
    before = listing(work)
    outcomes = exercise(fmt, str(dataset), str(out))
    stray = sorted(p for p in listing(work) - before if not p.startswith(os.path.join("case", "d", "out")))
    if stray:
        raise AssertionError(f"files written outside the output: {stray[:5]}")
    if _handle._shared:
        leaked = list(_handle._shared)
        _handle._shared.clear()
        raise AssertionError(f"handles left open: {leaked}")
    return outcomes


def fuzz(cases: int, seed: int) -> dict:
    faulthandler.enable()
    work = Path(tempfile.mkdtemp(prefix="packer-fuzz-"))
    try:
        packed = pack_all(build_source(work / "src"), work)
        summary = {"cases_per_format": cases, "seed": seed, "formats": {}, "failures": []}
        for fmt, pristine_path in packed.items():
            rng = random.Random(f"{seed}-{fmt}")
            pristine = read_raw(fmt, str(pristine_path))
            counts: dict[str, int] = {}
            slowest = 0.0
            for case in range(cases):
                raw, what, kind = mutant(fmt, pristine, rng)
                faulthandler.dump_traceback_later(CASE_SECONDS, exit=True)
                start = time.perf_counter()
                try:
                    outcomes = run_case(fmt, pristine_path, work, raw, kind)
                    label = "accepted" if all(o.endswith(":ok") for o in outcomes) else (
                        "refused" if not any(o.endswith(":ok") for o in outcomes) else "partly refused")
                    counts[label] = counts.get(label, 0) + 1
                except Exception as exc:  # noqa: BLE001 - anything not a PackError is the finding
                    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/packer/" in f.filename]
                    where = f"{frames[-1].filename.split('/packer/')[-1]}:{frames[-1].lineno}" if frames else "?"
                    summary["failures"].append({"format": fmt, "case": case, "mutant": what, "kind": kind,
                                                "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                                                "where": where, "raw_head": raw[:200].decode("latin-1")})
                    counts["FAILED"] = counts.get("FAILED", 0) + 1
                finally:
                    faulthandler.cancel_dump_traceback_later()
                slowest = max(slowest, time.perf_counter() - start)
            summary["formats"][fmt] = {**counts, "slowest_case_s": round(slowest, 2)}
        return summary
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_damaged_metadata_gives_packer_errors_only():
    cases = int(os.environ.get("PACKER_FUZZ_CASES", "100"))
    seed = int(os.environ.get("PACKER_FUZZ_SEED", "14"))
    child = subprocess.run([sys.executable, __file__, str(cases), str(seed)], capture_output=True, text=True,
                           cwd=HERE.parent, timeout=max(600, cases * 3))
    assert child.returncode >= 0, f"fuzz process killed by signal {-child.returncode}:\n{child.stderr[-4000:]}"
    assert child.returncode == 0, f"fuzz process failed (a hang trips the watchdog):\n{child.stderr[-4000:]}"
    summary = json.loads(child.stdout.strip().splitlines()[-1])
    assert not summary["failures"], json.dumps(summary["failures"][:10], indent=1, ensure_ascii=False)
    for fmt, counts in summary["formats"].items():  # the mutants reached both outcomes
        assert counts.get("refused", 0) > 0 and counts.get("accepted", 0) > 0, (fmt, counts)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    result = fuzz(int(sys.argv[1]) if len(sys.argv) > 1 else 100, int(sys.argv[2]) if len(sys.argv) > 2 else 14)
    print(json.dumps(result, ensure_ascii=False))
