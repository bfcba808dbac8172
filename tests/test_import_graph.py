"""The module import graph, built statically by grimp (the library behind
import-linter), counting imports inside functions too: no cycle, and the layers
hold (``inference`` imports no Django and nothing of ``cacheadmin``; the gateway's
modules import neither, except ``gateway.asgi``, which builds a deployment's
gateway from Django settings; models and services import no page, API or
command)."""

from __future__ import annotations

import grimp

PACKAGES = ("cacheadmin", "inference", "gateway")


def _graph() -> grimp.ImportGraph:
    # External packages appear as one module each ("django"), so the layer test can see them.
    return grimp.build_graph(*PACKAGES, include_external_packages=True, exclude_type_checking_imports=True)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(set(graph.find_modules_directly_imported_by(m)) & set(modules)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_module_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "a.b", "a.c", "a.d"):
        graph.add_module(name)
    graph.add_import(importer="a.b", imported="a.c")
    graph.add_import(importer="a.c", imported="a.b")
    graph.add_import(importer="a.d", imported="a.b")
    assert _cycles(graph) == [["a.b", "a.c"]]


def test_the_layers_hold() -> None:
    graph = _graph()
    inference = {m for m in graph.modules if m.split(".")[0] == "inference"}
    imported_by_inference = {i.split(".")[0] for m in inference for i in graph.find_modules_directly_imported_by(m)}
    assert "cacheadmin" not in imported_by_inference and "django" not in imported_by_inference
    assert {"blake3", "mistral_common", "redis"} <= imported_by_inference  # the graph does see external packages
    lower = {m for m in graph.modules if m.startswith(("cacheadmin.models", "cacheadmin.services"))}
    upper = ("cacheadmin.api", "cacheadmin.views", "cacheadmin.management", "cacheadmin.admin", "cacheadmin.tasks")
    assert sorted((m, i) for m in lower for i in graph.find_modules_directly_imported_by(m) if i.startswith(upper)) == []


def test_the_gateway_is_django_free_but_for_its_deployment_factory() -> None:
    graph = _graph()
    modules = {m for m in graph.modules if m.split(".")[0] == "gateway" and m != "gateway.asgi"}
    imported = {i.split(".")[0] for m in modules for i in graph.find_modules_directly_imported_by(m)}
    assert "cacheadmin" not in imported and "django" not in imported
    assert {"faiss", "httpx", "starlette"} <= imported  # the graph does see the gateway's external packages


def test_salts_are_computed_in_one_place() -> None:
    """Only ``cacheadmin.services.namespaces`` takes ``inference.identity.cache_salt``, the
    derivation of a namespace's ``cache_salt``: every other module asks it, through the
    audited read or the control plane's own unaudited one (its docstring names who)."""
    graph = _graph()
    naming = {
        module
        for module in graph.modules
        for detail in graph.get_import_details(importer=module, imported="inference.identity")
        if "cache_salt" in detail["line_contents"]
    }
    assert naming == {"cacheadmin.services.namespaces"}
