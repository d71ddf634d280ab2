"""The metric and label names a PromQL expression uses, so tests can check the rules and the
dashboard in deploy/ against what a real agent exports.

A lexer, not a parser: strings, ``[ranges]`` and ``offset`` durations are dropped, label names
are read from ``{matchers}`` and from ``by``/``without``/``on``/``ignoring``/``group_*``
clauses, and every other identifier is a metric unless it is a keyword or a known function. An
identifier called like a function that PromQL does not define raises, so a typo never passes
for a metric name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: PromQL's functions and aggregation operators (Prometheus 2.42)
FUNCTIONS = frozenset(
    {
        # aggregations
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
        "bottomk", "topk", "quantile",
        # functions
        "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max",
        "clamp_min", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta",
        "deriv", "exp", "floor", "histogram_count", "histogram_sum", "histogram_fraction",
        "histogram_quantile", "holt_winters", "hour", "idelta", "increase", "irate",
        "label_join", "label_replace", "ln", "log2", "log10", "minute", "month",
        "predict_linear", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc",
        "sqrt", "time", "timestamp", "vector", "year", "avg_over_time", "min_over_time",
        "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time",
        "stddev_over_time", "stdvar_over_time", "last_over_time", "present_over_time",
        "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin", "sinh", "tan",
        "tanh", "deg", "rad", "pi",
    }
)  # fmt: skip
KEYWORDS = frozenset({"and", "or", "unless", "atan2", "bool", "inf", "nan"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-zA-Z]+")
_TOKEN = re.compile(r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|[A-Za-z_:][A-Za-z0-9_:]*")


@dataclass
class Names:
    metrics: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)

    def add(self, other: Names) -> None:
        self.metrics |= other.metrics
        self.labels |= other.labels


def names(expr: str) -> Names:
    """The metric names and label names ``expr`` uses."""
    found = Names()
    text = _STRING.sub('""', expr)
    for body in _MATCHERS.findall(text):
        found.labels.update(_MATCHER_LABEL.findall(body))
    text = _MATCHERS.sub(" ", text)
    for body in _GROUPING.findall(text):
        found.labels.update(label.strip() for label in body.split(",") if label.strip())
    text = _OFFSET.sub(" ", _RANGE.sub(" ", _GROUPING.sub(" ", text)))
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token[0].isdigit() or token in KEYWORDS:
            continue
        if text[m.end() :].lstrip().startswith("("):
            if token not in FUNCTIONS:
                raise ValueError(f"{token}(...) is not a PromQL function, in: {expr}")
            continue
        found.metrics.add(token)
    return found


_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S)


def variable_names(query: str) -> Names:
    """Names in a Grafana variable query: ``label_values(selector, label)``, else PromQL."""
    m = _LABEL_VALUES.match(query)
    if m is None:
        return names(query)
    found = names(m.group(1))
    found.labels.add(m.group(2))
    return found
