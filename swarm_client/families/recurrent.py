"""Which configs keep a recurrent state per session, which the swarm's servers cannot hold.

A server keeps, per session, a KV cache it can roll back, export, resume and push (``worker/cache.py``).
Hybrid and recurrent families (Mamba and other state-space layers, linear attention such as Gated DeltaNet,
short convolutions, RWKV, xLSTM) also carry a state that every token rewrites in place: serving them needs a
per-session state beside the KV cache, rolled back by snapshot — not built (issue 38). They are refused with
this reason instead of failing somewhere inside a block.

The evidence is read off the config as 🤗 writes it: layer kinds in ``layer_types`` / ``layers_block_type``
that are not attention, or the sizes only a recurrent layer has.
"""

from __future__ import annotations

from typing import Any

__all__ = ["recurrent_reason"]

#: layer kinds (``layer_types``, ``layers_block_type``, ``block_types``) that keep a state other than KV
RECURRENT_LAYER_KINDS = frozenset({"linear_attention", "mamba", "conv", "recurrent"})
#: config fields only a recurrent layer has (state-space, linear-attention and convolution state sizes)
RECURRENT_FIELDS = (
    "ssm_state_size",
    "mamba_d_state",
    "state_size",
    "linear_num_value_heads",
    "conv_L_cache",
    "lru_width",
)
#: families whose config names none of the above (every layer is recurrent)
RECURRENT_MODEL_TYPES = {"rwkv": "RWKV time-mixing layers", "xlstm": "xLSTM (mLSTM) layers"}


def recurrent_reason(config: Any) -> str | None:
    """Why ``config``'s model keeps a per-session recurrent state (None: it keeps only a KV cache)."""
    config = getattr(config, "text_config", None) or config
    model_type = getattr(config, "model_type", "")
    if model_type in RECURRENT_MODEL_TYPES:
        return RECURRENT_MODEL_TYPES[model_type]
    kinds: set[str] = set()
    for name in ("layer_types", "layers_block_type", "block_types"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            kinds |= {str(kind) for kind in value}
    recurrent = sorted(kinds & RECURRENT_LAYER_KINDS)
    if recurrent:
        return f"layers of kind {' and '.join(recurrent)}"
    fields = [name for name in RECURRENT_FIELDS if getattr(config, name, None)]
    if fields:
        return f"recurrent layers: its config sets {' and '.join(fields)}"
    return None
