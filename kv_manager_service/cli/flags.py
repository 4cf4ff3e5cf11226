"""The flags `serve` and `replay` share: the pool's shape (`add_pool_flags`, `build_config`) and
security (`add_security_flags`, `security_options`). Each flag is parsed and validated here, once."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Mapping

from kv_manager_service.shared.arg_types import non_negative_int, positive_int
from kv_manager_service.shared.config import EvictionPolicy, GroupKind, GroupSpec, KVCacheConfig
from kv_manager_service.shared.hash_types import HashAlgorithm


def add_pool_flags(
    parser: argparse.ArgumentParser, default_num_blocks: int, reference_orders: Mapping[str, str] = {}
) -> None:
    """Flags that shape the pool; `build_config` turns them into a KVCacheConfig. `reference_orders`
    (name: help) are more --eviction-policy choices that the caller handles itself (the replay's oracles)."""
    group = parser.add_argument_group("pool")
    group.add_argument(
        "--config",
        type=Path,
        help="YAML or JSON file with num_blocks, groups ([{kind, block_size, sliding_window, chunk_size}]), "
        "hashing and limits; flags override it",
    )
    group.add_argument("--num-blocks", type=int, help=f"blocks in the pool, null block included (default {default_num_blocks})")
    group.add_argument(
        "--block-size", type=int, help="tokens per block of a single full-attention group (default 16); "
        "an error when --config lists groups"
    )
    group.add_argument("--no-prefix-caching", action="store_true", help="never reuse cached blocks")
    group.add_argument(
        "--hash-algorithm",
        choices=[a.value for a in HashAlgorithm],
        help="block hash (default sha256_cbor; xxh3_128 needs --hash-seed)",
    )
    group.add_argument("--hash-seed", help="seed of the root hash; the secret key of xxh3_128")
    group.add_argument(
        "--num-host-blocks", type=non_negative_int,
        help="blocks of a host-memory tier behind the pool (write-back on eviction; full-attention groups "
        "only); 0 means none (default: the config file's num_host_blocks, else 0)",
    )  # fmt: skip
    group.add_argument(
        "--retention-max-pinned-blocks", type=non_negative_int, metavar="N",
        help="blocks that requests' retention TTLs may pin at once, all pins together (docs/retention.md); "
        "a pin takes what room is left, and a prompt that alone fills more is refused; 0 turns pins off "
        "(default: the config file's retention_max_pinned_blocks, else a tenth of --num-blocks)",
    )  # fmt: skip
    group.add_argument(
        "--max-expected-blocks", type=non_negative_int, metavar="N",
        help="hash blocks that expected requests' prompts (expect ops) may keep at once, all together; an "
        "expectation past the room keeps the prefix that fits; 0 ignores expect ops (default: the config "
        "file's max_expected_blocks, else 16 per pool block)",
    )  # fmt: skip
    group.add_argument(
        "--eviction-policy", choices=[p.value for p in EvictionPolicy] + list(reference_orders), metavar="POLICY",
        help="which free cached block is reused first: lru, the least recently used (vLLM's order); "
        "frequency, the one whose hash was seen least often, in a history of 4 hashes per block that "
        "outlives eviction, least recently used among equals"
        + "".join(f"; {name}, {text}" for name, text in reference_orders.items())
        + ". Retention priorities come first either way (default: the config file's eviction_policy, else lru)",
    )  # fmt: skip
    parser.set_defaults(default_num_blocks=default_num_blocks)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """TLS, bearer tokens, tenants and Redis credentials; `security_options` reads them. Secrets come from files only."""
    group = parser.add_argument_group("security (see docs/security.md)")
    group.add_argument("--tls-cert", type=Path, metavar="FILE", help="serve gRPC over TLS with this certificate chain (PEM)")
    group.add_argument("--tls-key", type=Path, metavar="FILE", help="the private key of --tls-cert (PEM)")
    group.add_argument(
        "--tls-ca", type=Path, metavar="FILE",
        help="mutual TLS: require every client to present a certificate signed by this CA (PEM)",
    )  # fmt: skip
    group.add_argument(
        "--auth-token-file", type=Path, metavar="FILE",
        help="require 'authorization: Bearer <token>' on every call but health checks: a YAML/JSON mapping "
        "tenant -> token (or -> {token, role: tenant|operator, quota_blocks}), or one token (tenant 'default', "
        "operator role)",
    )  # fmt: skip
    group.add_argument(
        "--multi-tenant", action="store_true",
        help="isolate the token file's tenants: their own cache salts, request ids and block quotas "
        "(needs --auth-token-file and --tenant-secret-file; refuses xxh3_128)",
    )  # fmt: skip
    group.add_argument(
        "--tenant-secret-file", type=Path, metavar="FILE",
        help="the secret that keys each tenant's cache salt (at least 16 bytes); replicas of one deployment share it",
    )  # fmt: skip
    group.add_argument(
        "--tenant-quota-blocks", type=positive_int, metavar="N",
        help="blocks a tenant may hold, unless its token entry sets quota_blocks (default: no quota)",
    )  # fmt: skip
    group.add_argument("--redis-tls-ca", type=Path, metavar="FILE", help="CA that signed Redis's certificate (rediss:// URLs)")
    group.add_argument(
        "--redis-password-file", type=Path, metavar="FILE",
        help="Redis AUTH password, read from a file (instead of redis://:PASSWORD@host in --redis-url)",
    )  # fmt: skip


def security_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerOptions fields of `add_security_flags`, with their files read."""
    from kv_manager_service.shared import security

    return dict(
        tls=security.server_tls(args.tls_cert, args.tls_key, args.tls_ca),
        tokens=security.load_token_file(args.auth_token_file) if args.auth_token_file else None,
        multi_tenant=args.multi_tenant,
        tenant_secret=(
            security.read_secret_file(args.tenant_secret_file, "--tenant-secret-file") if args.tenant_secret_file else None
        ),
        tenant_quota_blocks=args.tenant_quota_blocks,
        redis_tls_ca=args.redis_tls_ca,
        redis_password=(
            security.read_secret_file(args.redis_password_file, "--redis-password-file", min_bytes=1).decode()
            if args.redis_password_file
            else None
        ),
    )


def build_config(args: argparse.Namespace, **overrides: Any) -> KVCacheConfig:
    """The one place where the config file, the flags and `overrides` meet."""
    values: dict[str, Any] = {}
    if args.config is not None:
        values = _load_config_file(args.config)
    if args.block_size is not None:
        if "groups" in values:
            raise ValueError(f"--block-size defines a single full-attention group, but {args.config} lists groups")
        values["groups"] = (GroupSpec(GroupKind.FULL_ATTENTION, args.block_size),)
    if args.num_blocks is not None:
        values["num_blocks"] = args.num_blocks
    values.setdefault("num_blocks", args.default_num_blocks)
    if args.no_prefix_caching:
        values["enable_prefix_caching"] = False
    if args.hash_algorithm is not None:
        values["hash_algorithm"] = args.hash_algorithm
    if args.hash_seed is not None:
        values["hash_seed"] = args.hash_seed
    if args.num_host_blocks is not None:
        values["num_host_blocks"] = args.num_host_blocks
    if args.retention_max_pinned_blocks is not None:
        values["retention_max_pinned_blocks"] = args.retention_max_pinned_blocks
    if args.max_expected_blocks is not None:
        values["max_expected_blocks"] = args.max_expected_blocks
    if args.eviction_policy in {p.value for p in EvictionPolicy}:  # else a reference order its command handles
        values["eviction_policy"] = args.eviction_policy
    values.update(overrides)
    return KVCacheConfig.from_dict(values)


def _load_config_file(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
