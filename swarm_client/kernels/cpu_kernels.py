"""Packed projections for CPU servers: faster decode, and batches that cost much less than their rows.

Two packings, chosen per server with ``--cpu-kernels`` (``resolve_cpu_kernels``):

- ``panels`` (the default where it builds: x86 with AVX2/FMA and a C++ compiler): our own small-batch
  kernel (swarm_client/kernels/cpu_gemm.py): 8 decode rows cost ≈2× one row, and results are batch-invariant;
- ``onednn``: oneDNN's own layout (below), the fallback;
- ``torch``: plain ``nn.Linear``.

Stock ``F.linear`` on CPU goes through MKL's GEMV for one row and a general GEMM for more; measured here on a
2-core AMD EPYC, one thread, a 2816×1024 float32 projection out of cache: 1 row 0.62 ms, 2 rows 1.21 ms,
8 rows 1.32 ms. The same projection with oneDNN on weights converted once to its own layout: 0.53 ms,
0.73 ms, 0.85 ms. One row gets faster, and eight rows cost 1.6× one row instead of 2.15×, which is what
continuous batching lives on. Only inference uses the packed kernel; a step that needs gradients
(``rpc_backward``) runs ``F.linear`` on an unpacked copy of the weight, so fine-tuning works unchanged.
Results differ from ``F.linear`` by float rounding only (~1e-6 relative).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from swarm_client.kernels import cpu_gemm

logger = logging.getLogger(__name__)

#: projections of attention and of dense MLPs (Llama, Mistral, Qwen2, Mixtral attention); routers and
#: expert weights are left alone (a router's top-k must see exactly the numbers 🤗 computes)
PACKABLE = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


#: ``--cpu-kernels`` choices; ``auto`` is the fastest that works here
CPU_KERNELS = ("auto", "panels", "onednn", "torch")


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing works here."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def resolve_cpu_kernels(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernels a server will really use for ``requested``: ``panels``, ``onednn`` or ``torch``.

    Packing applies to float32 CPU servers only; ``auto`` and ``panels`` fall back to oneDNN when the panel
    kernel cannot be built or run here (the log says why), and oneDNN to plain torch without mkldnn.
    """
    if requested not in CPU_KERNELS:
        raise ValueError(f"unknown cpu kernels {requested!r}; choose one of {', '.join(CPU_KERNELS)}")
    if device.type != "cpu" or dtype != torch.float32 or requested == "torch":
        return "torch"
    if requested in ("auto", "panels"):
        if cpu_gemm.load() is not None:
            return "panels"
        logger.warning("panel kernel unavailable (%s): using oneDNN", cpu_gemm.load_error())
    return "onednn" if packing_supported(device, dtype) else "torch"


class _PackedProjection(nn.Module):
    """What both packings share: ``nn.Linear``'s interface over a weight held in a kernel's own layout (the
    dense weight is not kept). Inference on float32 rows goes to ``_rows``; anything that needs gradients,
    or another dtype, runs ``F.linear`` on a dense copy, so fine-tuning works unchanged."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy, for code that reads the weight directly (and for gradients)."""
        raise NotImplementedError

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [M, in] float32, contiguous → [M, out]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        out = self._rows(x.reshape(-1, self.in_features).contiguous())
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PanelLinear(_PackedProjection):
    """The projection on the panel kernel's 16-column panels (swarm_client/kernels/cpu_gemm.py)."""

    def __init__(self, linear: nn.Linear):
        if cpu_gemm.load() is None:
            raise RuntimeError(f"panel kernel unavailable: {cpu_gemm.load_error()}")
        super().__init__(linear)
        self.panels = cpu_gemm.pack(linear.weight)

    @property
    def weight(self) -> torch.Tensor:
        return cpu_gemm.unpack(self.panels, self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(rows, self.panels, self.out_features, self.bias)


class PackedLinear(_PackedProjection):
    """The projection on weights in oneDNN's layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        with torch.no_grad():
            self.packed = linear.weight.detach().contiguous().to_mkldnn()
        bias = self.bias if self.bias is not None else torch.zeros(self.out_features)
        self._packed_bias = bias.to_mkldnn()

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.mkldnn_linear(rows.to_mkldnn(), self.packed, self._packed_bias).to_dense()


def pack_linears(block: nn.Module, kind: str = "onednn") -> int:
    """Replace the block's ``PACKABLE`` ``nn.Linear`` layers by ``PanelLinear`` (``kind="panels"``) or
    ``PackedLinear`` (``"onednn"``); returns how many."""
    packer = {"panels": PanelLinear, "onednn": PackedLinear}[kind]
    count = 0
    for parent, name, child in projections(block):
        setattr(parent, name, packer(child))
        count += 1
    return count


def projections(block: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, name, linear)`` of the block's plain ``PACKABLE`` projections; under a PEFT LoRA layer
    (swarm_client/lora.py) the projection is the LoRA layer's ``base_layer``."""
    found = []
    for path, parent in list(block.named_modules()):
        own = path.rsplit(".", 1)[-1]
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (name in PACKABLE or (name == "base_layer" and own in PACKABLE)):
                found.append((parent, name, child))
    return found
