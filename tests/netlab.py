"""A network lab on one machine: hosts as network namespaces, a NAT router, processes started inside them.

Root only (``unavailable()`` says why not, for a skip). Every lab has its own namespace names
(``snl<pid>-<random>-<host>``), so labs of parallel test runs never meet; nothing is added to the root
namespace, and nothing is routed off the machine.

    with NetLab() as lab:
        dht = lab.host("dht", "10.231.0.2")                    # on the "public" bridge
        rtr, home, home_ip = lab.nat("rtr", "10.231.0.100", forward=[31330])
        proc = lab.spawn(home, "w2", ["worker", ...])         # ``swarmserve worker`` inside ``home``

The public side is one bridge (in its own namespace); each host has ``eth0`` on it. ``nat`` adds a router
with ``eth0`` on the bridge and ``lan0`` towards one host behind it: MASQUERADE for what the host sends out,
inbound connections dropped silently (a SYN to the LAN or to the router times out, as on the internet)
except TCP ports in ``forward`` (DNAT to the host, same port). Public hosts route the private subnet to the
router, so a private address announced by the NATed host is a black hole, not an instant "unreachable".

``delay`` / ``delay_between`` add one-way delays (tests/netlab_delay.py: each host delays what it sends; a host
behind a router is reached at the router's public address), when ``unavailable_delays()`` is None.

``close()`` (also on ``with`` exit and at interpreter exit) kills what still runs in the lab's namespaces and
deletes them, which takes their veths and the bridge along. Labs left by a SIGKILLed run are swept by the
next ``NetLab()`` (their pid no longer exists).
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from swarmserve.processes import ChildProcess, popen_child, swarmserve_argv

if TYPE_CHECKING:
    from tests.netlab_delay import Delays

PREFIX = "snl"
CMD_TIMEOUT = 20.0


def unavailable() -> str | None:
    """Why a lab cannot run here (a skip reason), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian: apt-get install {package})"
    return None


def unavailable_delays() -> str | None:
    """Why the lab cannot delay packets here (a skip reason), or None (see tests/netlab_delay.py)."""
    from tests.netlab_delay import unavailable_delays as reason

    return reason()


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines() if line]


def _delete_namespace(ns: str) -> None:
    """Kill what runs in ``ns`` (only a lab's own namespaces come here), then delete it."""
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", ns, check=False)


def sweep_stale() -> None:
    """Delete the namespaces of labs whose process is gone (a run killed before it could clean up)."""
    for ns in _namespaces():
        if ns.startswith(PREFIX):
            pid = ns[len(PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                _delete_namespace(ns)


class NetLab:
    def __init__(self, subnet: str = "10.231.0", keep_tcp_window: bool = False) -> None:
        """``keep_tcp_window``: hosts do not shrink a TCP connection's window back to slow start after an idle
        gap (``net.ipv4.tcp_slow_start_after_idle=0``, a usual tuning for long-lived connections; Linux's
        default restarts slow start, so a step of several tokens after a pause pays extra round trips)."""
        self.keep_tcp_window = keep_tcp_window
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        sweep_stale()
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.subnet = subnet
        self.namespaces: list[str] = []
        self.public: list[str] = []  # hosts on the bridge (without routers)
        self.lans: list[tuple[str, str]] = []  # (private subnet, router's public address)
        self.reached_at: dict[str, str] = {}  # ns -> the address others reach it at (a NATed host: its router's)
        self._delays: Delays | None = None
        self._veths = 0
        self._closed = False
        atexit.register(self.close)
        try:
            self.bridge = self._namespace("br")
            _run("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------- topology
    def _namespace(self, name: str) -> str:
        ns = f"{self.tag}-{name}"
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        if self.keep_tcp_window:
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
        return ns

    def _on_bridge(self, ns: str, address: str) -> None:
        """``eth0`` of ``ns`` on the bridge with ``address``/24."""
        self._veths += 1
        peer = f"v{self._veths}"
        _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", peer)
        _run("ip", "-n", ns, "link", "set", peer, "netns", self.bridge)
        _run("ip", "-n", self.bridge, "link", "set", peer, "master", "br0")
        _run("ip", "-n", self.bridge, "link", "set", peer, "up")
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        self.reached_at[ns] = address

    def host(self, name: str, address: str) -> str:
        """A host on the public bridge; returns its namespace."""
        ns = self._namespace(name)
        self._on_bridge(ns, address)
        for lan, router in self.lans:
            _run("ip", "-n", ns, "route", "add", f"{lan}.0/24", "via", router)
        self.public.append(ns)
        return ns

    def nat(
        self, name: str, public_address: str, lan: str = "10.232.0", forward: Sequence[int] = ()
    ) -> tuple[str, str, str]:
        """A MASQUERADE router on the bridge and one host behind it: (router ns, host ns, host's address)."""
        router = self._namespace(name)
        self._on_bridge(router, public_address)
        home = self._namespace(f"{name}-lan")
        private = f"{lan}.2"
        self.reached_at[home] = public_address
        _run("ip", "-n", home, "link", "add", "eth0", "type", "veth", "peer", "name", "lan0")
        _run("ip", "-n", home, "link", "set", "lan0", "netns", router)
        _run("ip", "-n", home, "addr", "add", f"{private}/24", "dev", "eth0")
        _run("ip", "-n", home, "link", "set", "eth0", "up")
        _run("ip", "-n", home, "route", "add", "default", "via", f"{lan}.1")
        _run("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _run("ip", "-n", router, "link", "set", "lan0", "up")
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")

        def rule(*args: str) -> None:
            _run("ip", "netns", "exec", router, "iptables", *args)

        rule("-t", "nat", "-A", "POSTROUTING", "-s", f"{lan}.0/24", "-o", "eth0", "-j", "MASQUERADE")
        for port in forward:
            dnat = ("-j", "DNAT", "--to-destination", f"{private}:{port}")
            rule("-t", "nat", "-A", "PREROUTING", "-i", "eth0", "-p", "tcp", "--dport", str(port), *dnat)
        est = ("-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED,DNAT", "-j", "ACCEPT")
        rule("-A", "FORWARD", "-i", "eth0", "-o", "lan0", *est)
        rule("-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-j", "DROP")
        rule("-A", "INPUT", "-i", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        rule("-A", "INPUT", "-i", "eth0", "-j", "DROP")
        for ns in self.public:
            _run("ip", "-n", ns, "route", "add", f"{lan}.0/24", "via", public_address)
        self.lans.append((lan, public_address))
        return router, home, private

    def namespace_of(self, host: str) -> str:
        """The namespace of a host given by name (as passed to ``host``; ``NAME-lan`` behind router NAME) or ns."""
        for ns in (host, f"{self.tag}-{host}"):
            if ns in self.namespaces:
                return ns
        raise KeyError(f"no host {host!r} in this lab ({', '.join(self.namespaces)})")

    # ------------------------------------------------------------------------------------------ delays
    def _delay_settings(self) -> Delays:
        if self._delays is None:
            from tests.netlab_delay import Delays

            self._delays = Delays(self)
        return self._delays

    def delay(self, delays: Mapping[str, float]) -> None:
        """One-way delay (ms) for everything each host sends, e.g. ``{"client": 25}``; 0 removes it."""
        self._delay_settings().set_hosts(delays)

    def delay_between(self, source: str, destination: str, ms: float) -> None:
        """One-way delay (ms) for what ``source`` sends to ``destination``; overrides ``delay``'s."""
        self._delay_settings().set_pair(source, destination, ms)

    # --------------------------------------------------------------------------------------- processes
    @staticmethod
    def argv(ns: str, *command: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *command]

    def spawn(
        self, ns: str, name: str, args: Sequence[str], env: dict[str, str], cls: type[ChildProcess] = ChildProcess
    ) -> ChildProcess:
        """``swarmserve *args`` inside ``ns``, its output read line by line (as ``ChildProcess.spawn``).
        ``ip netns exec`` execs the command, so the pid and its process group are the child's own."""
        popen = popen_child(self.argv(ns, *swarmserve_argv(*args)), env)  # a killed test run leaves no worker
        proc = cls(name, popen)
        threading.Thread(target=proc._read, name=f"{name}-log", daemon=True).start()  # noqa: SLF001
        return proc

    # ----------------------------------------------------------------------------------------- cleanup
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._delays is not None:
                self._delays.close()
        finally:
            for ns in reversed(self.namespaces):
                _delete_namespace(ns)
            self.namespaces.clear()
