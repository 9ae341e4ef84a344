"""The shape of a decoder model, independent of the file format it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UserError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


class UnsupportedModelError(UserError, ValueError):
    """The file describes a model kvchat cannot run (architecture, rope type, missing keys)."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, with transformers' names and defaults.

    `original_max_position_embeddings` is the context the base model was trained on;
    None means the model's `max_position_embeddings`.
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(ROPE_TYPES)}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads are not a multiple of "
                f"{self.num_kv_heads} key/value heads"
            )

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def trained_context(self) -> int:
        """Positions the model can attend over without extrapolating (after rope scaling)."""
        rs = self.rope_scaling
        if rs.rope_type in ("default", "dynamic"):
            return self.max_position_embeddings
        base = rs.original_max_position_embeddings or self.max_position_embeddings
        return max(self.max_position_embeddings, int(base * rs.factor))
