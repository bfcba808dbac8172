"""The module import graph, built statically by grimp (the library behind
import-linter), counting imports inside functions too: no cycle, and the layers
hold (``inference`` imports no Django and nothing of ``cacheadmin``; the gateway's
modules import neither, except ``gateway.asgi``, which builds a deployment's
gateway from Django settings; models and services import no page, API or
command)."""

from __future__ import annotations

import ast
from pathlib import Path

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
    assert {"faiss", "httpx2", "httpx_sse", "starlette"} <= imported  # the graph does see the gateway's external packages


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


#: The gateway's levels, lowest first: a module imports only modules of its own level or
#: below (the longest matching prefix names a module's level). A third cache layer's
#: package sits beside ``gateway.layers.response``: its stores at level 2, its layer at 4.
GATEWAY_LEVELS: tuple[tuple[str, ...], ...] = (
    ("gateway.errors", "gateway.request_fields", "gateway.sqlite_file", "gateway.templates", "gateway.layers",
     "gateway.layers.base", "gateway.tracing", "gateway.engine_pool"),
    ("gateway.param_specs", "gateway.pii"),
    ("gateway.canonical", "gateway.routing", "gateway.records", "gateway.metrics", "gateway.answers", "gateway.layers.response",
     "gateway.layers.semantic"),
    ("gateway.protection", "gateway.prefix"),
    ("gateway.layers.response.layer", "gateway.layers.semantic.layer", "gateway.pipeline"),
    ("gateway.replies", "gateway.engine_proxy", "gateway.connections"),
    ("gateway.server",),
    ("gateway.asgi", "gateway.__init__"),
)  # fmt: skip
#: Most lines of one gateway module, and of one function's code (its docstring not counted: that is its contract).
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 800, 60


def _level(module: str) -> int:
    if module == "gateway":
        return len(GATEWAY_LEVELS) - 1
    best, level = "", -1
    for at, prefixes in enumerate(GATEWAY_LEVELS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, at
    assert level >= 0, f"{module} has no level in GATEWAY_LEVELS"
    return level


def test_the_gateway_imports_only_downward() -> None:
    graph = _graph()
    gateway = sorted(m for m in graph.modules if m.split(".")[0] == "gateway")
    upward = [
        (m, i)
        for m in gateway
        for i in graph.find_modules_directly_imported_by(m)
        if i.split(".")[0] == "gateway" and _level(i) > _level(m)
    ]
    assert upward == []
    assert _level("gateway.layers.response.redis_store") == 2 and _level("gateway.layers.response.layer") == 4


def _sizes(path: Path) -> tuple[int, list[tuple[str, int]]]:
    """A module's lines, and each function's lines of code (from ``def`` to its end, less its docstring)."""
    text = path.read_text()
    functions = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0]
            doc = (
                first.end_lineno - first.lineno + 1  # type: ignore[operator]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
                else 0
            )
            functions.append((node.name, node.end_lineno - node.lineno + 1 - doc))  # type: ignore[operator]
    return len(text.splitlines()), functions


def test_no_gateway_module_or_function_is_too_long() -> None:
    root = Path(__file__).resolve().parent.parent / "gateway"
    long_modules, long_functions = [], []
    for path in sorted(root.rglob("*.py")):
        lines, functions = _sizes(path)
        name = str(path.relative_to(root.parent))
        if lines > MAX_MODULE_LINES:
            long_modules.append((name, lines))
        long_functions += [(name, f, n) for f, n in functions if n > MAX_FUNCTION_LINES]
    assert long_modules == [] and long_functions == []


def test_the_size_rule_measures_code_not_docstrings(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "m.py").write_text(f'def f():\n    """Doc\n\n    more.\n    """\n{body}\n\n\ndef g():\n    return 1\n')
    assert _sizes(tmp_path / "m.py") == (70, [("f", 62), ("g", 2)])
