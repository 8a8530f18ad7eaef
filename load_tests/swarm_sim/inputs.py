"""The simulator's inputs, with their sources: the model, the GPU classes of the servers, the RTT table.

Model: Llama-3.1-70B, 80 blocks; bf16 weights ≈ 141 GB / 80 ≈ 1.75 GB per block; KV cache (GQA, 8 KV heads
× 128 dims × K and V × 2 bytes) = 4 KiB per token per block.

GPU classes: memory and memory bandwidth from the vendors' spec sheets (H100 SXM 80 GB 3.35 TB/s, A100 SXM
80 GB 2.04 TB/s, A100 40 GB 1.56 TB/s, RTX 4090 24 GB 1.01 TB/s, RTX 3090 24 GB 0.94 TB/s, T4 16 GB 0.32 TB/s).
A server holds as many blocks as fit in 80 % of its memory (the rest is its KV cache); its throughput through
one block is the bandwidth-bound decode rate ``bandwidth / block bytes`` times a batch of ``BATCH`` sequences.
That is a model, not a measurement; the mix of classes (``share``) is an assumption of a volunteer swarm
dominated by consumer GPUs.

RTTs: round-trip pings between cities of the WonderProxy network, P. Reinheimer, "Miles per Millisecond: A Look
at the WonderProxy Network", wonderproxy.com/blog/miles-per-milisecond (2011), table "Pings Between Cities",
in ms, the row's city pinging the column's. Zurich is left out (the table's Sydney–Zurich cell was not in the
copy at hand). Two peers in the same city: ``SAME_CITY_RTT_MS`` (an assumption, not in the table).
"""

from __future__ import annotations

from dataclasses import dataclass

NUM_BLOCKS = 80
BLOCK_GB = 1.75
KV_BYTES_PER_TOKEN_BLOCK = 4096
BATCH = 8
SESSION_TOKENS = 2048  # cache a session asks for (cache_tokens_needed)
UPDATE_PERIOD = 5.0  # worker/config.py update_period and swarm_client/client_config.py update_period
EXPIRATION = max(3 * UPDATE_PERIOD, 15.0)  # worker/server.py: cfg.expiration or max(3 × update_period, 15)
TOMBSTONE_EXPIRATION = max(EXPIRATION, 30.0)  # worker/server.py: OFFLINE records
REBALANCE_PERIOD = 60.0  # worker/config.py rebalance_period
LOAD_SECONDS_PER_BLOCK = 2.0  # assumption: reading 1.75 GB of weights from local disk onto the GPU
SAME_CITY_RTT_MS = 5.0


@dataclass(frozen=True)
class GpuClass:
    name: str
    memory_gb: float
    bandwidth_gbps: float
    share: float

    @property
    def blocks(self) -> int:
        return max(1, min(NUM_BLOCKS, int(0.8 * self.memory_gb / BLOCK_GB)))

    @property
    def throughput(self) -> float:
        """Tokens/s through one block (``ServerInfo.throughput``): bandwidth-bound decode of ``BATCH``."""
        return self.bandwidth_gbps / BLOCK_GB * BATCH

    @property
    def cache_tokens(self) -> int:
        free_bytes = (self.memory_gb - self.blocks * BLOCK_GB) * 1e9
        return int(free_bytes / (KV_BYTES_PER_TOKEN_BLOCK * self.blocks))


GPU_CLASSES = (
    GpuClass("H100-80GB", 80, 3350, 0.05),
    GpuClass("A100-80GB", 80, 2039, 0.10),
    GpuClass("A100-40GB", 40, 1555, 0.15),
    GpuClass("RTX4090", 24, 1008, 0.30),
    GpuClass("RTX3090", 24, 936, 0.25),
    GpuClass("T4", 16, 320, 0.15),
)

CITIES = ("Baltimore", "Brisbane", "Dallas", "Fremont", "Milan", "Moscow", "New York", "Paris", "Sydney")
_PINGS_MS = {  # WonderProxy 2011, upper triangle (row city → column city)
    "Baltimore": (239.38, 35.64, 79.68, 104.70, 141.15, 174.71, 97.71, 251.07),
    "Brisbane": (221.60, 174.38, 350.12, 357.21, 245.89, 335.79, 33.45),
    "Dallas": (44.00, 140.00, 168.00, 36.80, 130.94, 221.72),
    "Fremont": (167.85, 214.59, 78.43, 176.22, 184.91),
    "Milan": (67.08, 112.17, 21.61, 344.70),
    "Moscow": (131.29, 56.74, 387.09),
    "New York": (78.33, 319.33),
    "Paris": (348.84,),
}


def rtt_seconds(a: str, b: str) -> float:
    """Round-trip time between two cities of ``CITIES``, in seconds."""
    if a == b:
        return SAME_CITY_RTT_MS / 1000
    i, j = sorted((CITIES.index(a), CITIES.index(b)))
    return _PINGS_MS[CITIES[i]][j - i - 1] / 1000
