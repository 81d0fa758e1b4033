"""`python -m benchmarks run|compare|trend|gpu|suite-time`: the command line of the suite."""
from __future__ import annotations

import argparse
import sys

from .names import CACHE_STATES, MEASURE_NAMES, PACKER_SOURCES


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, help="the command; each takes --help")
    run = sub.add_parser("run", help="measure every source and measure; results.json + Markdown table")
    data = run.add_mutually_exclusive_group()
    data.add_argument("--data", metavar="DIR", help="an ImageFolder tree DIR/<class>/<images> to measure")
    data.add_argument("--generate", metavar="N", type=int, default=1000,
                      help="generate N synthetic ImageNet-like JPEGs (default: 1000)")
    run.add_argument("--formats", type=csv, default=list(PACKER_SOURCES),
                     help=f"comma-separated, from {', '.join(PACKER_SOURCES)} (default: all)")
    run.add_argument("--measures", type=csv, default=list(MEASURE_NAMES),
                     help=f"comma-separated, from {', '.join(MEASURE_NAMES)} (default: all)")
    run.add_argument("--cache", type=csv, default=list(CACHE_STATES), help="cold,warm (default: both)")
    run.add_argument("--pack-cache", choices=("cold", "warm"), default="cold",
                     help="page cache state of the source before each pack and tar run (default: cold)")
    run.add_argument("--no-peers", action="store_true", help="skip the webdataset and PIL+listdir peers")
    run.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    run.add_argument("--workers", type=int, help="loader and pack workers (default: usable CPUs)")
    run.add_argument("--batch-size", type=int, default=64, help="samples per batch in every read (default: 64)")
    run.add_argument("--repeat", type=int, default=3, help="timed runs per case (default: 3)")
    run.add_argument("--budget", type=float, default=1.0, help="seconds per timed run, at most (default: 1)")
    run.add_argument("--warmup", type=float, default=0.25, help="seconds of untimed warm-up per case (0.25)")
    run.add_argument("--step-ms", type=float, default=20.0, help="synthetic training step per batch (ms)")
    run.add_argument("--isolation", choices=("case", "source", "run"), default="case",
                     help="a fresh process per case (default), per source, or one for the whole run "
                          "(faster, for smoke runs)")
    run.add_argument("--workdir", help="where the corpus and packed data go (default: a temp dir, removed)")
    run.add_argument("--keep", action="store_true", help="keep the temporary workdir")
    run.add_argument("--seed", type=int, default=0,
                     help="seeds the generated corpus and every shuffled order (default: 0)")
    run.add_argument("--out", help="write results JSON here (e.g. results.json)")
    run.add_argument("--chart", help="write a PNG chart here (needs matplotlib)")
    cmp = sub.add_parser("compare", help="exit 1 when NEW regressed from OLD beyond the tolerance or holds a "
                                          "figure that cannot be judged, 2 when a file cannot be read as results")
    cmp.add_argument("old", metavar="OLD.json", help="the results a run wrote before (run --out), the baseline")
    cmp.add_argument("new", metavar="NEW.json", help="the results of the run to check against OLD.json")
    cmp.add_argument("--tolerance", type=float, default=0.1, help="allowed relative change (default: 0.1)")
    trend = sub.add_parser("trend", help="each figure over a series of results files (one a night): a table on "
                                          "stdout and a PNG, marking what compare calls a regression")
    trend.add_argument("results", nargs="+", metavar="RESULTS.json", help="oldest first (name them by date)")
    trend.add_argument("--tolerance", type=float, default=0.1, help="as compare's (default: 0.1)")
    trend.add_argument("--png", default="trend.png",
                       help="write the chart here (default: trend.png; needs matplotlib); '' for none")
    suite = sub.add_parser("suite-time", help="time the test suite (the README's command) against its target: "
                                             "wall and CPU seconds, the load around it, the slowest tests")
    suite.add_argument("--out", help="write the figures as JSON here")
    suite.add_argument("pytest_args", nargs=argparse.REMAINDER, help="more arguments for pytest (after --)")
    from . import gpu

    gpu.add_arguments(sub.add_parser(
        "gpu", help="on a GPU machine: the CUDA tests, the GPU feed, nvJPEG, scaling and the suite, into one folder",
        description=gpu.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.command == "compare":
        from . import compare

        return compare.main(args)
    if args.command == "trend":
        from . import trend

        return trend.main(args)
    if args.command == "suite-time":
        from . import suitetime

        args.pytest_args = [a for a in args.pytest_args if a != "--"]
        return suitetime.main(args)
    if args.command == "gpu":
        from . import gpu

        return gpu.main(args, argv[1:])
    from . import run

    args.argv = argv
    if args.repeat < 1 or args.budget <= 0 or args.batch_size < 1 or (args.workers is not None and args.workers < 0):
        print("--repeat and --batch-size must be >= 1, --budget > 0, --workers >= 0", file=sys.stderr)
        return 2
    return run.main(args)


if __name__ == "__main__":
    sys.exit(main())
