"""The user's settings file: where it lives, first-run creation, load + merge, atomic save."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .home import Place, folder_for, private_folder
from .overrides import apply_overrides
from .schema import Settings, changed_keys, replace_key, schema_fields, sections, value_of
from .upgrade import is_whole_file, mark_upgraded, upgrade
from .validate import Problem, build_settings, did_you_mean, fail, kind, validate_settings
from .yamltext import edit_values, parse, settings_file_text

# The model every command loads unless --model names one, over the settings file's; for a
# shell (or a test suite) that works with another model than the settings name.
MODEL_ENV = "KVCHAT_MODEL"


def env_overrides() -> list[str]:
    """The overrides the environment sets: model.path from $KVCHAT_MODEL when it is not empty."""
    model = os.environ.get(MODEL_ENV)
    return [f"model.path={model}"] if model else []


def default_config_path() -> Path:
    return folder_for(Place.CONFIG) / "config.yaml"


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
    path: Path | None = None,
    overrides: Sequence[str] = (),
    create: bool = True,
    environment: bool = True,
) -> LoadedSettings:
    """Read the settings file, fill in defaults for missing keys, validate, apply overrides.

    When `create` is true, a missing file is created from the packaged default (reported
    as a warning when it cannot be), and a file written whole by an earlier kvchat is
    upgraded once (config/upgrade.py, reported as a warning). With `environment`,
    $KVCHAT_MODEL applies before `overrides`, so a `--set model.path=...` still wins; saves
    read the file without it, so it never reaches the file. Unknown keys become warnings;
    anything invalid raises ConfigError.
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
                with _save_lock(path):
                    # Another kvchat may have saved its settings there since the read.
                    if not path.exists():
                        atomic_write_text(path, text)
                        created = True
            except OSError as exc:
                warnings.append(f"{path}: could not create it ({exc}); using the built-in defaults")
    settings = settings_from_text(text, str(path), warnings)
    if create and not created and is_whole_file(text):
        settings = _upgrade(path, warnings)
    settings = apply_overrides(settings, [*(env_overrides() if environment else ()), *overrides])
    return LoadedSettings(settings=settings, path=path, warnings=warnings, created=created)


def _upgrade(path: Path, warnings: list[str]) -> Settings:
    """Upgrade the whole file at `path` (config/upgrade.py); the settings it gives after."""
    with _save_lock(path):
        text = _read(path) or ""  # read again: another kvchat may have upgraded it
        settings = settings_from_text(text, str(path), [])
        if not is_whole_file(text):
            return settings
        upgraded = upgrade(text, settings)
        if upgraded is not None and _holds(upgraded[0], upgraded[1]):
            text, settings, changes = upgraded
            note = f"; now {', '.join(changes)}" if changes else ""
            message = (
                f"{path}: the keys at their defaults are now commented out, so kvchat's "
                f"defaults reach you{note}"
            )
        else:  # marked, so that this is said once
            text = mark_upgraded(text)
            message = (
                f"{path}: its layout cannot be edited line by line, so its keys stay as "
                "written and new defaults do not reach them; delete the keys you did not set"
            )
        try:
            atomic_write_text(path, text)
        except OSError as exc:
            warnings.append(f"{path}: could not upgrade it ({exc})")
            return settings_from_text(_read(path) or "", str(path), [])
    warnings.append(message)
    return settings


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

    An existing file keeps its comments, layout and unknown keys: only the lines of keys
    whose values change are rewritten, and a key changed to its default is commented out.
    A file that does not load, or that the line editor cannot handle, is rendered afresh.
    """
    path = Path(path)
    validate_settings(settings, str(path))
    with _save_lock(path):
        keys = None
        if path.is_file():
            with contextlib.suppress(ConfigError):
                keys = changed_keys(_file_settings(path), settings)
        _write_settings(settings, path, keys)


def save_changes(path: Path, old: Settings, new: Settings) -> None:
    """Write the keys that differ between `old` and `new` into the file at `path`.

    The file's other values stay as they are, so values this run took from `--set`
    overrides (in `old` and `new` alike) are not written, and neither are another kvchat's
    settings saved since this one loaded the file. Raises ConfigError when the file with
    the changes breaks a rule; the file is then left untouched.
    """
    path = Path(path)
    with _save_lock(path):
        settings = _file_settings(path)
        keys = changed_keys(old, new)
        for key in keys:
            settings = replace_key(settings, key, value_of(new, key))
        validate_settings(settings, str(path))
        _write_settings(settings, path, keys)


@contextlib.contextmanager
def _save_lock(path: Path) -> Iterator[None]:
    """Hold the flock of the lock file beside `path` (waiting for another holder) while the
    block reads, changes and writes the settings file: two kvchat processes saving at once
    then never write a file that lacks the other's change. The kernel drops the lock when
    the process ends, however it ends."""
    private_folder(path.parent)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing it releases the lock


def _file_settings(path: Path) -> Settings:
    """The settings the file at `path` holds, as a save must keep them: no environment.
    create=False: the caller holds the lock load_settings takes to create a file."""
    return load_settings(path, create=False, environment=False).settings


def _write_settings(settings: Settings, path: Path, keys: Sequence[str] | None = None) -> None:
    """Write `settings` to `path`, editing the lines of `keys` (every key when None) in the
    file there when the editor can and the result holds exactly `settings`."""
    text = None
    if path.is_file():
        with contextlib.suppress(UnicodeDecodeError):
            text = edit_values(path.read_text(encoding="utf-8"), settings, keys)
    if text is None or not _holds(text, settings):
        text = settings_file_text(settings)
    atomic_write_text(path, text)


def _holds(text: str, settings: Settings) -> bool:
    """Whether `text` reads back as exactly `settings`."""
    try:
        return settings_from_text(text, "", []) == settings
    except ConfigError:
        return False


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so a reader sees the old file or the new one, never a
    mix, even after a crash: temp file in the same directory, fsync, os.replace.

    A new file is 0600 whatever the umask (settings and exports are the user's alone); a
    file that exists keeps the mode the user gave it. Missing folders are made private.
    """
    private_folder(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            # mkstemp creates the file 0600, the mode a new file keeps.
            if path.exists():
                os.fchmod(f.fileno(), stat.S_IMODE(path.stat().st_mode))
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
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


def set_values(path: Path, assignments: Sequence[str]) -> list[tuple[str, Any, Any]]:
    """Set `SECTION.KEY=VALUE` assignments (read as `--set` reads them) in the file at `path`;
    returns (key, old, new) for each value that changed."""
    if not assignments:
        raise ConfigError("nothing to set: give SECTION.KEY=VALUE, e.g. long_context.kv_type=INT8")
    old = load_settings(path, environment=False).settings
    return _save_edit(path, old, apply_overrides(old, assignments))


def reset_values(path: Path, keys: Sequence[str] = ()) -> list[tuple[str, Any, Any]]:
    """Put `keys` (every key when none are given) back to their defaults in the file at
    `path`; returns (key, old, new) for each value that changed."""
    every = [f"{name}.{spec.name}" for name, cls, _ in sections() for spec in schema_fields(cls)]
    for key in keys:
        if key not in every:
            raise ConfigError(f"unknown key {key!r}{did_you_mean(key, every)}")
    old, defaults = load_settings(path, environment=False).settings, Settings()
    new = old
    for key in keys or every:
        new = replace_key(new, key, value_of(defaults, key))
    return _save_edit(path, old, new)


def _save_edit(path: Path, old: Settings, new: Settings) -> list[tuple[str, Any, Any]]:
    changes = [(key, value_of(old, key), value_of(new, key)) for key in changed_keys(old, new)]
    if changes:
        save_changes(path, old, new)
    return changes
