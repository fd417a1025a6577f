"""Tests for loopclient.py: standard library only (``python3 -S -m unittest -v test_loopclient``).

Order follows the data: parsers fed bytes (whole, byte by byte, split at every offset), the transport over
socket pairs, the client against an in-process fake server on a real Unix socket (and TCP), the command
line through ``main(argv)``, and last a tier against a real llama-server, run when ``LOOPCLIENT_REAL_SOCKET``
names its socket (``.ci/run`` provisions one).  Every blocking call has a timeout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
import unittest

import loopclient as lc

HERE = os.path.dirname(os.path.abspath(__file__))
TRANSCRIPTS = os.path.join(HERE, "..", "shared", "transcripts")

# -----------------------------------------------------------------------------------------------------
# Fixtures: bytes copied from a real llama-server (../shared/transcripts), shortened where noted
# -----------------------------------------------------------------------------------------------------

CID = "chatcmpl-LUGNfJTvMyZxeARiBgwpFYfe9BqbpYkn"
MODEL = "models/gemma-3-270m-q4_k_m.gguf"
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nAccess-Control-Allow-Origin: \r\nX-Accel-Buffering: no\r\n"
    b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
)


def chunk_json(delta=None, finish=None, cid=CID, extra=None, choices=True):
    """One chunk payload as llama-server writes it (key order and separators included)."""
    doc = {}
    if choices:
        doc["choices"] = [{"finish_reason": finish, "index": 0, "delta": delta if delta is not None else {}}]
    else:
        doc["choices"] = []
    doc.update({"created": 1796006109, "id": cid, "model": MODEL, "system_fingerprint": "b0-unknown",
                "object": "chat.completion.chunk"})
    if extra:
        doc.update(extra)
    return json.dumps(doc, separators=(",", ":"))


def sse(*payloads):
    return b"".join(b"data: " + p.encode() + b"\n\n" for p in payloads)


def chunked(*bodies):
    """HTTP chunks, one per body, hex sizes as llama-server writes them."""
    return b"".join(b"%x\r\n%s\r\n" % (len(b), b) for b in bodies)


TIMINGS = {"cache_n": 1, "prompt_n": 29, "prompt_ms": 76.722, "prompt_per_token_ms": 2.6455862068965517,
           "prompt_per_second": 377.98806079090747, "predicted_n": 16, "predicted_ms": 192.748,
           "predicted_per_token_ms": 12.849866666666665, "predicted_per_second": 77.82181916284476}
USAGE = {"completion_tokens": 8, "prompt_tokens": 26, "total_tokens": 34, "prompt_tokens_details": {"cached_tokens": 21}}


def content_stream(words, finish="stop", usage=True, done=True, role=True):
    """A whole llama-server stream body (chunked), in the real server's shape: role-only first chunk sharing
    an HTTP chunk with the first delta, one chunk per delta, finish with timings, usage chunk, [DONE], 0."""
    events = []
    if role:
        events.append(sse(chunk_json({"role": "assistant", "content": None})))
    for i, word in enumerate(words):
        piece = sse(chunk_json({"content": word}))
        if i == 0 and role:
            events[0] += piece
        else:
            events.append(piece)
    if finish is not None:
        fin = sse(chunk_json({}, finish, extra={"timings": TIMINGS}))
        if usage:
            fin += sse(chunk_json(choices=False, extra={"usage": USAGE, "timings": TIMINGS}))
        events.append(fin)
    if done:
        events.append(b"data: [DONE]\n\n")
    return chunked(*events) + b"0\r\n\r\n"


def load_transcript(name):
    """The raw response bytes of a transcript file, or None when ../shared is not beside the checkout."""
    path = os.path.join(TRANSCRIPTS, name)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        raw = f.read()
    marker = raw.index(b"<<< RESPONSE")
    return raw[raw.index(b"\n", marker) + 1 :]


# -----------------------------------------------------------------------------------------------------
# The fake server: a real Unix (or TCP) socket, one thread per connection, scripted by path
# -----------------------------------------------------------------------------------------------------


class FakeRequest:
    def __init__(self, server, conn, method, path, headers, body):
        self.server = server
        self.conn = conn
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.closed_by_peer = threading.Event()

    def json(self):
        return json.loads(self.body)

    def send(self, data):
        try:
            self.conn.sendall(data)
            return True
        except OSError:
            self.closed_by_peer.set()
            return False

    def wait_peer_close(self, timeout):
        """True once the client has closed its end (recv returns b"" or fails) within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.conn.settimeout(max(0.001, min(0.05, deadline - time.monotonic())))
            try:
                data = self.conn.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                data = b""
            if not data:
                self.closed_by_peer.set()
                return True
        return False


def respond_json(req, doc, status=200, reason="OK", extra_headers=b""):
    body = json.dumps(doc, separators=(",", ":")).encode()
    req.send(b"HTTP/1.1 %d %s\r\nServer: llama.cpp\r\nContent-Type: application/json; charset=utf-8\r\n"
             b"Content-Length: %d\r\n%sConnection: close\r\n\r\n%s" % (status, reason.encode(), len(body), extra_headers, body))


class FakeServer:
    """Answers by path with scripted handlers; records requests; by default /slots from ``busy`` flags."""

    def __init__(self, tcp=False, n_slots=2, listen=True):
        self.tcp = tcp
        self.tmp = tempfile.mkdtemp(prefix="lc", dir="/tmp")
        self.path = os.path.join(self.tmp, "s.sock")
        self.routes = {}
        self.requests = []
        self.busy = [False] * n_slots
        self.lock = threading.Lock()
        self.slots_in_flight = 0
        self.slots_max_in_flight = 0
        self.slots_requests = 0
        self.slots_delay = 0.0
        self.threads = []
        self.conns = []
        self.stopping = threading.Event()
        self.listener = None
        self.address = None
        self.route("GET", "/slots", self._slots)
        self.route("GET", "/props", lambda req: respond_json(req, {"total_slots": len(self.busy), "build_info": "b0-unknown"}))
        self.route("GET", "/health", lambda req: respond_json(req, {"status": "ok"}))
        if listen:
            self.listen()

    def listen(self):
        if self.tcp:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            self.address = "http://127.0.0.1:%d" % sock.getsockname()[1]
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(self.path)
            self.address = self.path
        sock.listen(64)
        sock.settimeout(0.05)
        self.listener = sock
        thread = threading.Thread(target=self._accept, args=(sock,), daemon=True)
        thread.start()
        self.threads.append(thread)

    def route(self, method, path, handler):
        self.routes[(method, path)] = handler

    def stream(self, handler):
        self.route("POST", "/v1/chat/completions", handler)

    def _slots(self, req):
        with self.lock:
            self.slots_requests += 1
            self.slots_in_flight += 1
            self.slots_max_in_flight = max(self.slots_max_in_flight, self.slots_in_flight)
            busy = list(self.busy)
        try:
            if self.slots_delay:
                self.stopping.wait(self.slots_delay)
            respond_json(req, [{"id": i, "n_ctx": 1024, "speculative": False, "is_processing": b} for i, b in enumerate(busy)])
        finally:
            with self.lock:
                self.slots_in_flight -= 1

    def _accept(self, sock):
        while not self.stopping.is_set():
            try:
                conn, _ = sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self.lock:
                self.conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            with self.lock:
                self.threads.append(thread)

    def _serve(self, conn):
        try:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            while len(body) < length:
                more = conn.recv(65536)
                if not more:
                    return
                body += more
            req = FakeRequest(self, conn, method, path, headers, body)
            req.raw_head = head
            with self.lock:
                self.requests.append(req)
            handler = self.routes.get((method, path))
            if handler is None:
                respond_json(req, {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}, 404, "Not Found")
            else:
                handler(req)
        except OSError:
            pass
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def chat_requests(self):
        with self.lock:
            return [r for r in self.requests if r.path == "/v1/chat/completions"]

    def close(self):
        self.stopping.set()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        with self.lock:
            conns = list(self.conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in list(self.threads):
            thread.join(5)
        shutil.rmtree(self.tmp, ignore_errors=True)


def wait_for(predicate, timeout=5.0, what="condition"):
    """Wait until ``predicate()`` is true; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError("timed out after %.1f s waiting for %s" % (timeout, what))


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def run_with_timeout(fn, timeout=10.0):
    """Run ``fn`` in a thread; return its result or raise its exception; fail if it takes over ``timeout``."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: B036 - carried to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError("call did not return within %.1f s" % timeout)
    if "error" in box:
        raise box["error"]
    return box.get("value")


FAST = lc.Limits(poll=0.05, liveness=2.0, busy_wait=3.0, load_wait=2.0, idle_grace=0.5)
MSGS = [{"role": "user", "content": "hi"}]


class ServerCase(unittest.TestCase):
    """A fake server per test, with descriptor and thread counts checked at the end."""

    tcp = False
    limits = FAST

    def setUp(self):
        self.fds = fd_count()
        self.threads = threading.active_count()
        self.server = FakeServer(tcp=self.tcp)
        self.client = lc.Client(self.server.address, limits=self.limits)
        self.closers = []

    def tearDown(self):
        for close in self.closers:
            close()
        self.client.close()
        self.server.close()
        wait_for(lambda: threading.active_count() <= self.threads, 5, "threads to end")
        wait_for(lambda: fd_count() <= self.fds, 5, "descriptors to close")

    def use(self, handler):
        self.server.stream(handler)

    def collect(self, client=None, **kw):
        events = []
        slot = kw.pop("slot", 0)
        completion = run_with_timeout(lambda: (client or self.client).chat(MSGS, slot=slot, on_event=events.append, **kw))
        return completion, events


# =====================================================================================================
# The client against the fake server
# =====================================================================================================


def serve_body(body):
    return lambda req: req.send(STREAM_HEAD + body)


class TestClientStream(ServerCase):
    def test_stream_assembles_real_server_bytes(self):
        self.use(serve_body(content_stream(["Write", " one", " sentence"])))
        completion, events = self.collect(max_tokens=16, temperature=0)
        self.assertEqual(events, [lc.Content("Write"), lc.Content(" one"), lc.Content(" sentence")])
        self.assertEqual(completion, lc.Completion(
            id=CID, model=MODEL, content="Write one sentence", reasoning="", tool_calls=[], finish_reason="stop",
            usage=USAGE, timings=TIMINGS, reasoning_tokens=0, thinking_capped=False))

    def test_transcript_04_replayed_byte_for_byte(self):
        raw = load_transcript("04_chat_stream.raw.txt")
        if raw is None:
            self.skipTest("../shared/transcripts is not beside this checkout")
        self.use(lambda req: req.send(raw))
        completion, events = self.collect()
        self.assertEqual(completion.content, "Write one sentence about the sea.<|im_end|>\n<|im")
        self.assertEqual(completion.finish_reason, "length")
        self.assertEqual(completion.timings["predicted_n"], 16)
        self.assertEqual(len(events), 16)

    def test_request_bytes_follow_the_wire_rules(self):
        self.use(serve_body(content_stream(["ok"])))
        self.collect(slot=1, max_tokens=8, tools=[{"type": "function", "function": {"name": "f"}}],
                     stop=["\n"], seed=7, chat_template_kwargs={"enable_thinking": True},
                     stream_options={"continuous_usage_stats": True})
        req = self.server.chat_requests()[0]
        head = req.raw_head.decode()
        self.assertTrue(head.startswith("POST /v1/chat/completions HTTP/1.1\r\n"))
        self.assertEqual(req.headers["host"], self.server.address[len("http://"):] if self.tcp else "localhost")
        self.assertEqual(req.headers["content-type"], "application/json")
        self.assertEqual(req.headers["accept"], "text/event-stream")
        self.assertEqual(req.headers["user-agent"], "loopclient/" + lc.__version__)
        self.assertEqual(int(req.headers["content-length"]), len(req.body))
        self.assertNotIn("authorization", req.headers)
        self.assertEqual(req.json(), {
            "messages": MSGS, "max_tokens": 8, "tools": [{"type": "function", "function": {"name": "f"}}],
            "stop": ["\n"], "seed": 7, "chat_template_kwargs": {"enable_thinking": True}, "stream": True,
            "stream_options": {"continuous_usage_stats": True, "include_usage": True}, "id_slot": 1})

    def test_any_slot_sends_no_id_slot(self):
        self.use(serve_body(content_stream(["ok"])))
        self.collect(slot=None)
        self.assertNotIn("id_slot", self.server.chat_requests()[0].json())

    def test_api_key_and_extra_headers(self):
        self.use(serve_body(content_stream(["ok"])))
        client = lc.Client(self.server.address, limits=FAST, api_key="sk-secret", headers={"X-Trace": "1"})
        self.collect(client=client)
        req = self.server.chat_requests()[0]
        self.assertEqual(req.headers["authorization"], "Bearer sk-secret")
        self.assertEqual(req.headers["x-trace"], "1")
        self.assertNotIn("sk-secret", repr(client))

    def test_stream_object_iterates_and_keeps_completion(self):
        self.use(serve_body(content_stream(["a", "b"])))
        with self.client.stream(MSGS, slot=0) as stream:
            self.assertIsNone(stream.completion)
            events = run_with_timeout(lambda: list(stream))
        self.assertEqual(events, [lc.Content("a"), lc.Content("b")])
        self.assertEqual(stream.completion.content, "ab")

    def test_reasoning_and_tool_calls(self):
        body = chunked(
            sse(chunk_json({"role": "assistant", "content": None})),
            sse(chunk_json({"reasoning_content": "think"})),
            sse(chunk_json({"reasoning_content": ""})),
            sse(chunk_json({"reasoning_content": " more"})),
            sse(chunk_json({"tool_calls": [{"index": 0, "id": "call1", "type": "function",
                                            "function": {"name": "get_weather", "arguments": "{"}}]})),
            sse(chunk_json({"tool_calls": [{"index": 0, "function": {"arguments": "\"city\": \"Paris\"}"}}]})),
            sse(chunk_json({}, "tool_calls")),
            b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.use(serve_body(body))
        completion, events = self.collect()
        self.assertEqual(events, [
            lc.Reasoning("think"), lc.Reasoning(" more"),
            lc.ToolCall(0, "call1", "get_weather", "{"), lc.ToolCall(0, None, None, "\"city\": \"Paris\"}")])
        self.assertEqual(completion.reasoning, "think more")
        self.assertEqual(completion.reasoning_tokens, 2)
        self.assertEqual(completion.tool_calls, [lc.ToolCallResult("call1", "get_weather", "{\"city\": \"Paris\"}")])
        self.assertEqual(completion.finish_reason, "tool_calls")

    def test_clean_end_after_finish_without_done(self):
        self.use(serve_body(content_stream(["x"], done=False)))
        completion, _ = self.collect()
        self.assertEqual((completion.content, completion.finish_reason), ("x", "stop"))

    def test_done_without_finish_reason_is_stream_closed(self):
        self.use(serve_body(content_stream(["x"], finish=None)))
        with self.assertRaises(lc.StreamClosedError):
            self.collect()

    def test_done_ends_the_response_before_the_final_chunk(self):
        body = chunked(sse(chunk_json({"content": "x"})), sse(chunk_json({}, "stop")), b"data: [DONE]\n\n")

        def handler(req):
            req.send(STREAM_HEAD + body)
            req.wait_peer_close(3)  # never sends the 0 chunk: the client must not wait for it

        self.use(handler)
        start = time.monotonic()
        completion, _ = self.collect()
        self.assertLess(time.monotonic() - start, 1.0)
        self.assertEqual(completion.content, "x")

    def test_http_error_status_carries_the_envelope(self):
        body = (b'{"error":{"code":400,"message":"request (3024 tokens) exceeds the available context size (1024 tokens),'
                b' try increasing it","type":"exceed_context_size_error","n_prompt_tokens":3024,"n_ctx":1024}}')
        self.use(lambda req: req.send(b"HTTP/1.1 400 Bad Request\r\nServer: llama.cpp\r\nContent-Type: application/json;"
                                      b" charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)))
        with self.assertRaises(lc.HTTPStatusError) as cm:
            self.collect()
        self.assertEqual(cm.exception.status, 400)
        self.assertEqual(cm.exception.message,
                         "request (3024 tokens) exceeds the available context size (1024 tokens), try increasing it")
        self.assertEqual(cm.exception.body, body)
        self.assertEqual(len(self.server.chat_requests()), 1)

    def test_midstream_error_event_is_server_error_and_not_replayed(self):
        body = chunked(sse(chunk_json({"role": "assistant", "content": None})),
                       sse(chunk_json({"reasoning_content": "is"})),
                       b'data: {"error":{"code":500,"message":"got exception: boom","type":"server_error"}}\n\n') + b"0\r\n\r\n"
        self.use(serve_body(body))
        with self.assertRaises(lc.ServerError) as cm:
            self.collect()
        self.assertEqual((cm.exception.code, cm.exception.message, cm.exception.type), (500, "got exception: boom", "server_error"))
        self.assertEqual(len(self.server.chat_requests()), 1)


class TestClientStreamTCP(TestClientStream):
    tcp = True


class TestSingleShot(ServerCase):
    def test_slots_health_props_models(self):
        self.server.busy[1] = True
        self.server.route("GET", "/v1/models", lambda req: respond_json(req, {"object": "list", "data": [{"id": MODEL}]}))
        slots = self.client.slots()
        self.assertEqual([(s.id, s.is_processing) for s in slots], [(0, False), (1, True)])
        self.assertEqual(slots[0].raw["n_ctx"], 1024)
        self.assertEqual(self.client.health(), {"status": "ok"})
        self.assertEqual(self.client.props()["total_slots"], 2)
        self.assertEqual(self.client.models()["data"][0]["id"], MODEL)

    def test_loading_server_is_http_status_error(self):
        self.server.route("GET", "/health", lambda req: respond_json(
            req, {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}, 503, "Service Unavailable"))
        with self.assertRaises(lc.HTTPStatusError) as cm:
            self.client.health()
        self.assertEqual((cm.exception.status, cm.exception.message), (503, "Loading model"))

    def test_unknown_endpoint_404(self):
        with self.assertRaises(lc.HTTPStatusError) as cm:
            self.client.models()
        self.assertEqual((cm.exception.status, cm.exception.message), (404, "File Not Found"))

    def test_missing_socket_is_connect_error(self):
        client = lc.Client(self.server.tmp + "/missing.sock", limits=FAST)
        with self.assertRaises(lc.ConnectError) as cm:
            client.health()
        self.assertEqual(cm.exception.address, self.server.tmp + "/missing.sock")
        self.assertIsInstance(cm.exception.__cause__, FileNotFoundError)

    def test_silence_is_stalled_after_liveness(self):
        self.server.route("GET", "/props", lambda req: req.wait_peer_close(5))
        client = lc.Client(self.server.address, limits=lc.Limits(liveness=0.3))
        start = time.monotonic()
        with self.assertRaises(lc.StalledError):
            client.props()
        self.assertGreaterEqual(time.monotonic() - start, 0.29)
        self.assertLess(time.monotonic() - start, 0.8)

    def test_end_reasoning(self):
        seen = []

        def control(req):
            seen.append(req.json())
            respond_json(req, {"success": req.json()["id"] == "chatcmpl-1"})

        self.server.route("POST", "/v1/chat/completions/control", control)
        self.assertTrue(self.client.end_reasoning("chatcmpl-1"))
        self.assertFalse(self.client.end_reasoning("chatcmpl-2"))
        self.assertEqual(seen[0], {"id": "chatcmpl-1", "action": "reasoning_end"})


class TestCallerMistakes(unittest.TestCase):
    def test_bad_addresses(self):
        for bad in ("", "ftp://x", "http://", "http://host:99999", "http://host:port", "http://h/path", "/tmp/" + "x" * 120):
            with self.assertRaises(ValueError, msg=bad):
                lc.Client(bad)
        with self.assertRaises(TypeError):
            lc.Client(8080)

    def test_addresses(self):
        self.assertEqual(lc.parse_address("/run/llama.sock").target, "/run/llama.sock")
        self.assertEqual(lc.parse_address("unix:///run/llama.sock").target, "/run/llama.sock")
        tcp = lc.parse_address("http://127.0.0.1:8080/")
        self.assertEqual((tcp.unix, tcp.target, tcp.host), (False, ("127.0.0.1", 8080), "127.0.0.1:8080"))
        v6 = lc.parse_address("http://[::1]:9000")
        self.assertEqual((v6.target, v6.host), (("::1", 9000), "[::1]:9000"))

    def test_header_injection_refused_before_sending(self):
        for kwargs in ({"api_key": "k\r\nX: y"}, {"headers": {"X-A": "v\nw"}}, {"headers": {"X\r\nB": "v"}}):
            with self.assertRaises(ValueError) as cm:
                lc.Client("/tmp/x.sock", **kwargs)
            self.assertNotIn("k\r\nX", str(cm.exception))
        with self.assertRaises(ValueError):
            lc.encode_request("GET", "/x\r\nY: z", "localhost")

    def test_body_not_serialisable_and_bad_limits(self):
        client = lc.Client("/tmp/lc-none.sock")
        with self.assertRaises(TypeError):
            client.stream(MSGS, foo=object())
        with self.assertRaises(ValueError):
            client.stream(MSGS, temperature=float("nan"))
        with self.assertRaises(ValueError):
            client.stream(MSGS, slot=-1)
        for bad in ({"poll": -1}, {"queue_len": -2}, {"liveness": 0}, {"max_line": -5}):
            with self.assertRaises(ValueError):
                lc.Limits(**bad)
        with self.assertRaises(TypeError):
            lc.Limits(poll="1")

    def test_timeouts_are_builtin_timeouts(self):
        for cls in (lc.WaitTimeoutError, lc.LoadTimeoutError, lc.StalledError):
            self.assertTrue(issubclass(cls, TimeoutError) and issubclass(cls, lc.LoopError))


def hold_then(body, release, server=None):
    """A handler that sends nothing until ``release`` is set (a busy slot), then ``body``."""

    def handler(req):
        deadline = time.monotonic() + 10
        while not release.is_set():
            if req.wait_peer_close(0.02) or req.server.stopping.is_set() or time.monotonic() > deadline:
                return
        req.send(STREAM_HEAD + body)

    return handler


class Timer:
    def __init__(self):
        self.start = time.monotonic()

    @property
    def elapsed(self):
        return time.monotonic() - self.start


MARGIN = 0.35  # scheduling slack on a loaded 2-core machine


class TestWaitForHead(ServerCase):
    def budget(self, **kw):
        return lc.Limits(**dict(dict(poll=0.05, liveness=2.0, busy_wait=5.0, load_wait=5.0, idle_grace=5.0), **kw))

    def test_busy_slot_is_waited_out_then_streams(self):
        release = threading.Event()
        self.server.busy[0] = True
        self.use(hold_then(content_stream(["done"]), release))
        events = []

        def on_event(ev):
            events.append(ev)
            if len([e for e in events if isinstance(e, lc.Waiting)]) == 3:
                self.server.busy[0] = False
                release.set()

        completion = run_with_timeout(lambda: self.client.chat(MSGS, slot=0, on_event=on_event))
        self.assertEqual(completion.content, "done")
        self.assertEqual(events[:3], [lc.Waiting(True)] * 3)
        self.assertEqual(events[-1], lc.Content("done"))

    def test_busy_slot_past_busy_wait(self):
        self.server.busy[0] = True
        self.use(hold_then(b"", threading.Event()))
        client = lc.Client(self.server.address, limits=self.budget(busy_wait=0.6))
        t = Timer()
        events = []
        with self.assertRaises(lc.WaitTimeoutError) as cm:
            run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        self.assertGreaterEqual(t.elapsed, 0.6)
        self.assertLess(t.elapsed, 0.6 + MARGIN)
        self.assertIsInstance(cm.exception, TimeoutError)
        self.assertTrue(events and all(e == lc.Waiting(True) for e in events))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(2))

    def test_idle_slot_and_no_head_is_stalled_after_idle_grace(self):
        self.use(hold_then(b"", threading.Event()))
        client = lc.Client(self.server.address, limits=self.budget(idle_grace=0.5))
        t = Timer()
        events = []
        with self.assertRaises(lc.StalledError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        self.assertGreaterEqual(t.elapsed, 0.5)
        self.assertLess(t.elapsed, 0.5 + MARGIN)
        self.assertTrue(events and all(e == lc.Waiting(False) for e in events))

    def test_slots_failing_is_load_timeout_after_load_wait(self):
        self.server.route("GET", "/slots", lambda req: respond_json(
            req, {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}, 503, "Service Unavailable"))
        self.use(hold_then(b"", threading.Event()))
        client = lc.Client(self.server.address, limits=self.budget(load_wait=0.5))
        t = Timer()
        with self.assertRaises(lc.LoadTimeoutError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        self.assertGreaterEqual(t.elapsed, 0.5)
        self.assertLess(t.elapsed, 0.5 + MARGIN)

    def test_budgets_restart_when_the_situation_changes(self):
        # busy 0.35 s, unavailable 0.35 s, busy 0.35 s: each under its 0.5 s budget, 1.05 s in all
        phase = {"state": "busy"}
        release = threading.Event()

        def slots(req):
            if phase["state"] == "down":
                respond_json(req, {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}, 503, "x")
            else:
                respond_json(req, [{"id": 0, "is_processing": True}])

        def driver():
            for state in ("down", "busy"):
                time.sleep(0.35)  # the phases of the scripted server, not a wait for a condition
                phase["state"] = state
            time.sleep(0.35)
            release.set()

        self.server.route("GET", "/slots", slots)
        self.use(hold_then(content_stream(["ok"]), release))
        client = lc.Client(self.server.address, limits=self.budget(busy_wait=0.5, load_wait=0.5))
        threading.Thread(target=driver, daemon=True).start()
        events = []
        completion = run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        self.assertEqual(completion.content, "ok")
        waits = [e.slot_busy for e in events if isinstance(e, lc.Waiting)]
        self.assertIn(False, waits)
        self.assertEqual(waits[0], True)
        self.assertEqual(waits[-1], True)

    def test_five_waiters_share_one_slots_request(self):
        for _ in range(3):
            self.server.busy.append(True)
        self.server.busy[:2] = [True, True]
        self.server.slots_delay = 0.08
        release = threading.Event()
        self.use(hold_then(content_stream(["ok"]), release))
        client = lc.Client(self.server.address, limits=self.budget(poll=0.05))
        waits = []
        lock = threading.Lock()

        def run(slot):
            def on_event(ev):
                with lock:
                    waits.append(ev)
            return client.chat(MSGS, slot=slot, on_event=on_event)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(5)]
        for th in threads:
            th.start()
        wait_for(lambda: len(waits) >= 40, 10, "Waiting events")
        release.set()
        for th in threads:
            th.join(5)
        self.assertEqual(self.server.slots_max_in_flight, 1)
        # far fewer /slots requests than Waiting events: answers are shared and reused
        self.assertLess(self.server.slots_requests, len(waits) / 2)

    def test_head_silence_after_first_byte_is_stalled_at_liveness(self):
        def handler(req):
            req.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
            req.wait_peer_close(5)

        self.use(handler)
        client = lc.Client(self.server.address, limits=self.budget(liveness=0.4))
        t = Timer()
        with self.assertRaises(lc.StalledError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        self.assertGreaterEqual(t.elapsed, 0.4)
        self.assertLess(t.elapsed, 0.4 + MARGIN)


class TestLiveness(ServerCase):
    def limits_(self, **kw):
        return lc.Limits(**dict(dict(poll=0.05, liveness=0.4, busy_wait=1.0, load_wait=5.0, idle_grace=5.0), **kw))

    def test_silence_mid_stream_is_stalled(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "partial"}))))
            req.wait_peer_close(5)

        self.use(handler)
        client = lc.Client(self.server.address, limits=self.limits_())
        events = []
        t = Timer()
        with self.assertRaises(lc.StalledError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        self.assertEqual(events, [lc.Content("partial")])
        self.assertGreaterEqual(t.elapsed, 0.4)
        self.assertLess(t.elapsed, 0.4 + MARGIN)

    def pinger(self, stop, then=b""):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))))
            while not stop.wait(0.05):
                if not req.send(chunked(b": ping\n\n")):
                    return
            if then:
                req.send(then)

        return handler

    def test_pings_with_idle_slot_are_stalled_after_liveness(self):
        stop = threading.Event()
        self.use(self.pinger(stop))
        client = lc.Client(self.server.address, limits=self.limits_())
        t = Timer()
        with self.assertRaises(lc.StalledError) as cm:
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        stop.set()
        self.assertIn("idle", str(cm.exception))
        self.assertGreaterEqual(t.elapsed, 0.4)
        self.assertLess(t.elapsed, 0.4 + MARGIN)

    def test_pings_with_busy_slot_are_waited_until_busy_wait(self):
        stop = threading.Event()
        self.server.busy[0] = True
        self.use(self.pinger(stop))
        client = lc.Client(self.server.address, limits=self.limits_(busy_wait=1.0))
        t = Timer()
        with self.assertRaises(lc.StalledError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        stop.set()
        self.assertGreaterEqual(t.elapsed, 1.0)
        self.assertLess(t.elapsed, 1.0 + MARGIN)

    def test_pings_then_data_completes(self):
        stop = threading.Event()
        self.server.busy[0] = True
        rest = chunked(sse(chunk_json({"content": "b"})), sse(chunk_json({}, "stop")), b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.use(self.pinger(stop, then=rest))
        client = lc.Client(self.server.address, limits=self.limits_(busy_wait=5.0))
        threading.Timer(0.7, stop.set).start()
        completion = run_with_timeout(lambda: client.chat(MSGS, slot=0))
        self.assertEqual(completion.content, "ab")


class TestRetries(ServerCase):
    def limits_(self, **kw):
        return lc.Limits(**dict(dict(poll=0.05, liveness=2.0, busy_wait=5.0, load_wait=3.0, idle_grace=5.0), **kw))

    def test_socket_appears_after_a_while(self):
        late = FakeServer(listen=False)
        self.closers.append(late.close)
        late.stream(serve_body(content_stream(["up"])))
        client = lc.Client(late.path, limits=self.limits_())
        events = []

        def on_event(ev):
            events.append(ev)
            if isinstance(ev, lc.Retrying) and ev.attempt == 2:
                late.listen()

        completion = run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=on_event))
        self.assertEqual(completion.content, "up")
        retries = [e for e in events if isinstance(e, lc.Retrying)]
        self.assertEqual([e.attempt for e in retries], [1, 2])
        self.assertTrue(0.1875 <= retries[0].delay <= 0.25, retries[0])
        self.assertTrue(0.375 <= retries[1].delay <= 0.5, retries[1])
        self.assertIn("No such file", retries[0].reason)

    def test_backoff_doubles_to_two_seconds_with_jitter_down(self):
        client = lc.Client(self.server.tmp + "/never.sock", limits=self.limits_(load_wait=30.0))
        stream = client.stream(MSGS, slot=0)
        delays = []
        originals = lc.BACKOFF_FIRST

        def consume():
            for ev in stream:
                delays.append(ev.delay)
                if len(delays) == 3:
                    stream.cancel()

        with self.assertRaises(lc.CancelledError):
            run_with_timeout(consume, 5)
        self.assertEqual(originals, 0.25)
        for delay, base in zip(delays, (0.25, 0.5, 1.0)):
            self.assertTrue(0.75 * base <= delay <= base, (delay, base))

    def test_load_wait_spent_is_load_timeout_with_os_cause(self):
        client = lc.Client(self.server.tmp + "/never.sock", limits=self.limits_(load_wait=0.6))
        t = Timer()
        with self.assertRaises(lc.LoadTimeoutError) as cm:
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        self.assertIsInstance(cm.exception.__cause__, FileNotFoundError)
        self.assertGreaterEqual(t.elapsed, 0.6 - 0.01)
        self.assertLess(t.elapsed, 0.6 + MARGIN)

    def test_socket_without_listener_is_refused_and_retried(self):
        path = os.path.join(self.server.tmp, "dead.sock")
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(path)  # bound, never listening: connect is refused
        self.closers.append(dead.close)
        client = lc.Client(path, limits=self.limits_(load_wait=0.4))
        with self.assertRaises(lc.LoadTimeoutError) as cm:
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        self.assertIsInstance(cm.exception.__cause__, ConnectionRefusedError)

    def unavailable_then(self, first, body=None):
        calls = []

        def handler(req):
            calls.append(req)
            if len(calls) == 1:
                first(req)
            else:
                req.send(STREAM_HEAD + (body or content_stream(["fine"])))

        return calls, handler

    def test_503_then_200(self):
        calls, handler = self.unavailable_then(lambda req: respond_json(
            req, {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}, 503, "Service Unavailable"))
        self.use(handler)
        client = lc.Client(self.server.address, limits=self.limits_())
        completion, events = self.collect(client=client)
        self.assertEqual(completion.content, "fine")
        self.assertEqual(len(calls), 2)
        retry = events[0]
        self.assertIsInstance(retry, lc.Retrying)
        self.assertEqual(retry.attempt, 1)
        self.assertIn("503", retry.reason)
        self.assertIn("Loading model", retry.reason)

    def test_retry_after_seconds_honoured(self):
        calls, handler = self.unavailable_then(lambda req: respond_json(
            req, {"error": {"message": "busy", "code": 503}}, 503, "Service Unavailable", b"Retry-After: 1\r\n"))
        self.use(handler)
        client = lc.Client(self.server.address, limits=self.limits_())
        t = Timer()
        completion, events = self.collect(client=client)
        self.assertEqual(events[0], lc.Retrying(1, 1.0, "HTTP 503: busy"))
        self.assertGreaterEqual(t.elapsed, 1.0)
        self.assertLess(t.elapsed, 1.0 + MARGIN)

    def test_retry_after_http_date_honoured(self):
        import email.utils

        def first(req):
            when = email.utils.formatdate(time.time() + 2, usegmt=True)
            respond_json(req, {"error": {"message": "busy", "code": 503}}, 503, "x", b"Retry-After: " + when.encode() + b"\r\n")

        calls, handler = self.unavailable_then(first)
        self.use(handler)
        client = lc.Client(self.server.address, limits=self.limits_())
        completion, events = self.collect(client=client)
        self.assertTrue(1.0 <= events[0].delay <= 2.0, events[0])
        self.assertEqual(completion.content, "fine")

    def test_retry_after_beyond_load_wait_fails_at_once(self):
        self.use(lambda req: respond_json(req, {"error": {"message": "busy", "code": 503}}, 503, "x", b"Retry-After: 3600\r\n"))
        client = lc.Client(self.server.address, limits=self.limits_(load_wait=10))
        t = Timer()
        with self.assertRaises(lc.LoadTimeoutError) as cm:
            self.collect(client=client)
        self.assertLess(t.elapsed, 0.3)
        self.assertIsInstance(cm.exception.__cause__, lc.HTTPStatusError)

    def test_first_event_503_error_is_retried(self):
        error = chunked(b'data: {"error":{"code":503,"message":"no slot available","type":"unavailable_error"}}\n\n') + b"0\r\n\r\n"
        calls, handler = self.unavailable_then(lambda req: req.send(STREAM_HEAD + error))
        self.use(handler)
        completion, events = self.collect()
        self.assertEqual(completion.content, "fine")
        self.assertEqual(len(calls), 2)
        self.assertIsInstance(events[0], lc.Retrying)

    def test_first_event_400_error_is_server_error(self):
        error = chunked(b'data: {"error":{"code":400,"message":"bad","type":"invalid_request_error"}}\n\n') + b"0\r\n\r\n"
        self.use(serve_body(error))
        with self.assertRaises(lc.ServerError) as cm:
            self.collect()
        self.assertEqual(cm.exception.code, 400)
        self.assertEqual(len(self.server.chat_requests()), 1)

    def test_error_after_content_is_not_retried(self):
        body = chunked(sse(chunk_json({"content": "x"})),
                       b'data: {"error":{"code":503,"message":"gone","type":"unavailable_error"}}\n\n') + b"0\r\n\r\n"
        self.use(serve_body(body))
        events = []
        with self.assertRaises(lc.ServerError):
            run_with_timeout(lambda: self.client.chat(MSGS, slot=0, on_event=events.append))
        self.assertEqual(events, [lc.Content("x")])
        self.assertEqual(len(self.server.chat_requests()), 1)

    def test_legacy_error_line_first_is_retried(self):
        error = chunked(b'error: {"code":503,"message":"Loading model","type":"unavailable_error"}\n\n') + b"0\r\n\r\n"
        calls, handler = self.unavailable_then(lambda req: req.send(STREAM_HEAD + error))
        self.use(handler)
        completion, events = self.collect()
        self.assertEqual((completion.content, len(calls)), ("fine", 2))

    def test_close_after_content_is_not_replayed(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "x"}))))

        self.use(handler)
        with self.assertRaises(lc.StreamClosedError):
            self.collect()
        self.assertEqual(len(self.server.chat_requests()), 1)


class Gatekeeper:
    """A scripted chat endpoint: each request is held until ``release(marker)``; records arrival order."""

    def __init__(self, server):
        self.server = server
        self.order = []
        self.gates = {}
        self.lock = threading.Lock()
        server.stream(self.handle)

    def gate(self, marker):
        with self.lock:
            return self.gates.setdefault(marker, threading.Event())

    def handle(self, req):
        marker = req.json()["messages"][0]["content"]
        slot = req.json().get("id_slot")
        with self.lock:
            self.order.append((slot, marker))
        release = self.gate(marker)
        while not release.is_set():
            if req.wait_peer_close(0.02) or req.server.stopping.is_set():
                return
        req.send(STREAM_HEAD + content_stream([marker]))

    def release(self, marker):
        self.gate(marker).set()

    def arrived(self, marker):
        with self.lock:
            return any(m == marker for _, m in self.order)


def start_chat(client, marker, slot=0, events=None, results=None):
    """Run a chat in a thread; its events and outcome go to ``events``/``results`` under ``marker``."""
    events = events if events is not None else {}
    results = results if results is not None else {}
    events[marker] = []

    def run():
        try:
            results[marker] = client.chat([{"role": "user", "content": marker}], slot=slot, on_event=events[marker].append)
        except BaseException as exc:  # noqa: B036
            results[marker] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class TestGate(ServerCase):
    limits = lc.Limits(poll=0.05, liveness=5.0, busy_wait=10.0, load_wait=5.0, idle_grace=10.0, queue_len=2)

    def test_queued_events_fifo_and_busy_error(self):
        keeper = Gatekeeper(self.server)
        events, results = {}, {}
        threads = [start_chat(self.client, "A", 0, events, results)]
        wait_for(lambda: keeper.arrived("A"), what="A to be sent")
        threads.append(start_chat(self.client, "B", 0, events, results))
        wait_for(lambda: events["B"], what="B to queue")
        threads.append(start_chat(self.client, "C", 0, events, results))
        wait_for(lambda: events["C"], what="C to queue")
        # the queue holds 2: the fourth is refused at once and nothing is sent
        t = Timer()
        with self.assertRaises(lc.BusyError):
            self.client.chat([{"role": "user", "content": "D"}], slot=0)
        self.assertLess(t.elapsed, 0.1)
        self.assertEqual(events["B"], [lc.Queued(1)])
        self.assertEqual(events["C"], [lc.Queued(2)])
        for marker in "ABC":
            keeper.release(marker)
        for th in threads:
            th.join(5)
        self.assertEqual([m for _, m in keeper.order], ["A", "B", "C"])
        self.assertEqual(events["C"][:2], [lc.Queued(2), lc.Queued(1)])
        self.assertEqual([results[m].content for m in "ABC"], ["A", "B", "C"])
        self.assertEqual(self.client._gate.snapshot()[0], (0, 0))

    def test_slots_are_independent(self):
        keeper = Gatekeeper(self.server)
        events, results = {}, {}
        a = start_chat(self.client, "A", 0, events, results)
        b = start_chat(self.client, "B", 1, events, results)
        wait_for(lambda: keeper.arrived("A") and keeper.arrived("B"), what="both sent at once")
        keeper.release("A")
        keeper.release("B")
        a.join(5)
        b.join(5)
        self.assertFalse(any(isinstance(e, lc.Queued) for e in events["A"] + events["B"]))

    def test_cancelled_waiter_leaves_and_others_move_up(self):
        keeper = Gatekeeper(self.server)
        events, results = {}, {}
        a = start_chat(self.client, "A", 0, events, results)
        wait_for(lambda: keeper.arrived("A"))
        b_stream = self.client.stream([{"role": "user", "content": "B"}], slot=0)
        b_events = []
        b_done = threading.Event()

        def run_b():
            try:
                for ev in b_stream:
                    b_events.append(ev)
            except lc.CancelledError as exc:
                b_events.append(exc)
            b_done.set()

        threading.Thread(target=run_b, daemon=True).start()
        wait_for(lambda: b_events)
        c = start_chat(self.client, "C", 0, events, results)
        wait_for(lambda: events["C"])
        self.assertEqual(events["C"], [lc.Queued(2)])
        t = Timer()
        b_stream.cancel()
        self.assertTrue(b_done.wait(0.2))
        self.assertLess(t.elapsed, 0.2)
        self.assertIsInstance(b_events[-1], lc.CancelledError)
        wait_for(lambda: len(events["C"]) == 2)
        self.assertEqual(events["C"], [lc.Queued(2), lc.Queued(1)])
        keeper.release("A")
        keeper.release("C")
        a.join(5)
        c.join(5)
        self.assertEqual([m for _, m in keeper.order], ["A", "C"])

    def test_any_slot_pool_is_sized_by_props(self):
        keeper = Gatekeeper(self.server)
        events, results = {}, {}
        a = start_chat(self.client, "A", None, events, results)
        b = start_chat(self.client, "B", None, events, results)
        wait_for(lambda: keeper.arrived("A") and keeper.arrived("B"), what="two at once over two slots")
        c = start_chat(self.client, "C", None, events, results)
        wait_for(lambda: events["C"])
        self.assertEqual(events["C"], [lc.Queued(2)])
        self.assertFalse(keeper.arrived("C"))
        for marker in "ABC":
            keeper.release(marker)
        for th in (a, b, c):
            th.join(5)
        self.assertEqual(results["C"].content, "C")
        self.assertEqual(sum(1 for r in self.server.requests if r.path == "/props"), 1)


class TestCancel(ServerCase):
    limits = lc.Limits(poll=0.05, liveness=5.0, busy_wait=10.0, load_wait=10.0, idle_grace=10.0)

    def cancel_during(self, handler, ready, slot=0, client=None):
        """Iterate a stream in a thread, cancel it once ``ready(events)``; returns (events, seconds to stop)."""
        if handler is not None:
            self.use(handler)
        stream = (client or self.client).stream(MSGS, slot=slot)
        events, done = [], threading.Event()

        def run():
            try:
                for ev in stream:
                    events.append(ev)
            except BaseException as exc:  # noqa: B036
                events.append(exc)
            done.set()

        threading.Thread(target=run, daemon=True).start()
        wait_for(lambda: ready(events), what="the moment to cancel")
        t = Timer()
        stream.cancel()
        self.assertTrue(done.wait(1.0))
        elapsed = t.elapsed
        self.assertIsInstance(events[-1], lc.CancelledError)
        self.assertLess(elapsed, 0.2)
        return events, elapsed

    def test_cancel_while_streaming_closes_the_connection(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))))
            req.wait_peer_close(5)

        self.cancel_during(handler, lambda evs: evs)
        req = self.server.chat_requests()[0]
        self.assertTrue(req.closed_by_peer.wait(1))
        self.assertEqual(self.client._gate.snapshot()[0], (0, 0))

    def test_cancel_while_waiting_for_the_head(self):
        self.server.busy[0] = True
        events, _ = self.cancel_during(hold_then(b"", threading.Event()), lambda evs: evs)
        self.assertEqual(events[0], lc.Waiting(True))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(1))

    def test_cancel_while_backing_off(self):
        client = lc.Client(self.server.tmp + "/never.sock", limits=self.limits)
        events, _ = self.cancel_during(None, lambda evs: evs, client=client)
        self.assertIsInstance(events[0], lc.Retrying)

    def test_cancel_while_queued(self):
        keeper = Gatekeeper(self.server)
        first = start_chat(self.client, "A", 0)
        wait_for(lambda: keeper.arrived("A"))
        events, _ = self.cancel_during(None, lambda evs: evs)
        self.assertEqual(events[0], lc.Queued(1))
        keeper.release("A")
        first.join(5)
        self.assertEqual([m for _, m in keeper.order], ["A"])

    def test_cancel_while_polling_a_hanging_slots(self):
        self.server.slots_delay = 3.0
        self.server.busy[0] = True
        self.cancel_during(hold_then(b"", threading.Event()), lambda evs: self.server.slots_in_flight == 1)

    def test_cancel_before_iteration(self):
        stream = self.client.stream(MSGS, slot=0)
        stream.cancel()
        with self.assertRaises(lc.CancelledError):
            next(stream)
        self.assertEqual(self.server.chat_requests(), [])

    def test_cancel_between_events_frees_the_permit_at_once(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))))
            req.wait_peer_close(5)

        self.use(handler)
        stream = self.client.stream(MSGS, slot=0)
        self.assertEqual(run_with_timeout(lambda: next(stream)), lc.Content("a"))
        self.assertEqual(self.client._gate.snapshot()[0], (1, 0))
        stream.cancel()  # nobody is iterating: cleanup happens here
        self.assertEqual(self.client._gate.snapshot()[0], (0, 0))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(1))
        with self.assertRaises(lc.CancelledError):
            next(stream)

    def test_leaving_the_with_block_early_cancels_quietly(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"})), sse(chunk_json({"content": "b"}))))
            req.wait_peer_close(5)

        self.use(handler)

        def body():
            with self.client.stream(MSGS, slot=0) as stream:
                for ev in stream:
                    return ev

        self.assertEqual(run_with_timeout(body), lc.Content("a"))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(1))
        self.assertEqual(self.client._gate.snapshot()[0], (0, 0))

    def test_with_block_keeps_the_callers_exception(self):
        self.use(serve_body(content_stream(["a", "b"])))

        def body():
            with self.client.stream(MSGS, slot=0) as stream:
                for _ in stream:
                    raise KeyError("mine")

        with self.assertRaises(KeyError) as cm:
            run_with_timeout(body)
        self.assertEqual(cm.exception.args, ("mine",))

    def test_on_event_exception_propagates_unchanged(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))))
            req.wait_peer_close(5)

        self.use(handler)

        class Mine(Exception):
            pass

        def on_event(ev):
            raise Mine("stop")

        with self.assertRaises(Mine):
            run_with_timeout(lambda: self.client.chat(MSGS, slot=0, on_event=on_event))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(1))
        self.assertEqual(self.client._gate.snapshot()[0], (0, 0))

    def test_keyboard_interrupt_in_chat_propagates_as_itself(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))))
            req.wait_peer_close(5)

        self.use(handler)

        def on_event(ev):
            raise KeyboardInterrupt

        with self.assertRaises(KeyboardInterrupt):
            run_with_timeout(lambda: self.client.chat(MSGS, slot=0, on_event=on_event))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(1))
        self.assertEqual(self.client._gate.snapshot()[0], (0, 0))

    def test_client_close_cancels_streams(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))))
            req.wait_peer_close(5)

        self.use(handler)
        stream = self.client.stream(MSGS, slot=0)
        self.assertEqual(run_with_timeout(lambda: next(stream)), lc.Content("a"))
        self.client.close()
        with self.assertRaises(lc.CancelledError):
            next(stream)
        with self.assertRaises(ValueError):
            self.client.stream(MSGS)


def reasoning_stream(n_reasoning, content="yes", cid=CID):
    events = [sse(chunk_json({"role": "assistant", "content": None}, cid=cid))]
    events += [sse(chunk_json({"reasoning_content": " r%d" % i}, cid=cid)) for i in range(n_reasoning)]
    events.append(sse(chunk_json({"content": content}, cid=cid)))
    events.append(sse(chunk_json({}, "stop", cid=cid)))
    events.append(b"data: [DONE]\n\n")
    return chunked(*events) + b"0\r\n\r\n"


class TestThinkingCap(ServerCase):
    def capped(self, cap=3, overrun=4):
        return lc.Client(self.server.address, limits=lc.Limits(poll=0.05, liveness=2.0, thinking_cap=cap, thinking_overrun=overrun))

    def controlled(self, answer):
        """A server that streams reasoning until the control endpoint is called, then 1 more token and content."""
        ended = threading.Event()
        controls = []

        def control(req):
            controls.append(req.json())
            answer(req)
            ended.set()

        def chat(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"role": "assistant", "content": None}))))
            for i in range(50):
                req.send(chunked(sse(chunk_json({"reasoning_content": " r%d" % i}))))
                if ended.wait(0.02):
                    req.send(chunked(sse(chunk_json({"reasoning_content": " last"})), sse(chunk_json({"content": "yes"})),
                                     sse(chunk_json({}, "stop")), b"data: [DONE]\n\n") + b"0\r\n\r\n")
                    return
            req.send(chunked(sse(chunk_json({}, "length"))) + b"0\r\n\r\n")

        self.server.route("POST", "/v1/chat/completions/control", control)
        self.use(chat)
        return controls

    def test_cap_ends_reasoning(self):
        controls = self.controlled(lambda req: respond_json(req, {"success": True}))
        completion, events = self.collect(client=self.capped(cap=3))
        self.assertEqual(self.server.chat_requests()[0].json()["reasoning_control"], True)
        self.assertEqual(controls, [{"id": CID, "action": "reasoning_end"}])
        self.assertEqual(events[:4], [lc.Reasoning(" r0"), lc.Reasoning(" r1"), lc.Reasoning(" r2"), lc.ThinkingCapped(3)])
        self.assertEqual(events[-1], lc.Content("yes"))
        self.assertTrue(completion.thinking_capped)
        self.assertLessEqual(completion.reasoning_tokens, 3 + 4)
        self.assertEqual(completion.content, "yes")

    def test_server_refuses(self):
        self.controlled(lambda req: respond_json(req, {"success": False}))
        with self.assertRaises(lc.ThinkingOverrunError):
            self.collect(client=self.capped())

    def test_control_endpoint_missing(self):
        self.controlled(lambda req: respond_json(req, {"error": {"message": "File Not Found", "code": 404}}, 404, "Not Found"))
        with self.assertRaises(lc.ThinkingOverrunError) as cm:
            self.collect(client=self.capped())
        self.assertIsInstance(cm.exception.__cause__, lc.HTTPStatusError)

    def test_reasoning_past_the_overrun(self):
        self.server.route("POST", "/v1/chat/completions/control", lambda req: respond_json(req, {"success": True}))
        self.use(serve_body(reasoning_stream(20)))
        events = []
        with self.assertRaises(lc.ThinkingOverrunError) as cm:
            run_with_timeout(lambda: self.capped(cap=3, overrun=4).chat(MSGS, slot=0, on_event=events.append))
        self.assertEqual(cm.exception.tokens, 8)
        self.assertEqual(sum(isinstance(e, lc.Reasoning) for e in events), 8)

    def test_no_completion_id(self):
        self.use(serve_body(reasoning_stream(5, cid=None)))
        with self.assertRaises(lc.ThinkingOverrunError):
            self.collect(client=self.capped())

    def test_no_cap_no_control(self):
        self.use(serve_body(reasoning_stream(5)))
        completion, events = self.collect()
        self.assertNotIn("reasoning_control", self.server.chat_requests()[0].json())
        self.assertEqual(completion.reasoning_tokens, 5)
        self.assertFalse(completion.thinking_capped)
