"""The fleet's read model: every figure the dashboard, `kvctl status --window`, `kvctl top` and
the benches read from the metrics database, as plain functions over a SQLAlchemy connection
returning dataclasses (tests assert exact figures without a browser or a terminal).

Windows read rollups through :func:`kvctl.db.rollup.window` and :func:`kvctl.db.rollup.buckets`,
so a 30-day window reads daily and hourly rows, not samples. Every hit ratio is defined once, in
:class:`kvctl.ratios.HitCounts`.

* :mod:`.windows`: named windows and durations; :mod:`.inventory`: DCs, nodes, links
* :mod:`.counts`: measured counts per node, DC and fleet, and the modeled savings of their hits
* :mod:`.overview`: the fleet page (and the capacity planner's view)
* :mod:`.recorded`: `kvctl status --window` and `kvctl top --json`'s recorded figures
* :mod:`.series`: time series and events of a DC or node; :mod:`.links`: probes, break-even
* :mod:`.summary`: per-DC totals summed in SQL, cache counter sums per node and tier
* :mod:`.routing`: the routers' decisions, index hits and pulls per DC link, the route report
"""
