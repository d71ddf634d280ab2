"""Fetch or recompute: which prefix of a request's cached chunks to use, and from where.

The candidates are the chain's chunks that some source holds, in chain order: the agent's own
tiers (gpu, cpu, disk) first, then the shared pool and peer agents past the local prefix. KV is
reusable only for an exact prefix, so chunk i helps only if every chunk before it is used too: a
plan fetches the first k candidates (each from one source) and recomputes the rest.

- A chunk's usable sources are those named in ``links`` whose override is not ``recompute`` and
  whose figures are known (an uncosted link is usable only when overridden ``fetch``). The
  candidate range (K chunks) ends at the first chunk with no usable source.
- Per chunk, the source with the smallest transfer time (bytes / bandwidth) wins; ties go to the
  smaller RTT, then the name. A forced uncosted link is chosen only where no costed one serves
  the chunk, since its cost cannot be compared.
- Links in one *stage* run in parallel, one batched request each; stages run one after another
  (an engine fills from the pool and peers, then reads the local tiers), and every byte that is
  not already in device memory then crosses the ``device`` link (host -> GPU)::

      fetch_s(k) = sum over stages of max over the stage's links used in the first k
                   of (rtt + bytes_from_link / bandwidth)
                   + device rtt + bytes crossing it / device bandwidth

  Without ``stages`` every link is in one stage (parallel), as for the remote tiers alone.
- ``recompute_s(k)`` is the prefill model's time for the first k candidates' tokens, which
  follow ``start_tokens`` already in place: with attention the same tokens cost more deep in a
  context than at its start (``PrefillModel``).
- k maximises ``saved_s(k) = recompute_s(k) - fetch_s(k)``; ties go to the larger k, and k = 0
  unless some k saves time (> 0). Operator override: the leading chunks whose chosen source is
  overridden ``fetch`` are always fetched (all K when every chunk's is), and k grows past them
  only where that saves more than stopping there.

For a single chunk this is the design's rule (design.md section 3, ``kvctl.workload.plan``):
fetch when ``rtt + chunk_bytes / bandwidth < chunk_tokens / prefill_tokens_per_second``. Over a
batch the RTT is paid once per link, so several chunks can be worth fetching where one is not.

O(K x stages + total sources): the sums are incremental and, since a link's time only grows as
chunks are added, each stage's max over links is kept incrementally too.

Prefill model: ``seconds(a, b)`` to compute tokens [a, b) after a cached prefix of a tokens is
``(b - a) * (alpha + beta * (a + b) / 2)``: a per-token cost (the weights' matmuls) plus one
that grows with the context (attention reads every earlier token). It is the sum of the
per-token costs ``alpha + beta * i``, so it is additive over adjacent ranges: the prefill a
chunk saves depends only on where in the context it sits. A whole prefill also pays an
overhead whatever its length (kernel launches: on a GPU a 64-token prefill of an 8B model costs
most of a 1k-token one), which no reuse saves, so the plan leaves it out; the fit must not: read
as attention, a short prefill deep in a context made an H200's 32k-token prefill look 12-25x
its real 1.4 s, and disk reads twice as slow as recomputing were taken. Fitted by least
squares on the engines' measured samples, per model, outliers rejected (``EngineRates``), else
the configured tokens/s (beta = 0), else the modeled figure of the model and GPU profiles
(beta = 0: the profiles leave attention out, so long prompts are under-costed and fetching deep
chunks is under-valued, never over-valued).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from kvctl.errors import InvalidArgument
from kvctl.remote.links import Link

if TYPE_CHECKING:
    from kvctl.profiles import ModeledInputs

Reason = Literal[
    "fetch",  # the chosen k saves time
    "override",  # chunks fetched because the operator forces their links
    "no-candidates",  # nothing beyond the local prefix
    "no-source",  # the first candidate is available from no known link
    "slower-than-recompute",  # no k saves time: everything is recomputed
    "unknown-link",  # the first candidate's links cannot be costed yet
    # (the planner's, never plan_fetch's) nothing here and the one remote source not asked:
    # fetching the whole chain from it could not beat recomputing it
    "unasked",
]

#: the engine's own device memory (a gpu tier chunk): no host -> device copy
DEVICE_TIERS: frozenset[str] = frozenset({"gpu"})
#: a fitted per-token cost below this (1e12 tokens/s) is noise, not a rate
MIN_ALPHA_S_PER_TOKEN = 1e-12
#: one prefill sample covers at most this many tokens (a context far beyond any model's)
MAX_SAMPLE_TOKENS = 1 << 24
#: one prefill sample lasts at most this long (an hour: anything longer is a unit error)
MAX_SAMPLE_SECONDS = 3600.0
#: a host -> device bandwidth above this (10 TB/s) is a unit error, not a measurement
MAX_DEVICE_BYTES_PER_S = 1e13
#: engine-reported samples the fit uses: the most recent ones, so the figure follows the node
DEFAULT_SAMPLE_WINDOW = 512
#: the fit is used (basis "measured") from this many samples on
MIN_PREFILL_SAMPLES = 3
#: a prefill sample this many times off its model's fit (either way) is rejected (EngineRates)
OUTLIER_FACTOR = 10.0
#: reports in a row with every sample rejected after which the fit is rebuilt from them
REBASE_AFTER_REPORTS = 8
#: models whose prefill rates one agent keeps at once
MAX_RATE_MODELS = 16
#: the longest model id a report may name (Hugging Face ids are at most 96 characters)
MAX_MODEL_ID_CHARS = 256


def _number(value: object, what: str) -> float:
    # bool is an int: reject it so a stray flag is not taken for 1
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Candidate:
    """A chunk of the request's chain that some source holds, and which sources hold it."""

    #: position in the request's chain
    index: int
    size_bytes: int
    tokens: int
    #: link names where this chunk is available; empty: nowhere
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for what, value in (
            ("index", self.index),
            ("size_bytes", self.size_bytes),
            ("tokens", self.tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"candidate {what} must be an int >= 0, got {value!r}")
        if isinstance(self.sources, str):  # a bare name would be iterated letter by letter
            raise InvalidArgument(f"candidate sources must be a tuple of names: {self.sources!r}")
        object.__setattr__(self, "sources", tuple(self.sources))

    @classmethod
    def trusted(
        cls, index: int, size_bytes: int, tokens: int, sources: tuple[str, ...]
    ) -> Candidate:
        """A candidate from figures already checked (the store's own entries), built without
        the checks: a lookup builds one per chunk of its chain."""
        c = object.__new__(cls)
        c.__dict__.update(index=index, size_bytes=size_bytes, tokens=tokens, sources=sources)
        return c


@dataclass(frozen=True)
class PrefillRate:
    """How fast this node recomputes: prefill tokens per second, and where the figure came from.

    A context-independent rate, as configured or modeled; the planner uses it as a
    ``PrefillModel`` (``as_model``), which adds the attention term. Either can be passed to
    ``plan_fetch``."""

    tokens_per_s: float
    #: e.g. "modeled: llama-3.1-8b on h100 at MFU 0.5", "measured", "configured"
    basis: str

    def __post_init__(self) -> None:
        rate = self.tokens_per_s
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise InvalidArgument(f"prefill tokens_per_s must be a number, got {rate!r}")
        if not math.isfinite(rate) or rate <= 0:
            raise InvalidArgument(f"prefill tokens_per_s must be finite and > 0, got {rate!r}")

    @classmethod
    def modeled(cls, inputs: ModeledInputs) -> PrefillRate:
        return cls(
            inputs.prefill_tokens_per_second,
            f"modeled: {inputs.model.name} on {inputs.gpu.name} at MFU {inputs.mfu:g}",
        )

    def as_model(self, **inputs: object) -> PrefillModel:
        """This rate as the model (beta = 0), its ``inputs`` the rate and ``inputs``."""
        return PrefillModel(
            1.0 / self.tokens_per_s, 0.0, self.basis, {"tokens_per_s": self.tokens_per_s, **inputs}
        )


@dataclass(frozen=True)
class PrefillModel:
    """Seconds to prefill tokens [a, b) after a cached prefix of a tokens:
    ``(b - a) * (alpha + beta * (a + b) / 2)`` (see the module), what recomputing them costs
    beyond ``overhead_s``, which every prefill pays whatever its length (a request always
    computes at least its last token, so reusing chunks never saves it).

    ``basis`` starts with "measured", "configured" or "modeled" (as ``PrefillRate``'s does);
    ``inputs`` says what the figure was built from (samples and fit, the setting, the
    profiles)."""

    #: seconds per token at an empty context (the weights' matmuls)
    alpha_s_per_token: float
    #: seconds per token per token of context before it (attention)
    beta_s_per_token2: float
    basis: str
    inputs: Mapping[str, object] = field(default_factory=dict)
    #: seconds of each prefill whatever its length (kernel launches, the pass's set-up)
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        alpha = _number(self.alpha_s_per_token, "prefill alpha_s_per_token")
        beta = _number(self.beta_s_per_token2, "prefill beta_s_per_token2")
        overhead = _number(self.overhead_s, "prefill overhead_s")
        if not math.isfinite(alpha) or alpha <= 0:
            raise InvalidArgument(f"prefill alpha_s_per_token must be finite and > 0, got {alpha}")
        if not math.isfinite(beta) or beta < 0:
            raise InvalidArgument(f"prefill beta_s_per_token2 must be finite and >= 0, got {beta}")
        if not math.isfinite(overhead) or overhead < 0:
            raise InvalidArgument(f"prefill overhead_s must be finite and >= 0, got {overhead}")

    @property
    def kind(self) -> str:
        """measured | configured | modeled"""
        return self.basis.split(":", 1)[0].strip()

    @property
    def tokens_per_s(self) -> float:
        """The rate at an empty context (attention slows it as the context grows)."""
        return 1.0 / self.alpha_s_per_token

    def seconds(self, start_tokens: float, end_tokens: float) -> float:
        """What computing tokens [start, end) adds to a prefill (the overhead left out)."""
        n = end_tokens - start_tokens
        return n * (
            self.alpha_s_per_token + self.beta_s_per_token2 * (start_tokens + end_tokens) / 2
        )

    def prefill_seconds(self, start_tokens: float, end_tokens: float) -> float:
        """A whole prefill of tokens [start, end), as an engine times it: the overhead included."""
        return self.overhead_s + self.seconds(start_tokens, end_tokens)

    def as_dict(self) -> dict[str, object]:
        return {
            "tokens_per_s": self.tokens_per_s,
            "alpha_s_per_token": self.alpha_s_per_token,
            "beta_s_per_token2": self.beta_s_per_token2,
            "overhead_s": self.overhead_s,
            "basis": self.basis,
            "kind": self.kind,
            "inputs": dict(self.inputs),
        }


def as_prefill_model(prefill: PrefillRate | PrefillModel) -> PrefillModel:
    return prefill if isinstance(prefill, PrefillModel) else prefill.as_model()


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One prefill an engine timed: ``computed_tokens`` after ``cached_tokens`` already in
    place, in ``seconds``."""

    computed_tokens: int
    cached_tokens: int
    seconds: float

    def __post_init__(self) -> None:
        for what, value, low in (
            ("computed_tokens", self.computed_tokens, 1),
            ("cached_tokens", self.cached_tokens, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(f"prefill sample {what} must be an int, got {value!r}")
            if not low <= value <= MAX_SAMPLE_TOKENS:
                raise InvalidArgument(
                    f"prefill sample {what} must be in {low}..{MAX_SAMPLE_TOKENS}, got {value}"
                )
        seconds = _number(self.seconds, "prefill sample seconds")
        if not math.isfinite(seconds) or not 0 < seconds <= MAX_SAMPLE_SECONDS:
            raise InvalidArgument(
                f"prefill sample seconds must be in (0, {MAX_SAMPLE_SECONDS:g}], got {seconds!r}"
            )


class PrefillFit(NamedTuple):
    """A least-squares fit of an engine's prefill samples (``fit_prefill``)."""

    alpha_s_per_token: float
    beta_s_per_token2: float
    #: seconds each prefill paid whatever its length (launches, the pass's set-up)
    overhead_s: float
    rms_residual_s: float


# the fit's terms as (overhead, per token, attention) columns, in the order of preference when
# several fit the samples equally well (they cannot be told apart): an overhead before an
# attention term, since a short prefill deep in a context mostly pays launches, and reading its
# cost as attention makes a long prompt's predicted prefill many times the real one
_TERMS: tuple[tuple[bool, bool, bool], ...] = (
    (True, True, True),
    (True, True, False),
    (False, True, True),
    (True, False, True),
    (False, True, False),
    (False, False, True),
)
#: a set of terms whose (normalised) columns are this close to dependent is not fitted
_SINGULAR = 1e-9


def fit_prefill(samples: Sequence[PrefillSample]) -> PrefillFit | None:
    """Least squares of ``t = overhead + n * (alpha + beta * (2a + n) / 2)`` over the samples
    (``n`` tokens computed after ``a`` cached), every term >= 0. The unconstrained fit of all
    three when the samples determine them and none comes out negative; else the best of the
    subsets of terms (a negative coefficient is noise: the others are fitted alone), ties in the
    order of ``_TERMS``. None without samples. In numpy: the agent refits on every engine report
    (up to ``DEFAULT_SAMPLE_WINDOW`` samples), and in pure Python that held the GIL for ~10 ms of
    512 samples, stalling the data plane's threads each time."""
    if not samples:
        return None
    n = np.fromiter((s.computed_tokens for s in samples), dtype=np.float64, count=len(samples))
    a = np.fromiter((s.cached_tokens for s in samples), dtype=np.float64, count=len(samples))
    rows = np.column_stack((np.ones_like(n), n, n * (2.0 * a + n) / 2))
    ys = np.fromiter((s.seconds for s in samples), dtype=np.float64, count=len(samples))
    best: tuple[float, np.ndarray] | None = None
    for used in _TERMS:
        coef = _least_squares(rows, ys, used)
        if coef is None:
            continue
        rss = float(np.dot(residual := rows @ coef - ys, residual))
        # a later set wins only if it fits clearly better (equal fits keep the preferred one)
        if best is None or rss < best[0] * (1 - 1e-9) - 1e-24:
            best = (rss, coef)
    if best is None:  # cannot happen: a single column of positive token counts always fits
        return None
    rss, coef = best
    overhead, alpha, beta = (float(c) for c in coef)
    return PrefillFit(
        max(alpha, MIN_ALPHA_S_PER_TOKEN), beta, overhead, math.sqrt(rss / len(samples))
    )


def _least_squares(
    rows: np.ndarray, ys: np.ndarray, used: tuple[bool, bool, bool]
) -> np.ndarray | None:
    """The coefficients of the ``used`` columns (the others 0) minimising the squared error,
    or None where the columns are (near) dependent or a coefficient comes out negative. The
    columns are scaled to unit length first (their magnitudes differ by up to 10^15), then
    solved by QR (Householder): normal equations would square the conditioning and refuse
    exactly determined systems of short and long prompts."""
    cols = [j for j in range(3) if used[j]]
    if len(rows) < len(cols):  # fewer samples than terms: not determined
        return None
    picked = rows[:, cols]
    norms = np.sqrt(np.einsum("ij,ij->j", picked, picked))
    if not np.all(norms > 0):
        return None
    q, upper = np.linalg.qr(picked / norms)
    # (unit columns) a column within 1e-9 rad of the span of the ones before it
    if np.min(np.abs(np.diag(upper))) < _SINGULAR:
        return None
    x = np.linalg.solve(upper, q.T @ ys)
    # a term within rounding of zero (exactly determined samples that need none of it) is zero,
    # not a reason to refuse the set: which side of zero rounding lands on is no evidence
    tiny = 1e-9 * float(np.sqrt(np.dot(ys, ys)))
    if np.any(x < -tiny):
        return None
    x = np.maximum(x, 0.0)
    out = np.zeros(3)
    out[cols] = x / norms
    return out


@dataclass
class _ModelRates:
    """One model's samples, fit and counts (``EngineRates``)."""

    samples: deque[PrefillSample]
    #: the samples of the current run of wholly rejected reports (a rebase candidate)
    run: deque[PrefillSample]
    fit: PrefillModel | None = None
    reports: int = 0
    accepted: int = 0
    rejected: int = 0
    #: reports in a row whose every sample was rejected
    rejected_reports_in_a_row: int = 0
    #: times the fit was rebuilt from such a run (the engine's speed really changed)
    rebased: int = 0
    #: ``EngineRates`` report number of this model's last report
    last_report: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "reports": self.reports,
            "prefill_samples": self.accepted,
            "prefill_samples_rejected": self.rejected,
            "prefill_samples_in_window": len(self.samples),
            "rebased": self.rebased,
            "prefill_fit": None if self.fit is None else self.fit.as_dict(),
        }


class EngineRates:
    """What the engines on this node measured and reported (data-plane ``RATES``): prefill
    samples per model, each model's fitted over a bounded recent window, and the host -> device
    bandwidth (an EWMA, one per node: it is the node's bus, whatever the model). Thread-safe;
    a fit is redone on each report, so lookups only read it.

    Per model: a small model on the same agent must not set the figure a large one's chunks are
    weighed with. A lookup names no model (its keys are hashes of the model's namespace and
    tokens, which cannot be told apart without the tokens), so it gets the fit of the model
    that reported last, among those with a fit (``prefill(model=...)`` names one; ``as_dict``
    says which is used and why). Reports from more than ``MAX_RATE_MODELS`` models replace the
    one that reported least recently.

    Outliers: once a model has a fit, a sample more than ``OUTLIER_FACTOR`` times faster than
    the fit predicts is rejected (counted, not kept), and so is one that many times slower
    within twice the context the fit has seen (beyond it, attention may honestly make a prefill
    that much slower than a fit from short prompts says). An engine whose speed really changed
    that much is followed after ``REBASE_AFTER_REPORTS`` reports in a row had every sample
    rejected: the fit is rebuilt from those samples alone (counted as ``rebased``).

    No floor below which a measured prefill is refused as implausibly fast: the one physical
    bound (peak FLOPs / (2 x parameters) per token) needs the reporting model's size and the
    node's accelerator, and the agent knows neither for a reported model id (the modeled
    fallback is the first configured model's profile, or another model's when it has none, on
    the operator's ``gpu`` setting). ``MIN_ALPHA_S_PER_TOKEN`` only keeps the fit finite."""

    def __init__(
        self,
        *,
        window: int = DEFAULT_SAMPLE_WINDOW,
        min_samples: int = MIN_PREFILL_SAMPLES,
        alpha: float = 0.3,
        outlier_factor: float = OUTLIER_FACTOR,
        rebase_after_reports: int = REBASE_AFTER_REPORTS,
    ) -> None:
        if window < 1 or min_samples < 1:
            raise InvalidArgument("the sample window and minimum must be >= 1")
        if not outlier_factor > 1 or rebase_after_reports < 1:
            raise InvalidArgument("the outlier factor must be > 1 and the rebase count >= 1")
        self._lock = threading.Lock()
        self._window = window
        self._min_samples = min_samples
        self._alpha = alpha
        self._outlier_factor = float(outlier_factor)
        self._rebase_after = rebase_after_reports
        self._by_model: dict[str, _ModelRates] = {}
        #: the model whose fit a lookup that names none gets (None: no model has a fit yet)
        self._selected: str | None = None
        self._device_bytes_per_s: float | None = None
        self.reports = 0
        self.samples_total = 0
        self.rejected_total = 0

    @property
    def models(self) -> dict[str, int]:
        """Reports per named model (the models kept)."""
        with self._lock:
            return {m: r.reports for m, r in self._by_model.items() if m}

    def report(
        self,
        samples: Sequence[PrefillSample],
        *,
        host_to_device_bytes_per_s: float | None = None,
        model: str = "",
    ) -> int:
        """Take one engine report (validated before anything is kept); returns how many of its
        samples were kept (the rest were outliers)."""
        if host_to_device_bytes_per_s is not None:
            bw = _number(host_to_device_bytes_per_s, "host_to_device_bytes_per_s")
            if not math.isfinite(bw) or not 0 < bw <= MAX_DEVICE_BYTES_PER_S:
                raise InvalidArgument(
                    f"host_to_device_bytes_per_s must be in (0, {MAX_DEVICE_BYTES_PER_S:g}], "
                    f"got {host_to_device_bytes_per_s!r}"
                )
        for s in samples:
            if not isinstance(s, PrefillSample):
                raise InvalidArgument(f"not a prefill sample: {s!r}")
        if not isinstance(model, str):
            raise InvalidArgument(f"model must be a string, got {model!r}")
        if len(model) > MAX_MODEL_ID_CHARS:  # a label kept per model: a name, not a payload
            raise InvalidArgument(
                f"model id of {len(model)} characters; at most {MAX_MODEL_ID_CHARS}"
            )
        with self._lock:
            self.reports += 1
            if host_to_device_bytes_per_s is not None:
                bw = float(host_to_device_bytes_per_s)
                cur = self._device_bytes_per_s
                self._device_bytes_per_s = (
                    bw if cur is None else self._alpha * bw + (1 - self._alpha) * cur
                )
            rates = self._model_locked(model)
            rates.reports += 1
            rates.last_report = self.reports
            kept = self._take_locked(model, rates, samples) if samples else 0
            if rates.fit is not None:
                self._selected = model
            return kept

    def _model_locked(self, model: str) -> _ModelRates:
        rates = self._by_model.pop(model, None)  # re-inserted last: the dict is in report order
        if rates is None:
            if len(self._by_model) >= MAX_RATE_MODELS:
                gone = next(iter(self._by_model))  # the least recent reporter
                del self._by_model[gone]
                if gone == self._selected:  # the next most recent model with a fit, if any
                    fitted = [(r.last_report, m) for m, r in self._by_model.items() if r.fit]
                    self._selected = max(fitted)[1] if fitted else None
            rates = _ModelRates(deque(maxlen=self._window), deque(maxlen=self._window))
        self._by_model[model] = rates
        return rates

    def _take_locked(self, model: str, rates: _ModelRates, samples: Sequence[PrefillSample]) -> int:
        kept = [s for s in samples if not self._outlier(rates.fit, s)]
        rejected = len(samples) - len(kept)
        rates.rejected += rejected
        self.rejected_total += rejected
        if kept:
            rates.rejected_reports_in_a_row = 0
            rates.run.clear()
            rates.samples.extend(kept)
        else:  # every sample disagreed with the fit: the engine may really have changed
            rates.rejected_reports_in_a_row += 1
            rates.run.extend(samples)
            if (
                rates.rejected_reports_in_a_row >= self._rebase_after
                and len(rates.run) >= self._min_samples
            ):
                rates.samples.clear()
                rates.samples.extend(rates.run)
                rates.run.clear()
                rates.rejected_reports_in_a_row = 0
                rates.rebased += 1
                rates.rejected -= len(rates.samples)  # kept after all, this report's included
                self.rejected_total -= len(rates.samples)
                rates.accepted += len(rates.samples)
                self.samples_total += len(rates.samples)
                rates.fit = self._refit_locked(model, rates.samples)
                return min(len(samples), len(rates.samples))
            return 0
        rates.accepted += len(kept)
        self.samples_total += len(kept)
        rates.fit = self._refit_locked(model, rates.samples)
        return len(kept)

    def _outlier(self, fit: PrefillModel | None, s: PrefillSample) -> bool:
        if fit is None:
            return False
        start, end = s.cached_tokens, s.cached_tokens + s.computed_tokens
        ratio = s.seconds / fit.prefill_seconds(start, end)
        if ratio < 1 / self._outlier_factor:
            return True  # faster than the fit by far, at any context
        seen = fit.inputs.get("max_context_tokens", 0)
        return ratio > self._outlier_factor and end <= 2 * seen  # type: ignore[operator]

    def _refit_locked(self, model: str, samples: deque[PrefillSample]) -> PrefillModel | None:
        window = list(samples)
        if len(window) < self._min_samples:
            return None
        fitted = fit_prefill(window)
        if fitted is None:
            return None
        return PrefillModel(
            fitted.alpha_s_per_token,
            fitted.beta_s_per_token2,
            "measured: least squares over the engines' recent prefills"
            + (f" of {model}" if model else ""),
            {
                "model": model,
                "samples": len(window),
                "window": samples.maxlen,
                "rms_residual_s": fitted.rms_residual_s,
                "max_context_tokens": max(s.cached_tokens + s.computed_tokens for s in window),
            },
            fitted.overhead_s,
        )

    def prefill(self, fallback: PrefillModel, *, model: str | None = None) -> PrefillModel:
        """``model``'s measured fit, or (None) that of the model that reported samples last;
        ``fallback`` while there is none."""
        with self._lock:
            name = self._selected if model is None else model
            rates = None if name is None else self._by_model.get(name)
            fit = None if rates is None else rates.fit
            return fit or fallback

    @property
    def host_to_device_bytes_per_s(self) -> float | None:
        with self._lock:
            return self._device_bytes_per_s

    def as_dict(self) -> dict[str, object]:
        with self._lock:
            name = self._selected
            selected = None if name is None else self._by_model.get(name)
            fit = None if selected is None else selected.fit
            return {
                "reports": self.reports,
                "prefill_samples": self.samples_total,
                "prefill_samples_rejected": self.rejected_total,
                "outlier_factor": self._outlier_factor,
                # the selected model's (the figures lookups use)
                "prefill_samples_in_window": 0 if selected is None else len(selected.samples),
                "prefill_fit": None if fit is None else fit.as_dict(),
                "prefill_model": None if fit is None else self._selected,
                "prefill_model_chosen_as": (
                    "the model that reported last, of those with a fit (a lookup names none)"
                    if fit is not None
                    else "none: no model has enough samples (the fallback is used)"
                ),
                "host_to_device_bytes_per_s": self._device_bytes_per_s,
                "models": {m: r.reports for m, r in self._by_model.items() if m},
                "by_model": {m: r.as_dict() for m, r in self._by_model.items()},
            }


@dataclass(frozen=True, slots=True)
class LocalLink:
    """A source inside this node: a local tier, or the host -> device copy.

    Costs ``rtt_s + nbytes / bandwidth``; a bandwidth of None means free (a read from host
    memory whose cost is the device copy, a chunk already in device memory, or a host ->
    device copy on an engine that reported no bandwidth: a CPU engine has none)."""

    name: str
    #: latency before the first byte (a disk read's), seconds
    rtt_s: float = 0.0
    bandwidth_bytes_per_s: float | None = None
    #: where the figure came from: "measured" | "configured" | "default" | "engine" | "free"
    source: str = "free"
    override: Literal["auto", "fetch", "recompute"] = "auto"

    def __post_init__(self) -> None:
        rtt = _number(self.rtt_s, f"{self.name} latency")
        if not math.isfinite(rtt) or rtt < 0:
            raise InvalidArgument(f"{self.name} latency must be finite and >= 0, got {rtt}")
        if self.bandwidth_bytes_per_s is not None:
            bw = _number(self.bandwidth_bytes_per_s, f"{self.name} bandwidth")
            if not math.isfinite(bw) or bw <= 0:
                raise InvalidArgument(f"{self.name} bandwidth must be finite and > 0, got {bw}")

    @property
    def costed(self) -> bool:
        return True

    @property
    def emulated(self) -> bool:
        return False

    def transfer_s(self, nbytes: float) -> float:
        bw = self.bandwidth_bytes_per_s
        return 0.0 if bw is None else nbytes / bw

    def fetch_s(self, nbytes: float) -> float:
        return self.rtt_s + self.transfer_s(nbytes)

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "rtt_s": self.rtt_s,
            "rtt_basis": self.source,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "source": self.source,
            "override": self.override,
            "emulated_delay_s": 0.0,
            "costed": True,
        }


AnyLink = Link | LocalLink


@dataclass(frozen=True)
class FetchPlan:
    """The decision for one request, with the inputs it was made from."""

    #: (chain index, link name) of each chunk to fetch, in chain order: always a prefix
    fetch: tuple[tuple[int, str], ...]
    #: candidates not fetched (recomputed)
    recompute: int
    #: modeled time to fetch the chosen chunks (stages in turn, parallel links in each, then
    #: the device copy)
    fetch_s: float
    #: modeled time recomputing the chosen chunks would have taken
    recompute_s: float
    saved_s: float
    reason: Reason
    #: as_dict() of each link the candidates named
    links: dict[str, dict[str, object]]
    #: the prefill model's as_dict(): tokens_per_s, alpha, beta, basis, inputs
    prefill: dict[str, object]
    per_link_bytes: dict[str, int]
    #: modeled time of each link's batch in the plan
    per_link_s: dict[str, float] = field(default_factory=dict)
    #: candidates that had a usable source (K): the plan could fetch at most this many
    usable: int = 0
    #: why the usable range ended before the last candidate ("no-source", "unknown-link",
    #: "override"); None when every candidate was usable
    stopped_by: Reason | None = None
    #: links in the plan whose figures are unknown (forced by override; they count 0 s)
    uncosted_links: tuple[str, ...] = ()
    #: the chosen source of each usable candidate (the first ``usable``), fetched or not
    usable_sources: tuple[str, ...] = ()
    #: tokens already in place before the first candidate
    start_tokens: int = 0
    #: the host -> device copy of the chosen chunks (None: not modeled)
    device: dict[str, object] | None = None
    device_s: float = 0.0

    @property
    def fetched_indices(self) -> tuple[int, ...]:
        return tuple(index for index, _ in self.fetch)

    def as_dict(self, *, chunks: bool = True) -> dict[str, object]:
        """The plan for events and reports; ``chunks=False`` leaves out the per-chunk list."""
        per_link_chunks: dict[str, int] = {}
        for _, name in self.fetch:
            per_link_chunks[name] = per_link_chunks.get(name, 0) + 1
        return {
            "fetch": (
                [{"index": index, "link": name} for index, name in self.fetch] if chunks else []
            ),
            "recompute": self.recompute,
            "fetch_s": self.fetch_s,
            "recompute_s": self.recompute_s,
            "saved_s": self.saved_s,
            "reason": self.reason,
            "usable": self.usable,
            "stopped_by": self.stopped_by,
            "uncosted_links": list(self.uncosted_links),
            "links": {name: dict(d) for name, d in self.links.items()},
            "prefill": dict(self.prefill),
            "start_tokens": self.start_tokens,
            "per_link_chunks": per_link_chunks,
            "per_link_bytes": dict(self.per_link_bytes),
            "per_link_s": dict(self.per_link_s),
            "device": None if self.device is None else dict(self.device),
            "device_s": self.device_s,
        }


def _usable(link: AnyLink) -> bool:
    if link.override == "recompute":
        return False
    return link.costed or link.override == "fetch"


def _choose(candidate: Candidate, links: Mapping[str, AnyLink]) -> str | None:
    """The chunk's cheapest usable source, or None when it has none."""
    best: tuple[int, float, float, str] | None = None
    for name in candidate.sources:
        link = links.get(name)
        if link is None or not _usable(link):
            continue
        transfer_s = link.transfer_s(candidate.size_bytes)
        if transfer_s is not None and link.rtt_s is not None:
            key = (0, transfer_s, link.rtt_s, name)
        else:  # forced but uncosted: only where nothing comparable serves the chunk
            key = (1, 0.0, 0.0, name)
        if best is None or key < best:
            best = key
    return None if best is None else best[3]


def _blocked_by(candidate: Candidate, links: Mapping[str, AnyLink]) -> Reason:
    """Why a chunk has no usable source. An override is the operator's deliberate choice, so it
    is named before an unknown link."""
    known = [links[name] for name in candidate.sources if name in links]
    if any(link.override == "recompute" for link in known):
        return "override"
    if known:
        return "unknown-link"
    return "no-source"


def plan_fetch(
    candidates: Sequence[Candidate],
    links: Mapping[str, AnyLink],
    prefill: PrefillRate | PrefillModel,
    *,
    start_tokens: int = 0,
    stages: Mapping[str, int] | None = None,
    device: LocalLink | None = None,
    on_device: Collection[str] = (),
) -> FetchPlan:
    """Decide which prefix of ``candidates`` to fetch and from which links (see the module).

    ``stages``: link name -> stage (absent: 0); ``device``: the copy every fetched byte makes
    unless its link is in ``on_device``."""
    previous: int | None = None
    for candidate in candidates:
        # a gap would make a later chunk look usable without the one before it
        if previous is not None and candidate.index != previous + 1:
            raise InvalidArgument(
                f"candidates must be consecutive chain positions in order: {candidate.index} "
                f"follows {previous}"
            )
        previous = candidate.index
    for filed_as, link in links.items():
        if link.name != filed_as:
            raise InvalidArgument(f"link {link.name!r} is filed under {filed_as!r}")
    if isinstance(start_tokens, bool) or not isinstance(start_tokens, int) or start_tokens < 0:
        raise InvalidArgument(f"start_tokens must be an int >= 0, got {start_tokens!r}")
    model = as_prefill_model(prefill)
    stage_of = stages or {}

    named = {name for candidate in candidates for name in candidate.sources if name in links}
    link_dicts = {name: links[name].as_dict() for name in sorted(named)}

    # One pass over the usable range: chosen sources, per-link bytes and times, the stage maxes
    # (and their running sum). Engines look up chains of hundreds of chunks per request, so the
    # loop inlines the device copy and the prefill model, and remembers each (sources, size)'s
    # choice: a chain's chunks mostly share both.
    chosen: list[str] = []
    link_bytes: dict[str, int] = {}
    stage_s: dict[int, float] = {}
    stages_total_s = 0.0
    choices: dict[tuple[tuple[str, ...], int], str | None] = {}
    device_bytes = 0
    device_rtt_s = 0.0 if device is None else device.rtt_s
    device_bw = None if device is None else device.bandwidth_bytes_per_s
    alpha, beta = model.alpha_s_per_token, model.beta_s_per_token2
    tokens = 0
    forced_floor = 0  # leading chunks whose chosen link is overridden "fetch"
    floor_saved_s = 0.0
    best_k, best_saved_s, best_fetch_s, best_recompute_s = 0, 0.0, 0.0, 0.0
    best_device_s = 0.0
    stopped_by: Reason | None = None
    for k, candidate in enumerate(candidates, start=1):
        size = candidate.size_bytes
        choice_key = (candidate.sources, size)
        if choice_key in choices:
            name = choices[choice_key]
        else:
            name = choices[choice_key] = _choose(candidate, links)
        if name is None:
            stopped_by = _blocked_by(candidate, links)
            break
        link = links[name]
        chosen.append(name)
        nbytes = link_bytes[name] = link_bytes.get(name, 0) + size
        link_s = link.fetch_s(nbytes)
        if link_s is not None:  # an uncosted (forced) link counts 0 s: flagged in the plan
            stage = stage_of.get(name, 0)
            grown_s = link_s - stage_s.get(stage, 0.0)
            if grown_s > 0:
                stage_s[stage] = link_s
                stages_total_s += grown_s
        if name not in on_device:
            device_bytes += size
        device_s = 0.0
        if device_bytes and device is not None:
            device_s = device_rtt_s + (device_bytes / device_bw if device_bw else 0.0)
        fetch_s = stages_total_s + device_s
        tokens += candidate.tokens
        # model.seconds(start_tokens, start_tokens + tokens), inlined
        recompute_s = tokens * (alpha + beta * (2 * start_tokens + tokens) / 2)
        saved_s = recompute_s - fetch_s
        if forced_floor == k - 1 and link.override == "fetch":
            forced_floor = k
            floor_saved_s = saved_s
        elif not (saved_s > floor_saved_s and saved_s >= best_saved_s):
            continue
        best_k, best_saved_s, best_fetch_s, best_recompute_s = k, saved_s, fetch_s, recompute_s
        best_device_s = device_s
    usable = len(chosen)

    fetch = tuple((candidates[i].index, chosen[i]) for i in range(best_k))
    per_link_bytes: dict[str, int] = {}
    for i in range(best_k):
        name = chosen[i]
        per_link_bytes[name] = per_link_bytes.get(name, 0) + candidates[i].size_bytes
    per_link_s: dict[str, float] = {}
    for name, nbytes in per_link_bytes.items():
        link_s = links[name].fetch_s(nbytes)
        per_link_s[name] = 0.0 if link_s is None else link_s
    uncosted = tuple(sorted(name for name in per_link_bytes if not links[name].costed))

    reason: Reason
    if not candidates:
        reason = "no-candidates"
    elif usable == 0:
        reason = stopped_by or "no-source"
    elif best_k == 0:
        reason = "slower-than-recompute"
    elif best_k == forced_floor:
        reason = "override"
    else:
        reason = "fetch"
    return FetchPlan(
        fetch=fetch,
        recompute=len(candidates) - best_k,
        fetch_s=best_fetch_s,
        recompute_s=best_recompute_s,
        saved_s=best_saved_s,
        reason=reason,
        links=link_dicts,
        prefill=model.as_dict(),
        per_link_bytes=per_link_bytes,
        per_link_s=per_link_s,
        usable=usable,
        stopped_by=stopped_by,
        uncosted_links=uncosted,
        usable_sources=tuple(chosen),
        start_tokens=start_tokens,
        device=None if device is None else device.as_dict(),
        device_s=best_device_s,
    )
