"""``python manage.py gateway [--addr HOST:PORT] [--workers N]`` serves the
OpenAI-compatible gateway; ``gateway explain|lookup|layer|policy|resume|status`` are
the operator's tools around it."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import CommandParser

from cacheadmin.management.addresses import listen_address
from cacheadmin.management.base import ControlPlaneCommand, cli_actor, positive_int
from cacheadmin.management.ports import GATEWAY_EXAMPLE
from cacheadmin.metrics.multiproc import instance_dir, multiproc_use
from cacheadmin.models import CacheNamespace, Tenant
from cacheadmin.services.gateway import (
    POLICY_FIELDS,
    SWITCHED_LAYERS,
    gateway_explain,
    layer_states,
    layer_switch_set,
    namespace_routing_resume,
    tenant_gateway_policy,
    tenant_gateway_policy_update,
)
from gateway.connections import GuardedHttpToolsProtocol
from gateway.server import MAX_BODY_BYTES, MAX_JSON_DEPTH
from inference.errors import EXIT_CONFLICT
from inference.strict_json import loads_unique

ACTOR = cli_actor()


class Command(ControlPlaneCommand):
    help = (
        "Serve the gateway (/v1/chat/completions, /v1/completions, /v1/models) under uvicorn, or: explain how a request "
        "would be served, switch a cache layer, set a tenant's gateway policy, resume a suspended namespace, show status. "
        "Exit codes: 0 done; 2 bad input; 3 the address is taken; 4 refused."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--addr", default=None, help=f"HOST:PORT to listen on (default {settings.GATEWAY_ADDR})")
        parser.add_argument("--workers", type=positive_int, default=None, help=f"processes (default {settings.GATEWAY_WORKERS})")
        sub = parser.add_subparsers(dest="verb")
        explain = sub.add_parser("explain", help="route, canonical request, cache key and admission of one request body")
        explain.add_argument("--tenant", required=True, help="tenant slug")
        explain.add_argument("--request", required=True, help="file with the JSON request body ('-': stdin)")
        explain.add_argument(
            "--endpoint", choices=["chat", "completions"], default="chat", help="/v1/chat/completions or /v1/completions"
        )
        explain.add_argument("--tags", default="", help="the request's X-Cache-Tags (comma separated)")
        explain.add_argument("--json", action="store_true", help="print the explanation as JSON")
        lookup = sub.add_parser("lookup", help="where a request (or a token list) is cached now: engines per medium, layers")
        lookup.add_argument("--tenant", required=True, help="tenant slug")
        given = lookup.add_mutually_exclusive_group(required=True)
        given.add_argument("--request", help="file with the JSON request body ('-': stdin)")
        given.add_argument("--tokens", help="file with a JSON list of token ids ('-': stdin)")
        lookup.add_argument(
            "--endpoint", choices=["chat", "completions"], default="chat", help="/v1/chat/completions or /v1/completions"
        )
        layer = sub.add_parser("layer", help="turn a cache layer on or off for all traffic (kill switch)")
        layer.add_argument("layer", choices=list(SWITCHED_LAYERS), help="the cache layer")
        layer.add_argument("state", choices=["on", "off"], help="off: every request bypasses the layer")
        layer.add_argument("--reason", default="", help="why, for the audit trail")
        policy = sub.add_parser("policy", help="show or change a tenant's gateway policy")
        policy.add_argument("--tenant", required=True, help="tenant slug")
        policy.add_argument(
            "--set", action="append", default=[], metavar="FIELD=JSON", help=f"fields: {', '.join(POLICY_FIELDS)}"
        )
        resume = sub.add_parser("resume", help="route a namespace suspended after a deceptive hit again")
        resume.add_argument("namespace", type=positive_int, help="namespace id")
        resume.add_argument("--reason", required=True, help="why, for the audit trail")
        sub.add_parser("status", help="cache layers' switches")

    def handle(self, *args: Any, **opts: Any) -> None:
        verb = opts["verb"]
        if verb is None:
            self._serve(opts)
        elif verb == "explain":
            self._explain(opts)
        elif verb == "lookup":
            self._lookup(opts)
        elif verb == "layer":
            switch = layer_switch_set(layer=opts["layer"], enabled=opts["state"] == "on", actor=ACTOR, reason=opts["reason"])
            self.stdout.write(f"{switch.layer} cache {'on' if switch.enabled else 'off'}")
        elif verb == "policy":
            self._policy(opts)
        elif verb == "resume":
            namespace = CacheNamespace.objects.filter(pk=opts["namespace"]).first()
            if namespace is None:
                raise self.bad_input(f"no namespace {opts['namespace']}")
            namespace_routing_resume(namespace=namespace, actor=ACTOR, reason=opts["reason"])
            self.stdout.write(f"namespace {namespace.pk} routed again")
        else:
            self.stdout.write(json.dumps(layer_states(), default=str))

    def _serve(self, opts: dict[str, Any]) -> None:
        # A SIGTERM before uvicorn installs its handlers (while it imports and
        # forks) stops the command as documented (exit 0), not by the default
        # action (143); uvicorn replaces this handler once it runs.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        import uvicorn

        source = "--addr" if opts["addr"] else "GATEWAY_ADDR"
        try:
            addr = listen_address(opts["addr"] or settings.GATEWAY_ADDR, example=GATEWAY_EXAMPLE)
        except ValueError as exc:
            raise self.bad_input(f"{source}: {exc}") from exc
        host, port = addr.host, addr.port
        workers = opts["workers"] or settings.GATEWAY_WORKERS
        try:
            # Refused here, in one line, rather than by uvicorn after it printed its own start.
            with socket.create_server((host, port), family=addr.family):
                pass
        except OSError as exc:
            # create_server() appends "(while attempting to bind on address ...)": the address is said already.
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise self.failed(
                f"cannot listen on {addr}: {reason}; set another with --addr or GATEWAY_ADDR", EXIT_CONFLICT
            ) from exc
        # This gateway's processes share a metrics folder of its own (its /metrics shows them alone): another
        # gateway on the same VAR_DIR keeps its own, and only dead gateways' folders are removed.
        multiproc_use(instance_dir(settings.GATEWAY_METRICS_DIR))
        self.stdout.write(f"gateway on http://{addr}/v1 ({workers} process{'es' if workers > 1 else ''})")
        self.stdout.flush()
        # access_log off: request lines carry no prompt, but the figures are what operators read. Info level:
        # the supervisor says so when it replaces a process ("Child process [pid] died").
        # The guarded protocol: read deadlines and a per-address cap (gateway.connections), which uvicorn lacks.
        uvicorn.run("gateway.asgi:create_app", factory=True, host=host, port=port, workers=workers, log_level="info",
                    access_log=False, timeout_graceful_shutdown=10, http=GuardedHttpToolsProtocol,
                    timeout_keep_alive=settings.GATEWAY_KEEPALIVE_S,
                    # No WebSockets: an upgraded connection leaves the guarded protocol, whose per-address count
                    # then never went down (128 upgrade requests locked an address out). Upgrades are plain HTTP.
                    ws="none",
                    timeout_worker_healthcheck=settings.GATEWAY_WORKER_HEALTHCHECK_S)  # fmt: skip

    def _tenant(self, opts: dict[str, Any]) -> Tenant:
        tenant = Tenant.objects.filter(slug=opts["tenant"]).first()
        if tenant is None:
            raise self.bad_input(f"no tenant {opts['tenant'][:63]!r}")
        return tenant

    def _read_json(self, opts: dict[str, Any], option: str, kind: type) -> Any:
        """The JSON value of the file ``--<option>`` names ('-': stdin), which must be a ``kind``."""
        name = opts[option]
        try:
            text = self.stdin_text() if name == "-" else Path(name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise self.bad_input(f"--{option} {name[:200]}: {exc}") from exc
        if len(text.encode("utf-8", "surrogatepass")) > MAX_BODY_BYTES:
            raise self.bad_input(f"--{option}: over {MAX_BODY_BYTES} bytes (the gateway answers 413)")
        try:
            value = loads_unique(text)
        except ValueError as exc:
            raise self.bad_input(f"--{option} is not JSON: {exc}") from exc
        except RecursionError:
            raise self.bad_input(f"--{option} is nested deeper than {MAX_JSON_DEPTH} levels") from None
        if not isinstance(value, kind):
            what = "a JSON object (the request body)" if kind is dict else "a JSON list of token ids"
            raise self.bad_input(f"--{option} must hold {what}")
        return value

    def _lookup(self, opts: dict[str, Any]) -> None:
        from cacheadmin.services.cache_lookup import cache_lookup  # loads the gateway's layers: lookup only

        tenant = self._tenant(opts)
        if opts["request"] is not None:
            out = cache_lookup(tenant=tenant, endpoint=opts["endpoint"], body=self._read_json(opts, "request", dict))
        else:
            out = cache_lookup(tenant=tenant, endpoint=opts["endpoint"], tokens=self._read_json(opts, "tokens", list))
        self.stdout.write(json.dumps(out, ensure_ascii=False))

    def _explain(self, opts: dict[str, Any]) -> None:
        tenant = self._tenant(opts)
        body = self._read_json(opts, "request", dict)
        out = gateway_explain(tenant=tenant, endpoint=opts["endpoint"], body=body, tags=opts["tags"].split(","))
        if opts["json"]:
            self.stdout.write(json.dumps(out, ensure_ascii=False, default=str))
            return
        route = out["route"]
        if "error" in route:
            self.stdout.write(f"route: none ({route['error']}: {route['message']})")
        else:
            engine = route["engine"]["name"] if route["engine"] else f"none ({route['engine_reason']})"
            self.stdout.write(
                f"route: {route['served_name']} → {route['label']} ({route['percent']} %, bucket {route['bucket']}), "
                f"namespace {route['namespace']}, engine {engine}"
            )
            self._routing(route.get("routing"))
        rc, sc = out["response_cache"], out["semantic_cache"]
        key = rc["key"] or "— (no route: computed per namespace)"
        self.stdout.write(f"response cache: {'admitted' if rc['admitted'] else 'bypassed'} ({rc['reason']}), key {key}")
        self.stdout.write(f"semantic cache: {'admitted' if sc['admitted'] else 'bypassed: ' + str(sc['reason'])}")
        self.stdout.write("canonical request: " + json.dumps(out["canonical_request"], ensure_ascii=False, sort_keys=True))

    def _routing(self, routing: dict[str, Any] | None) -> None:
        """How the engine was chosen: precise (each candidate's cached blocks, load and cost) or why not."""
        if routing is None:
            return
        if routing["mode"] != "precise":
            self.stdout.write(f"engine choice: {routing['mode']} ({routing['reason']})")
            return
        self.stdout.write(
            f"engine choice: precise, {routing['blocks']} blocks, {routing['predicted_cached_tokens']} prompt tokens "
            "predicted cached on the winner (lowest cost: blocks to compute + load)"
        )
        for c in routing["candidates"]:
            self.stdout.write(
                f"  {c['engine']}: {c['cached_blocks']} leading blocks held ({c['confirmed_blocks']} confirmed by its events, "
                f"weight {c['weighted_blocks']}), load {c['load']}, "
                f"cost {c['cost']}, index {c['index']}"
            )

    def stdin_text(self) -> str:
        """The request body from standard input."""
        import sys

        return sys.stdin.read()

    def _policy(self, opts: dict[str, Any]) -> None:
        tenant = Tenant.objects.filter(slug=opts["tenant"]).first()
        if tenant is None:
            raise self.bad_input(f"no tenant {opts['tenant'][:63]!r}")
        changes: dict[str, Any] = {}
        for item in opts["set"]:
            name, sep, raw = item.partition("=")
            if not sep:
                raise self.bad_input(f"--set {item[:80]!r}: use FIELD=JSON, e.g. allow_seeded=true")
            if name in changes:
                # As the API refuses a duplicate key: which of the two was meant is not the command's guess.
                raise self.bad_input(f"--set {name[:60]}: given twice")
            try:
                changes[name] = loads_unique(raw)
            except ValueError as exc:
                raise self.bad_input(f"--set {name[:60]}: not JSON: {exc}") from exc
            except RecursionError:
                raise self.bad_input(f"--set {name[:60]}: nested too deeply") from None
        policy = (
            tenant_gateway_policy_update(tenant=tenant, actor=ACTOR, changes=changes)
            if changes
            else tenant_gateway_policy(tenant)
        )
        self.stdout.write(json.dumps({name: getattr(policy, name) for name in POLICY_FIELDS}))
