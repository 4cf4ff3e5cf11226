"""Benchmarks of the pure core, side by side with vLLM's published figures.

Runs six measurements in one process and prints a markdown table, the
command line and the machine:

1. decode: 256 live requests with 1000-token prompts, 200 decode steps of
   `manager.step([AllocateOp(rid, [token], 1), ...])` (token append and block
   hashing included; building the op list is not timed).
2. prefix hit: 1000 requests of a shared 2048-token prefix plus 128 unique
   tokens: `find_cache_hit` (hashing + lookup), the lookup alone over
   precomputed hashes (what vLLM's ~87 us covers), and admit + free.
3. alloc/free: `BlockPool.get_new_blocks(64)` and `free_blocks` on a
   100k-block pool.
4. hashing: `BlockHasher.hash_blocks` (C chain, and without each C
   extension) against an in-run re-implementation of vLLM's sha256_cbor path
   (cbor2 + hashlib, one `hash_block_tokens` call per block), on the same
   tokens; the bytes must be identical.
5. memory: tracemalloc bytes of pool + prefix index per cached block.
6. trace replay: the first N Mooncake requests through `replay.replay`.

Each timed figure is the median over rounds of the per-round median; the
spread column shows the lowest and highest round medians. The vLLM column
comes from docs/architecture.md, "vLLM reference figures" (measured elsewhere); only the hashing
re-implementation is measured in this run. In the "vLLM / ours" column
> 1 means ours is faster or smaller.

With --vllm-python and --vllm-source (an interpreter with vLLM's Python
dependencies and the folder holding vLLM's source, e.g. from the baselines
kit), benchmark 4 also runs vLLM's own block hashing (`Request` +
`get_request_block_hasher` with `sha256_cbor`) in a subprocess on the same
tokens, alternating with ours round by round, and checks that its digests are
ours byte for byte. With --vllm-baseline as well (the kit's
vllm_step_baseline.py), every decode round is followed by one run of vLLM's
own manager on the same shape (256 requests, 1000-token prompts, as many
steps). The ratios ours / vLLM are taken per round; rows give their medians.

    python bench/core_bench.py            # full run, under a minute on 2 cores
    python bench/core_bench.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from kv_manager_service.core import (
    AllocateOp,
    AllocateStatus,
    BlockHasher,
    DecodeBatch,
    HashAlgorithm,
    KVCacheConfig,
    KVCacheManager,
)
from kv_manager_service.core import hashing
from kv_manager_service.core.block_pool import BlockPool
from kv_tooling.replay import ReplayConfig, replay
from kv_tooling.workload import DEFAULT_TRACE, TokenExpander, load_trace

from bench_stats import busy_machine_warning, fmt, replay_progress_printer  # bench/ is the script's own folder

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
VOCAB_SIZE = 150_000

# docs/architecture.md, "vLLM reference figures": vLLM 0.33's in-process core, 2 cores, Python 3.11.
VLLM_DECODE_US_PER_REQUEST = 4.7
VLLM_DECODE_STEP_MS = 1.35
VLLM_SHA256_CBOR_US_PER_BLOCK = 3.5
VLLM_LOOKUP_128_US = 87.0
VLLM_BYTES_PER_CACHED_BLOCK = 290.0

# Targets of the same-run ratios ours / vLLM's own code (lower is better).
TARGET_HASHING_RATIO = 0.1
TARGET_DECODE_RATIO = 0.45

now_ns = time.perf_counter_ns


@dataclass(frozen=True)
class Row:
    """One line of the report. `vllm / value > 1` means ours is faster or smaller."""

    section: str
    metric: str
    value: float
    unit: str
    spread: tuple[float, float] | None = None
    vllm: float | None = None
    note: str = ""


def summarize(round_medians: Sequence[float]) -> tuple[float, tuple[float, float]]:
    return statistics.median(round_medians), (min(round_medians), max(round_medians))


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def warm_token_memo() -> None:
    """Bring the core's token encoding to the state of a long-running manager.

    Without the C encoder, `hashing` memoises each token id's CBOR bytes. A
    server that has run for a while holds the whole vocabulary there, and a
    lookup then misses the CPU caches; a memo just filled by the benchmark's
    own tokens would measure a cache-warm best case instead. With the C
    encoder (the default when built) the memo is unused and this is harmless.
    """
    num_blocks = -(-VOCAB_SIZE // BLOCK_SIZE)
    hashing.encode_blocks_py(list(range(num_blocks * BLOCK_SIZE)), BLOCK_SIZE, num_blocks, b"", b"")


def hash_without_c(hasher: BlockHasher, tokens: list[int], without_encoder: bool) -> list[bytes]:
    """`hasher.hash_blocks` as it runs where the C chain (and with `without_encoder`, the C encoder
    too) was not built."""
    built = hashing.encode_blocks, hashing.hash_chain
    hashing.hash_chain = hashing.hash_chain_py
    if without_encoder:
        hashing.encode_blocks = hashing.encode_blocks_py
    try:
        return hasher.hash_blocks(hasher.root_hash, tokens)
    finally:
        hashing.encode_blocks, hashing.hash_chain = built


def target_note(ratio: float, target: float) -> str:
    return f"target <= {target}x ({'met' if ratio <= target else 'MISSED'})"


# -- vLLM's own code, in its own interpreter ---------------------------------------


@dataclass(frozen=True)
class VllmInstall:
    """An interpreter with vLLM's Python dependencies, vLLM's source folder, and optionally the
    baselines kit's `vllm_step_baseline.py` (N P D -> one JSON line with `step_ms_p50`)."""

    python: Path
    source: Path
    step_baseline: Path | None = None

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(self.source)}
        env.pop("PYTHONHASHSEED", None)  # vLLM's root hash then uses the fixed seed "vllm-none-hash"
        return env

    def decode_step_ms(self, num_requests: int, prompt_len: int, num_steps: int) -> float:
        """The median whole decode step of one run of vLLM's own manager."""
        assert self.step_baseline is not None
        done = subprocess.run(
            [str(self.python), str(self.step_baseline), str(num_requests), str(prompt_len), str(num_steps)],
            capture_output=True, text=True, env=self.environment(), cwd=self.source, timeout=600, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"the vLLM step baseline failed ({done.returncode}): {done.stderr[-2000:]}")
        return float(json.loads(done.stdout.strip().splitlines()[-1])["step_ms_p50"])


# Runs in vLLM's interpreter. Reads [block_size, token ids] once, then for every line it reads hashes
# all full blocks of one request with vLLM's own request block hasher and prints the time taken and
# a digest of the hashes. The Request has no hasher of its own, so its block_hashes stay empty and
# every call hashes the whole prompt from the root.
VLLM_HASHING_PROGRAM = """
import hashlib, json, sys, time
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

block_size, token_ids = json.loads(sys.stdin.readline())
init_none_hash(sha256_cbor)
hash_request_blocks = get_request_block_hasher(block_size, sha256_cbor)
params = SamplingParams(max_tokens=1)
params.update_from_generation_config({}, eos_token_id=None)
request = Request("bench", token_ids, params, None)
print("ready", flush=True)
for _ in sys.stdin:
    start = time.perf_counter_ns()
    hashes = hash_request_blocks(request)
    elapsed_ns = time.perf_counter_ns() - start
    digest = hashlib.sha256(b"".join(hashes)).hexdigest()
    print(json.dumps({"ns": elapsed_ns, "num_blocks": len(hashes), "digest": digest}), flush=True)
"""


class VllmHashing:
    """vLLM's own sha256_cbor block hashing of one fixed prompt, in a long-lived subprocess."""

    def __init__(self, install: VllmInstall, block_size: int, token_ids: list[int]) -> None:
        self._process = subprocess.Popen(
            [str(install.python), "-c", VLLM_HASHING_PROGRAM],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=install.environment(), cwd=install.source,
        )  # fmt: skip
        self._send(json.dumps([block_size, token_ids]))
        if self._receive() != "ready":
            raise RuntimeError("vLLM's hashing subprocess did not start")

    def hash_once(self) -> tuple[float, int, str]:
        """(ns, number of blocks, sha256 hex of the concatenated hashes) of one timed call."""
        self._send("hash")
        report = json.loads(self._receive())
        return report["ns"], report["num_blocks"], report["digest"]

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=60)

    def _send(self, line: str) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()

    def _receive(self) -> str:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM's hashing subprocess exited ({self._process.wait(timeout=60)})")
        return line.strip()


# -- 1. decode -------------------------------------------------------------------


def decode_round(
    prompts: Sequence[list[int]], num_steps: int, profiler: Any = None, columnar: bool = False
) -> list[int]:
    """Admit every prompt, then `num_steps` decode steps; returns each step's ns.

    A step is a list of allocate ops, or with `columnar` the same entries as a DecodeBatch (what the
    server applies for a Step's decode columns); building either is not timed."""
    num_requests = len(prompts)
    max_len = len(prompts[0]) + num_steps
    manager = KVCacheManager(KVCacheConfig(num_requests * -(-max_len // BLOCK_SIZE) + 64))
    request_ids = [f"decode-{i}" for i in range(num_requests)]
    for request_id, prompt in zip(request_ids, prompts):
        assert manager.allocate(request_id, prompt, len(prompt)).status is AllocateStatus.OK
    step_ns = []
    if profiler is not None:
        profiler.start()
    for step in range(num_steps):
        tokens = [(i * 7919 + step) % VOCAB_SIZE for i in range(num_requests)]
        if columnar:
            batch = DecodeBatch(request_ids, tokens)
            start = now_ns()
            result = manager.step((), decode=batch)
            step_ns.append(now_ns() - start)
            assert all(status is AllocateStatus.OK for status in result.decode.statuses)
            continue
        ops = [AllocateOp(rid, [token], 1) for rid, token in zip(request_ids, tokens)]
        start = now_ns()
        result = manager.step(ops)
        step_ns.append(now_ns() - start)
        assert all(r.status is AllocateStatus.OK for r in result.results)
    if profiler is not None:
        profiler.stop()
    assert manager.block_table(request_ids[0]).num_computed_tokens == max_len
    return step_ns


def bench_decode(
    rounds: int, num_requests: int, prompt_len: int, num_steps: int, vllm: VllmInstall | None = None
) -> list[Row]:
    """Our decode rounds; with `vllm`, each followed by one run of vLLM's own manager."""
    rng = random.Random(1)
    prompts = [random_tokens(rng, prompt_len) for _ in range(num_requests)]
    decode_round(prompts, min(num_steps, 20))  # warm-up
    decode_round(prompts, min(num_steps, 20), columnar=True)
    step_medians: list[float] = []
    batch_medians: list[float] = []
    vllm_per_request: list[float] = []
    for round_index in range(rounds):
        step_medians.append(statistics.median(decode_round(prompts, num_steps)))
        batch_medians.append(statistics.median(decode_round(prompts, num_steps, columnar=True)))
        if vllm is not None:
            vllm_per_request.append(vllm.decode_step_ms(num_requests, prompt_len, num_steps) * 1e3 / num_requests)
            print(f"  decode round {round_index + 1}/{rounds}: ours {step_medians[-1] / num_requests / 1e3:.2f} "
                  f"(DecodeBatch {batch_medians[-1] / num_requests / 1e3:.2f}), "
                  f"vLLM {vllm_per_request[-1]:.2f} us per request-step", file=sys.stderr)
    step_ns, (lo, hi) = summarize(step_medians)
    per_request = [s / num_requests / 1e3 for s in step_medians]
    per_entry = [s / num_requests / 1e3 for s in batch_medians]
    rows = [
        Row("1 decode", "per request-step, the same steps as one DecodeBatch each", statistics.median(per_entry), "us",
            (min(per_entry), max(per_entry)), VLLM_DECODE_US_PER_REQUEST, "what the server applies for a Step"),
    ]
    if vllm_per_request:
        vllm_value, vllm_spread = summarize(vllm_per_request)
        rows.append(Row("1 decode", f"vLLM's own manager, per request-step (step_ms_p50 / {num_requests}), this run",
                        vllm_value, "us", vllm_spread, note="vllm_step_baseline.py after each of our rounds"))
        for form, ours in (("allocate ops", per_request), ("DecodeBatch", per_entry)):
            ratio, ratio_spread = summarize([a / b for a, b in zip(ours, vllm_per_request)])
            rows.append(Row("1 decode", f"**ours ({form}) / vLLM's own, per request-step, same round**", ratio, "x",
                            ratio_spread, note=target_note(ratio, TARGET_DECODE_RATIO)))
    return [
        Row(
            "1 decode",
            f"per request-step ({num_requests} reqs, {prompt_len}-token prompts)",
            statistics.median(per_request),
            "us",
            (min(per_request), max(per_request)),
            VLLM_DECODE_US_PER_REQUEST,
        ),
        Row(
            "1 decode",
            f"whole {num_requests}-request step (median of {num_steps} steps)",
            step_ns / 1e6,
            "ms",
            (lo / 1e6, hi / 1e6),
            VLLM_DECODE_STEP_MS if num_requests == 256 else None,
        ),
        *rows,
    ]


def profile_decode(path: Path, num_requests: int, prompt_len: int, num_steps: int) -> None:
    """One decode round under pyinstrument; the text report goes to `path`."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        raise SystemExit("--profile-decode needs pyinstrument: pip install pyinstrument")
    rng = random.Random(1)
    prompts = [random_tokens(rng, prompt_len) for _ in range(num_requests)]
    profiler = Profiler(interval=0.0001)
    decode_round(prompts, num_steps, profiler)
    path.write_text(profiler.output_text(unicode=True, color=False, show_all=False))


# -- 2. prefix hit ---------------------------------------------------------------


def bench_prefix_hit(rounds: int, num_requests: int, prefix_len: int, suffix_len: int) -> list[Row]:
    rng = random.Random(2)
    prefix = random_tokens(rng, prefix_len)
    prompts = [prefix + random_tokens(rng, suffix_len) for _ in range(num_requests)]
    warm_prompt = prefix + random_tokens(rng, suffix_len)
    num_hit_blocks = prefix_len // BLOCK_SIZE
    num_blocks = (prefix_len + (num_requests + 1) * (suffix_len + BLOCK_SIZE)) // BLOCK_SIZE + 64
    find_medians, lookup_medians, admit_medians, free_medians, both_medians = [], [], [], [], []
    for round_index in range(rounds + 1):  # round 0 warms up
        manager = KVCacheManager(KVCacheConfig(num_blocks))
        manager.allocate("warm", warm_prompt, len(warm_prompt))
        manager.free(["warm"])
        hashes = [manager.hasher.hash_blocks(manager.hasher.root_hash, p) for p in prompts]
        find_ns, lookup_ns, admit_ns, free_ns, both_ns = [], [], [], [], []
        for prompt in prompts:
            start = now_ns()
            hit = manager.find_cache_hit(prompt)
            find_ns.append(now_ns() - start)
            assert len(hit.block_ids[0]) == num_hit_blocks, hit.num_cached_tokens
        find_longest_cache_hit = manager.coordinator.find_longest_cache_hit
        for prompt, block_hashes in zip(prompts, hashes):
            start = now_ns()
            blocks, _ = find_longest_cache_hit(block_hashes, len(prompt) - 1)
            lookup_ns.append(now_ns() - start)
            assert len(blocks[0]) == num_hit_blocks
        for i, prompt in enumerate(prompts):
            request_id = f"hit-{i}"
            start = now_ns()
            result = manager.allocate(request_id, prompt, len(prompt))
            middle = now_ns()
            manager.free([request_id])
            end = now_ns()
            assert result.num_computed_tokens == prefix_len
            admit_ns.append(middle - start)
            free_ns.append(end - middle)
            both_ns.append(end - start)
        assert manager.stats().num_evictions == 0
        if round_index:
            for medians, samples in (
                (find_medians, find_ns),
                (lookup_medians, lookup_ns),
                (admit_medians, admit_ns),
                (free_medians, free_ns),
                (both_medians, both_ns),
            ):
                medians.append(statistics.median(samples) / 1e3)
    section = "2 prefix hit"
    shape = f"{num_hit_blocks}-block hit, {prefix_len}+{suffix_len} tokens"
    rows = []
    for metric, medians, vllm, note in (
        (f"lookup only, precomputed hashes ({shape})", lookup_medians, VLLM_LOOKUP_128_US,
         "coordinator.find_longest_cache_hit; vLLM's figure is this part"),
        (f"find_cache_hit: hash + lookup ({shape})", find_medians, None, "public query, hashes the prompt"),
        ("first allocate after a hit (admit)", admit_medians, None,
         "validate + hash the prompt, adopt the hit, allocate 8 blocks"),
        ("free after the hit", free_medians, None, ""),
        ("admit + free", both_medians, None, ""),
    ):
        value, spread = summarize(medians)
        rows.append(Row(section, metric, value, "us", spread, vllm if num_hit_blocks == 128 else None, note=note))
    return rows


# -- 3. alloc / free -------------------------------------------------------------


def bench_alloc_free(rounds: int, num_blocks: int, batch: int, num_batches: int) -> list[Row]:
    pool = BlockPool(num_blocks, 1, True, False)
    assert num_batches * batch < num_blocks
    get_medians, free_medians, sum_medians = [], [], []
    for round_index in range(rounds + 1):
        get_ns, free_ns = [], []
        batches = []
        for _ in range(num_batches):
            start = now_ns()
            blocks = pool.get_new_blocks(batch)
            get_ns.append(now_ns() - start)
            batches.append(blocks)
        for blocks in batches:
            start = now_ns()
            pool.free_blocks(reversed(blocks))
            free_ns.append(now_ns() - start)
        assert pool.get_num_free_blocks() == num_blocks - 1
        if round_index:
            get_medians.append(statistics.median(get_ns) / 1e3)
            free_medians.append(statistics.median(free_ns) / 1e3)
            sum_medians.append(get_medians[-1] + free_medians[-1])
    section = "3 alloc/free"
    value, spread = summarize(sum_medians)
    get_value, get_spread = summarize(get_medians)
    free_value, free_spread = summarize(free_medians)
    return [
        Row(section, f"get_new_blocks({batch})", get_value, "us", get_spread),
        Row(section, f"free_blocks({batch})", free_value, "us", free_spread),
        Row(section, f"get + free per batch of {batch} ({num_blocks:,}-block pool)", value, "us", spread),
        Row(section, "get + free per block", value / batch, "us", (spread[0] / batch, spread[1] / batch)),
    ]


# -- 4. hashing ------------------------------------------------------------------


def vllm_sha256_cbor(value: Any) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 of canonical CBOR."""
    import cbor2

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def make_vllm_hasher() -> Callable[[list[int], int], list[bytes]]:
    """A faithful re-implementation of vLLM V1's per-request block hashing (no extra keys)."""
    import cbor2

    dumps, sha256 = cbor2.dumps, hashlib.sha256

    def sha256_cbor(value: Any) -> bytes:
        return sha256(dumps(value, canonical=True)).digest()

    # vLLM's init_none_hash with PYTHONHASHSEED="vllm-none-hash".
    none_hash = sha256_cbor("vllm-none-hash")

    def hash_block_tokens(
        hash_function: Callable[[Any], bytes],
        parent_block_hash: bytes | None,
        curr_block_token_ids: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
    ) -> bytes:
        if not parent_block_hash:
            parent_block_hash = none_hash
        curr_block_token_ids_tuple = tuple(curr_block_token_ids)
        return hash_function((parent_block_hash, curr_block_token_ids_tuple, extra_keys))

    def request_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
        hashes: list[bytes] = []
        parent = None
        start = 0
        while start + block_size <= len(token_ids):
            block_hash = hash_block_tokens(sha256_cbor, parent, token_ids[start : start + block_size], None)
            hashes.append(block_hash)
            parent = block_hash
            start += block_size
        return hashes

    return request_block_hashes


def bench_hashing(rounds: int, num_blocks: int, vllm: VllmInstall | None = None) -> list[Row]:
    hasher = BlockHasher(BLOCK_SIZE)
    # The test vector of docs/architecture.md ("Block hashing"), and vLLM's root with the same seed.
    expected = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"
    assert hasher.hash_blocks(hasher.root_hash, list(range(16)))[0].hex() == expected
    assert hasher.root_hash == vllm_sha256_cbor("vllm-none-hash")
    vllm_hashes = make_vllm_hasher()
    rng = random.Random(4)
    tokens = random_tokens(rng, num_blocks * BLOCK_SIZE)
    ours = hasher.hash_blocks(hasher.root_hash, tokens)
    theirs = vllm_hashes(tokens, BLOCK_SIZE)
    assert ours == theirs, "hash bytes differ from vLLM's sha256_cbor"
    ours_digest = hashlib.sha256(b"".join(ours)).hexdigest()
    xxh3 = BlockHasher(BLOCK_SIZE, HashAlgorithm.XXH3_128, seed="bench-secret")
    assert hash_without_c(hasher, tokens, without_encoder=False) == ours
    assert hash_without_c(hasher, tokens, without_encoder=True) == ours
    own = VllmHashing(vllm, BLOCK_SIZE, tokens) if vllm is not None else None

    def per_block_us(run: Callable[[], object]) -> float:
        start = now_ns()
        run()
        return (now_ns() - start) / 1e3 / num_blocks

    series: dict[str, list[float]] = {
        name: [] for name in ("ours", "no_chain", "python", "xxh3", "reimpl", "own", "reimpl_ratio", "own_ratio")
    }
    try:
        if own is not None:
            own.hash_once()  # warm-up
        for _ in range(rounds):
            series["python"].append(per_block_us(lambda: hash_without_c(hasher, tokens, without_encoder=True)))
            series["no_chain"].append(per_block_us(lambda: hash_without_c(hasher, tokens, without_encoder=False)))
            series["ours"].append(per_block_us(lambda: hasher.hash_blocks(hasher.root_hash, tokens)))
            series["xxh3"].append(per_block_us(lambda: xxh3.hash_blocks(xxh3.root_hash, tokens)))
            series["reimpl"].append(per_block_us(lambda: vllm_hashes(tokens, BLOCK_SIZE)))
            series["reimpl_ratio"].append(series["reimpl"][-1] / series["ours"][-1])
            if own is not None:
                ns, num_hashed, digest = own.hash_once()
                assert num_hashed == num_blocks and digest == ours_digest, "vLLM's own hashes differ from ours"
                series["own"].append(ns / 1e3 / num_blocks)
                series["own_ratio"].append(series["ours"][-1] / series["own"][-1])
    finally:
        if own is not None:
            own.close()
    figures = {name: summarize(values) for name, values in series.items() if values}
    chain = "C chain" if hashing.hash_chain is not hashing.hash_chain_py else "C CHAIN NOT BUILT"
    encoder = "C encoder" if hashing.encode_blocks is not hashing.encode_blocks_py else "C ENCODER NOT BUILT"
    section = "4 hashing"

    def row(name: str, metric: str, unit: str = "us/block", vllm_figure: float | None = None, note: str = "") -> Row:
        value, spread = figures[name]
        return Row(section, metric, value, unit, spread, vllm_figure, note)

    rows = [
        row("ours", f"BlockHasher.hash_blocks, sha256_cbor, {chain} ({num_blocks} blocks, vocab 150k)",
            vllm_figure=VLLM_SHA256_CBOR_US_PER_BLOCK, note=f"bytes identical to vLLM on all {num_blocks} blocks"),
        row("no_chain", f"BlockHasher.hash_blocks, sha256_cbor, without the C chain ({encoder} + Python loop)",
            vllm_figure=VLLM_SHA256_CBOR_US_PER_BLOCK, note="no OpenSSL headers at build time"),
        row("python", "BlockHasher.hash_blocks, sha256_cbor, pure Python (no C compiler)",
            vllm_figure=VLLM_SHA256_CBOR_US_PER_BLOCK, note="memo holding the whole vocabulary"),
        row("xxh3", "BlockHasher.hash_blocks, xxh3_128 with a secret seed (same tokens)"),
        row("reimpl", "vLLM sha256_cbor re-implementation (cbor2 + hashlib), this run"),
        row("reimpl_ratio", "speed-up vs the re-implementation, same round", "x", note="target >= 3x"),
    ]
    if own is not None:
        own_ratio = figures["own_ratio"][0]
        rows += [
            row("own", "vLLM's own request block hasher (sha256_cbor), subprocess, this run",
                note=f"sha256 of all {num_blocks} hashes equal to ours"),
            row("own_ratio", "**ours / vLLM's own, same round**", "x",
                note=target_note(own_ratio, TARGET_HASHING_RATIO)),
        ]
    return rows


# -- 5. memory -------------------------------------------------------------------


def bench_memory(num_cached_blocks: int, blocks_per_request: int) -> list[Row]:
    """tracemalloc around building a pool and caching `num_cached_blocks` through real requests."""
    rng = random.Random(5)
    num_requests = num_cached_blocks // blocks_per_request
    num_cached_blocks = num_requests * blocks_per_request
    prompts = [random_tokens(rng, blocks_per_request * BLOCK_SIZE) for _ in range(num_requests)]
    gc.collect()  # the token-encoding memo was filled before tracing, by warm_token_memo
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    manager = KVCacheManager(KVCacheConfig(num_cached_blocks + 1))
    empty = tracemalloc.get_traced_memory()[0] - base
    for i, prompt in enumerate(prompts):
        assert manager.allocate(f"mem-{i}", prompt, len(prompt)).status is AllocateStatus.OK
        manager.free([f"mem-{i}"])
    gc.collect()
    total = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    stats = manager.stats()
    assert stats.usage == 0 and stats.num_evictions == 0
    assert sum(len(c) for c in manager.pool.cached) == num_cached_blocks
    section = "5 memory"
    return [
        Row(section, f"pool + index per cached block ({num_cached_blocks:,} blocks cached, then freed)",
            total / num_cached_blocks, "bytes", vllm=VLLM_BYTES_PER_CACHED_BLOCK),
        Row(section, "of which the empty pool, per block", empty / num_cached_blocks, "bytes"),
        Row(section, "of which hash + index entry, per cached block", (total - empty) / num_cached_blocks, "bytes"),
    ]


# -- 6. trace replay -------------------------------------------------------------


def bench_replay(
    rounds: int, trace: Path, num_requests: int, num_blocks: int, token_budget: int, max_running: int
) -> list[Row]:
    records = load_trace(trace, limit=num_requests)
    expander = TokenExpander()
    for record in records:  # fill the SHAKE-128 memo: workload generation is not the manager's time
        expander.prompt_token_ids(record)
    config = ReplayConfig(token_budget=token_budget, max_num_running=max_running, progress_every_steps=2000)

    results = []
    for round_index in range(rounds):
        manager = KVCacheManager(KVCacheConfig(num_blocks))
        result = replay(manager, records, expander, config, replay_progress_printer("replay", len(records), manager))
        assert result.num_completed == len(records) and manager.stats().usage == 0
        print(f"  replay round {round_index + 1}/{rounds}: {result.wall_s:.1f} s", file=sys.stderr)
        results.append(result)
    first = results[0]
    rps, rps_spread = summarize([r.requests_per_s for r in results])
    wall, wall_spread = summarize([r.wall_s for r in results])
    tokens_per_s = [(r.num_prompt_tokens + r.num_output_tokens) / r.wall_s for r in results]
    section = "6 trace replay"
    shape = (f"first {len(records)} Mooncake requests, block {BLOCK_SIZE}, {num_blocks:,}-block pool, "
             f"budget {token_budget}, <= {max_running} running")
    return [
        Row(section, f"prefix-hit rate ({shape})", first.prefix_hit_rate * 100, "%",
            note=f"{first.prefix_cache_hits:,} of {first.prefix_cache_queries:,} tokens"),
        Row(section, "requests per second", rps, "req/s", rps_spread),
        Row(section, "prompt + output tokens per second", statistics.median(tokens_per_s), "tok/s",
            (min(tokens_per_s), max(tokens_per_s)),
            note=f"{first.num_prompt_tokens:,} prompt + {first.num_output_tokens:,} output tokens"),
        Row(section, "wall time", wall, "s", wall_spread, note=f"{first.num_steps:,} steps"),
        Row(section, "peak usage", first.peak_usage * 100, "%"),
        Row(section, "preemptions", first.num_preemptions, ""),
    ]


# -- report ----------------------------------------------------------------------


def render(rows: Sequence[Row], command: str, seconds: float, rounds: int, trace_rounds: int) -> str:
    lines = [
        "# Core benchmarks",
        "",
        f"Command: `{command}`",
        "",
        f"Python {platform.python_version()} ({platform.python_implementation()}), {platform.system()} "
        f"{platform.machine()}, {os.cpu_count()} CPUs; {rounds} timed rounds after a warm-up "
        f"({trace_rounds} for the trace replay); medians of per-round medians; total {seconds:.0f} s.",
        "",
        "| # | metric | ours | unit | spread (round medians) | vLLM | vLLM / ours | note |",
        "|---|---|---:|---|---|---:|---:|---|",
    ]
    for row in rows:
        spread = f"{fmt(row.spread[0])} - {fmt(row.spread[1])}" if row.spread else ""
        vllm = fmt(row.vllm) if row.vllm is not None else ""
        ratio = f"{row.vllm / row.value:.2f}x" if row.vllm is not None and row.value else ""
        cells = (row.section, row.metric, fmt(row.value), row.unit, spread, vllm, ratio, row.note)
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "vLLM column: vLLM 0.33's in-process core as recorded in docs/architecture.md (not measured in this",
        "run); the in-run comparisons are the sha256_cbor re-implementation in section 4 and, with --vllm-*,",
        "the rows of vLLM's own code (ratios ours / vLLM per round, lower is better). vLLM / ours > 1: ours is",
        "faster or smaller. Decode excludes building the op list; replay excludes expanding trace ids into tokens",
        "(memoised first).",
        "Before any section the core's token-encoding memo holds the whole 150k vocabulary, keyed by other int",
        "objects than the measured tokens: the steady state of a long-running manager (see warm_token_memo).",
    ]
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run: fewer rounds and smaller sizes")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per benchmark (default 7, quick 2)")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (default: %(default)s)")
    parser.add_argument("--trace-requests", type=int, default=None, help="requests to replay (default 400, quick 40)")
    parser.add_argument("--trace-pool-blocks", type=int, default=200_000, help="replay pool size (default %(default)s)")
    parser.add_argument("--trace-token-budget", type=int, default=8192,
                        help="replay tokens per step (default %(default)s)")
    parser.add_argument("--trace-max-running", type=int, default=256,
                        help="replay running requests (default %(default)s)")
    parser.add_argument("--trace-rounds", type=int, default=None, help="replay rounds (default 3, quick 1)")
    parser.add_argument("--only", default="1,2,3,4,5,6", help="comma-separated benchmark numbers to run")
    parser.add_argument("--profile-decode", type=Path, default=None,
                        help="also profile one decode round with pyinstrument and write the text report here")
    vllm = parser.add_argument_group("vLLM's own code, run in every round for same-run ratios")
    vllm.add_argument("--vllm-python", type=Path, help="an interpreter with vLLM's Python dependencies")
    vllm.add_argument("--vllm-source", type=Path,
                      help="the folder holding vLLM's source (vllm/), put on PYTHONPATH; goes with --vllm-python")
    vllm.add_argument("--vllm-baseline", type=Path,
                      help="the baselines kit's vllm_step_baseline.py (N P D -> JSON step_ms_p50), for decode; "
                           "needs the other two")
    return parser


def vllm_install(parser: argparse.ArgumentParser, args: argparse.Namespace) -> VllmInstall | None:
    """The --vllm-* options, checked: python and source together, the baseline only with them."""
    if (args.vllm_python is None) != (args.vllm_source is None):
        parser.error("--vllm-python and --vllm-source go together")
    if args.vllm_baseline is not None and args.vllm_python is None:
        parser.error("--vllm-baseline needs --vllm-python and --vllm-source")
    for name, path in (("--vllm-python", args.vllm_python), ("--vllm-source", args.vllm_source),
                       ("--vllm-baseline", args.vllm_baseline)):
        if path is not None and not path.exists():
            parser.error(f"{name} {path}: no such file or folder")
    if args.vllm_python is None:
        return None
    return VllmInstall(args.vllm_python, args.vllm_source.resolve(), args.vllm_baseline)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    vllm = vllm_install(parser, args)
    quick = args.quick
    rounds = args.rounds or (2 if quick else 7)
    trace_rounds = args.trace_rounds or (1 if quick else 3)
    trace_requests = args.trace_requests or (40 if quick else 400)
    only = {int(x) for x in args.only.split(",")}
    started = now_ns()
    warm_token_memo()
    rows: list[Row] = []
    plan: list[tuple[int, str, Callable[[], list[Row]]]] = [
        (1, "decode", lambda: bench_decode(
            rounds, 256, 1000, 50 if quick else 200, vllm if vllm and vllm.step_baseline else None)),
        (2, "prefix hit", lambda: bench_prefix_hit(rounds, 100 if quick else 1000, 2048, 128)),
        (3, "alloc/free", lambda: bench_alloc_free(rounds, 100_000, 64, 100 if quick else 1000)),
        (4, "hashing", lambda: bench_hashing(rounds, 200 if quick else 4000, vllm)),
        (5, "memory", lambda: bench_memory(8192 if quick else 65536, 256 if quick else 1024)),
        (6, "trace replay", lambda: bench_replay(
            trace_rounds, args.trace, trace_requests, args.trace_pool_blocks, args.trace_token_budget,
            args.trace_max_running)),
    ]
    for number, name, run in plan:
        if number in only:
            print(f"[{number}] {name} ...", file=sys.stderr, flush=True)
            section_start = now_ns()
            rows += run()
            print(f"[{number}] {name}: {(now_ns() - section_start) / 1e9:.1f} s", file=sys.stderr, flush=True)
    if args.profile_decode is not None:
        profile_decode(args.profile_decode, 256, 1000, 50 if quick else 200)
    command = shlex.join(["python", *sys.argv])
    print(render(rows, command, (now_ns() - started) / 1e9, rounds, trace_rounds))
    spreads = [(f"[{row.section}] {row.metric}", row.value, *row.spread) for row in rows if row.spread]
    warning = busy_machine_warning(spreads, os.getloadavg()[0], os.cpu_count() or 1)
    if warning:
        print("\n" + warning)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
