"""How close readers.diagnose's predicted rate comes to the rate of the fix it names.

    python benchmarks/suites/diagnose_accuracy.py PACKED [--from-workers 1] [--steps 20] [--runs 3]
                                                   [--json OUT]

A DataLoader over PACKED (an LMDB pack, read raw, RandomResizedCrop(224), batch 64,
shuffled, a 50 ms sleep for the training step) with --from-workers workers is diagnosed
over 2 epochs of --steps batches; the num_workers finding's predicted samples/s is then set
against a second diagnose run of the loader with the workers it names. One line of JSON a
run: from, to, predicted, measured, their ratio and the 1-minute load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch.utils.data import DataLoader  # noqa: E402

import readers  # noqa: E402


def loader(packed: str, workers: int) -> DataLoader:
    dataset = readers.LMDBDataset(packed, decode="raw", transform=readers.RandomResizedCrop(224))
    return DataLoader(dataset, batch_size=64, shuffle=True, num_workers=workers, persistent_workers=False)


def one_run(packed: str, workers: int, steps: int) -> dict | None:
    """The predicted and the measured rate of diagnose's num_workers fix; None without one."""
    def step(batch):
        time.sleep(0.05)

    found = readers.diagnose(loader(packed, workers), step, steps=steps, epochs=2)
    fixes = [f for f in found.findings if f.setting == "num_workers"]
    if not fixes:
        return None
    named = int(fixes[0].fix.split("num_workers=")[1].split()[0])
    predicted = float(fixes[0].fix.split("about ")[1].split()[0])
    measured = readers.diagnose(loader(packed, named), step, steps=steps, epochs=2).figures["samples_per_s"]
    return {"from": workers, "to": named, "predicted": round(predicted), "measured": round(measured),
            "ratio": round(measured / predicted, 3), "load": round(os.getloadavg()[0], 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packed", help="an LMDB pack (the standard corpus for reported figures)")
    parser.add_argument("--from-workers", type=int, default=1, help="the workers of the loader diagnosed first")
    parser.add_argument("--steps", type=int, default=20, help="batches timed per epoch")
    parser.add_argument("--runs", type=int, default=3, help="runs, each a diagnosis and a run of its fix")
    parser.add_argument("--json", help="append each run's line here too")
    args = parser.parse_args(argv)
    for _ in range(args.runs):
        result = one_run(args.packed, args.from_workers, args.steps)
        line = json.dumps(result if result is not None else {"from": args.from_workers, "finding": None})
        print(line)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
