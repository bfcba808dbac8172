"""``python manage.py engine attach ENGINE_ID NAMESPACE_ID`` and ``engine list``.

Twin of ``POST /api/engines/{id}/attach/``. Exit codes: 0 done; 2 bad input;
4 refused (salt-blind persistent tier, other identity, reference engine).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand, get_or_bad_input, positive_int
from cacheadmin.models import CacheNamespace, Engine
from cacheadmin.services.engines import engine_attach_namespace


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        attach = sub.add_parser("attach", help="serve another namespace from the engine's memory")
        attach.add_argument("engine", type=positive_int)
        attach.add_argument("namespace", type=positive_int)
        sub.add_parser("list", help="list engines")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["verb"] == "list":
            for e in Engine.objects.select_related("model_version").order_by("id"):
                tier = e.kv_connector or "memory"
                self.stdout.write(f"{e.pk}  {e.name:32} {e.role:9} {e.status:8} {e.model_version.label:20} {tier}")
            return
        engine = get_or_bad_input(self, Engine, opts["engine"], "engine")
        namespace = get_or_bad_input(self, CacheNamespace, opts["namespace"], "namespace")
        engine_attach_namespace(engine=engine, namespace=namespace, actor="cli")
        self.stdout.write(f"engine {engine.name} now serves namespace {namespace.namespace_key}")
