"""Build a node's remote tiers (the pool, the peers, their links) from its settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvctl.agent.settings import AgentSettings, LinkSpec
from kvctl.index.remote import IndexClient
from kvctl.profiles import DEFAULT_MODEL, MODELS, ModeledInputs, gpu_profile
from kvctl.remote.agent_source import AgentSource
from kvctl.remote.federation import PEER_TIER, POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import EmulatedDelay, LinkEstimator
from kvctl.remote.pool import RemotePool
from kvctl.store.store import TieredStore


def prefill_rate(settings: AgentSettings) -> PrefillRate:
    """The configured prefill speed, else the modeled one of the first model on ``gpu``."""
    if settings.prefill_tokens_per_second > 0:
        return PrefillRate(settings.prefill_tokens_per_second, "configured")
    model_id = settings.models[0].id
    profile = MODELS.get(model_id.lower())
    note = ""
    if profile is None:
        profile = MODELS[DEFAULT_MODEL]
        note = f" (no profile for {model_id}; using {DEFAULT_MODEL}'s)"
    inputs = ModeledInputs(profile, gpu_profile(settings.gpu))
    return PrefillRate(
        inputs.prefill_tokens_per_second,
        f"modeled: {profile.name} on {inputs.gpu.name} at MFU {inputs.mfu}{note}",
    )


def open_pool(settings: AgentSettings) -> RemotePool:
    url = settings.pool
    token = settings.remote_token or settings.token
    if url.startswith("kvctl://"):
        return AgentSource(url, token=token, max_chunk_bytes=settings.max_chunk_bytes)
    from kvctl.remote.redis_pool import RedisPool  # redis-py only for a Redis pool

    return RedisPool(
        url,
        prefix=settings.pool_prefix,
        capacity_bytes=settings.pool_capacity_bytes or None,
        ttl_s=settings.pool_ttl_seconds or None,
        tenant_quota_bytes=settings.pool_tenant_quota_bytes,
        # the pool reads no record longer than this agent's largest chunk, nor stores one
        max_chunk_bytes=settings.max_chunk_bytes,
    )


def _source(name: str, tier: str, backend: RemotePool, spec: LinkSpec | None) -> Source:
    spec = spec or LinkSpec(name)
    link = LinkEstimator(
        name,
        rtt_s=spec.rtt_seconds,
        bandwidth_bytes_per_s=spec.bandwidth_bytes_per_second,
        override=spec.override,
        emulated_delay_s=spec.delay_seconds,
    )
    return Source(name, tier, backend, link, EmulatedDelay(spec.delay_seconds))


def open_remote(
    settings: AgentSettings, store: TieredStore, *, emit: Callable[[dict[str, Any]], None]
) -> RemoteTiers:
    specs = {s.name: s for s in settings.links}
    token = settings.remote_token or settings.token
    pool = (
        _source("pool", POOL_TIER, open_pool(settings), specs.get("pool"))
        if settings.pool
        else None
    )
    peers = [
        _source(
            name,
            PEER_TIER,
            AgentSource(addr, token=token, max_chunk_bytes=settings.max_chunk_bytes),
            specs.get(name),
        )
        for name, addr in settings.peers
    ]
    return RemoteTiers(
        store,
        pool=pool,
        peers=peers,
        prefill=prefill_rate(settings),
        write_through=settings.pool_write == "through",
        emit=emit,
        index=open_index(settings),
        node_name=settings.name,
    )


def open_index(settings: AgentSettings) -> IndexClient | None:
    """The router's fleet index the lookups ask which peers to probe (None: probe them all)."""
    if not settings.index_url:
        return None
    return IndexClient(
        settings.index_url,
        token=settings.index_token or settings.remote_token or settings.token or None,
        timeout_s=settings.index_timeout_seconds,
    )
