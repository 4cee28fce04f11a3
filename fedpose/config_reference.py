"""Markdown reference of every configuration key, generated from the pydantic models.

The README embeds this output between ``<!-- config-reference:begin/end -->`` markers and a test
checks it is current: regenerate with ``python -m fedpose.config_reference --write README.md``.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"


def _type_name(annotation: object) -> str:
    text = str(annotation).replace("typing.", "").replace("pathlib.", "").replace("NoneType", "None")
    if isinstance(annotation, type):
        text = annotation.__name__
    return text.replace("<class '", "").replace("'>", "")


def _submodel(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows: list[str] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _submodel(field.annotation)
        if sub is None and typing.get_origin(field.annotation) is list:
            (item,) = typing.get_args(field.annotation)
            if _submodel(item) is not None:
                rows.append(f"| `{key}` | list of tables | required | one `[[{key}]]` table each, keys as below |")
                rows.extend(_rows(item, f"{key}[]."))
                continue
        if sub is not None:
            rows.extend(_rows(sub, f"{key}."))
            continue
        default = "required" if field.is_required() else f"`{field.default!r}`"
        desc = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{key}` | {_type_name(field.annotation).replace('|', 'or')} | {default} | {desc} |")
    return rows


def reference_markdown() -> str:
    from fedpose.config import RunConfig
    from fedpose.federation.config import FederationConfig

    header = "| key | type | default | meaning |\n|---|---|---|---|"
    parts = [
        "#### `fedpose train` (RunConfig)\n",
        header,
        *_rows(RunConfig, ""),
        "\n#### `fedpose simulate` / `fedpose deploy` (FederationConfig; a site file holds one `[[sites]]` table's keys)\n",
        header,
        *_rows(FederationConfig, ""),
    ]
    return "\n".join(parts) + "\n"


def splice(readme: str, reference: str) -> str:
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n" + reference + readme[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", type=Path, help="splice the reference into this markdown file")
    args = parser.parse_args(argv)
    reference = reference_markdown()
    if args.write:
        args.write.write_text(splice(args.write.read_text(), reference))
    else:
        sys.stdout.write(reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
