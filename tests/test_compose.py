"""docker-compose.yml (its "ha" profile included), docker-compose.gpu.yml and docker-compose.cluster.yml,
checked without a container engine.

- Valid: `docker-compose config -q` accepts the file, and the GPU override on top of it.
- Wired: every command parses with the project's own parsers; every HOST:PORT
  a command or healthcheck names is a service of the file listening there, and
  a healthy dependency; each worker follows its own manager; the demo's
  replicas are exactly the manager/worker pairs; published ports reach
  something that listens; the GPU override changes only the workers' device
  and backend (and gives them a volume for Triton's compiled kernels).
- Runs: the same commands as local processes (compose_support translates
  hosts and ports, nothing else), in dependency order: Redis, both managers,
  both workers, every healthcheck, then the demo on a small workload.
- The cluster profile (docker-compose.cluster.yml on top of the base file):
  valid; it changes only the managers' --redis-url (and what they wait for);
  wired as above; and run the same way: six cluster nodes, the create job,
  both managers mirroring into the cluster and seeing each other's prefixes.
- The "ha" profile (services of docker-compose.yml under `profiles: ["ha"]`):
  valid; its services need nothing outside it; wired as above, and as one
  group: one replica id, one witness that keeps its data, each member
  advertising its own service name, the worker and the demo following both
  members. Run the same way: both members start and exactly one becomes the
  primary, the worker registers with it; the primary is SIGKILLed, the
  standby takes over within a few seconds, the same worker process
  re-registers with it, and the demo runs through the new primary; the
  group restarted whole on the witness's data, the member that its in-sync
  set names takes over again.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Sequence

import grpc
import pytest
import redis
import yaml
from compose_support import (
    ROOT,
    LocalPlan,
    Service,
    flag_value,
    listen_ports,
    load_services,
    references,
    start_order,
    with_flag,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from processes import launch, launch_until_ready, stop_all
from redis.cluster import ClusterNode

from gpu_worker.cli import build_parser
from kv_manager_service.cli.main import make_parser
from kv_manager_service.client import KVManagerClient, manager_addresses
from kv_tooling.launch import LaunchedProcess, free_cluster_port
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, WORKER_READY_PREFIX
from kv_manager_service.mirror.schema import KeySchema
from kvcache.v1 import kv_manager_pb2 as pb

COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_FILE = ROOT / "docker-compose.gpu.yml"
CLUSTER_FILE = ROOT / "docker-compose.cluster.yml"


def running(services: dict[str, Service], *program: str) -> list[str]:
    """The services whose command starts with `program`, in file order."""
    return [n for n, s in services.items() if s.command[: len(program)] == program]


SERVICES = load_services(COMPOSE_FILE)
MANAGERS = running(SERVICES, "kv-manager", "serve")
WORKERS = running(SERVICES, "gpu-worker")
DEMOS = running(SERVICES, "kv-manager", "demo")
REDIS = running(SERVICES, "redis-server")
# `docker compose --profile ha` starts the services above and the group's.
WITH_HA = load_services(COMPOSE_FILE, ["ha"])
HA = {n: s for n, s in WITH_HA.items() if n not in SERVICES}
HA_MANAGERS = running(HA, "kv-manager", "serve")
HA_WORKERS = running(HA, "gpu-worker")
HA_DEMOS = running(HA, "kv-manager", "demo")
HA_REDIS = running(HA, "redis-server")
PRIMARY_HEALTH_SERVICE = "kvcache.v1.KVManagerService"  # SERVING on a group's primary only

LOCAL_REQUESTS = 12  # the compose file's demo replays 120: a few seconds' worth here
READY_TIMEOUT_S = 30.0  # hang guards, not expectations
DEMO_TIMEOUT_S = 900.0
# A standby takes over within about one lease (1.2 s by default); the bound leaves room for a busy machine.
FAILOVER_TIMEOUT_S = 5.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def parse(service: Service) -> argparse.Namespace:
    """The service's command parsed by the project's own parser (fails the test on a parse error)."""
    parser = build_parser() if service.command[0] == "gpu-worker" else make_parser()
    try:
        return parser.parse_args(list(service.command[1:]))
    except SystemExit:
        pytest.fail(f"{service.name}: {parser.prog} rejects {list(service.command)} (see the captured stderr)")


def docker_compose(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (.ci/run installs it)")
    return subprocess.run([binary, *args], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)


# -- valid compose -------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["-f", str(COMPOSE_FILE)],
        ["-f", str(COMPOSE_FILE), "-f", str(GPU_FILE)],
        ["-f", str(COMPOSE_FILE), "-f", str(CLUSTER_FILE)],
        ["-f", str(COMPOSE_FILE), "--profile", "ha"],
    ],
    ids=["cpu", "gpu", "cluster", "ha"],
)
def test_compose_config_is_valid(args: list[str]) -> None:
    result = docker_compose(*args, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_gpu_override_changes_only_device_and_backend() -> None:
    result = docker_compose("-f", str(COMPOSE_FILE), "-f", str(GPU_FILE), "config")
    assert result.returncode == 0, result.stderr
    merged = config_services(result.stdout)
    base = config_services(docker_compose("-f", str(COMPOSE_FILE), "config").stdout)
    assert merged.keys() == base.keys()
    worker_image, worker_build = merged[WORKERS[0]]["image"], merged[WORKERS[0]]["build"]
    for name in WORKERS:
        gpu, cpu = merged[name], base[name]
        gpu_args = vars(build_parser().parse_args([str(a) for a in gpu.pop("command")[1:]]))
        cpu_args = vars(build_parser().parse_args([str(a) for a in cpu.pop("command")[1:]]))
        assert gpu_args == {**cpu_args, "device": "cuda", "backend": "triton"}, name
        assert gpu.pop("build")["args"]["TORCH_VARIANT"] != "cpu", name
        assert cpu.pop("build")["args"]["TORCH_VARIANT"] == "cpu", name
        assert gpu.pop("image") == worker_image != cpu.pop("image"), name
        devices = gpu.pop("deploy")["resources"]["reservations"]["devices"]
        assert [d["driver"] for d in devices] == ["nvidia"] and "gpu" in devices[0]["capabilities"], name
        # Triton's compiled kernels live on a named volume, kept across restarts.
        (volume,) = gpu.pop("volumes")
        source, target = volume.split(":")[:2]
        assert source == "triton-cache" and gpu["environment"].pop("TRITON_CACHE_DIR").startswith(target + "/"), name
        assert gpu == cpu, f"the GPU override changes more of {name} than its command, image, GPU and Triton cache"
    for name in DEMOS:  # one CUDA image serves the workers and the demo
        assert merged[name]["image"] == worker_image
        assert merged[name]["build"] == worker_build
    for name in set(merged) - set(WORKERS) - set(DEMOS):
        assert merged[name] == base[name], f"the GPU override changes {name}"


def config_services(text: str, profiles: Sequence[str] = ()) -> dict:
    """The services of `docker-compose config`'s output that `profiles` start (docker-compose 1.x lists the
    others too), published ports sorted (merging reorders them)."""
    services = yaml.safe_load(text)["services"]
    for service in services.values():
        if "ports" in service:
            service["ports"] = sorted(service["ports"])
    return {n: s for n, s in services.items() if not s.get("profiles") or set(s["profiles"]) & set(profiles)}


def check_merges_as_compose_merges_it(args: list[str], services: dict[str, Service], profiles: Sequence[str]) -> None:
    """`docker-compose ARGS config` has the services that `services` holds, with the same commands and
    dependencies: what the tests read is what compose runs."""
    result = docker_compose(*args, "config")
    assert result.returncode == 0, result.stderr
    merged = config_services(result.stdout, profiles)
    assert merged.keys() == services.keys()
    for name, service in services.items():
        assert tuple(str(a) for a in merged[name].get("command", ())) == service.command, name
        conditions = {d: spec["condition"] for d, spec in merged[name].get("depends_on", {}).items()}
        assert conditions == dict(service.depends_on), name


# -- wiring --------------------------------------------------------------------------


def test_the_expected_services_are_there() -> None:
    assert sorted(SERVICES) == ["demo", "manager-a", "manager-b", "redis", "worker-a", "worker-b"]
    assert (len(REDIS), len(MANAGERS), len(WORKERS), len(DEMOS)) == (1, 2, 2, 1)
    assert SERVICES[REDIS[0]].raw["image"].startswith("redis:7")
    assert sorted(HA) == ["ha-demo", "ha-manager-a", "ha-manager-b", "ha-redis", "ha-worker"]
    assert (len(HA_REDIS), len(HA_MANAGERS), len(HA_WORKERS), len(HA_DEMOS)) == (1, 2, 1, 1)
    assert all(service.profiles == ("ha",) for service in HA.values())


@pytest.mark.parametrize("name", MANAGERS + WORKERS + DEMOS + HA_MANAGERS + HA_WORKERS + HA_DEMOS)
def test_command_parses_with_the_project_parser(name: str) -> None:
    args = parse(WITH_HA[name])
    if name in WORKERS + HA_WORKERS:
        assert (args.device, args.backend) == ("cpu", "torch")
    if name in MANAGERS + WORKERS + HA_MANAGERS + HA_WORKERS:
        assert args.host == "0.0.0.0", "a server in a container must listen beyond its loopback"


# The default services, and the "ha" profile's alone (`docker compose up ha-worker` starts what it needs).
SERVICE_SETS = pytest.mark.parametrize("services", [SERVICES, HA], ids=["default", "ha"])


@SERVICE_SETS
def test_every_address_names_a_service_listening_there(services: dict[str, Service]) -> None:
    for name, service in services.items():
        for host, port in references(service.command):
            assert host in services, f"{name} refers to {host}:{port}, which is not a service of its set"
            assert port in listen_ports(services[host]), (
                f"{name} refers to {host}:{port}; {host} listens on {listen_ports(services[host])}"
            )
        for host, port in references(service.healthcheck or ()):
            assert host in ("127.0.0.1", "localhost"), f"{name}'s healthcheck probes {host}: it should probe itself"
            assert port in listen_ports(service), (
                f"{name}'s healthcheck probes port {port}; it listens on {listen_ports(service)}"
            )


@SERVICE_SETS
def test_a_service_waits_for_every_service_it_refers_to(services: dict[str, Service]) -> None:
    for name, service in services.items():
        # A group member's --advertise-address names the member itself.
        for host in {host for host, _ in references(service.command)} - {name}:
            assert service.depends_on.get(host) == "service_healthy", (
                f"{name} refers to {host} without waiting for it to be healthy"
            )
            assert services[host].healthcheck is not None, (
                f"{name} waits for {host} to be healthy, but {host} has no healthcheck"
            )
    assert start_order(services)[-1] in running(services, "kv-manager", "demo")


def test_replicas_are_wired_pairwise() -> None:
    managers = {name: parse(SERVICES[name]) for name in MANAGERS}
    workers = {name: parse(SERVICES[name]) for name in WORKERS}
    # Each manager mirrors to the file's Redis, under one model name, with its own replica id.
    for name, args in managers.items():
        assert [host for host, _ in references([args.redis_url])] == REDIS, name
    assert len({args.model_name for args in managers.values()}) == 1
    assert len({args.replica_id for args in managers.values()}) == len(managers)
    # Each worker follows a different manager, and every manager has one.
    followed = [references([args.manager])[0][0] for args in workers.values()]
    assert sorted(followed) == sorted(MANAGERS)
    # The demo drives exactly those pairs.
    pairs = {(args.manager, f"{name}:{args.port}") for name, args in workers.items()}
    for name in DEMOS:
        assert set(parse(SERVICES[name]).replica) == pairs
        assert len(parse(SERVICES[name]).replica) == len(pairs)


def test_published_ports_reach_a_listening_port_on_the_loopback() -> None:
    host_ports = []
    for name, service in WITH_HA.items():
        for published in service.ports:
            assert published.container_port in listen_ports(service), (
                f"{name} publishes {published.container_port}, not a port it listens on"
            )
            assert published.host_ip == "127.0.0.1", (
                f"{name} publishes port {published.host_port} beyond the host's loopback"
            )
            host_ports.append(published.host_port)
        if name in MANAGERS + WORKERS + HA_MANAGERS + HA_WORKERS:
            # A group's replication port is for the other members, inside the compose network only.
            replication = flag_value(service.command, "--ha-replication-port")
            served = set(listen_ports(service)) - {int(replication)} if replication else set(listen_ports(service))
            assert {p.container_port for p in service.ports} == served, f"{name}: publish gRPC and metrics"
    assert len(host_ports) == len(set(host_ports)), f"a host port is published twice: {sorted(host_ports)}"


def test_images_build_from_what_the_context_holds() -> None:
    """Build args are ARGs of their Dockerfile; COPY sources exist and .dockerignore keeps them."""
    gpu = yaml.safe_load(GPU_FILE.read_text(encoding="utf-8"))["services"]
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for name, service in SERVICES.items():
        build = service.raw.get("build")
        if build is None:
            continue
        context = ROOT / build["context"]
        dockerfile = context / build["dockerfile"]
        text = dockerfile.read_text(encoding="utf-8")
        declared = set(re.findall(r"^ARG (\w+)", text, re.MULTILINE))
        for args in (build.get("args", {}), gpu.get(name, {}).get("build", {}).get("args", {})):
            assert set(args) <= declared, f"{name}: build args {set(args) - declared} are not ARGs of {dockerfile.name}"
        for source in re.findall(r"^COPY (?!--from)(\S+) ", text, re.MULTILINE):
            assert (context / source).exists(), f"{dockerfile.name} copies {source}, which does not exist"
            assert source.split("/")[0] not in ignored, (
                f"{dockerfile.name} copies {source}, which .dockerignore leaves out"
            )


def test_the_manager_image_installs_no_worker_extra() -> None:
    """The manager runs without torch or Triton: its image installs the redis extra only."""
    manager = next(SERVICES[name].raw["build"] for name in MANAGERS)
    text = (ROOT / manager["context"] / manager["dockerfile"]).read_text(encoding="utf-8")
    installs = re.findall(r"pip install [^\n]*\.\[([\w,]+)\]", text)
    assert installs == ["redis"], f"the manager image installs the extras {installs}"


# -- running the file's commands on one machine ---------------------------------------


@pytest.mark.slow
def test_compose_services_run_as_local_processes(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    plan = LocalPlan(SERVICES)
    processes: list[LaunchedProcess] = []
    failures: list[str] = []
    try:
        for name in start_order(SERVICES):
            if name in REDIS:
                processes.append(start_redis(plan, name, tmp_path))
            elif name in MANAGERS or name in WORKERS:
                prefix = MANAGER_READY_PREFIX if name in MANAGERS else WORKER_READY_PREFIX
                process = launch(plan.command(name), prefix, tmp_path / f"{name}.log", env=plan.environment(name))
                processes.append(process)
                assert process.address == plan.address(name, int(flag_value(SERVICES[name].command, "--port")))
        for name in SERVICES:
            check_healthy(plan, name)
        for name in DEMOS:
            run_demo(plan, name, tmp_path / name)
        check_managers(plan)
        check_metrics(plan)
    finally:
        failures = stop_all(processes)
    assert not failures, "\n\n".join(failures)


def start_redis(plan: LocalPlan, name: str, directory: Path) -> LaunchedProcess:
    """redis-server has no ready line: it is ready when its healthcheck passes, as for compose."""
    return launch_until_ready(
        plan.command(name),
        lambda: healthcheck(plan, name).returncode == 0,
        plan.address(name, listen_ports(plan.services[name])[0]),
        directory / f"{name}.log",
        cwd=directory,
        timeout_s=READY_TIMEOUT_S,
    )


def healthcheck(plan: LocalPlan, name: str) -> subprocess.CompletedProcess:
    test = plan.healthcheck(name)
    assert test is not None, f"{name} has no healthcheck"
    return subprocess.run(test, check=False, capture_output=True, text=True, env=plan.environment(name), timeout=60)


def check_healthy(plan: LocalPlan, name: str) -> None:
    if plan.services[name].healthcheck is None:
        return
    result = healthcheck(plan, name)
    assert result.returncode == 0, (
        f"{name}'s healthcheck {plan.healthcheck(name)} failed:\n{result.stdout}{result.stderr}"
    )


def run_demo(plan: LocalPlan, name: str, output_dir: Path) -> None:
    """The demo on LOCAL_REQUESTS requests; every one completes, and every replica of the plan gets some."""
    argv = with_flag(plan.command(name), "--output-dir", str(output_dir))
    argv = with_flag(argv, "--requests", str(LOCAL_REQUESTS))
    result = subprocess.run(
        argv, check=False, cwd=ROOT, env=plan.environment(name), capture_output=True, text=True, timeout=DEMO_TIMEOUT_S
    )
    assert result.returncode == 0, f"{argv} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr

    report = json.loads((output_dir / "report.json").read_text())
    assert report["num_requests"] == LOCAL_REQUESTS
    assert report["num_completed"] == LOCAL_REQUESTS
    assert report["num_generated_tokens"] >= LOCAL_REQUESTS
    assert 0.0 <= report["prefix_hit_rate"] <= 1.0
    replica_ids = {parse(plan.services[m]).replica_id for m in running(plan.services, "kv-manager", "serve")}
    routed = report["requests_per_replica"]
    assert set(routed) == replica_ids and sum(routed.values()) == LOCAL_REQUESTS
    assert all(count > 0 for count in routed.values()), f"a replica got no request: {routed}"
    assert (output_dir / "demo.png").read_bytes()[: len(PNG_SIGNATURE)] == PNG_SIGNATURE


def check_managers(plan: LocalPlan) -> None:
    """Each manager served the demo's requests and mirrored them to Redis without a failure."""
    for name in MANAGERS:
        args = parse(SERVICES[name])
        with KVManagerClient(plan.address(name, args.port), timeout_s=10) as client:
            stats = client.stub.GetStats(pb.GetStatsRequest(), timeout=10)
            config = client.get_config()
        assert stats.prefix_cache_queries > 0 and stats.last_step_id > 0, f"{name} served nothing: {stats}"
        assert stats.num_requests == 0, f"{name} still holds requests after the demo: {stats}"
        assert stats.mirror_enabled and stats.mirror_failures == 0, f"{name}'s mirror: {stats}"
        redis_host, redis_port = references([args.redis_url])[0]
        client = redis.Redis.from_url(f"redis://{plan.address(redis_host, redis_port)}/0")
        try:
            known = {m.decode() for m in client.smembers(KeySchema(args.model_name, config.hash_algorithm).replicas)}
        finally:
            client.close()
        assert args.replica_id in known, f"Redis does not know {args.replica_id}: {known}"


def check_metrics(plan: LocalPlan) -> None:
    """Every published metrics port serves Prometheus text."""
    for name in MANAGERS + WORKERS:
        port = int(flag_value(SERVICES[name].command, "--metrics-port"))
        with urllib.request.urlopen(f"http://{plan.address(name, port)}/metrics", timeout=10) as response:
            body = response.read().decode()
        assert response.status == 200 and "# TYPE " in body, f"{name}'s /metrics:\n{body[:500]}"


# -- the cluster profile ---------------------------------------------------------------


def merge_compose(base: dict, override: dict) -> dict:
    """`override` on top of `base` as compose merges files: mappings merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_compose(merged[key], value)
        else:
            merged[key] = value
    return merged


@pytest.fixture(scope="module")
def cluster_services(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Service]:
    """The services of the base file with the cluster profile on top."""
    base = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    override = yaml.safe_load(CLUSTER_FILE.read_text(encoding="utf-8"))
    path = tmp_path_factory.mktemp("compose") / "merged.yml"
    path.write_text(yaml.safe_dump({"services": merge_compose(base["services"], override["services"])}))
    return load_services(path)


def cluster_nodes(services: dict[str, Service]) -> list[str]:
    return [n for n, s in services.items() if s.command[:1] == ("redis-server",) and "--cluster-enabled" in s.command]


def test_the_cluster_profile_merges_as_compose_merges_it(cluster_services: dict[str, Service]) -> None:
    check_merges_as_compose_merges_it(["-f", str(COMPOSE_FILE), "-f", str(CLUSTER_FILE)], cluster_services, [])


def test_the_cluster_profile_changes_only_where_the_managers_mirror(cluster_services: dict[str, Service]) -> None:
    nodes = cluster_nodes(cluster_services)
    creators = [n for n, s in cluster_services.items() if "--cluster" in " ".join(s.command) and n not in nodes]
    assert len(nodes) == 6 and len(creators) == 1, (nodes, creators)
    assert set(cluster_services) == set(SERVICES) | set(nodes) | set(creators)
    for name in MANAGERS:
        cluster_args, base_args = vars(parse(cluster_services[name])), vars(parse(SERVICES[name]))
        assert [host for host, _ in references([cluster_args.pop("redis_url")])] == [nodes[0]], name
        base_args.pop("redis_url")
        assert cluster_args == base_args, f"the cluster profile changes more of {name}'s command than --redis-url"
        assert cluster_args["redis_cluster"] == "auto", name  # the manager finds out itself
        assert cluster_services[name].depends_on[creators[0]] == "service_completed_successfully", name
    for name in set(SERVICES) - set(MANAGERS):
        assert cluster_services[name] == SERVICES[name], f"the cluster profile changes {name}"


def test_the_cluster_profile_is_wired(cluster_services: dict[str, Service]) -> None:
    nodes = cluster_nodes(cluster_services)
    for name, service in cluster_services.items():
        for host, port in references(service.command):
            assert host in cluster_services and port in listen_ports(cluster_services[host]), (name, host, port)
            assert service.depends_on.get(host) == "service_healthy", f"{name} refers to {host} without waiting for it"
            assert cluster_services[host].healthcheck is not None, host
    (creator,) = [n for n, s in cluster_services.items() if s.command[:1] == ("sh",)]
    command = " ".join(cluster_services[creator].command)
    assert [host for host, _ in references([command])] == nodes, "the create job must name every node, masters first"
    assert "--cluster-replicas 1" in command and "--cluster-yes" in command
    order = start_order(cluster_services)
    assert order.index(creator) > max(order.index(node) for node in nodes)
    assert all(order.index(name) > order.index(creator) for name in MANAGERS)


def test_the_cluster_profile_runs_as_local_processes(cluster_services: dict[str, Service], tmp_path: Path) -> None:
    """The nodes, the create job and both managers: each manager mirrors into the cluster and sees the other."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are not installed (.ci/run installs them)")
    nodes = cluster_nodes(cluster_services)
    (creator,) = [n for n, s in cluster_services.items() if s.command[:1] == ("sh",)]
    plan = LocalPlan(cluster_services, pick_port=free_cluster_port)  # a node's bus port is its port + 10000
    processes: list[LaunchedProcess] = []
    try:
        for name in nodes:
            (tmp_path / name).mkdir()  # each node its own nodes.conf, as each container has its own /data
            processes.append(start_redis(plan, name, tmp_path / name))
        # The compose file writes a literal $ as $$ (its own interpolation escape): the shell gets $.
        argv = [arg.replace("$$", "$") for arg in plan.command(creator)]
        created = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
        assert created.returncode == 0, f"{creator}: {created.stdout}{created.stderr}"
        for name in MANAGERS:
            processes.append(
                launch(plan.command(name), MANAGER_READY_PREFIX, tmp_path / f"{name}.log", env=plan.environment(name))
            )
            check_healthy(plan, name)
        check_managers_share_the_cluster(plan, cluster_services, nodes)
    finally:
        failures = stop_all(processes)
    assert not failures, "\n\n".join(failures)


def check_managers_share_the_cluster(plan: LocalPlan, services: dict[str, Service], nodes: list[str]) -> None:
    """A prompt cached on each manager is seen from the other, through the cluster."""
    args = {name: parse(services[name]) for name in MANAGERS}
    clients = {name: KVManagerClient(plan.address(name, args[name].port), timeout_s=10) for name in MANAGERS}
    try:
        prompts = {name: list(range(1 + 1000 * i, 1 + 1000 * i + 64)) for i, name in enumerate(MANAGERS)}
        for name, client in clients.items():
            result = client.allocate("warm", prompts[name], num_new_tokens=len(prompts[name]))
            assert result.status.name == "OK", result
            client.free(["warm"])
        for asking, client in clients.items():
            for name in MANAGERS:
                own = client.find_cache_hit(prompts[name])[0].num_cached_tokens
                expected = {args[m].replica_id: own if m == asking else 0 for m in MANAGERS}
                expected[args[name].replica_id] = 48  # 4 full blocks of 16, the last token always computed

                def answer() -> dict[str, int]:
                    replicas = client.find_cache_hit(prompts[name], cluster=True)[1]
                    return {r.replica_id: r.num_cached_tokens for r in replicas}

                deadline = time.monotonic() + READY_TIMEOUT_S
                while answer() != expected and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert answer() == expected, f"{asking} sees {answer()} for {name}'s prompt, not {expected}"
        for name, client in clients.items():
            stats = client.stub.GetStats(pb.GetStatsRequest(), timeout=10)
            assert stats.mirror_enabled and stats.mirror_failures == 0, f"{name}'s mirror: {stats}"
        schema = KeySchema(args[MANAGERS[0]].model_name, clients[MANAGERS[0]].get_config().hash_algorithm)
    finally:
        for client in clients.values():
            client.close()
    startup = [ClusterNode("127.0.0.1", plan.local_port(name, 6379)) for name in nodes]
    cluster = redis.RedisCluster(startup_nodes=startup, socket_timeout=5.0)
    try:
        assert {m.decode() for m in cluster.smembers(schema.replicas)} == {a.replica_id for a in args.values()}
        assert sum(1 for _ in cluster.scan_iter(match=f"{schema.namespace}:block:*", count=1000)) > 0
    finally:
        cluster.close()


# -- the "ha" profile ------------------------------------------------------------------


def test_the_ha_profile_merges_as_compose_merges_it() -> None:
    check_merges_as_compose_merges_it(["-f", str(COMPOSE_FILE), "--profile", "ha"], WITH_HA, ["ha"])


def test_the_ha_profile_is_one_group_that_the_worker_and_the_demo_follow() -> None:
    members = {name: parse(HA[name]) for name in HA_MANAGERS}
    # One replica, one witness; the witness keeps the lease's token and the in-sync set across a restart.
    assert len({args.replica_id for args in members.values()}) == 1
    for name, args in members.items():
        assert [host for host, _ in references([args.ha_url])] == HA_REDIS, name
        assert args.redis_url is None, f"{name} mirrors: the profile shows failover, the default services routing"
    assert flag_value(HA[HA_REDIS[0]].command, "--appendonly") == "yes"
    # Each member tells the others, the worker and clients its own service name.
    for name, args in members.items():
        assert args.advertise_address == f"{name}:{args.port}", name
    # Its member id lives in its journal, on an anonymous volume: kept as long as the witness's data
    # (stop/start, recreate), so a group restarted with that data finds a member its in-sync set names.
    for name, args in members.items():
        assert str(Path(args.journal).parent) in HA[name].raw.get("volumes", ()), name
    # The worker and the demo follow the group: every member's address, the primary found among them.
    advertised = {args.advertise_address for args in members.values()}
    (worker,) = HA_WORKERS
    assert set(manager_addresses(parse(HA[worker]).manager)) == advertised
    for name in HA_DEMOS:
        ((managers, worker_address),) = parse(HA[name]).replica
        assert set(manager_addresses(managers)) == advertised, name
        assert worker_address == f"{worker}:{parse(HA[worker]).port}", name
    # The worker waits for both members to be healthy: a standby must pass, so they ask for the whole server.
    for name in HA_MANAGERS:
        assert PRIMARY_HEALTH_SERVICE not in HA[name].healthcheck, name


@pytest.mark.slow
def test_the_ha_profile_fails_over_as_local_processes(tmp_path: Path) -> None:
    """Both members start and one becomes the primary; the worker registers with it. SIGKILL the primary:
    the standby takes over within a few seconds, the same worker process is registered with it, and the
    demo, given both members, runs through it. Then the whole profile restarts on the witness's data, as
    `docker compose restart` does: the member the in-sync set names takes over again."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    plan = LocalPlan(HA)
    processes: dict[str, LaunchedProcess] = {}
    failures: list[str] = []
    (worker,) = HA_WORKERS
    try:
        for name in [n for n in start_order(HA) if n not in HA_DEMOS]:
            if name in HA_REDIS:
                processes[name] = start_redis(plan, name, tmp_path)  # its append-only file lands there
            else:
                processes[name] = launch_ha_server(plan, name, tmp_path, tmp_path / f"{name}.log")
                check_healthy(plan, name)  # a standby passes too: the worker waits for both members
        primary = wait_for_one_primary(plan, HA_MANAGERS, READY_TIMEOUT_S)
        worker_id = wait_for_streaming_worker(plan, primary)

        processes[primary].kill()
        (standby,) = set(HA_MANAGERS) - {primary}
        assert wait_for_one_primary(plan, HA_MANAGERS, FAILOVER_TIMEOUT_S) == standby
        assert wait_for_streaming_worker(plan, standby) == worker_id
        assert processes[worker].running, f"{worker} exited:\n{processes[worker].log()[-3000:]}"
        for name in HA_DEMOS:
            run_demo(plan, name, tmp_path / name)

        failures += stop_all([processes.pop(name) for name in [*HA_MANAGERS, worker]])
        for name in HA_MANAGERS:
            processes[name] = launch_ha_server(plan, name, tmp_path, tmp_path / f"{name}-restarted.log")
        assert wait_for_one_primary(plan, HA_MANAGERS, READY_TIMEOUT_S) == standby
    finally:
        failures += stop_all(list(processes.values()))
    assert not failures, "\n\n".join(failures)


def launch_ha_server(plan: LocalPlan, name: str, directory: Path, log_path: Path) -> LaunchedProcess:
    """A member or the worker of the "ha" profile, waited for; a member keeps its journal in `directory`
    (as each container keeps it on its own volume), so a member started again is the same member."""
    if name not in HA_MANAGERS:
        return launch(plan.command(name), WORKER_READY_PREFIX, log_path, env=plan.environment(name))
    argv = with_flag(plan.command(name), "--journal", str(directory / f"{name}.journal"))
    return launch(argv, MANAGER_READY_PREFIX, log_path, env=plan.environment(name))


def serves_as_primary(address: str) -> bool:
    """Whether the health service at `address` reports the manager's service SERVING (a group's primary)."""
    with grpc.insecure_channel(address) as channel:
        try:
            request = health_pb2.HealthCheckRequest(service=PRIMARY_HEALTH_SERVICE)
            response = health_pb2_grpc.HealthStub(channel).Check(request, timeout=1)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def wait_for_one_primary(plan: LocalPlan, members: list[str], timeout_s: float) -> str:
    """The one member that serves as the primary, waited for; two at once fail the test."""
    deadline = time.monotonic() + timeout_s
    while True:
        serving = [name for name in members if serves_as_primary(plan.address(name, parse(plan.services[name]).port))]
        assert len(serving) < 2, f"two primaries at once: {serving}"
        if serving:
            return serving[0]
        assert time.monotonic() < deadline, f"no member of {members} became the primary within {timeout_s} s"
        time.sleep(0.05)


def wait_for_streaming_worker(plan: LocalPlan, manager: str) -> str:
    """The id of the one worker `manager` lists, once that worker's step stream to it is open."""
    with KVManagerClient(plan.address(manager, parse(plan.services[manager]).port), timeout_s=10) as client:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            workers = client.stub.GetStats(pb.GetStatsRequest(), timeout=10).workers
            if len(workers) == 1 and workers[0].streaming:
                return workers[0].worker_id
            assert len(workers) <= 1, f"{manager} lists several workers: {workers}"
            assert time.monotonic() < deadline, f"{manager} lists no streaming worker: {workers}"
            time.sleep(0.05)
