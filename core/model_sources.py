"""Models already on this machine in other tools' stores: the Hugging Face cache and Ollama's.

Both lookups are offline: they read each store's own layout and never download. A repo id or an
Ollama name becomes the path of a .gguf file or a Hugging Face folder, which the loaders read
like any other. `local_models` lists every source, from GGUF headers and config.json alone.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .gguf_header import read_gguf_header
from .hf_loader import ARCHITECTURES, config_from_hf
from .model_config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from .weights import (
    BUNDLED_MODELS,
    SPLIT_MODELS,
    WeightsError,
    bundled_model_path,
    joined_model_path,
    split_model_parts,
)

OLLAMA_PREFIX = "ollama:"
OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_MAX_JSON_BYTES = 1 << 20  # manifests are under 2 KiB, config.json files a few KiB

# Hugging Face's rules for a repo id (huggingface_hub's validate_repo_id): no "--" or "..".
_HF_PART = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_REPO_SPEC = re.compile(rf"(?P<repo>{_HF_PART}/{_HF_PART})(?::(?P<quant>[A-Za-z0-9_.-]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_OLLAMA_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_OLLAMA_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


class RepoSpec(NamedTuple):
    repo: str  # org/name
    quant: str | None  # picks one of several .gguf files, matched against their names


def parse_repo_spec(spec: str) -> RepoSpec | None:
    """`org/name` or `org/name:QUANT` as a repo id and quant; None for anything else (a missing
    path such as `models/x.gguf` stays a path)."""
    match = _REPO_SPEC.fullmatch(spec)
    if match is None or any(s in match["repo"] for s in ("--", "..")):
        return None
    return None if match["repo"].endswith(".gguf") else RepoSpec(match["repo"], match["quant"])


def hf_cache_dir() -> Path:
    """huggingface_hub's cache folder, with its precedence of variables, read now: its own
    constants are read once, at import."""
    home = os.getenv(
        "HF_HOME", os.path.join(os.getenv("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    )
    cache = os.getenv("HF_HUB_CACHE", os.getenv("HUGGINGFACE_HUB_CACHE", f"{home}/hub"))
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hf_cache_model(ref: RepoSpec) -> Path:
    """The snapshot folder (config.json + safetensors) or the chosen .gguf file of a repo in
    the Hugging Face cache."""
    cache = hf_cache_dir()
    repo_dir = cache / ("models--" + ref.repo.replace("/", "--"))
    if not repo_dir.is_dir():
        raise WeightsError(
            f"{ref.repo!r} is neither an existing path nor a model in the Hugging Face cache "
            f"({cache}); kvchat does not download: `hf download {ref.repo}` fetches it"
        )
    snapshot = _hf_snapshot(repo_dir, ref.repo)
    folder_ok, ggufs = _hf_contents(snapshot)
    if ref.quant is None and folder_ok:
        return snapshot
    if not ggufs:
        also = "" if ref.quant else " and no config.json with safetensors"
        raise WeightsError(
            f"{ref.repo} in the Hugging Face cache holds no .gguf file{also} ({snapshot})"
        )
    if ref.quant is None and len(ggufs) == 1:
        return ggufs[0]
    matches = [p for p in ggufs if ref.quant and ref.quant.upper() in _name_tokens(p)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        names = ", ".join(repr(p.name) for p in matches)
        raise WeightsError(f"{ref.repo}: {len(matches)} .gguf files match {ref.quant!r}: {names}")
    choices = ", ".join(sorted({repr(_quant_label(p)) for p in ggufs}))
    pick = f"none matches {ref.quant!r}" if ref.quant else f"pick one as {ref.repo}:QUANT"
    raise WeightsError(f"{ref.repo} holds {len(ggufs)} .gguf files; {pick}, QUANT one of {choices}")


def _hf_snapshot(repo_dir: Path, repo: str) -> Path:
    """The snapshot folder refs/main names; without refs/main (a download pinned to a
    commit), the only snapshot there is."""
    ref = repo_dir / "refs" / "main"
    snapshots = repo_dir / "snapshots"
    try:
        commit = ref.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        found = sorted(p for p in snapshots.glob("*") if p.is_dir())
        if len(found) != 1:
            raise WeightsError(
                f"{repo} in the Hugging Face cache has no refs/main and {len(found)} snapshots; "
                f"pass the folder of one ({snapshots}/<commit>)"
            ) from None
        return found[0]
    except OSError as e:
        raise WeightsError(f"{ref}: unreadable ({e})") from e
    if not _COMMIT.fullmatch(commit):
        raise WeightsError(f"{ref} holds {commit[:60]!r}, not a commit hash")
    snapshot = snapshots / commit
    if not snapshot.is_dir():
        raise WeightsError(
            f"{repo} in the Hugging Face cache has no snapshot for refs/main ({commit[:12]}); "
            f"`hf download {repo}` fetches it again"
        )
    return snapshot


def _hf_contents(snapshot: Path) -> tuple[bool, list[Path]]:
    """Whether the snapshot loads as a Hugging Face folder, and its complete .gguf files
    (an interrupted download leaves no link, a removed blob a dangling one)."""
    folder_ok = (snapshot / "config.json").is_file() and (
        (snapshot / "model.safetensors").is_file()
        or (snapshot / "model.safetensors.index.json").is_file()
    )
    return folder_ok, sorted(p for p in snapshot.rglob("*.gguf") if p.is_file())


def _name_tokens(path: Path) -> list[str]:
    """A .gguf file name's parts between '-' and '.', upper-cased: the quant is one of them
    (Qwen2.5-0.5B-Instruct-Q4_K_M.gguf, llama-2-7b.Q4_0.gguf)."""
    return re.split(r"[-.]", path.stem.upper())


def _quant_label(path: Path) -> str:
    return re.split(r"[-.]", path.stem)[-1]


def ollama_store() -> Path:
    """Ollama's model folder: $OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(os.getenv("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def ollama_model(spec: str) -> Path:
    """The GGUF blob of `ollama:NAME[:TAG]` (tag `latest` by default), read from the model's
    manifest in Ollama's store."""
    name, tag = _ollama_name(spec)
    store = ollama_store()
    if not (store / "manifests").is_dir():
        raise WeightsError(
            f"no Ollama model store at {store} (set OLLAMA_MODELS to the folder that holds "
            "manifests/ and blobs/)"
        )
    parts = name.split("/")
    prefix = {1: [OLLAMA_HOST, OLLAMA_NAMESPACE], 2: [OLLAMA_HOST], 3: []}[len(parts)]
    tags = store.joinpath("manifests", *prefix, *parts)
    manifest = tags / tag
    if not manifest.is_file():
        if not tags.is_dir():
            raise WeightsError(
                f"Ollama has no model {name!r} in {store}; `ollama pull {name}` fetches it"
            )
        known = [p.name for p in tags.iterdir() if p.is_file() and _OLLAMA_TAG.fullmatch(p.name)]
        raise WeightsError(
            f"Ollama has no tag {tag!r} of {name!r}; its tags: {', '.join(sorted(known)) or 'none'}"
        )
    blob = store / "blobs" / f"sha256-{_model_digest(manifest)}"
    if not blob.is_file():
        raise WeightsError(
            f"{blob} is missing: the Ollama store lacks the weights of {name}:{tag}; "
            f"`ollama pull {name}:{tag}` fetches them again"
        )
    return blob


def _ollama_name(spec: str) -> tuple[str, str]:
    """(name, tag) of `ollama:NAME[:TAG]`, each part checked: they become folder names."""
    rest = spec.removeprefix(OLLAMA_PREFIX)
    name, _, tag = rest.rpartition(":") if ":" in rest else (rest, "", "latest")
    parts = name.split("/")
    if not 1 <= len(parts) <= 3 or not all(map(_OLLAMA_PART.fullmatch, parts)):
        raise WeightsError(
            f"{spec!r} is not an Ollama model name; expected ollama:NAME[:TAG], "
            "e.g. ollama:qwen2.5:7b"
        )
    if not _OLLAMA_TAG.fullmatch(tag):
        raise WeightsError(f"{spec!r}: {tag!r} is not an Ollama tag")
    return name, tag


def _model_digest(manifest: Path) -> str:
    """The hex sha256 of the model layer; only `layers[].mediaType` and `.digest` are read."""
    data = _small_json(manifest, "Ollama manifest")
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        raise WeightsError(f"{manifest}: malformed Ollama manifest: no layers list")
    for layer in layers:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            digest = layer.get("digest")
            match = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
            if match is None:
                raise WeightsError(
                    f"{manifest}: malformed Ollama manifest: the model layer's digest "
                    f"{str(digest)[:80]!r} is not sha256:<64 hex digits>"
                )
            return match[1]
    raise WeightsError(f"{manifest}: malformed Ollama manifest: no {OLLAMA_MODEL_LAYER} layer")


@dataclass(frozen=True)
class LocalModel:
    """One model found on this machine, described without loading its weights."""

    spec: str  # what --model takes
    source: str  # bundled, split, hf-cache or ollama
    path: Path | None  # None: not installed (or a split model's parts, not yet joined)
    size_bytes: int | None
    architecture: str | None
    context: int | None  # trained context length
    supported: bool | None  # None: unknown until installed or joined
    note: str = ""  # why it is not supported, or how to install it

    @property
    def status(self) -> str:
        """yes, no and why, or the note of a model not installed yet."""
        if self.supported is None:
            return self.note
        return "yes" if self.supported else f"no: {self.note}"


def local_models() -> list[LocalModel]:
    """The bundled and split models (installed or not), then the models in the Hugging Face
    cache and Ollama's store; a store that is absent adds nothing."""
    return [*_packaged(), *_hf_cache_models(), *_ollama_models()]


def _packaged() -> Iterator[LocalModel]:
    for name, model in BUNDLED_MODELS.items():
        try:
            path = bundled_model_path(model)
        except WeightsError:
            note = f"not installed: {model.install}"
            yield LocalModel(name, "bundled", None, None, None, None, None, note)
            continue
        yield _described(name, "bundled", path)
    for name, split in SPLIT_MODELS.items():
        joined = joined_model_path(split)
        if joined.is_file() and joined.stat().st_size == split.size:
            yield _described(name, "split", joined)
            continue
        try:
            split_model_parts(split)
            note = f"installed; joined into {joined.parent} on first use"
        except WeightsError:
            note = f"not installed: {split.install}"
        yield LocalModel(name, "split", None, split.size, None, None, None, note)


def _hf_cache_models() -> Iterator[LocalModel]:
    cache = hf_cache_dir()
    repo_dirs = sorted(cache.glob("models--*--*")) if cache.is_dir() else []
    for repo_dir in repo_dirs:
        repo = repo_dir.name.removeprefix("models--").replace("--", "/")
        if parse_repo_spec(repo) is None:
            continue
        try:
            snapshot = _hf_snapshot(repo_dir, repo)
        except WeightsError:
            continue  # an incomplete download: nothing there to load
        folder_ok, ggufs = _hf_contents(snapshot)
        if folder_ok:
            yield _described(repo, "hf-cache", snapshot)
        for gguf in ggufs:
            bare = len(ggufs) == 1 and not folder_ok
            spec = repo if bare else f"{repo}:{_quant_label(gguf)}"
            yield _described(spec, "hf-cache", gguf)


def _ollama_models() -> Iterator[LocalModel]:
    root = ollama_store() / "manifests"
    manifests = sorted(p for p in root.glob("*/*/*/*") if p.is_file()) if root.is_dir() else []
    for manifest in manifests:
        host, namespace, name, tag = manifest.relative_to(root).parts
        if host == OLLAMA_HOST:
            name = name if namespace == OLLAMA_NAMESPACE else f"{namespace}/{name}"
        else:
            name = f"{host}/{namespace}/{name}"
        spec = f"{OLLAMA_PREFIX}{name}:{tag}"
        try:
            yield _described(spec, "ollama", ollama_model(spec))
        except WeightsError as e:
            yield LocalModel(spec, "ollama", None, None, None, None, False, str(e))


def _described(spec: str, source: str, path: Path) -> LocalModel:
    """`path` described from its GGUF header or config.json, or the one line saying why it
    cannot be read."""
    try:
        if path.is_dir():
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            architecture, context, problem = _hf_facts(path, spec)
        else:
            size = path.stat().st_size
            architecture, context, problem = _gguf_facts(path)
    except (OSError, WeightsError) as e:
        return LocalModel(spec, source, path, None, None, None, False, str(e))
    return LocalModel(spec, source, path, size, architecture, context, not problem, problem)


def _gguf_facts(path: Path) -> tuple[str | None, int | None, str]:
    scalars = read_gguf_header(path).scalars
    arch = scalars.get("general.architecture")
    if not isinstance(arch, str):
        return None, None, "no general.architecture key"
    context = scalars.get(f"{arch}.context_length")
    context = context if isinstance(context, int) and not isinstance(context, bool) else None
    problem = "" if arch in SUPPORTED_ARCHITECTURES else f"architecture {arch!r} is not supported"
    return arch, context, problem


def _hf_facts(folder: Path, name: str) -> tuple[str | None, int | None, str]:
    raw = _small_json(folder / "config.json", "config.json")
    if not isinstance(raw, dict):
        raise WeightsError(f"{folder / 'config.json'}: expected a JSON object")
    try:
        parsed = config_from_hf(raw, name)
    except (UnsupportedModelError, WeightsError) as e:
        names = raw.get("architectures")
        arch = names[0] if isinstance(names, list) and names else raw.get("model_type")
        context = raw.get("max_position_embeddings")
        return (
            ARCHITECTURES.get(arch, arch) if isinstance(arch, str) else None,
            context if isinstance(context, int) and not isinstance(context, bool) else None,
            str(e),
        )
    return parsed.architecture, parsed.trained_context, ""


def _small_json(path: Path, what: str) -> object:
    try:
        with path.open("rb") as f:
            text = f.read(_MAX_JSON_BYTES + 1)
        if len(text) > _MAX_JSON_BYTES:
            raise ValueError(f"larger than {_MAX_JSON_BYTES} bytes")
        return json.loads(text)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or UTF-8, or too large
        raise WeightsError(f"{path}: unreadable {what} ({e})") from e
