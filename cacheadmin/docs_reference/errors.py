"""``errors.md``: every code of the API's one error envelope.

Service errors are the subclasses of :class:`inference.errors.ControlPlaneError`:
each class carries its code, HTTP status and CLI exit code (Zulip's
``JsonableError`` pattern), read here from the classes themselves. The other
codes come from the request layer: Django REST framework's exceptions and the
project's own (``APIException`` subclasses), and the literal
``envelope(status, "code", ...)`` answers of the middleware and handlers,
found in the source.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from rest_framework import exceptions

from cacheadmin.docs_reference.markdown import GENERATED_NOTE, code, page, rst_to_markdown, table
from inference.errors import EXIT_BAD_INPUT, EXIT_CONFLICT, EXIT_REFUSED, ControlPlaneError, Refused

#: Modules that define error classes (as tests/cacheadmin/test_errors.py imports them).
ERROR_MODULES = (
    "cacheadmin.services.engine_verification",
    "cacheadmin.services.engines",
    "cacheadmin.services.eviction",
    "cacheadmin.services.gateway",
    "cacheadmin.services.inference_pools",
    "cacheadmin.services.model_versions",
    "cacheadmin.services.namespaces",
    "cacheadmin.services.prewarm",
    "cacheadmin.services.quotas",
    "cacheadmin.services.releases",
    "gateway.layers.base",
    "inference.netpolicy",
    "cacheadmin.api.idempotency",
    "cacheadmin.api.views",
)
PACKAGE_DIR = Path(__file__).resolve().parent.parent
T = TypeVar("T")
EXIT_MEANINGS = {
    EXIT_BAD_INPUT: "bad input (usage, path, checkpoint, a field's value)",
    EXIT_CONFLICT: "a conflict with what exists, or a backend that cannot be reached",
    EXIT_REFUSED: "refused by the control plane in its current state",
}


def _subclasses(cls: type[T]) -> list[type[T]]:
    out: list[type[T]] = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def service_errors() -> list[type[ControlPlaneError]]:
    """Every concrete error class a surface reports (not the :class:`Refused` base), sorted by code then name."""
    for module in ERROR_MODULES:
        importlib.import_module(module)
    classes = {c for c in _subclasses(ControlPlaneError) if c is not Refused}
    return sorted(classes, key=lambda c: (c.code, c.__name__))


def _first_paragraph(doc: str | None) -> str:
    text = inspect.cleandoc(doc or "").split("\n\n", 1)[0]
    return rst_to_markdown(" ".join(text.split()))


@dataclass
class RequestError:
    """One request-layer code: its meaning (the exception's detail or the answering code's docstring) and sources."""

    meaning: str = ""
    sources: set[str] = field(default_factory=set)


def _text(node: ast.expr | None) -> str:
    """A message's text: a string literal, or an f-string with ``{expression}`` for each hole."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            str(v.value) if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"  # type: ignore[attr-defined]
            for v in node.values
        )
    return ""


def _message(call: ast.Call, scope: ast.AST | None) -> str:
    """The third argument's text, or that of the last assignment to the variable passed there before the call."""
    if len(call.args) < 3:
        return ""
    argument = call.args[2]
    if not isinstance(argument, ast.Name) or scope is None:
        return _text(argument)
    assigned = [
        n.value
        for n in ast.walk(scope)
        if isinstance(n, ast.Assign)
        and n.lineno < call.lineno
        and any(isinstance(t, ast.Name) and t.id == argument.id for t in n.targets)
    ]
    return _text(max(assigned, key=lambda v: v.lineno)) if assigned else ""


def _envelope_calls(tree: ast.AST) -> Iterator[tuple[ast.Call, str]]:
    """Each literal ``envelope(status, "code", ...)`` call with its message's text, else the docstring of the
    function (else class) it is in."""

    def visit(node: ast.AST, doc: str, scope: ast.AST | None) -> Iterator[tuple[ast.Call, str]]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = ast.get_docstring(node) or doc
            scope = node
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "envelope"
            and len(node.args) >= 2
            and all(isinstance(a, ast.Constant) for a in node.args[:2])
        ):
            yield node, _message(node, scope) or _first_paragraph(doc)
        for child in ast.iter_child_nodes(node):
            yield from visit(child, doc, scope)

    yield from visit(tree, "", None)


def request_errors() -> dict[tuple[str, int], RequestError]:
    """(code, HTTP status) → its meaning and where it comes from, for the request layer's codes
    (see the module's docstring), sorted by status then code."""
    found: dict[tuple[str, int], RequestError] = {}
    api_classes: list[type[exceptions.APIException]] = [exceptions.APIException]
    api_classes += _subclasses(exceptions.APIException)
    for cls in api_classes:
        if cls is exceptions.APIException or cls.__module__.startswith(("rest_framework", "cacheadmin")):
            entry = found.setdefault((str(cls.default_code), int(cls.status_code)), RequestError())
            entry.sources.add(f"{cls.__module__}.{cls.__name__}")
            own = "default_detail" in cls.__dict__ and cls.__module__.startswith("rest_framework")
            entry.meaning = entry.meaning or (str(cls.default_detail) if own else _first_paragraph(cls.__doc__))
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR.parent).as_posix()
        for call, meaning in _envelope_calls(ast.parse(path.read_text(encoding="utf-8"))):
            status, error_code = call.args[0].value, call.args[1].value  # type: ignore[attr-defined]
            if not (isinstance(status, int) and isinstance(error_code, str)):
                continue
            entry = found.setdefault((error_code, status), RequestError())
            entry.sources.add(relative)
            entry.meaning = entry.meaning or meaning
    return dict(sorted(found.items(), key=lambda item: (item[0][1], item[0][0])))


def render() -> str:
    """The page's Markdown."""
    lines = [
        GENERATED_NOTE,
        "",
        "# Errors",
        "",
        "Every error of the REST API is one JSON envelope, whatever the endpoint and the `Accept` header:",
        "",
        "```json",
        '{"error": {"status": 409, "code": "release_refused", "message": "...", "fields": {"field": ["problem"]}}}',
        "```",
        "",
        "`status` repeats the HTTP status, `code` is stable and machine-readable, `message` is for people, "
        "`fields` (invalid input only) maps each offending field path (`policy.max_bytes`, `items[2].name`) to "
        "its problems. The same errors from a `manage.py` command are one line on stderr and the exit code below "
        "(see [Command line](cli.md)); the envelope's schema is in the [REST API](api.md) reference.",
        "",
        "## Exit codes",
        "",
    ]
    lines += table(
        ("Exit code", "Meaning"),
        [("0", "success"), ("1", "the command ran a check of its own, and the check failed")]
        + [(str(k), v) for k, v in sorted(EXIT_MEANINGS.items())],
    )
    lines += ["", "## Service errors", ""]
    lines += [
        "Raised by the services behind the API, the pages and the commands; each class carries its code, HTTP "
        "status and exit code, so the surfaces cannot disagree.",
        "",
    ]
    rows = [
        (code(c.code), str(c.http_status), str(c.exit_code), code(c.__name__), _first_paragraph(c.__doc__))
        for c in service_errors()
    ]
    lines += table(("Code", "HTTP status", "Exit code", "Class", "Meaning"), rows)
    lines += ["", "## Request errors", ""]
    lines += [
        "Answered before or around a service: authentication, permissions, parsing, limits, a busy database. "
        "The API's own; a command reports these situations in its own words.",
        "",
    ]
    request_rows = [
        (code(error_code), str(status), entry.meaning, ", ".join(code(s) for s in sorted(entry.sources)))
        for (error_code, status), entry in request_errors().items()
    ]
    lines += table(("Code", "HTTP status", "Meaning", "Raised by"), request_rows)
    lines.append("")
    return page(lines)
