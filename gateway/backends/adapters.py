"""LoRA adapters as models: which adapters the swarm can serve, the model names that select them, and the
request's ``model`` → adapter.

A server started with ``--adapters NAME=PATH`` announces ``NAME`` (``ServerInfo.adapters``); a session that
runs adapter ``NAME`` is routed over servers announcing it only (``swarm_client.routing.find_route``). So an
adapter is served when the ONLINE servers announcing it cover every block (``served_adapters``). Each one
is a model of ``/v1/models`` named ``BASE:NAME`` (``BASE`` the served model's id; its basename works too,
as it does for the base model), or by an alias the operator configured (``--adapter-alias NAME=ALIAS``).
A request naming anything else is a 404 ``model_not_found`` listing the names that exist.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gateway.errors import ModelNotFoundError
from swarm_client.dht_records import RemoteSpanInfo
from swarm_client.lora import check_adapter_name
from swarm_client.routing import missing_blocks

__all__ = [
    "ServedModel",
    "parse_adapter_aliases",
    "public_model_id",
    "served_adapters",
    "served_models",
    "select_model",
]


@functools.lru_cache(maxsize=64)  # asked per request: a path's look on disk, once
def public_model_id(model_id: str) -> str:
    """The name the gateway shows for a served model: ``model_id`` itself when it is a name (a hub id such
    as ``HuggingFaceTB/SmolLM2-135M-Instruct``, or the name the operator gave), its directory's name when it
    is a filesystem path (``/srv/models/tiny-llama`` → ``tiny-llama``). A path says how the machine is laid
    out (user names, mounts): no answer to a client carries one."""
    trimmed = model_id.rstrip("/\\")
    looks_like_path = os.path.isabs(trimmed) or trimmed.startswith((".", "~")) or os.path.exists(trimmed)
    return (os.path.basename(trimmed) or trimmed) if looks_like_path else model_id


def served_adapters(spans: Mapping[str, RemoteSpanInfo], num_blocks: int) -> list[str]:
    """The adapters a whole-model route can use, sorted: those whose ONLINE servers cover blocks
    ``[0, num_blocks)`` between them (``routing.missing_blocks`` over the servers announcing each)."""
    names = sorted({name for span in spans.values() for name in span.server_info.adapters})
    return [
        name
        for name in names
        if num_blocks > 0
        and not missing_blocks({p: s for p, s in spans.items() if name in s.server_info.adapters}, num_blocks)
    ]


def parse_adapter_aliases(values: Iterable[str]) -> dict[str, str]:
    """``["NAME=ALIAS", ...]`` → ``{ALIAS: NAME}``: the model name ``ALIAS`` selects adapter ``NAME``.
    Raises ``ValueError`` on a malformed item, a bad adapter name or an alias given twice."""
    aliases: dict[str, str] = {}
    for value in values:
        name, sep, alias = value.partition("=")
        name, alias = name.strip(), alias.strip()
        if not sep or not name or not alias:
            raise ValueError(f"an adapter alias is NAME=ALIAS (the adapter, then its model name), got {value!r}")
        if alias in aliases:
            raise ValueError(f"the adapter alias {alias!r} is given twice")
        aliases[alias] = check_adapter_name(name)
    return aliases


@dataclass(frozen=True)
class ServedModel:
    """One entry of ``/v1/models``: its name, and the adapter it selects (None: the base model)."""

    id: str
    adapter: str | None = None


def served_models(base_id: str, adapters: Sequence[str], aliases: Mapping[str, str] | None = None) -> list[ServedModel]:
    """The models ``/v1/models`` lists: the base model, then ``BASE:NAME`` per served adapter, then each alias
    of a served adapter."""
    models = [ServedModel(base_id)] + [ServedModel(f"{base_id}:{name}", name) for name in adapters]
    served = set(adapters)
    models += [ServedModel(alias, name) for alias, name in (aliases or {}).items() if name in served]
    return models


def select_model(requested: str | None, models: Sequence[ServedModel]) -> ServedModel:
    """The served model ``requested`` names (None: the base model): an entry's id, or the base id's basename
    in its place (``tiny-llama`` and ``tiny-llama:a1`` for ``/models/tiny-llama``). A 404
    ``ModelNotFoundError`` listing ``models`` otherwise."""
    base = models[0]
    if requested is None:
        return base
    short = os.path.basename(base.id.rstrip("/"))
    for model in models:
        if requested == model.id:
            return model
        named = model.adapter is None or model.id == f"{base.id}:{model.adapter}"  # not an alias
        if short and named and requested == short + model.id[len(base.id) :]:
            return model
    raise ModelNotFoundError(requested, available=[m.id for m in models])
