"""Collectors: scrape agents, engines, NVML and link probes on an interval and write the counters'
increases into the metrics database. Headless: no UI library, never the dashboard."""
