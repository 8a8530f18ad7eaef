"""Weight-only int8 and NF4 formats for CPU servers, and the kernel that multiplies by them
(``csrc/quant_gemm.cpp``, built and loaded like the float32 panel kernel of ``cpu_gemm``).

- int8: symmetric, one float32 scale per output channel: ``w ≈ q * scale``, ``q`` in [-127, 127],
  ``scale = max|w_row| / 127``. 1 byte a weight (+4 bytes a row).
- NF4: bitsandbytes' 4-bit NormalFloat (QLoRA): each run of 64 weights along a row has its own absmax,
  and ``w ≈ NF4_TABLE[code] * absmax`` with the nearest of the 16 table values. 0.5 byte a weight
  (+4 bytes per 64 weights, not double-quantized: 0.5625 byte a weight in all).

Why our own kernel: measured on the 2-core AMD EPYC (one thread, the medium model's four layers'
projections, 1 row), torch's ``aten._weight_int8pack_mm`` took 38.8 ms against 7.8 ms for the float32 panel
kernel (4 rows: 170 vs 10.9 ms): its CPU path is not made for decode-sized batches; bitsandbytes 0.50's
CPU NF4 took 2.08 ms for one 2816×1024 projection where ours takes 0.38. Ours widens the int8 or NF4
weights to float32 in registers and accumulates in float32 FMA chains, one per output element in k order,
so its rows are batch-invariant like the float32 panel kernel's. Same four layers, 1 / 4 / 8 rows: float32
panels 7.4 / 10.6 / 15.1 ms, int8 2.8 / 5.2 / 9.4 ms (AVX-512 where the CPU has it: one conversion per
16 weights; 4.2 / 6.6 / 12.7 ms on AVX2 alone), NF4 5.5 / 8.0 / 15.1 ms (AVX2).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

from swarm_client.kernels import cpu_gemm

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "quant_gemm.cpp"
PANEL = cpu_gemm.PANEL
#: weights per NF4 absmax (bitsandbytes' default blocksize for 4-bit)
NF4_BLOCK = 64
#: bitsandbytes' NF4 code book (``bitsandbytes.functional.get_4bit_type("nf4")``)
NF4_TABLE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])  # fmt: skip
_NF4_MIDPOINTS = (NF4_TABLE[1:] + NF4_TABLE[:-1]) / 2

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_error: str | None = None


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None (``load_error()`` says why) where it cannot run."""
    global _library, _load_error
    with _lock:
        if _library is not None or _load_error is not None:
            return _library
        if not cpu_gemm.cpu_has_avx2_fma():
            _load_error = f"this CPU lacks AVX2/FMA (torch sees {torch.backends.cpu.get_cpu_capability()})"
            return None
        try:
            lib = cpu_gemm.build_and_load(SOURCE, "quant_gemm")
            p, n = ctypes.c_void_p, ctypes.c_long
            lib.swarm_int8_gemm.argtypes = [p, n, n, n, p, p, n, p, n, p, n, n]
            lib.swarm_nf4_gemm.argtypes = [p, n, n, n, p, p, p, n, p, n, p, n, n]
            lib.swarm_int8_gemm.restype = lib.swarm_nf4_gemm.restype = None
            _library = lib
        except Exception as exc:
            _load_error = f"{type(exc).__name__}: {exc}"
        return _library


def load_error() -> str | None:
    return _load_error


# ---------------------------------------------------------------- formats (dense [N, K] in nn.Linear's layout)
#: rows quantized at a time: keeps the float temporaries of a large projection to a few MB
CHUNK_ROWS = 256


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] → (``q`` int8 [N, K], ``scales`` float32 [N]); |w - q * scale| ≤ scale / 2."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n)
    for a in range(0, n, CHUNK_ROWS):
        w = weight[a : a + CHUNK_ROWS].detach().float()
        s = w.abs().amax(dim=1) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row stays zero
        q[a : a + CHUNK_ROWS] = torch.round(w / s[:, None]).clamp_(-127, 127)
        scales[a : a + CHUNK_ROWS] = s
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales[:, None]


def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] → (``codes`` uint8 [N, K] in 0..15, ``absmax`` float32 [N, ceil(K / 64)])."""
    n, k = weight.shape
    blocks = -(-k // NF4_BLOCK)
    codes = torch.empty(n, k, dtype=torch.uint8)
    absmax = torch.empty(n, blocks)
    for a in range(0, n, CHUNK_ROWS):
        w = weight[a : a + CHUNK_ROWS].detach().float()
        rows = w.shape[0]
        padded = torch.zeros(rows, blocks * NF4_BLOCK)
        padded[:, :k] = w
        padded = padded.view(rows, blocks, NF4_BLOCK)
        m = padded.abs().amax(dim=2)
        m = torch.where(m > 0, m, torch.ones_like(m))
        nearest = torch.bucketize(padded / m[:, :, None], _NF4_MIDPOINTS, out_int32=True)
        codes[a : a + CHUNK_ROWS] = nearest.view(rows, -1)[:, :k]
        absmax[a : a + CHUNK_ROWS] = m
    return codes, absmax


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    values = NF4_TABLE[codes.long()]
    return values * absmax.repeat_interleave(NF4_BLOCK, dim=1)[:, :k]


# ---------------------------------------------------------------- the kernel's panel layouts
def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (panels int8 [P, K, 16], scales float32 [P * 16]); padded columns are zero."""
    n, k = q.shape
    p = -(-n // PANEL)
    panels = _padded_rows(q, p * PANEL).view(p, PANEL, k).transpose(1, 2).contiguous()
    return panels, _padded_rows(scales.float(), p * PANEL).contiguous()


def unpack_int8(panels: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """The dense float32 [N, K] weight the kernel multiplies by."""
    p, k, _ = panels.shape
    q = panels.transpose(1, 2).reshape(p * PANEL, k)[:out_features]
    return dequantize_int8(q, scales[:out_features])


def pack_nf4(codes: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (panels uint8 [P, K, 8]: byte j = column j | column j + 8 << 4, absmax float32 [P, KB, 16])."""
    n, k = codes.shape
    p = -(-n // PANEL)
    cols = _padded_rows(codes, p * PANEL).view(p, PANEL, k).transpose(1, 2)  # [P, K, 16]
    panels = (cols[:, :, :8] | (cols[:, :, 8:] << 4)).contiguous()
    blocks = absmax.shape[1]
    scales = _padded_rows(absmax.float(), p * PANEL).view(p, PANEL, blocks).transpose(1, 2).contiguous()
    return panels, scales


def unpack_nf4(panels: torch.Tensor, absmax: torch.Tensor, out_features: int) -> torch.Tensor:
    p, k, _ = panels.shape
    cols = torch.cat([panels & 0x0F, panels >> 4], dim=2)  # [P, K, 16]
    codes = cols.transpose(1, 2).reshape(p * PANEL, k)[:out_features]
    return dequantize_nf4(codes, absmax.transpose(1, 2).reshape(p * PANEL, -1)[:out_features])


# ---------------------------------------------------------------- the kernel
def int8_linear(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, out_features: int,
                bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """``x`` [M, K] float32 contiguous → [M, N] (``load()`` must have succeeded)."""
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    args = (x.data_ptr(), m, k, k, panels.data_ptr(), scales.data_ptr(), out_features, y.data_ptr(),
            out_features, None if bias is None else bias.data_ptr())  # fmt: skip
    cpu_gemm.split_panels(_library.swarm_int8_gemm, args, panels.shape[0])
    return y


def nf4_linear(x: torch.Tensor, panels: torch.Tensor, absmax: torch.Tensor, out_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    args = (x.data_ptr(), m, k, k, panels.data_ptr(), absmax.data_ptr(), _TABLE.data_ptr(), out_features,
            y.data_ptr(), out_features, None if bias is None else bias.data_ptr())  # fmt: skip
    cpu_gemm.split_panels(_library.swarm_nf4_gemm, args, panels.shape[0])
    return y


_TABLE = NF4_TABLE.float().contiguous()
