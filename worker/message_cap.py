"""A cap on what hivemind buffers for one stream message, before any of our handlers sees it.

hivemind's stream handlers read each message whole (``P2P.receive_raw_data``: an 8-byte length, then
exactly that many bytes) before our code can check anything, so a peer could announce a 100 GiB message
and the server would keep reading. ``install_message_cap`` wraps that function once per process: a message
longer than ``max_message_bytes`` — or one that would take the bytes being read by all streams at once past
``max_receiving_bytes`` — is refused after reading only its header, and its stream is dropped (hivemind
logs the refusal and closes the stream; the peer sees it end). Nothing else changes: every message our own
clients send is far smaller (``protocol.MAX_STEP_BYTES``, ``protocol.STREAM_CHUNK_BYTES``).

Unary calls (``rpc_info``) do not pass through here: the p2p daemon hands them over whole.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from hivemind.p2p import P2P

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
DEFAULT_MAX_RECEIVING_BYTES = 1024 * 2**20


class MessageTooLargeError(ConnectionError):
    """A stream message over the cap: the stream is dropped without reading it."""


@dataclass
class MessageCap:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_receiving_bytes: int = DEFAULT_MAX_RECEIVING_BYTES
    #: bytes of messages being read right now, all streams together
    receiving: int = 0
    refused: int = 0

    async def receive(self, reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if length > self.max_message_bytes:
            self._refuse(f"a stream message of {length} bytes exceeds the cap of {self.max_message_bytes}")
        if self.receiving + length > self.max_receiving_bytes:
            self._refuse(
                f"a stream message of {length} bytes would take the bytes being received past "
                f"{self.max_receiving_bytes} ({self.receiving} in flight)"
            )
        self.receiving += length
        try:
            return await reader.readexactly(length)
        finally:
            self.receiving -= length

    def _refuse(self, reason: str) -> None:
        self.refused += 1
        logger.warning("dropping a stream unread: %s", reason)
        raise MessageTooLargeError(reason)


_cap: MessageCap | None = None


def install_message_cap(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_receiving_bytes: int = DEFAULT_MAX_RECEIVING_BYTES
) -> MessageCap:
    """Cap stream messages in this process (idempotent; a second call can only raise the limits, so a
    client and a server sharing one process both get what they need)."""
    global _cap
    if _cap is None:
        _cap = MessageCap(max_message_bytes, max_receiving_bytes)
        P2P.receive_raw_data = staticmethod(_cap.receive)  # type: ignore[method-assign]
    else:
        _cap.max_message_bytes = max(_cap.max_message_bytes, max_message_bytes)
        _cap.max_receiving_bytes = max(_cap.max_receiving_bytes, max_receiving_bytes)
    return _cap


def installed_cap() -> MessageCap | None:
    return _cap
