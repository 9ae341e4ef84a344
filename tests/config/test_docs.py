"""docs/configuration.md is the settings schema's own documentation, kept up to date."""

from __future__ import annotations

from pathlib import Path

from kvchat.config import settings_markdown
from kvchat.config.docs import DOCS_COMMAND, DOCS_PATH
from kvchat.config.schema import schema_fields, sections

REPO = Path(__file__).resolve().parents[2]


def test_configuration_md_matches_the_schema():
    path = REPO / DOCS_PATH
    assert path.is_file(), f"{DOCS_PATH} is missing; generate it with: {DOCS_COMMAND}"
    assert path.read_text(encoding="utf-8") == settings_markdown(), (
        f"{DOCS_PATH} is out of date with the settings schema; regenerate it with: {DOCS_COMMAND}"
    )


def test_every_setting_has_a_row_in_its_section():
    text = settings_markdown()
    for name, cls, _ in sections():
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for spec in schema_fields(cls):
            assert f"\n| `{spec.name}` |" in section, f"{name}.{spec.name}"


def test_enumerated_values_are_listed_and_table_cells_stay_cells():
    text = settings_markdown()
    assert "| `kv_type` | `FP16` | `FP16`, `INT8`, `INT4` |" in text
    assert "| `block_size` | `128` | an integer from 32 to 4096 that is a multiple of 32 |" in text
    # `*.safetensors` in a help text is escaped, not the start of emphasis.
    assert r"config.json + \*.safetensors" in text
    for line in text.splitlines():
        if line.startswith("| `"):
            assert line.replace(r"\|", "").count("|") == 5, line
