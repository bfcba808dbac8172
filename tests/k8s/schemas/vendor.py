"""How the schemas in this folder were made from the published files (run once by hand, never by a test).

``python tests/k8s/schemas/vendor.py trim FULL.json OUT.json ROOT...`` keeps, of a Kubernetes
OpenAPI v3 document, the components ``ROOT...`` reference (transitively), each component's
text byte for byte as it stands in the full document (sliced, not re-serialized), and
``info`` and ``openapi``; it drops ``paths`` and the other components, and checks that
every kept component parses to what it was.

``python tests/k8s/schemas/vendor.py crd CRD.yaml VERSION OUT.json`` writes the
``openAPIV3Schema`` of one version of a CustomResourceDefinition as JSON (read with
``yaml.safe_load``, written with ``json.dumps(indent=0, sort_keys=True)``; the values unchanged).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

_REF = re.compile(r'"\$ref": "#/components/schemas/([^"]+)"')


def _component_texts(text: str) -> dict[str, str]:
    """Each component's text (``"NAME": {...}``) as it stands in a document pretty-printed with 2-space indents."""
    start = text.index('\n    "schemas": {\n') + len('\n    "schemas": {\n')
    end = text.index("\n    }", start)  # the schemas object closes at indent 4
    body = text[start:end]
    pieces = re.split(r",\n(?=      \")", body)
    return {json.loads("{" + piece + "}").popitem()[0]: piece for piece in pieces}


def trim(full_path: Path, out_path: Path, roots: list[str]) -> None:
    text = full_path.read_text(encoding="utf-8")
    document = json.loads(text)
    schemas = document["components"]["schemas"]
    texts = _component_texts(text)
    assert set(texts) == set(schemas), "the component slices do not cover the schemas"
    keep: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo += _REF.findall(texts[name])
    ordered = [name for name in texts if name in keep]  # the full document's order
    info = json.dumps(document["info"], indent=2).replace("\n", "\n  ")
    trimmed = (
        '{\n  "components": {\n    "schemas": {\n'
        + ",\n".join(texts[name] for name in ordered)
        + f'\n    }}\n  }},\n  "info": {info},\n  "openapi": {json.dumps(document["openapi"])}\n}}\n'
    )
    parsed = json.loads(trimmed)["components"]["schemas"]
    assert parsed == {name: schemas[name] for name in ordered}
    assert all(texts[name] in text for name in ordered)
    out_path.write_text(trimmed, encoding="utf-8")
    print(f"{out_path}: {len(ordered)} of {len(schemas)} components, {len(trimmed)} of {len(text)} characters")


def crd(crd_path: Path, version: str, out_path: Path) -> None:
    document: Any = yaml.safe_load(crd_path.read_text(encoding="utf-8"))
    (schema,) = [v["schema"]["openAPIV3Schema"] for v in document["spec"]["versions"] if v["name"] == version]
    out_path.write_text(json.dumps(schema, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{out_path}: {document['metadata']['name']} {version}")


if __name__ == "__main__":
    if sys.argv[1] == "trim":
        trim(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
    else:
        crd(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
