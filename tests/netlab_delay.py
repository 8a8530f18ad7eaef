"""One-way network delays in the lab (tests/netlab.py), emulated in user space: this kernel has no ``sch_netem``.

    lab.delay({"client": 25})                  # everything "client" sends waits 25 ms
    lab.delay_between("client", "w1", 40)      # what "client" sends to "w1" waits 40 ms (overrides the above)

Where: each host delays what it sends. A namespace with a delay gets one iptables rule, mangle ``OUTPUT ! -o lo
! -d 224.0.0.0/4 -m mark ! --mark RESENT_MARK -j NFQUEUE --queue-num 0`` (IPv4 unicast; loopback untouched),
and one process, this file run as a script inside it, that takes a copy of every queued packet, drops the
original, and sends the copy from a raw socket (marked, so the rule lets it pass) once the delay set for its
destination address is over (``Holder`` says why a copy). IP level, so handshakes, ACKs and libp2p's own round
trips are delayed too.

NAT: a host behind a router is reached at its router's public address, so a delay towards it is keyed on that
address in the sender's table (the router stands for its one host). What the NATed host sends is delayed in
its own namespace, before the router masquerades it; routers themselves delay nothing.

Autocorking is turned off where packets are delayed (see ``_NO_AUTOCORK``): with it, every message a program
writes in two parts paid one more one-way trip than on a real link (load_tests/results/wan-2026-12-06.md).

Order: per destination, release times never go backwards (a lowered delay waits for what was queued before
it), so each flow's packets leave in order. One thread: ``select`` on the queue's socket and stdin, with the
next release as its timeout (no busy-waiting). The lab writes the sender's table as one JSON line on stdin,
``{"default": ms, "to": {"10.231.0.3": ms}}``; the process answers ``ok`` (and ``ready`` once bound), and exits
at EOF. ``NetLab.close`` stops it with the lab; a SIGKILLed test run takes it along (parent-death signal).

``unavailable_delays()`` says why delays cannot run here (for a skip): no lab, no ``netfilterqueue`` module
(PyPI; builds against Debian's ``libnetfilter-queue-dev``), or no NFQUEUE in the kernel.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.netlab import NetLab

QUEUE = "0"
REPLY_TIMEOUT = 20.0
_probed: list[str | None] = []  # unavailable_delays' answer, once per test run


def unavailable_delays() -> str | None:
    """Why the lab cannot delay packets here (a skip reason), or None. Checked for real once: the delay
    process binds a queue in a scratch namespace that has the NFQUEUE rule."""
    from tests.netlab import unavailable

    if (reason := unavailable()) is not None:
        return reason
    if not _probed:
        _probed.append(_probe())
    return _probed[0]


def _probe() -> str | None:
    import importlib.util
    import secrets

    from tests.netlab import PREFIX, _delete_namespace, _run

    if importlib.util.find_spec("netfilterqueue") is None:
        return (
            "needs the Python package netfilterqueue (Debian: apt-get install libnetfilter-queue-dev, "
            "then pip install netfilterqueue)"
        )
    ns = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}-probe"  # swept like a lab's if this run dies
    try:
        _run("ip", "netns", "add", ns)
        rule = _run("ip", "netns", "exec", ns, *_RULE, check=False)
        if rule.returncode:
            return f"iptables cannot add an NFQUEUE rule (no NFQUEUE in this kernel?): {rule.stderr.strip()}"
        done = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, __file__],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=REPLY_TIMEOUT,
        )  # fmt: skip
        if "ready" not in done.stdout.split():
            return f"cannot bind an NFQUEUE queue (nfnetlink_queue in this kernel?): {done.stderr.strip()[-500:]}"
        return None
    finally:
        _delete_namespace(ns)


#: what the delay process sends again carries this mark, so the rule lets it through
RESENT_MARK = 0x5E1A
#: multicast (p2pd's mDNS/SSDP, IGMP) goes undelayed: the lab's links carry unicast only
_RULE = ("iptables", "-t", "mangle", "-A", "OUTPUT", "!", "-o", "lo", "!", "-d", "224.0.0.0/4",
         "-m", "mark", "!", "--mark", str(RESENT_MARK), "-j", "NFQUEUE", "--queue-num", QUEUE)  # fmt: skip
#: a packet held here is still the sending socket's (its buffer is not freed until it leaves), and Linux TCP
#: autocorking holds a socket's next small write while its last packet has not left: behind a delay that write
#: waits the whole delay first, so a message written in two parts costs an extra one-way trip. On a real link the
#: packet leaves the host at once, so the lab turns autocorking off where it delays (per namespace)
_NO_AUTOCORK = ("sysctl", "-qw", "net.ipv4.tcp_autocorking=0")


# ------------------------------------------------------------------------------------------------ lab side
class Delays:
    """The lab's delay settings and its delay processes (one per namespace that has sent a delay)."""

    def __init__(self, lab: NetLab) -> None:
        self.lab = lab
        self.by_host: dict[str, float] = {}  # sender ns -> ms for every destination
        self.by_pair: dict[tuple[str, str], float] = {}  # (sender ns, destination ns) -> ms
        self.procs: dict[str, _Delayer] = {}

    def set_hosts(self, delays: Mapping[str, float]) -> None:
        resolved = {self.lab.namespace_of(host): float(ms) for host, ms in delays.items()}
        self.by_host.update(resolved)
        for ns in resolved:
            self._push(ns)

    def set_pair(self, source: str, destination: str, ms: float) -> None:
        src, dst = self.lab.namespace_of(source), self.lab.namespace_of(destination)
        self.by_pair[(src, dst)] = float(ms)
        self._push(src)

    def table(self, ns: str) -> dict:
        """What ``ns`` sends: the default delay and the delays by destination address (ms)."""
        to = {self.lab.reached_at[dst]: ms for (src, dst), ms in self.by_pair.items() if src == ns}
        return {"default": self.by_host.get(ns, 0.0), "to": to}

    def _push(self, ns: str) -> None:
        table = self.table(ns)
        if ns not in self.procs:
            if not table["default"] and not any(table["to"].values()):
                return  # nothing to delay: no process, no rule
            self.procs[ns] = _Delayer(self.lab, ns)
        self.procs[ns].send(table)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        self.procs.clear()


class _Delayer:
    """The delay process of one namespace, and the rule that feeds it (added once it has bound the queue:
    packets queued to nobody are dropped)."""

    def __init__(self, lab: NetLab, ns: str) -> None:
        from swarmserve.processes import _parent_death_signal

        self.ns = ns
        self.popen = subprocess.Popen(
            lab.argv(ns, sys.executable, __file__),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
            start_new_session=True, preexec_fn=_parent_death_signal(),
        )  # fmt: skip
        self._pending = b""
        self._expect("ready")
        from tests.netlab import _run

        _run(*lab.argv(ns, *_NO_AUTOCORK))
        _run(*lab.argv(ns, *_RULE))

    def send(self, table: dict) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(table).encode() + b"\n")
        self._expect("ok")

    def _expect(self, word: str) -> None:
        """Wait (bounded) for the process's next line, which must be ``word``."""
        assert self.popen.stdout is not None
        deadline = time.monotonic() + REPLY_TIMEOUT
        fd = self.popen.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError(f"delay process in {self.ns} did not say {word!r} in {REPLY_TIMEOUT} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"delay process in {self.ns} exited ({self.popen.wait(5)}) before {word!r}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        if line.decode().strip() != word:
            raise RuntimeError(f"delay process in {self.ns} said {line!r}, not {word!r}")

    def stop(self) -> None:
        if self.popen.stdin is not None:
            self.popen.stdin.close()  # EOF: the process unbinds and exits
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


# ------------------------------------------------------------------------------------- inside the namespace
class Holder:
    """Packets waiting for their release time, in a heap; per destination, release times never go back.

    A held packet is a copy: the queued original is dropped at once and the copy sent again, marked, from a raw
    socket when due. Holding the original would keep it charged to its TCP socket for the whole delay, and TCP
    Small Queues lets a socket have only about two packets below it: the lab's links then carried ~2 packets
    per delay (≈ 120 kB/s at 25 ms, whatever the window; load_tests/results/wan-tsq-2026-12-07.md). On a real
    link a packet is freed as soon as the NIC has sent it."""

    def __init__(self, send: Callable[[bytes], object] | None = None) -> None:
        self.default = 0.0
        self.to: dict[bytes, float] = {}  # destination address (4 bytes) -> seconds
        self.send = send or _raw_sender()
        self.heap: list[tuple[float, int, bytes]] = []
        self.last: dict[bytes, float] = {}  # destination -> latest release time given
        self.seq = itertools.count()

    def configure(self, table: Mapping) -> None:
        self.default = float(table.get("default", 0.0)) / 1000
        self.to = {socket.inet_aton(ip): float(ms) / 1000 for ip, ms in table.get("to", {}).items()}

    def hold(self, packet, now: float) -> None:
        copy = packet.get_payload()
        destination = copy[16:20]
        release = max(now + self.to.get(destination, self.default), self.last.get(destination, 0.0))
        if release <= now:
            packet.accept()
            return
        self.last[destination] = release
        heapq.heappush(self.heap, (release, next(self.seq), copy))
        packet.drop()

    def release_due(self, now: float) -> float | None:
        """Send what is due; return seconds until the next release (None: nothing held)."""
        while self.heap and self.heap[0][0] <= now:
            self.send(heapq.heappop(self.heap)[2])
        return self.heap[0][0] - now if self.heap else None


def _raw_sender() -> Callable[[bytes], object]:
    """Sends a whole IPv4 packet as it is (``IPPROTO_RAW`` implies ``IP_HDRINCL``), marked ``RESENT_MARK``. A
    copy that cannot go (its route gone meanwhile, a link taken down by a test) is lost, as on a link."""
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, RESENT_MARK)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)

    def send(packet: bytes) -> None:
        destination = socket.inet_ntoa(packet[16:20])
        try:
            raw.sendto(packet, (destination, 0))
        except OSError as e:
            print(f"dropped a packet to {destination}: {e}", file=sys.stderr, flush=True)

    return send


def main() -> None:
    import warnings

    from netfilterqueue import COPY_PACKET, NetfilterQueue

    holder = Holder()
    queue = NetfilterQueue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "rcvbuf limit is now ...": the kernel's cap is fine
        # whole packets are copied up (the kernel completes their checksums first): the copies are what is sent
        queue.bind(int(QUEUE), lambda packet: holder.hold(packet, time.monotonic()), 65536, COPY_PACKET, 65535)
    print("ready", flush=True)
    queue_fd, stdin_fd = queue.get_fd(), sys.stdin.fileno()
    commands = b""
    try:
        while True:
            wait = holder.release_due(time.monotonic())
            readable = select.select([queue_fd, stdin_fd], [], [], wait)[0]
            if queue_fd in readable:
                queue.run(block=False)
            if stdin_fd in readable:
                chunk = os.read(stdin_fd, 65536)
                if not chunk:
                    return  # the lab closed: what is still held is dropped with the queue
                commands += chunk
                while b"\n" in commands:
                    line, commands = commands.split(b"\n", 1)
                    holder.configure(json.loads(line))
                    print("ok", flush=True)
    finally:
        queue.unbind()


if __name__ == "__main__":
    main()
