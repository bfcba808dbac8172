"""Kubernetes InferencePools: the control plane adopts their vLLM pods, it never deploys them.

An ``InferencePool`` (Gateway API Inference Extension, ``inference.networking.k8s.io/v1``)
names a set of model-server pods by label and the ports they serve on. The pool's
controller (KServe, llm-d, a plain Deployment) runs the pods; this module reads the
pool and its pods through the Kubernetes API and keeps the fleet in step:

- every Running and Ready pod with an IP is adopted per target port, by URL
  ``http://{podIP}:{port}``, through :func:`cacheadmin.services.fleet.engine_adopt`
  (verified against the pool's model version like any adopted engine), and its row
  records the pool and the pod's node (``Engine.host``);
- an engine whose pod is gone, not ready, terminating or moved to another IP is
  stopped (:func:`cacheadmin.services.engines.engine_stop`: an adopted engine is only
  taken out of service), and a moved pod is adopted again at its new address;
- a pod refused by verification (or by the address policy, a quota...) is named with
  the reason in the pool's ``sync_error``; the other pods still go through.

Shapes read (published API types, vendored copies' sources in tests/k8s/recorded/README.md):
the pool's ``spec.selector.matchLabels`` and ``spec.targetPorts[].number``
(gateway-api-inference-extension ``api/v1/inferencepool_types.go``, ``shared_types.go``);
each pod's ``metadata.name``, ``metadata.deletionTimestamp``, ``spec.nodeName``,
``status.phase``, ``status.podIP`` and ``status.conditions[type=Ready]`` (Kubernetes core/v1 Pod).

Neither the adopter nor anything else here has run against a real cluster: it is
contract-tested against recorded API responses served by a local HTTP server.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from cacheadmin.models import CacheNamespace, Engine, InferencePool, ModelVersion
from cacheadmin.services.audit import audit_record
from cacheadmin.services.engines import LIVE_STATUSES, EngineRefused, engine_stop
from cacheadmin.services.fleet import _declared_connector, engine_adopt
from cacheadmin.services.namespaces import namespace_check_current
from inference.errors import ControlPlaneError, InvalidField, Refused

if TYPE_CHECKING:
    from kubernetes.client import ApiClient  # type: ignore[import-untyped]

#: The InferencePool resource (gateway-api-inference-extension ``api/v1/zz_generated.register.go``,
#: ``config/crd/bases/inference.networking.k8s.io_inferencepools.yaml``).
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
#: (connect, read) seconds of each Kubernetes API request.
API_TIMEOUT_S = (5.0, 30.0)
#: Pods asked for per page of the pod list; pages followed at most.
POD_PAGE, MAX_POD_PAGES = 500, 20

#: RFC 1123 label (a namespace) and subdomain (an object name), as Kubernetes validates them
#: (k8s.io/apimachinery ``pkg/util/validation/validation.go`` ``IsDNS1123Label``/``IsDNS1123Subdomain``).
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
#: ``LabelKey``/``LabelValue`` of the pool's selector (gateway-api-inference-extension ``api/v1/shared_types.go``).
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
)
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
#: Longest engine name (``Engine.name``) and the part of it kept before a digest when a name is longer.
_NAME_MAX, _NAME_KEPT = 100, 80


class InferencePoolRefused(Refused):
    """The pool cannot be read: the Kubernetes API is not configured or not reachable,
    refuses the credentials, has no such pool, or the pool's spec is not the published
    v1 shape (409 ``inference_pool_refused``, exit 4). The message says which, never
    the API server's response body."""

    code = "inference_pool_refused"


@dataclass(frozen=True)
class PoolSpec:
    """What the adopter reads of an InferencePool.

    Attributes:
        selector: ``spec.selector.matchLabels``, label → value.
        ports: ``spec.targetPorts[].number`` in the pool's order.
    """

    selector: dict[str, str]
    ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        """The pod list's ``labelSelector``: ``k1=v1,k2=v2`` sorted by key (equality-based selector syntax)."""
        return ",".join(f"{key}={self.selector[key]}" for key in sorted(self.selector))


@dataclass(frozen=True)
class PodView:
    """One pod as the adopter sees it.

    Attributes:
        name: ``metadata.name``.
        ip: ``status.podIP`` ("" while it has none).
        node: ``spec.nodeName`` ("" before it is scheduled).
        ready: Running, ``Ready`` condition ``True``, an IP, and not terminating
            (``metadata.deletionTimestamp`` unset).
        why_not: why it is not ready ("" when it is).
    """

    name: str
    ip: str
    node: str
    ready: bool
    why_not: str


def pool_ref_parse(pool_ref: str) -> tuple[str, str]:
    """``"NAMESPACE/NAME"`` → ``(namespace, name)``.

    Raises:
        InvalidField: on ``pool_ref``: not two parts, a namespace that is not a DNS-1123
            label (at most 63), or a name that is not a DNS-1123 subdomain (at most 253).
    """
    if not isinstance(pool_ref, str) or pool_ref.count("/") != 1:
        raise InvalidField("pool_ref", "NAMESPACE/NAME, e.g. llm/qwen-pool")
    namespace, name = pool_ref.split("/")
    if len(namespace) > 63 or not _DNS1123_LABEL.fullmatch(namespace):
        raise InvalidField("pool_ref", "the namespace must be a DNS-1123 label: a-z, 0-9 and '-', at most 63")
    if len(name) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(name):
        raise InvalidField("pool_ref", "the name must be a DNS-1123 subdomain: a-z, 0-9, '-' and '.', at most 253")
    return namespace, name


def kubernetes_api_client() -> ApiClient:
    """A Kubernetes API client configured from ``settings.KUBECONFIG``: a kubeconfig
    file's current context, or the pod's service account when it is empty
    (``kubernetes.config.load_incluster_config``). Close it after use.

    Raises:
        InferencePoolRefused: the configuration cannot be loaded (no in-cluster
            environment, a missing or malformed kubeconfig).
    """
    from kubernetes import client, config  # type: ignore[import-untyped]  # lazy: 0.3 s of imports each process pays

    try:
        if settings.KUBECONFIG:
            return config.new_client_from_config(config_file=settings.KUBECONFIG)
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except yaml.YAMLError as exc:
        # The parser's message quotes the file's text, which holds credentials: only where it broke is said.
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise InferencePoolRefused(f"the kubeconfig {settings.KUBECONFIG} is not valid YAML{at}") from None
    except (config.ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
        where = f"the kubeconfig {settings.KUBECONFIG}" if settings.KUBECONFIG else "the in-cluster service account"
        raise InferencePoolRefused(f"the Kubernetes API client cannot be configured from {where}: {exc}") from exc


def _api_call(what: str, call: Any) -> Any:
    """Run one Kubernetes API call; its failures as :class:`InferencePoolRefused`."""
    from kubernetes.client.exceptions import ApiException  # type: ignore[import-untyped]
    from urllib3.exceptions import HTTPError

    try:
        return call()
    except ApiException as exc:
        if exc.status == 404:
            raise InferencePoolRefused(f"{what}: not found (404)") from exc
        if exc.status in (401, 403):
            raise InferencePoolRefused(f"{what}: the Kubernetes API refused the credentials ({exc.status} {exc.reason})") from exc
        raise InferencePoolRefused(f"{what}: the Kubernetes API answered {exc.status} {exc.reason}") from exc
    except (HTTPError, OSError) as exc:
        raise InferencePoolRefused(f"{what}: the Kubernetes API cannot be reached ({type(exc).__name__})") from exc
    except ValueError as exc:  # a body that is not JSON
        raise InferencePoolRefused(f"{what}: the Kubernetes API answered something that is not JSON") from exc


def pool_read(api: ApiClient, namespace: str, name: str) -> PoolSpec:
    """Read one InferencePool: ``GET /apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools/{name}``.

    Raises:
        InferencePoolRefused: the API cannot be reached or refuses; no such pool; a
            spec without ``selector.matchLabels`` or ``targetPorts`` of the v1 shape
            (label keys and values as ``shared_types.go`` validates them, ports 1..65535).
    """
    from kubernetes.client import CustomObjectsApi

    what = f"InferencePool {namespace}/{name}"
    body = _api_call(
        what,
        lambda: CustomObjectsApi(api).get_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL, name, _request_timeout=API_TIMEOUT_S
        ),
    )
    spec = body.get("spec") if isinstance(body, dict) else None
    selector = (spec or {}).get("selector", {}).get("matchLabels") if isinstance(spec, dict) else None
    ports = (spec or {}).get("targetPorts") if isinstance(spec, dict) else None
    if not isinstance(selector, dict) or not selector or not 1 <= len(selector) <= 64:
        raise InferencePoolRefused(f"{what}: spec.selector.matchLabels must hold 1 to 64 labels (inference.networking.k8s.io/v1)")
    for key, value in selector.items():
        if not (isinstance(key, str) and len(key) <= 253 and _LABEL_KEY.fullmatch(key)):
            raise InferencePoolRefused(f"{what}: spec.selector.matchLabels has a key that is no label key")
        if not (isinstance(value, str) and len(value) <= 63 and _LABEL_VALUE.fullmatch(value)):
            raise InferencePoolRefused(f"{what}: spec.selector.matchLabels[{key}] is no label value")
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8:
        raise InferencePoolRefused(f"{what}: spec.targetPorts must list 1 to 8 ports (inference.networking.k8s.io/v1)")
    numbers = []
    for port in ports:
        number = port.get("number") if isinstance(port, dict) else None
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 65535 or number in numbers:
            raise InferencePoolRefused(f"{what}: spec.targetPorts[].number must be unique port numbers within 1..65535")
        numbers.append(number)
    return PoolSpec(selector=dict(selector), ports=tuple(numbers))


def _pod_view(item: dict[str, Any]) -> PodView:
    """One item of a PodList as the adopter reads it."""
    metadata, spec, status = item.get("metadata") or {}, item.get("spec") or {}, item.get("status") or {}
    name, ip, node = str(metadata.get("name", "")), str(status.get("podIP") or ""), str(spec.get("nodeName") or "")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    if metadata.get("deletionTimestamp"):
        why = "terminating"
    elif status.get("phase") != "Running":
        why = f"phase {status.get('phase') or 'unknown'}"
    elif not ready:
        why = "not Ready"
    elif not ip:
        why = "no pod IP"
    else:
        why = ""
    return PodView(name=name, ip=ip, node=node, ready=not why, why_not=why)


def pods_list(api: ApiClient, namespace: str, pool: PoolSpec) -> list[PodView]:
    """The pool's pods: ``GET /api/v1/namespaces/{namespace}/pods?labelSelector=...``, every page.

    Raises:
        InferencePoolRefused: the API cannot be reached or refuses, or answers no PodList.
    """
    from kubernetes.client import CoreV1Api

    what = f"the pods of {namespace} matching {pool.label_selector}"
    core = CoreV1Api(api)

    def page(token: str | None) -> Any:
        extra = {"_continue": token} if token else {}
        response = core.list_namespaced_pod(
            namespace, label_selector=pool.label_selector, limit=POD_PAGE, _preload_content=False,
            _request_timeout=API_TIMEOUT_S, **extra,
        )  # fmt: skip
        return json.loads(response.data)

    pods: list[PodView] = []
    token = None
    for _ in range(MAX_POD_PAGES):
        body = _api_call(what, lambda: page(token))  # noqa: B023 - called before the loop moves on
        if not isinstance(body, dict) or not isinstance(body.get("items"), list):
            raise InferencePoolRefused(f"{what}: the Kubernetes API answered no PodList")
        pods += [_pod_view(item) for item in body["items"] if isinstance(item, dict)]
        token = (body.get("metadata") or {}).get("continue")
        if not token:
            return pods
    raise InferencePoolRefused(f"{what}: more than {MAX_POD_PAGES * POD_PAGE} pods")


def _engine_base_name(pool: InferencePool, pod: str, port: int, ports: int) -> str:
    """``{k8s namespace}.{pool}.{pod}`` (``.{port}`` when the pool has several ports), as
    :func:`cacheadmin.services.engines.engine_name_check` allows it: a longer one keeps its
    first 80 characters and a digest of the whole."""
    name = f"{pool.k8s_namespace}.{pool.name}.{pod}" + (f".{port}" if ports > 1 else "")
    if len(name) > _NAME_MAX - 4:  # room for a "_NNN" suffix
        name = f"{name[:_NAME_KEPT]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
    return name


def _is_engine_of(engine: Engine, base: str) -> bool:
    """Whether ``engine`` was named after ``base`` (the base itself, or ``base_N`` after a re-adoption:
    ``_`` is never in a DNS-1123 name, so another pod's name cannot look like one)."""
    return engine.name == base or re.fullmatch(re.escape(base) + r"_[0-9]{1,3}", engine.name) is not None


def _free_name(base: str) -> str:
    """``base``, or ``base_2``, ``base_3``... the first no engine holds (a stopped engine keeps its name)."""
    taken = set(Engine.objects.filter(name__startswith=base).values_list("name", flat=True))
    if base not in taken:
        return base
    return next(f"{base}_{n}" for n in range(2, 1000) if f"{base}_{n}" not in taken)


@dataclass
class _Sync:
    """One sync's outcome, counted and explained."""

    adopted: int = 0
    removed: int = 0
    kept: int = 0
    refused: int = 0
    problems: list[str] = field(default_factory=list)

    def refuse(self, what: str, why: str) -> None:
        self.refused += 1
        self.problems.append(f"{what}: {' '.join(why.split())}")

    def counts(self) -> dict[str, int]:
        return {"adopted": self.adopted, "removed": self.removed, "kept": self.kept, "refused": self.refused}


def _adopt_pod(pool: InferencePool, pod: PodView, port: int, base: str, actor: str) -> Engine:
    """Adopt one pod's port through :func:`engine_adopt`, then record the pool and the node.

    Raises:
        ControlPlaneError: the adoption was refused (verification, address policy, quota...).
    """
    engine = engine_adopt(
        url=f"http://{pod.ip}:{port}", model_version=pool.model_version, namespace=pool.namespace, actor=actor,
        name=_free_name(base), kv_connector=pool.kv_connector,
    )  # fmt: skip
    Engine.objects.filter(pk=engine.pk).update(inference_pool=pool, host=pod.node)
    return engine


def _claim_orphan(pool: InferencePool, pod: PodView, url: str, base: str) -> bool:
    """Attach to the pool a live engine adopted for this pod whose row never got its pool (the
    adopting process died between :func:`engine_adopt` and the update); True when there was one.
    Without this, the pod's address would be refused as a live engine forever."""
    for orphan in Engine.objects.filter(
        inference_pool=None, origin=Engine.Origin.ADOPTED, status__in=LIVE_STATUSES, base_url=url, name__startswith=base
    ):
        if _is_engine_of(orphan, base):
            return bool(Engine.objects.filter(pk=orphan.pk, inference_pool=None).update(inference_pool=pool, host=pod.node))
    return False


def inference_pool_sync(pool: InferencePool, *, actor: str, spec: PoolSpec | None = None) -> dict[str, int]:
    """Bring the pool's engines in step with its Ready pods (see the module docstring).

    Idempotent: with nothing changed in the cluster, a second sync adopts, stops and
    writes no engine (only the pool's ``synced_at`` moves). The pool's ``sync_error``
    names each pod refused and why, or is emptied when none was.

    Args:
        spec: the pool as just read (:func:`inference_pool_adopt` reads it once); None reads it.

    Returns:
        ``{"adopted": n, "removed": n, "kept": n, "refused": n}``; a pod whose IP changed
        counts once removed and once adopted (or refused).

    Raises:
        InferencePoolRefused: the pool or its pods cannot be read; recorded in ``sync_error``
            first, and no engine is stopped (an unreachable API says nothing about the pods).
    """
    pool = InferencePool.objects.select_related("model_version", "namespace").get(pk=pool.pk)
    try:
        with kubernetes_api_client() as api:
            spec = spec or pool_read(api, pool.k8s_namespace, pool.name)
            pods = pods_list(api, pool.k8s_namespace, spec)
    except InferencePoolRefused as exc:
        InferencePool.objects.filter(pk=pool.pk).update(sync_error=str(exc), synced_at=timezone.now())
        raise
    outcome = _Sync()
    live = list(Engine.objects.filter(inference_pool=pool, status__in=LIVE_STATUSES))
    wanted = [
        (pod, port, _engine_base_name(pool, pod.name, port, len(spec.ports)))
        for pod in sorted(pods, key=lambda p: p.name)
        if pod.ready
        for port in spec.ports
    ]
    kept: set[int] = set()
    for pod, port, base in wanted:
        current = next((e for e in live if _is_engine_of(e, base) and e.base_url == f"http://{pod.ip}:{port}"), None)
        if current is None:
            continue
        kept.add(current.pk)
        outcome.kept += 1
        if current.host != pod.node:  # rescheduled onto another node under the same IP: rare, recorded
            Engine.objects.filter(pk=current.pk).update(host=pod.node)
    for engine in live:
        if engine.pk not in kept:
            engine_stop(engine=engine, actor=actor)
            outcome.removed += 1
    for pod, port, base in wanted:
        url = f"http://{pod.ip}:{port}"
        if any(_is_engine_of(e, base) and e.base_url == url for e in live if e.pk in kept):
            continue
        try:
            if not _claim_orphan(pool, pod, url, base):
                _adopt_pod(pool, pod, port, base, actor)
            outcome.adopted += 1
        except ControlPlaneError as exc:
            outcome.refuse(f"pod {pod.name} ({url})", str(exc))
        except IntegrityError:  # another sync of this pool took the name first
            outcome.refuse(f"pod {pod.name} ({url})", "adopted meanwhile by another sync")
    InferencePool.objects.filter(pk=pool.pk).update(sync_error="\n".join(outcome.problems), synced_at=timezone.now())
    return outcome.counts()


def inference_pool_adopt(
    *,
    pool_ref: str,
    model_version: ModelVersion,
    namespace: CacheNamespace | None,
    actor: str,
    kv_connector: str = "",
) -> InferencePool:
    """Record an InferencePool whose pods the control plane adopts, and run its first sync.

    Everything is checked before anything is recorded: the ref, the connector
    declaration, the namespace (current, of the version's identity), that no pool of
    that name is recorded yet, and that the pool can be read (the Kubernetes API
    reachable, the pool there, of the v1 shape). Pods the first sync refuses are named
    in the returned pool's ``sync_error``; the pool is recorded all the same.

    Args:
        pool_ref: ``"NAMESPACE/NAME"`` of the InferencePool.
        namespace: the cache namespace the pods serve; None adopts them as reference engines.
        kv_connector: the pods' KV connector when their ``/server_info`` is off
            (``none`` or a class name, as :func:`engine_adopt` takes it).

    Returns:
        The recorded pool, after its first sync.

    Raises:
        InvalidField: a malformed ref or ``kv_connector``; the pool is recorded already.
        EngineRefused: the namespace belongs to another identity.
        NamespaceConflict: a superseded shared-group namespace.
        InferencePoolRefused: the pool cannot be read (nothing recorded).
    """
    k8s_namespace, name = pool_ref_parse(pool_ref.strip() if isinstance(pool_ref, str) else pool_ref)
    declared = _declared_connector(kv_connector)
    if namespace is not None:
        namespace_check_current(namespace)
        if namespace.model_version.identity != model_version.identity:
            raise EngineRefused(
                f"namespace {namespace.namespace_key[:12]}… belongs to {namespace.model_version.label}, not {model_version.label}"
            )
    if InferencePool.objects.filter(k8s_namespace=k8s_namespace, name=name).exists():
        raise InvalidField("pool_ref", f"the InferencePool {k8s_namespace}/{name} is adopted already")
    with kubernetes_api_client() as api:
        spec = pool_read(api, k8s_namespace, name)
    try:
        with transaction.atomic():
            pool = InferencePool.objects.create(
                k8s_namespace=k8s_namespace, name=name, model_version=model_version, namespace=namespace,
                kv_connector="none" if declared == "" else (declared or ""), created_by=actor,
            )  # fmt: skip
            audit_record(
                actor=actor, action="inference_pool.adopt", obj=pool,
                after={"pool": f"{k8s_namespace}/{name}", "model_version": model_version.label,
                       "namespace": namespace.namespace_key if namespace else None, "selector": spec.selector,
                       "ports": list(spec.ports)},
            )  # fmt: skip
    except IntegrityError:  # adopted by another caller since the check above
        raise InvalidField("pool_ref", f"the InferencePool {k8s_namespace}/{name} is adopted already") from None
    try:
        inference_pool_sync(pool, actor=actor, spec=spec)
    except InferencePoolRefused:
        pass  # read a moment ago; the sync recorded why it could not run now, and the schedule retries
    pool.refresh_from_db()
    return pool


def inference_pools_sync_all(*, actor: str = "schedule") -> dict[str, dict[str, int] | str]:
    """Sync every active pool (scheduled every 60 s, :mod:`cacheadmin.schedules`).

    A pool that cannot be read has the reason in its ``sync_error``; the others still sync.

    Returns:
        ``"NAMESPACE/NAME"`` → its counts (:func:`inference_pool_sync`), or the reason it
        could not be synced.
    """
    report: dict[str, dict[str, int] | str] = {}
    for pool in InferencePool.objects.filter(active=True).order_by("k8s_namespace", "name"):
        try:
            report[str(pool)] = inference_pool_sync(pool, actor=actor)
        except InferencePoolRefused as exc:
            report[str(pool)] = str(exc)
    return report
