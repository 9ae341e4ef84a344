"""Text <-> token ids for one model: its tokenizer, its chat template, and a fast path for
texts of up to ~1M tokens.

Encoding runs on the Rust `tokenizers` library directly. transformers is needed only the first
time a GGUF file is seen, to convert the tokenizer in its metadata; that conversion takes
seconds, so its result is cached in the cache folder (tokenizers/).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvchat.config.home import Place, folder_for, private_folder

from .cancel import Cancelled
from .errors import UserError

# Model files are local; transformers must never try to reach a hub while converting a GGUF.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

log = logging.getLogger(__name__)

_CACHE_FORMAT = 1  # bump when the cached entry's layout or the conversion changes
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")

# encode_long cuts the text into pieces of at least this many characters, and hands the
# Rust batch encoder this many pieces per call; between calls it reports progress and
# checks for cancellation (a call is ~256K characters: tens of milliseconds).
_PIECE_CHARS = 8192
_BATCH_PIECES = 32

# Where a text may be cut without changing its ids: after a letter or digit, and before
# either a newline that starts a non-blank line or a space that starts a word.
# Why this is exact for byte-level BPE: BPE merges only inside pre-tokens, so the cut is
# exact when no pre-token spans it and the pre-tokens on each side do not depend on the
# other side. The GPT-2 pattern SmolLM2 uses ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
# ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) and the Llama-3/Qwen2 patterns end a letter or digit run
# right there; a newline followed by a non-space is then a pre-token of its own (no
# alternative but \s+ can take it and (?!\S) leaves it alone), and a space followed by a
# letter or digit starts the next pre-token in the whole text and in the piece alike. The
# only look-ahead in these patterns, (?!\S), sits on whitespace runs, which never end at a
# cut. Python's [^\W_] is a subset of [\p{L}\p{N}] and its \s a superset of the patterns'
# \s, so where Python and the Rust regex disagree, this errs on the side of not cutting.
# Other pre-tokenizers (e.g. SentencePiece's "prepend a space") are caught by a probe at
# first use and then encoded whole.
_BOUNDARY = re.compile(r"(?<=[^\W_])(?=\n\S| [^\W_])")

# Text for that probe: every kind of boundary next to prose, code, numbers, contractions,
# CJK, accents, emoji, tabs, CRLF, runs of spaces and blank lines, special-token strings.
_PROBE = (
    "The lighthouse was built in 1871\nIt stood 38 metres tall. Don't stop\n'til dawn\n"
    "x = 12345 67890\ny = f(x)\n    return y\nprint(y)  # done\n\nNext paragraph\n-- list\n"
    "caf\u00e9 na\u00efve \u00fcber\nSt\u00e4dte 2024\n\u6f22\u5b57 \u304b\u306a\n\u4e2d\u6587 "
    "\u6587\u5b57\nemoji \U0001f680 rocket\n\U0001f600 face 42\ttab\r\nline\r\n\r\nend\n"
    "it's we're I'll\nthey've\n<|im_start|>user\nhi<|im_end|>\nok 3.14\n1e9\nA\nB C\n"
)


class TokenizerError(UserError, ValueError):
    """The tokenizer or its chat template cannot be loaded or used; the message says why."""


class TooManyTokensError(ValueError):
    """encode_long passed its stop_after: `tokens` ids from `done` of `total` characters."""

    def __init__(self, tokens: int, done: int, total: int) -> None:
        super().__init__(f"{tokens:,} tokens in the first {done:,} of {total:,} characters")
        self.tokens, self.done, self.total = tokens, done, total


@dataclass(frozen=True)
class _TokenizerParts:
    """Everything a Tokenizer is built from; also what the GGUF cache stores."""

    tokenizer_json: str
    chat_template: str | None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token...
    extra_eos_ids: tuple[int, ...] = ()  # e.g. from an HF folder's generation_config.json


class StreamDecoder:
    """Incremental detokenisation: push ids one at a time, get the new text.

    Text is decoded over a short window of recent ids rather than id by id, because one
    character can span several byte-level tokens (emoji, CJK) and some decoders treat the
    first token of a string differently. While the window ends inside a character the
    decoded text ends with U+FFFD, and nothing is returned until the character completes.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tok = tokenizer
        self._window: list[int] = []  # ids already shown as context, then ids held back
        self._shown = 0  # how many ids at the start of the window have been returned as text

    def push(self, token_id: int) -> str:
        self._window.append(token_id)
        shown_text = self._decode(self._window[: self._shown])
        text = self._decode(self._window)
        if text.endswith("\ufffd"):
            return ""
        # The ids just completed become the context for the next character.
        del self._window[: self._shown]
        self._shown = len(self._window)
        return text[len(shown_text) :]

    def flush(self) -> str:
        """What is still held back when a stream ends (a cut-off character becomes U+FFFD)."""
        text = self._decode(self._window)[len(self._decode(self._window[: self._shown])) :]
        self._window.clear()
        self._shown = 0
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    some templates; transformers understands it, so rendering must not fail on it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _compile_template(source: str) -> jinja2.Template:
    # The same environment transformers' apply_chat_template uses, so the same text comes out.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _split_pieces(text: str, piece_chars: int) -> list[str]:
    """Cut `text` at _BOUNDARY positions into pieces of at least `piece_chars` characters
    (the last may be shorter; a stretch without boundaries stays in one piece)."""
    pieces = []
    start = 0
    while len(text) - start > piece_chars:
        cut = _BOUNDARY.search(text, start + piece_chars)
        if cut is None:
            break
        pieces.append(text[start : cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


class Tokenizer:
    """One model's tokenizer and chat template. Thread-safe for encoding and decoding."""

    def __init__(self, parts: _TokenizerParts, name: str) -> None:
        try:
            self._tok = tokenizers.Tokenizer.from_str(parts.tokenizer_json)
        except Exception as e:
            raise TokenizerError(f"{name}: the tokenizer cannot be read ({e})") from e
        # Some tokenizer.json files enable truncation (e.g. to 512); a document must never be cut.
        self._tok.no_truncation()
        self._tok.no_padding()
        self._text_tok = _plain_text_tokenizer(parts.tokenizer_json)
        # Strings a message's text must not carry into the template: every added token's
        # text (it would encode to the control token), and NUL and \x01, which open and close
        # kvchat's own slots (so typed text can neither forge a slot nor the document's).
        added_texts = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        self._literals = sorted(added_texts | {"\0", "\1"}, key=len, reverse=True)
        self._literal_index = {text: i for i, text in enumerate(self._literals)}
        self._literal_re = re.compile("|".join(map(re.escape, self._literals)))
        self.name = name
        self.chat_template = parts.chat_template
        self._special_tokens = parts.special_tokens
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self._added_ids = frozenset(self._tok.get_added_tokens_decoder())

        # bos_id is what the tokenizer itself puts before a plain text, so completion mode can
        # do the same; SmolLM2 puts nothing (its <|im_start|> belongs to the chat template).
        plain = self._text_tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        self.bos_id: int | None = full[0] if full[:1] != plain[:1] else None

        eos = [
            self._tok.token_to_id(parts.special_tokens.get("eos_token", "")),
            self._end_of_turn_id(),
            *parts.extra_eos_ids,
        ]
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as plain text: nothing added, and special-token strings in it
        ("<|im_start|>") encode as the characters they are, never as control tokens."""
        return self._text_tok.encode(text, add_special_tokens=False).ids

    def shield(self, text: str) -> str:
        """`text` with every special-token string (and NUL, \\x01) replaced by a slot that
        encode_chat encodes as plain text: a message's text cannot open or close a turn."""
        return self._literal_re.sub(
            lambda m: f"\0kvchat-literal-{self._literal_index[m.group()]}\1", text
        )

    def encode_chat(self, text: str) -> list[int]:
        """Ids of rendered chat text: the template's own markers become control tokens, the
        slots `shield` left become the plain text they stand for."""
        ids: list[int] = []
        start = 0
        for slot in _LITERAL_SLOT.finditer(text):
            ids += self._tok.encode(text[start : slot.start()], add_special_tokens=False).ids
            ids += self.encode(self._literals[int(slot.group(1))])
            start = slot.end()
        return ids + self._tok.encode(text[start:], add_special_tokens=False).ids

    def encode_long(
        self,
        text: str,
        on_progress: Callable[[int, int], None] | None = None,
        cancel: threading.Event | None = None,
        stop_after: int | None = None,
    ) -> list[int]:
        """encode(text), for texts of up to ~1M tokens: cut into pieces at boundaries that
        cannot change the ids, encoded in parallel by the Rust batch encoder.

        Reports (characters done, characters in all) after each batch, raises Cancelled at
        the next batch once `cancel` is set, and TooManyTokensError at the first batch that
        takes the ids past `stop_after` with text still to go (a whole text is returned, so
        the caller can say exactly how long it is).
        """
        total = len(text)
        pieces = _split_pieces(text, _PIECE_CHARS) if self._splits_exactly else [text]
        ids: list[int] = []
        done = 0
        for first in range(0, len(pieces), _BATCH_PIECES):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"tokenizing cancelled after {done:,} of {total:,} characters")
            batch = pieces[first : first + _BATCH_PIECES]
            for encoding in self._text_tok.encode_batch_fast(batch, add_special_tokens=False):
                ids.extend(encoding.ids)
            done += sum(map(len, batch))
            if on_progress is not None:
                on_progress(done, total)
            if stop_after is not None and len(ids) > stop_after and done < total:
                raise TooManyTokensError(len(ids), done, total)
        return ids

    def fewest_tokens(self, n_bytes: int) -> int:
        """A lower bound on the tokens of any UTF-8 text of `n_bytes`."""
        return n_bytes // self.bytes_per_token_bound

    @cached_property
    def bytes_per_token_bound(self) -> int:
        """More bytes of text than any one token spells: the vocabulary's longest entry in
        UTF-8 (byte-level vocabularies spell a byte in up to 2), with a 4x margin for
        normalizers that shorten text."""
        vocab = self._text_tok.get_vocab(with_added_tokens=False)
        return 4 * max(len(token.encode()) for token in vocab)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self._tok)

    def chat_text(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """`messages` rendered with the model's own chat template, as given: pass their
        contents through `shield` first, and encode the result with `encode_chat`."""
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.name} has no chat template, so it cannot chat; use completion mode instead"
            )
        try:
            # tools/documents are passed as None, as transformers does: a template testing
            # `tools is not none` must not see jinja's Undefined.
            return self._template.render(
                messages=list(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except Exception as e:  # the template is foreign code: any failure is its failure
            raise TokenizerError(f"{self.name}: the chat template failed: {e}") from e

    def chat_ids(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of `messages` rendered with the model's chat template (ends with the assistant
        prompt when `add_generation_prompt`); their contents are plain text."""
        shielded = [{**m, "content": self.shield(m["content"])} for m in messages]
        return self.encode_chat(self.chat_text(shielded, add_generation_prompt))

    @cached_property
    def _template(self) -> jinja2.Template:
        assert self.chat_template is not None
        try:
            return _compile_template(self.chat_template)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.name}: the chat template is not valid jinja: {e}") from e

    @cached_property
    def _splits_exactly(self) -> bool:
        """Whether cutting at _BOUNDARY keeps the ids of this tokenizer unchanged."""
        pieces = _split_pieces(_PROBE, 1)  # a cut at every boundary
        cut = self._text_tok.encode_batch_fast(pieces, add_special_tokens=False)
        return [i for encoding in cut for i in encoding.ids] == self.encode(_PROBE)

    def _end_of_turn_id(self) -> int | None:
        """The token the template closes an assistant turn with (<|im_end|>, <|eot_id|>...):
        a reply ends there even when it differs from the eos token."""
        marker = "kvchat-end-of-turn-probe"
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}]
        try:
            text = self.chat_text(messages, add_generation_prompt=False)
        except TokenizerError:
            return None
        _, found, after = text.partition(marker)
        ids = self.encode_chat(after) if found else []
        return ids[0] if ids and ids[0] in self._added_ids else None


_LITERAL_SLOT = re.compile("\0kvchat-literal-(\\d+)\1")


def _plain_text_tokenizer(tokenizer_json: str) -> tokenizers.Tokenizer:
    """The tokenizer with its added tokens left unmatched: the text "<|im_end|>" encodes to
    the pieces of its characters, as any other text. The library skips only tokens marked
    special, so every added token is marked special first."""
    data = json.loads(tokenizer_json)
    for token in data.get("added_tokens") or []:
        token["special"] = True
    plain = tokenizers.Tokenizer.from_str(json.dumps(data))
    plain.encode_special_tokens = True
    plain.no_truncation()
    plain.no_padding()
    return plain


def load_tokenizer(source: Path) -> Tokenizer:
    """The tokenizer of a .gguf file (from its metadata) or of an HF model folder
    (tokenizer.json, plus tokenizer_config.json / chat_template.jinja for the template)."""
    source = Path(source).expanduser()
    if source.is_dir():
        return Tokenizer(_read_hf_folder(source), source.name)
    if source.is_file():
        return Tokenizer(_read_gguf_cached(source), source.name)
    raise TokenizerError(f"{source}: no such file or folder")


def _read_hf_folder(folder: Path) -> _TokenizerParts:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerError(
            f"{folder}: no tokenizer.json in this folder (kvchat needs the fast-tokenizer file)"
        )
    config = _read_json(folder / "tokenizer_config.json")
    special = {**_read_json(folder / "special_tokens_map.json"), **config}
    special_tokens = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = special.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special_tokens[key] = value
    eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    extra_eos = tuple(i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int))
    return _TokenizerParts(
        tokenizer_json=_read_text(tokenizer_file),
        chat_template=_hf_chat_template(folder, config),
        special_tokens=special_tokens,
        extra_eos_ids=extra_eos,
    )


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    # transformers' own order: a separate chat_template.jinja / .json wins over the config.
    if (folder / "chat_template.jinja").is_file():
        return _read_text(folder / "chat_template.jinja")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the chat one is called "default"
        named = [t for t in template if isinstance(t, dict) and t.get("name") == "default"]
        template = named[0].get("template") if named else None
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot be read ({e})") from e


def _read_gguf_cached(path: Path) -> _TokenizerParts:
    """The GGUF's tokenizer from this process's memory, else from the cache on disk, else
    converted (~10 s for a 49K-token vocabulary: transformers reads the file's fields one by
    one) and cached in both. Memory keeps it for a model loaded again, after a switch or
    with another data folder."""
    stat = path.stat()
    return _gguf_parts(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4)
def _gguf_parts(path: Path, size: int, mtime_ns: int) -> _TokenizerParts:
    """`path`'s tokenizer, read while the file has this size and time (the cache's key)."""
    cache_file = _cache_file(path)
    try:
        entry = json.loads(cache_file.read_text(encoding="utf-8"))
        parts = _TokenizerParts(
            tokenizer_json=entry["tokenizer_json"],
            chat_template=entry["chat_template"],
            special_tokens=entry["special_tokens"],
        )
        if isinstance(parts.tokenizer_json, str) and isinstance(parts.special_tokens, dict):
            return parts
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not cached yet, or a damaged entry: convert again
    parts = _read_gguf(path)
    _write_atomically(
        cache_file,
        json.dumps(
            {
                "tokenizer_json": parts.tokenizer_json,
                "chat_template": parts.chat_template,
                "special_tokens": parts.special_tokens,
            }
        ),
    )
    return parts


def _cache_file(path: Path) -> Path:
    stat = path.stat()
    key = f"{_CACHE_FORMAT}\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return folder_for(Place.CACHE) / "tokenizers" / f"{digest}.json"


def _read_gguf(path: Path) -> _TokenizerParts:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise TokenizerError(f"{path}: cannot be read ({e})") from e
    if magic != b"GGUF":
        raise TokenizerError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    from .gguf_header import read_gguf_header
    from .weights import WeightsError

    try:
        read_gguf_header(path)  # before transformers' GGUF reader trusts the header's counts
    except WeightsError as e:
        raise TokenizerError(str(e)) from e
    from transformers import AutoTokenizer  # slow import, needed only on a cache miss

    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer_json = hf.backend_tokenizer.to_str()
    except Exception as e:
        raise TokenizerError(f"{path}: no usable tokenizer in this GGUF file ({e})") from e
    template = hf.chat_template
    if isinstance(template, dict):  # named templates: the chat one is called "default"
        template = template.get("default")
    return _TokenizerParts(
        tokenizer_json=tokenizer_json,
        chat_template=template if isinstance(template, str) else None,
        special_tokens={k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)},
    )


def _write_atomically(path: Path, text: str) -> None:
    """Best effort: a cache that cannot be written only costs the next load a few seconds.
    The folders made are 0700 and the file 0600 (NamedTemporaryFile's mode): the cache
    names the models the user runs."""
    tmp: str | None = None
    try:
        private_folder(path.parent)
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=path.parent, suffix=".tmp", delete=False
        ) as f:
            tmp = f.name
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot cache the tokenizer at %s: %s", path, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
