"""docs/configuration.md, generated from the settings schema: one table per section with
each key's default, allowed values and help text.

`kvchat config docs` prints it and `kvchat config docs --output FILE` writes it;
tests/config/test_docs.py fails when the file in the repository differs from what the
schema gives now.
"""

from __future__ import annotations

import re

from .schema import FieldSpec, schema_fields, sections
from .yamltext import render_scalar

DOCS_PATH = "docs/configuration.md"
DOCS_COMMAND = f"kvchat config docs --output {DOCS_PATH}"

_INTRO = f"""\
# Configuration

<!-- Generated from the settings schema (config/schema.py): edit the schema, not this
file, then run `{DOCS_COMMAND}`. -->

kvchat reads its settings from `config.yaml` in the platform's config folder
(`~/.config/kvchat/config.yaml` on Linux; `$KVCHAT_HOME/config.yaml` when that is set; `kvchat
config path` prints it), which the first run creates with every key listed under its help
and commented out. A key left commented (or left out) takes the default of the kvchat you
run, so improved defaults reach you; saving from the settings screen or `kvchat config set`
writes only the keys you change, and a key changed back to its default is commented out
again. An unknown key is reported and ignored. A file that an earlier kvchat wrote with every
key set is upgraded once: keys at a current or earlier default are commented out.
`--set SECTION.KEY=VALUE` overrides a setting for one run (repeatable, e.g.
`--set long_context.kv_type=INT8`), `kvchat config show` prints the settings in effect and
`kvchat config validate` checks the file. Enumerated values are case-sensitive.
"""

# Characters Markdown would read as markup inside a table cell. An underscore is markup
# only at the edge of a word (`second_select_num` stays as it is).
_MARKUP = re.compile(r"[\\`*|<>]|(?<!\w)_|_(?!\w)")


def _text(text: str) -> str:
    return _MARKUP.sub(lambda m: "\\" + m.group(0), text)


def _allowed(spec: FieldSpec) -> str:
    if spec.choices is not None:
        return ", ".join(f"`{choice}`" for choice in spec.choices)
    return _text(spec.allowed())


def _row(spec: FieldSpec) -> str:
    cells = (f"`{spec.name}`", f"`{render_scalar(spec.default)}`", _allowed(spec), _text(spec.help))
    return "| " + " | ".join(cells) + " |"


def settings_markdown() -> str:
    """The whole of docs/configuration.md."""
    parts = [_INTRO]
    for name, cls, help in sections():
        lines = [
            f"## {name}",
            "",
            _text(help),
            "",
            "| Key | Default | Allowed values | Description |",
            "| --- | --- | --- | --- |",
            *(_row(spec) for spec in schema_fields(cls)),
        ]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)
