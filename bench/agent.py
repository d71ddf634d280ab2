"""Run the agent benchmark with its defaults and print the JSON result.

    python bench/agent.py > bench/results/agent.json

The same as ``kvctl bench agent --json``; needs the kvctl package importable (``pip install -e .``).
"""

from __future__ import annotations

import json
import sys

from kvctl.bench.agent import (
    DEFAULT_BYTES_PER_SIZE,
    DEFAULT_REPEATS,
    DEFAULT_SIZES_BYTES,
    run_agent_bench,
)


def main() -> None:
    result = run_agent_bench(
        list(DEFAULT_SIZES_BYTES), bytes_per_size=DEFAULT_BYTES_PER_SIZE, repeats=DEFAULT_REPEATS
    )
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
