"""Checking values against the schema, and the rules that tie several keys together.

Per-key checks read only FieldSpec metadata; the few rules that involve more than one
key are a table, so every message has the same shape:
``SOURCE: section.key = VALUE: expected WHAT IS ALLOWED``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from .enums import WHOLE_BLOCK_ANCHOR_TYPES
from .errors import ConfigError
from .schema import FieldSpec, Settings, schema_fields, sections


@dataclass(frozen=True)
class Problem:
    key: str
    value: Any
    expected: str
    got: str = ""

    def __str__(self) -> str:
        text = f"{self.key} = {show(self.value)}: expected {self.expected}"
        return f"{text} (got {self.got})" if self.got else text


class Invalid(Exception):
    """One value rejected by `coerce`; carries the Problem so callers can batch them."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(str(problem))
        self.problem = problem


def show(value: Any) -> str:
    """A value as the user would write it in YAML, quoted when it is a string."""
    if isinstance(value, bool) or value is None:
        text = {True: "true", False: "false", None: "null"}[value]
    elif isinstance(value, int | float):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except TypeError:  # e.g. a mapping with odd keys built in Python
            text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "an empty value"
    names = {
        str: "a string",
        int: "an integer",
        float: "a decimal number",
        list: "a list",
        dict: "a mapping",
    }
    return names.get(type(value), f"a value of type {type(value).__name__}")


def coerce(spec: FieldSpec, key: str, value: Any) -> Any:
    """The value as the field stores it, or raise Invalid.

    YAML gives int for `4096` and float for `4096.0`; a float field takes either, an int
    field takes a float only when it is whole. bool is an int subclass in Python, so it is
    excluded explicitly: `show_panels: 1` and `block_size: true` are typos, not values.
    An enumerated field takes its value's string and stores the enum member.
    """
    expected = spec.allowed()
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if spec.type is bool:
        ok = isinstance(value, bool)
    elif spec.type is int:
        if numeric and isinstance(value, float) and value.is_integer():
            value = int(value)
        ok = numeric and isinstance(value, int)
    elif spec.type is float:
        ok = numeric
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        raise Invalid(Problem(key, value, expected, got=kind(value)))

    if spec.choices is not None:
        if value not in spec.choices:
            raise Invalid(Problem(key, value, expected))
        value = spec.type(value)
    if spec.min is not None and not spec.min <= value <= spec.max:  # `not <=` also rejects NaN
        raise Invalid(Problem(key, value, expected))
    if spec.multiple_of is not None and value % spec.multiple_of:
        raise Invalid(Problem(key, value, expected))
    return value


@dataclass(frozen=True)
class _Rule:
    key: str
    holds: Callable[[Settings], bool]
    expected: Callable[[Settings], str]


_RULES = (
    _Rule(
        "long_context.anchor_num",
        lambda s: (
            s.long_context.anchor_type not in WHOLE_BLOCK_ANCHOR_TYPES
            or s.long_context.anchor_num == 1
        ),
        lambda s: f"1 when long_context.anchor_type is {s.long_context.anchor_type}",
    ),
    _Rule(
        "long_context.anchor_num",
        lambda s: s.long_context.anchor_num <= s.long_context.block_size,
        lambda s: f"at most long_context.block_size ({s.long_context.block_size})",
    ),
    _Rule(
        "long_context.chunk_size",
        lambda s: s.long_context.chunk_size <= s.long_context.max_seq_len,
        lambda s: f"at most long_context.max_seq_len ({s.long_context.max_seq_len})",
    ),
    _Rule(
        "long_context.local_windows_len",
        lambda s: s.long_context.local_windows_len % s.long_context.block_size == 0,
        lambda s: f"a multiple of long_context.block_size ({s.long_context.block_size})",
    ),
    _Rule(
        "long_context.preselect_block_count",
        lambda s: (
            not s.long_context.preselect_block
            or s.long_context.preselect_block_count >= s.long_context.second_select_num
        ),
        lambda s: (
            f"at least long_context.second_select_num ({s.long_context.second_select_num})"
            " when long_context.preselect_block is true"
        ),
    ),
)


def fail(source: str, problems: Sequence[Problem]) -> NoReturn:
    """Raise one ConfigError listing every problem found in `source`."""
    if len(problems) == 1:
        raise ConfigError(f"{source}: {problems[0]}")
    lines = "\n".join(f"  {p}" for p in problems)
    raise ConfigError(f"{source}: {len(problems)} invalid settings:\n{lines}")


# Keys the app does not let the `keys` section take: the prompt's and Textual's own.
RESERVED_KEYS = {
    "enter": "sends the prompt",
    "shift+enter": "starts a new line in the prompt",
    "ctrl+j": "starts a new line in the prompt",
    "tab": "moves the focus",
    "shift+tab": "moves the focus",
    "ctrl+p": "opens the command palette",
    "ctrl+q": "quits",
    "ctrl+c": "copies the selected text",
}


def _key_problems(settings: Settings) -> list[Problem]:
    """Each action's keys are names without blanks, not reserved, not bound to another action."""
    problems = []
    owner: dict[str, str] = {}
    for spec in schema_fields(type(settings.keys)):
        key = f"keys.{spec.name}"
        value = getattr(settings.keys, spec.name)
        names = [name.strip() for name in value.split(",")]
        if not all(names) or any(char.isspace() for name in names for char in name):
            expected = "a key name such as ctrl+o or f2, or several separated by commas"
            problems.append(Problem(key, value, expected))
            continue
        for name in names:
            if name in RESERVED_KEYS:
                expected = f"a key other than {name}, which {RESERVED_KEYS[name]}"
            elif name in owner:
                expected = f"a key no other action has ({name} is keys.{owner[name]})"
            else:
                owner[name] = spec.name
                continue
            problems.append(Problem(key, value, expected))
    return problems


def rule_problems(settings: Settings) -> list[Problem]:
    """What breaks the cross-field rules; call only on settings whose single values are valid."""
    return [
        Problem(rule.key, _get(settings, rule.key), rule.expected(settings))
        for rule in _RULES
        if not rule.holds(settings)
    ] + _key_problems(settings)


def check_rules(settings: Settings, source: str) -> None:
    """Raise ConfigError, naming `source`, if a cross-field rule is broken."""
    problems = rule_problems(settings)
    if problems:
        fail(source, problems)


def _get(settings: Settings, key: str) -> Any:
    section_name, name = key.split(".")
    return getattr(getattr(settings, section_name), name)


def build_settings(data: Mapping[str, Mapping[str, Any]], source: str) -> Settings:
    """Settings from known keys per section; a key that is absent takes its default."""
    problems: list[Problem] = []
    built = {}
    for section_name, cls, _ in sections():
        given = data.get(section_name, {})
        values = {}
        for spec in schema_fields(cls):
            if spec.name not in given:
                continue
            try:
                values[spec.name] = coerce(spec, f"{section_name}.{spec.name}", given[spec.name])
            except Invalid as exc:
                problems.append(exc.problem)
        built[section_name] = cls(**values)
    if problems:
        fail(source, problems)
    settings = Settings(**built)
    check_rules(settings, source)
    return settings


def validate_settings(settings: Settings, source: str) -> None:
    """Raise ConfigError, naming `source`, if any value or cross-field rule is violated."""
    data = {
        section_name: dataclasses.asdict(getattr(settings, section_name))
        for section_name, _, _ in sections()
    }
    build_settings(data, source)


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """' (did you mean X?)' for the closest candidate, or ''."""
    tail = [c for c in candidates if c.endswith("." + word)]  # `kv_type` for `long_context.kv_type`
    close = tail or difflib.get_close_matches(word, candidates, n=1)
    return f" (did you mean {close[0]}?)" if close else ""
