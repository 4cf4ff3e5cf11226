"""docker/observability: the Prometheus alert rules and scrape config, the Grafana dashboard and its
provisioning, and docker-compose.yml's "observability" profile that runs them.

- Valid: `promtool check rules` and `promtool check config` accept the files, `promtool test rules`
  passes the rules' unit tests (alerts.test.yml), and `docker-compose --profile observability config
  -q` accepts the compose file. The dashboard is JSON with unique panel ids, every panel queries, and
  every query goes to the data source the provisioning defines.
- Real: every metric an alert, a dashboard query or a dashboard variable names is in a real scrape of
  a manager (with a host tier) and a worker started here, and every label one matches or groups by is
  a label of those metrics or one that prometheus.yml gives its targets; a `method` matched by name
  is a method the server times. `up` is the one series Prometheus makes itself.
- Wired: prometheus.yml scrapes every manager and worker of docker-compose.yml, of every profile, at
  its service name and --metrics-port, in a job of its kind, labelled with the replica it serves;
  compose mounts each file where Prometheus and Grafana read it.

promtool comes from Debian's `prometheus` package, which `make test` installs
(tools/system-packages.sh); only the checks that run it skip without it, as the compose checks skip
without docker-compose.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
import pytest
import yaml
from compose_support import ROOT, Service, flag_value, load_services, references
from e2e_support import start_stack, stop_stack
from processes import log_records
from prometheus_client.parser import text_string_to_metric_families

from kv_tooling.launch import LaunchedProcess
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import worker_pb2

OBSERVABILITY = ROOT / "docker" / "observability"
ALERTS = OBSERVABILITY / "alerts.yml"
ALERT_TESTS = OBSERVABILITY / "alerts.test.yml"
PROMETHEUS_CONFIG = OBSERVABILITY / "prometheus.yml"
DASHBOARD = OBSERVABILITY / "grafana" / "dashboards" / "kv-cache.json"
DATASOURCES = OBSERVABILITY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = OBSERVABILITY / "grafana" / "provisioning" / "dashboards" / "kv-cache.yml"
COMPOSE_FILE = ROOT / "docker-compose.yml"

PROFILE = "observability"
SERVICES = load_services(COMPOSE_FILE, ["ha", PROFILE])
OBSERVABILITY_SERVICES = {n: s for n, s in SERVICES.items() if s.profiles == (PROFILE,)}
JOB_PREFIXES = {"kv-manager": "kv-manager", "gpu-worker": "gpu-worker"}  # program -> the prefix of its jobs
PROMETHEUS_SERIES = {"up"}  # made by Prometheus for every target, not scraped
# The pool of the scraped manager; the host tier makes it export its kvcache_host_* series too.
POOL = {"num_blocks": 64, "num_host_blocks": 16, "groups": [{"kind": "full_attention", "block_size": 16}]}


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed (make test installs it: tools/system-packages.sh)")
    return subprocess.run([binary, *args], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


# -- valid -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["check", "rules", str(ALERTS)], ["check", "config", str(PROMETHEUS_CONFIG)], ["test", "rules", str(ALERT_TESTS)]],
    ids=["check-rules", "check-config", "test-rules"],
)
def test_promtool_accepts(args: list[str]) -> None:
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_config_evaluates_the_rules() -> None:
    assert [OBSERVABILITY / name for name in load_yaml(PROMETHEUS_CONFIG)["rule_files"]] == [ALERTS]
    assert load_yaml(ALERT_TESTS)["rule_files"] == load_yaml(PROMETHEUS_CONFIG)["rule_files"]


def test_the_observability_profile_is_valid() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (make test installs it: tools/system-packages.sh)")
    for profiles in (["--profile", PROFILE], ["--profile", PROFILE, "--profile", "ha"]):
        result = subprocess.run(
            [binary, "-f", str(COMPOSE_FILE), *profiles, "config", "-q"],
            check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside rows included, rows excluded."""
    found = []
    for panel in dashboard["panels"]:
        found += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return found


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"]
    rows = [panel for panel in dashboard["panels"] if panel["type"] == "row"]
    ids = [panel["id"] for panel in rows + panels(dashboard)]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"
    (provisioned,) = load_yaml(DATASOURCES)["datasources"]
    assert provisioned["type"] == "prometheus"
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    selector = variables["datasource"]
    assert selector["type"] == "datasource" and selector["query"] == "prometheus"
    assert selector["current"]["value"] == provisioned["uid"], "the dashboard opens on another data source"
    sources = [variable["datasource"] for variable in variables.values() if "datasource" in variable]
    assert panels(dashboard)
    for panel in panels(dashboard):
        assert panel["targets"] and all(target["expr"].strip() for target in panel["targets"]), panel["title"]
        sources += [panel["datasource"], *(target["datasource"] for target in panel["targets"])]
    for source in sources:
        assert source == {"type": "prometheus", "uid": "${datasource}"}, source


# -- real: the names the rules and the dashboard use are the servers' ---------------------------


@dataclasses.dataclass
class Exported:
    """What the servers expose: sample name -> its label names, and (sample name, label) -> values."""

    labels: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    values: dict[tuple[str, str], set[str]] = dataclasses.field(default_factory=dict)

    def methods(self, name: str) -> set[str]:
        """The methods the RPC metrics of `name`'s server label (its duration histogram has every unary one)."""
        server = name.split("_rpc_")[0] + "_rpc_"
        methods: set[str] = set()
        for (sample, label), values in self.values.items():
            if label == "method" and sample.startswith(server):
                methods |= values
        return methods

    def add(self, text: str) -> None:
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "summary": ["_count", "_sum"]}
        for family in text_string_to_metric_families(text):
            # A family of labelled series may have none yet: its sample names still exist.
            for suffix in suffixes.get(family.type, [""]):
                self.labels.setdefault(family.name + suffix, set())
            for sample in family.samples:
                self.labels.setdefault(sample.name, set()).update(sample.labels)
                for label, value in sample.labels.items():
                    self.values.setdefault((sample.name, label), set()).add(value)


def metrics_url(process: LaunchedProcess) -> str:
    (url,) = [record["metrics_url"] for record in log_records(process) if "metrics_url" in record]
    return url


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """One scrape of a manager and one of its worker, after a request ran through both and each refused
    one call (so that the error counters have their labels)."""
    directory = tmp_path_factory.mktemp("observability")
    stack, processes = start_stack(
        directory, "tiny", "torch", POOL, manager_args=["--metrics-port", "0"], worker_args=["--metrics-port", "0"]
    )
    try:
        scheduler = stack.scheduler()
        scheduler.add("r-0", list(range(1, 40)), max_new_tokens=3)
        scheduler.run()
        with pytest.raises(grpc.RpcError) as refused:
            stack.manager_client.stub.GetBlockTables(pb.GetBlockTablesRequest(request_ids=["missing"]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as refused:
            stack.worker_client.stub.Execute(worker_pb2.ExecuteRequest(step_id=0), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        result = Exported()
        for process in (stack.manager, stack.worker):
            result.add(scrape(metrics_url(process)))
    finally:
        failures = stop_stack(stack, processes)
    assert not failures, "\n\n".join(failures)
    return result


def target_labels() -> set[str]:
    """The labels every target of prometheus.yml carries: job, instance, and those the file adds."""
    labels = {"job", "instance"}
    for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]:
        for group in job.get("static_configs", []):
            labels |= set(group.get("labels", {}))
        labels |= {rule["target_label"] for rule in job.get("relabel_configs", []) if "target_label" in rule}
    return labels


GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\s*\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
IDENTIFIER = re.compile(r"(?<![\w.$])([A-Za-z_:][\w:]*)(?![\w:])(\s*\()?")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
GRAFANA_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")


@dataclasses.dataclass(frozen=True)
class Query:
    """The names a PromQL expression uses: its series (name -> matchers) and the labels it groups by."""

    series: list[tuple[str, list[tuple[str, str, str]]]]
    grouping: set[str]


def parse_query(expr: str) -> Query:
    """The series and grouping labels of `expr` (PromQL, or Grafana's label_values(SERIES, LABEL))."""
    grafana = GRAFANA_LABEL_VALUES.match(expr.strip())
    if grafana:
        inner = parse_query(grafana.group(1))
        return Query(inner.series, inner.grouping | {grafana.group(2)})
    grouping = {label.strip() for labels in GROUPING.findall(expr) for label in labels.split(",") if label.strip()}
    text = GROUPING.sub(" ", re.sub(r"\[[^\]]*\]", "", expr))  # ranges and grouping clauses out
    series: list[tuple[str, list[tuple[str, str, str]]]] = []

    def selector(match: re.Match) -> str:
        assert match.group(1), f"a selector without a metric name in {expr!r}"
        series.append((match.group(1), MATCHER.findall(match.group(2))))
        return " "

    text = SELECTOR.sub(selector, text)
    for name, call in IDENTIFIER.findall(text):
        if not call and name not in KEYWORDS:
            series.append((name, []))
    return Query(series, grouping)


def rule_queries() -> dict[str, str]:
    return {rule["alert"]: rule["expr"] for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]}


def dashboard_queries() -> dict[str, str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = {}
    for panel in panels(dashboard):
        for target in panel["targets"]:
            queries[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries[f"variable {variable['name']}"] = query["query"] if isinstance(query, dict) else query
    return queries


def unknown_names(expr: str, exported: Exported, known_labels: set[str]) -> list[str]:
    """The metrics, labels and method names `expr` uses that the scrape does not have."""
    query = parse_query(expr)
    unknown = []
    if not query.series:
        unknown.append("(no metric at all)")
    used_labels = set(known_labels)
    for name, matchers in query.series:
        if name in PROMETHEUS_SERIES:
            continue
        if name not in exported.labels:
            unknown.append(name)
            continue
        used_labels |= exported.labels[name]
        for label, operator, value in matchers:
            if label not in exported.labels[name] | known_labels:
                unknown.append(f"{name}{{{label}}}")
            if label == "method" and operator in ("=", "=~") and "$" not in value:
                methods = exported.methods(name)
                unknown += [f"{name}{{method={m!r}}}" for m in value.split("|") if m not in methods]
    unknown += [f"by ({label})" for label in sorted(query.grouping - used_labels)]
    return unknown


QUERIES = {**{f"alert {name}": expr for name, expr in rule_queries().items()}, **dashboard_queries()}


@pytest.mark.slow
@pytest.mark.parametrize("where", sorted(QUERIES))
def test_every_name_a_query_uses_is_exported(where: str, exported: Exported) -> None:
    unknown = unknown_names(QUERIES[where], exported, target_labels())
    assert not unknown, f"{where}: {QUERIES[where]}\n uses what no server exports: {unknown}"


@pytest.mark.slow
def test_a_name_no_server_exports_is_caught(exported: Exported) -> None:
    """The check above finds misspelled metrics, labels and methods, wherever they stand in a query."""
    assert unknown_names("sum by (instance) (rate(kvcache_evictons_total[5m]))", exported, {"instance"}) == [
        "kvcache_evictons_total"
    ]
    assert unknown_names('kvcache_usage_ratio{instanse="a"} > 0.9', exported, {"instance"}) == [
        "kvcache_usage_ratio{instanse}"
    ]
    assert unknown_names('rate(kvcache_rpc_duration_seconds_count{method="Stpe"}[1m])', exported, set()) == [
        "kvcache_rpc_duration_seconds_count{method='Stpe'}"
    ]
    assert unknown_names("kvcache_num_blocks - on (replica) gpu_worker_kv_cache_byte", exported, set()) == [
        "gpu_worker_kv_cache_byte", "by (replica)",
    ]  # fmt: skip
    assert unknown_names("label_values(kvcache_num_blocks, worker_id)", exported, set()) == ["by (worker_id)"]


# -- wired: Prometheus scrapes what compose runs, and compose mounts what they read ----------------


def scraped_targets() -> dict[tuple[str, int], tuple[str, str | None]]:
    """(host, port) -> (job, the replica label) of every target of prometheus.yml."""
    targets = {}
    for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]:
        relabelled = {rule["target_label"]: rule["replacement"] for rule in job.get("relabel_configs", [])}
        for group in job.get("static_configs", []):
            for target in group["targets"]:
                host, port = target.rsplit(":", 1)
                targets[(host, int(port))] = (job["job_name"], group.get("labels", {}).get("replica"))
        for lookup in job.get("dns_sd_configs", []):
            assert lookup["type"] == "A", "a service name resolves to its container's address"
            for host in lookup["names"]:
                targets[(host, lookup["port"])] = (job["job_name"], relabelled.get("replica"))
    return targets


def replica_of(name: str, service: Service) -> str:
    """The --replica-id a manager serves, or the one of the (first) manager a worker follows."""
    if service.command[0] == "gpu-worker":
        manager = references([flag_value(service.command, "--manager")])[0][0]
        return replica_of(manager, SERVICES[manager])
    return flag_value(service.command, "--replica-id")


def test_prometheus_scrapes_every_manager_and_worker_of_the_compose_file() -> None:
    expected = {}
    for name, service in SERVICES.items():
        program = service.command[0] if service.command[0] == "gpu-worker" else " ".join(service.command[:2])
        if program in ("kv-manager serve", "gpu-worker"):
            port = int(flag_value(service.command, "--metrics-port"))
            expected[(name, port)] = (JOB_PREFIXES[program.split()[0]], replica_of(name, service))
    targets = scraped_targets()
    assert set(targets) == set(expected), "prometheus.yml's targets are not the compose file's metrics ports"
    for address, (job_prefix, replica) in expected.items():
        job, labelled = targets[address]
        assert job.startswith(job_prefix), f"{address} is scraped by job {job}: the alerts select {job_prefix}*"
        assert labelled == replica, f"{address} serves replica {replica}, labelled {labelled}"


def bind_mounts(service: Service) -> dict[str, Path]:
    """Container path -> host path of the service's bind mounts (`./HOST:CONTAINER[:ro]`)."""
    mounts = {}
    for volume in service.raw.get("volumes", []):
        host, container = volume.split(":")[:2]
        assert (ROOT / host).exists(), f"{service.name} mounts {host}, which does not exist"
        mounts[container] = (ROOT / host).resolve()
    return mounts


def test_the_observability_services_read_the_files_of_docker_observability() -> None:
    assert sorted(OBSERVABILITY_SERVICES) == ["grafana", "prometheus"]
    assert not {n for n, s in SERVICES.items() if n not in OBSERVABILITY_SERVICES and PROFILE in s.profiles}
    prometheus, grafana = OBSERVABILITY_SERVICES["prometheus"], OBSERVABILITY_SERVICES["grafana"]
    for service in (prometheus, grafana):
        assert service.healthcheck is not None, service.name
        assert [p.host_ip for p in service.ports] == ["127.0.0.1"], f"{service.name} publishes beyond the loopback"
    # Prometheus reads its config, and the rules beside it.
    mounts = bind_mounts(prometheus)
    config = PurePosixPath(flag_value([a for arg in prometheus.command for a in arg.split("=", 1)], "--config.file"))
    assert mounts[str(config)] == PROMETHEUS_CONFIG
    for rule_file in load_yaml(PROMETHEUS_CONFIG)["rule_files"]:
        assert mounts[str(config.parent / rule_file)] == (OBSERVABILITY / rule_file).resolve()
    # Grafana provisions the data source and the dashboards' folder from the files.
    mounts = bind_mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == DATASOURCES.parent.parent
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    (datasource,) = load_yaml(DATASOURCES)["datasources"]
    host, port = references([datasource["url"]])[0]
    assert host == "prometheus" and f"--web.listen-address=:{port}" in prometheus.command
    assert grafana.depends_on == {"prometheus": "service_healthy"}
