"""kvchat settings: the typed schema, the packaged default YAML, and load / merge /
validate / save of the user's file ($KVCHAT_HOME/config.yaml, default ~/.kvchat)."""

from .errors import ConfigError
from .overrides import apply_overrides
from .schema import (
    FieldSpec,
    GenerationSettings,
    LongContextSettings,
    ModelSettings,
    Settings,
    UISettings,
    schema_fields,
)
from .store import (
    LoadedSettings,
    default_config_path,
    kvchat_home,
    load_settings,
    save_settings,
)
from .validate import validate_settings
from .yamltext import settings_to_yaml

__all__ = [
    "ConfigError",
    "FieldSpec",
    "GenerationSettings",
    "LoadedSettings",
    "LongContextSettings",
    "ModelSettings",
    "Settings",
    "UISettings",
    "apply_overrides",
    "default_config_path",
    "kvchat_home",
    "load_settings",
    "save_settings",
    "schema_fields",
    "settings_to_yaml",
    "validate_settings",
]
