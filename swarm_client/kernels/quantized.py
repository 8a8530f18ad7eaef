"""Weight-only int8 and NF4 projections on the quantized CPU kernel (``quant_gemm``): ``nn.Linear``'s interface,
used by quantized workers (worker/quant.py) and by the gateway's quantized draft model
(gateway/speculation/drafting.py).
Where the kernel cannot be built they run ``F.linear`` on the dequantized weight (slow, same numbers)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from swarm_client.kernels import quant_gemm
from swarm_client.kernels.cpu_kernels import _PackedProjection, projections
from swarm_client.precision import Quant

logger = logging.getLogger(__name__)


class Int8Linear(_PackedProjection):
    """``nn.Linear`` with int8 weights (one scale per output channel) on the quantized panel kernel."""

    quant = Quant.INT8.value

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.panels, self.scales = quant_gemm.pack_int8(*quant_gemm.quantize_int8(linear.weight))

    @property
    def weight(self) -> torch.Tensor:
        return quant_gemm.unpack_int8(self.panels, self.scales, self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        if quant_gemm.load() is None:
            return F.linear(rows, self.weight, self.bias)
        return quant_gemm.int8_linear(rows, self.panels, self.scales, self.out_features, self.bias)


class NF4Linear(_PackedProjection):
    """``nn.Linear`` with NF4 weights (absmax per 64 weights of a row) on the quantized panel kernel."""

    quant = Quant.NF4.value

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.panels, self.absmax = quant_gemm.pack_nf4(*quant_gemm.quantize_nf4(linear.weight))

    @property
    def weight(self) -> torch.Tensor:
        return quant_gemm.unpack_nf4(self.panels, self.absmax, self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        if quant_gemm.load() is None:
            return F.linear(rows, self.weight, self.bias)
        return quant_gemm.nf4_linear(rows, self.panels, self.absmax, self.out_features, self.bias)


def quantize_linear(linear: nn.Linear, quant: str) -> Int8Linear | NF4Linear:
    """``linear`` as an ``Int8Linear`` (``quant="int8"``) or ``NF4Linear`` (``"nf4"``)."""
    return {Quant.INT8.value: Int8Linear, Quant.NF4.value: NF4Linear}[quant](linear)


def quantize_linears(block: nn.Module, quant: str) -> int:
    """Replace the CPU block's ``PACKABLE`` ``nn.Linear`` layers by ``Int8Linear`` / ``NF4Linear``; how many."""
    if quant_gemm.load() is None:
        why = quant_gemm.load_error()
        logger.warning("quantized kernel unavailable (%s): %s runs on dequantized weights", why, quant)
    count = 0
    for parent, name, child in projections(block):
        setattr(parent, name, quantize_linear(child, quant))
        count += 1
    return count
