"""The user's settings file: where it lives, first-run creation, load + merge, atomic save."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .overrides import apply_overrides
from .schema import Settings, changed_keys, replace_key, schema_fields, sections
from .validate import Problem, build_settings, did_you_mean, fail, kind, validate_settings
from .yamltext import edit_values, parse, settings_to_yaml


def kvchat_home() -> Path:
    """$KVCHAT_HOME, or ~/.kvchat when it is unset or empty."""
    value = os.environ.get("KVCHAT_HOME")
    return Path(value).expanduser() if value else Path.home() / ".kvchat"


def default_config_path() -> Path:
    return kvchat_home() / "config.yaml"


def default_yaml() -> str:
    """The packaged default settings file, comments included."""
    return resources.files(__package__).joinpath("default.yaml").read_text(encoding="utf-8")


@dataclass(frozen=True)
class LoadedSettings:
    settings: Settings
    path: Path
    warnings: list[str]
    created: bool


def load_settings(
    path: Path | None = None, overrides: Sequence[str] = (), create: bool = True
) -> LoadedSettings:
    """Read the settings file, fill in defaults for missing keys, validate, apply overrides.

    A missing file is created from the packaged default when `create` is true (and
    reported as a warning when it cannot be). Unknown keys become warnings; anything
    invalid raises ConfigError.
    """
    path = Path(path) if path is not None else default_config_path()
    warnings: list[str] = []
    created = False
    text = _read(path)
    if text is None:
        text = default_yaml()
        if not create:
            warnings.append(f"{path}: not found; using the built-in defaults")
        else:
            try:
                atomic_write_text(path, text)
                created = True
            except OSError as exc:
                warnings.append(f"{path}: could not create it ({exc}); using the built-in defaults")
    settings = settings_from_text(text, str(path), warnings)
    settings = apply_overrides(settings, overrides)
    return LoadedSettings(settings=settings, path=path, warnings=warnings, created=created)


def _read(path: Path) -> str | None:
    """The file's text, or None when there is no file yet."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the settings file ({exc})") from None


def settings_from_text(text: str, source: str, warnings: list[str]) -> Settings:
    """Parse and validate settings YAML; unknown sections and keys are appended to
    `warnings` and otherwise ignored, so a file from a newer kvchat still loads."""
    try:
        data: Any = parse(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or exc
        raise ConfigError(f"{source}: {where}not valid YAML ({problem})") from None
    known = {name: cls for name, cls, _ in sections()}
    if data is None:  # an empty file, or one with only comments
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping with the sections {', '.join(known)} at the top "
            f"level (got {kind(data)})"
        )
    picked: dict[str, dict[str, Any]] = {}
    for name, given in data.items():
        if name not in known:
            hint = did_you_mean(str(name), list(known))
            warnings.append(f"{source}: unknown section {name} ignored{hint}")
            continue
        if given is None:  # `model:` with every key commented out
            given = {}
        if not isinstance(given, dict):
            fail(source, [Problem(name, given, f"a mapping of {name} settings", got=kind(given))])
        names = [spec.name for spec in schema_fields(known[name])]
        for key in given:
            if key not in names:
                hint = did_you_mean(str(key), names)
                warnings.append(f"{source}: unknown key {name}.{key} ignored{hint}")
        picked[name] = {key: value for key, value in given.items() if key in names}
    return build_settings(picked, source)


def save_settings(settings: Settings, path: Path) -> None:
    """Validate and write `settings` to `path` atomically.

    An existing file keeps its comments, layout and unknown keys: only the values
    change. A file the line editor cannot handle is re-rendered from the commented
    template instead.
    """
    path = Path(path)
    validate_settings(settings, str(path))
    text = None
    if path.is_file():
        with contextlib.suppress(UnicodeDecodeError):
            text = edit_values(path.read_text(encoding="utf-8"), settings)
    atomic_write_text(path, text or settings_to_yaml(settings))


def save_changes(path: Path, old: Settings, new: Settings) -> None:
    """Write the keys that differ between `old` and `new` into the file at `path`.

    The file's other values stay as they are, so values this run took from `--set`
    overrides (in `old` and `new` alike) are not written. Raises ConfigError when the
    file with the changes breaks a rule; the file is then left untouched.
    """
    settings = load_settings(path).settings
    for key in changed_keys(old, new):
        section_name, name = key.split(".")
        settings = replace_key(settings, key, getattr(getattr(new, section_name), name))
    save_settings(settings, path)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so a reader sees the old file or the new one, never a
    mix, even after a crash: temp file in the same directory, fsync, os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; keep the mode the user gave the file, else the usual 0644.
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable. Best effort: not every OS or filesystem allows
    # opening or syncing a directory, and the new file is already in place.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
