"""Build only this server's blocks, reading only their tensors from the checkpoint."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from swarm_client.families import Family
from swarm_client.kernels.cpu_kernels import pack_linears, resolve_cpu_kernels
from swarm_client.kernels.quantized import quantize_linears
from swarm_client.lora import AdapterSpec, apply_adapters, read_adapter
from swarm_client.model_source import ensure_shards
from swarm_client.weights import load_tensors
from worker.quant import quantize_linears_cuda, resolve_quant

logger = logging.getLogger(__name__)


def load_blocks(
    model_dir: str,
    config: PretrainedConfig,
    family: Family,
    start: int,
    end: int,
    dtype: torch.dtype,
    device: torch.device,
    max_disk_space: int | str | None = None,
    cpu_kernels: str = "torch",
    quant: str = "none",
    adapters: Sequence[AdapterSpec] = (),
) -> list[nn.Module]:
    """Blocks ``[start, end)`` in ``dtype`` on ``device``; tensors of other blocks are never read.

    From a Hub snapshot, the shards holding the span are downloaded first, all or none: the whole span's
    size is checked against ``max_disk_space`` (and the free space) before the first byte is fetched.
    ``cpu_kernels``: on a float32 CPU server, put the projections on packed weights (``auto``, ``panels``,
    ``onednn``; swarm_client/kernels/cpu_kernels.py); elsewhere, and with ``torch``, blocks keep plain layers.
    ``quant`` (``none``, ``int8``, ``nf4``, ``auto``; worker/quant.py): each block's projections are
    quantized right after its tensors are read, so the span never sits in memory at full precision.
    ``adapters``: PEFT LoRA checkpoints injected into every block (only the span's weights are read;
    swarm_client/lora.py), before packing or quantizing, which then apply to the LoRA layers' base layers.
    """
    prefixes = [family.layer_prefix(i) for i in range(start, end)]
    shards = ensure_shards(model_dir, prefixes, max_disk_space)
    quant = resolve_quant(quant, model_dir, prefixes, dtype, device)
    kind = resolve_cpu_kernels(cpu_kernels, device, dtype) if quant == "none" else "torch"
    if cpu_kernels != "torch" and quant == "none":
        logger.info("projections run on %s kernels (asked for %s)", kind, cpu_kernels)
    on_gpu = device.type == "cuda" and quant != "none"  # bitsandbytes quantizes while moving to the GPU
    logger.info("blocks %d:%d live in %d checkpoint file(s): %s", start, end, len(shards), ", ".join(shards))
    loaded = [read_adapter(spec, prefixes) for spec in adapters]
    for spec, adapter in zip(adapters, loaded, strict=True):
        logger.info(
            "adapter %s (%s): %d tensors for blocks %d:%d", spec.name, spec.path, len(adapter.tensors), start, end
        )
    blocks = []
    for index in range(start, end):
        prefix = family.layer_prefix(index)
        where = "cpu" if on_gpu else str(device)
        tensors = load_tensors(model_dir, [prefix], dtype=dtype, device=where, progress=False)
        if not tensors:
            raise ValueError(f"checkpoint {model_dir} has no tensors for block {index} (prefix {prefix!r})")
        relative = {name[len(prefix) :]: t for name, t in tensors.items()}
        block = family.build_block(config, index, relative)
        apply_adapters(block, prefix, loaded, config)
        block.requires_grad_(False)
        del tensors, relative  # the float weights of quantized projections go with them
        packed = 0
        if on_gpu:
            packed = quantize_linears_cuda(block, quant, dtype)
        elif quant != "none":
            packed = quantize_linears(block, quant)
        block = block.to(device)
        if kind != "torch":
            packed = pack_linears(block, kind)
        if packed and device.type == "cpu":
            _own_storage(block)
            release_freed_memory()
        blocks.append(block)
        how = f"quantized to {quant}" if quant != "none" else "packed"
        logger.info("loaded block %d (%s)", index, f"{packed} projections {how}" if packed else "plain")
    return blocks


def _own_storage(block: nn.Module) -> None:
    """Copy the block's remaining tensors out of the checkpoint's memory map. Otherwise a norm weight
    keeps the whole mapped file alive, and with it the pages the packed projections were read from:
    measured on the medium model's 8 blocks, 779 MB resident instead of 430."""
    for module in block.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.clone()


def release_freed_memory() -> None:
    """Hand memory freed by the allocator back to the system (glibc's ``malloc_trim``; a no-op elsewhere).
    Packing and quantizing a block free float temporaries and its checkpoint copy; glibc keeps such memory
    for reuse, and a span's resident size grew by them: measured on the medium model's 8 blocks in NF4,
    193 MB resident without this."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resolve_dtype(name: str, device: torch.device, config: PretrainedConfig | None = None) -> torch.dtype:
    """``auto`` → bfloat16 on GPU, float32 on CPU (CPU half-precision matmuls are slow and inexact)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        dtype = getattr(torch, name)
    except AttributeError:
        dtype = None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16, float16 or auto")
    return dtype
