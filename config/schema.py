"""The settings schema: frozen dataclasses whose field metadata drives validation, the
commented YAML and any generated settings screen.

Each setting is declared once, with `setting(...)`; its Python annotation is its type
and its metadata holds the help text and the range. An enumerated setting is annotated
with its StrEnum (config/enums.py), whose members are its allowed values. Nothing else in
the package names an individual key except the cross-field rules in validate.py.
"""

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .enums import (
    AnchorType,
    AttentionMode,
    HeadSelectMode,
    KvType,
    ModelDevice,
    ModelDtype,
    PositionMode,
    Theme,
)


def setting(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    multiple_of: int | None = None,
) -> Any:
    """A dataclass field carrying its help text and range (an enum-typed field's allowed
    values are its enum's members)."""
    meta = {"help": help, "min": min, "max": max, "multiple_of": multiple_of}
    return field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    """A Settings field holding one section, with the section's help text."""
    return field(default_factory=cls, metadata={"help": help})


@dataclass(frozen=True)
class FieldSpec:
    """One setting as a settings UI or the validator sees it."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[StrEnum, ...] | None = None  # the members of `type` when it is a StrEnum
    min: float | None = None
    max: float | None = None
    multiple_of: int | None = None

    def allowed(self) -> str:
        """What values are accepted, in words (used in messages and YAML comments)."""
        if self.type is bool:
            return "true or false"
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        if self.type is str:
            return "a string"
        kind = "an integer" if self.type is int else "a number"
        text = f"{kind} from {_num(self.min)} to {_num(self.max)}"
        if self.multiple_of is not None:
            text += f" that is a multiple of {self.multiple_of}"
        return text


def _num(value: float | None) -> str:
    # 30.0 reads better as 30 in a range; 0.01 stays as is.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class ModelSettings:
    path: str = setting(
        "qwen2.5-coder-0.5b",
        "Model to load: the name of a bundled model (qwen2.5-coder-0.5b; qwen2.5-coder-1.5b "
        "answers more questions and reads a document about 2.5x slower; smollm2-135m decodes "
        "2-4x as fast but misses answers the default finds), a path to a .gguf file, a Hugging "
        "Face model folder (config.json + *.safetensors + tokenizer), org/name[:QUANT] from the "
        "Hugging Face cache, or ollama:NAME[:TAG] (`kvchat models` lists what is found). "
        "$KVCHAT_MODEL, when set, takes the place of this value.",
    )
    dtype: ModelDtype = setting(
        ModelDtype.AUTO,
        "Activation and KV cache dtype: bfloat16 for speed and half the memory, float32 for "
        "exact results; auto is bfloat16 on every device (CPUs without bf16 hardware run "
        "the large products in float32 on the widened values).",
    )
    device: ModelDevice = setting(
        ModelDevice.AUTO,
        "Where the model computes: cuda (an NVIDIA GPU), cpu, or auto (cuda when one is "
        "available, else cpu).",
    )
    threads: int = setting(
        0,
        "CPU threads for the model's own computation; 0 = all cores.",
        min=0,
        max=1024,
    )


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = setting(
        512,
        "Most tokens generated for one answer; generation stops earlier at the model's "
        "end-of-turn token.",
        min=1,
        max=1_048_576,
    )
    temperature: float = setting(
        0.0,
        "Sampling temperature: 0 = greedy (always the most likely token, so answers are "
        "repeatable); higher values give more varied answers.",
        min=0.0,
        max=5.0,
    )
    top_p: float = setting(
        1.0,
        "Nucleus sampling: draw only from the most likely tokens whose probabilities add up "
        "to top_p; 1.0 = off. Ignored when temperature is 0.",
        min=0.01,
        max=1.0,
    )
    top_k: int = setting(
        0,
        "Draw only from the top_k most likely tokens; 0 = off. Ignored when temperature is 0.",
        min=0,
        max=1_000_000,
    )
    repetition_penalty: float = setting(
        1.0,
        "Penalty on tokens already in the context, as in Hugging Face transformers; "
        "1.0 = off, higher values discourage repeating.",
        min=1.0,
        max=2.0,
    )
    seed: int = setting(
        0,
        "Seed of the sampler so a sampled answer can be reproduced; -1 = a new random seed "
        "for every answer.",
        min=-1,
        max=2**31 - 1,
    )


@dataclass(frozen=True)
class LongContextSettings:
    chunk_size: int = setting(
        2048,
        "Prefill chunk in tokens: a long prompt goes through the model this many tokens at "
        "a time, which bounds the activation memory of prefill.",
        min=16,
        max=65_536,
    )
    max_seq_len: int = setting(
        131_072,
        "Capacity of the KV cache in tokens (document + conversation); the block store in "
        "DRAM grows up to this, so choose it from the DRAM you have.",
        min=256,
        max=4_194_304,
    )
    block_size: int = setting(
        128,
        "Tokens per KV cache block: the unit that is stored in DRAM, given anchors, scored "
        "and selected.",
        min=32,
        max=4096,
        multiple_of=32,
    )
    local_windows_len: int = setting(
        2048,
        "Local window: the last local_windows_len tokens are always attended to in full and "
        "kept on the compute device; a multiple of block_size.",
        min=128,
        max=1_048_576,
    )
    second_select_num: int = setting(
        16,
        "Blocks each layer selects by anchor score for the current query (from the "
        "preselected blocks when preselect_block is true), on top of sinks and local window.",
        min=0,
        max=1_000_000,
    )
    pinned_blocks: int = setting(
        4,
        "Blocks the end of each prompt (the question) attends to most, found once by exact "
        "attention over every stored key: each, with the block after it, leads every "
        "layer's second_select_num while the answer is written (this finds the passage a "
        "question names in natural text, where anchors alone miss it); the pinned blocks and "
        "those after them take at most half of second_select_num; 0 = off.",
        min=0,
        max=1_000_000,
    )
    threads_num: int = setting(
        0,
        "CPU threads for the block store and for attention over blocks on the host; "
        "0 = model.threads.",
        min=0,
        max=1024,
    )
    anchor_type: AnchorType = setting(
        AnchorType.QUEST,
        "How a block's anchors (representative keys) are made: DYNAMIC = its anchor_num "
        "most-attended keys, FIXED = anchor_num keys at even intervals, BLOCK_MEAN = the mean "
        "key, BLOCK_MAX = the element-wise max key, QUEST = element-wise min and max keys "
        "(the default: the best passkey recall measured, docs/quality.md).",
    )
    kv_type: KvType = setting(
        KvType.FP16,
        "Storage format of the blocks in DRAM: FP16, or INT8 / INT4 quantized per block "
        "(2x / 4x smaller than FP16, slightly less accurate).",
    )
    dense_layer_num: int = setting(
        0,
        "The first dense_layer_num layers attend to every token without block selection "
        "(early layers spread their attention widely); each costs a read of the whole "
        "context per token, so 0 keeps decode speed flat with length.",
        min=0,
        max=1024,
    )
    anchor_num: int = setting(
        1,
        "Anchors per block for DYNAMIC and FIXED; must be 1 for BLOCK_MEAN, BLOCK_MAX and "
        "QUEST, and at most block_size.",
        min=1,
        max=128,
    )
    preselect_block: bool = setting(
        False,
        "After prefill, preselect once the preselect_block_count blocks the end of the "
        "prompt attends to most (as SnapKV does); later selections choose only among them.",
    )
    head_select_mode: HeadSelectMode = setting(
        HeadSelectMode.SHARED,
        "SHARED = all KV heads of a layer select the same blocks (scores summed over heads); "
        "SEPARATE = each KV head selects its own blocks.",
    )
    preselect_block_count: int = setting(
        32,
        "Blocks kept by preselection when preselect_block is true; at least second_select_num.",
        min=1,
        max=1_000_000,
    )
    layer_step: int = setting(
        1,
        "Select blocks anew every layer_step layers; the layers in between reuse the last "
        "selection.",
        min=1,
        max=1024,
    )
    token_step: int = setting(
        1,
        "Select blocks anew every token_step generated tokens; the tokens in between reuse "
        "the last selection.",
        min=1,
        max=1024,
    )
    attention: AttentionMode = setting(
        AttentionMode.SPARSE,
        "sparse = each query attends to the sinks, the local window and the selected blocks "
        "(bounded cost per token, and with position_mode extrapolate the model answers far "
        "past its trained context); dense = to the whole KV cache (exact, slow on long texts).",
    )
    position_mode: PositionMode = setting(
        PositionMode.AUTO,
        "Positions past the trained context: native = true positions (model must be trained "
        "for the length), extrapolate = InfLLM-style fixed distance to retrieved blocks, "
        "auto = the planner picks per session.",
    )


@dataclass(frozen=True)
class UISettings:
    theme: Theme = setting(
        Theme.DARK,
        "Colour theme of the app: dark, light or another theme Textual ships; one chosen with "
        "the command palette's Change theme is saved here.",
    )
    stats_refresh_hz: float = setting(
        4.0,
        "How many times per second the live panels poll the engine statistics.",
        min=0.5,
        max=30.0,
    )
    show_panels: bool = setting(
        True,
        "Show the live panels (device window, DRAM blocks, selection heatmap, tok/s) at start-up.",
    )


@dataclass(frozen=True)
class KeySettings:
    load_file: str = setting("ctrl+o", "Open the file dialog to load a document.")
    stop: str = setting(
        "escape", "Stop the running prefill or reply; the partial reply is kept, marked stopped."
    )
    toggle_panels: str = setting("f2", "Show or hide the live panels.")
    clear_chat: str = setting("ctrl+l", "Clear the chat; the document stays cached.")
    settings: str = setting("f3", "Open the settings screen.")
    help: str = setting("f1", "Show the slash commands and the keys.")
    sessions: str = setting("f4", "Open the saved conversations to resume one.")
    regenerate: str = setting("ctrl+r", "Answer the last question again, in place of its reply.")
    copy_reply: str = setting("ctrl+t", "Copy the last reply to the clipboard.")


@dataclass(frozen=True)
class CacheSettings:
    snapshots: bool = setting(
        True,
        "Save the KV cache of a long document prefill in the cache folder (snapshots/) and "
        "load it, instead of prefilling again, whenever the same model and cache settings meet "
        "a text that starts with the same tokens.",
    )
    snapshot_min_tokens: int = setting(
        16_384,
        "Save a snapshot only after a prefill of at least this many tokens (shorter prefills "
        "are quick to redo).",
        min=1,
        max=4_194_304,
    )
    snapshot_max_gib: float = setting(
        0.0,
        "Disk space the snapshots may take in all, in GiB; the least recently used are deleted "
        "to make room. 0 = half of the disk space they could use (what they take plus what is "
        "free), so a 1M-token snapshot (7-13 GB as INT8 / INT4) fits where the disk has room "
        "and half of the free disk always stays free.",
        min=0.0,
        max=1_000_000.0,
    )


@dataclass(frozen=True)
class Settings:
    model: ModelSettings = section(ModelSettings, "Which model to load and where it runs.")
    generation: GenerationSettings = section(GenerationSettings, "How answers are sampled.")
    long_context: LongContextSettings = section(
        LongContextSettings,
        "The block-sparse KV cache, with KTransformers' long_context keys and meanings.",
    )
    ui: UISettings = section(UISettings, "The terminal app.")
    keys: KeySettings = section(
        KeySettings, "Key bindings in Textual's names (ctrl+o, f2, escape), several with commas."
    )
    cache: CacheSettings = section(
        CacheSettings, "KV snapshots on disk: a long prefill is done once, then loaded."
    )


def schema_fields(section_cls: type) -> list[FieldSpec]:
    """The settings of one section class (e.g. LongContextSettings), in declaration order."""
    return [
        FieldSpec(
            name=f.name,
            type=f.type,
            default=f.default,
            help=f.metadata["help"],
            choices=tuple(f.type) if _is_enum(f.type) else None,
            min=f.metadata["min"],
            max=f.metadata["max"],
            multiple_of=f.metadata["multiple_of"],
        )
        for f in dataclasses.fields(section_cls)
    ]


def _is_enum(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, StrEnum)


def sections() -> list[tuple[str, type, str]]:
    """(name, section class, help) for every section of Settings, in file order."""
    return [(f.name, f.type, f.metadata["help"]) for f in dataclasses.fields(Settings)]


def changed_keys(old: Settings, new: Settings) -> list[str]:
    """The `section.key` names whose values differ between `old` and `new`, in file order."""
    return [
        f"{name}.{spec.name}"
        for name, cls, _ in sections()
        for spec in schema_fields(cls)
        if getattr(getattr(old, name), spec.name) != getattr(getattr(new, name), spec.name)
    ]


def value_of(settings: Settings, key: str) -> Any:
    """The value of `section.key` in `settings`."""
    section_name, name = key.split(".")
    return getattr(getattr(settings, section_name), name)


def replace_key(settings: Settings, key: str, value: Any) -> Settings:
    """A copy of `settings` with `section.key` set to `value` (not validated here)."""
    section_name, name = key.split(".")
    section_value = dataclasses.replace(getattr(settings, section_name), **{name: value})
    return dataclasses.replace(settings, **{section_name: section_value})
