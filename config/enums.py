"""The values of the enumerated settings, declared once.

Each is a StrEnum: a member equals (and hashes like) its string, so it compares with the
text of a YAML file or a `--set` override, formats as that text in messages, and is written
back to YAML as the plain string. The schema takes each setting's allowed values from its
enum, and loading converts the strings it reads to members.
"""

from __future__ import annotations

from enum import StrEnum


class ModelDtype(StrEnum):
    """model.dtype: the activation and KV cache dtype."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class ModelDevice(StrEnum):
    """model.device: where the model computes."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class AnchorType(StrEnum):
    """long_context.anchor_type: how a block's anchors (representative keys) are made."""

    DYNAMIC = "DYNAMIC"
    FIXED = "FIXED"
    BLOCK_MEAN = "BLOCK_MEAN"
    BLOCK_MAX = "BLOCK_MAX"
    QUEST = "QUEST"


# Anchor types that summarise a block in one vector (or one min/max pair), so a block has
# exactly one anchor of them and anchor_num must be 1.
WHOLE_BLOCK_ANCHOR_TYPES = frozenset(
    {AnchorType.BLOCK_MEAN, AnchorType.BLOCK_MAX, AnchorType.QUEST}
)


class KvType(StrEnum):
    """long_context.kv_type: the storage format of the KV blocks in DRAM."""

    FP16 = "FP16"
    INT8 = "INT8"
    INT4 = "INT4"


class HeadSelectMode(StrEnum):
    """long_context.head_select_mode: whether the KV heads of a layer select blocks together."""

    SHARED = "SHARED"
    SEPARATE = "SEPARATE"


class AttentionMode(StrEnum):
    """long_context.attention: block-sparse attention, or attention to every cached token."""

    DENSE = "dense"
    SPARSE = "sparse"


class PositionMode(StrEnum):
    """long_context.position_mode: the positions of keys past the trained context.

    A cache runs in NATIVE or EXTRAPOLATE; AUTO is a setting only, resolved per session.
    """

    AUTO = "auto"
    NATIVE = "native"
    EXTRAPOLATE = "extrapolate"


class Theme(StrEnum):
    """ui.theme: the colour theme of the app: dark or light (Textual's own), or any theme
    Textual ships (its command palette's "Change theme" lists them)."""

    DARK = "dark"
    LIGHT = "light"
    ANSI_DARK = "ansi-dark"
    ANSI_LIGHT = "ansi-light"
    ATOM_ONE_DARK = "atom-one-dark"
    ATOM_ONE_LIGHT = "atom-one-light"
    CATPPUCCIN_FRAPPE = "catppuccin-frappe"
    CATPPUCCIN_LATTE = "catppuccin-latte"
    CATPPUCCIN_MACCHIATO = "catppuccin-macchiato"
    CATPPUCCIN_MOCHA = "catppuccin-mocha"
    DRACULA = "dracula"
    FLEXOKI = "flexoki"
    GRUVBOX = "gruvbox"
    MONOKAI = "monokai"
    NORD = "nord"
    ROSE_PINE = "rose-pine"
    ROSE_PINE_DAWN = "rose-pine-dawn"
    ROSE_PINE_MOON = "rose-pine-moon"
    SOLARIZED_DARK = "solarized-dark"
    SOLARIZED_LIGHT = "solarized-light"
    TOKYO_NIGHT = "tokyo-night"

    @property
    def textual_name(self) -> str:
        """The name Textual knows the theme by."""
        return {Theme.DARK: "textual-dark", Theme.LIGHT: "textual-light"}.get(self, self.value)

    @classmethod
    def from_textual(cls, name: str) -> Theme | None:
        """The setting for Textual's theme `name`; None for a theme kvchat does not list."""
        for theme in cls:
            if theme.textual_name == name:
                return theme
        return None
