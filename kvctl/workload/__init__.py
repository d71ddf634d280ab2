"""Workloads to drive the KV-cache store: Mooncake traces and a seeded built-in mix."""
