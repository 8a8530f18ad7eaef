"""LoRA adapters on a span of blocks: PEFT checkpoints loaded span by span, chosen per row at run time.

A server (``swarmserve worker --adapters NAME=PATH``) reads only its span's adapter weights and injects
them with PEFT's own LoRA layers (``peft.inject_adapter_in_model``) into each block's 🤗 layer, placed at
its checkpoint path (``model.layers.7`` …) so the adapter's ``target_modules``, ``layers_to_transform``
and rank/alpha patterns match exactly as on the full model. No adapter is active by default: a step runs
its rows through adapters only inside ``adapter_rows(...)``, which hands PEFT's mixed-batch argument
(``adapter_names``, one name per row, ``BASE`` for none) to every LoRA layer — so one batch can mix
sessions of different adapters, and each row computes what it would alone.

Only adapters of the transformer blocks are served: the client runs the embeddings and the LM head, so an
adapter that changes those (LoRA on ``lm_head``, ``modules_to_save``) is refused with a clear error.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import pathlib
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

#: PEFT's name for "no adapter" in a mixed batch
BASE = "__base__"
#: the most adapters one server serves (each adds its weights to every block of the span)
MAX_ADAPTERS = 32
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."

#: the adapter of each row of the step being computed (None: every row runs the base model)
_ROWS: contextvars.ContextVar[RowAdapters | None] = contextvars.ContextVar("lora_rows", default=None)


class AdapterError(ValueError):
    """An adapter that cannot be served: bad name, missing files, unsupported PEFT features."""


def check_adapter_name(name: object) -> str:
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise AdapterError(
            f"invalid adapter name {str(name)[:80]!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class AdapterSpec:
    """``NAME=PATH`` of ``--adapters``: a PEFT LoRA checkpoint (a directory or a Hub id) served as ``NAME``."""

    name: str
    path: str

    @classmethod
    def parse(cls, value: str) -> AdapterSpec:
        name, sep, path = value.partition("=")
        if not sep or not path:
            raise AdapterError(f"--adapters expects NAME=PATH (a PEFT LoRA directory or Hub id), got {value!r}")
        return cls(check_adapter_name(name.strip()), path.strip())


def adapter_field(adapter: str | None) -> dict[str, str]:
    """``{"adapter": NAME}`` for a request, a session's open spec or ``open_session``'s keywords; empty for the
    base model, so older servers and backends that serve no adapter see nothing new."""
    return {} if adapter is None else {"adapter": adapter}


def parse_adapter_specs(values: Sequence[str]) -> list[AdapterSpec]:
    specs = [AdapterSpec.parse(v) for v in values]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise AdapterError(f"adapter names must be unique, got {names}")
    if len(specs) > MAX_ADAPTERS:
        raise AdapterError(f"at most {MAX_ADAPTERS} adapters per server, got {len(specs)}")
    return specs


def resolve_adapter_path(name_or_path: str) -> pathlib.Path:
    """A local directory holding the adapter: the path itself, or a Hub snapshot of its two files."""
    path = pathlib.Path(name_or_path).expanduser()
    if not path.is_dir():
        if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
            raise AdapterError(f"adapter {name_or_path!r} is not a directory (nor a Hub id like 'user/repo')")
        from huggingface_hub import snapshot_download

        try:
            path = pathlib.Path(snapshot_download(name_or_path, allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS]))
        except Exception as e:
            raise AdapterError(f"could not fetch adapter {name_or_path!r} from the Hub: {e}") from e
    for needed in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / needed).is_file():
            raise AdapterError(
                f"adapter directory {path} has no {needed}: save it with PEFT's save_pretrained "
                "(safetensors; .bin checkpoints are not read)"
            )
    return path


@dataclass
class LoadedAdapter:
    """One adapter's PEFT config and its weights for a span of blocks (keys relative to the checkpoint)."""

    name: str
    config: object  # peft.LoraConfig
    tensors: dict[str, torch.Tensor]


def read_adapter(spec: AdapterSpec, layer_prefixes: Sequence[str]) -> LoadedAdapter:
    """``spec``'s config and only the weights under ``layer_prefixes`` (this span's blocks)."""
    from peft import LoraConfig
    from safetensors import safe_open

    path = resolve_adapter_path(spec.path)
    raw = json.loads((path / ADAPTER_CONFIG).read_text())
    if str(raw.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"adapter {spec.name}: only LoRA adapters are served, {path} is {raw.get('peft_type')}")
    config = LoraConfig.from_pretrained(str(path))
    unsupported = [
        flag for flag, on in (("use_dora", config.use_dora), ("modules_to_save", config.modules_to_save)) if on
    ]
    if unsupported:
        raise AdapterError(f"adapter {spec.name} uses {', '.join(unsupported)}, which servers do not support")
    tensors = {}
    with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
            name = key.removeprefix(_PEFT_PREFIX)
            if not any(name.startswith(prefix) for prefix in layer_prefixes):
                if not _is_block_key(name):
                    raise AdapterError(
                        f"adapter {spec.name} changes {name!r}, outside the transformer blocks; the client "
                        "runs embeddings and the LM head, so only adapters of the blocks can be served"
                    )
                continue
            tensors[name] = f.get_tensor(key)
    return LoadedAdapter(spec.name, config, tensors)


def _is_block_key(name: str) -> bool:
    return re.search(r"\.(layers|h|blocks)\.\d+\.", "." + name) is not None


class _AtCheckpointPath(nn.Module):
    """A module tree that holds one block's 🤗 layer at its checkpoint path (``model.layers.7``)."""

    def __init__(self, layer: nn.Module, prefix: str, config: object):
        super().__init__()
        self.config = config
        parent: nn.Module = self
        *outer, last = prefix.rstrip(".").split(".")
        for part in outer:
            child = nn.Module()
            parent.add_module(part, child)
            parent = child
        parent.add_module(last, layer)


def apply_adapters(block: nn.Module, prefix: str, adapters: Sequence[LoadedAdapter], model_config: object) -> int:
    """Inject every adapter into ``block.layer`` (the block of checkpoint ``prefix``); how many LoRA layers.

    Raises ``AdapterError`` when an adapter's weights for this block are missing or do not fit it."""
    if not adapters:
        return 0  # before importing peft: seconds of every worker's start-up when no adapter is served
    from peft import inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    root = _AtCheckpointPath(block.layer, prefix, model_config)
    for adapter in adapters:
        state = {k: v for k, v in adapter.tensors.items() if k.startswith(prefix)}
        if not state:
            continue  # the adapter leaves this block alone (layers_to_transform, target patterns)
        try:
            with warnings.catch_warnings():  # "Already found a peft_config": several adapters, as meant
                warnings.simplefilter("ignore", UserWarning)
                inject_adapter_in_model(adapter.config, root, adapter_name=adapter.name)
            result = set_peft_model_state_dict(root, state, adapter_name=adapter.name)
        except (ValueError, RuntimeError, KeyError) as e:
            raise AdapterError(f"adapter {adapter.name} does not fit block {prefix!r}: {e}") from e
        missing = [k for k in result.missing_keys if "lora_" in k and f".{adapter.name}." in k]
        if result.unexpected_keys or missing:
            raise AdapterError(
                f"adapter {adapter.name} does not fit block {prefix!r}: "
                f"missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}"
            )
    layers = [m for m in block.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer.set_adapter([])  # nothing active: rows choose their adapter through ``adapter_rows``
        if not getattr(layer, "_swarm_rows_hook", False):
            layer.register_forward_pre_hook(_pass_row_adapters, with_kwargs=True)
            layer._swarm_rows_hook = True
    block.requires_grad_(False)
    return len(layers)


def adapters_of(block: nn.Module) -> set[str]:
    """The names of the adapters injected into ``block``."""
    from peft.tuners.lora import LoraLayer

    return {name for m in block.modules() if isinstance(m, LoraLayer) for name in m.lora_A}


@dataclass(frozen=True)
class RowAdapters:
    """The adapter of each sequence of a step (``names``; None for the base model), or one for all rows."""

    names: tuple[str | None, ...] | str
    #: ``for_rows`` by row count: every projection of every block asks again within one step
    _memo: dict[int, list[str]] = field(default_factory=dict, compare=False, repr=False)

    def for_rows(self, rows: int) -> list[str]:
        if rows not in self._memo:
            self._memo[rows] = self._names_for(rows)
        return self._memo[rows]

    def _names_for(self, rows: int) -> list[str]:
        if isinstance(self.names, str):
            return [self.names] * rows
        if not self.names or rows % len(self.names):
            raise ValueError(f"{rows} rows do not split into {len(self.names)} sequences of one adapter each")
        repeat = rows // len(self.names)  # a [B, T] step flattened to B*T rows, row-major
        return [name or BASE for name in self.names for _ in range(repeat)]


def _pass_row_adapters(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    rows = _ROWS.get()
    if rows is None or not args:
        return None
    kwargs["adapter_names"] = rows.for_rows(len(args[0]))
    return args, kwargs


@contextlib.contextmanager
def adapter_rows(names: str | Sequence[str | None] | None) -> Iterator[None]:
    """Run the blocks inside with ``names``: one adapter for every row (a str), one per sequence/row (a
    sequence, None for the base model), or the base model alone (None, or no adapter named)."""
    if names is None or (not isinstance(names, str) and not any(names)):
        rows = None
    else:
        rows = RowAdapters(names if isinstance(names, str) else tuple(names))
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)
