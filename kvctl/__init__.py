"""kvctl: operate fleets of LLM inference nodes that share tiered KV caches."""

__version__ = "0.1.0"
