"""A seeded workload that sets no retention, and the digest of everything it makes a manager say.

The digest covers each step's delta, its response and its journal record, and
every cache event, all as bytes on the wire or in the journal, and the
replica's journal file past its header. It is what a manager said before the
retention API existed, so a test can hold today's manager to it.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from kv_manager_service import wire
from kv_manager_service.core import AllocateOp, AllocateStatus, DecodeBatch, ForkOp, FreeOp, KVCacheConfig, KVCacheManager
from kv_manager_service.server import journal_records
from kv_manager_service.server.journal import Journal
from kv_manager_service.server.journal_records import StepApplied
from kv_manager_service.server.replica import Replica

CONFIGS = {
    "one group": {"num_blocks": 40, "groups": [{"kind": "full_attention", "block_size": 4}]},
    "hybrid": {
        "num_blocks": 48,
        "groups": [
            {"kind": "full_attention", "block_size": 4},
            {"kind": "sliding_window", "block_size": 2, "sliding_window": 6},
        ],
    },
    "host tier": {"num_blocks": 24, "groups": [{"kind": "full_attention", "block_size": 4}], "num_host_blocks": 16},
}


def run(config_name: str, seed: int, num_steps: int, journal_path: Path) -> str:
    """The hex digest of one seeded run through a journaled replica (see the module docstring)."""
    config = KVCacheConfig.from_dict({**CONFIGS[config_name], "enable_events": True})
    journal = Journal.open(journal_path, "golden", "pool", "never", compact_bytes=0)
    replica = Replica(KVCacheManager(config), "golden", 1, journal=journal, check_invariants=True)
    rng = random.Random(seed)
    documents = [[rng.randrange(6) for _ in range(40)] for _ in range(3)]
    digest = hashlib.sha256()
    live: list[str] = []
    next_id = 0
    num_events = 0
    for _ in range(num_steps):
        ops = []
        used: set[str] = set()
        for _ in range(rng.randrange(3)):
            kind = rng.random()
            if kind < 0.5 or not live:
                request_id = f"r{next_id}"
                next_id += 1
                prompt = rng.choice(documents)[: rng.randrange(1, 30)] + [rng.randrange(6) for _ in range(rng.randrange(3))]
                ops.append(AllocateOp(request_id, prompt, rng.randrange(1, len(prompt) + 1)))
                used.add(request_id)
            elif kind < 0.8:
                victims = [r for r in live if r not in used][: rng.randrange(1, 3)]
                if victims:
                    ops.append(FreeOp(victims))
                    used.update(victims)
            else:
                parents = [r for r in live if r not in used]
                if parents:
                    child = f"r{next_id}"
                    next_id += 1
                    ops.append(ForkOp(parents[0], [child]))
                    used.update((parents[0], child))
        manager = replica.manager
        decoding = [
            r for r in live if r not in used and manager.requests[r].num_tokens < 36 and rng.random() < 0.7
        ]
        decode = DecodeBatch(decoding, [rng.randrange(6) for _ in decoding]) if decoding else None
        result = replica.step(ops, decode)
        for op, op_result in zip(ops, result.results):
            if type(op) is AllocateOp and op_result.status is AllocateStatus.OK and op.request_id not in live:
                live.append(op.request_id)
            elif type(op) is FreeOp:
                live = [r for r in live if r not in op.request_ids]
            elif type(op) is ForkOp:
                live += op.child_request_ids
        digest.update(wire.step_delta(result.delta).SerializeToString())
        digest.update(wire.step_response(result).SerializeToString())
        digest.update(journal_records.encode(StepApplied(ops, decode, None)).SerializeToString())
        for sequence, (_, event) in replica.events.read(num_events + 1, 1 << 20, 0):
            digest.update(wire.kv_event(event, sequence, "golden", 1).SerializeToString())
        num_events = replica.events.last_id
        if rng.random() < 0.3:
            replica.reset_prefix_cache()
    journal.close()
    records = Journal.open(journal_path, "golden", "pool", "never", compact_bytes=0).records
    for record in records:
        digest.update(record.SerializeToString())
    return digest.hexdigest()
