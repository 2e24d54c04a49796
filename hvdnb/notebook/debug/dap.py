"""A Debug Adapter Protocol client for one rank's debugpy adapter, over TCP.

Messages are JSON bodies behind a ``Content-Length`` header. A reader thread parses what
the adapter sends: a response wakes the request waiting for it (``request``), an event goes
to ``on_event`` (on the reader thread).

Owns: one socket and its reader. Never: decide what a message means for the page
(``hvdnb.notebook.debug.router`` does).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["DapClient", "DapError"]

HEADER = b"Content-Length: "


class DapError(RuntimeError):
    """The adapter refused a request, did not answer in time, or went away."""


class DapClient:
    """One connection to a debugpy adapter.

    Parameters
    ----------
    host, port : where the adapter listens
    on_event : called with each event (a dict) on the reader thread
    name : what errors call this adapter ("rank 1")
    """

    def __init__(
        self,
        host: str,
        port: int,
        on_event: Callable[[dict[str, Any]], None],
        name: str = "adapter",
        timeout: float = 10.0,
    ) -> None:
        self.name = name
        self.on_event = on_event
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.settimeout(None)
        self._send_lock = threading.Lock()
        self._seq = 0
        self._waiting: dict[int, list[Any]] = {}  # seq -> [Event, response]
        self._wait_lock = threading.Lock()
        self.closed = False
        self._reader = threading.Thread(target=self._read, name=f"hvdnb-dap-{name}", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ sending
    def send(self, command: str, arguments: dict[str, Any] | None = None) -> int:
        """Send a request without waiting; its sequence number."""
        with self._send_lock:
            self._seq += 1
            seq = self._seq
            body = {"seq": seq, "type": "request", "command": command}
            if arguments is not None:
                body["arguments"] = arguments
            data = json.dumps(body).encode()
            with self._wait_lock:
                self._waiting[seq] = [threading.Event(), None]
            try:
                self._sock.sendall(HEADER + str(len(data)).encode() + b"\r\n\r\n" + data)
            except OSError as exc:
                self._fail(f"{self.name}'s debugger went away ({exc})")
        return seq

    def wait(self, seq: int, timeout: float = 10.0) -> dict[str, Any]:
        """The response to request ``seq``; ``DapError`` if it failed or did not come."""
        with self._wait_lock:
            slot = self._waiting.get(seq)
        if slot is None:
            raise DapError(f"{self.name}: no request {seq} is waiting")
        if not slot[0].wait(timeout):
            with self._wait_lock:
                self._waiting.pop(seq, None)
            raise DapError(f"{self.name}'s debugger did not answer within {timeout:g} s")
        with self._wait_lock:
            self._waiting.pop(seq, None)
        response: dict[str, Any] = slot[1]
        if response.get("type") == "closed":
            raise DapError(response["message"])
        return response

    def request(
        self, command: str, arguments: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> dict[str, Any]:
        """Send a request and wait for its response (successful or not)."""
        return self.wait(self.send(command, arguments), timeout)

    def close(self) -> None:
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    # ------------------------------------------------------------------ reading
    def _fail(self, message: str) -> None:
        self.closed = True
        with self._wait_lock:
            for slot in self._waiting.values():
                slot[1] = {"type": "closed", "message": message}
                slot[0].set()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = self._sock.recv(65536)
                    if not chunk:
                        raise EOFError
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                size = next(
                    int(line[len(HEADER) :])
                    for line in head.split(b"\r\n")
                    if line.startswith(HEADER)
                )
                while len(buf) < size:
                    chunk = self._sock.recv(65536)
                    if not chunk:
                        raise EOFError
                    buf += chunk
                msg = json.loads(buf[:size])
                buf = buf[size:]
                self._dispatch(msg)
        except (OSError, EOFError, ValueError, StopIteration):
            pass
        self._fail(f"{self.name}'s debugger went away")
        if not self.closed:
            self.closed = True
        try:
            self.on_event({"type": "event", "event": "hvdnb_closed", "body": {}})
        except Exception:
            pass

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if msg.get("type") == "response":
            with self._wait_lock:
                slot = self._waiting.get(msg.get("request_seq", -1))
            if slot is not None:
                slot[1] = msg
                slot[0].set()
        elif msg.get("type") == "event":
            try:
                self.on_event(msg)
            except Exception:  # a fault in the router must not end the reader
                pass
