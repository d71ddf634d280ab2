"""Run the database benchmark and print the JSON result; arguments are passed through.

    python bench/db.py > bench/results/db.json
    python bench/db.py --no-pg --nodes 200 --days 2

The same as ``kvctl bench db --json [ARGS]`` (see ``kvctl bench db --help``); needs the kvctl
package importable (``pip install -e .``). Progress goes to stderr.
"""

from __future__ import annotations

import sys

from kvctl.cli.main import app


def main() -> None:
    # through the CLI, so options, validation and error messages are the command's own
    app(["bench", "db", "--json", *sys.argv[1:]], prog_name="kvctl")


if __name__ == "__main__":
    main()
