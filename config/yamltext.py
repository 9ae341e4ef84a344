"""The settings as YAML text: parsing, the commented rendering, and editing values in a
user's file without losing their comments.

The settings file lists every key with its help, and comments out the keys at their
defaults, so a default improved in a later kvchat reaches the user. PyYAML drops comments
when it loads, so a save that re-dumps the data would erase the user's notes. Instead
`edit_values` rewrites only the lines of the keys that change, and gives up on a layout it
does not handle (the caller then renders the whole file afresh).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import yaml

from .schema import FieldSpec, Settings, schema_fields, sections, value_of

HEADER = """\
# kvchat settings. Every key is listed with its help and its default, commented out: a key
# left commented takes the default of the kvchat you run, so better defaults reach you.
# Remove a key's '#' and edit its value to change it (or run kvchat config set
# SECTION.KEY=VALUE); kvchat keeps your comments when it saves. An unknown key is reported
# and ignored.
"""

# `kvchat config show`: every value live, the file's, the defaults and --set overrides merged.
SHOW_HEADER = """\
# kvchat settings in effect: the settings file, the defaults for the keys it leaves out,
# and this run's --set overrides.
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


def _key_block(spec: FieldSpec, value: Any, indent: str, live: bool) -> list[str]:
    return [*_comment(spec, indent), _key_line(indent, spec.name, value, live, "")]


def _key_line(indent: str, key: str, value: Any, live: bool, comment: str) -> str:
    return f"{indent}{'' if live else '# '}{key}: {render_scalar(value)}{comment}"


def _section_block(
    name: str, help: str, values: Any, specs: list[FieldSpec], comment_defaults: bool
) -> list[str]:
    lines = [f"# {help}", f"{name}:"]
    for spec in specs:
        value = getattr(values, spec.name)
        live = not (comment_defaults and is_default(name, spec.name, value))
        lines += _key_block(spec, value, "  ", live)
    return lines


def _render(settings: Settings, header: str, comment_defaults: bool) -> str:
    blocks = [
        "\n".join(
            _section_block(
                name, help, getattr(settings, name), schema_fields(cls), comment_defaults
            )
        )
        for name, cls, help in sections()
    ]
    return header + "\n" + "\n\n".join(blocks) + "\n"


def is_default(section: str, key: str, value: Any) -> bool:
    """Whether `value` is the default of `section.key`: such a key is left commented out in
    the settings file, so it follows the default of the kvchat that reads the file."""
    return value == value_of(_DEFAULTS, f"{section}.{key}")


_DEFAULTS = Settings()


def settings_file_text(settings: Settings) -> str:
    """The settings file for `settings`: every key under a comment with its help and range,
    the keys at their defaults commented out."""
    return _render(settings, HEADER, comment_defaults=True)


def settings_to_yaml(settings: Settings) -> str:
    """Every value of `settings` live, each under its help: what `kvchat config show` prints."""
    return _render(settings, SHOW_HEADER, comment_defaults=False)


_SECTION_LINE = re.compile(r"^(?P<name>[A-Za-z_][\w-]*)[ \t]*:(?P<rest>.*)$")
# A block-mapping entry with an optional scalar and an optional trailing comment; a plain
# scalar may contain '#' when no blank precedes it, hence the lazy value group.
_ENTRY = r"""(?P<key>[A-Za-z_]\w*)[ \t]*:
        (?:[ \t]+(?P<value>"(?:[^"\\]|\\.)*"|'(?:[^']|'')*'|[^\s#].*?))?
        (?P<comment>[ \t]*\#.*)?[ \t]*$"""
_KEY_LINE = re.compile(r"^(?P<indent>[ \t]+)" + _ENTRY, re.VERBOSE)
# The same entry commented out, as the settings file lists a key left at its default.
_COMMENTED_KEY_LINE = re.compile(r"^(?P<indent>[ \t]+)\#[ \t]?" + _ENTRY, re.VERBOSE)


@dataclass
class _Section:
    """Where a section's keys are in the file's lines."""

    last: int  # its last indented line: keys it lacks are inserted after it
    indent: str | None = None  # the indentation of its live keys
    live: dict[str, int] = field(default_factory=dict)  # key -> line
    commented: dict[str, tuple[int, str]] = field(default_factory=dict)  # key -> line, indent

    def key_indent(self) -> str:
        if self.indent is not None:
            return self.indent
        return next(iter(self.commented.values()), (0, "  "))[1]


def _layout(lines: list[str]) -> dict[str, _Section] | None:
    """The schema sections found in `lines`, or None for a layout the line editor does not
    handle (a section in flow style)."""
    known = {name: {spec.name for spec in schema_fields(cls)} for name, cls, _ in sections()}
    found: dict[str, _Section] = {}
    current = None
    for i, line in enumerate(lines):
        if not line.strip() or line.startswith("#"):
            continue  # a comment at the left margin introduces the next section
        if not line[0].isspace():
            match = _SECTION_LINE.match(line)
            current = match["name"] if match else None
            if current in known:
                rest = match["rest"].strip()
                if rest and not rest.startswith("#"):
                    return None  # `model: {...}`: not a block this editor can edit
                found.setdefault(current, _Section(last=i))
            continue
        if current not in known:
            continue
        section = found[current]
        section.last = i
        if line.lstrip().startswith("#"):
            match = _COMMENTED_KEY_LINE.match(line)
            if match and match["key"] in known[current]:
                # The last one: a help line above may read as `key: ...` too.
                section.commented[match["key"]] = (i, match["indent"])
            continue
        if section.indent is None:
            section.indent = line[: len(line) - len(line.lstrip())]
        match = _KEY_LINE.match(line)
        # A deeper line belongs to a value (a user's nested mapping), not to the section.
        if match and match["indent"] == section.indent and match["key"] in known[current]:
            section.live[match["key"]] = i
    # A commented entry counts only at the indentation of the section's keys.
    for section in found.values():
        indent = section.key_indent()
        section.commented = {k: v for k, v in section.commented.items() if v[1] == indent}
    return found


def edit_values(text: str, settings: Settings, keys: Collection[str] | None = None) -> str | None:
    """`text` with the values of `keys` (SECTION.KEY; every key when None) set from
    `settings`, comments and unknown keys kept.

    A key at its default is commented out, so the file follows the defaults of the kvchat
    that reads it; a key set to another value is written on its line, on its commented
    line (uncommented), or at the end of its section with its help, the section added at
    the end of the file when it is missing. None when the text is laid out in a way this
    line editor does not handle (flow style, ...); the caller checks the result parses
    back to `settings`.
    """
    lines = text.splitlines()
    found = _layout(lines)
    if found is None:
        return None
    inserts: list[tuple[int, list[str]]] = []
    for name, cls, help in sections():
        values = getattr(settings, name)
        chosen = [
            spec for spec in schema_fields(cls) if keys is None or f"{name}.{spec.name}" in keys
        ]
        section = found.get(name)
        if section is None:
            missing = [s for s in chosen if not is_default(name, s.name, getattr(values, s.name))]
            if missing:
                lines += ["", *_section_block(name, help, values, missing, True)]
            continue
        added: list[str] = []
        for spec in chosen:
            value = getattr(values, spec.name)
            live = not is_default(name, spec.name, value)
            if spec.name in section.live:
                i, indent = section.live[spec.name], section.key_indent()
            elif spec.name in section.commented and live:
                i, indent = section.commented[spec.name]
            else:
                if live:
                    added += _key_block(spec, value, section.key_indent(), True)
                continue
            pattern = _KEY_LINE if spec.name in section.live else _COMMENTED_KEY_LINE
            comment = pattern.match(lines[i])["comment"] or ""
            if comment and not comment[0].isspace():
                comment = " " + comment
            lines[i] = _key_line(indent, spec.name, value, live, comment)
        if added:
            inserts.append((section.last + 1, added))
    # Bottom-up, so inserting lines does not shift the positions still to be used.
    for at, added in sorted(inserts, reverse=True):
        lines[at:at] = added
    return "\n".join(lines) + "\n"
