"""A model id that names the weights, not only where they were loaded from.

Chunk keys are derived from the model id, so two sets of weights sharing an id share KV: a model
retrained into the same directory, or a hub id loaded at another revision, would read the old
weights' KV and answer wrongly. The id therefore carries, besides the name or path:

- the hub commit the weights came from, where transformers recorded it (``_commit_hash``), or
  the revision asked for;
- for a local directory, a fingerprint of its weight files' content: their names, sizes and
  three samples of each (start, middle, end). Copies of the same files on every node (the usual
  deployment) fingerprint alike, so nodes still share KV; new weights change the samples.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

#: the files that hold weights in the formats transformers and vLLM load
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: bytes read at each of a weight file's three sample points
SAMPLE_BYTES = 64 << 10


def model_identity(name: str, *, revision: str | None = None) -> str:
    """``name`` (a hub id or a local path), with ``@`` and the weights' identity where one is
    known: ``revision`` (a commit or tag), else a local directory's weights fingerprint."""
    if revision:
        return f"{name}@{revision}"
    fingerprint = weights_fingerprint(Path(name)) if name else None
    return f"{name}@weights:{fingerprint}" if fingerprint else name


def weights_fingerprint(directory: Path) -> str | None:
    """A hex digest of the weight files in ``directory`` (not below it); None where it is not
    a directory or holds none."""
    try:
        files = sorted(
            p for p in directory.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES
        )
    except OSError:  # not a directory (a hub id), or unreadable: nothing to add
        return None
    if not files:
        return None
    digest = xxhash.xxh3_128()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            for at in sorted(
                {0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}
            ):
                f.seek(at)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]
