"""Two run folders of one recipe compared by sha256, file by file (`hyco.pipeline.compare`): what a
change that should not change the artifacts (a refactor) did to them.

    .venv/bin/python bench/compare_runs.py runs/tiny-before runs/tiny

Prints the counts and every difference beyond what two runs may differ in (timings, the inputs'
mtimes, the outputs a stage declares nondeterministic, compared outside their declared
pointers); exit 1 when there is one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hyco.base.files import sha256_file
from hyco.pipeline.compare import differences


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    for folder in (args.before, args.after):
        if not (folder / "run_report.json").is_file():
            print(f"{folder}: not a run folder (no run_report.json)", file=sys.stderr)
            return 2
    files = sorted(p.relative_to(args.before) for p in args.before.rglob("*") if p.is_file())
    same = sum((args.after / rel).is_file() and sha256_file(args.before / rel) == sha256_file(args.after / rel)
               for rel in files)
    diffs = differences(args.before, args.after)
    print(f"{len(files)} files in {args.before}: {same} with the same sha256 in {args.after}, "
          f"{len(files) - same} not (timings, manifests, declared nondeterministic outputs); "
          f"{len(diffs)} differences beyond what two runs may differ in")
    for line in diffs:
        print("  " + line)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
