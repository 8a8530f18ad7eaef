"""CPU kernels both sides run: the panel GEMM and oneDNN-packed projections (``cpu_gemm``, ``cpu_kernels``),
the int8/NF4 weight-only kernel (``quant_gemm``) and the quantized projections on it (``quantized``). Workers
run their blocks on them (worker/loading.py, worker/quant.py); the gateway runs a quantized draft model on
them (gateway/speculation/drafting.py). Each C++ source in ``csrc/`` is built once per machine and loaded with
ctypes."""
