"""torch and CUDA, where the machine has them, and the skip marks tests use to say so."""

from __future__ import annotations

import pytest

try:
    import torch

    CUDA = torch.cuda.is_available()
except ImportError:  # torch is an optional dependency
    torch = None  # type: ignore[assignment]
    CUDA = False

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs torch with CUDA and a visible GPU")
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch (pip install 'kvctl[engine]')")
without_cuda = pytest.mark.skipif(CUDA, reason="checks behaviour on a machine without CUDA")
