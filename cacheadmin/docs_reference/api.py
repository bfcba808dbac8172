"""``api.md`` and ``openapi.json``: the REST API from the OpenAPI schema the
server serves at ``/api/schema/`` (drf-spectacular, built without a request,
as ``tests/cacheadmin/test_openapi_client.py`` builds it), rendered offline.

Every path and method with its description, parameters, request body fields
and responses; every component schema with its fields; the error envelope.
"""

from __future__ import annotations

import json
from typing import Any

from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer

from cacheadmin.docs_reference.markdown import GENERATED_NOTE, anchor, code, page, prose, rst_to_markdown, table

METHODS = ("get", "post", "put", "patch", "delete")
#: The schema file written beside the page, for download.
SCHEMA_FILE = "openapi.json"


def openapi_schema() -> dict[str, Any]:
    """The schema as ``/api/schema/?format=json`` renders it (public, no request)."""
    rendered = OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True))
    schema: dict[str, Any] = json.loads(rendered)
    return schema


def schema_json(schema: dict[str, Any]) -> str:
    """``openapi.json``'s text: keys sorted, two-space indent, one final newline."""
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _schema_heading(name: str) -> str:
    return f"{name} (schema)"


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _link(name: str) -> str:
    return f"[{name}](#{anchor(_schema_heading(name))})"


def type_of(schema: dict[str, Any]) -> str:
    """A schema's type in words, with links to component schemas (``array of [Tenant](#tenant-schema)``)."""
    if "$ref" in schema:
        return _link(_ref_name(schema["$ref"]))
    for combo, word in (("allOf", " and "), ("oneOf", " or "), ("anyOf", " or ")):
        if combo in schema:
            text = word.join(type_of(s) for s in schema[combo])
            return text + (" or null" if schema.get("nullable") else "")
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        kind = " or ".join(str(k) for k in kind)
    if kind == "array":
        text = f"array of {type_of(schema.get('items', {}))}"
    elif kind == "object" and "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        text = f"object of {type_of(schema['additionalProperties'])}"
    else:
        text = str(kind)
    if "format" in schema:
        text += f" ({schema['format']})"
    if "enum" in schema:
        text += ": " + ", ".join(code(json.dumps(v, ensure_ascii=False)) for v in schema["enum"] if v is not None)
    bounds = []
    for key, word in (("minimum", "≥"), ("maximum", "≤"), ("minLength", "length ≥"), ("maxLength", "length ≤")):
        if key in schema:
            bounds.append(f"{word} {schema[key]}")
    if "pattern" in schema:
        bounds.append(f"pattern {code(schema['pattern'])}")
    if bounds:
        text += " (" + ", ".join(bounds) + ")"
    if schema.get("nullable"):
        text += " or null"
    return text


def _fields(schema: dict[str, Any], components: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(field, type, required, description) of an object schema, merging ``allOf`` parts."""
    if "$ref" in schema:
        schema = components[_ref_name(schema["$ref"])]
    properties: dict[str, Any] = {}
    required: set[str] = set()
    for part in [schema, *schema.get("allOf", [])]:
        if "$ref" in part:
            part = components[_ref_name(part["$ref"])]
        properties.update(part.get("properties", {}))
        required.update(part.get("required", []))
    rows = []
    for name, prop in properties.items():
        notes = []
        if prop.get("readOnly"):
            notes.append("read-only")
        if prop.get("writeOnly"):
            notes.append("write-only")
        if "default" in prop:
            notes.append(f"default {code(json.dumps(prop['default'], ensure_ascii=False))}")
        description = rst_to_markdown(prop.get("description", ""))
        if notes:
            description = (description + " " if description else "") + "(" + ", ".join(notes) + ")"
        rows.append((code(name), type_of(prop), "yes" if name in required else "", description))
    return rows


def _body_schema(content: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    for media in sorted(content):
        if "schema" in content[media]:
            return media, content[media]["schema"]
    return None


def _summary(op: dict[str, Any]) -> str:
    """The operation's summary, else the first paragraph of its description."""
    text = op.get("summary") or (op.get("description") or "").split("\n\n", 1)[0]
    return rst_to_markdown(" ".join(text.split()))


def _operation(path: str, method: str, op: dict[str, Any], components: dict[str, Any]) -> list[str]:
    lines = [f"### {method.upper()} {path}", ""]
    description = op.get("summary") or op.get("description") or ""
    if op.get("summary") and op.get("description"):
        description = f"{op['summary']}\n\n{op['description']}"
    if description:
        lines += [prose(rst_to_markdown(description.strip())), ""]
    lines += [f"Operation id: {code(op['operationId'])}" + (" (deprecated)" if op.get("deprecated") else ""), ""]
    params = op.get("parameters", [])
    if params:
        rows = [
            (
                code(p["name"]),
                p["in"],
                type_of(p.get("schema", {})),
                "yes" if p.get("required") else "",
                rst_to_markdown(p.get("description", "")),
            )
            for p in params
        ]
        lines += ["Parameters:", ""] + table(("Name", "In", "Type", "Required", "Description"), rows) + [""]
    body = op.get("requestBody")
    if body:
        found = _body_schema(body.get("content", {}))
        if found:
            media, schema = found
            required = "required" if body.get("required") else "optional"
            lines += [f"Request body ({code(media)}, {required}): {type_of(schema)}", ""]
            fields = _fields(schema, components)
            if fields:
                lines += table(("Field", "Type", "Required", "Description"), fields) + [""]
    responses = []
    for status in sorted(op.get("responses", {})):
        response = op["responses"][status]
        found = _body_schema(response.get("content", {}))
        body_type = type_of(found[1]) if found else "no body"
        headers = ", ".join(code(h) for h in sorted(response.get("headers", {})))
        responses.append((code(status), body_type, rst_to_markdown(response.get("description", "")), headers))
    lines += ["Responses:", ""] + table(("Status", "Body", "Description", "Headers"), responses) + [""]
    return lines


def render(schema: dict[str, Any]) -> str:
    """The page's Markdown for ``schema`` (see :func:`openapi_schema`)."""
    info = schema["info"]
    components: dict[str, Any] = schema.get("components", {}).get("schemas", {})
    security = schema.get("components", {}).get("securitySchemes", {})
    operations = [
        (path, method, op) for path, item in schema["paths"].items() for method, op in item.items() if method in METHODS
    ]
    lines = [
        GENERATED_NOTE,
        "",
        "# REST API",
        "",
        prose(f"{info['title']}, version {info['version']}: {info.get('description', '')}"),
        "",
        f"{len(schema['paths'])} paths, {len(operations)} operations. The OpenAPI {schema['openapi']} schema they are "
        f"rendered from: [{SCHEMA_FILE}]({SCHEMA_FILE}) (the server serves the same at `/api/schema/`, "
        "and Swagger UI at `/api/docs/`).",
        "",
        "## Authentication",
        "",
    ]
    rows = []
    for name in sorted(security):
        scheme = security[name]
        how = scheme["type"] + (f" {scheme['scheme']}" if "scheme" in scheme else "")
        if scheme.get("in"):
            how += f" in {scheme['in']} {code(scheme['name'])}"
        rows.append((code(name), how, scheme.get("description", "")))
    lines += table(("Scheme", "How", "Description"), rows) + [""]
    lines += ["## Error envelope", ""]
    if "ErrorEnvelope" in components:
        lines += [
            prose(components["ErrorEnvelope"].get("description", "")),
            "",
            'Every 4xx and 5xx answer is `{"error": {...}}` with these fields (the codes: [Errors](errors.md)):',
            "",
        ]
        lines += table(("Field", "Type", "Required", "Description"), _fields(components["Error"], components)) + [""]
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, method, op in operations:
        by_tag.setdefault((op.get("tags") or ["other"])[0], []).append((path, method, op))
    lines += ["## Operations", ""]
    lines += table(
        ("Operation", "Description"),
        [
            (f"[{m.upper()} {p}](#{anchor(f'{m.upper()} {p}')})", _summary(o))
            for p, m, o in sorted(operations, key=lambda x: (x[0], METHODS.index(x[1])))
        ],
    )
    lines.append("")
    for tag in sorted(by_tag):
        lines += [f"## {tag}", ""]
        for path, method, op in sorted(by_tag[tag], key=lambda x: (x[0], METHODS.index(x[1]))):
            lines += _operation(path, method, op, components)
    lines += ["## Schemas", ""]
    for name in sorted(components):
        component = components[name]
        lines += [f"### {_schema_heading(name)}", ""]
        if component.get("description"):
            lines += [prose(rst_to_markdown(component["description"].strip())), ""]
        fields = _fields(component, components)
        if fields:
            lines += table(("Field", "Type", "Required", "Description"), fields) + [""]
        else:
            lines += [f"Type: {type_of(component)}", ""]
    return page(lines)
