"""The schema is the single source of truth: the packaged YAML, its comments and the
field metadata must all agree with it."""

from __future__ import annotations

import dataclasses
import re
from enum import StrEnum

import pytest

from kvchat.config import (
    CacheSettings,
    GenerationSettings,
    KeySettings,
    KvType,
    LongContextSettings,
    ModelSettings,
    Settings,
    UISettings,
    default_config_path,
    kvchat_home,
    schema_fields,
    settings_file_text,
    settings_to_yaml,
)
from kvchat.config.schema import sections
from kvchat.config.store import default_yaml
from kvchat.config.validate import coerce
from kvchat.config.yamltext import parse

SECTION_CLASSES = [
    ModelSettings,
    GenerationSettings,
    LongContextSettings,
    UISettings,
    KeySettings,
    CacheSettings,
]
ALL_SPECS = [(name, spec) for name, cls, _ in sections() for spec in schema_fields(cls)]
SPEC_IDS = [f"{name}.{spec.name}" for name, spec in ALL_SPECS]


KEY = re.compile(rf"^  # ({'|'.join(spec.name for _, spec in ALL_SPECS)}): ")


def _comment_above(lines: list[str], index: int) -> str:
    """The comment block right above line `index`, joined into one line of text."""
    parts = []
    i = index - 1
    # Up to the line above that is not a comment, or that is the commented-out key before.
    while i >= 0 and lines[i].lstrip().startswith("#") and not KEY.match(lines[i]):
        parts.insert(0, lines[i].lstrip()[1:].strip())
        i -= 1
    return " ".join(parts)


def test_sections_are_the_six_in_file_order():
    assert [name for name, _, _ in sections()] == [
        "model",
        "generation",
        "long_context",
        "ui",
        "keys",
        "cache",
    ]
    assert [cls for _, cls, _ in sections()] == SECTION_CLASSES


@pytest.mark.parametrize(("section", "spec"), ALL_SPECS, ids=SPEC_IDS)
def test_default_yaml_lists_every_key_commented_out_with_its_comment_and_default(section, spec):
    lines = default_yaml().splitlines()
    start = lines.index(f"{section}:")
    index = next(i for i in range(start, len(lines)) if lines[i].startswith(f"  # {spec.name}:"))
    value = parse(lines[index].removeprefix("  # "))[spec.name]
    # An enumerated default is written as its plain string.
    default = spec.default.value if isinstance(spec.default, StrEnum) else spec.default
    assert value == default and type(value) is type(default)
    comment = _comment_above(lines, index)
    assert spec.help in comment
    assert spec.allowed() in comment


def test_no_help_line_reads_as_a_commented_out_key():
    # The line editor uncomments `  # KEY: VALUE` to set a key: a help line of that form
    # would be taken for one.
    keys = [line for line in default_yaml().splitlines() if KEY.match(line)]
    assert len(keys) == len(ALL_SPECS)


def test_default_yaml_is_rendered_from_the_schema():
    assert default_yaml() == settings_file_text(Settings()), (
        "config/default.yaml is out of date; regenerate it with: python -c "
        '"from kvchat.config import settings_file_text, Settings; '
        "print(settings_file_text(Settings()), end='')\" > config/default.yaml"
    )


def test_default_yaml_sets_no_key_so_every_key_follows_the_defaults():
    data = parse(default_yaml())
    assert data == {name: None for name, _, _ in sections()}


@pytest.mark.parametrize(("section", "spec"), ALL_SPECS, ids=SPEC_IDS)
def test_every_field_is_fully_described(section, spec):
    assert spec.type in (bool, int, float, str) or issubclass(spec.type, StrEnum)
    assert spec.help and "\n" not in spec.help and spec.help.endswith(".")
    if spec.type in (int, float):
        assert spec.min is not None and spec.max is not None and spec.min < spec.max
    else:
        assert spec.min is None and spec.max is None
    if spec.choices is not None:
        assert spec.choices == tuple(spec.type) and type(spec.default) is spec.type
    else:
        assert not issubclass(spec.type, StrEnum)
    # The default passes its own checks unchanged.
    assert coerce(spec, f"{section}.{spec.name}", spec.default) == spec.default


def test_schema_fields_gives_what_a_settings_screen_needs():
    specs = {spec.name: spec for spec in schema_fields(LongContextSettings)}
    assert list(specs) == [
        "chunk_size",
        "max_seq_len",
        "block_size",
        "local_windows_len",
        "second_select_num",
        "pinned_blocks",
        "threads_num",
        "anchor_type",
        "kv_type",
        "dense_layer_num",
        "anchor_num",
        "preselect_block",
        "head_select_mode",
        "preselect_block_count",
        "layer_step",
        "token_step",
        "attention",
        "position_mode",
    ]
    kv = specs["kv_type"]
    assert (kv.type, kv.default, kv.choices) == (KvType, KvType.FP16, ("FP16", "INT8", "INT4"))
    block = specs["block_size"]
    assert (block.type, block.default, block.min, block.max, block.multiple_of) == (
        int,
        128,
        32,
        4096,
        32,
    )
    assert block.allowed() == "an integer from 32 to 4096 that is a multiple of 32"
    assert specs["preselect_block"].allowed() == "true or false"
    assert schema_fields(UISettings)[1].allowed() == "a number from 0.5 to 30"


def test_defaults_are_the_documented_ones():
    s = Settings()
    assert (s.model.path, s.model.dtype, s.model.device, s.model.threads) == (
        "qwen2.5-coder-0.5b",
        "auto",
        "auto",
        0,
    )
    assert dataclasses.astuple(s.generation) == (512, 0.0, 1.0, 0, 1.0, 0)
    assert dataclasses.astuple(s.long_context) == (
        2048,
        131072,
        128,
        2048,
        16,
        4,
        0,
        "QUEST",
        "FP16",
        0,
        1,
        False,
        "SHARED",
        32,
        1,
        1,
        "sparse",
        "auto",
    )
    assert dataclasses.astuple(s.ui) == ("dark", 4.0, True)
    assert dataclasses.asdict(s.keys) == {
        "load_file": "ctrl+o",
        "stop": "escape",
        "toggle_panels": "f2",
        "clear_chat": "ctrl+l",
        "settings": "f3",
        "help": "f1",
        "sessions": "f4",
        "regenerate": "ctrl+r",
        "copy_reply": "ctrl+t",
    }
    assert dataclasses.astuple(s.cache) == (True, 16384, 0.0)


def test_settings_are_frozen():
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.long_context.kv_type = "INT8"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.ui = UISettings()


@pytest.mark.parametrize("render", [settings_file_text, settings_to_yaml])
def test_rendered_yaml_lines_fit_the_comment_width(render):
    assert max(len(line) for line in render(Settings()).splitlines()) <= 92
    # Wrapping must not split words such as "end-of-turn" across comment lines.
    assert not re.search(r"-\n", render(Settings()))


def test_kvchat_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "h"))
    assert kvchat_home() == tmp_path / "h"
    assert default_config_path() == tmp_path / "h" / "config.yaml"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVCHAT_HOME", "~/elsewhere")
    assert kvchat_home() == tmp_path / "elsewhere"
    for unset in (monkeypatch.delenv, lambda name: monkeypatch.setenv(name, "")):
        unset("KVCHAT_HOME")
        assert kvchat_home() is None
