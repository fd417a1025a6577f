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

    def tearDown(self):
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
