"""The docs site's HTTP API reference, built at each docs build from the OpenAPI document the app
builds (no server runs), so that it cannot drift. (The configuration reference is written from the
settings' declarations by ``scripts/configuration_reference.py``; a test holds it equal.)

MkDocs loads this file as a hook (``mkdocs.yml``: ``hooks``); its ``on_files`` adds the pages to
the site without writing them into ``docs/``. ``python docs/gen_reference.py DIR`` writes them to
DIR to read them as text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

API_PAGE = "reference/api.md"


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def openapi_document() -> dict[str, Any]:
    """The document ``GET /openapi.json`` serves, built from the app for the default model."""
    from tokenline.api.app import ServerSettings, build_app

    return build_app(ServerSettings()).openapi()


def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_schema_name(schema.get('items', {}))}"
    return schema.get("type", "any")


def api_markdown(document: dict[str, Any] | None = None) -> str:
    """Each route with its body and answers, then each schema's fields; the whole document last."""
    doc = document or openapi_document()
    lines = ["# HTTP API reference", "",
             "Generated at each docs build from the OpenAPI document the app builds (what `GET /openapi.json` "
             f"serves; {doc['info']['title']} {doc['info']['version']}). Errors always have the `ErrorResponse` "
             "shape.", "", "## Routes", ""]
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            lines += [f"### `{method.upper()} {path}`", "", _cell(op.get("summary", "")), ""]
            if op.get("description"):
                lines += [op["description"].strip(), ""]
            body = op.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                lines.append(f"Body ({media}): `{_schema_name(content.get('schema', {}))}`")
            lines += ["", "| status | answer | content |", "|---|---|---|"]
            for status, answer in op.get("responses", {}).items():
                kinds = ", ".join(f"{m}: `{_schema_name(c.get('schema', {}))}`"
                                  for m, c in answer.get("content", {}).items())
                lines.append(f"| {status} | {_cell(answer.get('description', ''))} | {kinds} |")
            lines.append("")
    lines += ["## Schemas", ""]
    for name, schema in doc.get("components", {}).get("schemas", {}).items():
        lines += [f"### {name}", "", _cell(schema.get("description", "")), ""]
        properties = schema.get("properties", {})
        if properties:
            required = set(schema.get("required", []))
            lines += ["| field | type | required | description |", "|---|---|---|---|"]
            for field, spec in properties.items():
                lines.append(f"| `{field}` | {_cell(_schema_name(spec))} | {'yes' if field in required else ''} | "
                             f"{_cell(spec.get('description', ''))} |")
        lines.append("")
    lines += ["## The whole document", "", '??? note "openapi.json"', "",
              "    ```json", *("    " + line for line in json.dumps(doc, indent=1).splitlines()), "    ```", ""]
    return "\n".join(lines)


def pages() -> dict[str, str]:
    return {API_PAGE: api_markdown()}


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the site."""
    from mkdocs.structure.files import File

    for uri, text in pages().items():
        files.append(File.generated(config, uri, content=text))
    return files


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "site-reference")
    for uri, text in pages().items():
        (out / uri).parent.mkdir(parents=True, exist_ok=True)
        (out / uri).write_text(text)
        print(out / uri)
