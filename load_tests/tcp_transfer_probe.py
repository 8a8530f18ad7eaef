"""How long a request of N bytes takes to cross one emulated-WAN TCP link (the lab of tests/netlab.py).

Two lab hosts, ``--one-way`` ms each way; one TCP connection (``TCP_NODELAY``); per size, ``--reps`` requests of
N bytes, each answered by 1 byte once all N arrived, 0.3 s apart (an idle gap, as between decode steps).
Prints the milliseconds of each request. One RTT is the floor; slow start adds round trips for what exceeds
the window. Root, iptables and netfilterqueue (the lab's delays).

    sudo .venv/bin/python -m load_tests.tcp_transfer_probe [--one-way 25] [--keep-tcp-window]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

SERVER = r"""
import socket, sys
s = socket.create_server((sys.argv[1], 7000))
print("up", flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while len(h := c.recv(8, socket.MSG_WAITALL)) == 8:
    n, got = int.from_bytes(h, "big"), 0
    while got < n:
        got += len(c.recv(min(1 << 20, n - got)) or sys.exit())
    c.sendall(b"k")
"""

CLIENT = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], 7000))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for n in map(int, sys.argv[3].split(",")):
    ms = []
    for _ in range(int(sys.argv[2])):
        time.sleep(0.3)
        t = time.perf_counter()
        c.sendall(n.to_bytes(8, "big") + b"x" * n)
        c.recv(1)
        ms.append(f"{1000 * (time.perf_counter() - t):.0f}")
    print(f"{n} bytes: {' '.join(ms)} ms", flush=True)
"""

SIZES = "2304,9216,20736,100000,963000"  # 1 token of SmolLM2 (576 float32), 4, 9, ~43, a 418-token prefill


def main() -> int:
    from tests.netlab import NetLab

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one-way", type=float, default=25.0)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--sizes", default=SIZES)
    parser.add_argument("--keep-tcp-window", action="store_true", help="hosts: tcp_slow_start_after_idle=0")
    args = parser.parse_args()
    with NetLab(keep_tcp_window=args.keep_tcp_window) as lab:
        a, b = lab.host("a", "10.231.0.2"), lab.host("b", "10.231.0.3")
        lab.delay({"a": args.one_way, "b": args.one_way})
        server = subprocess.Popen(lab.argv(b, sys.executable, "-c", SERVER, "10.231.0.3"), stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == b"up"
            argv = lab.argv(a, sys.executable, "-c", CLIENT, "10.231.0.3", str(args.reps), args.sizes)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            print(done.stdout + done.stderr, end="")
            return done.returncode
        finally:
            server.kill()
            server.wait(10)


if __name__ == "__main__":
    sys.exit(main())
