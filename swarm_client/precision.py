"""How exactly a server computes its blocks: the weight quantization it announces, and what a client accepts.

A server announces ``ServerInfo.quant``: ``none`` (weights in the announced dtype), ``int8`` (weight-only,
one scale per output channel) or ``nf4`` (4-bit NormalFloat, one absmax per block of weights, as in
bitsandbytes / QLoRA). A client that needs the exact numbers of the full model (``ClientConfig.min_precision``,
``--min-precision`` on the gateway) is never routed through a server below that precision.
"""

from __future__ import annotations

import enum

__all__ = ["MIN_PRECISIONS", "Quant", "accepts", "check_min_precision", "precision_rank"]


class Quant(enum.StrEnum):
    NONE = "none"
    INT8 = "int8"
    NF4 = "nf4"


#: higher is closer to the full model; a value this version does not know ranks below all of them
_RANK = {Quant.NONE.value: 3, Quant.INT8.value: 2, Quant.NF4.value: 1}

#: ``ClientConfig.min_precision`` choices: ``full`` accepts only ``none``; ``int8`` accepts ``none`` and
#: ``int8``; ``any`` accepts every server (also quantizations newer than this client)
MIN_PRECISIONS = ("full", "int8", "nf4", "any")
_MIN_RANK = {"full": 3, "int8": 2, "nf4": 1, "any": 0}


def precision_rank(quant: str) -> int:
    """3 for full precision, 2 for int8, 1 for nf4, 0 for a quantization this version does not know."""
    return _RANK.get(quant, 0)


def check_min_precision(value: object) -> str:
    """``value`` if it is a valid ``min_precision``; a ValueError that lists the choices otherwise."""
    if value not in MIN_PRECISIONS:
        raise ValueError(f"min_precision must be one of {', '.join(MIN_PRECISIONS)}, got {value!r}")
    return value  # type: ignore[return-value]


def accepts(min_precision: str, quant: str) -> bool:
    """A client asking for at least ``min_precision`` may route through a server announcing ``quant``."""
    return precision_rank(quant) >= _MIN_RANK[min_precision]
