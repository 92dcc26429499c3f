"""vLLM's KV manager with KV events off and on, over a kv_cache_bench trace (run by the
peer venv's Python; kv_cache_bench.py starts it when the peer is present).

    <peer python> benchmarks/peer_kv_events.py --trace FILE --peer-scripts DIR [--repeat 3]

The peer's own replay (bench_kv.py in DIR) runs unchanged; with events on, its
KVCacheManager is built with enable_kv_cache_events=True and, once per step (an op for
a request already seen in the step opens the next one, as in kv_cache_bench), its events
are taken and encoded as vLLM's ZeroMQ publisher encodes them (msgpack KVEventBatch; the
publisher does it on its own thread, under the same GIL). That work is timed inside the
allocate call that opens the step, with the step bookkeeping (a set per step, about 1% of
the replay). Off and on alternate; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--peer-scripts", type=Path, required=True, help="the dir of bench_kv.py")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    sys.path.insert(0, str(a.peer_scripts))
    import bench_kv  # the peer's replay, unchanged
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.core import kv_cache_manager

    ops = [json.loads(line) for line in a.trace.read_text().splitlines() if line.strip()]
    manager_cls = kv_cache_manager.KVCacheManager
    build = manager_cls.__init__
    encode = msgspec.msgpack.Encoder().encode
    events_on = [False]
    batches = [0]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["enable_kv_cache_events"] = events_on[0]
        build(self, *args, **kwargs)
        if not events_on[0]:
            return
        step: set[str] = set()
        allocate = self.allocate_slots

        def allocate_and_publish(request: Any, *args: Any, **kwargs: Any) -> Any:
            rid = request.request_id
            if rid in step:
                events = self.take_events()
                if events:
                    encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=None))
                    batches[0] += 1
                step.clear()
            step.add(rid)
            return allocate(request, *args, **kwargs)

        self.allocate_slots = allocate_and_publish

    manager_cls.__init__ = init

    def seconds(run: dict[str, Any]) -> float:
        return run["kv_manager_seconds"] + run["request_hashing_seconds"]

    pairs = []
    for i in range(a.repeat):
        events_on[0] = False
        off = seconds(bench_kv.replay(ops))
        events_on[0] = True
        batches[0] = 0
        on = seconds(bench_kv.replay(ops))
        pairs.append((off, on))
        print(f"[peer_kv_events] pair {i + 1}: off {off:.3f} s, on {on:.3f} s", file=sys.stderr)
    print(
        json.dumps(
            {
                "impl": "vllm KVCacheManager, enable_kv_cache_events",
                "seconds_off": [round(off, 6) for off, _ in pairs],
                "seconds_on": [round(on, 6) for _, on in pairs],
                "overhead": round(statistics.median(on / off for off, on in pairs) - 1, 4),
                "seconds_added": round(statistics.median(on - off for off, on in pairs), 6),
                "batches_published": batches[0],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
