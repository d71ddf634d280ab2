"""Run the TTFT benchmark with its defaults and print the JSON result.

    python bench/ttft.py > bench/results/ttft.json

The same as ``kvctl bench ttft --json``; needs kvctl with its engine extra importable
(``pip install -e '.[engine]'``).
"""

from __future__ import annotations

import json
import sys

from kvctl.bench.ttft import run_ttft_bench


def main() -> None:
    result = run_ttft_bench(progress=lambda msg: print(msg, file=sys.stderr))
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
