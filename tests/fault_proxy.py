"""An HTTP proxy on loopback that injects faults into chat-completion requests.

Each POST to /v1/chat/completions takes the next fault from a fixed schedule (then passes once
the schedule is spent): drop the connection, answer 500 or 429, stall past the client's timeout,
or forward the request and cut the response body short. Other requests pass through.
"""
from __future__ import annotations

import asyncio
import threading
from collections import Counter

import httpx

FAULTS = ("drop", "500", "429", "stall", "truncate")


class FaultProxy:
    def __init__(self, upstream: str, schedule: list[str], stall_s: float = 10.0):
        self.upstream, self.schedule, self.stall_s = upstream, list(schedule), stall_s
        self.injected: Counter = Counter()
        self.completions = 0  # every POST to /v1/chat/completions, faulty or not
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._client = httpx.AsyncClient(timeout=600)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def _next_fault(self, path: str, method: str) -> str:
        if method != "POST" or path != "/v1/chat/completions":
            return "pass"
        self.completions += 1
        fault = self.schedule.pop(0) if self.schedule else "pass"
        if fault != "pass":
            self.injected[fault] += 1
        return fault

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
                length = int(next((v for k, v in headers.items() if k.lower() == "content-length"), "0"))
                body = await reader.readexactly(length) if length else b""
                fault = self._next_fault(path, method)
                if fault == "drop":
                    break
                if fault == "stall":
                    await asyncio.sleep(self.stall_s)
                    break
                if fault in ("500", "429"):
                    writer.write(f"HTTP/1.1 {fault} Injected\r\ncontent-length: 0\r\n\r\n".encode())
                    await writer.drain()
                    continue
                response = await self._client.request(method, self.upstream + path, content=body,
                                                      headers={"content-type": "application/json"})
                payload = response.content
                cut = payload[: len(payload) // 2] if fault == "truncate" else payload
                writer.write(f"HTTP/1.1 {response.status_code} OK\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(payload)}\r\n\r\n".encode() + cut)
                await writer.drain()
                if fault == "truncate":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
