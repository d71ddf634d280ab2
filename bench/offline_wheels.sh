#!/usr/bin/env bash
# Wheels for a GPU host with no package index that already has torch, transformers and numpy
# (a CUDA image): the rest of what `kvctl bench ttft --device cuda` and the CUDA tests import,
# at the versions of this checkout's .venv, for CPython 3.12 on x86-64 Linux.
#   bench/offline_wheels.sh [DIR]          (default .whl, which git ignores)
# On the GPU host, from the checkout with DIR copied beside it:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#   bench/gpu_checks.sh OUT
set -euo pipefail
dir=${1:-.whl}
py=${PYTHON:-.venv/bin/python}
names=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn
  sqlalchemy alembic mako psycopg psycopg-binary tomli-w redis typer rich typing-extensions
  opentelemetry-api)
pins=()
for name in "${names[@]}"; do
  version=$("$py" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "not installed in $py's environment: $name" >&2; exit 1; }
  pins+=("$name==$version")
done
mkdir -p "$dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir" "${pins[@]}"
ls "$dir"
