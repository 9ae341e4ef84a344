"""Settings files written whole: earlier kvchat releases wrote every key with its value, so
a default improved later never reached those users. Such a file, known by its first line,
is rewritten once: each key at the current default or at a default of an earlier release
is commented out, so it follows kvchat's defaults from then on; keys set to other values,
comments and unknown keys stay.
"""

from __future__ import annotations

from typing import Any

from .schema import Settings, replace_key, schema_fields, sections, value_of
from .yamltext import HEADER, edit_values, is_default

WHOLE_FILE_HEADER = """\
# kvchat settings. Created from the packaged default on first run; kvchat keeps your
# comments when it saves. A key left out takes its default; an unknown key is reported
# and ignored.
"""

# Defaults of earlier releases that measurements have since replaced.
EARLIER_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "model.path": ("smollm2-135m",),
    "long_context.chunk_size": (4096,),
    "long_context.max_seq_len": (32768,),
    "long_context.local_windows_len": (4096,),
    "long_context.second_select_num": (32,),
    "long_context.dense_layer_num": (2,),
    "long_context.anchor_type": ("DYNAMIC",),
    "long_context.attention": ("dense",),
    "cache.snapshot_max_gib": (20.0,),
}


def is_whole_file(text: str) -> bool:
    return text.startswith(WHOLE_FILE_HEADER)


def mark_upgraded(text: str) -> str:
    """`text` with the header of a file that lists its keys commented out: a file whose
    keys could not be commented out is not tried again."""
    return HEADER + text.removeprefix(WHOLE_FILE_HEADER)


def upgrade(text: str, settings: Settings) -> tuple[str, Settings, list[str]] | None:
    """The file `text` (whose settings are `settings`) with its keys at a current or earlier
    default commented out; the settings it then gives; and a line per value that changes,
    "KEY: OLD -> NEW". None when the line editor cannot handle the file's layout."""
    target, changes = settings, []
    for name, cls, _ in sections():
        for spec in schema_fields(cls):
            key = f"{name}.{spec.name}"
            value = value_of(settings, key)
            if value in EARLIER_DEFAULTS.get(key, ()) and not is_default(name, spec.name, value):
                new = value_of(Settings(), key)
                target = replace_key(target, key, new)
                changes.append(f"{key}: {value} -> {new}")
    edited = edit_values(text, target)
    if edited is None:
        return None
    return mark_upgraded(edited), target, changes
