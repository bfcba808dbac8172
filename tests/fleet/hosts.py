"""The project's own test hosts: network namespaces this test run creates, joined by veth pairs to
a bridge, each with an address that exists only there, and processes started inside them.

A "host" here shares this machine's filesystem and processes table but has its own network stack:
what one host binds, another reaches only over the bridge, at that host's address. Every process
started in a host is in its own process group (``setsid``), so it is ended by group; losing a host
kills every process whose network namespace is that host's (by pid: they are all this run's).

Needs root (``ip netns add``) and iproute2; :func:`hosts_available` says whether this machine has both.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from inference.child_env import die_with_parent
from inference.engines.ray_backend import cluster_nodes, ray_disconnect
from inference.errors import EngineError

PROJECT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def hosts_available() -> str | None:
    """None when test hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _free_subnet() -> int:
    """A third octet ``n`` whose ``10.213.n.0/24`` no interface of this machine uses (runs side by side differ)."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    for n in range(1 + os.getpid() % 200, 255):
        if f"10.213.{n}." not in used:
            return n
    raise RuntimeError("no free 10.213.n.0/24 subnet for test hosts")


@dataclass
class NetHost:
    """One host: a network namespace with ``address`` on its ``eth0``."""

    name: str
    netns: str
    address: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, argv: list[str], *, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this host, in its own process group, logging to ``log``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *argv], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=PROJECT, start_new_session=True,
                # A test run killed outright still ends its Ray nodes (ip netns exec execs the command).
                preexec_fn=die_with_parent,
            )  # fmt: skip
        self.processes.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process whose network namespace is this host's."""
        target = os.stat(f"/run/netns/{self.netns}").st_ino
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    if os.stat(f"/proc/{entry.name}/ns/net").st_ino == target:
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    def kill_all(self) -> int:
        """The host dies: SIGKILL every process in it. Returns how many were killed."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.processes = [p for p in self.processes if p.poll() is None]
        return len(pids)

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """End this host's process groups: SIGTERM, then SIGKILL to whatever is left in it."""
        for proc in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.pids():
            time.sleep(0.2)
        self.kill_all()


class HostNetwork:
    """Hosts ``names`` on a bridge of their own, with addresses ``10.213.n.1``, ``.2``…; this
    machine reaches them at ``10.213.n.254`` (the bridge; nothing listens there)."""

    def __init__(self, names: list[str]) -> None:
        tag = f"{os.getpid() % 100000}"
        self.subnet = _free_subnet()
        self.bridge = f"kvb{tag}"
        self.hosts: dict[str, NetHost] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"10.213.{self.subnet}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names, start=1):
                netns = f"kvcp-{tag}-{name}"
                outside = f"kv{tag}{name}"[:15]
                _ip("netns", "add", netns)
                host = NetHost(name=name, netns=netns, address=f"10.213.{self.subnet}.{i}")
                self.hosts[name] = host
                _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", netns)
                _ip("link", "set", outside, "master", self.bridge, "up")
                _ip("-n", netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", netns, "link", "set", "eth0", "up")
                _ip("-n", netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @property
    def cidr(self) -> str:
        """The hosts' network."""
        return f"10.213.{self.subnet}.0/24"

    def close(self) -> None:
        """Stop every host's processes and remove the namespaces and the bridge."""
        for host in self.hosts.values():
            host.stop_all()
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def ray_environment(**extra: str) -> dict[str, str]:
    """What every Ray process of the test cluster runs with: this checkout importable, no usage
    statistics (Ray would probe an outside address), the project's virtualenv first on PATH."""
    env = {
        "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(PROJECT), "RAY_USAGE_STATS_ENABLED": "0", "LANG": "C.UTF-8",
    }  # fmt: skip
    return {**env, **extra}


@dataclass
class RayTestCluster:
    """A Ray cluster across test hosts: the head on one, a worker node on each of the others,
    each node offering ``kvcp-host-<name>: 1`` (so it is host ``<name>`` to the control plane)."""

    network: HostNetwork
    head: str
    temp_dir: Path
    log_dir: Path
    started_s: float = 0.0

    @property
    def address(self) -> str:
        """``RAY_ADDRESS`` of the control plane (the head's Ray Client server)."""
        return f"ray://{self.network.hosts[self.head].address}:10001"

    def start_head(self) -> None:
        """``ray start --head`` on the head host (no dashboard, no CPUs: engines go to worker hosts)."""
        host = self.network.hosts[self.head]
        host.spawn(
            [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address", host.address, "--port", "6379",
             "--ray-client-server-port", "10001", "--include-dashboard=false", "--num-cpus", "0",
             "--resources", f'{{"kvcp-host-{host.name}": 1}}', "--temp-dir", str(self.temp_dir), "--disable-usage-stats"],
            env=ray_environment(), log=self.log_dir / f"ray-{host.name}.log",
        )  # fmt: skip

    def start_worker(self, name: str, *, cpus: int = 2) -> None:
        """``ray start`` of a worker node on host ``name``, joining the head."""
        host = self.network.hosts[name]
        head = self.network.hosts[self.head].address
        host.spawn(
            [str(VENV_BIN / "ray"), "start", "--block", "--address", f"{head}:6379", "--node-ip-address", host.address,
             "--num-cpus", str(cpus), "--resources", f'{{"kvcp-host-{name}": 1}}', "--disable-usage-stats"],
            env=ray_environment(), log=self.log_dir / f"ray-{name}.log",
        )  # fmt: skip


def wait_nodes(address: str, hosts: set[str], *, timeout_s: float = 120.0) -> None:
    """Wait until the cluster at ``address`` has a live node for each of ``hosts``.

    Raises:
        AssertionError: it did not, within ``timeout_s`` (with what it had).
    """

    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        try:
            seen = {n.host for n in cluster_nodes(address) if n.alive}
        except EngineError:
            ray_disconnect()
            seen = set()
        if hosts <= seen:
            return
        time.sleep(1)
    raise AssertionError(f"the Ray cluster has live hosts {sorted(seen)}, not {sorted(hosts)}")


@contextlib.contextmanager
def ray_cluster(names: list[str], *, log_dir: Path) -> Iterator[RayTestCluster]:
    """Test hosts ``names`` and a Ray cluster across them (head on the first); everything is ended after."""
    network = HostNetwork(names)
    temp_dir = Path(f"/tmp/kvcp-ray-{os.getpid()}")
    cluster = RayTestCluster(network=network, head=names[0], temp_dir=temp_dir, log_dir=log_dir)
    try:
        started = time.monotonic()
        cluster.start_head()
        wait_nodes(cluster.address, {names[0]}, timeout_s=90)
        for name in names[1:]:
            cluster.start_worker(name)
        wait_nodes(cluster.address, set(names), timeout_s=90)
        cluster.started_s = time.monotonic() - started
        yield cluster
    finally:
        ray_disconnect()
        network.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
