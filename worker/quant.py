"""Quantized servers (``swarmserve worker --quant none|int8|nf4|auto``): weight-only int8 or NF4 projections.

Only the projections ``cpu_kernels.PACKABLE`` names are quantized (q/k/v/o and the dense MLP); norms,
routers and experts' gates keep the serving dtype. Each block is quantized right after its tensors are
read (worker/loading.py), so loading a span peaks near its quantized size plus one float block.

- CPU: ``Int8Linear`` / ``NF4Linear`` on our kernel (swarm_client/kernels/quant_gemm.py, quantized.py; formats
  there). Where the kernel cannot be built they run ``F.linear`` on the dequantized weight (same numbers).
- CUDA: bitsandbytes' ``Linear8bitLt`` (LLM.int8(), threshold 6) and ``Linear4bit`` (NF4, compute in the
  serving dtype), as Petals does; bitsandbytes is an optional dependency (``pip install swarmserve[cuda]``),
  imported only by a CUDA server that asks for a quantization. **Not run here: no GPU on this machine.**
- ``auto``: the most precise of none / int8 / nf4 whose weights fit in 80% of the memory free on the
  device (CUDA: ``torch.cuda.mem_get_info``; CPU: available RAM), logging the estimate behind the choice.

Gradients (``rpc_backward``, prompt tuning through a quantized server) work on CPU: a step that needs them
runs ``F.linear`` on the dequantized weight, i.e. the gradient of the quantized model a forward computes.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from swarm_client.kernels import quant_gemm
from swarm_client.kernels.cpu_kernels import projections
from swarm_client.precision import Quant

logger = logging.getLogger(__name__)

#: ``--quant`` choices
QUANT_CHOICES = ("none", "int8", "nf4", "auto")
#: bytes a quantized projection weight takes per parameter (scales and absmax included)
BYTES_PER_PARAM = {Quant.INT8.value: 1.0, Quant.NF4.value: 0.5 + 4 / quant_gemm.NF4_BLOCK}
#: ``auto`` keeps this share of the free memory for the weights (the rest: KV caches, activations)
AUTO_WEIGHT_SHARE = 0.8


class QuantizationUnavailable(RuntimeError):
    """The asked-for quantization cannot run here (e.g. CUDA without bitsandbytes); the message says why."""


def bitsandbytes_module():
    """``bitsandbytes``, or QuantizationUnavailable saying how to install it."""
    try:
        import bitsandbytes
    except ImportError as exc:
        raise QuantizationUnavailable(
            f"--quant int8/nf4 on CUDA needs bitsandbytes ({exc}); pip install 'swarmserve[cuda]'"
        ) from exc
    return bitsandbytes


def quantize_linears_cuda(block: nn.Module, quant: str, compute_dtype: torch.dtype) -> int:
    """Replace the block's projections (still on the CPU) by bitsandbytes modules, as Petals'
    ``convert_block`` does; their weights are quantized when the block is moved to the GPU."""
    bnb = bitsandbytes_module()
    count = 0
    for parent, name, child in projections(block):
        bias = child.bias is not None
        shape = (child.in_features, child.out_features, bias)
        if quant == Quant.INT8.value:
            new = bnb.nn.Linear8bitLt(*shape, has_fp16_weights=False, threshold=6.0)
            new.weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(*shape, compute_dtype=compute_dtype, quant_type="nf4")
            new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
        if bias:
            new.bias = nn.Parameter(child.bias.data, requires_grad=False)
        setattr(parent, name, new)
        count += 1
    return count


# ---------------------------------------------------------------- --quant auto
def choose_quant(params: int, float_bytes_per_param: int, free_bytes: int) -> tuple[str, str]:
    """The most precise quantization whose weights fit in ``AUTO_WEIGHT_SHARE`` of ``free_bytes``; and why.
    Where even NF4 does not fit it is still the choice (loading may then fail, with the reason logged)."""
    budget = AUTO_WEIGHT_SHARE * free_bytes
    sizes = {Quant.NONE.value: params * float_bytes_per_param}
    sizes.update({q: params * b for q, b in BYTES_PER_PARAM.items()})
    gib = 2**30
    for quant, size in sizes.items():
        if size <= budget:
            return quant, f"the span's weights take ~{size / gib:.2f} GiB as {quant}, within {budget / gib:.2f} GiB"
    size = sizes[Quant.NF4.value]
    return Quant.NF4.value, f"even nf4 (~{size / gib:.2f} GiB) exceeds {budget / gib:.2f} GiB; trying nf4 anyway"


def span_parameters(model_dir: str, prefixes: list[str]) -> int:
    """Parameters under ``prefixes`` in the checkpoint, read from the safetensors headers only."""
    from safetensors import safe_open

    from swarm_client.model_source import ensure_shards

    total = 0
    for file_name in ensure_shards(model_dir, prefixes):
        with safe_open(os.path.join(model_dir, file_name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if any(key.startswith(p) for p in prefixes):
                    shape = f.get_slice(key).get_shape()
                    total += int(torch.tensor(shape).prod()) if shape else 1
    return total


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: the GPU's free memory, or the RAM available to new allocations."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_quant(requested: str, model_dir: str, prefixes: list[str], dtype: torch.dtype, device: torch.device) -> str:
    """``requested`` itself, or for ``auto`` the choice of ``choose_quant`` for this span on this device."""
    if requested not in QUANT_CHOICES:
        raise ValueError(f"unknown quantization {requested!r}; choose one of {', '.join(QUANT_CHOICES)}")
    if requested != "auto":
        return requested
    params = span_parameters(model_dir, prefixes)
    quant, why = choose_quant(params, dtype.itemsize, free_memory(device))
    logger.info("--quant auto chose %s for %.1fM parameters on %s: %s", quant, params / 1e6, device, why)
    return quant
