"""``configuration.md``: every environment variable the control plane reads.

The reads are found in the source: each call of a :mod:`cacheadmin.env` helper
(``env_int("NAME", default, minimum=...)``...) with a literal name anywhere in
the ``cacheadmin`` package, and each ``os.environ.get("NAME")`` in a
management command. The helper gives the type, minimum and choices; a literal
default (or a module constant) gives the default; the registry
(:mod:`cacheadmin.env_catalogue`) gives the meaning and the defaults that are
computed at start.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cacheadmin.docs_reference.markdown import GENERATED_NOTE, code, page, table
from cacheadmin.env import MIN_SECRET_CHARS
from cacheadmin.env_catalogue import SECTIONS, VARIABLES

#: The package whose source is searched for reads (the project root is its parent).
PACKAGE_DIR = Path(__file__).resolve().parent.parent
#: Helper name → the type the page states.
HELPERS: dict[str, str] = {
    "env_str": "string",
    "env_bool": "boolean (`1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`)",
    "env_int": "integer",
    "env_float": "number",
    "env_choice": "one of",
    "env_paths": "`:`-separated paths",
    "env_names": "comma-separated variable names",
    "env_networks": "comma-separated IP networks (CIDR) or addresses",
    "persistent_secret": f"secret: at least {MIN_SECRET_CHARS} visible ASCII characters",
}
#: ``os.environ.get`` reads count in these folders only: elsewhere the package sets or
#: passes on variables of other programs (prometheus-client's, Django's own).
DIRECT_READ_DIRS = ("management/commands",)

_BINOPS: dict[type[ast.operator], Callable[[object, object], object]] = {
    ast.Mult: operator.mul,
    ast.Add: operator.add,
    ast.Sub: operator.sub,
}


class UndocumentedVariable(LookupError):
    """The code reads a variable the registry does not describe, or the reverse; the message names them."""


@dataclass
class EnvRead:
    """What the source says about one variable, merged over every place it is read.

    Attributes:
        name: the variable.
        helper: the :mod:`cacheadmin.env` helper (``os.environ.get`` for a direct read).
        default: the literal default as the page shows it, or None when computed.
        minimum: the helper's ``minimum`` when literal.
        choices: ``env_choice``'s choices.
        files: where it is read, relative to the project root, sorted.
    """

    name: str
    helper: str
    default: str | None = None
    minimum: str | None = None
    choices: tuple[str, ...] = ()
    files: list[str] = field(default_factory=list)


def _literal(node: ast.expr, module: str) -> object:
    """The value of a literal, constant arithmetic, or a module-level constant of ``module``.

    Raises:
        ValueError: anything computed at run time.
    """
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(_literal(e, module) for e in node.elts)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_literal(node.left, module), _literal(node.right, module))
    if isinstance(node, ast.Name) and node.id.isupper():
        return _constant(node.id, module)
    raise ValueError(ast.unparse(node))


def _module_path(module: str) -> Path:
    return PACKAGE_DIR.parent.joinpath(*module.split(".")).with_suffix(".py")


def _constant(name: str, module: str) -> object:
    """A module-level constant assigned a literal in ``module``'s source (or in the
    module it is imported from): read statically, never by importing, so no
    setting computed at start leaks into the page.

    Raises:
        ValueError: ``name`` is not such a constant.
    """
    path = _module_path(module)
    if not path.is_file():
        raise ValueError(name)
    for stmt in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            return _literal(stmt.value, module)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            if stmt.value is not None:
                return _literal(stmt.value, module)
        if isinstance(stmt, ast.ImportFrom) and stmt.module and any(a.name == name and not a.asname for a in stmt.names):
            return _constant(name, stmt.module)
    raise ValueError(name)


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value == "":
        return "empty"
    if isinstance(value, int | float):
        return str(value)
    return code(str(value))


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_environ_get(func: ast.expr) -> bool:
    """``os.environ.get`` or ``os.getenv``."""
    if isinstance(func, ast.Attribute) and func.attr == "get":
        env = func.value
        return isinstance(env, ast.Attribute) and env.attr == "environ"
    return isinstance(func, ast.Attribute) and func.attr == "getenv"


def env_reads(package_dir: Path = PACKAGE_DIR) -> dict[str, EnvRead]:
    """Every variable the package's source reads, by name (see the module's docstring).

    Returns:
        name → :class:`EnvRead`; a variable read with a literal default in one place
        and a computed one in another shows the literal.
    """
    reads: dict[str, EnvRead] = {}
    root = package_dir.parent
    for path in sorted(package_dir.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        relative = path.relative_to(root).as_posix()
        direct = any(f"/{d}/" in f"/{relative}" for d in DIRECT_READ_DIRS)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            helper = node.func.id if isinstance(node.func, ast.Name) else None
            if helper in HELPERS:
                index = 1 if helper == "persistent_secret" else 0
                if len(node.args) <= index:
                    continue
                name_node = node.args[index]
            elif direct and _is_environ_get(node.func) and node.args:
                helper, name_node = "os.environ.get", node.args[0]
            else:
                continue
            if not isinstance(name_node, ast.Constant) or not isinstance(name_node.value, str):
                continue
            read = reads.setdefault(name_node.value, EnvRead(name_node.value, helper))
            if read.helper == "os.environ.get":
                read.helper = helper  # a typed helper's read says more than a direct one
            if relative not in read.files:
                read.files.append(relative)
                read.files.sort()
            module = _module_name(path, root)
            if helper == "persistent_secret" and isinstance(node.args[0], ast.Constant):
                read.default = f"generated once into {code('VAR_DIR/' + str(node.args[0].value))}"
            elif helper in ("env_names", "env_networks", "os.environ.get"):
                read.default = read.default or "none"
            elif len(node.args) > 1:
                try:
                    read.default = _shown(_literal(node.args[1], module))
                except ValueError:
                    pass
            minimum = _keyword(node, "minimum")
            if minimum is not None:
                read.minimum = str(_literal(minimum, module))
            if helper == "env_choice" and len(node.args) > 2:
                choices = _literal(node.args[2], module)
                read.choices = tuple(str(c) for c in choices) if isinstance(choices, tuple) else ()
    return reads


def undocumented(reads: dict[str, EnvRead]) -> tuple[list[str], list[str]]:
    """(variables read but not in the registry, registry entries nothing reads), each sorted."""
    return sorted(set(reads) - set(VARIABLES)), sorted(set(VARIABLES) - set(reads))


def _type(read: EnvRead) -> str:
    if read.helper == "os.environ.get":
        return "string"
    text = HELPERS[read.helper]
    if read.choices:
        text += " " + ", ".join(code(c) for c in read.choices)
    if read.minimum is not None:
        text += f", at least {read.minimum}"
    return text


def render() -> str:
    """The page's Markdown.

    Raises:
        UndocumentedVariable: a variable is read that the registry does not
            describe, one is described that nothing reads, or one's default is
            computed and the registry gives none.
    """
    reads = env_reads()
    missing, unread = undocumented(reads)
    if missing or unread:
        raise UndocumentedVariable(
            f"read but not in cacheadmin/env_catalogue.py: {', '.join(missing) or 'none'}; "
            f"in the registry but read nowhere: {', '.join(unread) or 'none'}"
        )
    no_default = sorted(n for n, r in reads.items() if VARIABLES[n].default is None and r.default is None)
    if no_default:
        raise UndocumentedVariable(f"computed defaults without a default in cacheadmin/env_catalogue.py: {', '.join(no_default)}")
    lines = [
        GENERATED_NOTE,
        "",
        "# Configuration (environment)",
        "",
        "Every environment variable the control plane reads, with its type and default. Every setting is read "
        "through the typed helpers of `cacheadmin/env.py`, which refuse a bad value at start (a `manage.py` "
        "command says why in one line and exits 2) instead of falling back to the default. `VAR_DIR` below "
        "stands for that variable's value.",
        "",
        "The control plane's own children (Celery worker, gateway, KV-event consumer, gunicorn) get every variable "
        "listed here that is set, and nothing else of its environment; engines get the system's names, "
        "`ENGINE_ENV_INHERIT` and what their launcher sets.",
        "",
    ]
    for section in SECTIONS:
        names = sorted(n for n, v in VARIABLES.items() if v.section == section)
        if not names:
            continue
        lines += [f"## {section}", ""]
        rows = []
        for name in names:
            read, doc = reads[name], VARIABLES[name]
            default = doc.default if doc.default is not None else read.default or ""
            rows.append((code(name), _type(read), default, doc.meaning, ", ".join(code(f) for f in read.files)))
        lines += table(("Variable", "Type", "Default", "Meaning", "Read in"), rows)
        lines.append("")
    lines += [
        "## Read by libraries",
        "",
        "Not settings of the control plane, and so not above: the gateway's tracing follows OpenTelemetry's "
        "standard `OTEL_*` variables (`gateway/tracing.py`), engines get vLLM's `VLLM_*` variables from their "
        "launcher, and `DJANGO_SETTINGS_MODULE` names the settings module (`cacheadmin.settings`).",
        "",
    ]
    return page(lines)
