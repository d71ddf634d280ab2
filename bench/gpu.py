"""Run the gpu tier benchmark with its defaults and print the JSON result (exit 2 when there is
no CUDA here, after printing {"skipped": reason, ...}).

    python bench/gpu.py > bench/results/gpu.json

The same as ``kvctl bench gpu --json``; needs the kvctl package importable (``pip install -e .``).
"""

from __future__ import annotations

import json
import sys

from kvctl.bench.gpu import (
    DEFAULT_BYTES_PER_SIZE,
    DEFAULT_DEVICE,
    DEFAULT_REPEATS,
    DEFAULT_SIZES_BYTES,
    run_gpu_bench,
)


def main() -> int:
    result = run_gpu_bench(
        list(DEFAULT_SIZES_BYTES),
        bytes_per_size=DEFAULT_BYTES_PER_SIZE,
        repeats=DEFAULT_REPEATS,
        device=DEFAULT_DEVICE,
    )
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 2 if "skipped" in result else 0


if __name__ == "__main__":
    sys.exit(main())
