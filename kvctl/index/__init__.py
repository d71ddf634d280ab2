"""The fleet's KV index: which node holds which chunk in which tier.

Agents publish their store events (``/v1/events/recent``: stored, moved, evicted, with sequence
numbers and an instance id that changes on restart); ``follower`` turns each agent's stream into
``ChunkEvent``s and keeps a ``FleetIndex`` up to date (resuming after a gap, resyncing from the
agent's key listing when too far behind or restarted, dropping a node that stops answering).
``vllm_events`` does the same for vLLM's own KV events over ZMQ. Two indexes share one
interface: ``EmbeddedIndex`` (in-process, the default) and ``RedisIndex`` (Redis/Valkey, for a
fleet beyond one process). Lookups filter by tenant: an isolated tenant's chunk is visible to
that tenant only. An entry can be stale; whoever fetches re-checks with the holder.
"""
