"""Bulk TCP sender/receiver run inside the emulated nodes (stdlib only, run as a script).

``python _tcp_endpoint.py recv PORT`` prints ``READY`` once listening, then,
after the transfer, one JSON line ``{"bytes": N, "seconds": T}`` where ``T`` runs
from the first byte to the last. ``python _tcp_endpoint.py send HOST PORT
SECONDS`` streams 1 MiB writes for ``SECONDS`` and closes. It is executed as a
file, not imported, so starting it in a namespace costs no ``import torch``.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def receive(port: int) -> None:
    """Accepts one connection, drains it and reports bytes and duration."""
    with socket.create_server(("0.0.0.0", port), backlog=1) as srv:
        print("READY", flush=True)
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            total = 0
            first = last = 0.0
            while True:
                n = conn.recv_into(view)
                if n == 0:
                    break
                last = time.monotonic()
                if total == 0:
                    first = last
                total += n
    print(json.dumps({"bytes": total, "seconds": last - first}), flush=True)


def send(host: str, port: int, seconds: float) -> None:
    """Connects (retrying for 5 s) and writes for ``seconds``."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = b"\0" * CHUNK
    with sock:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # wait for the receiver to close: every byte was read


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        receive(int(sys.argv[2]))
    else:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
