"""The kvctl agent: a daemon around the tiered store (control API, data plane, metrics)."""
