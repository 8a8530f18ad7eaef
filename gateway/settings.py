"""Settings of one gateway process, read from ``SWARMSERVE_*`` environment variables (or passed in).

List fields accept JSON (``'["http://a", "http://b"]'``) or a comma-separated string (``http://a,http://b``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["GatewaySettings"]


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWARMSERVE_", extra="ignore", validate_default=True)

    #: path or hub id of the served model; requests may name it or its basename
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    #: extra model names of served LoRA adapters, ``NAME=ALIAS`` (the model ``ALIAS`` runs adapter ``NAME``;
    #: ``BASE:NAME`` always does): gateway/backends/adapters.py
    adapter_aliases: Annotated[list[str], NoDecode] = Field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["*"])
    #: completion budget when a request names none (capped by what is left of the context window)
    default_max_tokens: int = Field(default=512, ge=1)
    #: most choices (``n``, times prompts for /v1/completions) one request may ask for
    max_choices: int = Field(default=16, ge=1)
    #: wall-clock limit of one request, generation included; 0 disables it
    request_timeout_s: float = Field(default=600.0, ge=0)
    #: threads for blocking backend calls: one per step in flight, so at least the expected concurrent choices
    backend_threads: int = Field(default=64, ge=1)
    #: run the next-token steps of all choices decoding at once as one call (backends with ``step_many``:
    #: the swarm); False: every choice steps in a thread of its own (gateway/decode/batch.py)
    batch_decode: bool = True
    #: speculative decoding (gateway/speculation/verify.py): ``auto`` drafts with ``draft_model`` when set, else by
    #: prompt lookup, sending guesses only while they pay; ``off``: only requests that ask for it guess
    speculation: Literal["auto", "off", "prompt_lookup", "draft_model"] = "auto"
    #: most guesses one step carries (fewer where the measured acceptance and step costs say so)
    max_draft_tokens: int = Field(default=8, ge=1, le=16)
    #: a small local 🤗 causal LM with the served model's tokenizer that drafts; the served model's own path
    #: with ``draft_layers`` is self-speculation (its first layers + its head)
    draft_model: str | None = None
    draft_layers: int | None = Field(default=None, ge=1)
    #: the draft model's projections quantized (CPU, the workers' int8/NF4 kernels): a cheaper draft; its
    #: guesses are still checked by the served model, so the output is the same
    draft_quant: Literal["none", "int8", "nf4"] = "none"
    #: what a 503 tells the client to wait before retrying
    retry_after_s: int = Field(default=5, ge=0)
    #: how long a request waits in line for room when every server is full (gateway/decode/capacity_queue.py)
    #: before its 503 + Retry-After; 0: answer the 503 at once
    busy_queue_timeout_s: float = Field(default=8.0, ge=0)
    #: session-affinity store, rate-limit counters and stored responses; None = in-memory (one gateway replica)
    redis_url: str | None = None
    #: stored responses of /v1/responses (gateway/responses/store.py): how long each is kept, the largest
    #: one (a longer conversation is refused unless ``store: false``), and in memory the most entries and
    #: bytes in all; in Redis (``redis_url``) the most entries per owner
    responses_ttl_s: float = Field(default=3600.0, gt=0)
    responses_max_entry_bytes: int = Field(default=4 * 2**20, ge=1)
    responses_max_entries: int = Field(default=10_000, ge=1)
    responses_max_bytes: int = Field(default=256 * 2**20, ge=1)
    responses_max_per_owner: int = Field(default=1000, ge=1)
    #: resume the servers' KV caches of earlier requests that share the prompt's prefix (gateway/affinity/sessions.py)
    affinity: bool = True
    #: how long a finished session stays resumable: the workers' ``--session-ttl``
    affinity_ttl_s: float = Field(default=300.0, gt=0)
    #: granularity (tokens) of the prefix index that finds the longest cached prefix
    affinity_block_tokens: int = Field(default=16, ge=1)
    #: this replica's name in affinity records (default: host, pid and a random suffix)
    replica_id: str | None = None
    #: how the served model writes tool calls (gateway/tools/formats.py); auto: read from its chat template
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral", "prompt"] = "auto"
    initial_peers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    #: trust policy: peer ids allowed to serve the model's first and last block, whose activations are closest
    #: to the text (``ClientConfig.trusted_peers``); empty: any server may
    trusted_peers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    log_level: str = "info"

    # access control and limits (gateway/admission/auth.py, gateway/admission/ratelimit.py, gateway/admission/limits.py)
    #: accepted API keys (``Authorization: Bearer <key>``); none here nor in ``api_keys_file``: API open
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)
    #: a file of API keys, one per line, ``#`` comments
    api_keys_file: str | None = None
    #: paths served without a key (``/prefix*`` for a prefix); the chat page is static (its requests send the
    #: key the user types), so a browser can open it
    auth_exempt_paths: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["/health", "/metrics", "/chat"])
    #: per key, on the generation routes, requests / tokens (prompt + max_tokens) per minute; 0 = no limit.
    #: Counted in ``redis_url`` when set (shared by replicas), else in this process
    rate_limit_rpm: int = Field(default=0, ge=0)
    #: addresses of reverse proxies whose ``X-Forwarded-For`` names the client (rate limits on an open gateway
    #: count per client address); nobody else's header is believed
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    rate_limit_tpm: int = Field(default=0, ge=0)
    #: a tiktoken ``.tiktoken`` BPE file to count tokens for the TPM limit instead of the model's tokenizer
    rate_limit_tiktoken_file: str | None = None
    #: largest request body accepted (413 above it, before parsing); 0 = no limit
    max_body_bytes: int = Field(default=8 * 2**20, ge=0)
    #: choices decoding at once, over all generation requests (streamed or not; ``n=16`` holds 16); None: 8
    #: per CPU core, at most ``backend_threads``, at least ``max_choices`` (gateway/admission/stream_slots.py); 0 = none
    max_concurrent_streams: int | None = Field(default=None, ge=0)
    #: requests that may wait for slots (503 + Retry-After beyond), and for how long at most
    max_queued_streams: int = Field(default=32, ge=0)
    stream_queue_timeout_s: float = Field(default=30.0, ge=0)

    @field_validator(
        "cors_origins",
        "initial_peers",
        "api_keys",
        "auth_exempt_paths",
        "trusted_proxies",
        "trusted_peers",
        "adapter_aliases",
        mode="before",
    )
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value
