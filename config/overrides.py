"""Command-line overrides such as `long_context.kv_type=INT8`, checked like file values."""

from __future__ import annotations

from collections.abc import Sequence

import yaml

from .errors import ConfigError
from .schema import FieldSpec, Settings, replace_key, schema_fields, sections
from .validate import Invalid, check_rules, coerce, did_you_mean, fail
from .yamltext import parse


def _specs() -> dict[str, tuple[str, FieldSpec]]:
    return {
        f"{name}.{spec.name}": (name, spec)
        for name, cls, _ in sections()
        for spec in schema_fields(cls)
    }


def apply_overrides(settings: Settings, overrides: Sequence[str]) -> Settings:
    """A copy of `settings` with each `SECTION.KEY=VALUE` applied in order.

    VALUE is read as a YAML scalar (`true`, `0.7`, `INT8`), so an override means what
    the same text would mean in the file. Errors name the override, not the file.
    """
    specs = _specs()
    for override in overrides:
        source = f"--set {override}"
        key, sep, raw = override.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(
                f"{source}: expected SECTION.KEY=VALUE, e.g. long_context.kv_type=INT8"
            )
        if key not in specs:
            raise ConfigError(f"{source}: unknown key {key!r}{did_you_mean(key, list(specs))}")
        try:
            value = parse(raw)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or exc
            raise ConfigError(f"{source}: value {raw!r} is not valid YAML ({problem})") from None
        section_name, spec = specs[key]
        try:
            value = coerce(spec, key, value)
        except Invalid as exc:
            fail(source, [exc.problem])
        settings = replace_key(settings, key, value)
    if overrides:
        # Each value was fine alone; a broken cross-field rule is caused by the overrides
        # together, since the settings they started from were already valid.
        check_rules(settings, " ".join(f"--set {o}" for o in overrides))
    return settings
