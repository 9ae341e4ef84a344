"""kvchat settings: the typed schema, the packaged default YAML, and load / merge /
validate / save of the user's file (config.yaml in the config folder, see home.py)."""

from .docs import settings_markdown
from .enums import (
    WHOLE_BLOCK_ANCHOR_TYPES,
    AnchorType,
    AttentionMode,
    HeadSelectMode,
    KvType,
    ModelDevice,
    ModelDtype,
    PositionMode,
    Theme,
)
from .errors import ConfigError
from .home import kvchat_home
from .overrides import apply_overrides
from .schema import (
    CacheSettings,
    FieldSpec,
    GenerationSettings,
    KeySettings,
    LongContextSettings,
    ModelSettings,
    Settings,
    UISettings,
    changed_keys,
    replace_key,
    schema_fields,
)
from .store import (
    LoadedSettings,
    default_config_path,
    load_settings,
    reset_values,
    save_changes,
    save_settings,
    set_values,
)
from .validate import validate_settings
from .yamltext import settings_file_text, settings_to_yaml

__all__ = [
    "WHOLE_BLOCK_ANCHOR_TYPES",
    "AnchorType",
    "AttentionMode",
    "CacheSettings",
    "ConfigError",
    "FieldSpec",
    "GenerationSettings",
    "HeadSelectMode",
    "KeySettings",
    "KvType",
    "LoadedSettings",
    "LongContextSettings",
    "ModelDevice",
    "ModelDtype",
    "ModelSettings",
    "PositionMode",
    "Settings",
    "Theme",
    "UISettings",
    "apply_overrides",
    "changed_keys",
    "default_config_path",
    "kvchat_home",
    "load_settings",
    "replace_key",
    "reset_values",
    "save_changes",
    "save_settings",
    "schema_fields",
    "set_values",
    "settings_markdown",
    "settings_file_text",
    "settings_to_yaml",
    "validate_settings",
]
