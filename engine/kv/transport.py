"""Moving KV chunks from a prefill DP rank to the decode instance: both ends of the wire.

Prefill side, one `KVServer` per DP rank: it is the receiver its TransferEngine delivers to. It keeps a
room's chunks until a decode receiver pulls that room, then forwards what it holds and everything
that follows. Decode side, one `KVClient`: `pull(rank, room)` is the receiver's handshake with the
rank the bootstrap server named; chunks land in `inbox` as (rank, KVChunk) for the scheduler thread.

A decode receiver initialised with the wrong rank asks a server that never had the room, so its KV
never arrives: a wrong rank shows up as a timeout, never as silently right output.

Two transports with the same interface:
  in-process  (`pdo run --pd`): a lock and a callback.
  ZMQ         (`pdo launch`): ROUTER on each prefill rank, one DEALER per rank on decode, over TCP
              loopback. ZMQ keeps per-connection message order and frames, and a DEALER/ROUTER pair
              gives the request/stream pattern (pull, then many chunks) without a broker; chunk
              tensors travel as raw frames, no pickling.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import torch

from engine.bootstrap import client as bootstrap_client
from engine.errors import EngineError
from engine.kv.transfer import KVChunk

DROP_RETRY_S = 10.0  # after a failed endpoint lookup, ZmqKVClient.drop skips that rank this long
# The decode's heartbeat to each prefill rank it has connected to (SGLang's decode pings each prefill
# instance: SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL, _MAX_FAILURE). A rank that has not answered
# for HEARTBEAT_TIMEOUT_S is failed: its requests in transfer are aborted (KVPoll.Failed). Shorter
# than SGLang's 5 s x 2 because every peer is on loopback.
HEARTBEAT_INTERVAL_S = 0.1
HEARTBEAT_TIMEOUT_S = 2.0
PONG = b"pong"
LEAVING = b"leaving"  # a prefill rank that ends cleanly says so: its silence then is no failure


class KVTransportError(EngineError):
    """A KV transfer that failed: the peer refused, went away or answered out of protocol."""


class _Rooms:
    """Per-room bookkeeping shared by both servers: buffered chunks, subscribers, what was sent."""

    def __init__(self):
        self.buffered: dict[int, list] = {}
        self.subs: dict[int, object] = {}
        self.done: set[int] = set()  # last chunk forwarded, or dropped by decode
        self.delivered: set[int] = set()  # rooms whose last chunk reached this server

    def unclaimed(self) -> list[int]:
        return sorted(r for r in self.delivered if r not in self.done)


# ---- in-process ------------------------------------------------------------------------------------


class InProcKVServer:
    def __init__(self, rank: int):
        self.rank = rank
        self.endpoint = None
        self._lock = threading.Lock()
        self._rooms = _Rooms()
        self.failed: str | None = None  # why this rank is gone (a fault of `pdo run --pd --kill`)

    def fail(self, reason: str) -> None:
        """The rank dies: nothing more reaches decode, and decode learns it (failed_ranks)."""
        with self._lock:
            self.failed = reason
            self._rooms.subs.clear()

    def deliver(self, chunk: KVChunk) -> None:
        """Called on the prefill's transfer thread. Sinks are called under the lock: a room's chunks
        reach decode in send order even while a pull is flushing the buffered ones."""
        r = self._rooms
        with self._lock:
            if self.failed:
                return
            if chunk.last:
                r.delivered.add(chunk.room)
            if chunk.room in r.done:
                return  # dropped by decode (request aborted): discard
            sink = r.subs.get(chunk.room)
            if sink is None:
                r.buffered.setdefault(chunk.room, []).append(chunk)
                return
            if chunk.last:
                r.done.add(chunk.room)
            sink(self.rank, chunk)

    def pull(self, room: int, sink) -> None:
        r = self._rooms
        with self._lock:
            r.subs[room] = sink
            for c in r.buffered.pop(room, []):
                if c.last:
                    r.done.add(room)
                sink(self.rank, c)

    def drop(self, room: int) -> None:
        with self._lock:
            self._rooms.subs.pop(room, None)
            self._rooms.buffered.pop(room, None)
            self._rooms.done.add(room)

    def unclaimed(self) -> list[int]:
        with self._lock:
            return self._rooms.unclaimed()

    def close(self) -> None:
        pass


class InProcKVClient:
    def __init__(self, servers: dict[int, InProcKVServer]):
        self.servers = servers
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()

    def pull(self, rank: int, room: int) -> None:
        server = self.servers.get(rank)
        if server is None:
            raise KVTransportError(f"no prefill DP rank {rank} (ranks: {sorted(self.servers)})")
        if server.failed:
            raise KVTransportError(f"prefill rank {rank} failed: {server.failed}")
        server.pull(room, lambda r, c: self.inbox.put((r, c)))

    def drop(self, rank: int, room: int) -> None:
        if rank in self.servers:
            self.servers[rank].drop(room)

    def failed_ranks(self) -> dict[int, str]:
        return {i: s.failed for i, s in self.servers.items() if s.failed}

    def close(self) -> None:
        pass


# ---- ZMQ over TCP ------------------------------------------------------------------------------------


def _encode(rank: int, chunk: KVChunk) -> list:
    head = {
        "rank": rank,
        "room": chunk.room,
        "start": chunk.start,
        "pages": chunk.pages,
        "last": chunk.last,
        "meta": chunk.meta,
        "shape": list(chunk.k.shape),
        "dtype": str(chunk.k.dtype).split(".")[-1],
    }
    raw = [
        t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for t in (chunk.k, chunk.v)
    ]
    return [json.dumps(head).encode(), *raw]


def _decode(frames) -> tuple[int, KVChunk]:
    head = json.loads(bytes(frames[0]))
    dtype = getattr(torch, head["dtype"])

    def tensor(buf):
        return (
            torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dtype).reshape(head["shape"])
        )

    chunk = KVChunk(
        head["room"],
        head["start"],
        tensor(frames[1]),
        tensor(frames[2]),
        head["pages"],
        head["last"],
        head["meta"] or {},
    )
    return head["rank"], chunk


class ZmqKVServer:
    """ROUTER bound on a free port. Only the server thread touches the ROUTER; the transfer thread hands
    chunks over an inproc PUSH/PULL pair (ZMQ sockets are not thread-safe)."""

    def __init__(self, rank: int, host: str = "127.0.0.1"):
        import zmq  # lazy: only `pdo launch` uses ZMQ, and importing it slows every start-up

        self.rank = rank
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self.port = self._router.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{self.port}"
        self._wake = f"inproc://kv-server-{rank}-{id(self):x}"
        self._in = self._ctx.socket(zmq.PULL)
        self._in.bind(self._wake)
        self._local = threading.local()
        self._pushes = []
        self._rooms = _Rooms()
        self._lock = threading.Lock()  # guards _rooms for readers on other threads
        self.byes = 0
        self.last_peer: float | None = None  # monotonic time of decode's last message (heartbeat)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kv-server-{rank}", daemon=True)
        self._thread.start()

    def deliver(self, chunk: KVChunk) -> None:
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self._ctx.socket(self._zmq.PUSH)
            push.connect(self._wake)
            self._pushes.append(push)
        push.send_multipart(_encode(self.rank, chunk), copy=False)

    def _serve(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._in, zmq.POLLIN)
        r = self._rooms
        peers: set = set()
        while not self._stop.is_set():
            ready = dict(poller.poll(50))
            if self._in in ready:
                frames = self._in.recv_multipart(copy=False)
                head = json.loads(bytes(frames[0]))
                room = head["room"]
                with self._lock:
                    if head["last"]:
                        r.delivered.add(room)
                    if room in r.done:
                        continue
                    ident = r.subs.get(room)
                    if ident is None:
                        r.buffered.setdefault(room, []).append(frames)
                        continue
                    if head["last"]:
                        r.done.add(room)
                self._router.send_multipart([ident, *frames], copy=False)
            if self._router in ready:
                ident, raw = self._router.recv_multipart()
                msg = json.loads(raw)
                room = msg.get("room")
                self.last_peer = time.monotonic()
                peers.add(ident)
                if msg["op"] == "ping":
                    self._router.send_multipart([ident, PONG])
                    continue
                with self._lock:
                    if msg["op"] == "bye":
                        self.byes += 1
                        continue
                    if msg["op"] == "drop":
                        r.subs.pop(room, None)
                        r.buffered.pop(room, None)
                        r.done.add(room)
                        continue
                    r.subs[room] = ident
                    held = r.buffered.pop(room, [])
                    if any(json.loads(bytes(f[0]))["last"] for f in held):
                        r.done.add(room)
                for frames in held:
                    self._router.send_multipart([ident, *frames], copy=False)
        for ident in peers:
            self._router.send_multipart([ident, LEAVING])
        self._router.close(linger=100)
        self._in.close(linger=0)

    def settled(self, rooms) -> bool:
        """Every room in `rooms` was forwarded in full or dropped by decode."""
        with self._lock:
            return set(rooms) <= self._rooms.done

    def unclaimed(self) -> list[int]:
        with self._lock:
            return self._rooms.unclaimed()

    def peer_lost(self, since: float, timeout_s: float) -> bool:
        """Decode is gone: no message for `timeout_s` (its heartbeat stopped), or none at all within
        `timeout_s` of `since` (it never connected). SGLang's prefill likewise times out a send
        whose decode never comes (SGLANG_DISAGGREGATION_WAITING_TIMEOUT)."""
        last = self.last_peer if self.last_peer is not None else since
        return time.monotonic() - last > timeout_s

    def close(self) -> None:
        """After the prefill's transfer thread has stopped (its PUSH sockets are closed here)."""
        self._stop.set()
        self._thread.join(timeout=5)
        for push in self._pushes:
            push.close(linger=0)
        self._ctx.term()


class ZmqKVClient:
    """One DEALER per prefill rank, owned by the client thread; the scheduler thread sends it commands
    over an inproc pair. Rank endpoints come from the bootstrap server (GET /route), as SGLang's
    receiver learns them."""

    def __init__(self, bootstrap_url: str, *, timeout_s: float = 5.0):
        import zmq  # lazy: only `pdo launch` uses ZMQ, and importing it slows every start-up

        self._zmq = zmq
        self.url = bootstrap_url
        self.timeout_s = timeout_s
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._cmd_addr = f"inproc://kv-client-{id(self):x}"
        self._cmd_in = self._ctx.socket(zmq.PULL)
        self._cmd_in.bind(self._cmd_addr)
        self._cmd_out = self._ctx.socket(zmq.PUSH)
        self._cmd_out.connect(self._cmd_addr)
        self._cmd_lock = threading.Lock()
        self._endpoints: dict[int, str] = {}
        self._lookup_failed: dict[
            int, float
        ] = {}  # rank -> monotonic time before which drop skips it
        self._failed: dict[int, str] = {}  # written by the client thread, read by the scheduler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-client", daemon=True)
        self._thread.start()

    def _endpoint(self, rank: int) -> str:
        ep = self._endpoints.get(rank)
        if ep is None:
            try:
                info = bootstrap_client.get_prefill_rank_info(
                    self.url, dp_rank=rank, tp_rank=0, timeout=self.timeout_s
                )
            except bootstrap_client.BootstrapError as exc:
                raise KVTransportError(f"cannot look up prefill rank {rank}: {exc}") from exc
            if info is None:
                raise KVTransportError(f"bootstrap server has no prefill rank {rank}")
            ep = self._endpoints[rank] = f"tcp://{info['rank_ip']}:{info['rank_port']}"
        return ep

    def _send(self, msg: dict) -> None:
        with self._cmd_lock:
            self._cmd_out.send(json.dumps(msg).encode())

    def pull(self, rank: int, room: int) -> None:
        self._send({"op": "pull", "rank": rank, "ep": self._endpoint(rank), "room": room})

    def drop(self, rank: int, room: int) -> None:
        # A request aborted before its pull has no endpoint cached yet: look it up, or that rank
        # keeps the room's KV buffered for good. A failed lookup (no such rank, or the bootstrap
        # server down: aborts come in bursts exactly then) is not retried for DROP_RETRY_S, so a
        # burst of aborts costs the scheduler one lookup timeout per rank, not one per request.
        if time.monotonic() < self._lookup_failed.get(rank, 0.0):
            return
        try:
            ep = self._endpoint(rank)
        except KVTransportError:
            self._lookup_failed[rank] = time.monotonic() + DROP_RETRY_S
            return
        self._send({"op": "drop", "rank": rank, "ep": ep, "room": room})

    def bye(self, rank: int) -> None:
        self._send({"op": "bye", "rank": rank, "ep": self._endpoint(rank)})

    def failed_ranks(self) -> dict[int, str]:
        return dict(self._failed)

    def _heartbeat(self, dealers: dict, answered: dict, left: set, next_ping: float) -> float:
        """Ping every connected rank each HEARTBEAT_INTERVAL_S; fail one that stays silent."""
        t = time.monotonic()
        if t < next_ping:
            return next_ping
        for rank, d in dealers.items():
            if rank in self._failed or rank in left:
                continue
            if t - answered[rank] > HEARTBEAT_TIMEOUT_S:
                self._failed[rank] = f"no heartbeat answer for {HEARTBEAT_TIMEOUT_S:g} s"
                continue
            d.send(b'{"op": "ping"}')
        return t + HEARTBEAT_INTERVAL_S

    def _serve(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._cmd_in, zmq.POLLIN)
        dealers: dict[int, object] = {}
        by_sock: dict[object, int] = {}
        answered: dict[int, float] = {}  # rank -> monotonic time of its last message
        left: set = set()  # ranks that ended cleanly
        next_ping = 0.0
        while not self._stop.is_set():
            next_ping = self._heartbeat(dealers, answered, left, next_ping)
            for sock, _ in poller.poll(20):
                if sock is self._cmd_in:
                    msg = json.loads(self._cmd_in.recv())
                    d = dealers.get(msg["rank"])
                    if d is None:
                        d = dealers[msg["rank"]] = self._ctx.socket(zmq.DEALER)
                        d.connect(msg["ep"])
                        by_sock[d] = msg["rank"]
                        answered[msg["rank"]] = time.monotonic()
                        poller.register(d, zmq.POLLIN)
                    d.send(json.dumps({"op": msg["op"], "room": msg.get("room")}).encode())
                else:
                    frames = sock.recv_multipart()
                    answered[by_sock[sock]] = time.monotonic()
                    if frames == [LEAVING]:
                        left.add(by_sock[sock])
                    elif frames != [PONG]:
                        self.inbox.put(_decode(frames))
        for d in dealers.values():
            d.close(linger=0)
        self._cmd_in.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._cmd_out.close(linger=0)
        self._ctx.term()
