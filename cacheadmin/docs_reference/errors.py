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


def _argument_text(call: ast.Call, index: int, scope: ast.AST | None) -> str:
    """The text of argument ``index``: a literal, or the last assignment before the call to the variable passed."""
    if len(call.args) <= index:
        return ""
    argument = call.args[index]
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


def _calls(tree: ast.AST) -> Iterator[tuple[ast.Call, str, ast.AST | None]]:
    """Each call with the docstring of the function (else class) it is in, and that function."""

    def visit(node: ast.AST, doc: str, scope: ast.AST | None) -> Iterator[tuple[ast.Call, str, ast.AST | None]]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = ast.get_docstring(node) or doc
            scope = node
        if isinstance(node, ast.Call):
            yield node, doc, scope
        for child in ast.iter_child_nodes(node):
            yield from visit(child, doc, scope)

    yield from visit(tree, "", None)


def _envelope_calls(tree: ast.AST) -> Iterator[tuple[ast.Call, str]]:
    """Each literal ``envelope(status, "code", ...)`` call with its message's text, else the docstring of the
    function (else class) it is in."""
    for call, doc, scope in _calls(tree):
        if (
            isinstance(call.func, ast.Name)
            and call.func.id == "envelope"
            and len(call.args) >= 2
            and all(isinstance(a, ast.Constant) for a in call.args[:2])
        ):
            yield call, _argument_text(call, 2, scope) or _first_paragraph(doc)


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


#: The gateway package (the data plane), beside the control plane's package.
GATEWAY_DIR = PACKAGE_DIR.parent / "gateway"


@dataclass
class GatewayErrorRow:
    """One code of the gateway's OpenAI-format errors: its statuses, ``type``, messages and where it is raised."""

    statuses: set[str] = field(default_factory=set)
    types: set[str] = field(default_factory=set)
    messages: set[str] = field(default_factory=set)
    sources: set[str] = field(default_factory=set)

    @property
    def message(self) -> str:
        """The message, or the first of several (sorted) with how many there are."""
        ordered = sorted(self.messages)
        if len(ordered) > 1:
            return f"one of {len(ordered)} messages, e.g. {ordered[0]}"
        return ordered[0] if ordered else ""


def _keyword_text(call: ast.Call, name: str) -> str | None:
    value = next((k.value for k in call.keywords if k.arg == name), None)
    return _text(value) if value is not None else None


def gateway_errors() -> dict[str, GatewayErrorRow]:
    """The gateway's error codes, by code, sorted, found in its source: ``GatewayError(status, message,
    type_=..., code=...)``, ``invalid(message, ..., code=...)`` (400 ``invalid_request_error``, code
    ``invalid_request`` unless given) and the connection guard's ``_answer(status, reason, message, code)``.
    A status or code computed at run time shows as the expression that computes it."""
    found: dict[str, GatewayErrorRow] = {}
    for path in sorted(GATEWAY_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR.parent).as_posix()
        for node, doc, scope in _calls(ast.parse(path.read_text(encoding="utf-8"))):
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if func == "GatewayError" and len(node.args) >= 2:
                status_node, message_index = node.args[0], 1
                code_text, type_text = _keyword_text(node, "code"), _keyword_text(node, "type_")
            elif func == "invalid" and relative == "gateway/errors.py":
                continue  # the helper's own body: its callers are counted
            elif func == "invalid" and node.args:
                status_node, message_index = ast.Constant(400), 0
                code_text, type_text = _keyword_text(node, "code") or "invalid_request", "invalid_request_error"
            elif func == "_answer" and len(node.args) >= 4:
                status_node, message_index = node.args[0], 2
                code_text, type_text = _text(node.args[3]), "invalid_request_error"
            else:
                continue
            if not code_text:
                continue
            literal = isinstance(status_node, ast.Constant)
            row = found.setdefault(code_text, GatewayErrorRow())
            row.statuses.add(str(status_node.value) if isinstance(status_node, ast.Constant) else "varies")
            if type_text:
                row.types.add(type_text)
            message = _argument_text(node, message_index, scope) or (_first_paragraph(doc) if not literal else "")
            if message:
                row.messages.add(message)
            row.sources.add(relative)
    return dict(sorted(found.items()))


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
    lines += ["", "## Gateway errors", ""]
    lines += [
        "The gateway (`manage.py gateway`, the OpenAI-compatible data plane) answers in the OpenAI error format "
        "instead, so OpenAI clients read it: "
        '`{"error": {"message": "...", "type": "...", "param": null, "code": "..."}}`. An engine\'s own error '
        "reaches the caller in the same shape with code `engine_<status>` (a 5xx as 502), its message sanitised "
        "(`gateway/errors.py`). Its codes (`{...}` in a message stands for a value filled in when it is raised):",
        "",
    ]
    gateway_rows = [
        (
            code(error_code),
            ", ".join(sorted(row.statuses)),
            ", ".join(code(t) for t in sorted(row.types)),
            row.message,
            ", ".join(code(s) for s in sorted(row.sources)),
        )
        for error_code, row in gateway_errors().items()
    ]
    lines += table(("Code", "HTTP status", "Type", "Message", "Raised in"), gateway_rows)
    lines.append("")
    return page(lines)
