"""Run the disk tier's reopen benchmark with its defaults and print the JSON result.

    python bench/reopen.py > bench/results/reopen.json

The same as ``kvctl bench reopen --json``; needs the kvctl package importable
(``pip install -e .``).
"""

from __future__ import annotations

import json
import sys

from kvctl.bench.reopen import run_reopen_bench


def main() -> None:
    sys.stdout.write(json.dumps(run_reopen_bench(), indent=2) + "\n")


if __name__ == "__main__":
    main()
