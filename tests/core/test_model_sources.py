"""--model forms for models other tools keep: a repo in the Hugging Face cache and an Ollama
name, each resolved from a store laid out as that tool lays it out; and `local_models`."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kvchat.core.model_files import load_weights, resolve_model_path
from kvchat.core.model_sources import local_models
from kvchat.core.weights import BUNDLED_MODELS, WeightsError, bundled_model_path

from .test_hf_loader import assert_same_tensors, save_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SMOLLM2 = bundled_model_path(BUNDLED_MODELS["smollm2-135m"])


def add_hf_repo(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """A repo as huggingface_hub caches it: the files in blobs/, a snapshot of links into
    them, refs/main naming the snapshot. Returns the snapshot folder."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(f"{repo}/{name}".encode()).hexdigest()
        blob.symlink_to(source.resolve())  # the bundled model is linked, not copied
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)  # no newline, as huggingface_hub writes it
    return snapshot


def add_ollama_model(store: Path, name: str, tag: str, gguf: Path) -> Path:
    """A model as Ollama stores it: a manifest (schema 2) whose model layer names a blob.
    Returns the blob."""
    digest = hashlib.sha256(f"{name}:{tag}".encode()).hexdigest()
    blob = store / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        blob.symlink_to(gguf.resolve())
    parts = name.split("/")
    prefix = {1: ["registry.ollama.ai", "library"], 2: ["registry.ollama.ai"], 3: []}[len(parts)]
    manifest = store.joinpath("manifests", *prefix, *parts, tag)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}
    manifest.write_text(json.dumps(ollama_manifest(layer)))
    return blob


def ollama_manifest(model_layer: dict) -> dict:
    config = {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 485}
    template = {"mediaType": "application/vnd.ollama.image.template", "size": 1492}
    for i, layer in enumerate((config, template)):
        layer["digest"] = "sha256:" + hashlib.sha256(bytes([i])).hexdigest()
    return {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": config,
        "layers": [{**model_layer, "size": SMOLLM2.stat().st_size}, template],
    }


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def ollama(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    store = tmp_path / "ollama" / "models"
    (store / "manifests").mkdir(parents=True)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    return store


# -- the Hugging Face cache ---------------------------------------------------------------------


def test_the_fake_cache_is_the_one_huggingface_hub_reads(hf_cache):
    from huggingface_hub import scan_cache_dir, snapshot_download

    snapshot = add_hf_repo(hf_cache, "org/name", {SMOLLM2.name: SMOLLM2})
    (repo,) = scan_cache_dir(hf_cache).repos
    assert repo.repo_id == "org/name" and repo.refs["main"].commit_hash == COMMIT
    found = snapshot_download("org/name", cache_dir=hf_cache, local_files_only=True)
    assert Path(found) == snapshot == resolve_model_path("org/name").parent


def test_a_repo_with_one_gguf_resolves_to_it(hf_cache):
    snapshot = add_hf_repo(hf_cache, "org/name", {SMOLLM2.name: SMOLLM2})
    assert resolve_model_path("org/name") == snapshot / SMOLLM2.name
    # The quant is matched case-insensitively against the file name's parts.
    assert resolve_model_path("org/name:q4_1") == snapshot / SMOLLM2.name


def test_a_repo_with_several_ggufs_needs_the_quant(hf_cache):
    files = {"model-Q4_1.gguf": SMOLLM2, "model-Q8_0.gguf": SMOLLM2, "README.md": SMOLLM2}
    snapshot = add_hf_repo(hf_cache, "org/multi", files)
    assert resolve_model_path("org/multi:Q8_0") == snapshot / "model-Q8_0.gguf"
    assert resolve_model_path("org/multi:Q4_1") == snapshot / "model-Q4_1.gguf"
    with pytest.raises(WeightsError) as info:
        resolve_model_path("org/multi")
    message = str(info.value)
    assert "pick one as org/multi:QUANT" in message and "'Q4_1', 'Q8_0'" in message
    assert "\n" not in message
    with pytest.raises(WeightsError, match=r"none matches 'Q4_K_M', QUANT one of 'Q4_1'"):
        resolve_model_path("org/multi:Q4_K_M")
    # A quant is one whole part of the name: Q4 is not Q4_1.
    with pytest.raises(WeightsError, match="none matches 'Q4'"):
        resolve_model_path("org/multi:Q4")


def test_a_repo_with_config_json_and_safetensors_loads_as_a_folder(hf_cache, tmp_path):
    saved = tmp_path / "saved"
    model = save_model(saved)
    files = {p.name: p for p in saved.iterdir()}
    snapshot = add_hf_repo(hf_cache, "org/tiny", files)
    assert resolve_model_path("org/tiny") == snapshot
    assert_same_tensors(load_weights("org/tiny"), model)


def test_a_repo_not_in_the_cache(hf_cache):
    add_hf_repo(hf_cache, "org/name", {SMOLLM2.name: SMOLLM2})
    with pytest.raises(WeightsError) as info:
        resolve_model_path("org/other")
    message = str(info.value)
    assert "is neither an existing path nor a model in the Hugging Face cache" in message
    assert str(hf_cache) in message and "`hf download org/other`" in message


def test_the_cache_follows_hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snapshot = add_hf_repo(tmp_path / "home" / "hub", "org/name", {SMOLLM2.name: SMOLLM2})
    assert resolve_model_path("org/name") == snapshot / SMOLLM2.name


def test_an_existing_path_wins_over_a_repo_of_the_same_spelling(hf_cache, tmp_path, monkeypatch):
    add_hf_repo(hf_cache, "org/name", {SMOLLM2.name: SMOLLM2})
    local = tmp_path / "work" / "org" / "name"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_path("org/name") == local.resolve()


def test_refs_main_that_is_not_a_commit_is_refused(hf_cache):
    snapshot = add_hf_repo(hf_cache, "org/name", {SMOLLM2.name: SMOLLM2})
    (snapshot.parents[1] / "refs" / "main").write_text("../../../elsewhere")
    with pytest.raises(WeightsError, match="not a commit hash"):
        resolve_model_path("org/name")


def test_a_missing_path_is_still_reported_as_a_path(hf_cache):
    with pytest.raises(WeightsError, match="model file or folder not found: models/x.gguf"):
        resolve_model_path("models/x.gguf")


# -- Ollama ------------------------------------------------------------------------------------


def test_ollama_names_resolve_to_the_model_blob(ollama):
    blob = add_ollama_model(ollama, "smollm2", "latest", SMOLLM2)
    assert resolve_model_path("ollama:smollm2") == blob
    assert resolve_model_path("ollama:smollm2:latest") == blob
    tagged = add_ollama_model(ollama, "qwen2.5", "7b", SMOLLM2)
    assert resolve_model_path("ollama:qwen2.5:7b") == tagged
    user = add_ollama_model(ollama, "someone/smol", "v1", SMOLLM2)
    assert resolve_model_path("ollama:someone/smol:v1") == user


def test_an_unknown_ollama_tag_lists_the_tags(ollama):
    add_ollama_model(ollama, "smollm2", "latest", SMOLLM2)
    add_ollama_model(ollama, "smollm2", "135m", SMOLLM2)
    with pytest.raises(WeightsError, match=r"no tag '1.7b' of 'smollm2'; its tags: 135m, latest"):
        resolve_model_path("ollama:smollm2:1.7b")
    with pytest.raises(WeightsError, match=r"no model 'llama3'.*`ollama pull llama3`"):
        resolve_model_path("ollama:llama3")


def test_a_missing_ollama_store(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nowhere"))
    with pytest.raises(WeightsError, match="no Ollama model store at .*nowhere"):
        resolve_model_path("ollama:smollm2")


@pytest.mark.parametrize(
    "content,expected",
    [
        ("{not json", "unreadable Ollama manifest"),
        ("[1, 2]", "no layers list"),
        (json.dumps({"schemaVersion": 2, "layers": []}), "no application/vnd.ollama.image.model"),
        (json.dumps(ollama_manifest({"mediaType": "application/vnd.ollama.image.model"})), "None"),
    ],
)
def test_a_malformed_ollama_manifest(ollama, content, expected):
    add_ollama_model(ollama, "smollm2", "latest", SMOLLM2)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "latest"
    manifest.write_text(content)
    with pytest.raises(WeightsError, match=expected) as info:
        resolve_model_path("ollama:smollm2")
    assert str(manifest) in str(info.value)


@pytest.mark.parametrize(
    "digest",
    [
        "sha256:../../../../etc/passwd",
        "sha256:" + "0" * 63,
        "sha256:" + "A" * 64,
        "md5:" + "0" * 64,
    ],
)
def test_a_digest_that_is_not_64_hex_digits_is_refused(ollama, digest):
    add_ollama_model(ollama, "smollm2", "latest", SMOLLM2)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "latest"
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": digest}
    manifest.write_text(json.dumps(ollama_manifest(layer)))
    with pytest.raises(WeightsError, match="is not sha256:<64 hex digits>"):
        resolve_model_path("ollama:smollm2")


def test_a_missing_ollama_blob(ollama):
    blob = add_ollama_model(ollama, "smollm2", "latest", SMOLLM2)
    blob.unlink()
    with pytest.raises(WeightsError, match=r"is missing: .*`ollama pull smollm2:latest`"):
        resolve_model_path("ollama:smollm2")


@pytest.mark.parametrize("spec", ["ollama:../smollm2", "ollama:a/b/c/d", "ollama:", "ollama:x:"])
def test_a_name_that_is_not_an_ollama_name_is_refused(ollama, spec):
    with pytest.raises(WeightsError, match="not an Ollama"):
        resolve_model_path(spec)


# -- the listing -------------------------------------------------------------------------------


def test_local_models_lists_every_store_from_headers(hf_cache, ollama, tmp_path):
    add_hf_repo(hf_cache, "org/name", {SMOLLM2.name: SMOLLM2})
    add_hf_repo(hf_cache, "org/multi", {"m-Q4_1.gguf": SMOLLM2, "m-Q8_0.gguf": SMOLLM2})
    saved = tmp_path / "saved"
    save_model(saved, max_position_embeddings=4096)
    add_hf_repo(hf_cache, "org/tiny", {p.name: p for p in saved.iterdir()})
    add_hf_repo(hf_cache, "org/readme-only", {"README.md": SMOLLM2})
    add_ollama_model(ollama, "smollm2", "latest", SMOLLM2)
    broken = add_ollama_model(ollama, "gone", "latest", SMOLLM2)
    broken.unlink()
    found = {m.spec: m for m in local_models()}
    for spec in (
        "smollm2-135m",
        "org/name",
        "org/multi:Q4_1",
        "org/multi:Q8_0",
        "ollama:smollm2:latest",
    ):
        m = found[spec]
        assert (m.architecture, m.context, m.supported) == ("llama", 8192, True), spec
        assert m.size_bytes == SMOLLM2.stat().st_size and m.status == "yes"
    tiny = found["org/tiny"]
    assert (tiny.architecture, tiny.context, tiny.supported) == ("llama", 4096, True)
    assert tiny.path == hf_cache / "models--org--tiny" / "snapshots" / COMMIT
    assert "org/readme-only" not in found
    gone = found["ollama:gone:latest"]
    assert not gone.supported and "is missing" in gone.status
    # Each listed spec is one --model resolves.
    for spec in ("org/name", "org/multi:Q8_0", "ollama:smollm2:latest", "org/tiny"):
        assert resolve_model_path(spec) == found[spec].path


def test_local_models_says_why_a_model_is_unsupported(hf_cache, tmp_path):
    saved = tmp_path / "saved"
    save_model(saved)
    config = json.loads((saved / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    files = {p.name: p for p in saved.iterdir()} | {"config.json": tmp_path / "config.json"}
    add_hf_repo(hf_cache, "org/gpt", files)
    gpt = next(m for m in local_models() if m.spec == "org/gpt")
    assert gpt.architecture == "GPT2LMHeadModel" and gpt.supported is False
    assert gpt.status.startswith("no: ") and "not supported" in gpt.status


def test_local_models_without_stores(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    sources = {m.source for m in local_models()}
    assert sources == {"bundled", "split"}
