"""Workloads: Mooncake traces and a seeded built-in mix, replayed against an agent or simulated
offline over the real store, and the fleet planner that sizes tiers from them."""
