"""Settings of one gateway process, read from ``SWARMSERVE_*`` environment variables (or passed in).

List fields accept JSON (``'["http://a", "http://b"]'``) or a comma-separated string (``http://a,http://b``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["GatewaySettings"]


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWARMSERVE_", extra="ignore", validate_default=True)

    #: path or hub id of the served model; requests may name it or its basename
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
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
    #: what a 503 tells the client to wait before retrying
    retry_after_s: int = Field(default=5, ge=0)
    #: session-affinity store; None = in-memory (one gateway replica)
    redis_url: str | None = None
    initial_peers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    log_level: str = "info"

    @field_validator("cors_origins", "initial_peers", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value
