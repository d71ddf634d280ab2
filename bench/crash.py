"""Run the crash-consistency benchmark with its defaults and print the JSON result.

    python bench/crash.py > bench/results/crash.json

The same as ``kvctl bench crash --json``; needs the kvctl package importable (``pip install -e .``).
"""

from __future__ import annotations

import json
import sys

from kvctl.bench.crash import run_crash_bench


def main() -> None:
    result = run_crash_bench()
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    if not result["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
