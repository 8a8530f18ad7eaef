"""Per-shard downloads into a 🤗 cache snapshot: a sharded Hub checkpoint is resolved with its index only
(``model_source``), and each shard is fetched here when a reader first needs it (``weights.load_tensors``,
``model_source.ensure_shards``), within ``max_disk_space`` (or ``$SWARMSERVE_MAX_DISK_SPACE``) and the free space.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_DISK_SPACE_ENV = "SWARMSERVE_MAX_DISK_SPACE"


class DiskSpaceError(OSError):
    """The needed shards would exceed ``max_disk_space`` or the free disk space; nothing was fetched."""


@dataclass(frozen=True)
class HubSnapshot:
    """Where a directory of the 🤗 cache came from: ``<cache_dir>/models--org--name/snapshots/<revision>``."""

    repo_id: str
    revision: str
    cache_dir: pathlib.Path


def hub_snapshot(model_dir: str | os.PathLike[str]) -> HubSnapshot | None:
    """The repo and revision a 🤗 cache snapshot directory holds (read from the cache's layout), else None."""
    path = pathlib.Path(model_dir).expanduser().absolute()
    repo_dir = path.parent.parent
    if path.parent.name != "snapshots" or not repo_dir.name.startswith("models--"):
        return None
    return HubSnapshot(repo_dir.name[len("models--") :].replace("--", "/"), path.name, repo_dir.parent)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes from ``"20GB"``, ``"1.5 GiB"``, ``"500MB"`` or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a size from {text!r}; use e.g. 20GB, 1.5GiB or 500MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _format_size(size: int) -> str:
    return f"{size / 10**9:.2f} GB" if size >= 10**8 else f"{size / 10**6:.1f} MB"


def _hub_file_size(snapshot: HubSnapshot, filename: str) -> int:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(snapshot.repo_id, filename, revision=snapshot.revision)
    return int(get_hf_file_metadata(url).size or 0)


def _hub_download(snapshot: HubSnapshot, filename: str) -> str:
    from huggingface_hub import hf_hub_download

    # with the snapshot's commit as revision, the file lands next to the files already there (tqdm progress)
    return hf_hub_download(
        snapshot.repo_id, filename, revision=snapshot.revision, cache_dir=str(snapshot.cache_dir)
    )


def check_disk_space(
    model_dir: pathlib.Path, sizes: dict[str, int], max_disk_space: int | None, repo_id: str = ""
) -> None:
    """Raise ``DiskSpaceError`` if adding files of ``sizes`` would exceed the limit or the free space."""
    needed = sum(sizes.values())
    held = sum(f.stat().st_size for f in model_dir.glob("*.safetensors") if f.exists())
    names = ", ".join(sorted(sizes))
    if max_disk_space is not None and held + needed > max_disk_space:
        raise DiskSpaceError(
            f"the needed shards of {repo_id or model_dir} ({names}: {_format_size(needed)}) would bring its "
            f"weights on disk to {_format_size(held + needed)}, over the max disk space of "
            f"{_format_size(max_disk_space)} ({_format_size(held)} already held). Raise --max-disk-space "
            f"(${MAX_DISK_SPACE_ENV}) or serve fewer blocks (--num-blocks)."
        )
    model_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(model_dir).free
    if needed > free:
        raise DiskSpaceError(
            f"the needed shards of {repo_id or model_dir} ({names}: {_format_size(needed)}) do not fit in "
            f"the {_format_size(free)} free on the disk of {model_dir}; free some or serve fewer blocks."
        )


def fetch_hub_files(
    model_dir: str | os.PathLike[str], files: list[str], max_disk_space: int | str | None = None
) -> list[str]:
    """Download the ``files`` missing from a 🤗 cache snapshot directory; returns the names fetched.

    Sizes are asked first and the whole batch is refused (``DiskSpaceError``) before any byte is written if it
    would exceed ``max_disk_space`` (default ``$SWARMSERVE_MAX_DISK_SPACE``) or the free space. Directories
    that are not Hub snapshots are left alone (nothing to fetch from; the reader reports what is missing).
    """
    path = pathlib.Path(model_dir)
    snapshot = hub_snapshot(path)
    missing = [f for f in files if not (path / f).is_file()]
    if snapshot is None or not missing:
        return []
    if max_disk_space is None and os.environ.get(MAX_DISK_SPACE_ENV):
        max_disk_space = os.environ[MAX_DISK_SPACE_ENV]
    limit = None if max_disk_space is None else parse_size(max_disk_space)
    sizes = {f: _hub_file_size(snapshot, f) for f in missing}
    check_disk_space(path, sizes, limit, snapshot.repo_id)
    for i, name in enumerate(missing, 1):
        size = _format_size(sizes[name])
        logger.warning("downloading %s (%d/%d, %s) from %s", name, i, len(missing), size, snapshot.repo_id)
        _hub_download(snapshot, name)
    return missing
