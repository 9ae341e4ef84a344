"""The settings as YAML text: parsing, the commented rendering, and editing values in a
user's file without losing their comments.

PyYAML drops comments when it loads, so a save that re-dumps the data would erase the
user's notes. Instead `edit_values` rewrites only the value on each `key: value` line,
checks the result parses back to exactly the settings, and otherwise gives up (the
caller then renders the whole file afresh).
"""

from __future__ import annotations

import re
import textwrap
from enum import StrEnum
from typing import Any

import yaml

from .schema import FieldSpec, Settings, schema_fields, sections

HEADER = """\
# kvchat settings. Created from the packaged default on first run; kvchat keeps your
# comments when it saves. A key left out takes its default; an unknown key is reported
# and ignored.
"""

_WIDTH = 92


class Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` and `5E2` as floats.

    PyYAML follows YAML 1.1, where a float needs a dot (`1.0e-3`), so `temperature: 1e-3`
    would be a string; YAML 1.2 and every other parser users know read it as a number.
    """


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse(text: str) -> Any:
    """Load YAML text with Loader; raises yaml.YAMLError."""
    return yaml.load(text, Loader=Loader)  # safe: Loader derives from SafeLoader


def render_scalar(value: Any) -> str:
    """One value as it is written after `key: ` (quoted only when YAML needs it)."""
    value = _plain(value)
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**9)
    text = text.removesuffix("\n").removesuffix("\n...")
    if len(text.splitlines()) > 1:
        # A multi-line scalar would break line-by-line editing; escapes keep it on one line.
        text = yaml.safe_dump(value, default_style='"', allow_unicode=True, width=10**9)
    return text.strip()


def _plain(value: Any) -> Any:
    """An enum member as its string, the type YAML reads it back as; other values as they are."""
    return value.value if isinstance(value, StrEnum) else value


def _comment(spec: FieldSpec, indent: str) -> list[str]:
    text = f"{spec.help} Allowed: {spec.allowed()}."
    prefix = f"{indent}# "
    return textwrap.wrap(
        text, _WIDTH, initial_indent=prefix, subsequent_indent=prefix, break_on_hyphens=False
    )


def _key_block(spec: FieldSpec, value: Any, indent: str) -> list[str]:
    return [*_comment(spec, indent), f"{indent}{spec.name}: {render_scalar(value)}"]


def _section_block(name: str, cls: type, help: str, values: Any) -> list[str]:
    lines = [f"# {help}", f"{name}:"]
    for spec in schema_fields(cls):
        lines += _key_block(spec, getattr(values, spec.name), "  ")
    return lines


def settings_to_yaml(settings: Settings) -> str:
    """The full settings file: every key, each under a comment with its help and range."""
    blocks = [
        "\n".join(_section_block(name, cls, help, getattr(settings, name)))
        for name, cls, help in sections()
    ]
    return HEADER + "\n" + "\n\n".join(blocks) + "\n"


_SECTION_LINE = re.compile(r"^(?P<name>[A-Za-z_][\w-]*)[ \t]*:(?P<rest>.*)$")
# A block-mapping entry with an optional scalar and an optional trailing comment; a plain
# scalar may contain '#' when no blank precedes it, hence the lazy value group.
_KEY_LINE = re.compile(
    r"""^(?P<indent>[ \t]+)(?P<key>[A-Za-z_]\w*)[ \t]*:
        (?:[ \t]+(?P<value>"(?:[^"\\]|\\.)*"|'(?:[^']|'')*'|[^\s#].*?))?
        (?P<comment>[ \t]*\#.*)?[ \t]*$""",
    re.VERBOSE,
)


def edit_values(text: str, settings: Settings) -> str | None:
    """`text` with every schema value set from `settings`, comments and unknown keys kept.

    Keys missing from the text are added at the end of their section, and missing
    sections at the end of the file, with their comments. None when the text is laid out
    in a way this line editor does not handle (flow style, multi-line values, ...).
    """
    lines = text.splitlines()
    known = {name: (cls, help) for name, cls, help in sections()}
    names = {name: {spec.name for spec in schema_fields(cls)} for name, (cls, _) in known.items()}
    seen: dict[str, set[str]] = {}  # section -> schema keys found, for sections present
    last_line: dict[str, int] = {}  # section -> its last content line
    indents: dict[str, str] = {}  # section -> the indentation of its direct children
    current = None
    for i, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            match = _SECTION_LINE.match(line)
            current = match["name"] if match else None
            if current in known:
                rest = match["rest"].strip()
                if rest and not rest.startswith("#"):
                    return None  # `model: {...}`: not a block this editor can edit
                seen.setdefault(current, set())
                last_line[current] = i
            continue
        if current not in known:
            continue
        last_line[current] = i
        indent = indents.setdefault(current, line[: len(line) - len(line.lstrip())])
        match = _KEY_LINE.match(line)
        # A deeper line belongs to a value (a user's nested mapping), not to the section.
        if match is None or match["indent"] != indent or match["key"] not in names[current]:
            continue
        comment = match["comment"] or ""
        if comment and not comment[0].isspace():
            comment = " " + comment
        value = getattr(getattr(settings, current), match["key"])
        lines[i] = f"{indent}{match['key']}: {render_scalar(value)}{comment}"
        seen[current].add(match["key"])

    # Bottom-up, so inserting lines does not shift the positions still to be used.
    for name in sorted(seen, key=last_line.__getitem__, reverse=True):
        cls, _ = known[name]
        values = getattr(settings, name)
        added = [
            line
            for spec in schema_fields(cls)
            if spec.name not in seen[name]
            for line in _key_block(spec, getattr(values, spec.name), indents.get(name, "  "))
        ]
        lines[last_line[name] + 1 : last_line[name] + 1] = added
    for name, (cls, help) in known.items():
        if name not in seen:
            lines += ["", *_section_block(name, cls, help, getattr(settings, name))]

    edited = "\n".join(lines) + "\n"
    return edited if _holds(edited, settings) else None


def _holds(text: str, settings: Settings) -> bool:
    """Whether `text` parses back to exactly the values of `settings` (types included)."""
    try:
        data = parse(text)
    except yaml.YAMLError:
        return False
    if not isinstance(data, dict):
        return False
    for name, cls, _ in sections():
        section_data = data.get(name)
        if not isinstance(section_data, dict):
            return False
        for spec in schema_fields(cls):
            want = _plain(getattr(getattr(settings, name), spec.name))
            got = section_data.get(spec.name)
            if type(got) is not type(want) or got != want:
                return False
    return True
