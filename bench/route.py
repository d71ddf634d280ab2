"""Run the routing benchmark with its defaults and print the JSON result.

    python bench/route.py > bench/results/route.json

The same as ``kvctl bench route --json``; needs the kvctl package importable (``pip install -e .``).
"""

from __future__ import annotations

import json
import sys

from kvctl.bench.route import RouteBenchConfig, run_route_bench


def main() -> None:
    result = run_route_bench(RouteBenchConfig())
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
