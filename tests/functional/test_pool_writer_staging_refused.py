"""The pool writer's staging buffer (c5092fc) is one 256 MiB mapping, virtual until copied into,
but the whole of it counts against a process's address-space limit (RLIMIT_AS, systemd's
LimitAS=) and against strict overcommit (vm.overcommit_memory=2), where a chunk's own buffer
counted only its bytes. Refused, it failed every batch: no chunk reached the pool again. A
node writing through to a real Redis pool, in a process whose RLIMIT_AS leaves room for its
chunks but not for the mapping."""

from __future__ import annotations

from tests.functional.child_report import child_report

CHILD = r"""
import hashlib, json, resource, sys, time
from kvctl.remote import federation
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier

url, prefix = sys.argv[1], sys.argv[2]
size = 64 << 10
store = TieredStore([CpuTier(64 * size)], chunk_tokens=16)
backend = RedisPool(url, prefix=prefix, capacity_bytes=64 << 20)
pool = Source("pool", POOL_TIER, backend, LinkEstimator("pool", override="fetch"))
remote = RemoteTiers(store, pool=pool, prefill=PrefillRate(1e4, "configured"))
backend.usage()  # connected, its buffers allocated, before the limit
remote.start()
time.sleep(0.5)  # the writer's thread and stack exist
with open("/proc/self/status") as f:
    vm_bytes = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
# room for the chunks and far more, not for the staging mapping
room_bytes = federation._WRITE_BATCH_BYTES // 2
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + room_bytes, resource.RLIM_INFINITY))
keys = [hashlib.blake2b(b"as:%d" % i, digest_size=16).digest() for i in range(5)]
for i, k in enumerate(keys):
    store.put(k, bytes([i + 1]) * size, tokens=16, tenant="t1")
deadline = time.monotonic() + 30
while remote.write.total() < len(keys) and time.monotonic() < deadline:
    time.sleep(0.05)
got = backend.get_many(keys, tenant="t1")
same = [c is not None and c.data.tobytes() == bytes([i + 1]) * size for i, c in enumerate(got)]
print(json.dumps({"write": dict(remote.write), "same": same}))
remote.close()
"""


def test_the_writer_still_writes_where_its_staging_mapping_is_refused(
    redis_url: str, redis_prefix: str
) -> None:
    report, stderr = child_report(CHILD, redis_url, redis_prefix)
    assert report["write"] == {"written": 5}, (report, stderr[-3000:])
    assert report["same"] == [True] * 5
    # said once, not a traceback per batch
    assert stderr.count("no staging buffer") == 1, stderr[-3000:]
    assert "Traceback" not in stderr
