"""A second implementation of Aerie's wire contract, for the tests.

Frames (services/rpc/frame.h) are cut by hand here and messages go through
Google's protobuf runtime, with aerie_pb2 compiled from proto/aerie.proto by
protoc at test time: the C services (nanopb) and this client agree only
through the contract itself.
"""
import os
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MAGIC = 0x46524541
VERSION = 3
HEADER = struct.Struct("<IBBHIIIII I".replace(" ", ""))
REQUEST, REPLY, ITEM, END, CANCEL, PING, PONG = range(1, 8)
STATUS = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
          "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
          "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
          "UNAUTHENTICATED"]

_pb2 = None


def pb2():
    """aerie_pb2, compiled once per process from proto/aerie.proto."""
    global _pb2
    if _pb2 is None:
        out = Path(tempfile.mkdtemp(prefix="aerie-pb2-"))
        subprocess.run(["protoc", f"-I{ROOT / 'proto'}", f"--python_out={out}",
                        str(ROOT / "proto" / "aerie.proto")], check=True)
        sys.path.insert(0, str(out))
        import aerie_pb2  # noqa: E402
        _pb2 = aerie_pb2
    return _pb2


def frame(kind, method=0, call_id=0, msg=b"", payload=b"", status=0, timeout_us=0, version=VERSION):
    return HEADER.pack(MAGIC, version, kind, method, call_id, status, timeout_us, len(msg),
                       len(payload), 0) + msg + payload


class Closed(Exception):
    pass


class Conn:
    """One connection; calls may overlap (read_frame hands out any frame)."""

    def __init__(self, addr, tls=None, timeout=300):
        if addr.startswith("unix:"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(addr[5:])
        else:
            host, port = addr.rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=timeout)
            if tls:
                s = tls.wrap_socket(s, server_hostname=host)
        self.sock = s
        self.buf = b""
        self.next_id = 1
        self.lock = threading.Lock()

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, data):
        with self.lock:
            self.sock.sendall(data)

    def _need(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise Closed("the server closed the connection")
            self.buf += chunk

    def read_frame(self):
        self._need(HEADER.size)
        magic, ver, kind, method, call_id, status, _t, mlen, plen, _r = HEADER.unpack_from(self.buf)
        assert magic == MAGIC, "bad magic from the server"
        self._need(HEADER.size + mlen + plen)
        msg = self.buf[HEADER.size:HEADER.size + mlen]
        payload = self.buf[HEADER.size + mlen:HEADER.size + mlen + plen]
        self.buf = self.buf[HEADER.size + mlen + plen:]
        return dict(version=ver, kind=kind, method=method, call_id=call_id, status=status), msg, payload

    def new_id(self):
        i = self.next_id
        self.next_id += 1
        return i

    def unary(self, method, msg, payload=b"", timeout_us=0):
        """(status name, reply bytes or error text)."""
        cid = self.new_id()
        self.send(frame(REQUEST, method, cid, msg, payload, timeout_us=timeout_us))
        while True:
            h, m, _p = self.read_frame()
            if h["call_id"] == cid and h["kind"] in (REPLY, END):
                return STATUS[h["status"]], m


def generate_request(prompt, max_tokens, request_id="", **kw):
    p = pb2()
    req = p.GenerateRequest(request_id=request_id, max_tokens=max_tokens, **kw)
    payload = struct.pack(f"<{len(prompt)}i", *prompt)
    req.prompt.offset = 0
    req.prompt.length = len(payload)
    return req.SerializeToString(), payload


def start_generate(conn, prompt, max_tokens, request_id="", **kw):
    msg, payload = generate_request(prompt, max_tokens, request_id, **kw)
    cid = conn.new_id()
    conn.send(frame(REQUEST, p_method("TARGET_GENERATE"), cid, msg, payload))
    return cid


def p_method(name):
    return pb2().Method.Value(name)


class Stream:
    def __init__(self):
        self.tokens = []
        self.events = []
        self.status = None
        self.error = None
        self.t_first = None


def collect(conn, ids):
    """Reads until every call in ids has ended: {call id: Stream}."""
    p = pb2()
    streams = {i: Stream() for i in ids}
    left = set(ids)
    while left:
        h, m, _p = conn.read_frame()
        s = streams.get(h["call_id"])
        if s is None:
            continue
        if h["kind"] == ITEM:
            ev = p.GenerateEvent.FromString(m)
            if s.t_first is None:
                s.t_first = time.monotonic()
            s.tokens.extend(ev.tokens)
            s.events.append(ev)
        elif h["kind"] in (END, REPLY):
            s.status = STATUS[h["status"]]
            if h["status"]:
                s.error = m.decode("utf-8", "replace")
            left.discard(h["call_id"])
    return streams


def generate(addr, prompt, max_tokens, tls=None, **kw):
    c = Conn(addr, tls)
    try:
        cid = start_generate(c, prompt, max_tokens, **kw)
        return collect(c, [cid])[cid]
    finally:
        c.close()


def info(addr, method="TARGET_INFO", tls=None):
    import json
    c = Conn(addr, tls)
    try:
        st, m = c.unary(p_method(method), b"")
        assert st == "OK", (st, m)
        r = pb2().InfoReply.FromString(m)
        return r, json.loads(r.stats_json), json.loads(r.config_json)
    finally:
        c.close()


def wait_for_socket(addr, proc, timeout=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}")
        try:
            if addr.startswith("unix:"):
                if os.path.exists(addr[5:]):
                    s = socket.socket(socket.AF_UNIX)
                    s.connect(addr[5:])
                    s.close()
                    return
            else:
                host, port = addr.rsplit(":", 1)
                socket.create_connection((host, int(port)), timeout=1).close()
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{addr} not up after {timeout}s")
