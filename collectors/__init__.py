"""Collectors that scrape agents, NVML and link probes into the metrics database.

Empty until the collectors issue lands; kept as a package so the distribution's layout is fixed.
"""
