"""What one running agent holds: its settings, store, event hub and metrics.

The control API, the data plane and the tests all take an ``AgentRuntime``; only ``daemon``
starts servers around it. The data plane reaches the store only through the runtime's methods
(reads that may go past this node to the pool or peers, puts, leases), so every path into the
store from the network is written here once.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kvctl import __version__
from kvctl.agent import tier_retry
from kvctl.agent.events import EventHub
from kvctl.agent.metrics import AgentMetrics
from kvctl.agent.settings import AgentSettings, ModelSpec
from kvctl.agent.tier_retry import TierRetry
from kvctl.errors import InvalidArgument
from kvctl.format import format_bytes
from kvctl.paths import make_private_dir
from kvctl.remote.federation import FetchPlanner
from kvctl.remote.fetchplan import EngineRates, PrefillModel, PrefillSample
from kvctl.store.errors import DirectoryInUse, TierUnavailable
from kvctl.store.keys import Namespace
from kvctl.store.store import TieredStore
from kvctl.store.tiers import hugepages
from kvctl.store.tiers.absent import AbsentTier
from kvctl.store.tiers.base import Tier, byte_view, copy_bytes
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from kvctl.wire.protocol import DATA_PLANE_FEATURES
from kvctl.wire.reports import (
    AgentInfo,
    AgentStats,
    DataDir,
    TierUsage,
    UnavailableTier,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvctl.nvml import GpuReading, NvmlReader, NvmlStatus
    from kvctl.remote.federation import RemoteTiers
    from kvctl.store.errors import KeyNotFound
    from kvctl.store.index import Entry, LookupResult
    from kvctl.store.tiers.base import Buffer
    from kvctl.store.tiers.cpu import Lease
    from kvctl.store.tiers.gpu import GpuTier

log = logging.getLogger("kvctl.agent")
#: the gpu tier's owner key for the cpu tier's arena
_CPU_ARENA = "cpu-arena"


class AgentRuntime:
    #: the gpu tier when there is one (``open`` sets it): host regions are registered with it
    gpu_tier: GpuTier | None = None
    #: stops the gpu tier following the cpu arena (``_register_cpu_arena``); ``close`` calls it
    _unfollow_cpu_arena: Callable[[], None] | None = None

    def __init__(self, settings: AgentSettings, store: TieredStore) -> None:
        self.store = store
        self.settings = settings  # before anything reads it: tells the store who is isolated
        self.events = EventHub()
        self._unsubscribe = store.subscribe(self.events.publish)
        self.started_s = time.time()
        self.metrics = AgentMetrics(store, started_s=self.started_s)
        #: fetch or recompute for every lookup, local tiers included; engines feed it their
        #: measured rates (data-plane RATES), the pool and peers share it (``open``)
        self.planner = FetchPlanner(
            store,
            prefill=_fallback_prefill(settings),
            rates=EngineRates(),
            disk_read_bytes_per_s=settings.disk_read_bytes_per_second or None,
            emit=self.events.publish,
        )
        self.metrics.add_plan_source(self.planner.counters)
        self._models = {m.id: m for m in settings.models}
        #: addresses the servers actually bound (port 0 in the settings becomes a real port)
        self.bound: dict[str, str | None] = {}
        #: opened on first use: most agents are never asked, and NVML init costs a driver call
        self._nvml: NvmlReader | None = None
        self._nvml_lock = threading.Lock()
        #: the pool and peers, when configured (``open`` builds them; tests may pass none)
        self.remote: RemoteTiers | None = None
        #: tiers the settings ask for that this machine cannot have (a gpu tier without CUDA);
        #: listed in ``info``
        self.unavailable_tiers: list[UnavailableTier] = []
        #: tries a disk tier that could not be opened at start again (``open`` starts it);
        #: its tier is listed in ``info`` as unavailable until it is online
        self.disk_retry: TierRetry | None = None

    @property
    def settings(self) -> AgentSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: AgentSettings) -> None:
        """Replacing the settings (a configuration reload) keeps the store's isolated tenants
        in step: an isolated tenant must never see another tenant's chunk, even for a moment."""
        self.store.set_isolated_tenants(settings.isolated_tenants)
        self._settings = settings

    @classmethod
    def open(
        cls,
        settings: AgentSettings,
        *,
        disk_retry_first_s: float = tier_retry.FIRST_S,
        disk_retry_max_s: float = tier_retry.MAX_S,
    ) -> AgentRuntime:
        """Build the tiers the settings ask for: gpu (when asked for and CUDA is here), cpu
        (shared memory when enabled), then disk. A disk tier whose directory cannot be used
        is tried again in the background, every ``disk_retry_first_s`` doubling up to
        ``disk_retry_max_s``, and comes online once it opens (``TierRetry``)."""
        data = settings.data_path
        make_private_dir(data, "data directory")
        tiers: list[Tier] = []
        unavailable: list[UnavailableTier] = []
        gpu_tier: GpuTier | None = None
        try:
            if settings.gpu_capacity_bytes > 0:
                gpu = _open_gpu_tier(settings)
                if isinstance(gpu, str):
                    unavailable.append(
                        {
                            "name": "gpu",
                            "capacity_bytes": settings.gpu_capacity_bytes,
                            "device": settings.gpu_device,
                            "reason": gpu,
                        }
                    )
                else:
                    tiers.append(gpu)
                    gpu_tier = gpu
            tiers.append(CpuTier(settings.cpu_bytes, shared=settings.shm))
            if settings.disk_bytes > 0:
                disk = _open_disk_tier(settings, data / "disk")
                # an absent tier keeps its place (and name, tier code, counters) until it opens
                tiers.append(
                    AbsentTier("disk", settings.disk_bytes, disk) if isinstance(disk, str) else disk
                )
        except BaseException:
            for t in tiers:
                t.close()
            raise
        try:
            store = TieredStore(
                tiers,
                eviction=settings.eviction,
                admission={"disk": settings.disk_admission} if settings.disk_bytes > 0 else None,
                chunk_tokens=settings.chunk_tokens,
                isolated_tenants=settings.isolated_tenants,
                defer_accesses=True,  # a lookup's reply does not wait for the policy
                bypass_unreachable=settings.bypass_unreachable,
            )
        except BaseException:
            for t in tiers:
                t.close()
            raise
        runtime = cls(settings, store)
        runtime.unavailable_tiers = unavailable
        _say_arena_pages(runtime.shm_tier)
        _say_disk_room(tiers)
        if "disk" in store.absent_tiers:
            runtime.disk_retry = TierRetry(
                store,
                "disk",
                lambda: DiskTier(
                    data / "disk", store.tier("disk").capacity_bytes, fsync=settings.fsync
                ),
                first_s=disk_retry_first_s,
                max_s=disk_retry_max_s,
                on_online=lambda tier: _say_disk_room([tier]),
            )
            runtime.disk_retry.start()
        if gpu_tier is not None:
            runtime.gpu_tier = gpu_tier
            runtime._unfollow_cpu_arena = _register_cpu_arena(gpu_tier, store)
        if settings.pool or settings.peers:
            from kvctl.agent.remote import open_remote  # redis only when a pool is configured

            try:
                runtime.remote = open_remote(settings, store, emit=runtime.events.publish)
            except BaseException:
                runtime.close()
                raise
            runtime.remote.planner = runtime.planner  # one set of rates and counters per node
            sources = runtime.remote.sources
            runtime.metrics.add_remote_sources(lambda: [s.status() for s in sources])
            runtime.metrics.add_index(runtime.remote.index_status)
        return runtime

    # --- reads that reach past this node when a pool or peers are configured -----------------
    def lookup(self, keys: Sequence[bytes], *, tenant: str = "") -> LookupResult:
        """The prefix worth fetching rather than recomputing (``FetchPlanner``): an engine that
        follows the answer recomputes the rest. Counts hits for that prefix only."""
        if self.remote is None:
            return self.planner.lookup(keys, tenant=tenant)
        return self.remote.lookup(keys, tenant=tenant)

    def report_rates(
        self,
        samples: Sequence[PrefillSample],
        *,
        host_to_device_bytes_per_s: float | None = None,
        model: str = "",
    ) -> int:
        """An engine's measured prefill timings and host -> device bandwidth (``RATES``); how
        many samples were kept (outliers against the model's fit are not)."""
        return self.planner.rates.report(
            samples, host_to_device_bytes_per_s=host_to_device_bytes_per_s, model=model
        )

    def locate(self, keys: Sequence[bytes], *, tenant: str = "") -> list[str | None]:
        if self.remote is None:
            return self.store.locate(keys, tenant=tenant)
        return self.remote.locate(keys, tenant=tenant)

    def fill(self, keys: Sequence[bytes], *, tenant: str = "") -> int:
        """Bring chunks that are not local from the pool or peers (0 without them)."""
        return 0 if self.remote is None else self.remote.fill(keys, tenant=tenant)

    def model(self, model_id: str | None) -> ModelSpec:
        """The named model, or the first configured one when ``model_id`` is None."""
        if model_id is None:
            return self.settings.models[0]
        try:
            return self._models[model_id]
        except KeyError:
            raise InvalidArgument(
                f"unknown model {model_id!r}; this agent knows {', '.join(self._models)}"
            ) from None

    def namespace(self, model_id: str | None, tenant: str) -> Namespace:
        """Key namespace of a request: isolated tenants get their own salt, others share."""
        spec = self.model(model_id)
        salt = tenant if tenant in self.settings.isolated_tenants else ""
        return Namespace(spec.id, spec.layout, salt)

    def is_isolated(self, tenant: str) -> bool:
        return tenant in self.settings.isolated_tenants

    # --- writes and leases: the data plane's way into the store -----------------------------
    def put(
        self,
        key: bytes,
        data: Buffer,
        *,
        tokens: int | None,
        tenant: str,
        parent: bytes | None,
        depth: int,
        priority: int,
        pinned: bool,
        isolated: bool,
    ) -> str | None:
        """Store a client's chunk; the tier it landed in, or None when a policy declined it
        (or ``bypass_unreachable`` turned it away).
        An isolated tenant's chunks are isolated whatever the client's flag says.

        A new chunk bound for the lease tier's arena is copied there without the store's lock
        (``TieredStore.reserve_put``: its place is reserved under the lock, the bytes copied
        outside it, then committed), so a large put never holds up another thread's reads and
        lookups for its copy. Anything else (a pin, a key cached already, a chunk another tier
        takes or a policy declines) is a plain ``put``, with its semantics unchanged."""
        store = self.store
        isolated = isolated or self.is_isolated(tenant)
        if not pinned:
            view = byte_view(data)
            slot = store.reserve_put(
                key,
                view.nbytes,
                tokens=tokens,
                tenant=tenant,
                parent=parent,
                depth=depth,
                priority=priority,
                isolated=isolated,
            )
            if slot is not None:
                try:
                    copy_bytes(slot.view, view)  # without the store's lock, or the GIL
                except BaseException:
                    store.abort_put(slot)
                    raise
                return store.commit_put(slot)
        return store.put(
            key,
            data,
            tokens=tokens,
            tenant=tenant,
            parent=parent,
            depth=depth,
            priority=priority,
            pinned=pinned,
            isolated=isolated,
        )

    def get(self, key: bytes, *, tenant: str) -> bytearray:
        """A copy of a local chunk (raises KeyNotFound)."""
        return self.store.get(key, tenant=tenant)

    def get_uncounted(self, key: bytes, *, tenant: str) -> bytearray:
        """``get`` of a chunk ``lease_many`` already counted as served (it could not lease it);
        see ``TieredStore.get_uncounted``."""
        return self.store.get_uncounted(key, tenant=tenant)

    def lease_many(
        self, keys: Sequence[bytes], ttl_s: float, *, tenant: str, served: bool = True
    ) -> list[Lease | KeyNotFound | None]:
        """Hold local chunks in place in the shared (cpu) tier; see ``TieredStore.lease_many``."""
        return self.store.lease_many(keys, ttl_s, tenant=tenant, served=served)

    def leased_view(self, lease: Lease) -> memoryview:
        return self.store.leased_view(lease)

    def release(self, lease_ids: Sequence[int]) -> int:
        return self.store.release(lease_ids)

    def expire_leases(self) -> int:
        return self.store.expire_leases()

    def cached_entries(self, keys: Sequence[bytes], *, tenant: str) -> list[Entry | None]:
        """Each key's index entry where it is cached here and visible to ``tenant`` (None
        elsewhere), read under one hold of the store's lock."""
        store = self.store
        with store.locked():
            tiers = store.locate(keys, tenant=tenant)
            return [
                None if tier is None else store.entry(key)
                for key, tier in zip(keys, tiers, strict=True)
            ]

    @property
    def served_tier_names(self) -> list[str]:
        """Local tiers, then the remote ones lookups can report (the pool, peers)."""
        return [*self.store.tier_names, *self.store.external_tier_names]

    @property
    def shm_tier(self) -> CpuTier | None:
        """The cpu tier local clients read from in place, when it is shared (under a gpu tier,
        not the top one)."""
        tier = self.store.lease_tier
        return tier if tier is not None and tier.shared else None

    def map_shm_arena(self, tier: CpuTier) -> tuple[int, int, int]:
        """(a read-only descriptor, generation, size in bytes) of the shared arena, read
        together under the store's lock; the caller closes the descriptor."""
        with self.store.locked():
            return tier.reader_fd(), tier.generation, max(tier.capacity_bytes, 1)

    # --- what the control API and HELLO report -------------------------------------------------
    def usage(self) -> dict[str, TierUsage]:
        # the store builds these entries; tests/unit/test_reports.py holds them to the wire shape
        return cast("dict[str, TierUsage]", self.store.usage())

    def stats(self) -> AgentStats:
        """Counters and usage from one snapshot of the store, with the fetch-or-recompute
        decisions (and the pool and peers, when configured)."""
        snap = self.store.snapshot()
        read_chunks, read_missing_chunks = self.metrics.read_counts()
        out: AgentStats = {
            "stats": snap["stats"],
            "usage": snap["usage"],
            "leases": snap["leases"],
            "read_bandwidth_bytes_per_second": snap["read_bandwidth_bytes_per_second"],
            "hit_ratio": snap["stats"]["hit_ratio"],
            "started_s": self.started_s,
            "fetch_plans": self.planner.status(),
            "policies": snap["policies"],
            # as on /metrics (kvctl_dataplane_corrupt_puts_total, _no_room_puts_total, ...)
            "dataplane": {
                "corrupt_puts": self.metrics.corrupt_puts,
                "no_room_puts": self.metrics.no_room_puts,
                # kvctl_dataplane_read_chunks_total of an engine's ops (get, lease), all
                # outcomes; and missing only
                "read_chunks": read_chunks,
                "read_missing_chunks": read_missing_chunks,
            },
        }
        if self.remote is not None:
            out["remote"] = self.remote.status()
        return out

    def info(self) -> AgentInfo:
        s = self.settings
        tcp = s.data_host_port
        shm = self.shm_tier
        offline: list[UnavailableTier] = [
            {"name": name, "reason": reason, "offline": True}
            for name, reason in self.store.offline_tiers.items()
        ]
        absent: list[UnavailableTier] = []
        retry = self.disk_retry
        for name, reason in self.store.absent_tiers.items():
            entry: UnavailableTier = {
                "name": name,
                "reason": reason,
                "capacity_bytes": self.store.tier(name).capacity_bytes,
                "device": str(s.data_path / name),
            }
            if retry is not None and retry.name == name:
                entry["tries"] = retry.tries
                if retry.next_try_s is not None:
                    entry["next_try_s"] = retry.next_try_s
            absent.append(entry)
        return {
            "name": s.name,
            "dc": s.dc,
            "version": __version__,
            "pid": os.getpid(),
            "started_s": self.started_s,
            "chunk_tokens": s.chunk_tokens,
            "max_chunk_bytes": s.max_chunk_bytes,
            "eviction": s.eviction,
            "tiers": [{"name": name, **u} for name, u in self.usage().items()],
            # tiers never opened, tiers not opened yet (tried again), then tiers that failed in
            # service (puts go to the next one)
            "unavailable_tiers": [*self.unavailable_tiers, *absent, *offline],
            "models": [
                {
                    "id": m.id,
                    "layers": m.layers,
                    "kv_heads": m.kv_heads,
                    "head_dim": m.head_dim,
                    "dtype": m.dtype,
                    "bytes_per_token": m.layout.bytes_per_token,
                    "chunk_bytes": m.layout.bytes_per_token * s.chunk_tokens,
                }
                for m in s.models
            ],
            "isolated_tenants": list(s.isolated_tenants),
            "role": s.role,
            "remote": None if self.remote is None else self.remote.describe(),
            "dataplane": {
                "tcp": self.bound.get("tcp", None if tcp is None else f"{tcp[0]}:{tcp[1]}"),
                "unix": self.bound.get(
                    "unix", None if s.socket_path is None else str(s.socket_path)
                ),
                "shm": s.shm and s.socket_path is not None,
                "shm_huge_page_bytes": None if shm is None else shm.huge_page_bytes(),
                "shmem_huge_pages": hugepages.shmem_mode(),
                # the HELLO's capabilities, so `kvctl doctor` can tell builds apart: they all
                # report the same package version
                "features": dict(DATA_PLANE_FEATURES),
            },
            "auth": bool(s.token),
            "data_dir": _disk(s.data_path),
        }

    def retry_tier(self, name: str) -> dict[str, Any]:
        """Try tier ``name`` once now, for an operator who just fixed it: an absent tier (a
        disk tier that could not be opened at start) is opened as its backoff would later; an
        offline one (taken offline by a failed put) is written to (``TieredStore.
        retry_offline``: a disk tier writes a page) and is back online when that works, where
        the store would wait for a put after its retry delay. Answers the tier's state after
        the call ("online", "absent" or "offline", with the reason), whether this call made a
        try (``retried``; not for a tier that was online), the tries so far and when the next
        one comes by itself (absent tiers). Raises InvalidArgument for a tier this agent does
        not have (a gpu tier this machine cannot have, named with its reason)."""
        store = self.store
        for gone in self.unavailable_tiers:
            if gone["name"] == name:
                raise InvalidArgument(
                    f"the {name} tier is unavailable on this machine ({gone['reason']}): it is "
                    "not tried again while the agent runs; restart the agent once that is fixed"
                )
        store.tier(name)  # InvalidArgument naming the tiers there are
        retry = self.disk_retry
        if retry is not None and retry.name != name:
            retry = None
        retried = False
        if name in store.absent_tiers:
            if retry is None:  # (every absent tier has one; a runtime built by hand may not)
                raise InvalidArgument(f"the {name} tier is absent and has no retry")
            retried = retry.attempt() != "was_online"
        elif name in store.offline_tiers:
            store.retry_offline(name)
            retried = True
        absent = store.absent_tiers.get(name)
        offline = store.offline_tiers.get(name)
        state = "absent" if absent is not None else "offline" if offline is not None else "online"
        return {
            "tier": name,
            "state": state,
            "online": state == "online",
            "retried": retried,
            "reason": absent if absent is not None else offline,
            "tries": None if retry is None else retry.tries,
            "next_try_s": retry.next_try_s if retry is not None and absent is not None else None,
            "usage": self.usage().get(name),
        }

    def gpus(self) -> tuple[NvmlStatus, list[GpuReading]]:
        """NVML's status and one reading per GPU ([] when NVML is unavailable). A failed open
        is retried on the next call, so a driver loaded after the agent started is picked up."""
        from kvctl.nvml import NvmlReader  # pynvml only when GPUs are asked about

        with self._nvml_lock:
            if self._nvml is None:
                self._nvml = NvmlReader()
            status = self._nvml.open()  # no-op once open; never raises
            return status, self._nvml.read()

    def close(self) -> None:
        if self.disk_retry is not None:
            self.disk_retry.close()
        if self.remote is not None:
            self.remote.close()
        self._unsubscribe()
        with self._nvml_lock:
            if self._nvml is not None:
                self._nvml.close()
                self._nvml = None
        unfollow, self._unfollow_cpu_arena = self._unfollow_cpu_arena, None
        if unfollow is not None:  # first, so the cpu tier can close its arena whatever the order
            unfollow()
        self.store.close()  # the gpu tier unregisters its other host regions as it closes

    def register_host_region(
        self, owner: object, buffer: mmap.mmap | Buffer, *, read_only: bool
    ) -> bool:
        """Let the gpu tier copy straight from (unless ``read_only``, also into) ``buffer``, a
        mapping such as a client's staging segment, until ``owner`` is collected or
        ``unregister_host_region(owner)``; re-registering an owner replaces its region. False
        without a gpu tier or when CUDA refuses (logged; copies are then staged). Never raises
        for CUDA's sake. While registered the mapping stays in place (``close`` raises
        BufferError), so unregister before closing it."""
        gpu = self.gpu_tier
        return gpu is not None and gpu.register_host_region(owner, buffer, read_only=read_only)

    def unregister_host_region(self, owner: object) -> bool:
        gpu = self.gpu_tier
        return gpu is not None and gpu.unregister_host_region(owner)


def _say_arena_pages(shm: CpuTier | None) -> None:
    """Once at start: a shared arena on small pages costs every engine fetch (hugepages)."""
    if shm is None or shm.capacity_bytes <= 1:
        return
    huge = shm.huge_page_bytes()
    if huge == 0:
        log.info(
            "shared arena on 4 KiB pages (shmem_enabled %s): engines copy out of it more "
            "slowly than out of huge pages; `kvctl doctor` says how to allow them",
            hugepages.shmem_mode() or "N/A",
        )


def _say_disk_room(tiers: list[Tier]) -> None:
    """Once at start: a disk tier larger than its filesystem can hold never reaches its
    capacity: once the filesystem is full it evicts its own chunks for new ones (evictions
    reason "filesystem"); the operator learns why here."""
    for tier in tiers:
        if not isinstance(tier, DiskTier):
            continue
        room = tier.room_bytes()
        if room is not None and tier.capacity_bytes > room:
            log.warning(
                "disk tier %s: capacity %s, but %s has %s free (the tier holds %s): past "
                "that the tier evicts its own chunks when the filesystem fills (counted as "
                "filesystem_full); lower --disk or free space",
                tier.name,
                format_bytes(tier.capacity_bytes),
                tier.directory,
                format_bytes(room - tier.used_bytes),
                format_bytes(tier.used_bytes),
            )


def _register_cpu_arena(gpu: GpuTier, store: TieredStore) -> Callable[[], None] | None:
    """Register the cpu tier's arena with the gpu tier, which follows it across resizes: chunks
    moving between the two (demotions, lease moves) then cross the bus in one copy. Returns what
    undoes it (None when nothing was registered).

    A resize replaces the arena, and the cpu tier cannot close the old mapping while the
    registration holds it: registered again only before the gpu tier's next copy, an idle gpu
    tier would keep the old arena pinned and mapped beside the new one. So the registration
    follows the arena at once: the cpu tier calls back with the new arena in place and the old
    one still mapped, the registry registers the new and lets go of the old, and the cpu tier
    then releases it (a sender still holding a slice keeps it mapped until it lets go). The new
    arena of a resize is registered (pinned: ~0.3-0.4 s a GiB, read off first-lease delays on an
    H200, not timed directly) as soon as it is mapped, while
    the chunks are copied in without the store's lock, so the replacement under the lock swaps
    registrations and unregisters the old arena (unpinning: not measured here; still under the
    lock)."""
    cpu = store.lease_tier
    if not isinstance(cpu, CpuTier):
        return None
    started_s = time.perf_counter()
    if not gpu.follow_host_region(_CPU_ARENA, cpu.arena_mapping, read_only=False):
        return None
    log.info(
        "cpu arena (%d bytes) registered with CUDA for the gpu tier in %.3f s",
        cpu.capacity_bytes,
        time.perf_counter() - started_s,
    )

    def follow() -> None:
        gpu.host_registry.refresh()
        if not any(r["owner"] == _CPU_ARENA for r in gpu.host_regions()):
            log.warning("resized cpu arena not registered with CUDA: copies are staged")

    def prepare(arena: mmap.mmap, generation: int, given_up: bool) -> None:
        if given_up:
            gpu.host_registry.discard(_CPU_ARENA, arena, generation)
        else:  # pinned while the resize copies, off the store's lock; ``follow`` takes it
            gpu.host_registry.prepare(_CPU_ARENA, arena, generation)

    remove_hook = cpu.on_arena_replaced(follow)
    remove_prepare = cpu.on_arena_prepared(prepare)

    def undo() -> None:
        remove_prepare()
        remove_hook()
        gpu.unregister_host_region(_CPU_ARENA)

    return undo


def _fallback_prefill(settings: AgentSettings) -> PrefillModel:
    """The configured prefill rate, else the modeled one (``prefill_rate``), as a model with
    its inputs; both leave attention out (beta = 0) until engines report measured samples."""
    from kvctl.agent.remote import prefill_rate

    rate = prefill_rate(settings)
    if settings.prefill_tokens_per_second > 0:
        return rate.as_model(setting="prefill_tokens_per_second")
    return rate.as_model(model=settings.models[0].id, gpu=settings.gpu)


def _open_gpu_tier(settings: AgentSettings) -> GpuTier | str:
    """The gpu tier, or why this machine cannot have one (logged once, here). A device that is
    present but too small for the capacity raises CapacityError: that is a wrong size, not a
    missing GPU."""
    from kvctl.store.tiers.gpu import GpuTier, gpu_available  # torch only when a gpu is asked for

    ok, detail = gpu_available(settings.gpu_device)
    if not ok:
        log.warning(
            "gpu tier unavailable, starting without it: %s (asked for %d bytes on %s)",
            detail,
            settings.gpu_capacity_bytes,
            settings.gpu_device,
        )
        return detail
    tier = GpuTier(settings.gpu_capacity_bytes, settings.gpu_device)
    log.info("gpu tier: %d bytes on %s", settings.gpu_capacity_bytes, detail)
    return tier


def _open_disk_tier(settings: AgentSettings, directory: Path) -> DiskTier | str:
    """The disk tier, or why its directory cannot be used at all (logged once, here): the
    agent then starts without it, as without a gpu tier, rather than not at all (the cpu tier
    still serves; under systemd a failed start is a restart loop). Chunk files it cannot read
    are skipped by the tier itself. Another agent holding the directory still stops the start
    (DirectoryInUse), as do a wrong size and an interrupt."""
    try:
        return DiskTier(directory, settings.disk_bytes, fsync=settings.fsync)
    except DirectoryInUse:
        raise
    except TierUnavailable as exc:
        log.warning(
            "disk tier unavailable, starting without it (it is tried again in the background "
            "and comes online once its directory is usable): %s (asked for %s in %s)",
            exc,
            format_bytes(settings.disk_bytes),
            directory,
        )
        return str(exc)


def _disk(path: Path) -> DataDir:
    """Free and total bytes of the filesystem holding ``path`` and the directory's permission
    bits (None when unreadable), for `kvctl doctor` (it warns when others can read them)."""
    try:
        mode: int | None = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        mode = None
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return {"path": str(path), "free_bytes": None, "total_bytes": None, "mode": mode}
    return {"path": str(path), "free_bytes": usage.free, "total_bytes": usage.total, "mode": mode}
