"""Read only the tensors a caller needs from a safetensors checkpoint.

A block server holding blocks ``[a, b)`` of a 70B model must not read (or even map) the other shards, and the
client's head needs only the embeddings, the final norm and the LM head. ``safetensors.safe_open`` reads the
header of a file without its data, so we select tensor names first and then open only the shards that hold
them.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarm_client.hub_files import fetch_hub_files

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: ``model_type`` → template of the key prefix of block ``i`` in a 🤗 checkpoint (checked on saved models).
LAYER_PREFIXES: dict[str, str] = {
    "llama": "model.layers.{index}.",
    "mistral": "model.layers.{index}.",
    "qwen2": "model.layers.{index}.",
    "mixtral": "model.layers.{index}.",
    "falcon": "transformer.h.{index}.",
    "bloom": "transformer.h.{index}.",
}

_HINT = (
    "Pass a local model directory with config.json and safetensors weights (for example one written by "
    "`swarmserve tiny-model DIR`, or by `save_pretrained(DIR)`)."
)


class TensorNotFoundError(KeyError):
    """No tensor of the checkpoint matches the requested prefixes.

    A ``KeyError`` subclass whose ``str()`` is the plain message (``KeyError`` would print its repr).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _model_dir(model_dir: str | os.PathLike[str]) -> pathlib.Path:
    path = pathlib.Path(model_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {str(path)!r} does not exist or is not a directory. {_HINT}"
        )
    return path


def _weight_map(path: pathlib.Path) -> dict[str, str]:
    """Tensor name → file name (relative to ``path``), read from headers and the shard index only."""
    from safetensors import safe_open

    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index (no 'weight_map'): {exc}") from exc
        return {str(name): str(file) for name, file in weight_map.items()}
    single = path / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    others = sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".gguf"})
    found = f" It holds {', '.join(others)}, which swarmserve does not read;" if others else ""
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {str(path)!r}.{found} re-save the model with "
        f"`model.save_pretrained(DIR)` (safetensors is the default). {_HINT}"
    )


def list_tensor_names(model_dir: str | os.PathLike[str]) -> list[str]:
    """All tensor names in the checkpoint, sorted; reads only headers."""
    return sorted(_weight_map(_model_dir(model_dir)))


def select_names(names: Sequence[str] | Mapping[str, Any], prefixes: Sequence[str]) -> list[str]:
    """Names starting with any of ``prefixes``, sorted (a plain string is one prefix, not a sequence)."""
    if isinstance(prefixes, str):
        prefixes = [prefixes]
    wanted = tuple(prefixes)
    return sorted(name for name in names if name.startswith(wanted))


def shard_files(model_dir: str | os.PathLike[str], prefixes: Sequence[str]) -> list[str]:
    """The checkpoint files (relative names) holding tensors under any of ``prefixes``, sorted.

    Reads only ``model.safetensors.index.json`` (or the single file's header), so it answers before any
    shard is on disk: this is how a server knows which shards of a Hub repo its span needs.
    """
    weight_map = _weight_map(_model_dir(model_dir))
    return sorted({weight_map[name] for name in select_names(weight_map, prefixes)})


def load_tensors(
    model_dir: str | os.PathLike[str],
    prefixes: Sequence[str],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    missing_ok: bool = False,
) -> dict[str, torch.Tensor]:
    """Tensors whose names start with any of ``prefixes``, keyed by their full checkpoint name.

    Only the shards holding selected tensors are opened. Floating-point tensors are cast to ``dtype`` when
    given (integer buffers keep theirs). Raises ``TensorNotFoundError`` (a ``KeyError``) when nothing
    matches, unless ``missing_ok``: a wrong prefix is a bug, and an empty block would fail later and less
    clearly. A prefix that matches nothing while others do is fine (``lm_head.`` of a tied model).
    """
    from safetensors import safe_open
    from tqdm.auto import tqdm

    path = _model_dir(model_dir)
    weight_map = _weight_map(path)
    names = select_names(weight_map, prefixes)
    if not names:
        if missing_ok:
            return {}
        sample = sorted(weight_map)[:4]
        raise TensorNotFoundError(
            f"no tensor in {str(path)!r} starts with any of {list(prefixes)!r} (its names look like "
            f"{sample}). Check the block index against config.num_hidden_layers and the family's "
            f"layer prefix (swarm_client.weights.layer_prefix)."
        )

    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(weight_map[name], []).append(name)

    absent = sorted(f for f in by_file if not (path / f).is_file())
    if absent:
        fetch_hub_files(path, absent)  # a lazily fetched Hub snapshot gets them now; elsewhere a no-op

    device_str = str(device)
    out: dict[str, torch.Tensor] = {}
    with tqdm(total=len(names), desc=f"Loading {path.name}", unit="tensor", disable=not progress) as bar:
        for file_name, file_names in sorted(by_file.items()):
            file_path = path / file_name
            if not file_path.is_file():
                raise FileNotFoundError(
                    f"{INDEX_FILE} in {str(path)!r} lists shard {file_name!r}, which is missing: the "
                    f"download or copy is incomplete. Fetch the whole checkpoint again."
                )
            with safe_open(str(file_path), framework="pt", device=device_str) as f:
                for name in file_names:
                    tensor = f.get_tensor(name)
                    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                        tensor = tensor.to(dtype)
                    out[name] = tensor
                    bar.update(1)
    return out


def _config_get(config: Any, *keys: str) -> Any:
    for key in keys:
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if value is not None:
            return value
    return None


def layer_prefix(config: Any, index: int) -> str:
    """Checkpoint key prefix of block ``index``, e.g. ``"model.layers.3."`` or ``"transformer.h.3."``.

    ``config`` is a ``PretrainedConfig`` or the dict of ``config.json``.
    """
    model_type = _config_get(config, "model_type")
    template = LAYER_PREFIXES.get(str(model_type))
    if template is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; swarmserve serves {', '.join(sorted(LAYER_PREFIXES))}"
        )
    num_layers = _config_get(config, "num_hidden_layers", "n_layer")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise IndexError(f"block index must be a non-negative int, got {index!r}")
    if num_layers is not None and index >= int(num_layers):
        raise IndexError(f"block index {index} out of range: the model has {num_layers} blocks")
    return template.format(index=index)
