"""The tiered KV store as a library: chunk keys, the index, tiers, eviction and admission
policies. The bottom layer: it knows no daemon, database, network client or UI."""
