"""DHT records are signed and schema-checked: peers cannot overwrite, impersonate or poison servers.

A real ``swarmserve dht`` bootstrap, an honest server DHT in this process (signing with this process's
key, its peer id derived from it) and attacker DHTs that store forged, impersonating and malformed
records; a client reads through ``fetch_block_records`` and must see only the honest records.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm_client.dht_records import (
    ServerInfo,
    ServerState,
    fetch_block_records,
    owner_peer_id,
    record_subkey,
    record_validators,
    spans_from_records,
    write_identity,
)
from swarm_client.lora import MAX_ADAPTERS
from swarm_client.routing import find_route
from tests.swarm_fixtures import spawn
from worker.announce import declare_span

PREFIX = "validated-model"
NUM_BLOCKS = 4
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def marker(key: RSAPrivateKey) -> bytes:
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


def info(start: int = 0, end: int = NUM_BLOCKS, **kw) -> ServerInfo:
    kw = {"state": ServerState.ONLINE, "throughput": 10.0, "cache_tokens_left": 100, **kw}
    return ServerInfo(start_block=start, end_block=end, **kw)


def later(seconds: float = 120.0) -> float:
    return time.time() + seconds


# ------------------------------------------------------------------------------------ pure checks
def test_owner_peer_id_accepts_only_the_hash_of_the_key_in_the_subkey() -> None:
    honest = record_subkey("Qm" + "x" * 44)
    assert owner_peer_id(honest) is None  # a made-up id is not the hash of our key
    key = RSAPrivateKey()
    pid = peer_id_of(key)
    assert owner_peer_id(pid.encode() + marker(key)) == pid
    assert owner_peer_id(pid.encode() + marker(RSAPrivateKey())) is None  # someone else's key
    assert owner_peer_id(pid) is None and owner_peer_id(pid.encode()) is None  # unsigned forms
    assert owner_peer_id(b"\x00garbage[owner:ssh-rsa AAAA]") is None
    assert owner_peer_id(pid.encode() + b"[owner:not a key]") is None


def test_schema_validator_rejects_malformed_values_and_subkeys() -> None:
    (schema,) = [v for v in record_validators(PREFIX, NUM_BLOCKS) if not isinstance(v, RSASignatureValidator)]
    key = DHTID.generate(source=f"{PREFIX}.1").to_bytes()
    subkey = DHTProtocol.serializer.dumps(record_subkey("Qm" + "x" * 44))

    def ok(value, sub: bytes = subkey, k: bytes = key) -> bool:
        return schema.validate(DHTRecord(k, sub, DHTProtocol.serializer.dumps(value), later()))

    good = info(features=("step_bundles",)).to_wire()
    assert ok(good)
    assert ok({**good, "from_the_future": [1, 2]})  # newer servers stay readable
    assert ok({k: v for k, v in good.items() if k != "features"})  # older servers announce no features
    assert ServerInfo.from_wire(good).features == ("step_bundles",)
    assert ServerInfo.from_wire({k: v for k, v in good.items() if k != "features"}).features == ()
    assert ServerInfo.from_wire({**good, "features": "step_bundles"}) is None  # a list of names, not a string
    for bad in (
        {**good, "throughput": 10},  # int for a float: strict types, no conversions
        {**good, "start_block": "0"},
        {**good, "state": 7},
        {**good, "cache_tokens_left": -1},
        {k: v for k, v in good.items() if k != "end_block"},
        "ONLINE",
        [good],
    ):
        assert not ok(bad), bad
    assert not ok(good, sub=DHTProtocol.serializer.dumps("QmPlainPeerIdWithoutAKey"))
    assert ok(["anything"], k=DHTID.generate(source="some.other.key").to_bytes())  # not our keys


def test_announced_adapters_are_bounded_names() -> None:
    """``ServerInfo.adapters`` (LoRA adapters a server holds): names as ``--adapters`` allows them, at most
    ``MAX_ADAPTERS``; anything else is dropped by the DHT schema and unreadable as a record."""
    (schema,) = [v for v in record_validators(PREFIX, NUM_BLOCKS) if not isinstance(v, RSASignatureValidator)]
    key = DHTID.generate(source=f"{PREFIX}.1").to_bytes()
    subkey = DHTProtocol.serializer.dumps(record_subkey("Qm" + "x" * 44))

    def ok(value) -> bool:
        return schema.validate(DHTRecord(key, subkey, DHTProtocol.serializer.dumps(value), later()))

    good = info(adapters=("a1", "sql-v2.1")).to_wire()
    assert ok(good) and ServerInfo.from_wire(good).adapters == ("a1", "sql-v2.1")
    assert ServerInfo.from_wire({k: v for k, v in good.items() if k != "adapters"}).adapters == ()  # older servers
    for bad in (["bad name"], ["../x"], ["x" * 65], [1], ["a"] * (MAX_ADAPTERS + 1), "a1"):
        assert not ok({**good, "adapters": bad}), bad
        assert ServerInfo.from_wire({**good, "adapters": bad}) is None, bad


def identity_bytes(key: RSAPrivateKey) -> bytes:
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()


def peer_id_of(key: RSAPrivateKey) -> str:
    """libp2p's own derivation (hivemind's), to check ours against."""
    return PeerID.from_identity(identity_bytes(key)).to_base58()


# ------------------------------------------------------------------------------------ a live DHT
def identity_dht(tmp: Path, peers: list[str], key: RSAPrivateKey, **kw) -> DHT:
    """A full DHT node whose libp2p identity is ``key`` (another 'machine' in this process)."""
    path = tmp / f"{os.getpid()}-{id(key)}.id"
    path.write_bytes(identity_bytes(key))
    return DHT(
        initial_peers=peers,
        host_maddrs=LOCAL,
        start=True,
        identity_path=str(path),
        check_if_identity_free=False,
        **kw,
    )


@dataclass
class Swarm:
    peers: list[str]
    honest: DHT
    client: DHT
    tmp: Path

    @property
    def victim(self) -> str:
        return self.honest.peer_id.to_base58()

    def records(self) -> list[dict[str, ServerInfo]]:
        return fetch_block_records(self.client, PREFIX, NUM_BLOCKS)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> Iterator[Swarm]:
    tmp = tmp_path_factory.mktemp("dht-ids")
    bootstrap = spawn("dht", ["dht"])  # the real command: signature checks, no schema (no model given)
    started: list[DHT] = []
    try:
        line = bootstrap.wait_for("initial_peers:")
        peers = [line.split("initial_peers:", 1)[1].strip()]
        honest = DHT(
            initial_peers=peers,
            host_maddrs=LOCAL,
            start=True,
            record_validators=record_validators(PREFIX, NUM_BLOCKS),
            **write_identity(tmp),
        )
        started.append(honest)
        assert declare_span(honest, PREFIX, 0, NUM_BLOCKS, info(), expiration=300)
        client = DHT(
            initial_peers=peers,
            client_mode=True,
            start=True,
            record_validators=record_validators(PREFIX, NUM_BLOCKS),
        )
        started.append(client)
        yield Swarm(peers, honest, client, tmp)
    finally:
        for dht in started:
            dht.shutdown()
        bootstrap.stop(timeout=5)


def assert_only_honest(s: Swarm, *extra: str) -> None:
    records = s.records()
    for block, per_peer in enumerate(records):
        assert set(per_peer) == {s.victim, *extra}, (block, per_peer)
        assert per_peer[s.victim] == info(), per_peer[s.victim]


@pytest.mark.slow
def test_honest_records_are_read_with_the_signing_peer_id(swarm: Swarm) -> None:
    assert_only_honest(swarm)
    spans = spans_from_records(swarm.records())
    assert list(spans) == [swarm.victim]
    assert [h.peer_id for h in find_route(spans, 0, NUM_BLOCKS)] == [swarm.victim]


@pytest.mark.slow
def test_unsigned_overwrite_of_a_servers_record_is_rejected(swarm: Swarm) -> None:
    forger = DHT(initial_peers=swarm.peers, host_maddrs=LOCAL, start=True)  # no validators: signs nothing
    try:
        fake = info(state=ServerState.OFFLINE, throughput=0.0).to_wire()
        for block in range(NUM_BLOCKS):
            forger.store(
                f"{PREFIX}.{block}", subkey=record_subkey(swarm.victim), value=fake, expiration_time=later()
            )
        assert_only_honest(swarm)
    finally:
        forger.shutdown()


@pytest.mark.slow
def test_impersonation_with_the_attackers_own_key_is_ignored(swarm: Swarm) -> None:
    key = RSAPrivateKey()
    impostor = identity_dht(swarm.tmp, swarm.peers, key, record_validators=[RSASignatureValidator(key)])
    try:
        lie = info(1, 2, throughput=1e9, cache_tokens_left=10**9).to_wire()
        subkey = swarm.victim.encode() + marker(key)  # validly signed, but the id is not the key's hash
        assert impostor.store(f"{PREFIX}.1", subkey=subkey, value=lie, expiration_time=later())
        unsigned = swarm.victim  # the pre-validation subkey format: no key at all
        impostor.store(f"{PREFIX}.2", subkey=unsigned, value=lie, expiration_time=later())
        assert_only_honest(swarm)
        spans = spans_from_records(swarm.records())
        assert spans[swarm.victim].start == 0 and spans[swarm.victim].end == NUM_BLOCKS
    finally:
        impostor.shutdown()


@pytest.mark.slow
def test_malformed_values_are_dropped_and_a_second_honest_server_still_works(swarm: Swarm) -> None:
    key = RSAPrivateKey()
    other = identity_dht(swarm.tmp, swarm.peers, key, record_validators=[RSASignatureValidator(key)])
    try:
        pid = other.peer_id.to_base58()
        assert pid == peer_id_of(key)
        subkey = pid.encode() + marker(key)
        good = info(2, NUM_BLOCKS, throughput=5.0).to_wire()
        garbage = [
            {"state": "ONLINE", "start_block": 0, "end_block": 1, "throughput": 1.0},
            {**good, "throughput": "fast"},
            {**good, "start_block": 3, "end_block": 1},
            b"\x00" * 64,
        ]
        for block, value in enumerate(garbage):
            other.store(f"{PREFIX}.{block}", subkey=subkey, value=value, expiration_time=later())
        records = swarm.records()
        for block in range(2):
            assert set(records[block]) == {swarm.victim}, records[block]
        for block in range(2, NUM_BLOCKS):  # its records for blocks 2, 3 were garbage too: not listed
            assert pid not in records[block] or records[block][pid] == ServerInfo.from_wire(good)

        for block in range(2, NUM_BLOCKS):  # now it announces properly, with later expiration
            assert other.store(f"{PREFIX}.{block}", subkey=subkey, value=good, expiration_time=later(200))
        records = swarm.records()
        for block in range(2, NUM_BLOCKS):
            assert records[block][pid] == ServerInfo.from_wire(good)
            assert records[block][swarm.victim] == info()
        spans = spans_from_records(records)
        assert set(spans) == {swarm.victim, pid}
        assert {h.peer_id for h in find_route(spans, 0, NUM_BLOCKS)} <= {swarm.victim, pid}
    finally:
        other.shutdown()


@pytest.mark.slow
def test_a_dht_made_without_validators_still_reads_signed_records(swarm: Swarm) -> None:
    raw = DHT(initial_peers=swarm.peers, client_mode=True, start=True)
    try:
        records = fetch_block_records(raw, PREFIX, NUM_BLOCKS)
        assert records == swarm.records()  # the same view as a client made with the validators
        assert all(r[swarm.victim] == info() for r in records)
    finally:
        raw.shutdown()
