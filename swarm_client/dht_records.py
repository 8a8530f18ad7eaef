"""What a block server announces on the DHT, and the functions that read and guard it.

Key: ``"{dht_prefix}.{block_index}"``; subkey: ``b"<peer id>[owner:<RSA public key>]"``; value: ``ServerInfo``
as a dict. Records expire unless the server refreshes them, so a crashed server disappears by itself.
Servers write them with ``worker.announce.declare_span``.

Why the subkey carries a key: every swarm DHT node runs hivemind's ``RSASignatureValidator``, so a value
stored under a subkey holding a public key must be signed by the matching private key — nobody can
overwrite another server's record. A server's libp2p identity is that same RSA key, so its peer id is
a hash of the key; readers recompute it (``owner_peer_id``) and drop records whose claimed peer id does
not match, so a peer cannot announce spans in another server's name either. A ``SchemaValidator`` (strict
pydantic v1 types, as hivemind requires) rejects malformed values under ``{prefix}.{i}`` on storing nodes.
"""

from __future__ import annotations

import concurrent.futures
import enum
import functools
import hashlib
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Dict, List, Optional  # noqa: UP035 - pydantic v1 schemas (hivemind) want typing generics

import pydantic.v1 as pv1
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator, conbytes
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from swarm_client.lora import ADAPTER_NAME, MAX_ADAPTERS
from swarm_client.precision import Quant

PROTOCOL_VERSION = "1"
#: blocks covered by the schema of a node that knows the model's prefix but not its depth (bootstrap)
MAX_SCHEMA_BLOCKS = 256
_BASE58 = rb"[1-9A-HJ-NP-Za-km-z]"
_SUBKEY_RE = re.compile(rb"(" + _BASE58 + rb"{32,128})\[owner:(.+?)\]", re.DOTALL)


class ServerState(enum.IntEnum):
    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


#: bounds of ``ServerInfo.addrs`` (a record past them is dropped, like any invalid one)
MAX_ADDRS, MAX_ADDR_CHARS = 8, 256


class Reachability(enum.StrEnum):
    """How the swarm reaches a server, as a peer of the swarm found by dialing it back at start-up."""

    DIRECT = "direct"  # a peer dialed the announced address
    RELAYED = "relayed"  # only through a libp2p relay (a public peer forwards its traffic)
    UNKNOWN = "unknown"  # no peer could run the check (e.g. the first server of a new swarm)


class ServerInfo(BaseModel):
    """The announced state of one server. Unknown fields are ignored so newer servers stay readable."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    state: ServerState
    start_block: int = Field(ge=0)
    end_block: int = Field(gt=0)
    throughput: float = Field(ge=0.0, description="tokens/s the server can push through one block")
    cache_tokens_left: int = Field(ge=0, default=0)
    #: the server's whole cache budget (None: an older server that does not say): no session longer fits
    cache_tokens_total: int | None = Field(ge=0, default=None)
    #: session slots free for new sessions (None: not announced)
    sessions_left: int | None = Field(ge=0, default=None)
    version: str = PROTOCOL_VERSION
    dtype: str = "float32"
    public_name: str | None = None
    #: the multiaddrs the server announces (without ``/p2p/``), for people reading errors and status pages
    addrs: tuple[Annotated[str, Field(max_length=MAX_ADDR_CHARS)], ...] = Field(default=(), max_length=MAX_ADDRS)
    #: optional protocol features the server serves (e.g. ``protocol.STEP_BUNDLES``); older servers: none
    features: tuple[str, ...] = ()
    #: how peers reach the server, as its start-up check found (``Reachability``); None: not checked / older
    reachability: Reachability | None = None
    #: weight quantization of the server's blocks (``swarm_client.precision.Quant``; a value this version does
    #: not know is kept as said, and ranks below every known one)
    quant: str = Field(default=Quant.NONE.value, max_length=16)
    #: LoRA adapters the server applies to its whole span on request (``swarm_client.lora``); older: none
    adapters: tuple[Annotated[str, Field(pattern=ADAPTER_NAME.pattern)], ...] = Field(
        default=(), max_length=MAX_ADAPTERS
    )

    @field_validator("reachability", mode="before")
    @classmethod
    def _unknown_reachability_is_none(cls, value: object) -> object:
        """A value this version does not know (a newer server's) reads as "not said", not a broken record."""
        return value if isinstance(value, str) and value in {r.value for r in Reachability} else None

    def to_wire(self) -> dict:
        data = self.model_dump(mode="json")
        data["state"] = int(self.state)
        data["throughput"] = float(self.throughput)
        data["addrs"] = list(self.addrs)
        data["features"] = list(self.features)
        data["adapters"] = list(self.adapters)
        return data

    @classmethod
    def from_wire(cls, value: object) -> ServerInfo | None:
        """Parse a record value; None (never an exception) for garbage, so one bad peer breaks nothing."""
        if not isinstance(value, dict):
            return None
        try:
            info = cls.model_validate(value)
        except (ValidationError, ValueError, TypeError):
            return None
        if info.end_block <= info.start_block:
            return None
        return info


@dataclass(frozen=True)
class RemoteSpanInfo:
    """One server's contiguous span ``[start, end)`` as seen by clients."""

    peer_id: str
    start: int
    end: int
    server_info: ServerInfo = field(compare=False)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def state(self) -> ServerState:
        return self.server_info.state


def block_uids(dht_prefix: str, start: int, end: int) -> list[str]:
    return [f"{dht_prefix}.{i}" for i in range(start, end)]


# ---------------------------------------------------------------------------------------- identity
def _signing_key() -> RSAPrivateKey:
    """The key this process signs records with: hivemind's process-wide key, the default of
    ``RSASignatureValidator()``, so validators made anywhere in the process agree on it."""
    return RSAPrivateKey.process_wide()


def _owner_marker(key: RSAPrivateKey) -> bytes:
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


@functools.lru_cache(maxsize=4096)
def _peer_id_of_ssh_key(ssh_key: bytes) -> str | None:
    """libp2p's peer id of an RSA key: sha2-256 multihash of the protobuf-wrapped DER public key."""
    try:
        key = serialization.load_ssh_public_key(ssh_key)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None
    if not isinstance(key, rsa.RSAPublicKey):
        return None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest()).to_base58()


def write_identity(directory: str | os.PathLike) -> dict[str, Any]:
    """Write this process's signing key as a libp2p identity file in ``directory``; returns the extra
    ``DHT(...)`` kwargs that make the node's peer id a hash of that key (so its records verify).

    The file only has to exist while the DHT starts (p2pd reads it once)."""
    path = os.path.join(os.fspath(directory), "swarmserve.id")
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=_signing_key().to_bytes())
    with open(path, "wb") as f:
        f.write(data.SerializeToString())
    os.chmod(path, 0o400)
    return {"identity_path": path, "check_if_identity_free": False}


def record_subkey(peer_id: str) -> bytes:
    """Our subkey: peer id + owner marker, so the DHT signs our records and readers can verify the id."""
    return peer_id.encode() + _owner_marker(_signing_key())


def owner_peer_id(subkey: object) -> str | None:
    """The peer id a subkey may speak for, or None: the claimed id must be the hash of the key in it."""
    if not isinstance(subkey, bytes):
        return None
    match = _SUBKEY_RE.fullmatch(subkey)
    if match is None:
        return None
    claimed, ssh_key = match.group(1).decode(), match.group(2)
    return claimed if _peer_id_of_ssh_key(ssh_key) == claimed else None


# ---------------------------------------------------------------------------------------- validators
class _WireRecord(pv1.BaseModel):
    """Strict wire shape of ``ServerInfo.to_wire()``; extra fields pass (newer servers stay readable)."""

    state: pv1.conint(strict=True, ge=0, le=2)  # type: ignore[valid-type]
    start_block: pv1.conint(strict=True, ge=0)  # type: ignore[valid-type]
    end_block: pv1.conint(strict=True, gt=0)  # type: ignore[valid-type]
    throughput: pv1.confloat(strict=True, ge=0.0)  # type: ignore[valid-type]
    cache_tokens_left: pv1.conint(strict=True, ge=0)  # type: ignore[valid-type]
    cache_tokens_total: Optional[pv1.conint(strict=True, ge=0)] = None  # type: ignore[valid-type]  # noqa: UP045
    sessions_left: Optional[pv1.conint(strict=True, ge=0)] = None  # type: ignore[valid-type]  # noqa: UP045
    version: pv1.StrictStr
    dtype: pv1.StrictStr
    public_name: Optional[pv1.StrictStr]  # noqa: UP045
    addrs: List[pv1.StrictStr]  # noqa: UP006
    quant: Optional[pv1.constr(strict=True, max_length=16)] = None  # type: ignore[valid-type]  # noqa: UP045
    adapters: Optional[List[pv1.constr(strict=True, regex=ADAPTER_NAME.pattern)]] = pv1.Field(  # type: ignore[valid-type]  # noqa: UP006, UP045
        None, max_items=MAX_ADAPTERS
    )

    class Config:
        extra = pv1.Extra.allow


_Subkey = conbytes(
    regex=rb"^" + _BASE58 + rb"{32,128}" + RSASignatureValidator.PUBLIC_KEY_REGEX + rb"\Z", max_length=4096
)


@functools.lru_cache(maxsize=16)
def _block_schema(dht_prefix: str, num_blocks: int) -> type[pv1.BaseModel]:
    fields: dict[str, Any] = {
        key: (Optional[Dict[_Subkey, _WireRecord]], None)  # noqa: UP006, UP045
        for key in block_uids(dht_prefix, 0, num_blocks)
    }
    name = "BlockRecords_" + re.sub(r"\W", "_", dht_prefix)
    return pv1.create_model(name, **fields)


def record_validators(dht_prefix: str | None = None, num_blocks: int | None = None) -> list[RecordValidatorBase]:
    """Validators for every swarm DHT node: owner signatures always, the record schema when the model's
    prefix is known (keys are hashed on the wire, so a node can only check keys it can name).

    Signing uses this process's key; start the node with ``write_identity`` so its peer id matches it."""
    validators: list[RecordValidatorBase] = [RSASignatureValidator(_signing_key())]
    if dht_prefix is not None:
        schema = _block_schema(dht_prefix, num_blocks or MAX_SCHEMA_BLOCKS)
        validators.append(SchemaValidator(schema, allow_extra_keys=True))
    return validators


def _ensure_can_read(dht) -> None:
    """A DHT made without our validators cannot even decode signed values (hivemind appends the
    signature to the value bytes): give it the signature validator on first use."""
    if getattr(dht, "_swarmserve_validated", False):
        return
    dht.add_validators([RSASignatureValidator(_signing_key())])  # merges into an existing one: no-op then
    dht._swarmserve_validated = True


def mark_validated(dht) -> None:
    """Note that ``dht`` was created with ``record_validators`` (skips the check in reads)."""
    dht._swarmserve_validated = True


# ---------------------------------------------------------------------------------------- I/O
#: a swarm read gives up after this long: a DHT shut down mid-read never answers its futures, and a thread
#: waiting on one forever keeps the interpreter from exiting (concurrent.futures joins its workers at exit)
FETCH_TIMEOUT = 20.0


def fetch_block_records(
    dht, dht_prefix: str, num_blocks: int, timeout: float = FETCH_TIMEOUT
) -> list[dict[str, ServerInfo]]:
    """For each block, ``{peer_id: ServerInfo}`` of the valid, unexpired, owner-verified records; blocking,
    ``TimeoutError`` after ``timeout`` seconds."""
    _ensure_can_read(dht)
    uids = block_uids(dht_prefix, 0, num_blocks)
    futures = [dht.get(uid, latest=True, return_future=True) for uid in uids]
    deadline = time.monotonic() + timeout
    result: list[dict[str, ServerInfo]] = []
    for fut in futures:
        try:
            entry = fut.result(timeout=max(deadline - time.monotonic(), 0.001))
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the DHT did not answer a swarm read within {timeout:g}s") from None
        per_peer: dict[str, ServerInfo] = {}
        if entry is not None and isinstance(entry.value, dict):
            for subkey, item in entry.value.items():
                peer_id = owner_peer_id(subkey)
                info = ServerInfo.from_wire(getattr(item, "value", None))
                if info is not None and peer_id is not None:
                    per_peer[peer_id] = info
        result.append(per_peer)
    return result


def spans_from_records(records: Sequence[dict[str, ServerInfo]]) -> dict[str, RemoteSpanInfo]:
    """Collapse per-block records into one span per peer (the span the peer announced)."""
    spans: dict[str, RemoteSpanInfo] = {}
    for block, per_peer in enumerate(records):
        for peer_id, info in per_peer.items():
            if not (info.start_block <= block < info.end_block):
                continue  # a record that lies about its own span is ignored for this block
            if peer_id not in spans:
                spans[peer_id] = RemoteSpanInfo(peer_id, info.start_block, info.end_block, info)
    return spans
