"""A compose file's services as local processes on one machine: the translation, in one place.

In a compose project every service is its own host (named after the service)
and listens on the ports its command names. On one machine all of them share
127.0.0.1, so `LocalPlan` gives each (service, port) pair a free local port and
rewrites a command only where one machine must differ:

| in the compose file                                       | locally                                          |
|-----------------------------------------------------------|--------------------------------------------------|
| the program (`kv-manager`, `redis-cli`, ...)              | this Python environment's script, else `PATH`'s  |
| `--host 0.0.0.0`                                          | `--host 127.0.0.1`                               |
| `--port P`, `--metrics-port P`, `--ha-replication-port P` | the local port of (this service, P)              |
| `SERVICE:P` inside any argument                           | `127.0.0.1:` the local port of (SERVICE, P)      |
| `127.0.0.1:P`, `localhost:P`                              | the local port of (this service, P): a           |
|                                                           | healthcheck probes its own container             |
| a program on its default port (redis-server)              | that port made explicit, bound to 127.0.0.1      |

`SERVICE:P` covers `manager-a:50051`, `redis://redis:6379/0`, the demo's
`manager-a:50051=worker-a:50061` and a group's
`ha-manager-a:50051,ha-manager-b:50051`. Flags are written `--flag VALUE`, as
in the compose file. Everything else, the service's `environment:` included,
stays as written; what a test changes on purpose (an output directory, a
journal's path, a smaller workload) it changes with `with_flag`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

import yaml

from processes import free_port

ROOT = Path(__file__).resolve().parents[1]

# Flags whose value is a port the program listens on.
PORT_FLAGS = ("--port", "--metrics-port", "--ha-replication-port")
# Programs that listen on a default port when no port flag is given, and the
# arguments that bind them to the loopback interface.
DEFAULT_PORTS = {"redis-server": 6379}
LOCAL_BIND_ARGS = {"redis-server": ("--bind", "127.0.0.1")}
# Programs the images install from this repository rather than from the package.
REPOSITORY_SCRIPTS = {"grpc-health-check": ROOT / "docker" / "grpc_health_check.py"}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")

# HOST:PORT inside an argument, e.g. in "redis://redis:6379/0" or "a:1=b:2".
ADDRESS = re.compile(r"(?<![\w.-])([A-Za-z0-9][\w.-]*):(\d+)")


@dataclasses.dataclass(frozen=True)
class PublishedPort:
    host_ip: str
    host_port: int
    container_port: int


@dataclasses.dataclass(frozen=True)
class Service:
    """One service of a compose file, as far as running it goes."""

    name: str
    command: tuple[str, ...]
    environment: Mapping[str, str]
    depends_on: Mapping[str, str]  # service -> condition
    healthcheck: tuple[str, ...] | None  # the exec-form test, without its leading "CMD"
    ports: tuple[PublishedPort, ...]
    profiles: tuple[str, ...]  # empty: the service always starts
    raw: Mapping[str, Any]


def load_services(path: Path, profiles: Collection[str] = ()) -> dict[str, Service]:
    """The file's services that `docker compose --profile P` for every P in `profiles` starts (those of no
    profile, and those of one of `profiles`), in file order (YAML anchors and merge keys resolved)."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    services = {name: _service(name, body) for name, body in data["services"].items()}
    return {name: s for name, s in services.items() if not s.profiles or set(s.profiles) & set(profiles)}


def _service(name: str, body: Mapping[str, Any]) -> Service:
    command = body.get("command", ())
    assert isinstance(command, list), f"{name}: command must be an exec-form list, got {command!r}"
    environment = body.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    depends_on = body.get("depends_on", {})
    if isinstance(depends_on, list):
        depends_on = {dependency: "service_started" for dependency in depends_on}
    else:
        depends_on = {dependency: spec.get("condition", "service_started") for dependency, spec in depends_on.items()}
    healthcheck = None
    if "healthcheck" in body:
        test = body["healthcheck"]["test"]
        assert isinstance(test, list) and test[0] == "CMD", (
            f"{name}: healthcheck must be an exec-form CMD list, got {test!r}"
        )
        healthcheck = tuple(str(arg) for arg in test[1:])
    return Service(
        name=name,
        command=tuple(str(arg) for arg in command),
        environment={key: str(value) for key, value in environment.items()},
        depends_on=depends_on,
        healthcheck=healthcheck,
        ports=tuple(_published_port(name, spec) for spec in body.get("ports", ())),
        profiles=tuple(body.get("profiles", ())),
        raw=body,
    )


def _published_port(name: str, spec: Any) -> PublishedPort:
    """The short syntax `HOST_IP:HOST_PORT:CONTAINER_PORT[/tcp]`, the only one the file uses."""
    parts = str(spec).removesuffix("/tcp").split(":")
    assert len(parts) == 3, f"{name}: publish ports as HOST_IP:HOST_PORT:CONTAINER_PORT, got {spec!r}"
    return PublishedPort(parts[0], int(parts[1]), int(parts[2]))


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value after the last `flag` in `argv`, or None."""
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]
    return values[-1] if values else None


def with_flag(argv: Sequence[str], flag: str, value: str) -> list[str]:
    """`argv` with every value of `flag` replaced by `value` (the flag must be there)."""
    assert flag in argv, f"{flag} is not in {list(argv)}"
    return [value if i > 0 and argv[i - 1] == flag else arg for i, arg in enumerate(argv)]


def listen_ports(service: Service) -> tuple[int, ...]:
    """The ports the service's program listens on, from its command."""
    ports = tuple(int(service.command[i + 1]) for i, arg in enumerate(service.command[:-1]) if arg in PORT_FLAGS)
    if not ports and service.command and service.command[0] in DEFAULT_PORTS:
        return (DEFAULT_PORTS[service.command[0]],)
    return ports


def references(argv: Sequence[str]) -> list[tuple[str, int]]:
    """Every HOST:PORT inside the arguments, in order."""
    return [(m.group(1), int(m.group(2))) for arg in argv for m in ADDRESS.finditer(arg)]


def start_order(services: Mapping[str, Service]) -> list[str]:
    """Service names, every one after what it depends on; file order otherwise."""
    order: list[str] = []
    while len(order) < len(services):
        ready = [n for n, s in services.items() if n not in order and all(d in order for d in s.depends_on)]
        assert ready, f"a dependency cycle, or a dependency on a missing service, among {set(services) - set(order)}"
        order.append(ready[0])
    return order


def local_program(name: str) -> list[str]:
    """How to run `name` here: this environment's console script, a repository script, or the binary on PATH."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    if name in REPOSITORY_SCRIPTS:
        return [sys.executable, str(REPOSITORY_SCRIPTS[name])]
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is neither in {script.parent} nor on PATH")
    return [found]


class LocalPlan:
    """Local ports for every service of a compose file, and its commands rewritten to use them."""

    def __init__(self, services: Mapping[str, Service], pick_port: Callable[[], int] = free_port) -> None:
        self.services = dict(services)
        self.ports: dict[tuple[str, int], int] = {}
        for name, service in self.services.items():
            for port in listen_ports(service):
                local = pick_port()
                while local in self.ports.values():
                    local = pick_port()
                self.ports[(name, port)] = local

    def local_port(self, service: str, port: int) -> int:
        assert (service, port) in self.ports, (
            f"{service} does not listen on {port} (it listens on {self._listening(service)})"
        )
        return self.ports[(service, port)]

    def address(self, service: str, port: int) -> str:
        return f"127.0.0.1:{self.local_port(service, port)}"

    def command(self, name: str) -> list[str]:
        """The service's command, as it runs on this machine."""
        service = self.services[name]
        argv = self._rewrite(name, service.command)
        program = service.command[0]
        if program in DEFAULT_PORTS and not any(flag in service.command for flag in PORT_FLAGS):
            argv += ["--port", str(self.local_port(name, DEFAULT_PORTS[program]))]
        argv += LOCAL_BIND_ARGS.get(program, ())
        return argv

    def healthcheck(self, name: str) -> list[str] | None:
        """The service's healthcheck test, as it runs on this machine (probing the local service)."""
        test = self.services[name].healthcheck
        return None if test is None else self._rewrite(name, test)

    def environment(self, name: str) -> dict[str, str]:
        """This process's environment with the service's `environment:` entries on top."""
        return {**os.environ, **self.services[name].environment}

    def _rewrite(self, name: str, argv: Sequence[str]) -> list[str]:
        out = local_program(argv[0])
        previous = None
        for arg in argv[1:]:
            if previous == "--host":
                out.append("127.0.0.1")
            elif previous in PORT_FLAGS:
                out.append(str(self.local_port(name, int(arg))))
            else:
                out.append(ADDRESS.sub(lambda m: self._address(name, m.group(1), int(m.group(2))), arg))
            previous = arg
        return out

    def _address(self, name: str, host: str, port: int) -> str:
        if host in LOOPBACK_HOSTS:
            return self.address(name, port)
        assert host in self.services, f"{name} refers to {host}:{port}, and {host} is not a service of the file"
        return self.address(host, port)

    def _listening(self, service: str) -> list[int]:
        return [port for (name, port) in self.ports if name == service]
