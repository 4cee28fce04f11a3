"""Markdown reference of every configuration key, generated from the pydantic models.

``docs/configuration.md`` is :func:`configuration_page`, one heading per config file and section
(regenerated with the CLI reference by ``python -m fedpose.reference_docs``; a test checks it is
current). It is the one configuration reference: the README links it.
"""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def _type_name(annotation: object) -> str:
    text = str(annotation).replace("typing.", "").replace("pathlib.", "").replace("NoneType", "None")
    if isinstance(annotation, type):
        text = annotation.__name__
    return text.replace("<class '", "").replace("'>", "")


def _submodel(annotation: object) -> type[BaseModel] | None:
    """The model a field holds — an optional one (``Model | None``) too."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if type(None) in typing.get_args(annotation) and len(options) == 1:
        return _submodel(options[0])
    return None


def markdown_text(text: str) -> str:
    """``text`` with ``<`` outside code spans escaped: a renderer would take ``<checkpoint_dir>`` for an HTML tag and drop it."""
    parts = re.split(r"(`+[^`]*`+)", text)
    return "".join(part if part.startswith("`") else part.replace("<", "&lt;") for part in parts)


def _row(key: str, field: FieldInfo) -> str:
    """One table row, its description escaped for a rendered page."""
    if field.is_required():
        default = "required"
    else:
        default = f"`{field.default_factory()!r}`" if field.default_factory is not None else f"`{field.default!r}`"  # type: ignore[call-arg]
    desc = markdown_text(" ".join((field.description or "").split()).replace("|", "\\|"))
    return f"| `{key}` | {_type_name(field.annotation).replace('|', 'or')} | {default} | {desc} |"


#: the config files, in the order the page documents them: (heading, model, what reads it, the table
#: of it that a later file reuses: "" for the whole file, None for none)
CONFIG_FILES: tuple[tuple[str, str, str, str | None], ...] = (
    ("Central training", "fedpose.config:RunConfig",
     "`fedpose train --config FILE` (e.g. `configs/central.toml`).", None),
    ("Coordinator", "fedpose.federation.deployment:CoordinatorRunConfig",
     "A deployed coordinator's TOML (`configs/coordinator.toml`, submitted with `flwr run`); "
     "its `[coordinator]` table is also the `[coordinator]` table of a federation file.", "coordinator"),
    ("Site", "fedpose.federation.config:SiteConfig",
     "A site's TOML, read by its SuperNode (`--node-config site-config=FILE`) and by `python -m sites.metrics`; "
     "the same keys make up one `[[sites]]` table of a federation file. The site alone decides its budget and mechanism.", ""),
    ("Federation", "fedpose.federation.config:FederationConfig",
     "`fedpose simulate --config FILE` and `fedpose deploy local --config FILE`: the coordinator and every site in one file.", None),
)


def _model(path: str) -> type[BaseModel]:
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _section_tables(model: type[BaseModel], documented: dict[type[BaseModel], str], prefix: str = "", level: int = 3) -> list[str]:
    """The table of ``model``'s own keys, then a heading and tables per section (sub-model), nested
    sections one heading level deeper (at most ``#####``).

    A section whose model is documented elsewhere on the page (``documented``: model -> the sentence
    that links there) is that link, not a second copy.
    """
    header = "| key | type | default | meaning |\n|---|---|---|---|"
    own: list[str] = []
    sections: list[str] = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        table, keys = f"[{prefix}{name}]", f"{prefix}{name}."
        if sub is None and typing.get_origin(field.annotation) is list:
            (item,) = typing.get_args(field.annotation)
            sub, table, keys = _submodel(item), f"[[{prefix}{name}]]", f"{prefix}{name}[]."
        if sub is None:
            own.append(_row(f"{prefix}{name}", field))
            continue
        about = " ".join((field.description or sub.__doc__ or "").split())
        if table.startswith("[["):
            about = f"One table per entry, repeated. {about}".strip()
        sections.append(f"\n{'#' * min(level, 5)} `{table}`\n")
        if sub in documented:
            sections.append(f"{about} {documented[sub].format(name=name)}".strip())
            continue
        if about:
            sections.append(about + "\n")
        sections.extend(_section_tables(sub, documented, keys, level + 1))
    if own and not prefix:
        own = ["\n### Top-level keys\n", header, *own]
    elif own:
        own = [header, *own]
    return own + sections


def configuration_page() -> str:
    """``docs/configuration.md``: every config file, one heading per section, every key's type, default and meaning."""
    from fedpose.reference_docs import REGENERATE

    files = [(heading, _model(path), readers) for heading, path, readers, _ in CONFIG_FILES]
    documented: dict[type[BaseModel], tuple[str, str]] = {}  # model -> (the file documenting it, a sentence linking there)
    for (heading, model, _), (*_, reused) in zip(files, CONFIG_FILES):
        if reused == "":
            documented[model] = heading, (f"Its keys are those of a [{heading}](#{_anchor(heading)}) file; a `--set` override names "
                                "an entry by position or site id: `{name}.0.<key>`, `{name}.<site_id>.<key>`.")
        elif reused:
            section = _submodel(model.model_fields[reused].annotation)
            assert section is not None, f"{heading}: {reused} is not a section"
            documented[section] = heading, f"Its keys are those of the `[{reused}]` table of the [{heading}](#{_anchor(heading)}) file."
    parts = [
        "# Configuration reference",
        "",
        f"<!-- generated from the pydantic config models: do not edit; regenerate with `{REGENERATE}` -->",
        "",
        "Configs are TOML files (examples in `configs/`). `--set key=value` overrides any key (dotted path; "
        "a site of a federation file is named by its 0-based position or its `site_id`: `--set sites.1.eps_max=4`, "
        "`--set sites.site-2.eps_max=4`). Unknown keys and invalid values are rejected with a message naming the key.",
        "",
        *[f"- [{heading}](#{_anchor(heading)}): {readers}" for heading, _, readers in files],
    ]
    for heading, model, readers in files:
        elsewhere = {m: link for m, (owner, link) in documented.items() if owner != heading}
        parts += ["", f"## {heading}", "", f"{readers} Model: `{model.__module__}.{model.__name__}`.",
                  *_section_tables(model, elsewhere)]
    return "\n".join(parts) + "\n"
