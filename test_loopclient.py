"""Tests for loopclient.py: standard library only (``python3 -S -m unittest -v test_loopclient``).

First the fixtures shared by every tier and by dev/fuzz.py and dev/bench.py (canned streams, the fake
server, the one set of limits FAST and its variants, the timing margin MARGIN, ServerCase, AsyncDriver),
then the tiers, in this order:

1. parsers fed bytes (whole, byte by byte, split at every offset), and the pump between them;
2. transport and client against an in-process fake server on a real Unix socket (and TCP): streams,
   single-shot calls, the server API, TLS, path prefixes, routing, caller mistakes;
3. waits and gates: wait for head, liveness, wedged slots, retries, the gate, cancel, thinking cap, stress;
4. faults: hostile servers, one test per row of the fault table (FAULT_TABLE, written out as
   dev/FAULTS.md), and dev/fuzz.py's regressions;
5. security; 6. the command line through ``main(argv)``;
7. a real llama-server, run when ``LOOPCLIENT_REAL_SOCKET`` names its socket (``.ci/run`` provisions one).

A client test class ``TestX`` is followed by ``TestXAsync`` (AsyncDriver): the same tests through
AsyncClient.  The tiers that are about time (waits, faults, the API's errors) run on a virtual clock
instead (VirtualFactory: the plans on a third driver, in-memory connections, time that jumps when every
task waits, timing asserted exactly), with a few tests of each class again on real sockets through both
clients (``TestXSockets``, ``TestXSocketsAsync``: on_sockets) and the three drivers compared operation by
operation (TestDriversAlike).  Every blocking call has a timeout.  A test that times an outcome in real
time is marked ``@real_time`` and states its bound against the machine's pace (``lateness``), so the suite
holds on a busy machine; ``LOOPCLIENT_TEST_LOAD=N`` runs N busy processes beside it to prove so (BusyLoad),
and LOOPCLIENT_TIME_MARGIN adds to every margin (see MARGIN).
"""

from __future__ import annotations

import asyncio
import calendar
import collections
import contextlib
import copy
import email.utils
import errno
import functools
import gc
import hashlib
import heapq
import importlib.util
import inspect
import io
import itertools
import json
import logging
import os
import pathlib
import pickle
import pty
import random
import re
import resource
import select
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
import types
import unittest
import urllib.parse
import warnings
import weakref
from unittest import mock

import loopclient as lc

HERE = os.path.dirname(os.path.abspath(__file__))
TRANSCRIPTS = os.path.join(HERE, "dev", "testdata", "transcripts")

# -----------------------------------------------------------------------------------------------------
# Fixtures: bytes copied from a real llama-server (dev/testdata/transcripts), shortened where noted
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
    doc.update(
        {
            "created": 1796006109,
            "id": cid,
            "model": MODEL,
            "system_fingerprint": "b0-unknown",
            "object": "chat.completion.chunk",
        }
    )
    if extra:
        doc.update(extra)
    return json.dumps(doc, separators=(",", ":"))


def sse(*payloads):
    return b"".join(b"data: " + p.encode() + b"\n\n" for p in payloads)


def chunked(*bodies):
    """HTTP chunks, one per body, hex sizes as llama-server writes them."""
    return b"".join(b"%x\r\n%s\r\n" % (len(b), b) for b in bodies)


TIMINGS = {
    "cache_n": 1,
    "prompt_n": 29,
    "prompt_ms": 76.722,
    "prompt_per_token_ms": 2.6455862068965517,
    "prompt_per_second": 377.98806079090747,
    "predicted_n": 16,
    "predicted_ms": 192.748,
    "predicted_per_token_ms": 12.849866666666665,
    "predicted_per_second": 77.82181916284476,
}
USAGE = {
    "completion_tokens": 8,
    "prompt_tokens": 26,
    "total_tokens": 34,
    "prompt_tokens_details": {"cached_tokens": 21},
}


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
    """The raw response bytes of a transcript file (a missing file fails the test: they ship with the code)."""
    with open(os.path.join(TRANSCRIPTS, name), "rb") as f:
        raw = f.read()
    marker = raw.index(b"<<< RESPONSE")
    return raw[raw.index(b"\n", marker) + 1 :]


# -----------------------------------------------------------------------------------------------------
# The fake server: a real Unix (or TCP) socket, one thread per connection, scripted by path
# -----------------------------------------------------------------------------------------------------


#: One HTTP request as read_request() returns it (header names lower-cased; ``head``: the raw head bytes).
HTTPRequest = collections.namedtuple("HTTPRequest", "method path headers body head")


def read_request(conn):
    """Read one HTTP request from ``conn``: an HTTPRequest, or None when the peer closes before it is whole.
    FakeServer, dev/fuzz.py's and dev/bench.py's servers all read their requests with it."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            return None
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
            return None
        body += more
    return HTTPRequest(method, path, headers, body, head)


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


# -- canned answers: the one family of helpers that make a response (bytes, or a handler sending them) --

JSON_TYPE = b"application/json; charset=utf-8"


def http_response(body, ctype=JSON_TYPE, framing="length", status=b"200 OK", extra=b""):
    """A whole response as llama-server frames it: by Content-Length, chunked (two chunks) or until close;
    ``extra``: more header lines, each ending in CRLF."""
    head = b"HTTP/1.1 %s\r\nServer: llama.cpp\r\nContent-Type: %s\r\n" % (status, ctype)
    if framing == "length":
        return head + b"Content-Length: %d\r\n%sConnection: close\r\n\r\n" % (len(body), extra) + body
    if framing == "chunked":
        cut = len(body) // 2
        return (
            head
            + b"Transfer-Encoding: chunked\r\n%sConnection: close\r\n\r\n" % extra
            + chunked(body[:cut], body[cut:])
            + b"0\r\n\r\n"
        )
    assert framing == "close", framing
    return head + extra + b"Connection: close\r\n\r\n" + body


def json_response(doc, status=b"200 OK", extra=b""):
    """A JSON answer (llama-server's separators) framed by Content-Length."""
    return http_response(json.dumps(doc, separators=(",", ":")).encode(), status=status, extra=extra)


def reply(data, hold=False):
    """A handler that sends ``data``, then (``hold``) keeps the connection open until the client leaves."""

    def handler(req):
        req.send(data)
        if hold:
            req.wait_peer_close(5)

    return handler


def serve_body(body, hold=False):
    """``reply()`` with a stream's head before ``body``."""
    return reply(STREAM_HEAD + body, hold)


def respond_json(req, doc, status=200, reason="OK", extra_headers=b""):
    """Answer ``req`` with ``json_response(doc)``, in a handler that does more than answer."""
    req.send(json_response(doc, b"%d %s" % (status, reason.encode()), extra_headers))


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
        self.route(
            "GET", "/props", lambda req: respond_json(req, {"total_slots": len(self.busy), "build_info": "b0-unknown"})
        )
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
            respond_json(
                req, [{"id": i, "n_ctx": 1024, "speculative": False, "is_processing": b} for i, b in enumerate(busy)]
            )
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
            request = read_request(conn)
            if request is None:
                return
            method, path, headers, body, head = request
            req = self.new_request(conn, method, path, headers, body)
            req.raw_head = head
            with self.lock:
                self.requests.append(req)
            handler = self.routes.get((method, path))
            if handler is None:
                respond_json(
                    req,
                    {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}},
                    404,
                    "Not Found",
                )
            else:
                handler(req)
        except OSError:
            pass
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def new_request(self, conn, method, path, headers, body):
        return FakeRequest(self, conn, method, path, headers, body)

    def accepted(self, req):
        """Where ``req``'s connection came in the order the server accepted them, which is the order the
        client connected (a handler thread may come to its request after a later connection's)."""
        with self.lock:
            return self.conns.index(req.conn)

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


def _marked_done(client, conversation, timeout=10.0):
    """``lookup_streams([conversation])`` once the server no longer says is_done false.  A real server marks
    a resumable stream done when its producer returns, which can be a few ms after the client has read the
    last byte: until then lookup says is_done false."""
    found = []

    def marked_done():
        found[:] = client.lookup_streams([conversation])
        return [e["is_done"] for e in found] != [False]

    wait_for(marked_done, timeout, "the server to mark the finished stream done")
    return found


def wait_for(predicate, timeout=5.0, what="condition"):
    """Wait until ``predicate()`` is true; fail the test after ``timeout``."""
    kernel = VirtualKernel.active
    if kernel is not None and kernel.current() is None:
        kernel = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if kernel is not None:  # the virtual clock: first what can happen without time passing
            kernel.settle()
            if predicate():
                return
        time.sleep(0.005)
    raise AssertionError("timed out after %.1f s waiting for %s" % (timeout, what))


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def run_with_timeout(fn, timeout=10.0):
    """Run ``fn`` in a thread; return its result or raise its exception; fail if it takes over ``timeout``."""
    kernel = VirtualKernel.active
    if kernel is not None and kernel.current() is not None:
        return kernel.call(fn, timeout)  # a task of the virtual clock, ``timeout`` virtual seconds
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


class Timer:
    """Seconds since it was made: ``Timer().elapsed``."""

    def __init__(self):
        self.start = time.monotonic()

    @property
    def elapsed(self):
        return time.monotonic() - self.start


#: How much slower a line tracer (coverage) makes pure-Python work, for the few CPU-bound time limits.
TRACED = 4.0 if sys.gettrace() is not None else 1.0


#: How late a timed outcome may come after its budget (thread start, /slots round trips, 2 busy cores):
#: the one timing margin of the suite.  On a slow or loaded machine, widen it with the environment
#: variable LOOPCLIENT_TIME_MARGIN, a number of seconds *added* to it (e.g. LOOPCLIENT_TIME_MARGIN=1).
MARGIN = 0.35 + float(os.environ.get("LOOPCLIENT_TIME_MARGIN") or 0)


#: How early a budget error may come (clock granularity); not widened.
EARLY = 0.03


def pace():
    """How many times its CPU time a fixed piece of this process's work (about 20 ms of pure Python) takes
    in real time, now: 1 on an idle machine; on a busy one about the runnable threads per core (measured:
    2.4 with four busy processes on two cores, 5 with eight).  The floor a real-time bound is stated against
    (``lateness``): whatever slows this process (other processes, other threads holding the GIL) slows the
    outcome a test times by about as much."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(PACE_WORK):
        pass
    cpu = time.thread_time() - cpu
    return max(1.0, (time.perf_counter() - wall) / max(cpu, 1e-6))


#: The loop ``pace()`` times: about 20 ms of CPU on the machines this was written on.
PACE_WORK = 1200000


def real_time(test):
    """Marks a test (a method, or every test of a class) that times an outcome in real time (a budget
    waited out on real sockets, a cancel that must be prompt): its bounds come from ``lateness()``, which
    scales them by the machine's pace, measured when the test begins and again when the outcome is judged.
    The tiers that time outcomes exactly run on the virtual clock; a marked test is the real drivers'
    side of it, and holds on a loaded machine (``LOOPCLIENT_TEST_LOAD``)."""
    if isinstance(test, type):
        for name in dir(test):
            method = getattr(test, name)
            if name.startswith("test") and callable(method) and not getattr(method, "real_time", False):
                setattr(test, name, real_time(method))
        return test

    @functools.wraps(test)
    def timed(self, *args, **kw):
        self.pace_floor = pace()
        return test(self, *args, **kw)

    timed.real_time = True
    return timed


def lateness(test, seconds=None):
    """In a test marked ``real_time``: how late (``seconds``, by default MARGIN) a timed outcome may come
    on this machine now: ``seconds`` times its pace, the larger of the pace when the test began and now
    (1 on an idle machine).  A test that times an outcome without the mark fails here, on any machine."""
    floor = getattr(test, "pace_floor", None)
    if floor is None:
        raise AssertionError("%s times an outcome in real time: mark it @real_time" % test.id())
    return (MARGIN if seconds is None else seconds) * max(floor, pace())


#: The one family of test limits: FAST for the client tiers, and short variants of it.
FAST = lc.Limits(poll=0.05, liveness=2.0, busy_wait=3.0, load_wait=2.0, idle_grace=0.5)


#: FAST for the socket tiers' streams that wait for no slot: a head later than a 50 ms poll (a loaded
#: machine delays the fake server's answer that much now and then) would add a Waiting to the events they
#: assert; a test there that waits for a busy slot asks for FAST's poll itself.
SOCKETS = FAST.replace(poll=1.0)


#: Small budgets for the fault tier: every wait there is under a second.
FAST_FAULTS = FAST.replace(
    liveness=0.5, busy_wait=0.8, load_wait=0.6, idle_grace=0.4, max_line=4096, max_body=64 * 1024
)


#: The command line's limits in tests (see QuickLimits), so that its error paths end quickly.
FAST_CLI = FAST.replace(liveness=0.5, busy_wait=0.5, load_wait=0.3, wedge_wait=0.2)


MSGS = [{"role": "user", "content": "hi"}]


class ClientFactory:
    """The client a test class drives: ``lc.Client`` here; ``AsyncDriver`` (mixed in first) makes it
    ``lc.AsyncClient`` behind the same blocking calls, so that one description of a behaviour runs twice."""

    CLIENT = "sync"
    #: The clients run on the virtual clock (VirtualFactory): timing is exact there.
    VIRTUAL = False

    def new_client(self, *args, **kw):
        return lc.Client(*args, **kw)

    # What a test makes where the virtual clock (VirtualFactory) needs its own kind: a server, an event,
    # a timer, a thread.

    def new_server(self, **kw):
        return FakeServer(**kw)

    def event(self):
        return threading.Event()

    def later(self, delay, fn):
        timer = threading.Timer(delay, fn)
        timer.daemon = True
        timer.start()

    def start_thread(self, fn):
        thread = threading.Thread(target=fn, daemon=True)
        thread.start()
        return thread

    def settle(self):
        """After the test's servers are closed, before its threads and descriptors are counted."""

    def assertAtOnce(self, elapsed, limit):
        """An outcome that waits for nothing: in no time at all on the virtual clock, under ``limit`` on a
        real one (scaled by the machine's pace: ``lateness``)."""
        if self.VIRTUAL:
            self.assertEqual(elapsed, 0.0)
        else:
            self.assertLess(elapsed, lateness(self, limit))

    def assertElapsed(self, elapsed, budget, late=0.0, early=0.0, what="the outcome"):
        """``elapsed`` seconds are ``budget``, or up to ``late`` more (a rule's own slack, e.g. a poll):
        exactly so on the virtual clock (to a microsecond: its timers run out a nanosecond late); on a real
        one also up to ``early`` sooner (clock granularity) and the margin later (MARGIN, scaled by the
        machine's pace: ``lateness``)."""
        if self.VIRTUAL:
            low, high = budget - 1e-6, budget + late + 1e-6
            ok = low <= elapsed <= high
        else:
            low, high = budget - early, budget + late + lateness(self)
            ok = low <= elapsed < high
        if not ok:
            self.fail("%s came after %.6f s, not within [%.6f, %.6f]" % (what, elapsed, low, high))


class ServerCase(ClientFactory, unittest.TestCase):
    """A fake server per test, with descriptor and thread counts checked at the end."""

    tcp = False
    #: The limits of the client set up for each test.
    limits = FAST
    #: What ``limits_()`` starts from, when a class's variants differ from its own client (default: ``limits``).
    base_limits = None

    def setUp(self):
        self.fds = fd_count()
        self.threads = threading.active_count()
        self.server = self.new_server(tcp=self.tcp)
        self.client = self.new_client(self.server.address, limits=self.limits)
        self.closers = []

    def tearDown(self):
        for close in self.closers:
            close()
        self.client.close()
        self.server.close()
        self.settle()
        wait_for(lambda: threading.active_count() <= self.threads, 5, "threads to end")
        wait_for(lambda: fd_count() <= self.fds, 5, "descriptors to close")

    def limits_(self, **changes):
        """This class's limits (``base_limits``, else ``limits``) with ``changes``."""
        return (self.base_limits or self.limits).replace(**changes)

    def client_with(self, **changes):
        """Replace this test's client by one with ``limits_(**changes)``; return it."""
        self.client.close()
        self.client = self.new_client(self.server.address, limits=self.limits_(**changes))
        return self.client

    def use(self, handler):
        self.server.stream(handler)

    def collect(self, client=None, **kw):
        events = []
        slot = kw.pop("slot", 0)
        completion = run_with_timeout(
            lambda: (client or self.client).chat(MSGS, slot=slot, on_event=events.append, **kw)
        )
        return completion, events


# -----------------------------------------------------------------------------------------------------
# AsyncDriver: each tier's client tests run again through AsyncClient
# -----------------------------------------------------------------------------------------------------
#
# AsyncDriver, mixed in first, makes a test class's ``new_client()`` return a SyncFacade: lc.AsyncClient
# behind Client's blocking calls, its coroutines run on an event loop in a helper thread (one per test,
# asyncio debug mode on).  A test written once for Client then runs twice, unchanged.  The loop's
# exception handler records what debug mode reports (a task destroyed while pending, an exception never
# retrieved, a callback that failed), and so do tasks still pending when the test's clients are closed:
# either fails the test.  Each ``...Async`` class follows its base class; the async variants leave out
# a few slow tests whose async path another async test already walks (the behaviour they pin is shared
# code, and the threaded run keeps them).  A test that looks at threaded internals sees GateView; one
# that is about the threaded client itself builds lc.Client and says why.


class LoopThread:
    """An event loop (debug mode) running in a helper thread; ``run()`` waits for a coroutine there."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.loop.set_debug(True)
        self.loop.slow_callback_duration = 5.0  # a loaded machine is not a bug
        self.problems = []
        self.facades = []
        self.loop.set_exception_handler(lambda loop, context: self.problems.append(context))
        self.thread = threading.Thread(target=self._serve, name="lc-test-loop", daemon=True)
        self.thread.start()

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        while True:
            try:
                self.loop.run_forever()
                return
            except BaseException:  # noqa: B036 - a KeyboardInterrupt from on_event leaves asyncio's loop; serve on
                continue

    def run(self, coro, timeout=60.0):
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a blocking call from the loop's own thread (on_event?) would deadlock")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args):
        """``fn(*args)`` in the loop's thread (at once when already there); its result."""
        if threading.current_thread() is self.thread:
            return fn(*args)

        async def call():
            return fn(*args)

        return self.run(call())

    def close(self):
        """Close the clients, then the loop; the problems the loop saw (contexts of its exception handler,
        and tasks left pending once every client was closed)."""

        async def finish():
            for facade in self.facades:
                await facade._client.close()
            leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in leftover:
                self.problems.append({"message": "task still pending after close()", "task": repr(task)})
                task.cancel()
            if leftover:
                await asyncio.wait(leftover, timeout=5)
            await self.loop.shutdown_asyncgens()

        try:
            self.run(finish(), 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()
        return self.problems


class StreamFacade:
    """An AsyncChatStream behind ChatStream's blocking iteration; ``cancel()`` runs in the loop's thread."""

    def __init__(self, runner, stream):
        self._runner = runner
        self._stream = stream

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return self._runner.run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def cancel(self):
        self._runner.call(self._stream.cancel)

    @property
    def completion(self):
        return self._stream.completion

    @property
    def offset(self):
        return self._stream.offset

    @property
    def conversation_id(self):
        return self._stream.conversation_id

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._runner.run(self._stream.__aexit__(*exc_info))


class GateView:
    """The async board's gate as the threaded client's tests look at it: keys ``slot`` (no model), else
    ``(model, slot)``; read in the loop's thread."""

    def __init__(self, facade):
        self._facade = facade

    def _board(self):
        board = self._facade._client._board
        assert board is not None, "the client has not run on a loop yet"
        return board

    @staticmethod
    def _key(key):
        return key

    def snapshot(self):
        snap = self._facade._runner.call(lambda: self._board().gate.snapshot())
        return {self._key(k): v for k, v in snap.items()}

    def problems(self, queue_len=None):
        """gate_problems() of the async board's gate, read in the loop's thread."""
        return self._facade._runner.call(lambda: gate_problems(self._board().gate, queue_len))

    @property
    def _lanes(self):
        lanes = self._facade._runner.call(lambda: dict(self._board().gate._lanes))
        return {self._key(k): lane for k, lane in lanes.items()}


class SyncFacade:
    """lc.AsyncClient behind Client's blocking calls: each call runs its coroutine on the test's loop."""

    def __init__(self, runner, *args, **kw):
        self._client = lc.AsyncClient(*args, **kw)  # ValueError/TypeError here, as Client's
        self._runner = runner
        self._board = types.SimpleNamespace(gate=GateView(self))

    def __repr__(self):
        return repr(self._client)

    def __str__(self):
        return str(self._client)

    @property
    def limits(self):
        return self._client.limits

    @property
    def address(self):
        return self._client.address

    def __getattr__(self, name):  # the single-shot calls: slots(), health(), props(), request(), ...
        method = getattr(self._client, name)
        if name == "resume" or name.startswith("stream_"):  # plain methods that return an AsyncStream
            return lambda *args, **kw: StreamFacade(self._runner, method(*args, **kw))
        return lambda *args, **kw: self._runner.run(method(*args, **kw))

    def chat(self, messages, slot=None, on_event=None, **params):
        return self._runner.run(self._client.chat(messages, slot=slot, on_event=on_event, **params))

    def stream(self, messages, slot=None, **params):
        return StreamFacade(self._runner, self._client.stream(messages, slot=slot, **params))

    def _json(self, method, path, body=None):
        return self.request(method, path, body)

    def close(self):
        if self._runner.thread.is_alive():
            self._runner.run(self._client.close())

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


class AsyncDriver:
    """Mixed in before a test class: its tests drive lc.AsyncClient (through SyncFacade) instead of lc.Client."""

    CLIENT = "async"

    def new_client(self, *args, **kw):
        runner = self.__dict__.get("_loop_thread")
        if runner is None:
            runner = self._loop_thread = LoopThread()
        facade = SyncFacade(runner, *args, **kw)
        runner.facades.append(facade)
        return facade

    def tearDown(self):
        runner = self.__dict__.pop("_loop_thread", None)
        problems = []
        try:
            if runner is not None:
                problems = runner.close()
        finally:
            super().tearDown()
        self.assertEqual(problems, [], "the event loop reported problems")


# -----------------------------------------------------------------------------------------------------
# VirtualFactory: the request logic on a virtual clock, against the same scripted servers in memory
# -----------------------------------------------------------------------------------------------------
#
# VirtualFactory, mixed in first, makes a test class's clients run their plans on VirtualRun, a third
# driver: it performs the same operations as _SyncRun and _AsyncRun, on in-memory connections to a
# VirtualServer (FakeServer with its handlers unchanged), and on a virtual clock.  The model is trio's
# MockClock with autojump: every participant (the test's thread, each handler, each background plan) is a
# thread, but only one runs at a time, handing over the turn whenever it blocks (a read, a park, a sleep,
# an event); when every one is blocked, the clock jumps to the next timer.  So a 5-second budget passes
# in no real time, every outcome is deterministic, and timing is asserted exactly (assertElapsed).
# While a test runs, ``time.monotonic``, ``time.time``, ``time.sleep`` and ``loopclient._clock`` read the
# virtual clock in those threads (and the real one in any other), which is how the handlers, Timer and
# wait_for run unchanged.  Tests say ``self.event()``, ``self.later()``, ``self.start_thread()`` and
# ``self.new_server()`` where they would make a threading.Event, a threading.Timer, a thread or a
# FakeServer, so that one description runs on real sockets or on the virtual clock.

_REAL_MONOTONIC = time.monotonic
_REAL_SLEEP = time.sleep
_REAL_TIME = time.time

#: What an in-memory connection buffers one way before a write blocks (a socket's buffers).
_V_BUFFER = 256 * 1024


class VirtualDeadlock(AssertionError):
    """Every virtual task is blocked and none has a timer: nothing can ever happen again."""


class _VTask:
    __slots__ = ("name", "go", "blocked", "token", "timed_out", "done", "deadlock", "done_waiters")

    def __init__(self, name):
        self.name = name
        self.go = threading.Lock()  # released to hand this task its turn
        self.go.acquire()
        self.blocked = False
        self.token = 0  # which wait a timer belongs to
        self.timed_out = False
        self.done = False
        self.deadlock = False
        self.done_waiters = None

    def __repr__(self):
        return "<task %s%s>" % (self.name, " blocked" if self.blocked else "")


class _VWorker:
    """A thread that runs tasks one after another: starting a thread per task (each connection's handler,
    each call) cost half a millisecond, most of the time of a test that makes a few thousand."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.job = None  # (task, fn), None to end
        self.bell = threading.Lock()  # released to hand over a job
        self.bell.acquire()
        self.thread = threading.Thread(target=self._serve, name="lc-virtual", daemon=True)
        self.thread.start()

    def _serve(self):
        kernel = self.kernel
        while True:
            self.bell.acquire()
            if self.job is None:
                return
            task, fn = self.job
            kernel.local.task = task
            kernel._turn(task)
            try:
                fn()  # an error goes where a thread's goes (threading.excepthook), and the thread ends
            finally:
                kernel._leave(task)
            with kernel.mutex:
                if kernel.closing:
                    return
                kernel.idle.append(self)


class _VWaiters:
    """The tasks blocked on one thing (data on a connection, an event, a run's waker)."""

    __slots__ = ("kernel", "tasks")

    def __init__(self, kernel):
        self.kernel = kernel
        self.tasks = []

    def wait(self, due=None):
        """Block the running task until notify() or virtual time ``due``: True when the timer ended it."""
        me = self.kernel.current()
        self.tasks.append(me)
        try:
            return self.kernel.wait(due)
        finally:
            self.tasks.remove(me)

    def notify(self):
        for task in list(self.tasks):
            self.kernel.wake(task)


class VirtualKernel:
    """Tasks that take turns, and the clock that jumps when every one of them waits."""

    #: Real seconds a task may wait for its turn before the test fails (another task never blocks).
    PATIENCE = 60.0
    active = None  # the kernel of the test running, if it is virtual

    #: Where the clock starts: 2**20 s (twelve days of uptime).  Not 0: a real monotonic clock never reads
    #: 0, and the request logic takes a time of 0.0 for "not yet" (when the first byte of a response came).
    ORIGIN = 2.0**20
    #: The clock's grid: 2**-30 s.  Every reading is a multiple, so that the difference of two readings is
    #: exact, and a timer of t seconds runs out one or two steps (a nanosecond or two) past t, never before:
    #: the waits that make up a budget then add up to at least the budget, however 0.05 rounds in binary.
    SCALE = 2.0**30

    def __init__(self):
        self.now = self.ORIGIN
        self.epoch = _REAL_TIME() - self.ORIGIN
        self.mutex = threading.Lock()
        self.local = threading.local()
        self.running = None
        self.ready = collections.deque()
        self.timers = []  # (due, seq, task, token)
        self.seq = 0
        self.tasks = set()
        self.root = None
        self.servers = {}  # unix path or (host, port): VirtualServer
        self.ports = 40000
        self.drained = None
        self.saved = None
        self.idle = []  # workers between tasks
        self.closing = False

    # -- the clock, as the patched time functions read it ----------------------------------------

    def current(self):
        return getattr(self.local, "task", None)

    def monotonic(self):
        return self.now if self.current() is not None else _REAL_MONOTONIC()

    def time(self):
        return self.epoch + self.now if self.current() is not None else _REAL_TIME()

    def deadline(self, timeout):
        """When ``timeout`` (None: never) from now runs out: on the grid, just past it (see SCALE)."""
        return None if timeout is None else (int((self.now + max(timeout, 0.0)) * self.SCALE) + 2) / self.SCALE

    def sleep(self, seconds):
        if self.current() is None:
            return _REAL_SLEEP(seconds)
        due = self.deadline(seconds)
        while self.now < due:
            self.wait(due)

    # -- turns ----------------------------------------------------------------------------------

    def _dispatch(self):
        """(mutex held) The next task's turn: a ready one, else the earliest timer, the clock moved to it."""
        task = None
        if self.ready:
            task = self.ready.popleft()
        else:
            while self.timers:
                due, _, t, token = heapq.heappop(self.timers)
                if t.blocked and t.token == token:
                    self.now = max(self.now, due)
                    t.blocked = False
                    t.timed_out = True
                    task = t
                    break
        if task is None and self.root is not None and self.root.blocked:
            # every task waits and none has a timer: the test's own thread is told so
            task = self.root
            task.blocked = False
            task.deadlock = True
        self.running = task
        return task

    def _turn(self, task):
        """Wait (really) for ``task``'s turn."""
        if not task.go.acquire(True, self.PATIENCE):
            raise AssertionError("virtual task %s waited %.0f real seconds for its turn" % (task.name, self.PATIENCE))

    def wait(self, due=None):
        """Block the running task until wake() or virtual time ``due``; True when the timer ended it."""
        me = self.current()
        with self.mutex:
            assert self.running is me, (self.running, me)
            me.blocked = True
            me.timed_out = False
            me.token += 1
            if due is not None:
                self.seq += 1
                heapq.heappush(self.timers, (due, self.seq, me, me.token))
            nxt = self._dispatch()
            if nxt is not me:
                if nxt is None:  # (not the root: it would have been woken with deadlock)
                    raise VirtualDeadlock("every virtual task waits: %s" % sorted(map(repr, self.tasks)))
                nxt.go.release()
        if nxt is not me:
            self._turn(me)
        if me.deadlock:
            me.deadlock = False
            raise VirtualDeadlock(
                "every virtual task waits and none has a timer: %s" % sorted(map(repr, self.tasks - {me}))
            )
        return me.timed_out

    def wake(self, task):
        with self.mutex:
            if not task.blocked:
                return
            task.blocked = False
            task.timed_out = False
            task.token += 1  # its timer is void
            self.ready.append(task)
            if self.running is None:
                self._dispatch().go.release()

    def spawn(self, fn, name):
        """Run ``fn`` as a new task (ready now, its turn after the tasks ready before it); its handle."""
        task = _VTask(name)
        task.done_waiters = _VWaiters(self)
        with self.mutex:
            self.tasks.add(task)
            self.ready.append(task)
            worker = self.idle.pop() if self.idle else None
        if worker is None:
            worker = _VWorker(self)
        worker.job = (task, fn)
        worker.bell.release()
        return task

    def _leave(self, task):
        with self.mutex:
            task.done = True
            self.tasks.discard(task)
            for waiter in list(task.done_waiters.tasks) + ([self.root] if self.drained else []):
                if waiter is not None and waiter.blocked:
                    waiter.blocked = False
                    waiter.token += 1
                    self.ready.append(waiter)
            nxt = self._dispatch() if self.running is task else None
            if nxt is not None:
                nxt.go.release()
        self.local.task = None

    def settle(self):
        """Let every task that can run now run, the clock standing still: until none is ready."""
        me = self.current()
        while True:
            with self.mutex:
                if not self.ready:
                    return
                self.ready.append(me)
                nxt = self.ready.popleft()
                self.running = nxt
                nxt.go.release()
            self._turn(me)

    def join(self, task, timeout=None):
        """Wait for ``task`` to end, at most ``timeout`` virtual seconds: whether it ended."""
        due = self.deadline(timeout)
        while not task.done:
            if due is not None and self.now >= due:
                return False
            task.done_waiters.wait(due)
        return True

    def call(self, fn, timeout):
        """``fn()`` in a task of its own, as run_with_timeout() runs it in a thread."""
        box = {}

        def target():
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: B036 - carried to the waiting task
                box["error"] = exc

        if not self.join(self.spawn(target, "call"), timeout):
            raise AssertionError("call did not return within %.1f virtual s" % timeout)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    # -- the test's thread: the root task ----------------------------------------------------------

    def start(self):
        assert VirtualKernel.active is None, "a virtual test is already running"
        task = self.root = _VTask("test")
        task.done_waiters = _VWaiters(self)
        self.local.task = task
        with self.mutex:
            self.tasks.add(task)
            self.running = task
        self.saved = (time.monotonic, time.sleep, time.time, lc._clock)
        time.monotonic, time.sleep, time.time = self.monotonic, self.sleep, self.time
        lc._clock = self.monotonic
        VirtualKernel.active = self

    def drain(self, limit=60.0):
        """Let the other tasks run to their end, at most ``limit`` virtual seconds: those still there."""
        due = self.deadline(limit)
        self.drained = True
        try:
            while self.tasks - {self.root} and self.now < due:
                self.wait(due)
        finally:
            self.drained = False
        return self.tasks - {self.root}

    def stop(self):
        """The test's thread leaves (after drain()); the real clock is back.  Idempotent."""
        if self.saved is None:
            return
        left = set()
        try:
            if self.current() is self.root:
                left = self.drain()
                with self.mutex:
                    self.tasks.discard(self.root)
                    self.root = None
                    self.running = None  # tasks still blocked stay so: their threads are counted by the test
                self.local.task = None
        finally:
            time.monotonic, time.sleep, time.time, lc._clock = self.saved
            self.saved = None
            VirtualKernel.active = None
            with self.mutex:
                self.closing = True
                idle, self.idle = self.idle, []
            for worker in idle:
                worker.job = None
                worker.bell.release()
            for worker in idle:
                worker.thread.join(5)
        if left:
            raise AssertionError("virtual tasks still blocked at the end of the test: %s" % sorted(map(repr, left)))

    # -- connections ------------------------------------------------------------------------------

    def listen(self, server, tcp):
        if tcp:
            self.ports += 1
            port = server.port or self.ports
            key, address = ("127.0.0.1", port), "http://127.0.0.1:%d" % port
        else:
            key = address = server.path
        self.servers[key] = server
        return key, address

    def connect(self, addr, owner):
        """A client end connected to the server at ``addr``; the errors a socket's connect() raises."""
        if addr.tls:
            raise AssertionError("the virtual driver has no TLS")
        target = addr.target if addr.unix else tuple(addr.target)
        server = self.servers.get(target)
        if server is None:
            if addr.unix and not os.path.exists(target):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
            raise ConnectionRefusedError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))
        conn = VirtualConn(self, owner)
        theirs = _VEnd(self)
        conn.peer, theirs.peer = theirs, conn
        server.accept(theirs)
        return conn


class _VEnd:
    """One end of an in-memory connection, with the socket methods FakeServer's handlers use (recv,
    sendall, settimeout, shutdown, close, SO_LINGER 0 for a reset) and a socket's errors."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.peer = None
        self.inbox = bytearray()
        self.eof = False  # the peer sends nothing more
        self.reset = False  # the peer reset the connection
        self.shut_rd = self.shut_wr = self.closed = False
        self.linger0 = False
        self.timeout = None
        self.readers = _VWaiters(kernel)  # for data or the end
        self.room = _VWaiters(kernel)  # for room in inbox

    # -- the socket's methods --------------------------------------------------------------------

    def settimeout(self, timeout):
        self.timeout = timeout

    def gettimeout(self):
        return self.timeout

    def setsockopt(self, level, option, value):
        if (level, option) == (socket.SOL_SOCKET, socket.SO_LINGER):
            self.linger0 = struct.unpack("ii", value) == (1, 0)

    def recv(self, size):
        return self.read(size, self.timeout)

    def sendall(self, data):
        self.write(data, self.timeout)

    def send(self, data):
        self.write(data, self.timeout)
        return len(data)

    def shutdown(self, how):
        if how in (socket.SHUT_RD, socket.SHUT_RDWR):
            self.shut_rd = True
        if how in (socket.SHUT_WR, socket.SHUT_RDWR) and not self.shut_wr:
            self.shut_wr = True
            self.peer.eof = True
        self._notify()

    def close(self):
        if self.closed:
            return
        self.closed = True
        if self.linger0:
            self.peer.reset = True
        else:
            self.peer.eof = True
        self._notify()

    def _notify(self):
        for end in (self, self.peer):
            end.readers.notify()
            end.room.notify()

    # -- reading and writing on the virtual clock ---------------------------------------------------

    def read(self, size, timeout):
        due = self.kernel.deadline(timeout)
        while True:
            if self.closed:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            if self.reset:
                raise ConnectionResetError(errno.ECONNRESET, os.strerror(errno.ECONNRESET))
            if self.inbox:
                data = bytes(self.inbox[:size])
                del self.inbox[:size]
                self.room.notify()
                return data
            if self.eof or self.shut_rd:
                return b""
            if due is not None and self.kernel.now >= due:
                raise socket.timeout("timed out")
            self.readers.wait(due)

    def write(self, data, timeout):
        due = self.kernel.deadline(timeout)
        sent = 0
        while True:
            peer = self.peer
            if self.closed:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            if self.shut_wr or peer.closed or peer.shut_rd:
                raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))
            if sent == len(data):
                return
            room = _V_BUFFER - len(peer.inbox)
            if room > 0:
                piece = data[sent : sent + room]
                peer.inbox += piece
                sent += len(piece)
                peer.readers.notify()
                continue
            if due is not None and self.kernel.now >= due:
                raise socket.timeout("timed out")
            peer.room.wait(due)


class VirtualConn(_VEnd):
    """The client's end, as VirtualRun uses it: ``_Conn``'s methods and its translation of errors."""

    def __init__(self, kernel, owner):
        _VEnd.__init__(self, kernel)
        self.owner = owner
        self.reused = False

    def recv(self, timeout):
        try:
            return self.read(lc.RECV_SIZE, timeout)
        except socket.timeout:
            raise lc._Silence() from None
        except OSError as exc:
            raise lc._connection_failed(exc) from exc

    def sendall(self, data, timeout):
        try:
            self.write(data, timeout)
        except socket.timeout:
            raise lc._send_stalled(timeout) from None
        except OSError as exc:
            raise lc.StreamClosedError("the connection closed while sending the request: %s" % exc) from exc

    def abort(self):
        if not self.closed:
            self.shutdown(socket.SHUT_RDWR)

    def close(self):
        self.owner.forget(self)
        _VEnd.close(self)


class VirtualRun(lc._Run):
    """The third driver: a plan's operations performed on the virtual clock, in the calling task.  Its
    ``cancel()`` is ``_SyncRun``'s: shut the run's connections, ring its waker, and end the plan itself
    when no task drives it."""

    __slots__ = ("kernel", "lock", "conns", "rung", "sleeper")

    def __init__(self, board):
        lc._Run.__init__(self, board)
        self.kernel = board.kernel
        self.lock = threading.Lock()  # held while a task drives the plan
        self.conns = set()
        self.rung = False
        self.sleeper = _VWaiters(self.kernel)

    def signal(self):
        self.rung = True
        self.sleeper.notify()

    def _park(self, timeout):
        if not self.rung:
            self.sleeper.wait(self.kernel.deadline(timeout))
        self.rung = False

    def step(self):
        value = None
        exc = lc._cancelled() if self.cancelled else None
        while True:
            op = lc._advance(self, value, exc)
            if op is lc._DONE:
                return None
            if type(op) is list:
                return op
            value = exc = None
            try:
                code = op[0]
                if code == lc._RECV:
                    value = op[1].recv(op[2])
                elif code == lc._SEND:
                    op[1].sendall(op[2], op[3])
                elif code == lc._PARK:
                    self._park(op[1])
                elif code == lc._CONNECT:
                    value = self._connect(op[1], op[2])
                elif code == lc._KEEP:
                    self.forget(op[1])
                    if not self.board.checkin(op[1], op[2]):
                        op[1].close()
                elif code == lc._SLEEP:
                    due = self.kernel.deadline(op[1])
                    while not self.cancelled and self.kernel.now < due:
                        self._park(due - self.kernel.now)
                elif code == lc._SPAWN:
                    run = VirtualRun(self.board)
                    run.gen = op[1]
                    self.board.add(run)
                    self.kernel.spawn(run._background, "background")
                else:
                    raise AssertionError("unknown operation %r" % (op,))
            except BaseException as caught:  # noqa: B036 - thrown into the plan, which decides
                exc = caught
            exc = lc._after(self, exc)

    def _connect(self, timeout, reuse):
        conn = self.board.checkout() if reuse else None
        if conn is not None:
            conn.owner = self
            conn.reused = True
        else:
            conn = self.kernel.connect(self.board.calls.addr, self)
        self.conns.add(conn)
        return conn

    def forget(self, conn):
        self.conns.discard(conn)

    def close_all(self):
        for conn in list(self.conns):
            conn.close()

    def unwind(self):
        self.cancelled = True
        try:
            while self.step() is not None:
                pass
        except lc.CancelledError:
            pass

    def finish(self):
        with self.lock:
            try:
                while self.step() is not None:
                    pass
            finally:
                self.close_all()
        return self.value

    def _background(self):
        try:
            self.finish()
        except BaseException:  # noqa: B036 - a background plan has no caller to tell
            pass
        finally:
            self.board.discard(self)

    def cancel(self):
        self.cancelled = True
        for conn in list(self.conns):
            conn.abort()
        self.signal()
        if self.gen is not None and self.lock.acquire(False):
            try:
                self.unwind()
            finally:
                self.lock.release()


class VirtualEvent:
    """threading.Event on the virtual clock."""

    def __init__(self, kernel):
        self._kernel = kernel
        self._flag = False
        self._waiters = _VWaiters(kernel)

    def is_set(self):
        return self._flag

    def set(self):
        self._flag = True
        self._waiters.notify()

    def clear(self):
        self._flag = False

    def wait(self, timeout=None):
        due = self._kernel.deadline(timeout)
        while not self._flag and (due is None or self._kernel.now < due):
            self._waiters.wait(due)
        return self._flag


class VirtualServer(FakeServer):
    """FakeServer on in-memory connections: the same routes, handlers and records; each connection is
    served by a task of the virtual clock."""

    def __init__(self, kernel, tcp=False, n_slots=2, listen=True, like=None):
        self.kernel = kernel
        self.key = None
        FakeServer.__init__(self, tcp=tcp, n_slots=n_slots, listen=False)
        self.stopping = VirtualEvent(kernel)
        self.port = None
        self.own_tmp = like is None
        if like is not None:  # at the address of (real) server ``like``, in its directory: the same names
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp, self.path = like.tmp, like.path
            self.port = int(like.address.rsplit(":", 1)[1]) if tcp else None
        if listen:
            self.listen()

    def new_request(self, *args):
        req = FakeServer.new_request(self, *args)
        req.closed_by_peer = VirtualEvent(self.kernel)
        return req

    def listen(self):
        if not self.tcp and not os.path.exists(self.path):
            open(self.path, "wb").close()  # the socket's file, as a bound socket leaves one (unlink() works)
        self.key, self.address = self.kernel.listen(self, self.tcp)
        self.listener = _VListener(self.kernel, self.key)

    def accept(self, conn):
        with self.lock:
            self.conns.append(conn)
        self.kernel.spawn(lambda: self._serve(conn), "serve")

    def close(self):
        self.stopping.set()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        with self.lock:
            conns = list(self.conns)
        for conn in conns:
            conn.shutdown(socket.SHUT_RDWR)
        if self.kernel.current() is not None:
            self.kernel.drain()
        if self.own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


class _VListener:
    """A VirtualServer's listening socket: close() stops new connections (a Unix socket's file stays,
    so a connect is then refused)."""

    def __init__(self, kernel, key):
        self._kernel, self._key = kernel, key

    def close(self):
        self._kernel.servers.pop(self._key, None)


class VirtualThread:
    """What start_thread() returns on the virtual clock: a task, joined like a thread."""

    def __init__(self, kernel, fn):
        self._kernel = kernel
        self._task = kernel.spawn(fn, "thread")

    def join(self, timeout=None):
        self._kernel.join(self._task, timeout)

    def is_alive(self):
        return not self._task.done


class VirtualFactory:
    """Mixed in first: the test class's clients and servers run on the virtual clock (VirtualRun,
    VirtualServer), the test's thread being one of its tasks.  With ``VIRTUAL`` false (on_sockets), each
    method hands over to the real one."""

    CLIENT = "virtual"
    VIRTUAL = True

    def setUp(self):
        if not self.VIRTUAL:
            return super().setUp()
        self.kernel = VirtualKernel()
        self.kernel.start()
        try:
            super().setUp()
        except BaseException:
            self.kernel.stop()
            raise

    def tearDown(self):
        if not self.VIRTUAL:
            return super().tearDown()
        try:
            super().tearDown()
        finally:
            self.kernel.stop()

    def settle(self):
        if not self.VIRTUAL:
            return super().settle()
        self.kernel.stop()

    def new_server(self, **kw):
        if not self.VIRTUAL:
            return super().new_server(**kw)
        return VirtualServer(self.kernel, **kw)

    def new_client(self, *args, **kw):
        if not self.VIRTUAL:
            return super().new_client(*args, **kw)
        client = lc.Client(*args, **kw)
        client._board.run_class = VirtualRun
        client._board.kernel = self.kernel
        return client

    def event(self):
        if not self.VIRTUAL:
            return super().event()
        return VirtualEvent(self.kernel)

    def later(self, delay, fn):
        if not self.VIRTUAL:
            return super().later(delay, fn)

        def task():
            time.sleep(delay)
            fn()

        self.kernel.spawn(task, "later")

    def start_thread(self, fn):
        if not self.VIRTUAL:
            return super().start_thread(fn)
        return VirtualThread(self.kernel, fn)


class _OnSockets:
    """Mixed in before a VirtualFactory class: its tests back on real sockets and the real clock."""

    VIRTUAL = False
    CLIENT = "sync"


def on_sockets(cls, *names):
    """Two classes that run the tests ``names`` of ``cls`` (a VirtualFactory class) on real sockets, through
    Client and through AsyncClient: the few that show the real drivers do what the virtual one does."""
    unknown = set(names) - set(dir(cls))
    assert not unknown, unknown
    hidden = {name: None for name in dir(cls) if name.startswith("test") and name not in names}
    doc = "%s's %s on real sockets." % (cls.__name__, ", ".join(names))
    sync = type(cls.__name__ + "Sockets", (_OnSockets, cls), dict(hidden, __doc__=doc, __module__=__name__))
    other = type(cls.__name__ + "SocketsAsync", (AsyncDriver, sync), {"__doc__": doc, "__module__": __name__})
    return real_time(sync), real_time(other)


# -- helpers shared by the tiers: an event loop per test for asyncio-only tests, canned handlers ------


def run_on_new_loop(test, main, timeout=30.0, debug=True):
    """``main()`` on a fresh event loop in debug mode, as ``asyncio.run`` runs it; the test fails on what
    the loop reports (a task destroyed while pending, an exception never retrieved), on tasks still
    pending when ``main`` returns, and on a ResourceWarning (an unclosed socket, transport or loop)."""
    problems = []

    async def wrapper():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: problems.append(context))
        loop.slow_callback_duration = 5.0  # a loaded machine is not a bug
        try:
            return await asyncio.wait_for(main(), timeout)
        finally:
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if pending:
                problems.append({"message": "tasks pending when main() returned", "tasks": pending})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        try:
            result = asyncio.run(wrapper(), debug=debug)
        finally:
            gc.collect()
    test.assertEqual(problems, [], "the event loop reported problems")
    test.assertEqual([str(w.message) for w in caught if issubclass(w.category, ResourceWarning)], [])
    return result


async def until(predicate, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.1f s waiting for %s" % (timeout, what))
        await asyncio.sleep(0.005)


async def consume(stream, events):
    async for ev in stream:
        events.append(ev)


class SlotAnswers:
    """The head wait's readings of ``/slots`` in one test, in order: for each ``Waiting`` a request emits,
    whether an answer was in hand when the wait judged the slot.  A request waits at most ``poll`` for the
    shared poll's answer, and no answer by then counts as an unavailable server (``Waiting(False)``) whatever
    the slot does: on real sockets a loaded machine delays a fake server's answer past a 50 ms poll now and
    then.  ``sort(events)`` parts the Waiting events into those judged on an answer (what the test asserts,
    as the server set the slots) and those judged without one (each must be ``Waiting(False)``).  On the
    virtual clock every answer is in time."""

    def __init__(self, test):
        self.test, self.answered, self.times, self.lock = test, [], [], threading.Lock()
        original = lc._SlotWatch.state

        def state(watch, slots, slot, every, address):
            if every:  # the head wait's reading (the quiet rule's, after the head, passes every=False)
                with self.lock:
                    self.answered.append(slots is not None)
                    self.times.append(lc._clock())
            return original(watch, slots, slot, every, address)

        patcher = mock.patch.object(lc._SlotWatch, "state", state)
        patcher.start()
        test.addCleanup(patcher.stop)

    def reset(self):
        """A new request: its Waiting events are counted afresh."""
        with self.lock:
            self.answered, self.times = [], []

    def busy_since(self, start):
        """When the wait judged on answers began last: ``start``, or the first reading on an answer after
        the last one without (each change between busy and unavailable starts a budget afresh)."""
        with self.lock:
            pairs = list(zip(self.answered, self.times))
        since = start
        for (before, _), (now, at) in zip([(True, start)] + pairs, pairs):
            if now and not before:
                since = at
        return since

    def sort(self, events):
        """(the Waiting events judged on an answer, those judged without one), each in order."""
        waits = [e for e in events if isinstance(e, lc.Waiting)]
        with self.lock:
            answered = list(self.answered)
        self.test.assertLessEqual(len(waits), len(answered))
        timely = [w for w, ok in zip(waits, answered) if ok]
        late = [w for w, ok in zip(waits, answered) if not ok]
        self.test.assertEqual(set(late) - {lc.Waiting(False)}, set(), "no answer yet is an unavailable server")
        if getattr(self.test, "VIRTUAL", False):
            self.test.assertEqual(late, [], "every answer is in time on the virtual clock")
        return timely, late


def waits_first(test, events):
    """``events`` without their ``Waiting`` events, which all come first (a head wait is before any byte)."""
    waits = [e for e in events if isinstance(e, lc.Waiting)]
    test.assertEqual(events[: len(waits)], waits, "a Waiting after the head")
    return events[len(waits) :]


def past_the_first_waits(events):
    """``events`` from the first that is not a ``Waiting`` on: what a first attempt whose answer came later
    than the poll told before it (a later attempt has a head wait of its own)."""
    first = next((i for i, e in enumerate(events) if not isinstance(e, lc.Waiting)), len(events))
    return events[first:]


def hold_then(body, release, server=None):
    """A handler that sends nothing until ``release`` is set (a busy slot), then ``body``."""

    def handler(req):
        deadline = time.monotonic() + 10
        while not release.is_set():
            if req.wait_peer_close(0.02) or req.server.stopping.is_set() or time.monotonic() > deadline:
                return
        req.send(STREAM_HEAD + body)

    return handler


# =====================================================================================================
# Tier 1. Parsers fed bytes (and the pump between them)
# =====================================================================================================

# -----------------------------------------------------------------------------------------------------
# Parser tests: no sockets.  Every byte-level case goes through _p_check_feeds, which feeds the input
# whole, byte by byte, split at every offset (a seeded sample plus the interesting offsets for big inputs),
# at every pair of offsets for short inputs, and with empty reads around it, and asserts the same exact
# output (or the same error, raised by the read that holds the offending byte) every time.
# -----------------------------------------------------------------------------------------------------


def _p_pieces(data, cuts):
    pieces, prev = [], 0
    for cut in cuts:
        pieces.append(data[prev:cut])
        prev = cut
    pieces.append(data[prev:])
    return pieces


def _p_splittings(n, pairs_upto=40, sample=None, hot=(), seed=20240611):
    """(label, cut offsets): whole, with empty reads, byte by byte, each single offset, each pair if short."""
    yield "whole", []
    yield "with empty reads around it", [0, n]
    if n > 1:
        yield "byte by byte", list(range(1, n))
    if sample is None or n - 1 <= sample:
        singles = range(1, n)
    else:
        chosen = set(random.Random(seed + n).sample(range(1, n), sample))
        for h in hot:
            chosen.update(o for o in range(h - 4, h + 5) if 0 < o < n)
        singles = sorted(chosen)
    for i in singles:
        yield "split at %d" % i, [i]
    if n <= pairs_upto:
        for i in range(1, n):
            for j in range(i + 1, n):
                yield "split at %d and %d" % (i, j), [i, j]


def _p_short(value, limit=300):
    text = repr(value)
    return text if len(text) <= limit else "%s...(%d chars)...%s" % (text[: limit // 2], len(text), text[-limit // 2 :])


def _p_run(make, pieces, end, state, join):
    """Feed ``pieces`` to a fresh parser: ("ok", output) or ("raised", exc, first byte, end of the read,
    output delivered before the error).  A parser that returns output and keeps the error in ``failed``
    raised it at that read: the caller raises it once the output is used, as the client does."""
    parser = make()
    out = []
    start = 0

    def raised(exc, first, stop):
        return ("raised", exc, first, stop, b"".join(out) if join else out)

    for piece in pieces:
        try:
            out.extend(parser.feed(piece))
        except Exception as exc:
            return raised(exc, start, start + len(piece))
        if getattr(parser, "failed", None) is not None:
            return raised(parser.failed, start, start + len(piece))
        start += len(piece)
    if end is not None:
        try:
            out.extend(end(parser) or [])
        except Exception as exc:
            return raised(exc, "eof", "eof")
        if getattr(parser, "failed", None) is not None:
            return raised(parser.failed, "eof", "eof")
    value = b"".join(out) if join else out
    if state is not None:
        value = (value, state(parser))
    return ("ok", value)


def _p_check_feeds(
    test,
    make,
    data,
    expect=None,
    raises=None,
    at=None,
    end=None,
    state=None,
    join=False,
    pairs_upto=40,
    sample=None,
    hot=(),
    before=None,
):
    """Assert every way of feeding ``data`` to ``make()`` gives ``expect`` exactly, or raises ``raises``.

    ``end(parser)`` runs after the last read (feed_eof, close) and may add output.  ``state(parser)`` is
    compared too: the output is then ``(output, state)``.  ``join`` joins bytes pieces.  With ``raises``,
    ``at`` says which read must raise: "eof" (the end call), an index (the read holding that byte), or
    (lo, hi): the read holding some byte from lo to hi; ``before`` is the output every way of feeding
    delivers before the error.  Big inputs: pass ``sample`` (how many single offsets to try) and ``hot``
    (offsets tried with their neighbours).
    """
    tried = 0
    for label, cuts in _p_splittings(len(data), pairs_upto, sample, hot):
        result = _p_run(make, _p_pieces(data, cuts), end, state, join)
        tried += 1
        if raises is None:
            if result[0] != "ok":
                test.fail("%s: raised %r, expected %s" % (label, result[1], _p_short(expect)))
            if result[1] != expect:
                test.fail("%s: got %s, expected %s" % (label, _p_short(result[1]), _p_short(expect)))
            continue
        if result[0] != "raised":
            test.fail("%s: returned %s, expected %s" % (label, _p_short(result[1]), raises.__name__))
        exc, first, stop, delivered = result[1:]
        if type(exc) is not raises:
            test.fail("%s: raised %r, expected %s" % (label, exc, raises.__name__))
        if before is not None and delivered != before:
            test.fail("%s: delivered %s before %s, expected %s" % (label, _p_short(delivered), exc, _p_short(before)))
        if at is None:
            continue
        if at == "eof" or first == "eof":
            if at != first:
                test.fail("%s: %s raised at read [%s, %s), expected at %r" % (label, raises.__name__, first, stop, at))
            continue
        lo, hi = (at, at) if isinstance(at, int) else at
        if not (first <= hi and stop > lo):
            test.fail(
                "%s: %s raised by the read of bytes [%d, %d), expected by the read holding byte %s"
                % (label, raises.__name__, first, stop, at)
            )
    return tried


def _p_reader_state(reader):
    head = reader.head
    return (head.version, head.status, head.reason, head.headers, reader.done)


def _p_eof(parser):
    parser.feed_eof()
    return []


# -----------------------------------------------------------------------------------------------------
# Request encoding
# -----------------------------------------------------------------------------------------------------


class TestParserEncodeRequest(unittest.TestCase):
    def test_post_with_body_exact_bytes(self):
        got = lc.encode_request(
            "POST",
            "/v1/chat/completions",
            "localhost",
            [("Content-Type", "application/json"), ("Authorization", "Bearer k")],
            b'{"a":1}',
        )
        self.assertEqual(
            got,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer k\r\n"
            b'Content-Length: 7\r\n\r\n{"a":1}',
        )

    def test_get_without_body_has_no_content_length(self):
        self.assertEqual(
            lc.encode_request("GET", "/slots", "127.0.0.1:8080"), b"GET /slots HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n"
        )

    def test_cr_lf_nul_refused_in_path_name_value_host(self):
        for bad in ("\r", "\n", "\r\n", "\0"):
            with self.subTest(bad=bad):
                with self.assertRaises(ValueError):
                    lc.encode_request("GET", "/slots" + bad + "X: y", "localhost")
                with self.assertRaises(ValueError):
                    lc.encode_request("GET", "/slots", "localhost", [("X-A" + bad + "B", "v")])
                with self.assertRaises(ValueError):
                    lc.encode_request("GET", "/slots", "localhost", [("X-Trace", "1" + bad + "Evil: 1")])
                with self.assertRaises(ValueError):
                    lc.encode_request("GET", "/slots", "local" + bad + "host")

    def test_secret_value_not_echoed_in_the_error(self):
        with self.assertRaises(ValueError) as cm:
            lc.encode_request("GET", "/", "h", [("Authorization", "Bearer s3cret\r\n")])
        self.assertNotIn("s3cret", str(cm.exception))


# -----------------------------------------------------------------------------------------------------
# Response head and body framing
# -----------------------------------------------------------------------------------------------------


class TestParserResponseReader(unittest.TestCase):
    def check(self, data, expect=None, reader=lambda: lc.ResponseReader(), **kw):
        kw.setdefault("end", _p_eof)
        if kw.get("raises") is None:
            kw.setdefault("state", _p_reader_state)
        return _p_check_feeds(self, reader, data, expect, join=True, **kw)

    def test_content_length_body_and_head_fields(self):
        data = (
            b"HTTP/1.1 404 Not Found\r\nServer: llama.cpp\r\nX-Dup: a\r\nx-dup:  b \r\nContent-Length: 5\r\n\r\nhello"
        )
        headers = [("server", "llama.cpp"), ("x-dup", "a"), ("x-dup", "b"), ("content-length", "5")]
        self.check(data, (b"hello", ("HTTP/1.1", 404, "Not Found", headers, True)))
        reader = lc.ResponseReader()
        self.assertEqual(reader.feed(data), [b"hello"])
        self.assertEqual(reader.head.get("X-DUP"), "b")
        self.assertEqual(reader.head.get_all("x-dup"), ["a", "b"])
        self.assertIsNone(reader.head.get("missing"))

    def test_content_length_done_before_eof(self):
        reader = lc.ResponseReader()
        self.assertEqual(reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\no"), [b"o"])
        self.assertFalse(reader.done)
        self.assertEqual(reader.feed(b"k"), [b"k"])
        self.assertTrue(reader.done)
        self.assertEqual(reader.head.status, 200)

    def test_reason_with_spaces_and_missing_reason(self):
        self.check(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
            (b"", ("HTTP/1.1", 503, "Service Unavailable", [("content-length", "0")], True)),
        )
        self.check(
            b"HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n", (b"", ("HTTP/1.1", 200, "", [("content-length", "0")], True))
        )

    def test_until_close(self):
        data = b"HTTP/1.0 200 OK\r\nServer: x\r\n\r\nline1\nline2\r\n"
        self.check(data, (b"line1\nline2\r\n", ("HTTP/1.0", 200, "OK", [("server", "x")], True)))
        reader = lc.ResponseReader()
        self.assertEqual(reader.feed(data), [b"line1\nline2\r\n"])
        self.assertFalse(reader.done)
        reader.feed_eof()
        self.assertTrue(reader.done)

    def test_chunked_stream_head(self):
        data = STREAM_HEAD + chunked(b"data: a\n\n", b"data: [DONE]\n\n") + b"0\r\n\r\n"
        headers = [
            ("server", "llama.cpp"),
            ("access-control-allow-origin", ""),
            ("x-accel-buffering", "no"),
            ("content-type", "text/event-stream"),
            ("transfer-encoding", "chunked"),
            ("connection", "close"),
        ]
        self.check(
            data,
            (b"data: a\n\ndata: [DONE]\n\n", ("HTTP/1.1", 200, "OK", headers, True)),
            sample=150,
            hot=(len(STREAM_HEAD),),
        )

    def test_chunked_wins_over_content_length(self):
        data = b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
        self.check(
            data,
            (b"abc", ("HTTP/1.1", 200, "OK", [("content-length", "99"), ("transfer-encoding", "chunked")], True)),
            sample=60,
        )

    def test_interim_1xx_responses_skipped(self):
        data = (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        )
        self.check(data, (b"ok", ("HTTP/1.1", 200, "OK", [("content-length", "2")], True)), pairs_upto=0)

    def test_204_has_no_body(self):
        self.check(b"HTTP/1.1 204 No Content\r\n\r\n", (b"", ("HTTP/1.1", 204, "No Content", [], True)))

    def test_identical_duplicate_content_length_ok(self):
        self.check(
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
            (b"abc", ("HTTP/1.1", 200, "OK", [("content-length", "3"), ("content-length", "3")], True)),
            pairs_upto=0,
        )
        self.check(
            b"HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\nabc",
            (b"abc", ("HTTP/1.1", 200, "OK", [("content-length", "3, 3")], True)),
            pairs_upto=0,
        )

    def test_conflicting_content_length(self):
        for head in (b"Content-Length: 3\r\nContent-Length: 4\r\n", b"Content-Length: 3, 4\r\n"):
            data = b"HTTP/1.1 200 OK\r\n" + head + b"\r\nabcd"
            with self.subTest(head=head):
                self.check(data, raises=lc.ProtocolError, at=(17, len(data) - 5), pairs_upto=0)

    def test_malformed_content_length(self):
        for value in (b"-1", b"abc", b"", b"3.0", b"+3", b"0x3", b"\xd9\xa3"):
            data = b"HTTP/1.1 200 OK\r\nContent-Length: " + value + b"\r\n\r\nabc"
            with self.subTest(value=value):
                self.check(data, raises=lc.ProtocolError, at=(len(data) - 6, len(data) - 4), pairs_upto=0)

    def test_body_short_is_stream_closed_at_eof(self):
        self.check(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabc", raises=lc.StreamClosedError, at="eof")

    def test_eof_before_or_inside_head(self):
        self.check(b"", raises=lc.StreamClosedError, at="eof")
        self.check(b"HTTP/1.1 200 OK\r\nContent-Le", raises=lc.StreamClosedError, at="eof")
        self.check(b"HTTP/1.1 200 OK\r\n\r", raises=lc.StreamClosedError, at="eof")

    def test_malformed_status_line(self):
        for line in (
            b"HTTP/2 200 OK",
            b"HTTP/1.1 20 OK",
            b"HTTP/1.1 2000 OK",
            b"ICY 200 OK",
            b"HTTP/1.1 abc OK",
            b"garbage",
        ):
            data = line + b"\r\nContent-Length: 0\r\n\r\n"
            with self.subTest(line=line):
                self.check(data, raises=lc.ProtocolError, at=(0, len(data) - 1), pairs_upto=0)

    def test_malformed_header_line(self):
        for line in (b"NoColon", b"Space : before", b": empty-name", b"Bad\x00: nul", b"B\xe4d: latin"):
            data = b"HTTP/1.1 200 OK\r\n" + line + b"\r\nContent-Length: 0\r\n\r\n"
            with self.subTest(line=line):
                self.check(data, raises=lc.ProtocolError, at=(17, len(data) - 1), pairs_upto=0)

    # ---- caps: 64 KiB of head (status line and header lines, the blank line excluded), 100 header lines

    def _head(self, size):
        """A head block of exactly ``size`` bytes (without the blank line that ends it)."""
        prefix = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Pad: "
        return prefix + b"p" * (size - len(prefix))

    def test_head_at_64k_limit_ok(self):
        block = self._head(65536)
        data = block + b"\r\n\r\nok"
        state = ("HTTP/1.1", 200, "OK", [("content-length", "2"), ("x-pad", "p" * (65536 - 43))], True)
        self.check(data, (b"ok", state), sample=40, hot=(65536, 65538, 65540))

    def test_head_one_byte_over_64k(self):
        data = self._head(65537) + b"\r\n\r\nok"
        self.check(data, raises=lc.ProtocolError, at=65536, sample=40, hot=(65536,))

    def test_head_over_64k_without_terminator(self):
        data = self._head(65537 + 1000)
        self.check(data, raises=lc.ProtocolError, at=65536, sample=40, hot=(65536,))

    def test_small_max_head_every_offset(self):
        block = b"HTTP/1.1 200 OK\r\nContent-Length: 0"  # 34 bytes
        ok = lambda: lc.ResponseReader(max_head=34)
        self.check(block + b"\r\n\r\n", (b"", ("HTTP/1.1", 200, "OK", [("content-length", "0")], True)), reader=ok)
        self.check(block + b"\n\n", (b"", ("HTTP/1.1", 200, "OK", [("content-length", "0")], True)), reader=ok)
        tight = lambda: lc.ResponseReader(max_head=33)
        self.check(block + b"\r\n\r\n", raises=lc.ProtocolError, at=33, reader=tight)
        self.check(block + b"0000", raises=lc.ProtocolError, at=33, reader=tight)

    def _lines_head(self, n):
        return (
            b"HTTP/1.1 200 OK\r\n"
            + b"".join(b"X-H%d: %d\r\n" % (i, i) for i in range(n - 1))
            + b"Content-Length: 0\r\n"
        )

    def test_100_header_lines_ok(self):
        data = self._lines_head(100) + b"\r\n"
        headers = [("x-h%d" % i, str(i)) for i in range(99)] + [("content-length", "0")]
        self.check(data, (b"", ("HTTP/1.1", 200, "OK", headers, True)), sample=200, hot=(len(data) - 2,))

    def test_101_header_lines(self):
        head = self._lines_head(101)
        data = head + b"\r\n"
        first = len(self._lines_head(100))  # first byte of the 101st header line
        self.check(data, raises=lc.ProtocolError, at=(first, len(data) - 1), sample=200, hot=(first, len(head)))

    def test_101_header_lines_without_terminator(self):
        head = self._lines_head(101)
        first = len(self._lines_head(100))
        self.check(
            head + b"X-More: 1", raises=lc.ProtocolError, at=(first, len(head) - 1), sample=200, hot=(first, len(head))
        )

    # ---- max_body

    def test_max_body_content_length(self):
        ten = lambda: lc.ResponseReader(max_body=10)
        data = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789"
        self.check(
            data, (b"0123456789", ("HTTP/1.1", 200, "OK", [("content-length", "10")], True)), reader=ten, pairs_upto=0
        )
        data = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n0123456789A"
        head_end = len(data) - 11
        self.check(data, raises=lc.ProtocolError, at=(head_end - 1, len(data) - 1), reader=ten, pairs_upto=0)

    def test_max_body_chunked(self):
        ten = lambda: lc.ResponseReader(max_body=10)
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        data = head + chunked(b"01234", b"56789") + b"0\r\n\r\n"
        self.check(
            data,
            (b"0123456789", ("HTTP/1.1", 200, "OK", [("transfer-encoding", "chunked")], True)),
            reader=ten,
            pairs_upto=0,
        )
        data = head + chunked(b"01234", b"56789A") + b"0\r\n\r\n"
        eleventh = len(head) + len(chunked(b"01234")) + 3 + 5
        self.assertEqual(data[eleventh : eleventh + 1], b"A")
        self.check(data, raises=lc.ProtocolError, at=eleventh, reader=ten, pairs_upto=0)
        # over without any terminator: one chunk announced bigger than the cap, cut off after 11 bytes
        data = head + b"20\r\n0123456789A"
        self.check(data, raises=lc.ProtocolError, at=len(data) - 1, reader=ten, pairs_upto=0)

    def test_max_body_until_close(self):
        ten = lambda: lc.ResponseReader(max_body=10)
        head = b"HTTP/1.0 200 OK\r\n\r\n"
        self.check(head + b"0123456789", (b"0123456789", ("HTTP/1.0", 200, "OK", [], True)), reader=ten)
        self.check(head + b"0123456789A", raises=lc.ProtocolError, at=len(head) + 10, reader=ten)  # no EOF needed


# -----------------------------------------------------------------------------------------------------
# Chunked framing
# -----------------------------------------------------------------------------------------------------


class TestParserChunked(unittest.TestCase):
    def check(self, data, expect=None, **kw):
        kw.setdefault("end", _p_eof)
        if kw.get("raises") is None:
            kw.setdefault("state", lambda d: d.done)
        return _p_check_feeds(self, lc.ChunkedDecoder, data, expect, join=True, **kw)

    def test_plain_chunks(self):
        self.check(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", (b"hello world", True))
        self.check(b"A\r\n0123456789\r\na\r\nabcdefghij\r\n0\r\n\r\n", (b"0123456789abcdefghij", True), pairs_upto=0)
        self.check(b"0\r\n\r\n", (b"", True))

    def test_done_before_eof_and_bytes_after_ignored(self):
        dec = lc.ChunkedDecoder()
        self.assertEqual(dec.feed(b"3\r\nabc\r\n"), [b"abc"])
        self.assertFalse(dec.done)
        self.assertEqual(dec.feed(b"0\r\n\r\n"), [])
        self.assertTrue(dec.done)
        self.assertEqual(dec.feed(b"5\r\nextra\r\n"), [])
        dec.feed_eof()

    def test_extensions_ignored(self):
        self.check(
            b'5;name=val\r\nhello\r\n6;a=1;q="x y"\r\n world\r\n0;last\r\n\r\n', (b"hello world", True), pairs_upto=20
        )

    def test_trailers_ignored(self):
        self.check(b"3\r\nabc\r\n0\r\nX-Trailer: 1\r\nAnother: two\r\n\r\n", (b"abc", True))

    def test_lf_only_line_ends_accepted(self):
        self.check(b"3\nabc\n0\n\n", (b"abc", True))

    def test_malformed_size(self):
        for line in (b"zz", b"-1", b"", b"0x10", b"1 0", b";ext", b"g", b"+5", b"12345678901234567"):
            data = line + b"\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n"
            with self.subTest(line=line):
                self.check(data, raises=lc.ProtocolError, at=(0, len(line) + 1), pairs_upto=0)

    def test_missing_crlf_after_data(self):
        self.check(b"3\r\nabcX\r\n0\r\n\r\n", raises=lc.ProtocolError, at=6)
        self.check(b"3\r\nabc\rX0\r\n\r\n", raises=lc.ProtocolError, at=7)
        self.check(b"3\r\nabcd\r\n0\r\n\r\n", raises=lc.ProtocolError, at=6)

    def test_cut_short_is_stream_closed_at_eof(self):
        for data in (
            b"",
            b"3",
            b"3\r",
            b"3\r\n",
            b"3\r\nab",
            b"3\r\nabc",
            b"3\r\nabc\r",
            b"3\r\nabc\r\n",
            b"3\r\nabc\r\n0;ext",
            b"3\r\nabc\r\n0\r\nX-T: 1",
        ):
            with self.subTest(data=data):
                self.check(data, raises=lc.StreamClosedError, at="eof")

    def test_chunk_size_line_cap(self):
        cap = lc.MAX_CHUNK_LINE  # longest chunk-size line: size and extensions, the line end excluded
        at_limit = b"3;" + b"e" * (cap - 2)
        hot = (cap, cap + 1, cap + 2)
        self.check(at_limit + b"\r\nabc\r\n0\r\n\r\n", (b"abc", True), sample=60, hot=hot)
        self.check(at_limit + b"\nabc\n0\n\n", (b"abc", True), sample=60, hot=hot)
        over = at_limit + b"e"
        self.check(over + b"\r\nabc\r\n0\r\n\r\n", raises=lc.ProtocolError, at=cap, sample=60, hot=hot)
        self.check(over + b"e" * 100, raises=lc.ProtocolError, at=cap, sample=60, hot=hot)


# -----------------------------------------------------------------------------------------------------
# Server-Sent Events
# -----------------------------------------------------------------------------------------------------


def _p_sse(max_line=1024 * 1024):
    return lambda: lc.SSEDecoder(max_line)


def _p_close(decoder):
    return decoder.close()


class TestParserSSE(unittest.TestCase):
    def check(self, data, expect=None, max_line=1024 * 1024, **kw):
        kw.setdefault("end", _p_close)
        return _p_check_feeds(self, _p_sse(max_line), data, expect, **kw)

    def test_lf_line_ends(self):
        self.check(b"data: a\n\ndata: b\n\n", [("message", "a"), ("message", "b")])

    def test_crlf_line_ends(self):
        self.check(b"data: a\r\n\r\ndata: b\r\n\r\n", [("message", "a"), ("message", "b")])

    def test_cr_line_ends(self):
        self.check(b"data: a\r\rdata: b\r\r", [("message", "a"), ("message", "b")])

    def test_mixed_line_ends(self):
        self.check(b"data: a\r\ndata: b\rdata: c\n\r\ndata: d\r\r\n", [("message", "a\nb\nc"), ("message", "d")])

    def test_cr_at_end_of_read_then_lf_is_one_line_end(self):
        dec = lc.SSEDecoder()
        self.assertEqual(dec.feed(b"data: a\r"), [])
        self.assertEqual(dec.feed(b"\n"), [])  # CR LF split across reads: one line end, not a blank line
        self.assertEqual(dec.feed(b"data: b\r"), [])
        self.assertEqual(dec.feed(b"\ndata: c\r\n\r"), [])
        self.assertEqual(dec.feed(b"\n"), [("message", "a\nb\nc")])
        self.assertEqual(dec.close(), [])
        self.check(b"data: a\r\ndata: b\r\n\r\n", [("message", "a\nb")])

    def test_cr_at_end_of_read_then_other_byte(self):
        dec = lc.SSEDecoder()
        self.assertEqual(dec.feed(b"data: a\r"), [])
        self.assertEqual(dec.feed(b"\r"), [])  # the second CR may still be the start of a CRLF
        self.assertEqual(dec.feed(b"data: b\n\n"), [("message", "a"), ("message", "b")])

    def test_held_cr_ends_its_line_at_close(self):
        dec = lc.SSEDecoder()
        self.assertEqual(dec.feed(b"data: a\r\r"), [])
        self.assertEqual(dec.close(), [("message", "a")])
        self.check(b"data: a\r\r", [("message", "a")])

    def test_one_leading_bom_dropped(self):
        self.check(b"\xef\xbb\xbfdata: a\n\n", [("message", "a")])

    def test_bom_split_across_reads(self):
        for cuts in ([1], [2], [1, 2], [1, 3], [2, 3], [0, 1, 2, 3]):
            with self.subTest(cuts=cuts):
                dec = lc.SSEDecoder()
                out = []
                for piece in _p_pieces(b"\xef\xbb\xbfdata: a\n\n", cuts):
                    out += dec.feed(piece)
                self.assertEqual(out + dec.close(), [("message", "a")])

    def test_only_one_bom_dropped(self):
        # the second BOM is part of the first line: its field name is "\ufeffdata", unknown, ignored
        self.check(b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\ndata: b\n\n", [("message", "b")])

    def test_bom_not_leading_is_kept(self):
        self.check(b"data: a\n\n\xef\xbb\xbfdata: b\n\n", [("message", "a")])
        self.check(b"data: \xef\xbb\xbfx\n\n", [("message", "\ufeffx")])

    def test_partial_bom_prefix_is_not_dropped(self):
        self.check(b"\xef\xbb\ndata: a\n\n", [("message", "a")])  # a line "\xef\xbb": unknown field
        self.check(b"\xefdata: a\n\ndata: b\n\n", [("message", "b")])

    def test_comments_ignored(self):
        self.check(b": ping\n\n:\ndata: a\n: in the middle\ndata: b\n:x\n\n: tail\n", [("message", "a\nb")])

    def test_comment_only_blocks_dispatch_nothing(self):
        self.check(b": ping - 1\n\n: ping - 2\r\n\r\n", [])

    def test_exactly_one_space_stripped_after_colon(self):
        self.check(
            b"data:a\n\ndata: a\n\ndata:  a\n\ndata: \n\ndata:\n\ndata:\ta\n\n",
            [
                ("message", "a"),
                ("message", "a"),
                ("message", " a"),
                ("message", ""),
                ("message", ""),
                ("message", "\ta"),
            ],
        )
        self.check(b"event:  x\ndata: 1\n\nevent:y\ndata: 2\n\n", [(" x", "1"), ("y", "2")])

    def test_multiline_data_joined_with_lf(self):
        self.check(b"data: a\ndata:\ndata: b\ndata\n\n", [("message", "a\n\nb\n")])

    def test_field_without_colon(self):
        self.check(b"data\n\n", [("message", "")])

    def test_event_type_field_and_reset(self):
        self.check(b"event: update\ndata: x\n\ndata: y\n\n", [("update", "x"), ("message", "y")])

    def test_blocks_without_data_dispatch_nothing(self):
        self.check(b"event: foo\n\nid: 7\n\nretry: 10\n\nunknown: z\n\ndata: x\n\n", [("message", "x")])

    def test_id_retry_and_unknown_fields_ignored_inside_event(self):
        self.check(b"id: 1\nretry: 5\nfoo: bar\nData: no\ndata: x\n\n", [("message", "x")])

    def test_unterminated_last_event_discarded(self):
        self.check(b"data: a\n\ndata: b\n", [("message", "a")])
        self.check(b"data: a\n\ndata: b", [("message", "a")])
        self.check(b"data: a\n\ndata: b\ndata: c\r\n", [("message", "a")])

    def test_close_resets(self):
        dec = lc.SSEDecoder()
        self.assertEqual(dec.feed(b"event: e\ndata: x\n"), [])
        self.assertEqual(dec.close(), [])

    def test_utf8_and_multibyte_split(self):
        text = "h\u00e9llo \u20ac \U0001f30a \u4e2d"
        self.check(b"data: " + text.encode() + b"\n\n", [("message", text)])

    def test_invalid_utf8_replaced(self):
        self.check(
            b"data: a\xffb\n\ndata: \xe2\x82\n\ndata: \xc3\n\n",
            [("message", "a\ufffdb"), ("message", "\ufffd"), ("message", "\ufffd")],
        )

    def test_legacy_error_line(self):
        self.check(
            b'error: {"code":500,"message":"boom"}\n\ndata: x\n\n',
            [("error", '{"code":500,"message":"boom"}'), ("message", "x")],
        )

    def test_llama_server_stream_shape(self):
        payload = chunk_json({"content": "hi"})
        self.check(
            sse(payload) + b": ping\n\n" + b"data: [DONE]\n\n",
            [("message", payload), ("message", "[DONE]")],
            pairs_upto=0,
        )


class TestParserSSELimits(unittest.TestCase):
    """max_line: for a line and for an event; at the limit OK, one over and over without newline refused."""

    def check(self, data, expect=None, max_line=16, **kw):
        kw.setdefault("end", _p_close)
        return _p_check_feeds(self, _p_sse(max_line), data, expect, **kw)

    def test_data_line_at_limit(self):
        self.check(b"data:" + b"x" * 11 + b"\n\n", [("message", "x" * 11)])
        self.check(b"data:" + b"x" * 11 + b"\r\n\r\n", [("message", "x" * 11)])
        self.check(b"data:" + b"x" * 11 + b"\r\r", [("message", "x" * 11)])

    def test_data_line_one_over(self):
        self.check(b"data:" + b"x" * 12 + b"\n\n", raises=lc.ProtocolError, at=16)
        self.check(b"data:" + b"x" * 12 + b"\r\n\r\n", raises=lc.ProtocolError, at=16)

    def test_comment_line_limit(self):
        self.check(b":" + b"c" * 15 + b"\ndata: x\n\n", [("message", "x")])
        self.check(b":" + b"c" * 16 + b"\ndata: x\n\n", raises=lc.ProtocolError, at=16)

    def test_line_over_without_newline(self):
        self.check(b"data:" + b"x" * 20, raises=lc.ProtocolError, at=16)
        self.check(b"data: a\n\n: " + b"p" * 40, raises=lc.ProtocolError, at=9 + 16)

    def test_event_at_limit(self):
        # the event is its data: 16 + 1 (the joining LF) + 15 = 32 bytes
        self.check(
            b"data:" + b"a" * 16 + b"\ndata:" + b"b" * 15 + b"\n\n",
            [("message", "a" * 16 + "\n" + "b" * 15)],
            max_line=32,
            pairs_upto=0,
        )

    def test_event_one_over(self):
        data = b"data:" + b"a" * 16 + b"\ndata:" + b"b" * 16 + b"\n\n"
        last_b = 22 + 5 + 15
        self.assertEqual(data[last_b : last_b + 2], b"b\n")
        self.check(data, raises=lc.ProtocolError, at=(last_b, last_b + 1), max_line=32, pairs_upto=0)

    def test_event_over_without_newline(self):
        # each line is under the limit (21 and 25 bytes), the event passes 32 bytes before any newline ends it
        data = b"data:" + b"a" * 16 + b"\ndata:" + b"b" * 20
        passes = 22 + 5 + 15  # the 16th "b": 16 + 1 + 16 = 33 bytes of event data
        # a decoder that counts the raw bytes of the event's lines may refuse earlier, from byte 32 on
        self.check(data, raises=lc.ProtocolError, at=(32, passes), max_line=32, pairs_upto=0)

    def test_many_lines_each_under_limit_form_an_event_over(self):
        data = b"".join(b"data:%02d\n" % i for i in range(12)) + b"\n"  # 12 * 2 + 11 = 35 bytes of data
        self.check(data, raises=lc.ProtocolError, max_line=32, pairs_upto=0)

    def test_limit_resets_between_events(self):
        one = b"data:" + b"a" * 16 + b"\ndata:" + b"b" * 15 + b"\n\n"
        self.check(one * 3, [("message", "a" * 16 + "\n" + "b" * 15)] * 3, max_line=32, pairs_upto=0)


# -----------------------------------------------------------------------------------------------------
# Delta assembler
# -----------------------------------------------------------------------------------------------------


def _p_feed_payloads(payloads):
    asm = lc.Assembler()
    events = []
    for payload in payloads:
        events += asm.feed(payload)
    return asm, events


def _p_tool(index, cid=None, name=None, args=None):
    call = {"index": index}
    if cid is not None:
        call["id"] = cid
        call["type"] = "function"
    func = {}
    if name is not None:
        func["name"] = name
    if args is not None:
        func["arguments"] = args
    if func:
        call["function"] = func
    return call


class TestParserAssembler(unittest.TestCase):
    def test_content_deltas_concatenate_in_order(self):
        asm, events = _p_feed_payloads(
            [
                chunk_json({"role": "assistant", "content": None}),
                chunk_json({"content": "Hel"}),
                chunk_json({"content": "lo"}),
                chunk_json({"content": " w\u00f6rld\n"}),
                chunk_json({}, "stop"),
            ]
        )
        self.assertEqual(events, [lc.Content("Hel"), lc.Content("lo"), lc.Content(" w\u00f6rld\n")])
        self.assertEqual(asm.id, CID)
        self.assertEqual(
            asm.completion(),
            lc.Completion(
                id=CID,
                model=MODEL,
                content="Hello w\u00f6rld\n",
                reasoning="",
                tool_calls=[],
                finish_reason="stop",
                usage=None,
                timings=None,
                reasoning_tokens=0,
                thinking_capped=False,
            ),
        )

    def test_reasoning_then_content(self):
        asm = lc.Assembler()
        self.assertFalse(asm.in_reasoning)
        self.assertEqual(asm.feed(chunk_json({"reasoning_content": "Let"})), [lc.Reasoning("Let")])
        self.assertTrue(asm.in_reasoning)
        self.assertEqual(asm.feed(chunk_json({"reasoning_content": " me"})), [lc.Reasoning(" me")])
        self.assertEqual(asm.reasoning_tokens, 2)
        self.assertEqual(asm.feed(chunk_json({"content": "Yes"})), [lc.Content("Yes")])
        self.assertFalse(asm.in_reasoning)
        self.assertEqual(asm.feed(chunk_json({}, "stop")), [])
        done = asm.completion()
        self.assertEqual((done.reasoning, done.content, done.reasoning_tokens), ("Let me", "Yes", 2))

    def test_one_reasoning_token_per_chunk_with_nonempty_reasoning(self):
        asm, events = _p_feed_payloads(
            [
                chunk_json({"reasoning_content": "a few words in one chunk"}),
                chunk_json({"reasoning_content": ""}),
                chunk_json({"reasoning_content": None}),
                chunk_json({"reasoning_content": "b", "content": "c"}),
                chunk_json({"content": "d"}),
                chunk_json({}, "stop"),
            ]
        )
        self.assertEqual(
            events, [lc.Reasoning("a few words in one chunk"), lc.Reasoning("b"), lc.Content("c"), lc.Content("d")]
        )
        self.assertEqual(asm.reasoning_tokens, 2)
        self.assertEqual(asm.completion().reasoning_tokens, 2)

    def test_empty_deltas_and_role_only_chunks_produce_no_event(self):
        asm = lc.Assembler()
        for delta in (
            {"role": "assistant", "content": None},
            {"role": "assistant"},
            {},
            {"content": ""},
            {"content": None},
            {"reasoning_content": ""},
            {"tool_calls": []},
            {"tool_calls": None},
            {"tool_calls": [{"index": 0}]},
            {"tool_calls": [{"index": 0, "id": "", "function": {}}]},
            {"tool_calls": [{"index": 0, "function": {"name": "", "arguments": ""}}]},
        ):
            with self.subTest(delta=delta):
                self.assertEqual(asm.feed(chunk_json(delta)), [])
        self.assertEqual(asm.feed(json.dumps({"choices": [{"index": 0, "delta": None, "finish_reason": None}]})), [])
        self.assertEqual(asm.reasoning_tokens, 0)

    def test_tool_calls_keyed_by_index_from_3_id_and_name_set_once(self):
        payloads = [
            chunk_json({"tool_calls": [_p_tool(3, "call-A", "get_weather", '{"ci')]}),
            chunk_json({"tool_calls": [_p_tool(5, "call-B", "get_time", "")]}),
            chunk_json({"tool_calls": [_p_tool(3, None, None, 'ty": "Pa')]}),
            chunk_json({"tool_calls": [_p_tool(5, "call-B", "get_time", '{"tz":')]}),  # repeated: not concatenated
            chunk_json({"tool_calls": [_p_tool(3, "call-Z", "other", 'ris"}')]}),  # another id/name: ignored
            chunk_json({"tool_calls": [_p_tool(5, None, None, ' "UTC"}')]}),
            chunk_json({}, "tool_calls"),
        ]
        asm, events = _p_feed_payloads(payloads)
        self.assertEqual(
            events,
            [
                lc.ToolCall(3, "call-A", "get_weather", '{"ci'),
                lc.ToolCall(5, "call-B", "get_time", ""),
                lc.ToolCall(3, None, None, 'ty": "Pa'),
                lc.ToolCall(5, "call-B", "get_time", '{"tz":'),
                lc.ToolCall(3, "call-Z", "other", 'ris"}'),
                lc.ToolCall(5, None, None, ' "UTC"}'),
            ],
        )
        done = asm.completion()
        self.assertEqual(
            done.tool_calls,
            [
                lc.ToolCallResult("call-A", "get_weather", '{"city": "Paris"}'),
                lc.ToolCallResult("call-B", "get_time", '{"tz": "UTC"}'),
            ],
        )
        self.assertEqual(done.finish_reason, "tool_calls")
        self.assertEqual(done.content, "")

    def test_tool_calls_in_index_order_whatever_the_arrival(self):
        asm, _ = _p_feed_payloads(
            [
                chunk_json({"tool_calls": [_p_tool(7, "b", "g", "{}")]}),
                chunk_json({"tool_calls": [_p_tool(2, "a", "f", "[]")]}),
                chunk_json({}, "tool_calls"),
            ]
        )
        self.assertEqual(
            asm.completion().tool_calls, [lc.ToolCallResult("a", "f", "[]"), lc.ToolCallResult("b", "g", "{}")]
        )

    def test_two_tool_calls_in_one_delta(self):
        asm, events = _p_feed_payloads(
            [
                chunk_json({"tool_calls": [_p_tool(0, "x", "f", "{"), _p_tool(1, "y", "g", "[")]}),
                chunk_json({}, "tool_calls"),
            ]
        )
        self.assertEqual(events, [lc.ToolCall(0, "x", "f", "{"), lc.ToolCall(1, "y", "g", "[")])

    def test_usage_only_chunk_and_timings_merged(self):
        asm, events = _p_feed_payloads(
            [
                chunk_json({"content": "hi"}),
                chunk_json({}, "stop", extra={"timings": {"prompt_n": 5, "predicted_n": 1}}),
                chunk_json(choices=False, extra={"usage": USAGE, "timings": {"predicted_n": 2, "cache_n": 21}}),
            ]
        )
        self.assertEqual(events, [lc.Content("hi")])
        done = asm.completion()
        self.assertEqual(done.usage, USAGE)
        self.assertEqual(done.timings, {"prompt_n": 5, "predicted_n": 2, "cache_n": 21})
        self.assertEqual((done.content, done.finish_reason), ("hi", "stop"))

    def test_usage_chunk_before_finish(self):
        asm, _ = _p_feed_payloads(
            [chunk_json(choices=False, extra={"usage": {"total_tokens": 3}}), chunk_json({"content": "x"}, "length")]
        )
        done = asm.completion()
        self.assertEqual((done.usage, done.timings, done.finish_reason), ({"total_tokens": 3}, None, "length"))

    def test_no_finish_reason_is_stream_closed(self):
        asm, _ = _p_feed_payloads([chunk_json({"content": "half an ans"})])
        with self.assertRaises(lc.StreamClosedError):
            asm.completion()
        with self.assertRaises(lc.StreamClosedError):
            lc.Assembler().completion()
        asm, _ = _p_feed_payloads(
            [chunk_json({"content": "x"}), chunk_json(choices=False, extra={"usage": USAGE, "timings": TIMINGS})]
        )
        with self.assertRaises(lc.StreamClosedError):
            asm.completion()

    def test_unknown_fields_ignored(self):
        asm, events = _p_feed_payloads(
            [
                json.dumps(
                    {
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"content": "a", "new_field": [1]},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        "id": "c1",
                        "future": {"x": 1},
                    }
                ),
                json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "id": "c2"}),
            ]
        )
        self.assertEqual(events, [lc.Content("a")])
        self.assertEqual((asm.id, asm.completion().id, asm.completion().content), ("c1", "c1", "a"))

    def test_malformed_payloads_are_protocol_errors(self):
        bad = {
            "invalid JSON": "{",
            "empty": "",
            "truncated": chunk_json({"content": "x"})[:-1],
            "array": "[1, 2]",
            "string": '"text"',
            "number": "42",
            "null": "null",
            "choices object": '{"choices": {"0": {}}}',
            "choices string": '{"choices": "x"}',
            "choices falsy non-list": '{"choices": 0}',
            "choice not object": '{"choices": [1]}',
            "delta list": '{"choices": [{"delta": [], "index": 0}]}',
            "delta string": '{"choices": [{"delta": "x", "index": 0}]}',
            "delta number": '{"choices": [{"delta": 5, "index": 0}]}',
            "tool call without index": '{"choices": [{"delta": {"tool_calls": [{"id": "a", "function": {"name": "f"}}]}}]}',
            "tool call index string": '{"choices": [{"delta": {"tool_calls": [{"index": "0", "id": "a"}]}}]}',
            "tool call index bool": '{"choices": [{"delta": {"tool_calls": [{"index": true, "id": "a"}]}}]}',
            "tool call not object": '{"choices": [{"delta": {"tool_calls": ["x"]}}]}',
            "tool_calls not list": '{"choices": [{"delta": {"tool_calls": {"index": 0}}}]}',
            "arguments not string": '{"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": {}}}]}}]}',
            "content not string": '{"choices": [{"delta": {"content": 5}}]}',
            "reasoning not string": '{"choices": [{"delta": {"reasoning_content": ["x"]}}]}',
            "finish_reason not string": '{"choices": [{"delta": {}, "finish_reason": 1}]}',
            "usage not object": '{"choices": [], "usage": [1]}',
            "timings not object": '{"choices": [], "timings": "x"}',
            "deep nesting": "[" * 100000 + "]" * 100000,
        }
        for what, payload in bad.items():
            with self.subTest(what=what), self.assertRaises(lc.ProtocolError):
                lc.Assembler().feed(payload)

    def test_error_envelope_is_server_error(self):
        asm = lc.Assembler()
        asm.feed(chunk_json({"content": "partial"}))
        with self.assertRaises(lc.ServerError) as cm:
            asm.feed('{"error":{"code":500,"message":"boom","type":"server_error"}}')
        self.assertEqual((cm.exception.code, cm.exception.message), (500, "boom"))
        self.assertIsInstance(cm.exception, lc.LoopError)
        with self.assertRaises(lc.ServerError) as cm:
            lc.Assembler().feed('{"error":{"code":"503","message":"Loading model","type":"unavailable_error"}}')
        self.assertEqual((cm.exception.code, cm.exception.message), (503, "Loading model"))
        with self.assertRaises(lc.ServerError) as cm:
            lc.Assembler().feed('{"error":"plain text"}')
        self.assertEqual((cm.exception.code, cm.exception.message), (None, "plain text"))


# -----------------------------------------------------------------------------------------------------
# Small pure functions
# -----------------------------------------------------------------------------------------------------


class TestParserSmallFunctions(unittest.TestCase):
    def test_retry_after_seconds(self):
        for value, expect in (
            ("120", 120.0),
            ("0", 0.0),
            (" 7 ", 7.0),
            (None, None),
            ("", None),
            ("-1", None),
            ("-0", None),
            ("+5", None),
            ("1.5", None),
            ("abc", None),
            ("5s", None),
            ("\u0663", None),
            ("Wed, 99 Foo 2015", None),
        ):
            with self.subTest(value=value):
                self.assertEqual(lc.parse_retry_after(value, now=1000.0), expect)

    def test_retry_after_http_date(self):
        when = calendar.timegm((2015, 10, 21, 7, 28, 0))
        self.assertEqual(lc.parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=when - 30), 30.0)
        self.assertEqual(lc.parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=when + 30), 0.0)

    def test_error_envelope(self):
        body = b'{"error":{"code":400,"message":"bad thing","type":"invalid_request_error"}}'
        self.assertEqual(
            lc.parse_error_envelope(body),
            ("bad thing", {"error": {"code": 400, "message": "bad thing", "type": "invalid_request_error"}}),
        )
        self.assertEqual(lc.parse_error_envelope(b'{"error":"just text"}'), ("just text", {"error": "just text"}))
        self.assertEqual(lc.parse_error_envelope(b'{"message":"top"}'), ("top", {"message": "top"}))
        self.assertEqual(lc.parse_error_envelope(b"Service Unavailable\n"), ("Service Unavailable", None))
        self.assertEqual(lc.parse_error_envelope(b""), ("(empty body)", None))
        self.assertEqual(lc.parse_error_envelope(b"\xff oops"), ("\ufffd oops", None))

    def test_error_envelope_from_transcripts(self):
        for name, status, message in (
            ("12_unknown_endpoint.raw.txt", 404, "File Not Found"),
            (
                "11_prompt_exceeds_ctx.raw.txt",
                400,
                "request (3024 tokens) exceeds the available context size (1024 tokens), try increasing it",
            ),
            (
                "07_malformed_json.raw.txt",
                400,
                "[json.exception.parse_error.101] parse error at line 1, column 60: "
                "syntax error while parsing object key - unexpected end of input; expected string literal",
            ),
        ):
            raw = load_transcript(name)
            with self.subTest(name=name):
                reader = lc.ResponseReader()
                body = b"".join(reader.feed(raw))
                reader.feed_eof()
                self.assertTrue(reader.done)
                self.assertEqual(reader.head.status, status)
                self.assertEqual(lc.parse_error_envelope(body)[0], message)

    def test_parse_address(self):
        a = lc.parse_address("/run/llama.sock")
        self.assertEqual((a.unix, a.target, a.host, a.text), (True, "/run/llama.sock", "localhost", "/run/llama.sock"))
        a = lc.parse_address("unix:///run/llama.sock")
        self.assertEqual((a.unix, a.target, a.text), (True, "/run/llama.sock", "unix:///run/llama.sock"))
        a = lc.parse_address("http://127.0.0.1:8080")
        self.assertEqual((a.unix, a.target, a.host), (False, ("127.0.0.1", 8080), "127.0.0.1:8080"))
        a = lc.parse_address("http://example:80/")
        self.assertEqual((a.unix, a.target, a.host), (False, ("example", 80), "example"))
        a = lc.parse_address("http://localhost")
        self.assertEqual((a.target, a.host), (("localhost", 80), "localhost"))
        a = lc.parse_address("http://[::1]:8080")
        self.assertEqual((a.target, a.host), (("::1", 8080), "[::1]:8080"))

    def test_parse_address_unix_path_length(self):
        ok = "/" + "s" * (lc.MAX_UNIX_PATH - 1)
        self.assertEqual(lc.parse_address(ok).target, ok)
        self.assertEqual(lc.parse_address("unix://" + ok).target, ok)
        with self.assertRaises(ValueError):
            lc.parse_address(ok + "s")
        with self.assertRaises(ValueError):
            lc.parse_address("unix://" + ok + "s")

    def test_parse_address_refused(self):
        for bad in (
            "",
            "ftp://x",
            "http://",
            "https://",
            "http://h:0",
            "http://h:65536",
            "http://h:x",
            "http://h:8080/a//b",
            "http://h:8080/p?q",
            "http://h:8080/p#f",
            "http://h:8080/a b",
            "http://u@h:1",
            "http://[::1",
            "unix://",
            "/tmp/a\0b",
        ):
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                lc.parse_address(bad)
        with self.assertRaises(TypeError):
            lc.parse_address(8080)

    def test_parse_address_https_and_prefix(self):
        cases = [
            ("https://h", ("h", 443), "h", True, ""),
            ("https://h:8443/", ("h", 8443), "h:8443", True, ""),
            ("HTTPS://h:443/llama/", ("h", 443), "h", True, "/llama"),
            ("http://h:8080/llama", ("h", 8080), "h:8080", False, "/llama"),
            ("http://[::1]:8080/a/b", ("::1", 8080), "[::1]:8080", False, "/a/b"),
        ]
        for text, target, host, tls, prefix in cases:
            with self.subTest(text=text):
                addr = lc.parse_address(text)
                self.assertEqual((addr.target, addr.host, addr.tls, addr.prefix), (target, host, tls, prefix))
        self.assertEqual((lc.parse_address("/run/x.sock").tls, lc.parse_address("/run/x.sock").prefix), (False, ""))


# -----------------------------------------------------------------------------------------------------
# The response pump: a whole streamed response, bytes in, events and decisions out
# -----------------------------------------------------------------------------------------------------


def _pump_run(pieces, limits=None, answers=(), raw_chunks=False):
    """Feed ``pieces`` (then end of file) to a ResponsePump, answering each cap with the next of ``answers``.
    Returns (events, outcome or the error's class and message)."""
    pump = lc.ResponsePump(limits or lc.Limits(thinking_cap=None), raw_chunks)
    events = []
    answers = list(answers)
    try:
        for piece in list(pieces) + [None]:
            events += pump.feed(piece) if piece is not None else pump.feed_eof()
            if pump.failed is not None:
                raise pump.failed
            while pump.cap_due is not None:
                events += pump.capped(answers.pop(0))
                if pump.failed is not None:
                    raise pump.failed
            if pump.outcome is not None:
                break
    except lc.LoopError as exc:
        return events, (type(exc), str(exc))
    outcome = pump.outcome
    if isinstance(outcome, lc.Completion):
        return events, outcome
    return events, ("retry", outcome.reason, outcome.hint, type(outcome.cause))


class TestPump(unittest.TestCase):
    """Every case fed whole, byte by byte and split at every offset gives the same events and outcome."""

    def check(self, data, limits=None, answers=(), every=True):
        whole = _pump_run([data], limits, answers)
        self.assertEqual(_pump_run([data[i : i + 1] for i in range(len(data))], limits, answers), whole)
        cuts = range(1, len(data)) if every else random.Random(5).sample(range(1, len(data)), min(200, len(data) - 1))
        for cut in cuts:
            self.assertEqual(_pump_run([data[:cut], data[cut:]], limits, answers), whole, cut)
        return whole

    def test_a_stream_gives_its_events_and_completion(self):
        events, outcome = self.check(STREAM_HEAD + content_stream(["Hello", " world"]))
        self.assertEqual(events, [lc.Content("Hello"), lc.Content(" world")])
        self.assertEqual(outcome, lc.Completion(CID, MODEL, "Hello world", "", [], "stop", USAGE, TIMINGS, 0, False))

    def test_a_503_is_a_retry_with_its_hint(self):
        body = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
        data = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        self.assertEqual(self.check(data), ([], ("retry", "HTTP 503: Loading model", 2.0, lc.HTTPStatusError)))

    def test_another_status_is_http_status_error_once_the_body_is_in(self):
        body = b'{"error":{"code":400,"message":"the request exceeds the available context size","type":"x"}}'
        data = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        self.assertEqual(
            self.check(data), ([], (lc.HTTPStatusError, "HTTP 400: the request exceeds the available context size"))
        )
        pump = lc.ResponsePump(lc.Limits())
        self.assertEqual(pump.feed(data[:-1]), [])  # the body is not whole yet: no decision
        self.assertIsNone(pump.outcome)
        with self.assertRaises(lc.HTTPStatusError):
            pump.feed(data[-1:])

    def test_an_error_body_over_max_body_is_protocol_error(self):
        data = b"HTTP/1.1 500 Oops\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
        events, (cls, _) = self.check(data, lc.Limits(max_body=99), every=False)
        self.assertEqual((events, cls), ([], lc.ProtocolError))

    def test_a_retryable_error_before_delivery_is_a_retry_after_delivery_a_server_error(self):
        err = '{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
        before = STREAM_HEAD + chunked(sse(chunk_json({"role": "assistant", "content": None})), sse(err))
        self.assertEqual(self.check(before), ([], ("retry", "server error 503: Loading model", None, lc.ServerError)))
        after = STREAM_HEAD + chunked(sse(chunk_json({"content": "a"})), sse(err))
        self.assertEqual(self.check(after), ([lc.Content("a")], (lc.ServerError, "server error 503: Loading model")))

    def test_progress_and_raw_chunks_are_not_delivery(self):
        err = '{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
        progress = chunk_json(
            {"role": "assistant", "content": None},
            extra={"prompt_progress": {"total": 9, "cache": 0, "processed": 4, "time_ms": 12}},
        )
        data = STREAM_HEAD + chunked(sse(progress), sse(err))
        pump = lc.ResponsePump(lc.Limits(), raw_chunks=True)
        events = pump.feed(data)
        self.assertEqual(events, [lc.Chunk(json.loads(progress)), lc.Progress(4, 9, 0, 12.0)])
        self.assertFalse(pump.delivered)
        self.assertEqual(
            (pump.outcome.reason, type(pump.outcome.cause)), ("server error 503: Loading model", lc.ServerError)
        )

    def test_events_before_malformed_framing_come_first(self):
        data = STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))) + b"zz\r\n"
        events, (cls, _) = self.check(data)
        self.assertEqual((events, cls), ([lc.Content("a")], lc.ProtocolError))

    def test_events_before_a_malformed_payload_come_first(self):
        data = STREAM_HEAD + chunked(
            sse(chunk_json({"content": "a"}), chunk_json({"content": "b"})) + b"data: {nope\n\n"
        )
        events, (cls, message) = self.check(data)
        self.assertEqual((events, cls), ([lc.Content("a"), lc.Content("b")], lc.ProtocolError))
        pump = lc.ResponsePump(lc.Limits())
        self.assertEqual(pump.feed(data), [lc.Content("a"), lc.Content("b")])
        self.assertIsInstance(pump.failed, lc.ProtocolError)
        with self.assertRaises(lc.ProtocolError):  # a later call raises it too
            pump.feed(b"")

    def test_the_thinking_cap_pauses_the_pump_until_the_server_answers(self):
        data = STREAM_HEAD + reasoning_stream(4)
        limits = lc.Limits(thinking_cap=2, thinking_overrun=5)
        events, outcome = self.check(data, limits, answers=[True])
        self.assertEqual(
            events,
            [
                lc.Reasoning(" r0"),
                lc.Reasoning(" r1"),
                lc.ThinkingCapped(2),
                lc.Reasoning(" r2"),
                lc.Reasoning(" r3"),
                lc.Content("yes"),
            ],
        )
        self.assertTrue(outcome.thinking_capped)
        self.assertEqual(outcome.reasoning_tokens, 4)
        pump = lc.ResponsePump(limits)
        self.assertEqual(pump.feed(data), [lc.Reasoning(" r0"), lc.Reasoning(" r1")])
        self.assertEqual(pump.cap_due, (CID, 2))
        self.assertEqual(pump.feed(b"more bytes wait"), [])  # nothing moves while the cap is due
        refused = self.check(data, limits, answers=[False])
        self.assertEqual(refused[1][0], lc.ThinkingOverrunError)
        self.assertIn("refused", refused[1][1])
        overrun = self.check(data, lc.Limits(thinking_cap=1, thinking_overrun=2), answers=[True])
        self.assertEqual(overrun[0][-1], lc.Reasoning(" r3"))
        self.assertEqual(overrun[1][0], lc.ThinkingOverrunError)

    def test_a_cap_without_a_completion_id_is_an_overrun(self):
        data = STREAM_HEAD + reasoning_stream(3, cid=None)
        events, (cls, message) = self.check(data, lc.Limits(thinking_cap=2))
        self.assertEqual((events, cls), ([lc.Reasoning(" r0"), lc.Reasoning(" r1")], lc.ThinkingOverrunError))
        self.assertIn("no completion id", message)

    def test_pings_are_not_progress(self):
        pump = lc.ResponsePump(lc.Limits())
        pump.feed(STREAM_HEAD)
        self.assertFalse(pump.progressed)
        pump.feed(chunked(b": ping\n\n"))
        self.assertFalse(pump.progressed)
        self.assertEqual(pump.feed(chunked(sse(chunk_json({"role": "assistant", "content": None})))), [])
        self.assertTrue(pump.progressed)  # a data event, even one that makes no event
        self.assertFalse(pump.delivered)
        pump.feed(chunked(sse(chunk_json({"content": "x"}))))
        self.assertTrue(pump.delivered)

    def test_a_stream_cut_short_is_stream_closed(self):
        full = STREAM_HEAD + content_stream(["a"], finish=None, done=False)
        self.assertEqual(self.check(full)[1][0], lc.StreamClosedError)
        cut = (STREAM_HEAD + content_stream(["a", "b"]))[:-40]
        self.assertEqual(self.check(cut)[1][0], lc.StreamClosedError)


# -----------------------------------------------------------------------------------------------------
# Whole streams: ResponseReader -> SSEDecoder -> Assembler, real transcripts and random splits
# -----------------------------------------------------------------------------------------------------


class _p_Stream:
    """The three parsers in a row, as the client runs them; ``feed`` returns the events."""

    def __init__(self):
        self.reader = lc.ResponseReader()
        self.sse = lc.SSEDecoder(1024 * 1024)
        self.asm = lc.Assembler()
        self.finished = False
        self.events = []  # every event delivered so far, kept when a later payload raises

    def _events(self, items):
        for etype, data in items:
            if self.finished:
                continue
            if etype != "message":
                raise AssertionError("unexpected SSE event type %r" % etype)
            if data == "[DONE]":
                self.finished = True
                continue
            self.events += self.asm.feed(data)

    def feed(self, data):
        for piece in self.reader.feed(data):
            self._events(self.sse.feed(piece))

    def end(self):
        self.reader.feed_eof()
        self._events(self.sse.close())


def _p_stream_outcome(pieces):
    stream = _p_Stream()
    try:
        for piece in pieces:
            stream.feed(piece)
        stream.end()
        return ("ok", stream.reader.head.status, stream.events, stream.asm.completion())
    except lc.StreamClosedError:
        return ("stream closed", stream.reader.head.status, stream.events)
    except lc.ServerError as exc:
        return (
            "server error",
            stream.reader.head.status,
            stream.events,
            exc.code,
            exc.message,
            exc.type,
            stream.asm.reasoning_tokens,
        )


#: Above this size a stream is not split in two at every offset (n^2 bytes parsed) but cut every
#: _p_STRIDE bytes, once for each phase: every offset is still a read boundary, with a piece of _p_STRIDE
#: bytes (several whole events) on either side, for n * _p_STRIDE bytes parsed.
_p_STRIDE = 1024


def _p_stream_splittings(data, every=True, sample=300, seed=7):
    """Whole, byte by byte, at every offset (``every``: in two pieces, or for a stream over 2 * _p_STRIDE
    bytes in pieces of _p_STRIDE bytes cut at each phase) and at ``sample`` seeded offsets in two pieces,
    and at 30 seeded random sets of offsets."""
    yield "whole", [data]
    yield "byte by byte", [data[i : i + 1] for i in range(len(data))]
    if every and len(data) <= 2 * _p_STRIDE:
        offsets = range(1, len(data))
    else:
        offsets = sorted(random.Random(seed).sample(range(1, len(data)), min(sample, len(data) - 1)))
    for i in offsets:
        yield "split at %d" % i, [data[:i], data[i:]]
    if every and len(data) > 2 * _p_STRIDE:
        for phase in range(1, _p_STRIDE + 1):
            cuts = list(range(phase, len(data), _p_STRIDE))
            yield "cut every %d bytes from %d" % (_p_STRIDE, phase), _p_pieces(data, cuts)
    rng = random.Random(seed + 1)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(2, 40)))
        yield "split at %r" % cuts, _p_pieces(data, cuts)


_p_TOOL_ID = "uzrJnRe3BYtgqVs4caaGJ5gmdf9eIOA7"


class TestParserTranscripts(unittest.TestCase):
    def transcript(self, name):
        return load_transcript(name)

    def check(self, raw, expect, every=True):
        for label, pieces in _p_stream_splittings(raw, every):
            got = _p_stream_outcome(pieces)
            if got != expect:
                self.fail("%s: got %s\nexpected %s" % (label, _p_short(got, 2000), _p_short(expect, 2000)))

    def test_04_chat_stream(self):
        raw = self.transcript("04_chat_stream.raw.txt")
        words = [
            "Write",
            " one",
            " sentence",
            " about",
            " the",
            " sea",
            ".<",
            "|",
            "im",
            "_",
            "end",
            "|>",
            "\n",
            "<",
            "|",
            "im",
        ]
        timings = {
            "cache_n": 1,
            "prompt_n": 29,
            "prompt_ms": 76.722,
            "prompt_per_token_ms": 2.6455862068965517,
            "prompt_per_second": 377.98806079090747,
            "predicted_n": 16,
            "predicted_ms": 192.748,
            "predicted_per_token_ms": 12.849866666666665,
            "predicted_per_second": 77.82181916284476,
        }
        completion = lc.Completion(
            id="chatcmpl-LUGNfJTvMyZxeARiBgwpFYfe9BqbpYkn",
            model="models/gemma-3-270m-q4_k_m.gguf",
            content="Write one sentence about the sea.<|im_end|>\n<|im",
            reasoning="",
            tool_calls=[],
            finish_reason="length",
            usage=None,
            timings=timings,
            reasoning_tokens=0,
            thinking_capped=False,
        )
        self.check(raw, ("ok", 200, [lc.Content(w) for w in words], completion))

    def test_06_include_usage(self):
        raw = self.transcript("06_chat_stream_include_usage.raw.txt")
        words = ["Say", " hi", ".<", "|", "im", "_", "end", "|>"]
        completion = lc.Completion(
            id="chatcmpl-joWrtwhUf305cc7PVLBxr68d8BnqhE0q",
            model="models/gemma-3-270m-q4_k_m.gguf",
            content="Say hi.<|im_end|>",
            reasoning="",
            tool_calls=[],
            finish_reason="length",
            usage={
                "completion_tokens": 8,
                "prompt_tokens": 26,
                "total_tokens": 34,
                "prompt_tokens_details": {"cached_tokens": 21},
            },
            timings={
                "cache_n": 21,
                "prompt_n": 5,
                "prompt_ms": 22.313,
                "prompt_per_token_ms": 4.4626,
                "prompt_per_second": 224.08461435037873,
                "predicted_n": 8,
                "predicted_ms": 84.958,
                "predicted_per_token_ms": 12.136857142857142,
                "predicted_per_second": 82.39365333458886,
            },
            reasoning_tokens=0,
            thinking_capped=False,
        )
        self.check(raw, ("ok", 200, [lc.Content(w) for w in words], completion))

    def test_14_reasoning(self):
        raw = self.transcript("14_reasoning_grammar.raw.txt")
        thoughts = ["is"] + [" the", " sky", " blue", " is"] * 18 + [" the", " sky", " "]
        answer = ["the", " ", "answer", " is", " yes"]
        self.assertEqual(len(thoughts), 76)
        completion = lc.Completion(
            id="chatcmpl-JIfSrDp0Zx7SYO4w8iGypUzGsPY8HdtD",
            model="models/gemma-3-270m-q4_k_m.gguf",
            content="the answer is yes",
            reasoning="is" + " the sky blue is" * 18 + " the sky ",
            tool_calls=[],
            finish_reason="stop",
            usage=None,
            timings={
                "cache_n": 1,
                "prompt_n": 32,
                "prompt_ms": 100.071,
                "prompt_per_token_ms": 3.12721875,
                "prompt_per_second": 319.77296119754976,
                "predicted_n": 88,
                "predicted_ms": 1410.771,
                "predicted_per_token_ms": 16.215758620689655,
                "predicted_per_second": 61.66840684987146,
            },
            reasoning_tokens=76,
            thinking_capped=False,
        )
        events = [lc.Reasoning(t) for t in thoughts] + [lc.Content(t) for t in answer]
        self.check(raw, ("ok", 200, events, completion), every=False)

    def test_17_midstream_error(self):
        raw = self.transcript("17_midstream_error.raw.txt")
        events = [lc.Reasoning(t) for t in ("is", " the", " sky", " blue", " is")]
        self.check(
            raw,
            (
                "server error",
                200,
                events,
                500,
                "got exception: Unexpected empty grammar stack after accepting piece: <unused24> (30)",
                "server_error",
                5,
            ),
        )

    def test_18_tool_call(self):
        raw = self.transcript("18_tools_required_stream.raw.txt")
        events = [lc.ToolCall(0, _p_TOOL_ID, "get_weather", "{")] + [
            lc.ToolCall(0, None, None, frag) for frag in ('"', "city", '":', ' "', "Paris", ' "', "}")
        ]
        completion = lc.Completion(
            id="chatcmpl-aXwtKQdGgvz4IeWD184XVrTmqqlptIts",
            model="models/gemma-3-270m-q4_k_m.gguf",
            content="",
            reasoning="",
            tool_calls=[lc.ToolCallResult(_p_TOOL_ID, "get_weather", '{"city": "Paris "}')],
            finish_reason="tool_calls",
            usage=None,
            timings={
                "cache_n": 1,
                "prompt_n": 137,
                "prompt_ms": 238.581,
                "prompt_per_token_ms": 1.7414671532846715,
                "prompt_per_second": 574.2284590977489,
                "predicted_n": 21,
                "predicted_ms": 623.895,
                "predicted_per_token_ms": 31.19475,
                "predicted_per_second": 32.056676203527836,
            },
            reasoning_tokens=0,
            thinking_capped=False,
        )
        self.check(raw, ("ok", 200, events, completion))

    def test_04_cut_before_finish_is_stream_closed(self):
        raw = self.transcript("04_chat_stream.raw.txt")
        cut = raw.index(b'"finish_reason":"length"')
        cut = raw.rindex(b"\r\n", 0, cut - 20)  # end of the chunk before the finish chunk
        for end in (cut, cut + 2):
            stream = _p_Stream()
            stream.feed(raw[:end])
            self.assertEqual(len(stream.events), 16)
            with self.assertRaises(lc.StreamClosedError):
                stream.reader.feed_eof()
            with self.assertRaises(lc.StreamClosedError):
                stream.asm.completion()

    def test_04_done_without_final_zero_chunk(self):
        raw = self.transcript("04_chat_stream.raw.txt")
        stream = _p_Stream()
        stream.feed(raw[: raw.index(b"data: [DONE]") + len(b"data: [DONE]\n\n")])
        self.assertTrue(stream.finished)
        self.assertEqual(len(stream.events), 16)
        self.assertEqual(stream.asm.completion().finish_reason, "length")


def _p_raw_chunk(delta, finish=None):
    """A chunk payload with raw UTF-8 (llama-server's own JSON writer does not escape non-ASCII)."""
    return json.dumps(
        {
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
            "id": CID,
            "model": MODEL,
            "object": "chat.completion.chunk",
        },
        separators=(",", ":"),
        ensure_ascii=False,
    )


def _p_sse_stream(payloads, newline, rng):
    """Chunked SSE with ``newline`` as line end, events grouped into HTTP chunks at random, ping comments."""
    events = []
    for payload in payloads:
        text = b"data: " + payload.encode() + newline + newline
        if rng.random() < 0.2:
            text = b": ping" + newline + newline + text
        events.append(text)
    bodies, i = [], 0
    while i < len(events):
        n = rng.randint(1, 3)
        bodies.append(b"".join(events[i : i + n]))
        i += n
    return chunked(*bodies) + b"0\r\n\r\n"


class TestParserRandomSplits(unittest.TestCase):
    words = [
        "Hello",
        ",",
        " w\u00f6rld",
        " \u20ac",
        " \U0001f30a",
        "\n",
        "data: fake\n\n",
        "\r",
        "\u4e2d\u6587",
        ":",
        " ",
        "end.",
    ]

    def outcomes(self, data, seed, trials):
        rng = random.Random(seed)
        whole = _p_stream_outcome([data])
        for trial in range(trials):
            cuts = sorted(set(rng.randint(1, len(data) - 1) for _ in range(rng.randint(1, 60))))
            got = _p_stream_outcome(_p_pieces(data, cuts))
            if got != whole:
                self.fail(
                    "seed %d trial %d cuts %r: got %s, expected %s"
                    % (seed, trial, cuts, _p_short(got, 2000), _p_short(whole, 2000))
                )
        return whole

    def test_content_stream_random_splits(self):
        data = STREAM_HEAD + content_stream(self.words)
        whole = self.outcomes(data, 1, 300)
        completion = lc.Completion(
            id=CID,
            model=MODEL,
            content="".join(self.words),
            reasoning="",
            tool_calls=[],
            finish_reason="stop",
            usage=USAGE,
            timings=TIMINGS,
        )
        self.assertEqual(whole, ("ok", 200, [lc.Content(w) for w in self.words], completion))

    def test_done_without_finish_reason_random_splits(self):
        data = STREAM_HEAD + content_stream(["a", "b"], finish=None)
        whole = self.outcomes(data, 3, 100)
        self.assertEqual(whole, ("stream closed", 200, [lc.Content("a"), lc.Content("b")]))

    def test_raw_utf8_any_line_end_random_splits(self):
        payloads = [_p_raw_chunk({"role": "assistant", "content": None})]
        payloads += [_p_raw_chunk({"reasoning_content": w}) for w in ("pens\u00e9e", " \U0001f914")]
        payloads += [_p_raw_chunk({"content": w}) for w in self.words]
        payloads += [_p_raw_chunk({}, "stop"), "[DONE]"]
        for seed, newline in enumerate((b"\n", b"\r\n", b"\r")):
            rng = random.Random(100 + seed)
            data = STREAM_HEAD + _p_sse_stream(payloads, newline, rng)
            whole = self.outcomes(data, 200 + seed, 150)
            completion = lc.Completion(
                id=CID,
                model=MODEL,
                content="".join(self.words),
                reasoning="pens\u00e9e \U0001f914",
                tool_calls=[],
                finish_reason="stop",
                usage=None,
                timings=None,
                reasoning_tokens=2,
            )
            events = [lc.Reasoning("pens\u00e9e"), lc.Reasoning(" \U0001f914")] + [lc.Content(w) for w in self.words]
            self.assertEqual(whole, ("ok", 200, events, completion), "line end %r" % newline)


# -----------------------------------------------------------------------------------------------------
# RFC 9112 as a user agent reads a head: line ends, obsolete folding, control bytes, caps at every split
# -----------------------------------------------------------------------------------------------------


def _p_random_head(rng):
    """A head block (the last line's LF left out, as ResponseReader hands it over): mostly plain, sometimes
    with the bytes and shapes the plain pattern must leave to the line-by-line parser."""
    pick = rng.choice
    odd = [b"\x00", b"\r", b"\x0b", b"\x0c", b"\t", b" ", b":", b"\x7f", b"\xe9", b"\x01", b"(", b"@"]

    def text(alphabet, n):
        return b"".join(pick(alphabet) for _ in range(rng.randint(0, n)))

    plain = [bytes([c]) for c in b"abcXYZ019-_.!~"]
    odds = 0.0 if rng.random() < 0.4 else 0.1  # how often each part is not plain
    status = pick([b"HTTP/1.1", b"HTTP/1.0"]) if rng.random() >= odds else pick([b"HTTP/2", b"http/1.1", b"HTTP/1.1 "])
    status += b" " + (pick([b"200", b"503", b"101"]) if rng.random() >= odds else pick([b"20", b"2000", b"2x0"]))
    status += (
        pick([b"", b" ", b" OK", b"  OK", b" Not Found "]) if rng.random() >= odds else b" " + text(plain + odd, 6)
    )
    lines = [status]
    for _ in range(rng.randint(0, 6)):
        name = text(plain, 8) or b"x" if rng.random() >= odds else text(plain + odd, 6)
        value = text(plain + [b" ", b"\t", b"\xe9"], 12) if rng.random() >= odds else text(plain + odd, 8)
        lines.append(name + (pick([b":", b": "]) if rng.random() >= odds else pick([b" :", b""])) + value)
    if rng.random() < odds:
        lines.insert(rng.randint(1, len(lines)), pick([b" folded", b"\tfolded", b""]))
    ends = [pick([b"\r\n", b"\n"]) if rng.random() < odds else b"\r\n" for _ in lines]
    block = b"".join(line + end for line, end in zip(lines, ends))
    return block[:-1]  # the LF of the last line is not part of the block


class TestParserHeadPaths(unittest.TestCase):
    """``_parse_head`` splits a plain head at once; it must answer what the line-by-line parser answers."""

    @staticmethod
    def outcome(parse, block, max_headers):
        try:
            head = parse(block, max_headers)
        except lc.ProtocolError as exc:
            return ("raised", str(exc))
        return (head.version, head.status, head.reason, head.headers)

    def test_the_plain_path_and_the_line_parser_agree(self):
        rng = random.Random(20261201)
        plain = 0
        for trial in range(20000):
            block = _p_random_head(rng)
            max_headers = rng.choice([100, 3])
            with self.subTest(trial=trial, block=block):
                got = self.outcome(lc._parse_head, block, max_headers)
                self.assertEqual(got, self.outcome(lc._parse_lines, block, max_headers))
                plain += lc._PLAIN_HEAD.match(block) is not None
        self.assertGreater(plain, 2000)  # the plain path ran often
        self.assertLess(plain, 18000)  # and the line parser too

    def test_real_heads_take_the_plain_path(self):
        for name in sorted(os.listdir(TRANSCRIPTS)):
            with open(os.path.join(TRANSCRIPTS, name), "rb") as f:
                raw = f.read()
            if b"<<< RESPONSE" not in raw:
                continue
            raw = load_transcript(name)
            start = raw.find(b"HTTP/1.")
            end = raw.find(b"\r\n\r\n", start)
            if start < 0 or end < 0:
                continue
            block = raw[start : end + 1]
            with self.subTest(name=name):
                self.assertIsNotNone(lc._PLAIN_HEAD.match(block), block[:200])
                self.assertEqual(self.outcome(lc._parse_head, block, 100), self.outcome(lc._parse_lines, block, 100))


class TestParserHeadRules(unittest.TestCase):
    def check(self, data, expect=None, reader=lambda: lc.ResponseReader(), **kw):
        kw.setdefault("end", _p_eof)
        if kw.get("raises") is None:
            kw.setdefault("state", _p_reader_state)
        return _p_check_feeds(self, reader, data, expect, join=True, **kw)

    def test_head_ends_at_the_first_empty_line_whatever_the_line_ends(self):
        ends = (b"\r\n", b"\n")
        headers = [("x-a", "1"), ("content-length", "2")]
        for status_end in ends:
            for a_end in ends:
                for cl_end in ends:
                    for blank in ends:
                        data = b"HTTP/1.1 200 OK" + status_end + b"X-A: 1" + a_end + b"Content-Length: 2" + cl_end
                        data += blank + b"ok"
                        with self.subTest(data=data):
                            self.check(data, (b"ok", ("HTTP/1.1", 200, "OK", headers, True)), pairs_upto=0)

    def test_crlf_then_lf_and_lf_then_crlf(self):
        state = ("HTTP/1.1", 200, "OK", [("content-length", "3")], True)
        self.check(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\nabc", (b"abc", state))
        self.check(b"HTTP/1.1 200 OK\r\nContent-Length: 3\n\r\nabc", (b"abc", state))
        # the body starts right after the empty line: a CR or LF there is body
        self.check(b"HTTP/1.1 200 OK\r\nContent-Length: 3\n\r\n\r\nx", (b"\r\nx", state))
        self.check(b"HTTP/1.1 200 OK\nContent-Length: 3\n\n\nab", (b"\nab", state))
        # an empty head (no header line): the status line's end, then the empty line
        for end in (b"\r\n\r\n", b"\r\n\n", b"\n\r\n", b"\n\n"):
            with self.subTest(end=end):
                self.check(b"HTTP/1.0 200 OK" + end + b"xy", (b"xy", ("HTTP/1.0", 200, "OK", [], True)))

    def test_interim_response_ended_by_mixed_line_ends(self):
        data = b"HTTP/1.1 100 Continue\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\nz"
        self.check(data, (b"z", ("HTTP/1.1", 200, "OK", [("content-length", "1")], True)), pairs_upto=0)

    def test_obsolete_folding_unfolded_with_one_space(self):
        data = (
            b"HTTP/1.1 200 OK\r\nX-A: one\r\n  two \r\n\tthree\r\nX-Empty:\r\n folded\r\n"
            b"X-Blank: b\r\n \t \r\nContent-Length: 0\r\n\r\n"
        )
        headers = [("x-a", "one two three"), ("x-empty", "folded"), ("x-blank", "b"), ("content-length", "0")]
        self.check(data, (b"", ("HTTP/1.1", 200, "OK", headers, True)), pairs_upto=0)
        self.check(
            b"HTTP/1.1 200 OK\nX-A: a\n\tb\nContent-Length: 0\n\n",
            (b"", ("HTTP/1.1", 200, "OK", [("x-a", "a b"), ("content-length", "0")], True)),
        )

    def test_folded_line_right_after_the_status_line(self):
        for fold in (b" X-A: a", b"\tX-A: a", b" "):
            data = b"HTTP/1.1 200 OK\r\n" + fold + b"\r\nContent-Length: 0\r\n\r\n"
            with self.subTest(fold=fold):
                self.check(data, raises=lc.ProtocolError, at=(17, len(data) - 1), pairs_upto=0)

    def test_folded_lines_count_as_header_lines(self):
        def head(n):  # the status line and n header lines, one of them folded
            return b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(n - 2))

        data = head(100) + b"Content-Length: 0\r\n\r\n"
        self.check(data, raises=lc.ProtocolError, sample=100, hot=(len(head(100)),))
        data = head(99) + b"Content-Length: 0\r\n\r\n"
        headers = [("x-a", "a b")] + [("x-%d" % i, "v") for i in range(97)] + [("content-length", "0")]
        self.check(data, (b"", ("HTTP/1.1", 200, "OK", headers, True)), sample=100, hot=(len(head(99)),))

    def test_nul_bare_cr_ff_vt_refused_in_the_status_line(self):
        for bad in (b"\x00", b"\r", b"\x0c", b"\x0b"):
            for line in (b"HTTP/1.1 200 O" + bad + b"K", b"HTTP/1.1 200 OK" + bad, b"HTTP/1.1 200" + bad):
                data = line + b"\r\nContent-Length: 0\r\n\r\n"
                with self.subTest(line=line):
                    # refused as soon as the status line is whole, before the head ends
                    self.check(data, raises=lc.ProtocolError, at=len(line) + 1, pairs_upto=0)

    def test_nul_bare_cr_ff_vt_refused_in_a_header(self):
        for bad in (b"\x00", b"\r", b"\x0c", b"\x0b"):
            for line in (b"X-A: a" + bad + b"b", b"X-A: " + bad, b"X-A" + bad + b": a", b"X-A: a" + bad):
                data = b"HTTP/1.1 200 OK\r\n" + line + b"\r\nContent-Length: 0\r\n\r\n"
                with self.subTest(line=line):
                    self.check(data, raises=lc.ProtocolError, at=(17, len(data) - 1), pairs_upto=0)
        # a CR before CR LF is a bare CR too, even on the last line whichever blank line follows, and a line
        # holding only CR CR LF is no blank line
        for end in (b"\r\n\r\n", b"\r\n\n"):
            data = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r" + end
            with self.subTest(end=end):
                self.check(data, raises=lc.ProtocolError, at=(17, len(data) - 1))
        data = b"HTTP/1.1 200 OK\r\nX-A: a\r\n\r\r\nContent-Length: 0\r\n\r\n"
        self.check(data, raises=lc.ProtocolError, at=(17, len(data) - 1), pairs_upto=0)

    def test_other_control_bytes_tolerated_in_reason_and_values(self):
        data = b"HTTP/1.1 200 O\x01K\x7f\r\nSet-Cookie: a=\x1b[0m\x01\x7f; b\tc\r\nContent-Length: 0\r\n\r\n"
        headers = [("set-cookie", "a=\x1b[0m\x01\x7f; b\tc"), ("content-length", "0")]
        self.check(data, (b"", ("HTTP/1.1", 200, "O\x01K\x7f", headers, True)), pairs_upto=0)
        # and in the obsolete folding of a value
        data = b"HTTP/1.1 200 OK\r\nX-A: a\r\n \x01b\r\n\r\n"
        self.check(data, (b"", ("HTTP/1.1", 200, "OK", [("x-a", "a \x01b")], False)), end=None, pairs_upto=0)

    def test_cap_is_exact_whatever_the_line_ends(self):
        block = b"HTTP/1.1 200 OK\r\nContent-Length: 0"  # 34 bytes: the cap counts the head without its line ends
        state = ("HTTP/1.1", 200, "OK", [("content-length", "0")], True)
        for end in (b"\r\n\r\n", b"\r\n\n", b"\n\r\n", b"\n\n"):
            with self.subTest(end=end):
                self.check(block + end, (b"", state), reader=lambda: lc.ResponseReader(max_head=34))
                self.check(block + end, raises=lc.ProtocolError, at=33, reader=lambda: lc.ResponseReader(max_head=33))
        lf_block = b"HTTP/1.1 200 OK\nContent-Length: 0"  # 33 bytes
        for end in (b"\r\n\r\n", b"\n\r\n", b"\n\n"):
            with self.subTest(end=end):
                self.check(
                    lf_block + end, (b"", state), reader=lambda: lc.ResponseReader(max_head=33), state=_p_reader_state
                )
                self.check(
                    lf_block + end, raises=lc.ProtocolError, at=32, reader=lambda: lc.ResponseReader(max_head=32)
                )
        # unfinished at the cap: a line end may follow, anything else may not
        for tail in (b"\r\r", b"\rx", b"\r\nx", b"\n\rx", b"\r\n\rx", b"x"):
            with self.subTest(tail=tail):
                self.check(block + tail, raises=lc.ProtocolError, reader=lambda: lc.ResponseReader(max_head=34))

    def test_100_header_lines_with_bare_lf_ok_101_refused(self):
        def head(n, end):
            return b"HTTP/1.1 200 OK" + end + b"".join(b"X-H%d: %d%s" % (i, i, end) for i in range(n))

        headers = [("x-h%d" % i, str(i)) for i in range(100)]
        for end in (b"\n", b"\r\n"):
            with self.subTest(end=end):
                data = head(100, end) + b"\r\n"
                self.check(data, (b"", ("HTTP/1.1", 200, "OK", headers, False)), end=None, sample=100, hot=(len(data),))
                first = len(head(100, end))  # the 101st header line starts here
                self.check(head(101, end) + end, raises=lc.ProtocolError, at=(first, len(head(101, end))), sample=100)
                self.check(head(101, end) + b"X", raises=lc.ProtocolError, at=(first, len(head(101, end))), sample=100)


# -----------------------------------------------------------------------------------------------------
# Whole responses through ResponseReader -> SSEDecoder -> Assembler, as the client runs them
# -----------------------------------------------------------------------------------------------------


class _p_Pipe:
    """ResponseReader -> SSEDecoder -> Assembler as the client runs them: what each read produced is
    delivered, then an error the reader or the decoder kept in ``failed`` is raised."""

    def __init__(self, raw_chunks=False, max_line=1024 * 1024, max_body=None):
        self.reader = lc.ResponseReader(max_body=max_body)
        self.sse = lc.SSEDecoder(max_line)
        self.asm = lc.Assembler(raw_chunks=raw_chunks)
        self.events = []
        self.done = None  # the Completion, from [DONE] or the end of the stream

    def _payloads(self, items):
        for kind, data in items:
            if self.done is not None:
                return
            if kind != "message":
                raise AssertionError("unexpected SSE event type %r" % kind)
            if data == "[DONE]":
                self.done = self.asm.completion()
                return
            self.events += self.asm.feed(data)

    def feed(self, data):
        if self.done is not None:
            return
        for piece in self.reader.feed(data):
            self._payloads(self.sse.feed(piece))
            if self.sse.failed is not None:
                raise self.sse.failed
        if self.reader.failed is not None:
            raise self.reader.failed

    def end(self):
        if self.done is None:
            self.reader.feed_eof()
            self._payloads(self.sse.close())
        if self.done is None:
            self.done = self.asm.completion()


def _p_pipe_outcome(pieces, **kw):
    """("ok", events, completion) or ("raised", events delivered first, error class)."""
    pipe = _p_Pipe(**kw)
    try:
        for piece in pieces:
            pipe.feed(piece)
        pipe.end()
    except lc.LoopError as exc:
        return ("raised", pipe.events, type(exc))
    return ("ok", pipe.events, pipe.done)


def _p_check_pipe(test, data, expect, every=True, sample=300, **kw):
    """Every way of splitting ``data`` (whole, byte by byte, at each offset, at random sets of offsets) gives
    ``expect`` exactly."""
    tried, boundaries = 0, set()
    for label, pieces in _p_stream_splittings(data, every, sample):
        got = _p_pipe_outcome(pieces, **kw)
        tried += 1
        if got != expect:
            test.fail("%s: got %s\nexpected %s" % (label, _p_short(got, 2000), _p_short(expect, 2000)))
        if label != "byte by byte":
            boundaries.update(itertools.accumulate(len(piece) for piece in pieces[:-1]))
    return tried, boundaries


# -----------------------------------------------------------------------------------------------------
# Deliver before failing: what a read decoded before malformed bytes is delivered, then the error, however
# the bytes are split between reads
# -----------------------------------------------------------------------------------------------------


class TestParserDeliverBeforeFailing(unittest.TestCase):
    def test_failed_is_none_normally(self):
        for parser in (lc.ResponseReader(), lc.ChunkedDecoder(), lc.SSEDecoder()):
            self.assertIsNone(parser.failed)
        reader = lc.ResponseReader()
        reader.feed(STREAM_HEAD + content_stream(["a"]))
        self.assertIsNone(reader.failed)
        reader.feed_eof()

    def test_chunked_payload_before_a_malformed_size_then_the_error(self):
        data = b"3\r\nabc\r\n2\r\nde\r\nzz\r\n0\r\n\r\n"
        _p_check_feeds(self, lc.ChunkedDecoder, data, raises=lc.ProtocolError, at=(15, 18), before=b"abcde", join=True)
        dec = lc.ChunkedDecoder()
        self.assertEqual(dec.feed(data), [b"abc", b"de"])
        error = dec.failed
        self.assertIsInstance(error, lc.ProtocolError)
        for call in (lambda: dec.feed(b"1\r\nx\r\n"), dec.feed_eof, lambda: dec.feed(b"")):
            with self.assertRaises(lc.ProtocolError) as cm:
                call()
            self.assertIs(cm.exception, error)
        # a read that produced nothing raises at once, and keeps the error too
        dec = lc.ChunkedDecoder()
        with self.assertRaises(lc.ProtocolError):
            dec.feed(b"zz\r\n")
        self.assertIsInstance(dec.failed, lc.ProtocolError)

    def test_chunked_partial_data_then_missing_crlf(self):
        data = b"5\r\nhello\r\n6\r\n worldXX0\r\n\r\n"
        _p_check_feeds(self, lc.ChunkedDecoder, data, raises=lc.ProtocolError, at=19, before=b"hello world", join=True)

    def test_reader_body_before_malformed_framing(self):
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        data = head + b"3\r\nabc\r\n3\r\ndefX\r\n"
        _p_check_feeds(
            self, lc.ResponseReader, data, raises=lc.ProtocolError, at=len(data) - 3, before=b"abcdef", join=True
        )
        reader = lc.ResponseReader()
        self.assertEqual(reader.feed(data), [b"abc", b"def"])
        self.assertEqual(reader.head.status, 200)
        self.assertIsInstance(reader.failed, lc.ProtocolError)
        with self.assertRaises(lc.ProtocolError) as cm:
            reader.feed_eof()
        self.assertIs(cm.exception, reader.failed)

    def test_reader_max_body_delivers_what_fits(self):
        ten = lambda: lc.ResponseReader(max_body=10)
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        data = head + chunked(b"01234", b"56789AB") + b"0\r\n\r\n"
        eleventh = len(head) + len(chunked(b"01234")) + 3 + 5
        _p_check_feeds(self, ten, data, raises=lc.ProtocolError, at=eleventh, before=b"0123456789", join=True)
        data = b"HTTP/1.0 200 OK\r\n\r\n0123456789ABC"
        _p_check_feeds(self, ten, data, raises=lc.ProtocolError, at=len(data) - 3, before=b"0123456789", join=True)

    def test_sse_events_before_an_overlong_line(self):
        data = b"data: a\n\ndata: b\r\n\r\n: " + b"p" * 20 + b"\ndata: c\n\n"
        _p_check_feeds(
            self,
            _p_sse(16),
            data,
            raises=lc.ProtocolError,
            at=20 + 16,  # the 17th byte of the comment line
            before=[("message", "a"), ("message", "b")],
            end=_p_close,
        )
        dec = lc.SSEDecoder(16)
        self.assertEqual(dec.feed(data), [("message", "a"), ("message", "b")])
        self.assertIsInstance(dec.failed, lc.ProtocolError)
        with self.assertRaises(lc.ProtocolError) as cm:
            dec.close()
        self.assertIs(cm.exception, dec.failed)

    def test_sse_events_before_an_overlong_event(self):
        data = b"data: a\n\ndata:" + b"x" * 10 + b"\ndata:" + b"y" * 10 + b"\n\n"
        _p_check_feeds(self, _p_sse(16), data, raises=lc.ProtocolError, before=[("message", "a")], end=_p_close)

    def test_every_later_call_raises_the_kept_error(self):
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        cases = (
            (lc.ResponseReader, head + b"1\r\na\r\nzz\r\n", [b"a"], ("feed", "feed_eof")),
            (lc.ChunkedDecoder, b"1\r\na\r\nzz\r\n", [b"a"], ("feed", "feed_eof")),
            (lambda: lc.SSEDecoder(16), b"data: a\n\n:" + b"c" * 20, [("message", "a")], ("feed", "close")),
        )
        for make, data, before, calls in cases:
            parser = make()
            with self.subTest(parser=type(parser).__name__):
                self.assertEqual(parser.feed(data), before)
                error = parser.failed
                self.assertIsInstance(error, lc.ProtocolError)
                for name in calls * 2:
                    with self.assertRaises(lc.ProtocolError) as cm:
                        getattr(parser, name)(b"1\r\nb\r\n") if name == "feed" else getattr(parser, name)()
                    self.assertIs(cm.exception, error)

    def test_sse_error_line_over_the_event_cap_at_close(self):
        # a held CR ends the legacy error line only at close(): the event passes max_line there
        data = b"data:" + b"a" * 10 + b"\nerror:" + b"b" * 10 + b"\r"
        _p_check_feeds(self, _p_sse(16), data, raises=lc.ProtocolError, at="eof", before=[], end=_p_close)
        dec = lc.SSEDecoder(16)
        self.assertEqual(dec.feed(data), [])
        with self.assertRaises(lc.ProtocolError):
            dec.close()
        self.assertIsInstance(dec.failed, lc.ProtocolError)

    def _stream(self, tail):
        words = ["Hel", "lo", " there"]
        body = chunked(sse(chunk_json({"role": "assistant", "content": None})))
        body += chunked(*(sse(chunk_json({"content": w})) for w in words))
        return STREAM_HEAD + body + tail, [lc.Content(w) for w in words]

    def test_stream_events_then_malformed_chunk_size(self):
        data, events = self._stream(b"zz\r\n" + chunked(sse(chunk_json({}, "stop"))) + b"0\r\n\r\n")
        _p_check_pipe(self, data, ("raised", events, lc.ProtocolError))

    def test_stream_events_then_chunk_data_without_crlf(self):
        data, events = self._stream(b"%x\r\n%sXX0\r\n\r\n" % (len(sse("x")), sse("x")))
        _p_check_pipe(self, data, ("raised", events, lc.ProtocolError))

    def test_stream_events_then_overlong_sse_line(self):
        data, events = self._stream(chunked(b"data: " + b"x" * 2000) + b"0\r\n\r\n")
        _p_check_pipe(self, data, ("raised", events, lc.ProtocolError), max_line=1024)

    def test_stream_events_then_bad_json(self):
        data, events = self._stream(chunked(b'data: {"choices": [\n\n') + b"0\r\n\r\n")
        _p_check_pipe(self, data, ("raised", events, lc.ProtocolError))

    def test_stream_events_then_cut_mid_chunk(self):
        data, events = self._stream(b"40\r\ndata: ")
        _p_check_pipe(self, data, ("raised", events, lc.StreamClosedError))


# -----------------------------------------------------------------------------------------------------
# Everything llama-server streams: choices, log probabilities, prompt progress, raw chunks.  Synthetic
# streams in the real server's shape, fed through ResponseReader -> SSEDecoder -> Assembler whole, byte by
# byte, split at every offset and at random sets of offsets.
# -----------------------------------------------------------------------------------------------------


def _p_choice(index=0, delta=None, finish=None, logprobs=None):
    """One entry of ``choices`` in llama-server's key order; ``index=None`` leaves the index out."""
    choice = {"finish_reason": finish}
    if index is not None:
        choice["index"] = index
    choice["delta"] = {} if delta is None else delta
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return choice


def _p_chunk(*choices, extra=None):
    doc = {
        "choices": list(choices),
        "created": 1796072537,
        "id": CID,
        "model": MODEL,
        "system_fingerprint": "b0-unknown",
        "object": "chat.completion.chunk",
    }
    doc.update(extra or {})
    return json.dumps(doc, separators=(",", ":"))


def _p_role(index=0, extra=None):
    return _p_chunk(_p_choice(index, {"role": "assistant", "content": None}), extra=extra)


def _p_text(index, text, what="content", logprobs=None):
    return _p_chunk(_p_choice(index, {what: text}, logprobs=logprobs))


def _p_finish(index, reason="stop", extra=None):
    return _p_chunk(_p_choice(index, {}, reason), extra=extra)


def _p_usage(extra=None):
    return _p_chunk(extra=dict({"usage": USAGE, "timings": TIMINGS}, **(extra or {})))


def _p_progress(processed, total=230, cache=0, time_ms=0, index=0):
    progress = {"total": total, "cache": cache, "processed": processed, "time_ms": time_ms}
    return _p_role(index, extra={"prompt_progress": progress})


def _p_http(payloads, done=True):
    """A whole streamed response: the payloads as SSE events grouped 1, 2, 3, 1, ... per HTTP chunk."""
    events = [sse(p) for p in payloads] + ([b"data: [DONE]\n\n"] if done else [])
    bodies, i, n = [], 0, 0
    while i < len(events):
        n = n % 3 + 1
        bodies.append(b"".join(events[i : i + n]))
        i += n
    return STREAM_HEAD + chunked(*bodies) + b"0\r\n\r\n"


def _p_completion(choices, usage=USAGE, timings=TIMINGS, reasoning_tokens=0):
    first = choices[0]
    return lc.Completion(
        id=CID,
        model=MODEL,
        content=first.content,
        reasoning=first.reasoning,
        tool_calls=first.tool_calls,
        finish_reason=first.finish_reason,
        usage=usage,
        timings=timings,
        reasoning_tokens=reasoning_tokens,
        choices=choices,
    )


def _p_entry(tid, token, logprob, *tops):
    """A log-probability entry as llama-server writes it: ``tops`` are (id, token, logprob)."""
    entry = {"id": tid, "token": token, "bytes": list(token.encode()), "logprob": logprob}
    entry["top_logprobs"] = [{"id": i, "token": t, "bytes": list(t.encode()), "logprob": p} for i, t, p in tops]
    return entry


class TestParserChoices(unittest.TestCase):
    def test_two_interleaved_choices_tool_calls_in_one(self):
        payloads = [
            _p_role(0),
            _p_role(1),
            _p_text(0, "It is"),
            _p_chunk(_p_choice(1, {"tool_calls": [_p_tool(0, "call-A", "get_weather", '{"ci')]})),
            _p_text(0, " sunny"),
            _p_chunk(_p_choice(1, {"tool_calls": [_p_tool(0, None, None, 'ty": "Paris"}')]})),
            _p_chunk(_p_choice(1, {"tool_calls": [_p_tool(1, "call-B", "get_time", "{}")]})),
            _p_finish(0, "stop"),
            _p_finish(1, "tool_calls"),
            _p_usage(),
        ]
        events = [
            lc.Content("It is", 0),
            lc.ToolCall(0, "call-A", "get_weather", '{"ci', 1),
            lc.Content(" sunny", 0),
            lc.ToolCall(0, None, None, 'ty": "Paris"}', 1),
            lc.ToolCall(1, "call-B", "get_time", "{}", 1),
        ]
        calls = [
            lc.ToolCallResult("call-A", "get_weather", '{"city": "Paris"}'),
            lc.ToolCallResult("call-B", "get_time", "{}"),
        ]
        choices = (
            lc.Choice(0, "It is sunny", "", [], "stop", None),
            lc.Choice(1, "", "", calls, "tool_calls", None),
        )
        _p_check_pipe(self, _p_http(payloads), ("ok", events, _p_completion(choices)))

    def test_three_interleaved_choices_one_finishes_early(self):
        payloads = [_p_role(0), _p_role(1), _p_role(2)]
        payloads += [_p_text(1, "hm", "reasoning_content"), _p_text(2, "No."), _p_finish(2, "stop")]
        payloads += [_p_text(0, "Yes"), _p_text(1, "Maybe"), _p_text(0, ", yes."), _p_text(1, " not.")]
        payloads += [_p_finish(1, "length"), _p_finish(0, "stop")]
        events = [
            lc.Reasoning("hm", 1),
            lc.Content("No.", 2),
            lc.Content("Yes", 0),
            lc.Content("Maybe", 1),
            lc.Content(", yes.", 0),
            lc.Content(" not.", 1),
        ]
        choices = (
            lc.Choice(0, "Yes, yes.", "", [], "stop", None),
            lc.Choice(1, "Maybe not.", "hm", [], "length", None),
            lc.Choice(2, "No.", "", [], "stop", None),
        )
        done = _p_completion(choices, usage=None, timings=None, reasoning_tokens=1)
        _p_check_pipe(self, _p_http(payloads), ("ok", events, done))
        # also when the last finish is followed by nothing at all: a clean end after every finish_reason
        _p_check_pipe(self, _p_http(payloads, done=False), ("ok", events, done), every=False)

    def test_two_choices_in_one_chunk_never_mix(self):
        both = _p_chunk(
            _p_choice(1, {"content": "b", "tool_calls": [_p_tool(0, "y", "g", "[")]}),
            _p_choice(0, {"content": "a", "tool_calls": [_p_tool(0, "x", "f", "{")]}),
        )
        ends = _p_chunk(_p_choice(0, {"tool_calls": [_p_tool(0, args="}")]}, "tool_calls"), _p_choice(1, {}, "stop"))
        events = [
            lc.Content("b", 1),
            lc.ToolCall(0, "y", "g", "[", 1),
            lc.Content("a", 0),
            lc.ToolCall(0, "x", "f", "{", 0),
            lc.ToolCall(0, None, None, "}", 0),
        ]
        choices = (
            lc.Choice(0, "a", "", [lc.ToolCallResult("x", "f", "{}")], "tool_calls", None),
            lc.Choice(1, "b", "", [lc.ToolCallResult("y", "g", "[")], "stop", None),
        )
        _p_check_pipe(self, _p_http([both, ends]), ("ok", events, _p_completion(choices, None, None)))

    def test_stream_ending_before_every_choice_finished(self):
        payloads = [_p_role(0), _p_role(1), _p_text(0, "a"), _p_text(1, "b"), _p_finish(0, "stop"), _p_text(1, "c")]
        events = [lc.Content("a", 0), lc.Content("b", 1), lc.Content("c", 1)]
        for done in (True, False):
            with self.subTest(done=done):
                _p_check_pipe(self, _p_http(payloads, done), ("raised", events, lc.StreamClosedError))
        asm, _ = _p_feed_payloads(payloads)
        with self.assertRaises(lc.StreamClosedError) as cm:
            asm.completion()
        self.assertIn("choice 1 ", str(cm.exception))
        # no finish_reason at all: the message of a single choice that never finished
        asm, _ = _p_feed_payloads(payloads[:4])
        with self.assertRaisesRegex(lc.StreamClosedError, "ended without a finish_reason"):
            asm.completion()

    def test_missing_or_null_index_is_zero(self):
        payloads = [
            _p_chunk(_p_choice(None, {"content": "a"})),
            json.dumps({"choices": [{"index": None, "delta": {"content": "b"}}], "id": CID}),
            _p_text(0, "c"),
            _p_finish(None, "stop"),
        ]
        asm, events = _p_feed_payloads(payloads)
        self.assertEqual(events, [lc.Content("a"), lc.Content("b"), lc.Content("c")])
        self.assertEqual(asm.completion().choices, (lc.Choice(0, "abc", "", [], "stop", None),))

    def test_index_not_an_integer_is_protocol_error(self):
        for index in ("0", 0.0, 1.5, True, False, [0], {}):
            payload = json.dumps({"choices": [{"index": index, "delta": {"content": "x"}}], "id": CID})
            with self.subTest(index=index):
                asm = lc.Assembler()
                asm.feed(_p_text(0, "warm"))  # the fast path is on
                with self.assertRaises(lc.ProtocolError):
                    asm.feed(payload)

    def test_lowest_index_gives_the_completion_fields(self):
        payloads = [_p_text(5, "five"), _p_text(2, "two"), _p_finish(5, "length"), _p_finish(2, "stop")]
        asm, events = _p_feed_payloads(payloads)
        self.assertEqual(events, [lc.Content("five", 5), lc.Content("two", 2)])
        self.assertEqual((asm.content, asm.finish_reason), ("two", "stop"))
        done = asm.completion()
        self.assertEqual([c.index for c in done.choices], [2, 5])
        self.assertEqual((done.content, done.finish_reason, done.logprobs), ("two", "stop", None))
        self.assertEqual(done, _p_completion(done.choices, None, None))

    def test_a_choice_appears_with_a_role_only_chunk(self):
        asm, events = _p_feed_payloads([_p_role(0), _p_role(1), _p_text(0, "a"), _p_finish(0, "stop")])
        self.assertEqual(events, [lc.Content("a")])
        with self.assertRaisesRegex(lc.StreamClosedError, "choice 1 "):
            asm.completion()


class TestParserLogprobs(unittest.TestCase):
    def test_entries_appended_in_order_per_choice(self):
        lp = [_p_entry(1, "<", -2.1, (2, "Is", -1.4)), _p_entry(2, "is", -2.5, (1, "\n", -1.4))]
        lp += [_p_entry(4, " the", -0.7, (4, " the", -0.7)), _p_entry(2, "ok", -0.1, (2, "ok", -0.1))]
        lp += [_p_entry(1, "!", -3.0, (1, ".", -0.2))]
        payloads = [
            # llama-server puts the entry of a token it hides (the <think> tag's first piece) on the role chunk
            _p_chunk(_p_choice(0, {"role": "assistant", "content": None}, logprobs={"content": [lp[0]]})),
            _p_role(1),
            _p_text(0, "is", "reasoning_content", {"content": [lp[1]]}),
            _p_text(1, "ok", logprobs={"content": [lp[3]]}),
            _p_text(0, " the", "reasoning_content", {"content": [lp[2]], "reasoning_content": [lp[2], lp[1]]}),
            _p_chunk(_p_choice(0, {"content": "!"}, logprobs={"content": [lp[4]], "future": 1}, finish="stop")),
            _p_chunk(_p_choice(1, {}, logprobs={"content": [], "reasoning_content": None}, finish="stop")),
            _p_usage(),
        ]
        events = [lc.Reasoning("is", 0), lc.Content("ok", 1), lc.Reasoning(" the", 0), lc.Content("!", 0)]
        choices = (
            lc.Choice(0, "!", "is the", [], "stop", [lp[0], lp[1], lp[2], lp[4]], [lp[2], lp[1]]),
            lc.Choice(1, "ok", "", [], "stop", [lp[3]], None),
        )
        done = _p_completion(choices, reasoning_tokens=2)
        _p_check_pipe(self, _p_http(payloads), ("ok", events, done))
        self.assertEqual(done.logprobs, [lp[0], lp[1], lp[2], lp[4]])

    def test_none_when_never_sent_empty_list_when_sent_empty(self):
        asm, _ = _p_feed_payloads([_p_text(0, "a", logprobs=None), _p_finish(0)])
        self.assertEqual((asm.completion().logprobs, asm.completion().choices[0].reasoning_logprobs), (None, None))
        payload = _p_chunk(_p_choice(0, {"content": "a"}, logprobs={"content": None, "reasoning_content": None}))
        asm, _ = _p_feed_payloads([payload, _p_finish(0)])
        self.assertEqual((asm.completion().logprobs, asm.completion().choices[0].reasoning_logprobs), (None, None))
        payload = _p_chunk(_p_choice(0, {"content": "a"}, logprobs={"content": [], "reasoning_content": []}))
        asm, _ = _p_feed_payloads([payload, _p_finish(0)])
        self.assertEqual((asm.completion().logprobs, asm.completion().choices[0].reasoning_logprobs), ([], []))

    def test_malformed_log_probabilities_are_protocol_errors(self):
        for logprobs in ([], "x", 1, {"content": {}}, {"content": "x"}, {"content": [1]}, {"reasoning_content": [[]]}):
            payload = _p_chunk(_p_choice(0, {"content": "a"}, logprobs=logprobs))
            with self.subTest(logprobs=logprobs), self.assertRaises(lc.ProtocolError):
                _p_feed_payloads([_p_text(0, "warm"), payload])


class TestParserProgress(unittest.TestCase):
    def test_progress_chunks_before_the_first_token(self):
        # as llama-server sends them: an empty assistant delta and prompt_progress, first at 0 of the total
        payloads = [_p_progress(p, 230, 0, t) for p, t in ((0, 0), (1, 35), (65, 118), (226, 362), (230, 399))]
        payloads += [_p_role(0), _p_text(0, "The"), _p_text(0, " end"), _p_finish(0, "length"), _p_usage()]
        events = [lc.Progress(p, 230, 0, float(t)) for p, t in ((0, 0), (1, 35), (65, 118), (226, 362), (230, 399))]
        events += [lc.Content("The"), lc.Content(" end")]
        done = _p_completion((lc.Choice(0, "The end", "", [], "length", None),))
        _p_check_pipe(self, _p_http(payloads), ("ok", events, done))
        got = _p_pipe_outcome([_p_http(payloads)])[1][0]
        self.assertIs(type(got.time_ms), float)
        self.assertIs(type(got.processed), int)

    def test_progress_with_cache_and_float_time(self):
        asm = lc.Assembler()
        payload = _p_chunk(
            extra={"prompt_progress": {"total": 8000, "cache": 1234, "processed": 1300, "time_ms": 15.5}}
        )
        self.assertEqual(asm.feed(payload), [lc.Progress(1300, 8000, 1234, 15.5)])

    def test_missing_fields(self):
        def progress(**fields):
            return lc.Assembler().feed(_p_chunk(extra={"prompt_progress": fields}))

        self.assertEqual(progress(total=10, processed=3), [lc.Progress(3, 10, 0, 0.0)])
        self.assertEqual(progress(total=10, processed=3, cache=None, time_ms=None), [lc.Progress(3, 10, 0, 0.0)])
        self.assertEqual(progress(total=10, processed=3, future=[1], cache=2), [lc.Progress(3, 10, 2, 0.0)])
        # without what it is about, a progress object gives no event (and no error)
        self.assertEqual(progress(total=10, cache=1, time_ms=2), [])
        self.assertEqual(progress(processed=3), [])
        self.assertEqual(progress(), [])
        self.assertEqual(lc.Assembler().feed(_p_chunk(extra={"prompt_progress": None})), [])

    def test_malformed_progress_is_protocol_error(self):
        good = {"total": 10, "cache": 0, "processed": 3, "time_ms": 5}
        bad = [[], "x", 1, {"processed": "3", "total": 10}, {"processed": 3, "total": True}]
        bad += [dict(good, cache=0.5), dict(good, time_ms="5"), dict(good, time_ms=False), dict(good, time_ms=10**400)]
        bad += [dict(good, total=None, processed=[3])]
        for progress in bad:
            with self.subTest(progress=progress), self.assertRaises(lc.ProtocolError):
                lc.Assembler().feed(_p_chunk(extra={"prompt_progress": progress}))

    def test_progress_then_error_delivers_the_progress(self):
        payloads = [_p_progress(0, 100), _p_progress(50, 100, time_ms=80)]
        data = _p_http(payloads, done=False)
        data = data[: -len(b"0\r\n\r\n")] + chunked(
            sse('{"error":{"code":503,"message":"busy","type":"unavailable_error"}}')
        )
        events = [lc.Progress(0, 100, 0, 0.0), lc.Progress(50, 100, 0, 80.0)]
        _p_check_pipe(self, data + b"0\r\n\r\n", ("raised", events, lc.ServerError))


class TestParserRawChunks(unittest.TestCase):
    def test_every_payload_gives_its_chunk_first(self):
        payloads = [_p_progress(0, 4), _p_role(0), _p_role(1), _p_text(0, "a"), _p_text(1, "b")]
        payloads += [_p_finish(1), _p_finish(0), _p_usage()]
        derived = {
            0: [lc.Progress(0, 4, 0, 0.0)],
            3: [lc.Content("a", 0)],
            4: [lc.Content("b", 1)],
        }
        events = []
        for i, payload in enumerate(payloads):
            events.append(lc.Chunk(json.loads(payload)))
            events += derived.get(i, [])
        choices = (lc.Choice(0, "a", "", [], "stop", None), lc.Choice(1, "b", "", [], "stop", None))
        done = _p_completion(choices)
        _p_check_pipe(self, _p_http(payloads), ("ok", events, done), raw_chunks=True)
        # without raw_chunks, no Chunk is built and the rest is the same
        plain = [e for e in events if type(e) is not lc.Chunk]
        _p_check_pipe(self, _p_http(payloads), ("ok", plain, done), every=False)

    def test_the_hot_path_with_raw_chunks(self):
        asm = lc.Assembler(raw_chunks=True)
        self.assertTrue(asm.raw_chunks)
        for word in ("one", " two", " three"):
            payload = _p_text(0, word)
            self.assertEqual(asm.feed(payload), [lc.Chunk(json.loads(payload)), lc.Content(word)])
        self.assertFalse(lc.Assembler().raw_chunks)

    def test_error_payload_raises_without_a_chunk(self):
        asm = lc.Assembler(raw_chunks=True)
        with self.assertRaises(lc.ServerError):
            asm.feed('{"error":{"code":500,"message":"boom","type":"server_error"}}')


class TestParserUnknownFields(unittest.TestCase):
    def test_unknown_fields_at_every_level_are_ignored(self):
        tool = dict(_p_tool(0, "c", "f", "{}"), extra={"x": 1})
        tool["function"]["strict"] = True
        payloads = [
            _p_chunk(
                dict(_p_choice(0, {"role": "assistant", "content": None, "refusal": None}), future=[1]),
                extra={"prompt_progress": {"total": 2, "processed": 1, "cache": 0, "time_ms": 1, "batch": 9}, "x": {}},
            ),
            _p_chunk(
                dict(_p_choice(0, {"content": "a", "audio": {}}, logprobs={"content": [{"t": 1}], "refusal": []}), y=2)
            ),
            _p_chunk(_p_choice(0, {"tool_calls": [tool], "annotations": []}), extra={"service_tier": "x"}),
            _p_finish(0, "tool_calls", extra={"timings": {"new": 1}, "usage": {"n": 2}, "z": None}),
        ]
        events = [lc.Progress(1, 2, 0, 1.0), lc.Content("a"), lc.ToolCall(0, "c", "f", "{}")]
        choice = lc.Choice(0, "a", "", [lc.ToolCallResult("c", "f", "{}")], "tool_calls", [{"t": 1}])
        done = _p_completion((choice,), {"n": 2}, {"new": 1})
        _p_check_pipe(self, _p_http(payloads), ("ok", events, done))


# The fast path (one choice, index 0, a text-only delta) and the general path must agree on everything.


def _p_general_feed(asm, payload):
    """Feed ``payload`` to the general path alone (the fast path skipped)."""
    if payload == "null" and type(asm) is lc._NativeAssembler:  # what opens a stream of several prompts
        return []
    try:
        doc = json.loads(payload)
    except ValueError:
        raise lc.ProtocolError("invalid JSON") from None
    if type(doc) is not dict:
        raise lc.ProtocolError("not an object")
    return asm._feed(doc, payload)


def _p_random_payload(rng, words):
    def pick(*options):
        return options[rng.randrange(len(options))]

    def delta():
        return pick(
            {"content": rng.choice(words)},
            {"content": rng.choice(words)},
            {"reasoning_content": rng.choice(words)},
            {"content": ""},
            {"reasoning_content": ""},
            {"content": None},
            {"role": "assistant", "content": None},
            {"content": rng.choice(words), "reasoning_content": rng.choice(words)},
            {"content": rng.choice(words), "future": 1},
            {"tool_calls": [_p_tool(rng.randrange(3), pick(None, "id"), pick(None, "f"), rng.choice(words))]},
            {},
            {"content": 5},
            {"reasoning_content": ["x"]},
            [],
            None,
            "text",
        )

    def choice():
        entry = {}
        if rng.random() < 0.9:
            entry["index"] = pick(0, 0, 0, 0, 0, None, 1, 2, -1, "0", 0.0, False, True)
        if rng.random() < 0.95:
            entry["delta"] = delta()
        roll = rng.random()
        if roll < 0.8:
            entry["finish_reason"] = None
        elif roll < 0.9:
            entry["finish_reason"] = pick("stop", "length", 1, "")
        if rng.random() < 0.15:
            entry["logprobs"] = pick(
                None, {}, {"content": [{"token": "t"}]}, {"reasoning_content": []}, {"content": 1}, "x"
            )
        return entry if rng.random() < 0.98 else pick([], "x", None)

    doc = {}
    roll = rng.random()
    if roll < 0.85:
        doc["choices"] = [choice()]
    elif roll < 0.93:
        doc["choices"] = [choice() for _ in range(rng.randint(0, 3))]
    elif roll < 0.96:
        doc["choices"] = pick(None, {}, "x", 0)
    if rng.random() < 0.9:
        doc["id"] = pick(CID, CID, CID, "other", 5)
    if rng.random() < 0.5:
        doc["model"] = pick(MODEL, None, 1)
    doc["object"] = "chat.completion.chunk"
    for key, values in (
        ("usage", ({"total_tokens": 3}, None, [1])),
        ("timings", ({"predicted_n": 1}, None, "x")),
        ("prompt_progress", ({"total": 9, "processed": 1, "cache": 0, "time_ms": 2}, None, {"total": "x"}, [])),
        ("error", ({"code": 500, "message": "m"}, "plain")),
        ("future", ({"x": 1}, None)),
    ):
        if rng.random() < (0.01 if key == "error" else 0.05):
            doc[key] = pick(*values)
    if rng.random() < 0.02:
        return pick("[1]", "null", '"x"', "{", "")
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=rng.random() < 0.5)


class _FastPaths:
    """A dialect's fast path against its general path alone (``_feed`` after a plain parse)."""

    DIALECT = lc.Assembler
    #: the attributes compared after every payload: what the pump and the thinking cap read
    STATE = ("id", "model", "usage", "timings", "reasoning_tokens", "in_reasoning", "done")

    @staticmethod
    def fast_on(asm):
        return asm._fast

    def run_both(self, payloads, raw_chunks=False):
        """The same payloads through feed() (fast path where it applies) and through the general path
        alone: every step's events or error, the state the pump and the thinking cap read, and the
        completion.  Returns how many payloads met the fast path switched on."""
        fast, general = self.DIALECT(raw_chunks), self.DIALECT(raw_chunks)
        fast_steps = 0
        for payload in payloads:
            fast_steps += bool(self.fast_on(fast))
            results = []
            for feed in (fast.feed, lambda p: _p_general_feed(general, p)):
                try:
                    results.append(("events", feed(payload)))
                except lc.LoopError as exc:
                    results.append(("raised", type(exc)))
            self.assertEqual(results[0], results[1], payload)
            for name in self.STATE:
                self.assertEqual(getattr(fast, name), getattr(general, name), (name, payload))
            if results[0][0] == "raised":
                return fast_steps
        outcomes = []
        for asm in (fast, general):
            try:
                outcomes.append(asm.completion())
            except lc.LoopError as exc:
                outcomes.append(type(exc))
        self.assertEqual(outcomes[0], outcomes[1])
        return fast_steps


class TestAssemblerPaths(_FastPaths, unittest.TestCase):
    STATE = _FastPaths.STATE + ("content", "reasoning", "finish_reason")

    def test_fast_and_general_paths_agree(self):
        words = ["a", " b", "\u00e9", "\U0001f30a", "", " ", "\n", '"q"']
        rng = random.Random(20240611)
        fast_steps = 0
        for trial in range(3000):
            payloads = [_p_role(0)] if rng.random() < 0.7 else []
            payloads += [_p_random_payload(rng, words) for _ in range(rng.randint(1, 16))]
            with self.subTest(trial=trial):
                fast_steps += self.run_both(payloads, raw_chunks=rng.random() < 0.1)
        self.assertGreater(fast_steps, 3000)  # the fast path was on for many of the payloads

    def test_fast_and_general_paths_agree_on_real_streams(self):
        payloads = [_p_role(0)] + [
            _p_text(0, w, what) for w in ("x", "", " y") for what in ("content", "reasoning_content")
        ]
        payloads += [
            _p_text(0, "z", logprobs={"content": [_p_entry(1, "z", -1.0)]}),
            _p_text(None, "n"),
            _p_text(1, "one"),
        ]
        payloads += [_p_chunk(_p_choice(0, {"content": "p"}), extra={"prompt_progress": {"total": 1, "processed": 1}})]
        payloads += [_p_finish(1), _p_text(0, "w"), _p_finish(0), _p_usage()]
        self.assertGreater(self.run_both(payloads), 5)
        self.assertEqual(self.run_both(payloads, raw_chunks=True), 0)  # a Chunk per payload: never the fast path

    def test_token_chunks_read_by_their_learned_tail(self):
        # A token chunk's JSON after its text is the same all through a stream (created, id, model, ...): once
        # the fast path parsed one whole, the next are read as head + one string literal + that tail.  Each
        # stream here holds to the general path, and says whether a tail was learned.
        head = '{"choices":[{"finish_reason":null,"index":0,"delta":{"content":'
        rhead = '{"choices":[{"finish_reason":null,"index":0,"delta":{"reasoning_content":'
        tail = '}}],"created":1796072537,"id":"%s","model":"m","object":"chat.completion.chunk"}' % CID
        again = '"choices":[{"finish_reason":null,"index":0,"delta":{"content":"w"}}]}'
        texts = ["a", "", r"\u00e9", r"\ud83c\udf0a", r"\ud800", r"\"}}],\"x\":1", r"\\", r"\/", "\u00e9\U0001f30a"]
        plain = [_p_role(0)] + [head + '"%s"' % t + tail for t in texts] + [rhead + '"%s"' % t + tail for t in texts]
        cases = {
            "plain": (plain, True),
            "no other keys": ([_p_role(0)] + [head + '"%s"}}]}' % t for t in texts], True),
            # a later "choices" is the one that counts: its text, not the head's
            "a tail that names choices again": ([_p_role(0)] + [head + '"%s"}}],' % t + again for t in "xyz"], False),
            "... escaped": (
                [_p_role(0)] + [head + '"%s"}}],' % t + again.replace("c", r"\u0063", 1) for t in "xyz"],
                False,
            ),
            "... after another key": ([_p_role(0)] + [head + '"%s"}}],"id":"i",' % t + again for t in "xyz"], False),
            "a tail that opens something": ([_p_role(0)] + [head + '"x"},"future":{"a":1}}],"id":"i"}'] * 3, False),
            "the tail changes": (
                [_p_role(0)] + [head + '"x"' + tail.replace('"m"', '"%s"' % m) for m in "mnmnm"],
                True,
            ),
            "it changes all the time": ([_p_role(0)] + [head + '"x"}}],"n":%d}' % i for i in range(40)], True),
            "it changes every fifth chunk": (
                [_p_role(0)] + [head + '"x"}}],"n":%d}' % (i // 5) for i in range(200)],
                True,
            ),
            "whitespace after it": ([_p_role(0), head + '"x"' + tail, head + '"y"' + tail + " "], True),
        }
        bad = [r'"\x"', '"a', r'"\ud80"', '"a\nb"', "5", "null", '"a"+"b"']
        for i, literal in enumerate(bad):
            cases["bad literal %d" % i] = ([_p_role(0), head + '"x"' + tail, head + literal + tail], True)
        for name, (payloads, learned) in cases.items():
            with self.subTest(name):
                self.run_both(payloads)
                asm = lc.Assembler()
                for payload in payloads:
                    try:
                        asm.feed(payload)
                    except lc.ProtocolError:
                        break
                self.assertEqual(asm._tail is not None, learned)
        # learned once, a stream of 1,000 tokens is parsed whole only for the role and the first token
        asm, parsed = lc.Assembler(), []

        def scan(text, at):
            parsed.append(text)
            return json.JSONDecoder().raw_decode(text, at)

        with mock.patch.object(lc, "_scan_json", scan):
            events = [e for p in [_p_role(0)] + [head + '"w%d"' % i + tail for i in range(1000)] for e in asm.feed(p)]
        self.assertEqual(events, [lc.Content("w%d" % i) for i in range(1000)])
        self.assertEqual(len(parsed), 2)
        self.assertEqual(asm._tails, 1)
        # llama-server's tail changes each second (its "created"); a tail that changes with every chunk
        # is learned 16 times, then no more (each costs a parse of the tail); one that changes every fifth
        # chunk (each read 4 chunks) is learned all through the stream
        for name, learned, tailed in [("it changes all the time", 16, 0), ("it changes every fifth chunk", 40, 160)]:
            asm = lc.Assembler()
            for payload in cases[name][0]:
                asm.feed(payload)
            self.assertEqual((asm._tails, asm._tailed), (learned, tailed), name)


# -----------------------------------------------------------------------------------------------------
# Real bytes of n > 1, prompt progress and log probabilities (dev/testdata/transcripts/30-32), captured from
# llama-server started with `LOOPCLIENT_LLAMA_EXTRA_ARGS="--no-repack -b 64 -ub 64" dev/llama-server.sh
# start` (a batch smaller than the prompt, so that it reports progress more than once).  What they show:
# every choice sends its own role chunk(s), its own finish chunk and, with include_usage, its own usage
# chunk (no index: the usage and timings of one choice; the last one sent wins); progress chunks carry the
# index of the choice whose task reports them; the tokens' entries come one per chunk in
# ``logprobs.content``, reasoning tokens' too (``logprobs.reasoning_content`` is never sent), and the role
# chunk of a reasoning stream carries the entry of the first, hidden, token of the <think> tag.
# -----------------------------------------------------------------------------------------------------

_p_MODEL_PATH = "/root/.cache/loopclient/gemma-3-270m-q4_k_m.gguf"


class TestParserChoiceTranscripts(unittest.TestCase):
    def transcript(self, name):
        return load_transcript(name)  # a missing file fails: the transcripts ship with the code

    def check(self, raw, expect, every=True):
        tried, boundaries = _p_check_pipe(self, raw, expect, every, sample=1000)
        if every:  # each offset a read boundary between pieces of more than one byte
            self.assertEqual(boundaries, set(range(1, len(raw))))
        self.assertGreater(tried, 1000)
        outcome = _p_pipe_outcome([raw], raw_chunks=True)  # the same with a Chunk before each payload's events
        self.assertEqual([e for e in outcome[1] if type(e) is not lc.Chunk], expect[1])
        self.assertEqual(outcome[2], expect[2])

    def test_30_two_choices_progress_logprobs_temperature_0(self):
        raw = self.transcript("30_chat_stream_n2_progress_logprobs.raw.txt")
        words = ["The", " keeper", " of", " the", " lighthouse", " kept"]
        steps = ((0, 0), (1, 35), (65, 118), (129, 210), (166, 268), (226, 362), (230, 394))
        events = [lc.Progress(p, 230, 0, float(t)) for p, t in steps]
        events += [lc.Content("The", 1), lc.Progress(230, 230, 0, 399.0), lc.Content("The", 0)]
        for word in words[1:]:
            events += [lc.Content(word, 1), lc.Content(word, 0)]
        logprobs = [
            _p_entry(818, "The", -1.4798029661178589, (818, "The", -1.4798029661178589), (236820, "<", -2.0855979919433594)),
            _p_entry(64222, " keeper", -1.715211033821106, (64222, " keeper", -1.715211033821106), (63937, " lighthouse", -2.132290840148926)),
            _p_entry(529, " of", -1.6078027486801147, (529, " of", -1.6078027486801147), (7953, " kept", -2.020444393157959)),
            _p_entry(506, " the", -0.14537063241004944, (506, " the", -0.14537063241004944), (496, " a", -2.7692224979400635)),
            _p_entry(63937, " lighthouse", -0.5113813281059265, (63937, " lighthouse", -0.5113813281059265), (7507, " ship", -4.255830764770508)),
            _p_entry(7953, " kept", -2.048600673675537, (7953, " kept", -2.048600673675537), (691, " was", -2.2447752952575684)),
        ]  # fmt: skip
        text = "The keeper of the lighthouse kept"
        choices = (lc.Choice(0, text, "", [], "length", logprobs), lc.Choice(1, text, "", [], "length", logprobs))
        completion = lc.Completion(
            id="chatcmpl-J63SQaeZohWQzm6aFJt7VZ2UadGCn20t",
            model=_p_MODEL_PATH,
            content=text,
            reasoning="",
            tool_calls=[],
            finish_reason="length",
            usage={
                "completion_tokens": 6,
                "prompt_tokens": 230,
                "total_tokens": 236,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            timings={  # choice 0's: its usage chunk came last
                "cache_n": 0,
                "prompt_n": 230,
                "prompt_ms": 400.004,
                "prompt_per_token_ms": 1.7391478260869566,
                "prompt_per_second": 574.9942500574994,
                "predicted_n": 6,
                "predicted_ms": 158.727,
                "predicted_per_token_ms": 31.7454,
                "predicted_per_second": 31.50062686247456,
            },
            choices=choices,
        )
        self.check(raw, ("ok", events, completion))
        self.assertEqual(completion.logprobs, logprobs)

    def test_31_two_choices_progress_logprobs_temperature_0_9(self):
        raw = self.transcript("31_chat_stream_n2_t09_progress_logprobs.raw.txt")
        steps = ((0, 0), (1, 4), (65, 90), (129, 177), (151, 214), (211, 305), (215, 324))
        events = [lc.Progress(p, 215, 0, float(t)) for p, t in steps]
        events += [lc.Content("A", 0), lc.Progress(215, 215, 0, 326.0), lc.Content("A", 1)]
        zero = ["A", " recipe", " for", " bread", " begins", " with", " flour", ","]
        one = ["A", " recipe", " for", " a", " loaf", " of", " bread", " begins"]
        for a, b in zip(zero[1:], one[1:]):
            events += [lc.Content(a, 0), lc.Content(b, 1)]
        lp0 = [
            _p_entry(236776, "A", -1.7863634824752808, (236776, "A", -1.7863634824752808), (236820, "<", -2.126858711242676)),
            _p_entry(15028, " recipe", -1.0426180362701416, (15028, " recipe", -1.0426180362701416), (86396, " baker", -3.478832483291626)),
            _p_entry(573, " for", -0.03036627359688282, (573, " for", -0.03036627359688282), (531, " to", -5.311124324798584)),
        ]  # fmt: skip
        lp1 = lp0 + [
            _p_entry(496, " a", -2.6972055435180664, (12175, " bread", -1.241759181022644), (496, " a", -2.6972055435180664)),
            _p_entry(72276, " loaf", -2.4273104667663574, (12580, " cake", -2.0815463066101074), (72276, " loaf", -2.4273104667663574)),
            _p_entry(529, " of", -0.16343477368354797, (529, " of", -0.16343477368354797), (563, " is", -3.5912740230560303)),
            _p_entry(12175, " bread", -0.38308072090148926, (12175, " bread", -0.38308072090148926), (2173, " white", -4.051033973693848)),
            _p_entry(12502, " begins", -1.082929253578186, (12502, " begins", -1.082929253578186), (563, " is", -1.883905053138733)),
        ]  # fmt: skip
        lp0 = lp0 + [
            _p_entry(12175, " bread", -1.241759181022644, (12175, " bread", -1.241759181022644), (496, " a", -2.6972055435180664)),
            _p_entry(12502, " begins", -0.16543486714363098, (12502, " begins", -0.16543486714363098), (9857, " starts", -3.451441764831543)),
            _p_entry(607, " with", -0.009987592697143555, (607, " with", -0.009987592697143555), (684, " by", -5.8237104415893555)),
            _p_entry(18763, " flour", -0.08550732582807541, (18763, " flour", -0.08550732582807541), (496, " a", -4.513678550720215)),
            _p_entry(236764, ",", -0.018818872049450874, (236764, ",", -0.018818872049450874), (532, " and", -4.663834571838379)),
        ]  # fmt: skip
        choices = (
            lc.Choice(0, "".join(zero), "", [], "length", lp0),
            lc.Choice(1, "".join(one), "", [], "length", lp1),
        )
        completion = lc.Completion(
            id="chatcmpl-CgpZOAAckx3PAm6sOfl2YHqb5bDeCrJ1",
            model=_p_MODEL_PATH,
            content="A recipe for bread begins with flour,",
            reasoning="",
            tool_calls=[],
            finish_reason="length",
            usage={
                "completion_tokens": 8,
                "prompt_tokens": 215,
                "total_tokens": 223,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            timings={  # choice 1's: choice 0 finished first
                "cache_n": 0,
                "prompt_n": 215,
                "prompt_ms": 326.701,
                "prompt_per_token_ms": 1.519539534883721,
                "prompt_per_second": 658.0940982733447,
                "predicted_n": 8,
                "predicted_ms": 208.588,
                "predicted_per_token_ms": 29.798285714285715,
                "predicted_per_second": 33.55897750589679,
            },
            choices=choices,
        )
        self.check(raw, ("ok", events, completion), every=False)  # the shape of 30, split at 1,000 offsets

    def test_32_two_choices_reasoning_logprobs(self):
        raw = self.transcript("32_reasoning_n2_logprobs.raw.txt")
        thoughts, answer = ["is", " the", " sky", " a"], ["the", " ", "answer", " is", " yes"]
        events = []
        for cls, words in ((lc.Reasoning, thoughts), (lc.Content, answer)):
            for word in words:
                events += [cls(word, 0), cls(word, 1)]
        logprobs = [  # the first entry came with the role chunk: the hidden "<" of <think>
            _p_entry(236820, "<", -2.107464551925659, (4602, "Is", -1.3712775707244873)),
            _p_entry(511, "is", -2.472975254058838, (107, "\n", -1.4195847511291504)),
            _p_entry(506, " the", -0.6985302567481995, (506, " the", -0.6985302567481995)),
            _p_entry(7217, " sky", -0.33211347460746765, (7217, " sky", -0.33211347460746765)),
            _p_entry(496, " a", -6.750306129455566, (3730, " blue", -0.12635499238967896)),
            _p_entry(1437, "the", -5.134098052978516, (107, "\n", -1.365402102470398)),
            _p_entry(236743, " ", -5.88148307800293, (7217, " sky", -0.7689611911773682)),
            _p_entry(14433, "answer", -16.392276763916016, (107, "\n", -1.4316818714141846)),
            _p_entry(563, " is", -2.07139253616333, (236881, "?", -1.9522062540054321)),
            _p_entry(11262, " yes", -2.938149929046631, (3730, " blue", -0.863429605960846)),
        ]
        choice = lc.Choice(0, "the answer is yes", "is the sky a", [], "stop", logprobs, None)
        completion = lc.Completion(
            id="chatcmpl-UT7y4QKWnieKZlUMeWj880aTeMsPQGne",
            model=_p_MODEL_PATH,
            content="the answer is yes",
            reasoning="is the sky a",
            tool_calls=[],
            finish_reason="stop",
            usage={
                "completion_tokens": 16,
                "prompt_tokens": 28,
                "total_tokens": 44,
                "prompt_tokens_details": {"cached_tokens": 1},
            },
            timings={
                "cache_n": 1,
                "prompt_n": 27,
                "prompt_ms": 125.898,
                "prompt_per_token_ms": 4.662888888888888,
                "prompt_per_second": 214.4593242148406,
                "predicted_n": 16,
                "predicted_ms": 1335.871,
                "predicted_per_token_ms": 89.05806666666668,
                "predicted_per_second": 11.228629111643263,
            },
            reasoning_tokens=8,  # four per choice: the cap is refused with n > 1, so counting both is harmless
            choices=(choice, choice.replace(index=1)),
        )
        self.check(raw, ("ok", events, completion))

    def test_30_cut_before_the_last_finish_is_stream_closed(self):
        raw = self.transcript("30_chat_stream_n2_progress_logprobs.raw.txt")
        # the stream up to choice 1's finish chunk (and its usage chunk), then the connection closes
        event = raw.rindex(b"data: ", 0, raw.rindex(b'"delta":{"content":" kept"}'))  # choice 0's last token
        cut = raw.rindex(b"\r\n", 0, event - 2) + 2  # at the start of its HTTP chunk
        got = _p_pipe_outcome([raw[:cut]])
        self.assertEqual(got[0], "raised")
        self.assertIs(got[2], lc.StreamClosedError)
        self.assertEqual(len(got[1]), 8 + 2 * 6 - 1)  # every event but choice 0's " kept"
        asm = lc.Assembler()
        for _, payload in lc.SSEDecoder().feed(b"".join(lc.ResponseReader().feed(raw[:cut]))):
            asm.feed(payload)
        with self.assertRaisesRegex(lc.StreamClosedError, "choice 0 "):
            asm.completion()


# -----------------------------------------------------------------------------------------------------
# The other streamed endpoints' dialects (/completion and /infill, Responses, Messages): each stream fed
# through ResponseReader -> SSEDecoder -> the dialect, whole, byte by byte, split at every offset and at
# random sets of offsets, stopping where the dialect says its stream ended, as the engine does.  The
# streams are in the shapes llama-server writes (key order included).
# -----------------------------------------------------------------------------------------------------


class _p_DialectPipe:
    """ResponseReader -> SSEDecoder -> a dialect: an SSE error event (``event: error`` or the legacy
    ``error:`` line) raises ServerError as the pump does; the Completion once the dialect is ``done``, or
    at the end of the stream."""

    def __init__(self, dialect, raw_chunks=False):
        self.reader = lc.ResponseReader()
        self.sse = lc.SSEDecoder(1024 * 1024)
        self.asm = dialect(raw_chunks)
        self.events = []
        self.done = None

    def _payloads(self, items):
        for kind, data in items:
            if self.done is not None:
                return
            if kind == "error":
                raise lc._error_from(lc._json_or_text(data))
            self.events += self.asm.feed(data)
            if self.asm.done:
                self.done = self.asm.completion()

    def feed(self, data):
        if self.done is not None:
            return
        for piece in self.reader.feed(data):
            self._payloads(self.sse.feed(piece))
            if self.sse.failed is not None:
                raise self.sse.failed
        if self.reader.failed is not None:
            raise self.reader.failed

    def end(self):
        if self.done is None:
            self.reader.feed_eof()
            self._payloads(self.sse.close())
        if self.done is None:
            self.done = self.asm.completion()


def _p_dialect_outcome(dialect, pieces, raw_chunks=False):
    """("ok", events, completion) or ("raised", events delivered first, error class, message)."""
    pipe = _p_DialectPipe(dialect, raw_chunks)
    try:
        for piece in pieces:
            pipe.feed(piece)
        pipe.end()
    except lc.LoopError as exc:
        return ("raised", pipe.events, type(exc), str(exc))
    return ("ok", pipe.events, pipe.done)


def _p_check_dialect(test, dialect, data, expect, every=True, raw_chunks=False):
    """Every way of splitting ``data`` gives ``expect`` exactly."""
    for label, pieces in _p_stream_splittings(data, every):
        got = _p_dialect_outcome(dialect, pieces, raw_chunks)
        if got != expect:
            test.fail("%s: got %s\nexpected %s" % (label, _p_short(got, 3000), _p_short(expect, 3000)))


def _p_dialect_http(events):
    """A streamed response of SSE events (bytes), grouped 1, 2, 3, 1, ... per HTTP chunk."""
    bodies, i, n = [], 0, 0
    while i < len(events):
        n = n % 3 + 1
        bodies.append(b"".join(events[i : i + n]))
        i += n
    return STREAM_HEAD + chunked(*bodies) + b"0\r\n\r\n"


def _p_json(doc):
    return json.dumps(doc, separators=(",", ":"))


def _p_typed(doc):
    """An ``event: <type>`` block with the document as its data, as Responses and Messages stream."""
    return b"event: %s\ndata: %s\n\n" % (doc["type"].encode(), _p_json(doc).encode())


# -- /completion and /infill ----------------------------------------------------------------------------

_p_SETTINGS = {"seed": 4294967295, "temperature": 0.0, "n_predict": 3, "stream": True}
_p_NATIVE_TIMINGS = {
    "cache_n": 0,
    "prompt_n": 4,
    "prompt_ms": 21.5,
    "prompt_per_token_ms": 5.375,
    "prompt_per_second": 186.0,
    "predicted_n": 3,
    "predicted_ms": 30.0,
    "predicted_per_token_ms": 10.0,
    "predicted_per_second": 100.0,
}


def _p_native(content, tokens=(), index=0, predicted=1, evaluated=4, extra=None):
    doc = {
        "index": index,
        "content": content,
        "tokens": list(tokens),
        "stop": False,
        "id_slot": -1,
        "tokens_predicted": predicted,
        "tokens_evaluated": evaluated,
    }
    doc.update(extra or {})
    return _p_json(doc)


def _p_native_stop(index=0, stop_type="limit", predicted=3, evaluated=4, content="", extra=None):
    doc = {
        "index": index,
        "content": content,
        "tokens": [],
        "id_slot": 0,
        "stop": True,
        "model": MODEL,
        "tokens_predicted": predicted,
        "tokens_evaluated": evaluated,
        "generation_settings": _p_SETTINGS,
        "prompt": "<bos>Once upon",
        "has_new_line": False,
        "truncated": False,
        "stop_type": stop_type,
        "stopping_word": "",
        "tokens_cached": evaluated + predicted - 1,
        "timings": _p_NATIVE_TIMINGS,
    }
    doc.update(extra or {})
    return _p_json(doc)


def _p_native_usage(evaluated=4, predicted=3, cached=6):
    return {
        "tokens_evaluated": evaluated,
        "tokens_predicted": predicted,
        "tokens_cached": cached,
        "prompt_tokens": evaluated,
        "completion_tokens": predicted,
        "total_tokens": evaluated + predicted,
    }


def _p_native_completion(choices, final, usage=None, timings=_p_NATIVE_TIMINGS):
    first = choices[0]
    return lc.Completion(
        id=None,
        model=MODEL,
        content=first.content,
        reasoning="",
        tool_calls=[],
        finish_reason=first.finish_reason,
        usage=usage if usage is not None else _p_native_usage(),
        timings=timings,
        choices=choices,
        final=final,
        tokens=first.tokens,
    )


def _p_random_native(rng, words):
    """A /completion chunk of random shape: mostly a plain token of choice 0, sometimes anything."""

    def pick(*options):
        return options[rng.randrange(len(options))]

    if rng.random() < 0.02:
        return pick("null", "[1]", '"x"', "{", "")
    doc = {}
    if rng.random() < 0.9:
        doc["index"] = 0 if rng.random() < 0.8 else pick(1, None, "0", True, 0.0)
    if rng.random() < 0.95:
        doc["content"] = rng.choice(words) if rng.random() < 0.9 else pick(None, 5, ["x"])
    if rng.random() < 0.9:
        doc["tokens"] = [rng.randrange(1000)] if rng.random() < 0.85 else pick([], [1, 2], ["x"], [True], None, "x")
    doc["stop"] = False if rng.random() < 0.9 else pick(True, None, "yes", 0)
    if doc["stop"] is True:
        doc.update(stop_type=pick("eos", "limit", "word", None), tokens_predicted=3, tokens_evaluated=4, model=MODEL)
    doc["id_slot"] = 0
    for key, values in (
        ("prompt_progress", ({"total": 9, "processed": 1, "cache": 0, "time_ms": 2}, None, {"total": "x"})),
        ("completion_probabilities", ([{"id": 1, "token": "a", "logprob": -0.5}], None, "x")),
        ("timings", ({"predicted_n": 1}, None, "x")),
        ("error", ({"code": 500, "message": "m"}, "plain")),
        ("future", ({"x": 1}, None)),
    ):
        if rng.random() < (0.01 if key == "error" else 0.04):
            doc[key] = pick(*values)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=rng.random() < 0.5)


class TestNativeAssemblerPaths(_FastPaths, unittest.TestCase):
    """The native dialect's fast path (a plain token of choice 0) gives what its general path gives."""

    DIALECT = lc._NativeAssembler

    @staticmethod
    def fast_on(asm):
        return asm._first is not None

    def test_fast_and_general_paths_agree(self):
        words = ["a", " b", "\u00e9", "\U0001f30a", "", " ", "\n", '"q"']
        rng = random.Random(20261201)
        fast_steps = 0
        for trial in range(3000):
            payloads = [_p_random_native(rng, words) for _ in range(rng.randint(1, 16))]
            with self.subTest(trial=trial):
                fast_steps += self.run_both(payloads, raw_chunks=rng.random() < 0.1)
        self.assertGreater(fast_steps, 3000)  # the fast path was on for many of the payloads

    def test_fast_and_general_paths_agree_on_real_streams(self):
        for name in (
            "40_completion_stream_tokens_probs.raw.txt",
            "41_completion_stream_progress.raw.txt",
            "42_completion_stream_token_ids.raw.txt",
            "43_completion_stream_two_prompts.raw.txt",
            "46_completion_stream_stop_word.raw.txt",
            "48_infill_stream.raw.txt",
        ):
            raw = load_transcript(name)
            payloads = [line[6:].decode() for line in raw.split(b"\n") if line.startswith(b"data: ")]
            with self.subTest(name=name):
                self.assertGreater(self.run_both(payloads), 0)  # the fast path was on after the first token
                self.assertEqual(self.run_both(payloads, raw_chunks=True), 0)  # a Chunk per payload: never fast


class TestParserNativeDialect(unittest.TestCase):
    def test_one_prompt(self):
        stop = _p_native_stop()
        data = _p_dialect_http(
            [
                sse(_p_native(" the", [506])),
                sse(_p_native(" sea", [5442], predicted=2)),
                sse(_p_native(".", [236761], predicted=3)),
                sse(stop),
            ]
        )
        choice = lc.Choice(0, " the sea.", "", [], "length", None, None, [506, 5442, 236761])
        expect = (
            "ok",
            [lc.Content(" the"), lc.Content(" sea"), lc.Content(".")],
            _p_native_completion((choice,), json.loads(stop)),
        )
        _p_check_dialect(self, lc._NativeAssembler, data, expect)

    def test_no_token_ids_unless_sent(self):
        asm = lc._NativeAssembler()
        for payload in (_p_native("a"), _p_native("b"), _p_native_stop(stop_type="eos")):
            asm.feed(payload)
        done = asm.completion()
        self.assertEqual(
            (done.tokens, done.choices[0].tokens, done.content, done.finish_reason), (None, None, "ab", "stop")
        )
        self.assertIsNone(done.id)  # id_slot and index are not completion ids

    def test_two_prompts_interleaved_by_index(self):
        lp = _p_entry(4, " the", -0.5, (4, " the", -0.5), (2, " a", -1.25))
        progress = {"total": 4, "cache": 0, "processed": 4, "time_ms": 12.5}
        stop0, stop1 = _p_native_stop(0, "eos", 2, 4), _p_native_stop(1, "limit", 3, 5)
        data = _p_dialect_http(
            [
                sse(_p_native("", [], 1, 0, 5, extra={"prompt_progress": progress})),
                sse(_p_native(" the", [506], 0, extra={"completion_probabilities": [lp]})),
                sse(_p_native(" one", [886], 1, evaluated=5)),
                sse(_p_native(" end", [1345], 0, 2)),
                sse(_p_native(" two", [1156], 1, 2, 5)),
                sse(stop0),
                sse(_p_native(" three", [1806], 1, 3, 5)),
                sse(stop1),
            ]
        )
        events = [
            lc.Progress(4, 4, 0, 12.5),
            lc.Content(" the", 0),
            lc.Content(" one", 1),
            lc.Content(" end", 0),
            lc.Content(" two", 1),
            lc.Content(" three", 1),
        ]
        choices = (
            lc.Choice(0, " the end", "", [], "stop", [lp], None, [506, 1345]),
            lc.Choice(1, " one two three", "", [], "length", None, None, [886, 1156, 1806]),
        )
        usage = _p_native_usage(9, 5, 5 + 7)
        expect = ("ok", events, _p_native_completion(choices, json.loads(stop0), usage))
        _p_check_dialect(self, lc._NativeAssembler, data, expect)

    def test_a_stream_that_ends_before_every_stop_is_stream_closed(self):
        data = _p_dialect_http([sse(_p_native("a", [1], 0)), sse(_p_native("b", [2], 1)), sse(_p_native_stop(1))])
        expect = (
            "raised",
            [lc.Content("a", 0), lc.Content("b", 1)],
            lc.StreamClosedError,
            "the stream ended before choice 0 had its stop chunk: the server stopped mid-answer",
        )
        _p_check_dialect(self, lc._NativeAssembler, data, expect)
        data = _p_dialect_http([sse(_p_native("a", [1]))])
        expect = (
            "raised",
            [lc.Content("a")],
            lc.StreamClosedError,
            "the stream ended before its stop chunk: the server stopped mid-answer",
        )
        _p_check_dialect(self, lc._NativeAssembler, data, expect)
        asm = lc._NativeAssembler()
        self.assertFalse(asm.done)
        with self.assertRaises(lc.StreamClosedError):
            asm.completion()

    def test_done_once_every_choice_that_appeared_has_stopped(self):
        asm = lc._NativeAssembler()
        asm.feed(_p_native("a", index=0))
        asm.feed(_p_native("b", index=1))
        asm.feed(_p_native_stop(0))
        self.assertFalse(asm.done)
        asm.feed(_p_native_stop(1))
        self.assertTrue(asm.done)

    def test_an_error_payload_before_and_after_content(self):
        error = _p_json({"error": {"code": 500, "message": "boom", "type": "server_error"}})
        for before in ([], [sse(_p_native("a", [1]))]):
            data = _p_dialect_http(before + [sse(error)])
            delivered = [lc.Content("a")] if before else []
            _p_check_dialect(
                self, lc._NativeAssembler, data, ("raised", delivered, lc.ServerError, "server error 500: boom")
            )
        legacy = _p_dialect_http([sse(_p_native("a", [1])), b"error: " + error.encode() + b"\n\n"])
        _p_check_dialect(
            self, lc._NativeAssembler, legacy, ("raised", [lc.Content("a")], lc.ServerError, "server error 500: boom")
        )

    def test_stop_types_in_chat_words(self):
        for stop_type, reason in (
            ("eos", "stop"),
            ("word", "stop"),
            ("limit", "length"),
            ("none", "none"),
            (None, "stop"),
        ):
            asm = lc._NativeAssembler()
            asm.feed(_p_native_stop(stop_type=stop_type))
            self.assertEqual(asm.completion().finish_reason, reason, stop_type)

    def test_content_in_the_stop_chunk_is_delivered(self):
        asm = lc._NativeAssembler()
        self.assertEqual(asm.feed(_p_native_stop(content=" end")), [lc.Content(" end")])
        self.assertEqual(asm.completion().content, " end")

    def test_unknown_fields_are_ignored_and_raw_chunks_come_first(self):
        payload = _p_native("a", [1], extra={"future": {"x": [1]}, "n_indent": 2})
        asm = lc._NativeAssembler(raw_chunks=True)
        self.assertEqual(asm.feed(payload), [lc.Chunk(json.loads(payload)), lc.Content("a")])
        self.assertEqual(lc._NativeAssembler().feed(payload), [lc.Content("a")])

    def test_wrong_types_are_protocol_errors(self):
        for payload in (
            "{",
            "[]",
            '"text"',
            _p_native(7),
            _p_native("a", extra={"index": "0"}),
            _p_native("a", extra={"tokens": "1"}),
            _p_native("a", extra={"tokens": [1, "2"]}),
            _p_native("a", extra={"tokens": [True]}),
            _p_native("a", extra={"stop": "yes"}),
            _p_native("a", extra={"completion_probabilities": {}}),
            _p_native("a", extra={"prompt_progress": []}),
            _p_native("a", extra={"timings": 1}),
            _p_native_stop(stop_type=3),
            _p_native_stop(extra={"tokens_predicted": "3"}),
        ):
            with self.subTest(payload=payload), self.assertRaises(lc.ProtocolError):
                lc._NativeAssembler().feed(payload)

    def test_the_thinking_cap_state_stays_idle(self):
        asm = lc._NativeAssembler()
        asm.feed(_p_native("a"))
        self.assertEqual((asm.reasoning_tokens, asm.in_reasoning, asm.thinking_capped, asm.id), (0, False, False, None))
        asm.thinking_capped = True
        asm.feed(_p_native_stop())
        self.assertTrue(asm.completion().thinking_capped)


# -- Responses --------------------------------------------------------------------------------------------

_p_RESP = "resp_Ms2lNBYqmG7I4BT2fwWT8uTzGVSjGJXm"
_p_MSG = "msg_Y2X1F7cbBgD3SOUY0lpDbUVw6aqrBMfI"
_p_RS = "rs_fUTp2mbXRvBqQm1FdY6EywvA0V3KXgh4"


def _p_resp(kind, **fields):
    return dict({"type": kind}, **fields)


def _p_resp_text_stream(words, reasoning=(), status="completed", incomplete=None, extra_events=()):
    """(SSE blocks, the closing response) of a Responses stream: reasoning deltas, text deltas, done events."""
    blocks = [
        _p_resp(
            "response.created", response={"id": _p_RESP, "object": "response", "status": "in_progress", "model": MODEL}
        ),
        _p_resp("response.in_progress", response={"id": _p_RESP, "object": "response", "status": "in_progress"}),
    ]
    output = []
    if reasoning:
        blocks.append(
            _p_resp(
                "response.output_item.added",
                item={
                    "id": _p_RS,
                    "summary": [],
                    "type": "reasoning",
                    "content": [],
                    "encrypted_content": "",
                    "status": "in_progress",
                },
            )
        )
        blocks += [_p_resp("response.reasoning_text.delta", item_id=_p_RS, delta=w) for w in reasoning]
        item = {
            "id": _p_RS,
            "summary": [],
            "type": "reasoning",
            "content": [{"text": "".join(reasoning), "type": "reasoning_text"}],
            "encrypted_content": "",
        }
        blocks.append(_p_resp("response.output_item.done", item=item))
        output.append(item)
    blocks.append(
        _p_resp(
            "response.output_item.added",
            item={"content": [], "id": _p_MSG, "role": "assistant", "status": "in_progress", "type": "message"},
        )
    )
    blocks.append(_p_resp("response.content_part.added", item_id=_p_MSG, part={"type": "output_text", "text": ""}))
    blocks += [_p_resp("response.output_text.delta", item_id=_p_MSG, delta=w) for w in words]
    blocks += list(extra_events)
    text = "".join(words)
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    blocks.append(_p_resp("response.output_text.done", item_id=_p_MSG, text=text))
    blocks.append(_p_resp("response.content_part.done", item_id=_p_MSG, part=part))
    item = {"type": "message", "status": "completed", "id": _p_MSG, "content": [part], "role": "assistant"}
    blocks.append(_p_resp("response.output_item.done", item=item))
    output.append(item)
    response = {
        "id": _p_RESP,
        "object": "response",
        "created_at": 1796072537,
        "status": status,
        "model": MODEL,
        "output": output,
    }
    if incomplete is not None:
        response["incomplete_details"] = {"reason": incomplete}
    response["usage"] = {
        "input_tokens": 9,
        "output_tokens": 3,
        "total_tokens": 12,
        "input_tokens_details": {"cached_tokens": 0},
    }
    blocks.append(_p_resp("response." + status, response=response))
    return blocks, response


def _p_resp_usage(input_tokens=9, output_tokens=3):
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "prompt_tokens": input_tokens,
        "completion_tokens": output_tokens,
    }


def _p_event_completion(cid, content, finish, usage, final, reasoning="", calls=(), reasoning_tokens=0):
    calls = list(calls)
    return lc.Completion(
        id=cid,
        model=MODEL,
        content=content,
        reasoning=reasoning,
        tool_calls=calls,
        finish_reason=finish,
        usage=usage,
        timings=None,
        reasoning_tokens=reasoning_tokens,
        choices=(lc.Choice(0, content, reasoning, calls, finish, None),),
        final=final,
    )


class TestParserResponsesDialect(unittest.TestCase):
    def test_reasoning_then_text(self):
        blocks, response = _p_resp_text_stream([" the", " sea", "."], reasoning=["Let", " me"])
        data = _p_dialect_http([_p_typed(b) for b in blocks])
        events = [lc.Reasoning("Let"), lc.Reasoning(" me"), lc.Content(" the"), lc.Content(" sea"), lc.Content(".")]
        completion = _p_event_completion(
            _p_RESP, " the sea.", "stop", _p_resp_usage(), response, "Let me", reasoning_tokens=2
        )
        _p_check_dialect(self, lc._ResponsesAssembler, data, ("ok", events, completion))

    def test_the_data_alone_suffices(self):
        blocks, response = _p_resp_text_stream(["a"])
        data = _p_dialect_http([sse(_p_json(b)) for b in blocks])  # no event: lines
        completion = _p_event_completion(_p_RESP, "a", "stop", _p_resp_usage(), response)
        _p_check_dialect(self, lc._ResponsesAssembler, data, ("ok", [lc.Content("a")], completion), every=False)

    def test_function_calls(self):
        call1 = {
            "arguments": "",
            "call_id": "fc_uzrJnRe3",
            "name": "get_weather",
            "type": "function_call",
            "status": "in_progress",
        }
        call2 = {
            "arguments": "",
            "call_id": "fc_Xk2p",
            "name": "get_time",
            "type": "function_call",
            "status": "in_progress",
        }
        blocks = [
            _p_resp(
                "response.created",
                response={"id": _p_RESP, "object": "response", "status": "in_progress", "model": MODEL},
            ),
            _p_resp("response.output_item.added", item=call1),
            _p_resp("response.function_call_arguments.delta", delta='{"city":', item_id="fc_uzrJnRe3"),
            _p_resp("response.function_call_arguments.delta", delta='"Paris"}', item_id="fc_uzrJnRe3"),
            _p_resp("response.output_item.added", item=call2),
            _p_resp("response.function_call_arguments.delta", delta="{}", item_id="fc_Xk2p"),
            _p_resp("response.output_item.done", item=dict(call1, arguments='{"city":"Paris"}', status="completed")),
            _p_resp("response.output_item.done", item=dict(call2, arguments="{}", status="completed")),
        ]
        output = [
            dict(call1, arguments='{"city":"Paris"}', status="completed"),
            dict(call2, arguments="{}", status="completed"),
        ]
        response = {
            "id": _p_RESP,
            "object": "response",
            "created_at": 1796072537,
            "status": "completed",
            "model": MODEL,
            "output": output,
            "usage": {"input_tokens": 40, "output_tokens": 20, "total_tokens": 60},
        }
        blocks.append(_p_resp("response.completed", response=response))
        data = _p_dialect_http([_p_typed(b) for b in blocks])
        events = [
            lc.ToolCall(0, "fc_uzrJnRe3", "get_weather", ""),
            lc.ToolCall(0, None, None, '{"city":'),
            lc.ToolCall(0, None, None, '"Paris"}'),
            lc.ToolCall(1, "fc_Xk2p", "get_time", ""),
            lc.ToolCall(1, None, None, "{}"),
        ]
        calls = [
            lc.ToolCallResult("fc_uzrJnRe3", "get_weather", '{"city":"Paris"}'),
            lc.ToolCallResult("fc_Xk2p", "get_time", "{}"),
        ]
        usage = {
            "input_tokens": 40,
            "output_tokens": 20,
            "total_tokens": 60,
            "prompt_tokens": 40,
            "completion_tokens": 20,
        }
        expect = ("ok", events, _p_event_completion(_p_RESP, "", "tool_calls", usage, response, calls=calls))
        _p_check_dialect(self, lc._ResponsesAssembler, data, expect)

    def test_openai_shaped_calls_by_item_id_and_output_index(self):
        asm = lc._ResponsesAssembler()
        item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": ""}
        self.assertEqual(
            asm.feed(_p_json(_p_resp("response.output_item.added", output_index=0, item=item))),
            [lc.ToolCall(0, "call_1", "f", "")],
        )
        self.assertEqual(
            asm.feed(
                _p_json(_p_resp("response.function_call_arguments.delta", item_id="fc_1", output_index=0, delta="{"))
            ),
            [lc.ToolCall(0, None, None, "{")],
        )
        self.assertEqual(
            asm.feed(_p_json(_p_resp("response.function_call_arguments.delta", output_index=0, delta="}"))),
            [lc.ToolCall(0, None, None, "}")],
        )
        # the done item holds nothing the deltas did not bring
        self.assertEqual(
            asm.feed(_p_json(_p_resp("response.output_item.done", output_index=0, item=dict(item, arguments="{}")))), []
        )
        # a call seen only when done: its arguments come from the item
        late = {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"a":1}'}
        self.assertEqual(
            asm.feed(_p_json(_p_resp("response.output_item.done", output_index=1, item=late))),
            [lc.ToolCall(1, "call_2", "g", ""), lc.ToolCall(1, None, None, '{"a":1}')],
        )
        asm.feed(
            _p_json(
                _p_resp("response.completed", response={"id": _p_RESP, "status": "completed", "output": [item, late]})
            )
        )
        done = asm.completion()
        self.assertEqual(
            done.tool_calls, [lc.ToolCallResult("call_1", "f", "{}"), lc.ToolCallResult("call_2", "g", '{"a":1}')]
        )
        self.assertEqual((done.finish_reason, done.usage, done.id), ("tool_calls", None, _p_RESP))

    def test_an_id_or_name_first_seen_in_the_done_item_is_delivered(self):
        # dev/fuzz.py found it: the Completion named the call while no event had
        asm = lc._ResponsesAssembler()
        item = {"id": "fc_1", "arguments": "", "call_id": "call_1", "type": "function_call"}
        self.assertEqual(
            asm.feed(_p_json(_p_resp("response.output_item.added", item=item))), [lc.ToolCall(0, "call_1", None, "")]
        )
        done = dict(item, name="get_weather", arguments="{}")
        self.assertEqual(
            asm.feed(_p_json(_p_resp("response.output_item.done", item=done))),
            [lc.ToolCall(0, None, "get_weather", ""), lc.ToolCall(0, None, None, "{}")],
        )
        self.assertEqual(asm.feed(_p_json(_p_resp("response.output_item.done", item=done))), [])
        asm.feed(_p_json(_p_resp("response.completed", response={"id": _p_RESP, "output": [done]})))
        self.assertEqual(asm.completion().tool_calls, [lc.ToolCallResult("call_1", "get_weather", "{}")])

    def test_arguments_before_any_call_are_a_protocol_error(self):
        with self.assertRaises(lc.ProtocolError):
            lc._ResponsesAssembler().feed(
                _p_json(_p_resp("response.function_call_arguments.delta", item_id="x", delta="{"))
            )

    def test_text_held_back_and_sent_only_in_the_done_event_is_delivered(self):
        asm = lc._ResponsesAssembler()
        asm.feed(_p_json(_p_resp("response.output_text.delta", item_id=_p_MSG, delta="Hello")))
        self.assertEqual(
            asm.feed(_p_json(_p_resp("response.output_text.done", item_id=_p_MSG, text="Hello world"))),
            [lc.Content(" world")],
        )
        self.assertEqual(
            asm.feed(_p_json(_p_resp("response.output_text.done", item_id=_p_MSG, text="Hello world"))), []
        )
        # a done event of an item no delta named: the deltas may have named it otherwise, so nothing is added
        self.assertEqual(asm.feed(_p_json(_p_resp("response.output_text.done", item_id="other", text="Hello"))), [])
        # a stream that sends its text only in the done event
        only = lc._ResponsesAssembler()
        self.assertEqual(
            only.feed(_p_json(_p_resp("response.output_text.done", item_id=_p_MSG, text="All"))), [lc.Content("All")]
        )
        self.assertEqual(
            only.feed(_p_json(_p_resp("response.reasoning_text.done", item_id=_p_RS, text="Why"))),
            [lc.Reasoning("Why")],
        )

    def test_incomplete_for_max_output_tokens_is_length(self):
        blocks, response = _p_resp_text_stream(["a", "b"], status="incomplete", incomplete="max_output_tokens")
        data = _p_dialect_http([_p_typed(b) for b in blocks])
        completion = _p_event_completion(_p_RESP, "ab", "length", _p_resp_usage(), response)
        _p_check_dialect(
            self, lc._ResponsesAssembler, data, ("ok", [lc.Content("a"), lc.Content("b")], completion), every=False
        )
        for reason, finish in (("content_filter", "content_filter"), ("other", "other"), (None, "length")):
            asm = lc._ResponsesAssembler()
            details = {"incomplete_details": {"reason": reason}} if reason else {}
            asm.feed(
                _p_json(
                    _p_resp("response.incomplete", response=dict({"id": _p_RESP, "status": "incomplete"}, **details))
                )
            )
            self.assertEqual(asm.completion().finish_reason, finish)

    def test_failed_and_error_events_are_server_errors(self):
        failed = _p_resp(
            "response.failed",
            response={
                "id": _p_RESP,
                "status": "failed",
                "error": {"code": "server_error", "message": "the model crashed"},
            },
        )
        overloaded = {"type": "error", "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        openai_error = {
            "type": "error",
            "code": "ERR_SOMETHING",
            "message": "Something went wrong",
            "param": None,
            "sequence_number": 3,
        }
        for before in ([], ["x"]):
            blocks, _ = _p_resp_text_stream(before)
            head = [_p_typed(b) for b in blocks[: 4 + len(before)]]
            delivered = [lc.Content(w) for w in before]
            for bad, message in (
                (failed, "server error None: the model crashed"),
                (overloaded, "server error 503: Loading model"),
                (openai_error, "server error None: Something went wrong"),
            ):
                data = _p_dialect_http(head + [_p_typed(bad)])
                _p_check_dialect(
                    self, lc._ResponsesAssembler, data, ("raised", delivered, lc.ServerError, message), every=False
                )
        with self.assertRaises(lc.ServerError) as cm:
            lc._ResponsesAssembler().feed(_p_json(overloaded))
        self.assertEqual((cm.exception.code, cm.exception.type), (503, "unavailable_error"))

    def test_a_stream_that_ends_before_completed_is_stream_closed(self):
        blocks, _ = _p_resp_text_stream(["a", "b"])
        data = _p_dialect_http([_p_typed(b) for b in blocks[:-1]])
        expect = (
            "raised",
            [lc.Content("a"), lc.Content("b")],
            lc.StreamClosedError,
            "the stream ended before response.completed: the server stopped mid-answer",
        )
        _p_check_dialect(self, lc._ResponsesAssembler, data, expect, every=False)

    def test_unknown_events_and_fields_are_ignored(self):
        extra = [
            _p_resp("response.output_text.annotation.added", item_id=_p_MSG, annotation={"type": "url_citation"}),
            _p_resp("response.web_search_call.searching", item_id="ws_1"),
            _p_resp("response.output_text.delta", item_id=_p_MSG, delta="!", logprobs=[], sequence_number=9),
        ]
        blocks, response = _p_resp_text_stream(["a"], extra_events=extra)
        blocks[-1] = dict(blocks[-1], sequence_number=12)
        # (the done event's text, "a", is shorter than the deltas' "a!": it adds nothing)
        data = _p_dialect_http([_p_typed(b) for b in blocks])
        completion = _p_event_completion(_p_RESP, "a!", "stop", _p_resp_usage(), response)
        _p_check_dialect(
            self, lc._ResponsesAssembler, data, ("ok", [lc.Content("a"), lc.Content("!")], completion), every=False
        )
        asm = lc._ResponsesAssembler()
        self.assertEqual(asm.feed('{"sequence_number":1}'), [])

    def test_wrong_types_are_protocol_errors(self):
        for doc in (
            {"type": 7},
            _p_resp("response.output_text.delta", delta=1),
            _p_resp("response.output_item.added", item=[]),
            _p_resp("response.output_item.added", item={"type": "function_call", "name": 3}),
            _p_resp("response.completed"),
            _p_resp("response.completed", response={"usage": {"input_tokens": "9"}}),
            _p_resp("response.completed", response={"output": {}}),
            _p_resp("response.created", response=[]),
        ):
            with self.subTest(doc=doc), self.assertRaises(lc.ProtocolError):
                lc._ResponsesAssembler().feed(_p_json(doc))

    def test_thinking_cap_state(self):
        asm = lc._ResponsesAssembler()
        asm.feed(_p_json(_p_resp("response.created", response={"id": _p_RESP})))
        self.assertEqual(asm.id, _p_RESP)
        asm.feed(_p_json(_p_resp("response.reasoning_text.delta", item_id=_p_RS, delta="a")))
        self.assertEqual((asm.in_reasoning, asm.reasoning_tokens), (True, 1))
        asm.feed(_p_json(_p_resp("response.output_text.delta", item_id=_p_MSG, delta="b")))
        self.assertEqual((asm.in_reasoning, asm.reasoning_tokens), (False, 1))


# -- Messages ---------------------------------------------------------------------------------------------

_p_MSG_ID = "chatcmpl-xdlTsEL8sxv1yq5JpWLxoRq1UACyF3Fk"


def _p_msg_start(usage=None):
    usage = usage if usage is not None else {"cache_read_input_tokens": 0, "input_tokens": 9, "output_tokens": 0}
    message = {
        "id": _p_MSG_ID,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": MODEL,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return {"type": "message_start", "message": message}


def _p_block_start(index, block):
    return {"type": "content_block_start", "index": index, "content_block": block}


def _p_block_delta(index, kind, **fields):
    return {"type": "content_block_delta", "index": index, "delta": dict({"type": kind}, **fields)}


def _p_msg_end(reason="end_turn", output_tokens=3, sequence=None):
    return [
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": output_tokens},
        },
        {"type": "message_stop"},
    ]


def _p_msg_final(reason="end_turn", usage=None, sequence=None):
    final = _p_msg_start()["message"]
    final = dict(final, stop_reason=reason, stop_sequence=sequence)
    final["usage"] = (
        usage if usage is not None else {"cache_read_input_tokens": 0, "input_tokens": 9, "output_tokens": 3}
    )
    return final


def _p_msg_usage(input_tokens=9, cached=0, output_tokens=3, extra=None):
    usage = {"cache_read_input_tokens": cached, "input_tokens": input_tokens, "output_tokens": output_tokens}
    usage.update(extra or {})
    prompt = input_tokens + cached + (extra or {}).get("cache_creation_input_tokens", 0)
    usage.update({"prompt_tokens": prompt, "completion_tokens": output_tokens, "total_tokens": prompt + output_tokens})
    return usage


class TestParserMessagesDialect(unittest.TestCase):
    def test_thinking_text_and_tool_use(self):
        docs = [
            _p_msg_start(),
            {"type": "ping"},
            _p_block_start(0, {"type": "thinking", "thinking": ""}),
            _p_block_delta(0, "thinking_delta", thinking="Let"),
            _p_block_delta(0, "thinking_delta", thinking=" me"),
            _p_block_start(1, {"type": "text", "text": ""}),
            _p_block_delta(1, "text_delta", text="Sure"),
            _p_block_start(2, {"type": "tool_use", "id": "uzrJnRe3BYtg", "name": "get_weather"}),
            _p_block_delta(2, "input_json_delta", partial_json='{"city":'),
            _p_block_start(3, {"type": "tool_use", "id": "Xk2pQ", "name": "get_time", "input": {}}),
            _p_block_delta(3, "input_json_delta", partial_json="{}"),
            _p_block_delta(2, "input_json_delta", partial_json='"Paris"}'),
            _p_block_delta(0, "signature_delta", signature=""),
            {"type": "content_block_stop", "index": 0},
            {"type": "content_block_stop", "index": 1},
            {"type": "content_block_stop", "index": 2},
            {"type": "content_block_stop", "index": 3},
        ] + _p_msg_end("tool_use")
        data = _p_dialect_http([_p_typed(d) for d in docs])
        events = [
            lc.Reasoning("Let"),
            lc.Reasoning(" me"),
            lc.Content("Sure"),
            lc.ToolCall(0, "uzrJnRe3BYtg", "get_weather", ""),
            lc.ToolCall(0, None, None, '{"city":'),
            lc.ToolCall(1, "Xk2pQ", "get_time", ""),
            lc.ToolCall(1, None, None, "{}"),
            lc.ToolCall(0, None, None, '"Paris"}'),
        ]
        calls = [
            lc.ToolCallResult("uzrJnRe3BYtg", "get_weather", '{"city":"Paris"}'),
            lc.ToolCallResult("Xk2pQ", "get_time", "{}"),
        ]
        completion = _p_event_completion(
            _p_MSG_ID, "Sure", "tool_calls", _p_msg_usage(), _p_msg_final("tool_use"), "Let me", calls, 2
        )
        _p_check_dialect(self, lc._MessagesAssembler, data, ("ok", events, completion))

    def test_the_data_alone_suffices(self):
        docs = [
            _p_msg_start(),
            _p_block_start(0, {"type": "text", "text": ""}),
            _p_block_delta(0, "text_delta", text="a"),
        ] + _p_msg_end()
        data = _p_dialect_http([sse(_p_json(d)) for d in docs])
        completion = _p_event_completion(_p_MSG_ID, "a", "stop", _p_msg_usage(), _p_msg_final())
        _p_check_dialect(self, lc._MessagesAssembler, data, ("ok", [lc.Content("a")], completion))

    def test_stop_reasons_in_chat_words(self):
        for reason, finish in (
            ("end_turn", "stop"),
            ("stop_sequence", "stop"),
            ("max_tokens", "length"),
            ("tool_use", "tool_calls"),
            ("refusal", "content_filter"),
            ("pause_turn", "pause_turn"),
        ):
            asm = lc._MessagesAssembler()
            for doc in [_p_msg_start()] + _p_msg_end(reason, sequence="\n\n" if reason == "stop_sequence" else None):
                asm.feed(_p_json(doc))
            done = asm.completion()
            self.assertEqual(done.finish_reason, finish, reason)
            self.assertEqual(done.final["stop_reason"], reason)
        self.assertEqual(done.final, _p_msg_final("pause_turn"))

    def test_usage_counts_the_cache_in_prompt_tokens(self):
        asm = lc._MessagesAssembler()
        start = _p_msg_start(
            {"cache_read_input_tokens": 20, "input_tokens": 5, "output_tokens": 0, "cache_creation_input_tokens": 7}
        )
        for doc in [start] + _p_msg_end("max_tokens", 4):
            asm.feed(_p_json(doc))
        done = asm.completion()
        self.assertEqual(done.usage, _p_msg_usage(5, 20, 4, {"cache_creation_input_tokens": 7}))
        self.assertEqual(done.usage["prompt_tokens"], 32)
        self.assertEqual(
            done.final["usage"],
            {"cache_read_input_tokens": 20, "input_tokens": 5, "output_tokens": 4, "cache_creation_input_tokens": 7},
        )

    def test_error_events_before_and_after_content(self):
        overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
        for before in (
            [],
            [
                _p_msg_start(),
                _p_block_start(0, {"type": "text", "text": ""}),
                _p_block_delta(0, "text_delta", text="a"),
            ],
        ):
            data = _p_dialect_http([_p_typed(d) for d in before + [overloaded]])
            delivered = [lc.Content("a")] if before else []
            _p_check_dialect(
                self,
                lc._MessagesAssembler,
                data,
                ("raised", delivered, lc.ServerError, "server error None: Overloaded"),
            )
        with self.assertRaises(lc.ServerError) as cm:
            lc._MessagesAssembler().feed(_p_json(overloaded))
        self.assertEqual(cm.exception.type, "overloaded_error")
        with self.assertRaises(lc.ServerError):
            lc._MessagesAssembler().feed(_p_json({"error": {"code": 500, "message": "m", "type": "server_error"}}))

    def test_a_stream_that_ends_before_message_stop_is_stream_closed(self):
        docs = [
            _p_msg_start(),
            _p_block_start(0, {"type": "text", "text": ""}),
            _p_block_delta(0, "text_delta", text="a"),
            _p_msg_end()[0],
        ]
        data = _p_dialect_http([_p_typed(d) for d in docs])
        expect = (
            "raised",
            [lc.Content("a")],
            lc.StreamClosedError,
            "the stream ended before message_stop: the server stopped mid-answer",
        )
        _p_check_dialect(self, lc._MessagesAssembler, data, expect)

    def test_unknown_block_and_event_types_are_ignored(self):
        docs = [
            dict(_p_msg_start(), future=1),
            _p_block_start(0, {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search"}),
            _p_block_delta(0, "citations_delta", citation={}),
            {"type": "content_block_stop", "index": 0},
            _p_block_start(1, {"type": "redacted_thinking", "data": "xyz"}),
            _p_block_start(2, {"type": "text", "text": ""}),
            _p_block_delta(2, "text_delta", text="a", extra=True),
            {"type": "future_event", "payload": [1]},
        ] + _p_msg_end()
        data = _p_dialect_http([_p_typed(d) for d in docs])
        completion = _p_event_completion(_p_MSG_ID, "a", "stop", _p_msg_usage(), _p_msg_final())
        _p_check_dialect(self, lc._MessagesAssembler, data, ("ok", [lc.Content("a")], completion), every=False)

    def test_protocol_errors(self):
        for docs in (
            [{"type": 3}],
            [{"type": "message_start"}],
            [{"type": "message_start", "message": []}],
            [_p_block_delta("0", "text_delta", text="a")],
            [_p_block_delta(0, "input_json_delta", partial_json="{")],  # no tool_use block 0
            [_p_block_start(0, {"type": "text", "text": ""}), _p_block_delta(0, "input_json_delta", partial_json="{")],
            [_p_block_delta(0, "text_delta", text=1)],
            [{"type": "content_block_delta", "index": 0}],
            [{"type": "content_block_start", "index": 0}],
            [_p_msg_start(), {"type": "message_stop"}],  # no stop reason
            [_p_msg_start({"input_tokens": "9"})] + _p_msg_end(),
            [_p_msg_start(), {"type": "message_delta", "delta": {"stop_reason": 1}}],
        ):
            asm = lc._MessagesAssembler()
            with self.subTest(docs=docs), self.assertRaises(lc.ProtocolError):
                for doc in docs:
                    asm.feed(_p_json(doc))

    def test_thinking_cap_state(self):
        asm = lc._MessagesAssembler()
        asm.feed(_p_json(_p_msg_start()))
        self.assertEqual((asm.id, asm.model, asm.done), (_p_MSG_ID, MODEL, False))
        asm.feed(_p_json(_p_block_delta(0, "thinking_delta", thinking="a")))
        self.assertEqual((asm.in_reasoning, asm.reasoning_tokens), (True, 1))
        asm.feed(_p_json(_p_block_start(1, {"type": "tool_use", "id": "t", "name": "n"})))
        self.assertFalse(asm.in_reasoning)
        asm.thinking_capped = True
        for doc in _p_msg_end():
            asm.feed(_p_json(doc))
        self.assertTrue(asm.done)
        self.assertTrue(asm.completion().thinking_capped)


# -- All dialects -----------------------------------------------------------------------------------------


class TestParserDialectsAlike(unittest.TestCase):
    def test_chat_assembler_is_never_done(self):
        asm = lc.Assembler()
        self.assertFalse(asm.done)
        asm.feed(_p_finish(0))
        self.assertFalse(asm.done)  # chat ends by [DONE] or the end of the body, in the pump

    def test_every_dialect_has_the_interface(self):
        for dialect in (lc.Assembler, lc._NativeAssembler, lc._ResponsesAssembler, lc._MessagesAssembler):
            for raw in (False, True):
                asm = dialect(raw_chunks=raw)
                self.assertEqual(
                    (asm.id, asm.model, asm.reasoning_tokens, asm.in_reasoning, asm.thinking_capped, asm.done),
                    (None, None, 0, False, False, False),
                )
                asm.thinking_capped = True
                with self.assertRaises(lc.StreamClosedError):
                    asm.completion()
                for bad in ("", "{", "[1]", "null", " ", '"x"'):
                    if bad == "null" and dialect is lc._NativeAssembler:
                        self.assertEqual(asm.feed(bad), [])  # a stream of several prompts opens with it
                        continue
                    with self.assertRaises(lc.ProtocolError):
                        asm.feed(bad)

    def test_raw_chunks_come_first_in_every_dialect(self):
        for dialect, doc in (
            (lc._NativeAssembler, json.loads(_p_native("a"))),
            (lc._ResponsesAssembler, _p_resp("response.output_text.delta", item_id=_p_MSG, delta="a")),
            (lc._MessagesAssembler, _p_block_delta(0, "text_delta", text="a")),
        ):
            self.assertEqual(dialect(raw_chunks=True).feed(_p_json(doc)), [lc.Chunk(doc), lc.Content("a")])
            self.assertEqual(dialect().feed(_p_json(doc)), [lc.Content("a")])
            self.assertEqual(dialect(raw_chunks=True).feed('{"type":"ping"}'), [lc.Chunk({"type": "ping"})])


class TestParserCompletionFields(unittest.TestCase):
    def test_new_fields_come_last_with_defaults(self):
        self.assertEqual(lc.Completion.__match_args__[-3:], ("choices", "final", "tokens"))
        self.assertEqual(lc.Choice.__match_args__[-2:], ("reasoning_logprobs", "tokens"))
        self.assertEqual(list(inspect.signature(lc.Completion).parameters)[-2:], ["final", "tokens"])
        old = lc.Completion(CID, MODEL, "a", "", [], "stop", None, None, 0, False)
        self.assertEqual((old.final, old.tokens, old.choices[0].tokens), (None, None, None))
        self.assertEqual(lc.Choice(0, "a", "", [], "stop", None).tokens, None)

    def test_round_trips(self):
        choice = lc.Choice(0, "a", "", [], "length", None, None, [1, 2])
        done = lc.Completion(
            None,
            MODEL,
            "a",
            "",
            [],
            "length",
            {"prompt_tokens": 1},
            None,
            choices=(choice,),
            final={"stop": True},
            tokens=[1, 2],
        )
        for copied in (copy.copy(done), copy.deepcopy(done), pickle.loads(pickle.dumps(done))):
            self.assertEqual(copied, done)
        self.assertEqual(done.replace(tokens=None).tokens, None)
        self.assertEqual(done.replace(final=None).final, None)
        doc = done.to_dict()
        self.assertEqual((doc["final"], doc["tokens"], doc["choices"][0]["tokens"]), ({"stop": True}, [1, 2], [1, 2]))
        json.dumps(doc)
        self.assertIn("tokens=[1, 2]", repr(done))
        self.assertEqual(lc.Completion(None, None, "x", "", [], "stop", None, None, tokens=[5]).choices[0].tokens, [5])


class TestParserDialectBodies(unittest.TestCase):
    def test_native(self):
        mm = {"prompt_string": "<__media__> What is it?", "multimodal_data": ["aGk="]}
        for prompt in ("Once upon", [1, 2, 3], [1, "a", 2], ["one", "two"], [[1, 2], "two", [3, "x"]], mm, [mm, "x"]):
            self.assertEqual(
                lc._native_body(prompt, {"n_predict": 3}), {"prompt": prompt, "n_predict": 3, "stream": True}
            )
        self.assertEqual(lc._native_body((1, 2), {"stream": False})["prompt"], [1, 2])
        self.assertIs(lc._native_body("x", {"stream": False})["stream"], True)
        for prompt, error in (
            (None, TypeError),
            (3, TypeError),
            (b"x", TypeError),
            ([], ValueError),
            ([1.5], TypeError),
            ([True], TypeError),
            ([[1], {}], TypeError),
            ({"text": "x"}, TypeError),
            ([[1], []], ValueError),
        ):
            with self.subTest(prompt=prompt), self.assertRaises(error):
                lc._native_body(prompt, {})
        with self.assertRaises(TypeError):
            lc._native_body("x", {"prompt": "y"})
        self.assertNotIn("id_slot", lc._native_body("x", {}))

    def test_infill(self):
        body = lc._infill_body(
            "def f(", "):\n", [("a.py", "x = 1"), {"filename": "b.py", "text": "y"}], {"n_indent": 4}
        )
        self.assertEqual(
            body,
            {
                "input_prefix": "def f(",
                "input_suffix": "):\n",
                "input_extra": [{"filename": "a.py", "text": "x = 1"}, {"filename": "b.py", "text": "y"}],
                "n_indent": 4,
                "stream": True,
            },
        )
        self.assertEqual(lc._infill_body("a", "", None, {}), {"input_prefix": "a", "input_suffix": "", "stream": True})
        self.assertEqual(
            lc._infill_body("a", "", iter([["f", "t"]]), {})["input_extra"], [{"filename": "f", "text": "t"}]
        )
        self.assertEqual(lc._infill_body("a", "", (), {})["input_extra"], [])
        for args, error in (
            ((1, "", None), TypeError),
            (("a", None, None), TypeError),
            (("a", "", "file.py"), TypeError),
            (("a", "", {"filename": "f", "text": "t"}), TypeError),
            (("a", "", 5), TypeError),
            (("a", "", [("f",)]), ValueError),
            (("a", "", [("f", "t", "u")]), ValueError),
            (("a", "", [{"filename": "f"}]), ValueError),
            (("a", "", [{"filename": "f", "text": "t", "x": 1}]), ValueError),
            (("a", "", [("f", 3)]), TypeError),
            (("a", "", [{"filename": 1, "text": "t"}]), TypeError),
            (("a", "", ["f"]), TypeError),
        ):
            with self.subTest(args=args), self.assertRaises(error):
                lc._infill_body(*args, {})
        for key in ("input_prefix", "input_suffix", "input_extra"):
            with self.assertRaises(TypeError):
                lc._infill_body("a", "", None, {key: "x"})

    def test_responses(self):
        self.assertEqual(
            lc._responses_body("Hi", {"max_output_tokens": 8}), {"input": "Hi", "max_output_tokens": 8, "stream": True}
        )
        items = [{"role": "user", "content": "Hi"}]
        self.assertEqual(lc._responses_body(items, {})["input"], items)
        for value, error in ((None, TypeError), (3, TypeError), ([], ValueError), (["Hi"], TypeError)):
            with self.subTest(value=value), self.assertRaises(error):
                lc._responses_body(value, {})
        with self.assertRaises(TypeError):
            lc._responses_body("Hi", {"input": "x"})

    def test_messages(self):
        messages = [{"role": "user", "content": "Hi"}]
        self.assertEqual(
            lc._messages_body(messages, {"max_tokens": 8, "system": "Be brief"}),
            {"messages": messages, "max_tokens": 8, "system": "Be brief", "stream": True},
        )
        self.assertEqual(lc._messages_body(tuple(messages), {})["messages"], messages)
        for value, error in (
            (None, TypeError),
            ("Hi", TypeError),
            ({"role": "user"}, TypeError),
            ([], ValueError),
            (["Hi"], TypeError),
        ):
            with self.subTest(value=value), self.assertRaises(error):
                lc._messages_body(value, {})
        with self.assertRaises(TypeError):
            lc._messages_body(messages, {"messages": []})


# -----------------------------------------------------------------------------------------------------
# Real bytes of /completion, /infill, Responses and Messages (dev/testdata/transcripts/38-67, 85-86, from
# dev/capture.py against this build).  What they show beyond the documented shapes: every /completion chunk
# carries its token's id even without return_tokens, the EOS token too (a chunk with "content": "" and its
# id); each prompt_progress chunk carries a placeholder "tokens": [0]; a stream of several prompts opens
# with `data: null`; a stop word is held back (its chunk has "content": "" and the token); an error
# mid-stream is `data: {"error": ...}` on /completion and Responses, but a bare `data: {"code": 500,
# "message": ..., "type": "server_error"}` on Messages (no envelope, no `event: error`); Responses'
# function_call items carry both "id" (what the argument deltas name as item_id) and "call_id", the deltas
# carry no output_index, response.created has no model, prompt_progress rides beside "response" in
# response.in_progress, the timings beside it in response.completed, and max_output_tokens ends
# "completed"; Messages' message_start counts input_tokens without the cached tokens.
# -----------------------------------------------------------------------------------------------------


def _p_data_docs(raw):
    """Every data payload of a captured stream, parsed (the bytes' own lines, not the decoders)."""
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


_p_GEMMA = "/root/.cache/loopclient/gemma-3-270m-q4_k_m.gguf"
_p_SKY = [" the", " limit", " for", " the", " ", "2", "0", "1"]
_p_SKY_TOKENS = [506, 4576, 573, 506, 236743, 236778, 236771, 236770]


class TestParserDialectTranscripts(unittest.TestCase):
    def transcript(self, name):
        return load_transcript(name)  # the captures ship with the code: a missing one fails

    def check(self, dialect, raw, expect):
        # every offset where that stays quick; 300 seeded offsets (and the random sets) for the longer captures
        _p_check_dialect(self, dialect, raw, expect, every=len(raw) <= 6000)
        outcome = _p_dialect_outcome(dialect, [raw], raw_chunks=True)  # the same with a Chunk before each
        self.assertEqual([e for e in outcome[1] if type(e) is not lc.Chunk], expect[1])
        self.assertEqual(outcome[2:], expect[2:])

    def native(self, raw, choices, model=_p_GEMMA):
        docs = [d for d in _p_data_docs(raw) if d is not None]
        finals = {d["index"]: d for d in docs if d.get("stop")}
        evaluated = sum(f["tokens_evaluated"] for f in finals.values())
        predicted = sum(f["tokens_predicted"] for f in finals.values())
        usage = {
            "tokens_evaluated": evaluated,
            "tokens_predicted": predicted,
            "tokens_cached": sum(f["tokens_cached"] for f in finals.values()),
            "prompt_tokens": evaluated,
            "completion_tokens": predicted,
            "total_tokens": evaluated + predicted,
        }
        first = choices[0]
        return lc.Completion(
            id=None,
            model=model,
            content=first.content,
            reasoning="",
            tool_calls=[],
            finish_reason=first.finish_reason,
            usage=usage,
            timings=finals[max(finals, key=lambda i: docs.index(finals[i]))]["timings"],
            choices=choices,
            final=finals[first.index],
            tokens=first.tokens,
        )

    def test_40_completion_tokens_and_probabilities(self):
        raw = self.transcript("40_completion_stream_tokens_probs.raw.txt")
        probs = [e for d in _p_data_docs(raw) for e in d.get("completion_probabilities", [])]
        self.assertEqual(len(probs), 8)
        self.assertEqual(probs[0]["top_logprobs"][1]["token"], " blue")
        choice = lc.Choice(0, "".join(_p_SKY), "", [], "length", probs, None, _p_SKY_TOKENS)
        self.check(lc._NativeAssembler, raw, ("ok", [lc.Content(w) for w in _p_SKY], self.native(raw, (choice,))))

    def test_41_completion_progress_leaves_the_placeholder_token_out(self):
        raw = self.transcript("41_completion_stream_progress.raw.txt")
        events = [lc.Progress(3, 4, 3, 0.0), lc.Progress(4, 4, 3, 15.0)] + [lc.Content(w) for w in _p_SKY]
        choice = lc.Choice(0, "".join(_p_SKY), "", [], "length", None, None, _p_SKY_TOKENS)
        self.check(lc._NativeAssembler, raw, ("ok", events, self.native(raw, (choice,))))

    def test_42_completion_token_id_prompt(self):
        raw = self.transcript("42_completion_stream_token_ids.raw.txt")
        choice = lc.Choice(0, "".join(_p_SKY), "", [], "length", None, None, _p_SKY_TOKENS)
        self.check(lc._NativeAssembler, raw, ("ok", [lc.Content(w) for w in _p_SKY], self.native(raw, (choice,))))

    def test_43_two_prompts_open_with_null(self):
        raw = self.transcript("43_completion_stream_two_prompts.raw.txt")
        self.assertIsNone(_p_data_docs(raw)[0])
        grass = [" green", ",", " the", " trees", " are", " green", ",", " and"]
        events = []
        for g, s in zip(grass, _p_SKY):
            events += [lc.Content(g, 1), lc.Content(s, 0)]
        choices = (
            lc.Choice(0, "".join(_p_SKY), "", [], "length", None, None, _p_SKY_TOKENS),
            lc.Choice(
                1, "".join(grass), "", [], "length", None, None, [3826, 236764, 506, 7146, 659, 3826, 236764, 532]
            ),
        )
        self.check(lc._NativeAssembler, raw, ("ok", events, self.native(raw, choices)))

    def test_46_a_stop_word_is_held_back(self):
        raw = self.transcript("46_completion_stream_stop_word.raw.txt")
        choice = lc.Choice(0, "", "", [], "stop", None, None, [506])
        done = self.native(raw, (choice,))
        self.assertEqual(done.final["stopping_word"], " the")
        self.check(lc._NativeAssembler, raw, ("ok", [], done))

    def test_47_completion_error_mid_stream(self):
        raw = self.transcript("47_completion_midstream_error.raw.txt")
        words = ["<", "think", ">", " is", " the", " sky", " blue", " is"]
        message = (
            "server error 500: got exception: Unexpected empty grammar stack after accepting piece: <unused24> (30)"
        )
        self.check(lc._NativeAssembler, raw, ("raised", [lc.Content(w) for w in words], lc.ServerError, message))

    def test_38_infill_error_mid_stream(self):
        raw = self.transcript("38_infill_midstream_error.raw.txt")
        words = ["<", "think", ">", "def", " add", "b", "to", "a"]
        message = (
            "server error 500: got exception: Unexpected empty grammar stack after accepting piece: <unused24> (30)"
        )
        self.check(lc._NativeAssembler, raw, ("raised", [lc.Content(w) for w in words], lc.ServerError, message))

    def test_48_infill(self):
        raw = self.transcript("48_infill_stream.raw.txt")
        words = ["\n", "    "] * 4
        choice = lc.Choice(0, "".join(words), "", [], "length", None, None, [107, 140] * 4)
        done = self.native(raw, (choice,), model="/root/.cache/loopclient/gemma-3-270m-q4_k_m-fim.gguf")
        self.check(lc._NativeAssembler, raw, ("ok", [lc.Content(w) for w in words], done))

    def event_completion(self, raw, content, finish, reasoning="", calls=(), reasoning_tokens=0, messages=False):
        docs = _p_data_docs(raw)
        if messages:
            start, delta = docs[0]["message"], [d for d in docs if d["type"] == "message_delta"][-1]
            final = dict(
                start, stop_reason=delta["delta"]["stop_reason"], stop_sequence=delta["delta"]["stop_sequence"]
            )
            final["usage"] = dict(start["usage"], **delta["usage"])
            u = final["usage"]
            prompt = u["input_tokens"] + u["cache_read_input_tokens"]
            usage = dict(
                u, prompt_tokens=prompt, completion_tokens=u["output_tokens"], total_tokens=prompt + u["output_tokens"]
            )
            cid, timings = start["id"], None
        else:
            last = docs[-1]
            final, timings, u = last["response"], last["timings"], last["response"]["usage"]
            usage = dict(u, prompt_tokens=u["input_tokens"], completion_tokens=u["output_tokens"])
            cid = final["id"]
        calls = list(calls)
        return lc.Completion(
            id=cid,
            model=_p_GEMMA,
            content=content,
            reasoning=reasoning,
            tool_calls=calls,
            finish_reason=finish,
            usage=usage,
            timings=timings,
            reasoning_tokens=reasoning_tokens,
            choices=(lc.Choice(0, content, reasoning, calls, finish, None),),
            final=final,
        )

    _SEA = ["Write", " one", " sentence", " about", " the", " sea", ".<", "|"]

    def test_50_responses_text(self):
        raw = self.transcript("50_responses_stream.raw.txt")
        done = self.event_completion(raw, "".join(self._SEA), "stop")
        self.assertEqual((done.usage["input_tokens"], done.usage["output_tokens"]), (30, 8))
        self.check(lc._ResponsesAssembler, raw, ("ok", [lc.Content(w) for w in self._SEA], done))

    def test_53_responses_max_output_tokens_ends_completed(self):
        raw = self.transcript("53_responses_max_output_tokens.raw.txt")
        words = ["Tell", " me", " a", " story"]
        done = self.event_completion(raw, "Tell me a story", "stop")  # the server says completed: so do we
        self.assertEqual(done.final["status"], "completed")
        self.check(lc._ResponsesAssembler, raw, ("ok", [lc.Content(w) for w in words], done))

    def test_54_responses_error_mid_stream(self):
        raw = self.transcript("54_responses_midstream_error.raw.txt")
        events = [lc.Reasoning(w) for w in ["is", " the", " sky", " blue", " is"]]
        message = (
            "server error 500: got exception: Unexpected empty grammar stack after accepting piece: <unused24> (30)"
        )
        self.check(lc._ResponsesAssembler, raw, ("raised", events, lc.ServerError, message))

    def test_60_messages_text(self):
        raw = self.transcript("60_messages_stream.raw.txt")
        done = self.event_completion(raw, "".join(self._SEA), "length", messages=True)
        self.assertEqual(done.usage["prompt_tokens"], 30)  # 1 + 29 from the cache, as Responses counts it
        self.check(lc._MessagesAssembler, raw, ("ok", [lc.Content(w) for w in self._SEA], done))

    def test_61_messages_thinking(self):
        raw = self.transcript("61_messages_thinking.raw.txt")
        thinking = ["blue", " sky", "\n"]
        words = ["yes", "<", "|", "im", "_", "end", "|>", "\n", "<", "|", "im", "_", "start"]
        events = [lc.Reasoning(w) for w in thinking] + [lc.Content(w) for w in words]
        done = self.event_completion(
            raw, "".join(words), "length", "".join(thinking), reasoning_tokens=3, messages=True
        )
        self.check(lc._MessagesAssembler, raw, ("ok", events, done))

    def expected_events(self, raw):
        """The events a capture's data payloads say, read off the payloads directly (a test's own reading)."""
        events, calls = [], {}
        for doc in _p_data_docs(raw):
            kind, delta = doc.get("type"), doc.get("delta")
            if "prompt_progress" in doc:
                p = doc["prompt_progress"]
                events.append(lc.Progress(p["processed"], p["total"], p["cache"], float(p["time_ms"])))
            if kind == "response.output_text.delta":
                events.append(lc.Content(delta))
            elif kind == "response.reasoning_text.delta":
                events.append(lc.Reasoning(delta))
            elif kind == "response.output_item.added" and doc["item"]["type"] == "function_call":
                calls[doc["item"]["id"]] = len(calls)
                events.append(lc.ToolCall(len(calls) - 1, doc["item"]["call_id"], doc["item"]["name"], ""))
            elif kind == "response.function_call_arguments.delta":
                events.append(lc.ToolCall(calls[doc["item_id"]], None, None, delta))
            elif kind == "content_block_start" and doc["content_block"]["type"] == "tool_use":
                calls[doc["index"]] = len(calls)
                block = doc["content_block"]
                events.append(lc.ToolCall(len(calls) - 1, block["id"], block["name"], ""))
            elif kind == "content_block_delta":
                if delta["type"] == "text_delta":
                    events.append(lc.Content(delta["text"]))
                elif delta["type"] == "thinking_delta":
                    events.append(lc.Reasoning(delta["thinking"]))
                elif delta["type"] == "input_json_delta":
                    events.append(lc.ToolCall(calls[doc["index"]], None, None, delta["partial_json"]))
        return events

    def generic(self, name, finish, messages=False):
        raw = self.transcript(name)
        events = self.expected_events(raw)
        content = "".join(e.text for e in events if type(e) is lc.Content)
        reasoning = "".join(e.text for e in events if type(e) is lc.Reasoning)
        calls = {}
        for e in events:
            if type(e) is lc.ToolCall:
                entry = calls.setdefault(e.index, [e.id, e.name, ""])
                entry[2] += e.arguments
        calls = [lc.ToolCallResult(*calls[i]) for i in sorted(calls)]
        rt = sum(1 for e in events if type(e) is lc.Reasoning)
        done = self.event_completion(raw, content, finish, reasoning, calls, rt, messages)
        self.check(lc._MessagesAssembler if messages else lc._ResponsesAssembler, raw, ("ok", events, done))
        return done

    def test_51_responses_reasoning_then_text(self):
        done = self.generic("51_responses_reasoning_grammar.raw.txt", "stop")
        self.assertEqual(
            (done.reasoning, done.content, done.reasoning_tokens), ("is the sky blue is a", "the answer is yes", 6)
        )

    def test_52_responses_function_call(self):
        done = self.generic("52_responses_tool_call.raw.txt", "tool_calls")
        cid = "call_WuvgdAuvDRouqUfLNEvkLZ0FpcOWMKcw"  # the item's call_id, not its id fc_...
        self.assertEqual(done.tool_calls, [lc.ToolCallResult(cid, "get_weather", '{"city": "Paris "}')])

    def test_56_responses_progress_beside_the_response(self):
        done = self.generic("56_responses_stream_progress.raw.txt", "stop")
        self.assertEqual(done.content, "The lighthouse keeper")
        events = _p_dialect_outcome(lc._ResponsesAssembler, [self.transcript("56_responses_stream_progress.raw.txt")])[
            1
        ]
        self.assertEqual(events[:2], [lc.Progress(9, 114, 9, 0.0), lc.Progress(114, 114, 9, 4003.0)])

    def test_85_responses_reasoning(self):
        done = self.generic("85_responses_reasoning_control.raw.txt", "stop")
        self.assertEqual((done.content, done.reasoning_tokens), ("the answer is yes", 75))

    def test_62_messages_tool_use(self):
        done = self.generic("62_messages_tool_use.raw.txt", "tool_calls", messages=True)
        self.assertEqual(
            done.tool_calls, [lc.ToolCallResult("pbitHA1orxPQ2XjiPUvz7STbslHDhXhW", "get_weather", '{"city": "Paris"}')]
        )
        self.assertEqual(done.final["stop_reason"], "tool_use")

    def test_63_65_86_messages_more(self):
        for name, thinking in (
            ("63_messages_max_tokens.raw.txt", ""),
            ("65_messages_thinking_budget.raw.txt", "blue"),
            ("86_messages_reasoning_control.raw.txt", "blue sky\n"),
        ):
            with self.subTest(name=name):
                done = self.generic(name, "length", messages=True)
                self.assertEqual(done.reasoning, thinking)

    def test_67_messages_bare_error_object_mid_stream(self):
        raw = self.transcript("67_messages_midstream_error.raw.txt")
        self.assertIn(b'data: {"code":500,"message":', raw)  # no "error" envelope, no event: line
        events = self.expected_events(raw)
        self.assertEqual(len(events), 8)
        message = "server error 500: The model produced output that does not match the expected peg-native format"
        self.check(lc._MessagesAssembler, raw, ("raised", events, lc.ServerError, message))

    def test_39_completion_to_eos(self):
        raw = self.transcript("39_completion_stream_eos.raw.txt")
        words = ["<", "think", ">", " is", " the", " sky", " blue", " is", " ", "</", "think", ">"]
        words += ["the", " ", "answer", " is", " yes"]
        tokens = [236820, 36345, 236813, 563, 506, 7217, 3730, 563, 236743, 954, 36345, 236813, 1437, 236743]
        tokens += [14433, 563, 11262, 1]  # the EOS token's own chunk: content "", tokens [1]
        choice = lc.Choice(0, "".join(words), "", [], "stop", None, None, tokens)
        done = self.native(raw, (choice,))
        self.assertEqual(done.final["stop_type"], "eos")
        self.check(lc._NativeAssembler, raw, ("ok", [lc.Content(w) for w in words], done))


# -- /v1/completions (OpenAI text completions) and a router's /models/sse ---------------------------------


def _t_payloads(raw):
    """Every data payload of a captured stream: parsed, or the bare string ([DONE])."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: "):
            text = line[6:].decode()
            out.append(text if text == "[DONE]" else json.loads(text))
    return out


def _t_pump_outcome(dialect, pieces, raw_chunks=False):
    """The pump (which reads [DONE]) fed ``pieces``: ("ok", events, completion) or ("raised", events
    delivered first, error class, message)."""
    pump = lc.ResponsePump(lc.Limits(), raw_chunks, dialect)
    events = []
    try:
        for piece in pieces + [None]:
            events += pump.feed(piece) if piece is not None else pump.feed_eof()
            if pump.failed is not None:
                raise pump.failed
            if pump.outcome is not None:
                return ("ok", events, pump.outcome)
    except lc.LoopError as exc:
        return ("raised", events, type(exc), str(exc))
    return ("no outcome", events)


#: What captures 90-92 stream for "The sky is" (max_tokens 8), and 91 for "The grass is"
_t_GRASS = [" greener", " on", " the", " other", " side", " of", " the", " fence"]


class TestParserTextCompletionsDialect(unittest.TestCase):
    """/v1/completions as the real server streamed it (captures 90-96): fed whole, byte by byte, split at
    every offset (300 seeded ones for the longer captures) and at random sets of offsets, through the pump."""

    def check(self, raw, expect, raw_chunks=False):
        for label, pieces in _p_stream_splittings(raw, every=len(raw) <= 6000):
            got = _t_pump_outcome(lc._TextAssembler, pieces, raw_chunks)
            if got != expect:
                self.fail("%s: got %s\nexpected %s" % (label, _p_short(got, 3000), _p_short(expect, 3000)))

    def completion(self, raw, choices, usage_from=-1):
        """The Completion the capture's own bytes say: chat's fields, the finals' usage (the last one's, as
        chat merges them) and timings, no final object, no token ids."""
        docs = [d for d in _t_payloads(raw) if isinstance(d, dict)]
        finals = [d for d in docs if d["choices"] and d["choices"][0]["finish_reason"] is not None]
        first = choices[0]
        return lc.Completion(
            id=docs[0]["id"],
            model=_p_GEMMA,
            content=first.content,
            reasoning="",
            tool_calls=[],
            finish_reason=first.finish_reason,
            usage=finals[usage_from]["usage"],
            timings=finals[-1]["timings"],
            choices=choices,
        )

    def logprobs(self, raw, index):
        return [
            e
            for d in _t_payloads(raw)
            if isinstance(d, dict)
            for c in d["choices"]
            if c["index"] == index and c["logprobs"]
            for e in c["logprobs"]["content"]
        ]

    def test_90_text_deltas_and_logprobs(self):
        raw = load_transcript("90_completions_oai_stream_logprobs.raw.txt")
        payloads = _t_payloads(raw)
        self.assertEqual(payloads[-1], "[DONE]")
        self.assertEqual(payloads[-2]["usage"], {**payloads[-2]["usage"], "prompt_tokens": 4, "completion_tokens": 8})
        probs = self.logprobs(raw, 0)
        self.assertEqual(len(probs), 8)
        self.assertEqual(probs[0]["top_logprobs"][1]["token"], " blue")
        choice = lc.Choice(0, "".join(_p_SKY), "", [], "length", probs, None)
        expect = self.completion(raw, (choice,))
        self.assertTrue(expect.id.startswith("chatcmpl-"))
        self.check(raw, ("ok", [lc.Content(w) for w in _p_SKY], expect))

    def test_90_raw_chunks_come_first(self):
        raw = load_transcript("90_completions_oai_stream_logprobs.raw.txt")
        docs = [d for d in _t_payloads(raw) if isinstance(d, dict)]
        events = []
        for doc in docs:
            events.append(lc.Chunk(doc))
            text = doc["choices"][0]["text"]
            if text:
                events.append(lc.Content(text))
        outcome = _t_pump_outcome(lc._TextAssembler, [raw], raw_chunks=True)
        self.assertEqual(outcome[:2], ("ok", events))

    def test_91_two_prompts_are_two_choices_opened_by_null(self):
        raw = load_transcript("91_completions_oai_stream_two_prompts.raw.txt")
        self.assertIsNone(_t_payloads(raw)[0])
        events = []
        for g, s in zip(_t_GRASS, _p_SKY):  # interleaved, choice 1 first
            events += [lc.Content(g, 1), lc.Content(s, 0)]
        choices = (
            lc.Choice(0, "".join(_p_SKY), "", [], "length", self.logprobs(raw, 0), None),
            lc.Choice(1, "".join(_t_GRASS), "", [], "length", self.logprobs(raw, 1), None),
        )
        expect = self.completion(raw, choices)
        # each choice's closing chunk has its own usage, of its own prompt: the last one's is kept, as chat does
        self.assertEqual((expect.usage["prompt_tokens"], expect.usage["completion_tokens"]), (4, 8))
        self.check(raw, ("ok", events, expect))

    def test_92_progress_before_the_text(self):
        raw = load_transcript("92_completions_oai_stream_progress.raw.txt")
        events = [lc.Progress(3, 4, 3, 0.0), lc.Progress(4, 4, 3, 16.0)] + [lc.Content(w) for w in _p_SKY]
        choice = lc.Choice(0, "".join(_p_SKY), "", [], "length", None, None)
        self.check(raw, ("ok", events, self.completion(raw, (choice,))))

    def test_94_95_echo_and_suffix_are_ignored_by_this_server(self):
        for name in ("94_completions_oai_echo.raw.txt", "95_completions_oai_suffix.raw.txt"):
            with self.subTest(name=name):
                raw = load_transcript(name)
                outcome = _t_pump_outcome(lc._TextAssembler, [raw])
                self.assertEqual(outcome[:2], ("ok", [lc.Content(w) for w in _p_SKY]))

    def test_96_an_error_in_mid_stream(self):
        raw = load_transcript("96_completions_oai_midstream_error.raw.txt")
        words = ["<", "think", ">", " is", " the", " sky", " blue", " is"]
        message = "got exception: Unexpected empty grammar stack after accepting piece: <unused24> (30)"
        expect = ("raised", [lc.Content(w) for w in words], lc.ServerError, "server error 500: " + message)
        self.check(raw, expect)

    def test_the_end_without_done_or_a_finish(self):
        raw = load_transcript("90_completions_oai_stream_logprobs.raw.txt")
        done = raw.rindex(b"e\r\ndata: [DONE]")
        got = _t_pump_outcome(lc._TextAssembler, [raw[:done] + b"0\r\n\r\n"])  # [DONE] left out: finished anyway
        self.assertEqual((got[0], got[2].finish_reason), ("ok", "length"))
        last = raw.rindex(b"\r\n278\r\n")  # the closing chunk left out too
        got = _t_pump_outcome(lc._TextAssembler, [raw[: last + 2] + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"])
        self.assertEqual((got[0], got[2]), ("raised", lc.StreamClosedError))

    def test_shapes_it_refuses(self):
        for payload, message in (
            ('{"choices":[{"index":0,"text":5}]}', "'text' is not a string"),
            ('{"choices":[{"index":"0","text":"x"}]}', "'index' is not an integer"),
            ('{"choices":{"index":0}}', "'choices' is not a list"),
            ("[1]", "not a JSON object"),
        ):
            with self.subTest(payload=payload), self.assertRaises(lc.ProtocolError) as caught:
                lc._TextAssembler().feed(payload)
            self.assertIn(message, str(caught.exception))
        self.assertEqual(lc._TextAssembler().feed('{"choices":[{"index":0,"text":"","delta":{"content":"x"}}]}'), [])


class TestParserModelEvents(unittest.TestCase):
    """A router's GET /models/sse as it streamed (captures 98, 99): one ModelEvent per payload, and the
    connection's end is StreamClosedError (the route has no end of its own)."""

    def expect(self, raw):
        return [lc.ModelEvent(d["model"], d["event"], d.get("data")) for d in _t_payloads(raw)]

    def test_98_a_model_loads(self):
        raw = load_transcript("98_router_models_sse.raw.txt")
        events = self.expect(raw)
        self.assertEqual(
            [(e.model, e.event, (e.data or {}).get("status")) for e in events],
            [("beta", "model_status", "loading")]
            + [("beta", "status_change", "loading")] * 3
            + [("beta", "status_change", "loaded")],
        )
        self.assertEqual(events[-1].data["info"]["id"], "beta")
        outcome = _p_dialect_outcome(lc._ModelEvents, [raw])
        self.assertEqual(outcome[:3], ("raised", events, lc.StreamClosedError))
        _p_check_dialect(self, lc._ModelEvents, raw, outcome)

    def test_99_a_model_that_cannot_load(self):
        raw = load_transcript("99_router_load_broken.raw.txt")
        events = self.expect(raw)
        self.assertEqual(events[-1], lc.ModelEvent("broken", "status_change", {"status": "unloaded", "exit_code": 1}))
        outcome = _p_dialect_outcome(lc._ModelEvents, [raw])
        self.assertEqual(outcome[:3], ("raised", events, lc.StreamClosedError))
        _p_check_dialect(self, lc._ModelEvents, raw, outcome)

    def test_the_closed_stream_says_so(self):
        asm = lc._ModelEvents()
        self.assertEqual(asm.feed('{"model":"*","event":"models_reload"}'), [lc.ModelEvent("*", "models_reload", None)])
        with self.assertRaises(lc.StreamClosedError) as caught:
            asm.completion()
        self.assertIn("/models/sse", str(caught.exception))

    def test_raw_chunks_and_shapes_it_refuses(self):
        doc = {"model": "a", "event": "download_progress", "data": {"x": 1}}
        self.assertEqual(
            lc._ModelEvents(True).feed(json.dumps(doc)),
            [lc.Chunk(doc), lc.ModelEvent("a", "download_progress", {"x": 1})],
        )
        for payload in (
            '{"event":"x"}',
            '{"model":"a"}',
            '{"model":1,"event":"x"}',
            '{"model":"a","event":"x","data":[]}',
            "null",
        ):
            with self.subTest(payload=payload), self.assertRaises(lc.ProtocolError):
                lc._ModelEvents().feed(payload)

    def test_model_event_is_a_value_object(self):
        event = lc.ModelEvent("alpha", "status_change", {"status": "loaded"})
        self.assertEqual(event, copy.deepcopy(event))
        self.assertEqual(pickle.loads(pickle.dumps(event)), event)
        self.assertEqual(repr(event), "ModelEvent(model='alpha', event='status_change', data={'status': 'loaded'})")
        self.assertEqual(list(inspect.signature(lc.ModelEvent).parameters), ["model", "event", "data"])
        with self.assertRaises(AttributeError):
            event.model = "beta"
        self.assertIn("ModelEvent", lc.__all__)


# =====================================================================================================
# Tier 2. Transport and client: streams, single-shot calls, the server API, TLS, prefixes, routing
# =====================================================================================================


class TestClientStream(ServerCase):
    limits = SOCKETS

    def test_stream_assembles_real_server_bytes(self):
        self.use(serve_body(content_stream(["Write", " one", " sentence"])))
        completion, events = self.collect(max_tokens=16, temperature=0)
        self.assertEqual(events, [lc.Content("Write"), lc.Content(" one"), lc.Content(" sentence")])
        self.assertEqual(
            completion,
            lc.Completion(
                id=CID,
                model=MODEL,
                content="Write one sentence",
                reasoning="",
                tool_calls=[],
                finish_reason="stop",
                usage=USAGE,
                timings=TIMINGS,
                reasoning_tokens=0,
                thinking_capped=False,
            ),
        )

    def test_transcript_04_replayed_byte_for_byte(self):
        raw = load_transcript("04_chat_stream.raw.txt")
        self.use(reply(raw))
        completion, events = self.collect()
        self.assertEqual(completion.content, "Write one sentence about the sea.<|im_end|>\n<|im")
        self.assertEqual(completion.finish_reason, "length")
        self.assertEqual(completion.timings["predicted_n"], 16)
        self.assertEqual(len(events), 16)

    def test_request_bytes_follow_the_wire_rules(self):
        self.use(serve_body(content_stream(["ok"])))
        self.collect(
            slot=1,
            max_tokens=8,
            tools=[{"type": "function", "function": {"name": "f"}}],
            stop=["\n"],
            seed=7,
            chat_template_kwargs={"enable_thinking": True},
            stream_options={"continuous_usage_stats": True},
        )
        req = self.server.chat_requests()[0]
        head = req.raw_head.decode()
        self.assertTrue(head.startswith("POST /v1/chat/completions HTTP/1.1\r\n"))
        self.assertEqual(req.headers["host"], self.server.address[len("http://") :] if self.tcp else "localhost")
        self.assertEqual(req.headers["content-type"], "application/json")
        self.assertEqual(req.headers["accept"], "text/event-stream")
        self.assertEqual(req.headers["user-agent"], "loopclient/" + lc.__version__)
        self.assertEqual(int(req.headers["content-length"]), len(req.body))
        self.assertNotIn("authorization", req.headers)
        self.assertEqual(
            req.json(),
            {
                "messages": MSGS,
                "max_tokens": 8,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "stop": ["\n"],
                "seed": 7,
                "chat_template_kwargs": {"enable_thinking": True},
                "stream": True,
                "stream_options": {"continuous_usage_stats": True, "include_usage": True},
                "id_slot": 1,
            },
        )

    def test_any_slot_sends_no_id_slot(self):
        self.use(serve_body(content_stream(["ok"])))
        self.collect(slot=None)
        self.assertNotIn("id_slot", self.server.chat_requests()[0].json())

    def test_api_key_and_extra_headers(self):
        self.use(serve_body(content_stream(["ok"])))
        client = self.new_client(self.server.address, limits=FAST, api_key="sk-secret", headers={"X-Trace": "1"})
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
        body = (
            chunked(
                sse(chunk_json({"role": "assistant", "content": None})),
                sse(chunk_json({"reasoning_content": "think"})),
                sse(chunk_json({"reasoning_content": ""})),
                sse(chunk_json({"reasoning_content": " more"})),
                sse(
                    chunk_json(
                        {
                            "tool_calls": [
                                {
                                    "index": 0,
                                    "id": "call1",
                                    "type": "function",
                                    "function": {"name": "get_weather", "arguments": "{"},
                                }
                            ]
                        }
                    )
                ),
                sse(chunk_json({"tool_calls": [{"index": 0, "function": {"arguments": '"city": "Paris"}'}}]})),
                sse(chunk_json({}, "tool_calls")),
                b"data: [DONE]\n\n",
            )
            + b"0\r\n\r\n"
        )
        self.use(serve_body(body))
        completion, events = self.collect()
        self.assertEqual(
            events,
            [
                lc.Reasoning("think"),
                lc.Reasoning(" more"),
                lc.ToolCall(0, "call1", "get_weather", "{"),
                lc.ToolCall(0, None, None, '"city": "Paris"}'),
            ],
        )
        self.assertEqual(completion.reasoning, "think more")
        self.assertEqual(completion.reasoning_tokens, 2)
        self.assertEqual(completion.tool_calls, [lc.ToolCallResult("call1", "get_weather", '{"city": "Paris"}')])
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
            req.wait_peer_close(30)  # never sends the 0 chunk: the client must not wait for it

        self.use(handler)
        completion, _ = self.collect()
        self.assertEqual(completion.content, "x")
        # the client ended the response itself: a client that read on for the 0 chunk would have been told
        # StalledError after liveness (2 s), long before the server gave up holding the connection (30 s)
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(10))

    def test_http_error_status_carries_the_envelope(self):
        body = (
            b'{"error":{"code":400,"message":"request (3024 tokens) exceeds the available context size (1024 tokens),'
            b' try increasing it","type":"exceed_context_size_error","n_prompt_tokens":3024,"n_ctx":1024}}'
        )
        self.use(reply(http_response(body, status=b"400 Bad Request")))
        with self.assertRaises(lc.HTTPStatusError) as cm:
            self.collect()
        self.assertEqual(cm.exception.status, 400)
        self.assertEqual(
            cm.exception.message,
            "request (3024 tokens) exceeds the available context size (1024 tokens), try increasing it",
        )
        self.assertEqual(cm.exception.body, body)
        self.assertEqual(len(self.server.chat_requests()), 1)

    def test_midstream_error_event_is_server_error_and_not_replayed(self):
        body = (
            chunked(
                sse(chunk_json({"role": "assistant", "content": None})),
                sse(chunk_json({"reasoning_content": "is"})),
                b'data: {"error":{"code":500,"message":"got exception: boom","type":"server_error"}}\n\n',
            )
            + b"0\r\n\r\n"
        )
        self.use(serve_body(body))
        with self.assertRaises(lc.ServerError) as cm:
            self.collect()
        self.assertEqual(
            (cm.exception.code, cm.exception.message, cm.exception.type), (500, "got exception: boom", "server_error")
        )
        self.assertEqual(len(self.server.chat_requests()), 1)


class TestClientStreamAsync(AsyncDriver, TestClientStream):
    pass


class TestClientStreamTCP(TestClientStream):
    tcp = True


class TestClientStreamTCPAsync(AsyncDriver, TestClientStreamTCP):
    pass


class TestSingleShot(ServerCase):
    def test_slots_health_props_models(self):
        self.server.busy[1] = True
        self.server.route(
            "GET", "/v1/models", lambda req: respond_json(req, {"object": "list", "data": [{"id": MODEL}]})
        )
        slots = self.client.slots()
        self.assertEqual([(s.id, s.is_processing) for s in slots], [(0, False), (1, True)])
        self.assertEqual(slots[0].raw["n_ctx"], 1024)
        self.assertEqual(self.client.health(), {"status": "ok"})
        self.assertEqual(self.client.props()["total_slots"], 2)
        self.assertEqual(self.client.models()["data"][0]["id"], MODEL)

    def test_loading_server_is_http_status_error(self):
        self.server.route(
            "GET",
            "/health",
            lambda req: respond_json(
                req,
                {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}},
                503,
                "Service Unavailable",
            ),
        )
        with self.assertRaises(lc.HTTPStatusError) as cm:
            self.client.health()
        self.assertEqual((cm.exception.status, cm.exception.message), (503, "Loading model"))

    def test_unknown_endpoint_404(self):
        with self.assertRaises(lc.HTTPStatusError) as cm:
            self.client.models()
        self.assertEqual((cm.exception.status, cm.exception.message), (404, "File Not Found"))

    def test_missing_socket_is_connect_error(self):
        client = self.new_client(self.server.tmp + "/missing.sock", limits=FAST)
        with self.assertRaises(lc.ConnectError) as cm:
            client.health()
        self.assertEqual(cm.exception.address, self.server.tmp + "/missing.sock")
        self.assertIsInstance(cm.exception.__cause__, FileNotFoundError)

    def test_end_reasoning(self):
        seen = []

        def control(req):
            seen.append(req.json())
            respond_json(req, {"success": req.json()["id"] == "chatcmpl-1"})

        self.server.route("POST", "/v1/chat/completions/control", control)
        self.assertTrue(self.client.end_reasoning("chatcmpl-1"))
        self.assertFalse(self.client.end_reasoning("chatcmpl-2"))
        self.assertEqual(seen[0], {"id": "chatcmpl-1", "action": "reasoning_end"})


class TestSingleShotAsync(AsyncDriver, TestSingleShot):
    pass


class TestClientEdges(ServerCase):
    limits = SOCKETS

    """Edge cases of streams and single-shot calls."""

    def test_many_deltas_fold_into_the_exact_text(self):
        words = ["w%d " % i for i in range(5000)]
        self.use(serve_body(content_stream(words)))
        completion, events = self.collect()
        self.assertEqual(completion.content, "".join(words))
        self.assertEqual(len(events), 5000)

    def test_mistyped_delta_fields_are_protocol_errors(self):
        for delta in (
            {"reasoning_content": 5},
            {"content": ["x"]},
            {"tool_calls": "x"},
            {"tool_calls": [{"index": 0, "function": "x"}]},
            {"content": "a", "reasoning_content": {}},
        ):
            with self.subTest(delta=delta):
                self.use(
                    serve_body(chunked(sse(chunk_json({"role": "assistant"})), sse(chunk_json(delta))) + b"0\r\n\r\n")
                )
                with self.assertRaises(lc.ProtocolError):
                    self.collect()

    def test_single_shot_bodies(self):
        self.server.route("GET", "/health", reply(b'HTTP/1.0 200 OK\r\n\r\n{"status":"ok"}'))
        self.assertEqual(self.client.health(), {"status": "ok"})  # read until close
        self.server.route("GET", "/props", lambda req: respond_json(req, [1, 2]))
        with self.assertRaises(lc.ProtocolError):
            self.client.props()
        self.server.route("GET", "/slots", lambda req: respond_json(req, {"slots": []}))
        with self.assertRaises(lc.ProtocolError):
            self.client.slots()
        deep = b"[" * 100000 + b"]" * 100000
        self.server.route(
            "GET",
            "/v1/models",
            reply(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(deep), deep)),
        )
        with self.assertRaises(lc.ProtocolError):
            self.client.models()

    def test_legacy_error_line_with_envelope(self):
        body = (
            chunked(
                sse(chunk_json({"content": "x"})),
                b'error: {"error":{"code":"500","message":"boom","type":"server_error"}}\n\n',
            )
            + b"0\r\n\r\n"
        )
        self.use(serve_body(body))
        with self.assertRaises(lc.ServerError) as cm:
            self.collect()
        self.assertEqual((cm.exception.code, cm.exception.message), (500, "boom"))

    def test_chunked_trailers_and_last_crlf(self):
        decoder = lc.ChunkedDecoder()
        self.assertEqual(decoder.feed(b"3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n"), [b"abc"])
        self.assertTrue(decoder.done)
        decoder = lc.ChunkedDecoder()
        self.assertEqual(decoder.feed(b"3\r\nabc\r\n0\r\n"), [b"abc"])
        decoder.feed_eof()  # only the final CRLF is missing: the body is whole
        self.assertTrue(decoder.done)
        with self.assertRaises(lc.ProtocolError):
            lc.ChunkedDecoder().feed(b"0\r\n" + b"X: y\r\n" * 101)
        with self.assertRaises(lc.ProtocolError):
            lc.ChunkedDecoder().feed(b"0\r\n" + b"X" * 5000)
        with self.assertRaises(lc.ProtocolError):
            lc.ChunkedDecoder().feed(b"0\r\n" + b"X" * 5000 + b"\r\n")


class TestClientEdgesAsync(AsyncDriver, TestClientEdges):
    pass


# -----------------------------------------------------------------------------------------------------
# The other streamed endpoints (/completion, /infill, /v1/responses, /v1/messages) and their single-shot
# companions, through the whole client: each request as sent, the captured bytes as answered
# -----------------------------------------------------------------------------------------------------


def open_stream(client, endpoint, *args, **kw):
    """``client.stream_<endpoint>(...)``: a Stream; for AsyncDriver's facade, its AsyncStream behind
    blocking iteration (as ``SyncFacade.stream`` does for chat)."""
    if isinstance(client, SyncFacade):
        return StreamFacade(client._runner, getattr(client._client, "stream_" + endpoint)(*args, **kw))
    return getattr(client, "stream_" + endpoint)(*args, **kw)


def first_chunk(raw):
    """A captured response cut after its head and its first HTTP chunk (the rest never comes)."""
    head_end = raw.index(b"\r\n\r\n") + 4
    line_end = raw.index(b"\r\n", head_end)
    size = int(raw[head_end:line_end], 16)
    return raw[: line_end + 2 + size + 2]


_E_SEA = [{"role": "user", "content": "Write one sentence about the sea."}]


#: What the captures 50 and 60 stream for _E_SEA at max 8 tokens
_E_SEA_WORDS = ["Write", " one", " sentence", " about", " the", " sea", ".<", "|"]


_E_SEA_TEXT = "".join(_E_SEA_WORDS)


_E_PATHS = {"complete": "/completion", "infill": "/infill", "respond": "/v1/responses", "message": "/v1/messages"}


#: For each endpoint: the call's arguments, a capture of its stream, and the text that capture streams.
_E_CASES = {
    "complete": (("The sky is",), "40_completion_stream_tokens_probs.raw.txt", "".join(_p_SKY)),
    "infill": (("def add(a, b):\n    ", "\n    return c\n"), "48_infill_stream.raw.txt", "\n    " * 4),
    "respond": (("Write one sentence about the sea.",), "50_responses_stream.raw.txt", _E_SEA_TEXT),
    "message": ((_E_SEA,), "60_messages_stream.raw.txt", _E_SEA_TEXT),
}


def _e_native_usage(evaluated, predicted, cached):
    return {
        "tokens_evaluated": evaluated,
        "tokens_predicted": predicted,
        "tokens_cached": cached,
        "prompt_tokens": evaluated,
        "completion_tokens": predicted,
        "total_tokens": evaluated + predicted,
    }


def _e_final(raw):
    """The last data payload of a capture, parsed."""
    return _p_data_docs(raw)[-1]


class TestEndpoints(ServerCase):
    """complete, infill, respond and message (and their stream_* forms) through the client, on the bytes
    the real server sent (dev/testdata/transcripts); count_message_tokens and the LoRA calls."""

    limits = SOCKETS

    def serve(self, endpoint, name):
        raw = load_transcript(name)
        self.server.route("POST", _E_PATHS[endpoint], lambda req: req.send(raw))
        return raw

    def sent(self, path):
        with self.server.lock:
            return [r for r in self.server.requests if r.path == path]

    def call(self, endpoint, *args, client=None, **kw):
        events = []
        method = getattr(client or self.client, endpoint)
        completion = run_with_timeout(lambda: method(*args, on_event=events.append, **kw))
        return completion, events

    def routed_client(self):
        """A client with a default model, which every streamed body then names."""
        client = self.new_client(self.server.address, limits=self.limits, model="alpha")
        self.closers.append(client.close)
        return client

    def check_head(self, req, path):
        head = req.raw_head.decode()
        self.assertTrue(head.startswith("POST %s HTTP/1.1\r\n" % path), head)
        self.assertEqual(req.headers["accept"], "text/event-stream")
        self.assertEqual(req.headers["content-type"], "application/json")
        self.assertEqual(int(req.headers["content-length"]), len(req.body))

    # -- /completion ------------------------------------------------------------------------------------

    def test_complete_request_and_transcript_40(self):
        raw = self.serve("complete", "40_completion_stream_tokens_probs.raw.txt")
        completion, events = self.call(
            "complete",
            "The sky is",
            slot=1,
            client=self.routed_client(),
            n_predict=8,
            temperature=0,
            return_tokens=True,
            n_probs=2,
        )
        (req,) = self.sent("/completion")
        self.check_head(req, "/completion")
        self.assertEqual(
            req.json(),
            {
                "prompt": "The sky is",
                "n_predict": 8,
                "temperature": 0,
                "return_tokens": True,
                "n_probs": 2,
                "stream": True,
                "id_slot": 1,
                "model": "alpha",
            },
        )
        self.assertEqual(events, [lc.Content(w) for w in _p_SKY])
        docs = _p_data_docs(raw)
        probs = [d["completion_probabilities"][0] for d in docs[:-1]]
        final = _e_final(raw)
        self.assertEqual(final["stop"], True)
        self.assertEqual(
            completion,
            lc.Completion(
                id=None,
                model=_p_GEMMA,
                content=" the limit for the 201",
                reasoning="",
                tool_calls=[],
                finish_reason="length",
                usage=_e_native_usage(4, 8, 11),
                timings=final["timings"],
                choices=(lc.Choice(0, " the limit for the 201", "", [], "length", probs, None, _p_SKY_TOKENS),),
                final=final,
                tokens=_p_SKY_TOKENS,
            ),
        )
        self.assertEqual(completion.choices[0].tokens, _p_SKY_TOKENS)
        self.assertEqual(len(completion.logprobs), 8)

    def test_complete_without_slot_or_model_sends_neither(self):
        self.serve("complete", "41_completion_stream_progress.raw.txt")
        completion, events = self.call("complete", "The sky is", n_predict=8, return_progress=True)
        self.assertEqual(
            self.sent("/completion")[0].json(),
            {"prompt": "The sky is", "n_predict": 8, "return_progress": True, "stream": True},
        )
        # the progress chunks' placeholder token [0] is no generated token
        self.assertEqual(
            events, [lc.Progress(3, 4, 3, 0.0), lc.Progress(4, 4, 3, 15.0)] + [lc.Content(w) for w in _p_SKY]
        )
        self.assertEqual((completion.content, completion.tokens), ("".join(_p_SKY), _p_SKY_TOKENS))
        self.assertEqual(completion.usage["prompt_tokens"], 4)

    def test_complete_token_id_prompt_transcript_42(self):
        self.serve("complete", "42_completion_stream_token_ids.raw.txt")
        completion, events = self.call("complete", [2, 818, 7217, 563], slot=0, n_predict=8, return_tokens=True)
        self.assertEqual(self.sent("/completion")[0].json()["prompt"], [2, 818, 7217, 563])
        self.assertEqual(events, [lc.Content(w) for w in _p_SKY])
        self.assertEqual(
            (completion.content, completion.tokens, completion.finish_reason),
            ("".join(_p_SKY), _p_SKY_TOKENS, "length"),
        )

    def test_complete_two_prompts_transcript_43(self):
        raw = self.serve("complete", "43_completion_stream_two_prompts.raw.txt")
        self.assertIn(b"data: null\n\n", raw)
        completion, events = self.call("complete", ["The sky is", "The grass is"], n_predict=8)
        self.assertEqual(self.sent("/completion")[0].json()["prompt"], ["The sky is", "The grass is"])
        grass = [" green", ",", " the", " trees", " are", " green", ",", " and"]
        expect = []
        for g, s in zip(grass, _p_SKY):
            expect += [lc.Content(g, 1), lc.Content(s, 0)]
        self.assertEqual(events, expect)
        self.assertEqual(
            [(c.index, c.content, c.finish_reason) for c in completion.choices],
            [(0, "".join(_p_SKY), "length"), (1, "".join(grass), "length")],
        )
        self.assertEqual(completion.content, "".join(_p_SKY))
        self.assertEqual(completion.final["index"], 0)
        self.assertEqual(completion.usage["completion_tokens"], 16)  # both prompts' tokens
        self.assertEqual(completion.usage["prompt_tokens"], completion.usage["tokens_evaluated"])

    def test_complete_finish_reasons_eos_and_stop_word(self):
        for name, finish, stop_type in (
            ("39_completion_stream_eos.raw.txt", "stop", "eos"),
            ("46_completion_stream_stop_word.raw.txt", "stop", "word"),
            ("40_completion_stream_tokens_probs.raw.txt", "length", "limit"),
        ):
            with self.subTest(name=name):
                self.serve("complete", name)
                completion, _ = self.call("complete", "The sky is")
                self.assertEqual((completion.finish_reason, completion.final["stop_type"]), (finish, stop_type))
        self.assertEqual(completion.usage["total_tokens"], 12)

    # -- /infill ----------------------------------------------------------------------------------------

    def test_infill_request_and_transcript_48(self):
        raw = self.serve("infill", "48_infill_stream.raw.txt")
        completion, events = self.call(
            "infill",
            "def add(a, b):\n    ",
            "\n    return c\n",
            extra=[("util.py", "def sub(a, b):\n    return a - b\n")],
            slot=0,
            client=self.routed_client(),
            n_predict=8,
            temperature=0,
            seed=42,
        )
        (req,) = self.sent("/infill")
        self.check_head(req, "/infill")
        self.assertEqual(
            req.json(),
            {
                "input_prefix": "def add(a, b):\n    ",
                "input_suffix": "\n    return c\n",
                "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
                "n_predict": 8,
                "temperature": 0,
                "seed": 42,
                "stream": True,
                "id_slot": 0,
                "model": "alpha",
            },
        )
        words = ["\n", "    "] * 4
        self.assertEqual(events, [lc.Content(w) for w in words])
        final = _e_final(raw)
        self.assertEqual(
            completion,
            lc.Completion(
                id=None,
                model="/root/.cache/loopclient/gemma-3-270m-q4_k_m-fim.gguf",
                content="".join(words),
                reasoning="",
                tool_calls=[],
                finish_reason="length",
                usage=_e_native_usage(18, 8, 25),
                timings=final["timings"],
                choices=(lc.Choice(0, "".join(words), "", [], "length", None, None, [107, 140] * 4),),
                final=final,
                tokens=[107, 140] * 4,
            ),
        )

    def test_infill_not_supported_is_http_status_error_501(self):
        raw = self.serve("infill", "49_infill_not_supported.raw.txt")
        events = []
        with self.assertRaises(lc.HTTPStatusError) as cm:
            run_with_timeout(lambda: self.client.infill("def f():\n", "", on_event=events.append, n_predict=8))
        self.assertEqual(cm.exception.status, 501)
        self.assertEqual(
            cm.exception.message,
            "Infill is not supported by this model: prefix token is missing. suffix token is missing. "
            "middle token is missing. ",
        )
        self.assertEqual(cm.exception.body, raw[raw.index(b"\r\n\r\n") + 4 :])
        self.assertEqual(events, [])
        self.assertEqual(len(self.sent("/infill")), 1)  # not retried
        self.assertEqual(
            self.sent("/infill")[0].json(),
            {"input_prefix": "def f():\n", "input_suffix": "", "n_predict": 8, "stream": True},
        )

    # -- /v1/responses ----------------------------------------------------------------------------------

    def test_respond_request_and_transcript_50(self):
        raw = self.serve("respond", "50_responses_stream.raw.txt")
        completion, events = self.call(
            "respond",
            "Write one sentence about the sea.",
            slot=1,
            client=self.routed_client(),
            max_output_tokens=8,
            temperature=0,
        )
        (req,) = self.sent("/v1/responses")
        self.check_head(req, "/v1/responses")
        self.assertEqual(
            req.json(),
            {
                "input": "Write one sentence about the sea.",
                "max_output_tokens": 8,
                "temperature": 0,
                "stream": True,
                "id_slot": 1,
                "model": "alpha",
            },
        )
        self.assertEqual(events, [lc.Content(w) for w in _E_SEA_WORDS])
        last = _e_final(raw)
        self.assertEqual(last["type"], "response.completed")
        usage = {
            "input_tokens": 30,
            "output_tokens": 8,
            "total_tokens": 38,
            "input_tokens_details": {"cached_tokens": 29},
            "prompt_tokens": 30,
            "completion_tokens": 8,
        }
        self.assertEqual(
            completion,
            lc.Completion(
                id="resp_P400vjQqsH92lf8TuqMQ4vT4zpHXU1fv",
                model=_p_GEMMA,
                content=_E_SEA_TEXT,
                reasoning="",
                tool_calls=[],
                finish_reason="stop",  # the server reports completed even at max_output_tokens
                usage=usage,
                timings=last["timings"],
                final=last["response"],
            ),
        )

    def test_respond_reasoning_and_tool_call(self):
        self.serve("respond", "51_responses_reasoning_grammar.raw.txt")
        completion, events = self.call("respond", "Think step by step: is the sky blue?", grammar="root ::= x")
        self.assertEqual(self.sent("/v1/responses")[0].json()["grammar"], "root ::= x")  # passed on as sent
        thinking = ["is", " the", " sky", " blue", " is", " a"]
        self.assertEqual(events[: len(thinking)], [lc.Reasoning(w) for w in thinking])
        self.assertTrue(all(type(e) is lc.Content for e in events[len(thinking) :]), events)
        self.assertEqual(
            (completion.reasoning, completion.content, completion.reasoning_tokens, completion.finish_reason),
            ("is the sky blue is a", "the answer is yes", 6, "stop"),
        )
        self.serve("respond", "52_responses_tool_call.raw.txt")
        tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
        completion, events = self.call("respond", "What is the weather in Paris?", tools=tools, tool_choice="required")
        cid = "call_WuvgdAuvDRouqUfLNEvkLZ0FpcOWMKcw"
        fragments = ["{", '"', "city", '":', ' "', "Paris", ' "', "}"]
        self.assertEqual(
            events, [lc.ToolCall(0, cid, "get_weather", "")] + [lc.ToolCall(0, None, None, f) for f in fragments]
        )
        self.assertEqual(completion.tool_calls, [lc.ToolCallResult(cid, "get_weather", '{"city": "Paris "}')])
        self.assertEqual(completion.finish_reason, "tool_calls")
        self.assertEqual(self.sent("/v1/responses")[1].json()["tools"], tools)

    # -- /v1/messages -----------------------------------------------------------------------------------

    def test_message_request_and_transcript_60(self):
        raw = self.serve("message", "60_messages_stream.raw.txt")
        completion, events = self.call(
            "message", _E_SEA, slot=0, client=self.routed_client(), max_tokens=8, temperature=0, system="Be brief"
        )
        (req,) = self.sent("/v1/messages")
        self.check_head(req, "/v1/messages")
        self.assertEqual(
            req.json(),
            {
                "messages": _E_SEA,
                "max_tokens": 8,
                "temperature": 0,
                "system": "Be brief",
                "stream": True,
                "id_slot": 0,  # sent, though this server's Messages endpoint ignores it
                "model": "alpha",
            },
        )
        self.assertEqual(events, [lc.Content(w) for w in _E_SEA_WORDS])
        start = _p_data_docs(raw)[0]["message"]
        final = dict(start, stop_reason="max_tokens", stop_sequence=None)
        final["usage"] = {"cache_read_input_tokens": 29, "input_tokens": 1, "output_tokens": 8}
        usage = dict(final["usage"], prompt_tokens=30, completion_tokens=8, total_tokens=38)
        self.assertEqual(
            completion,
            lc.Completion(
                id="chatcmpl-21iAlT8NSlUuS8bTlxIrzyf279JfysDw",
                model=_p_GEMMA,
                content=_E_SEA_TEXT,
                reasoning="",
                tool_calls=[],
                finish_reason="length",
                usage=usage,
                timings=None,
                final=final,
            ),
        )

    def test_message_thinking_and_tool_use(self):
        self.serve("message", "61_messages_thinking.raw.txt")
        completion, events = self.call("message", _E_SEA, thinking={"type": "enabled", "budget_tokens": 8})
        self.assertEqual(self.sent("/v1/messages")[0].json()["thinking"], {"type": "enabled", "budget_tokens": 8})
        thinking = ["blue", " sky", "\n"]
        words = ["yes", "<", "|", "im", "_", "end", "|>", "\n", "<", "|", "im", "_", "start"]
        self.assertEqual(events, [lc.Reasoning(w) for w in thinking] + [lc.Content(w) for w in words])
        self.assertEqual(
            (completion.reasoning, completion.content, completion.reasoning_tokens, completion.finish_reason),
            ("blue sky\n", "".join(words), 3, "length"),
        )
        self.serve("message", "62_messages_tool_use.raw.txt")
        completion, events = self.call("message", _E_SEA, tool_choice={"type": "any"})
        cid = "pbitHA1orxPQ2XjiPUvz7STbslHDhXhW"
        fragments = ["{", '"', "city", '":', ' "', "Paris", '"}']
        self.assertEqual(
            events, [lc.ToolCall(0, cid, "get_weather", "")] + [lc.ToolCall(0, None, None, f) for f in fragments]
        )
        self.assertEqual(completion.tool_calls, [lc.ToolCallResult(cid, "get_weather", '{"city": "Paris"}')])
        self.assertEqual((completion.finish_reason, completion.final["stop_reason"]), ("tool_calls", "tool_use"))

    def test_the_token_cap_of_respond_and_message(self):
        cat = "Tell me a story about a cat."
        words = ["Tell", " me", " a", " story"]
        self.serve("respond", "53_responses_max_output_tokens.raw.txt")
        completion, events = self.call("respond", cat, max_output_tokens=4)
        self.assertEqual(events, [lc.Content(w) for w in words])
        # Responses says completed even at max_output_tokens: only the count tells
        self.assertEqual((completion.finish_reason, completion.final["status"]), ("stop", "completed"))
        self.assertEqual(
            [completion.usage[k] for k in ("output_tokens", "prompt_tokens", "completion_tokens", "total_tokens")],
            [4, 31, 4, 35],
        )
        self.serve("message", "63_messages_max_tokens.raw.txt")
        completion, events = self.call("message", [{"role": "user", "content": cat}], max_tokens=4)
        self.assertEqual(events, [lc.Content(w) for w in words])
        self.assertEqual((completion.finish_reason, completion.final["stop_reason"]), ("length", "max_tokens"))
        # input_tokens leaves out the 30 read from the cache; prompt_tokens counts them
        self.assertEqual(
            [completion.usage[k] for k in ("input_tokens", "prompt_tokens", "completion_tokens", "total_tokens")],
            [1, 31, 4, 35],
        )

    def test_respond_progress_and_message_thinking_budget(self):
        self.serve("respond", "56_responses_stream_progress.raw.txt")
        completion, events = self.call(
            "respond", "The lighthouse keeper ...", max_output_tokens=3, return_progress=True
        )
        self.assertIs(self.sent("/v1/responses")[0].json()["return_progress"], True)
        self.assertEqual(
            events,
            [lc.Progress(9, 114, 9, 0.0), lc.Progress(114, 114, 9, 4003.0)]
            + [lc.Content(w) for w in ["The", " lighthouse", " keeper"]],
        )
        self.assertEqual(completion.content, "The lighthouse keeper")
        self.serve("message", "65_messages_thinking_budget.raw.txt")
        thinking = {"type": "enabled", "budget_tokens": 2}
        completion, events = self.call("message", _E_SEA, max_tokens=12, thinking=thinking)
        self.assertEqual(self.sent("/v1/messages")[0].json()["thinking"], thinking)
        self.assertEqual(events, [lc.Reasoning("blue")] + [lc.Content(w) for w in ["yes", "<", "|"]])
        self.assertEqual((completion.reasoning, completion.reasoning_tokens), ("blue", 1))

    def test_count_message_tokens_request_and_answer(self):
        self.server.route(
            "POST",
            "/v1/messages/count_tokens",
            lambda req: req.send(load_transcript("64_messages_count_tokens.raw.txt")),
        )
        msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
        self.assertEqual(run_with_timeout(lambda: self.client.count_message_tokens(msgs)), 31)
        self.assertEqual(
            run_with_timeout(lambda: self.routed_client().count_message_tokens(msgs, system="Be brief")), 31
        )
        plain, routed = self.sent("/v1/messages/count_tokens")
        self.assertEqual(plain.json(), {"messages": msgs})  # no stream, no slot
        self.assertEqual(routed.json(), {"messages": msgs, "system": "Be brief", "model": "alpha"})
        self.assertEqual(plain.headers["accept"], "application/json")
        for answer in ({"input_tokens": "31"}, {"tokens": 31}, [31], {"input_tokens": True}):
            with self.subTest(answer=answer):
                self.server.route("POST", "/v1/messages/count_tokens", lambda req, a=answer: respond_json(req, a))
                with self.assertRaises(lc.ProtocolError):
                    run_with_timeout(lambda: self.client.count_message_tokens(msgs))

    # -- LoRA adapters ----------------------------------------------------------------------------------

    def test_lora_adapters_and_set_lora_adapters(self):
        adapters = [{"id": 0, "path": "/cache/lora-test-r4.gguf", "scale": 0.0, "task_name": "", "prompt_prefix": ""}]
        posted = []

        def post(req):
            posted.append(req.json())
            respond_json(req, {"success": True})

        self.server.route("GET", "/lora-adapters", lambda req: respond_json(req, adapters))
        self.server.route("POST", "/lora-adapters", post)
        self.assertEqual(run_with_timeout(self.client.lora_adapters), adapters)
        self.assertEqual(
            run_with_timeout(lambda: self.client.set_lora_adapters([{"id": 0, "scale": 1.0}])), {"success": True}
        )
        self.assertEqual(
            run_with_timeout(lambda: self.client.set_lora_adapters(({"id": 0, "scale": 0.0},))), {"success": True}
        )
        self.assertEqual(
            run_with_timeout(lambda: self.client.set_lora_adapters(a for a in [{"id": 0, "scale": 0.5}])),
            {"success": True},
        )
        self.assertEqual(posted, [[{"id": 0, "scale": 1.0}], [{"id": 0, "scale": 0.0}], [{"id": 0, "scale": 0.5}]])
        get = [r for r in self.server.requests if r.path == "/lora-adapters" and r.method == "GET"]
        self.assertEqual((len(get), get[0].body), (1, b""))
        self.server.route("GET", "/lora-adapters", lambda req: respond_json(req, {"adapters": adapters}))
        with self.assertRaises(lc.ProtocolError):
            run_with_timeout(self.client.lora_adapters)
        for bad in ({"id": 0, "scale": 1.0}, "x", [0], [{"id": 0}, 1], 5):
            with self.subTest(bad=bad), self.assertRaises(TypeError):
                self.client.set_lora_adapters(bad)
        self.assertEqual(len(posted), 3)  # nothing was sent for the mistakes

    # -- what every endpoint shares with chat ---------------------------------------------------------------

    def test_stream_forms_iterate_and_keep_the_completion(self):
        for endpoint, (args, name, text) in _E_CASES.items():
            with self.subTest(endpoint=endpoint):
                self.serve(endpoint, name)
                with open_stream(self.client, endpoint, *args, slot=1) as stream:
                    self.assertIsNone(stream.completion)
                    events = waits_first(self, run_with_timeout(lambda: list(stream)))  # a late head: Waiting
                self.assertEqual("".join(e.text for e in events), text)
                self.assertTrue(all(type(e) is lc.Content for e in events), events)
                self.assertEqual(stream.completion.content, text)
                self.assertIsNotNone(stream.completion.final)
                self.assertEqual(self.sent(_E_PATHS[endpoint])[-1].json()["id_slot"], 1)

    def test_raw_chunks_come_before_their_events_and_stay_out_of_the_body(self):
        for endpoint, (args, name, text) in _E_CASES.items():
            with self.subTest(endpoint=endpoint):
                raw = self.serve(endpoint, name)
                completion, events = self.call(endpoint, *args, raw_chunks=True)
                self.assertNotIn("raw_chunks", self.sent(_E_PATHS[endpoint])[-1].json())
                chunks = [e.data for e in events if type(e) is lc.Chunk]
                self.assertEqual(chunks, [d for d in _p_data_docs(raw) if d is not None])
                for i, event in enumerate(events):
                    if type(event) is lc.Content:
                        self.assertIs(type(events[i - 1]), lc.Chunk)  # one text delta per payload here
                self.assertEqual(completion.content, text)

    def test_the_closing_event_ends_the_response_without_the_last_chunk(self):
        for endpoint, (args, name, text) in _E_CASES.items():
            with self.subTest(endpoint=endpoint):
                raw = load_transcript(name)
                self.assertTrue(raw.endswith(b"\r\n0\r\n\r\n"))

                cut = raw[: -len(b"0\r\n\r\n")]

                def handler(req, cut=cut):
                    req.send(cut)
                    req.wait_peer_close(30)  # never sends the 0 chunk: the client must not wait for it

                self.server.route("POST", _E_PATHS[endpoint], handler)
                completion, _ = self.call(endpoint, *args)
                self.assertEqual(completion.content, text)
                # the client ended it: reading on would have been StalledError after liveness (2 s)
                self.assertTrue(self.sent(_E_PATHS[endpoint])[-1].closed_by_peer.wait(10))

    def test_a_stream_cut_before_its_closing_event_is_stream_closed(self):
        for endpoint, (args, name, _) in _E_CASES.items():
            with self.subTest(endpoint=endpoint):
                cut = first_chunk(load_transcript(name)) + b"0\r\n\r\n"
                self.server.route("POST", _E_PATHS[endpoint], lambda req, cut=cut: req.send(cut))
                with self.assertRaises(lc.StreamClosedError):
                    self.call(endpoint, *args)

    def test_busy_slot_is_waited_out_then_streams(self):
        self.client_with(poll=FAST.poll)  # a Waiting every poll
        answers = SlotAnswers(self)
        for endpoint, (args, name, text) in _E_CASES.items():
            with self.subTest(endpoint=endpoint):
                answers.reset()
                raw = load_transcript(name)
                release = threading.Event()
                self.server.busy[0] = True

                def handler(req, raw=raw, release=release):
                    while not release.is_set():  # the slot is busy: no byte until it frees
                        if req.wait_peer_close(0.02) or req.server.stopping.is_set():
                            return
                    req.send(raw)

                self.server.route("POST", _E_PATHS[endpoint], handler)
                events = []

                def on_event(ev, events=events, release=release):
                    events.append(ev)
                    if answers.sort(events)[0].count(lc.Waiting(True)) == 2:
                        self.server.busy[0] = False
                        release.set()

                completion = run_with_timeout(lambda: getattr(self.client, endpoint)(*args, slot=0, on_event=on_event))
                self.assertEqual(answers.sort(events)[0][:2], [lc.Waiting(True)] * 2)
                self.assertEqual("".join(e.text for e in waits_first(self, events)), text)
                self.assertEqual(completion.content, text)
                self.assertEqual(len(self.sent(_E_PATHS[endpoint])), 1)

    def test_cancel_mid_stream_frees_the_permit(self):
        for endpoint, (args, name, _) in _E_CASES.items():
            with self.subTest(endpoint=endpoint):
                cut = first_chunk(load_transcript(name))

                def handler(req, cut=cut):
                    req.send(cut)
                    req.wait_peer_close(5)

                self.server.route("POST", _E_PATHS[endpoint], handler)
                stream = open_stream(self.client, endpoint, *args, slot=0)
                first = run_with_timeout(lambda: next(stream))
                self.assertIsInstance(first, lc.Content)
                self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (1, 0))
                stream.cancel()  # nobody is iterating: cleanup happens here
                self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (0, 0))
                self.assertTrue(self.sent(_E_PATHS[endpoint])[-1].closed_by_peer.wait(10))
                with self.assertRaises(lc.CancelledError):
                    run_with_timeout(lambda: next(stream))

    @real_time
    def test_cancel_while_sizing_the_pool_never_enters_the_gate(self):
        self.server.route("GET", "/props", lambda req: req.wait_peer_close(30))  # slot=None asks /props first
        stream = open_stream(self.client, "complete", "The sky is")
        outcome, done = [], threading.Event()

        def run():
            try:
                outcome.extend(stream)
            except BaseException as exc:  # noqa: B036
                outcome.append(exc)
            done.set()

        threading.Thread(target=run, daemon=True).start()
        wait_for(lambda: any(r.path == "/props" for r in self.server.requests), what="the /props request")
        t = Timer()
        stream.cancel()
        self.assertTrue(done.wait(10))
        self.assertLess(t.elapsed, lateness(self, 0.2))  # at once: not when /props answers (30 s)
        self.assertEqual(len(outcome), 1)
        self.assertIsInstance(outcome[0], lc.CancelledError)
        self.assertNotIn((None, None), self.client._board.gate.snapshot())
        self.assertEqual(self.sent("/completion"), [])

    def test_midstream_errors_are_server_errors_and_not_replayed(self):
        grammar_error = "got exception: Unexpected empty grammar stack after accepting piece: <unused24> (30)"
        cases = [
            (
                "complete",
                ("x",),
                "47_completion_midstream_error.raw.txt",
                [lc.Content(w) for w in ["<", "think", ">", " is", " the", " sky", " blue", " is"]],
                grammar_error,
            ),
            (
                "infill",
                ("x", "y"),
                "38_infill_midstream_error.raw.txt",
                [lc.Content(w) for w in ["<", "think", ">", "def", " add", "b", "to", "a"]],
                grammar_error,
            ),
            (
                "respond",
                ("x",),
                "54_responses_midstream_error.raw.txt",
                [lc.Reasoning(w) for w in ["is", " the", " sky", " blue", " is"]],
                grammar_error,
            ),
            (
                "message",
                (_E_SEA,),
                "67_messages_midstream_error.raw.txt",
                [lc.ToolCall(0, "4c86UqKUxfxdFUmDpiUFmMy1DLkXLCXN", "get_weather", "")]
                + [lc.ToolCall(0, None, None, f) for f in ["{", '"', "city", '":', ' "', "Paris", '"}']],
                "The model produced output that does not match the expected peg-native format",
            ),
        ]
        for endpoint, args, name, expect, message in cases:
            with self.subTest(endpoint=endpoint):
                self.serve(endpoint, name)
                events = []
                with self.assertRaises(lc.ServerError) as cm:
                    run_with_timeout(lambda: getattr(self.client, endpoint)(*args, slot=0, on_event=events.append))
                self.assertEqual(
                    (cm.exception.code, cm.exception.message, cm.exception.type), (500, message, "server_error")
                )
                self.assertEqual(events, expect)
                self.assertEqual(len(self.sent(_E_PATHS[endpoint])), 1)

    def test_an_error_before_delivery_is_retried(self):
        overloaded = (
            b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
        )
        unavailable = b'data: {"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}\n\n'
        for endpoint, (args, name, text) in _E_CASES.items():
            with self.subTest(endpoint=endpoint):
                answers = [
                    STREAM_HEAD + chunked(overloaded if endpoint == "message" else unavailable) + b"0\r\n\r\n",
                    load_transcript(name),
                ]
                self.server.route("POST", _E_PATHS[endpoint], lambda req, answers=answers: req.send(answers.pop(0)))
                completion, events = self.call(endpoint, *args, slot=0)
                self.assertIsInstance(events[0], lc.Retrying)
                self.assertIn("Overloaded" if endpoint == "message" else "Loading model", events[0].reason)
                self.assertEqual(completion.content, text)
                self.assertEqual(len(self.sent(_E_PATHS[endpoint])), 2)

    def test_thinking_cap_is_value_error_before_sending_on_respond_and_message(self):
        client = self.client_with(thinking_cap=3)
        for endpoint, args in (("respond", ("x",)), ("message", (_E_SEA,))):
            with self.subTest(endpoint=endpoint):
                for make in (
                    lambda: open_stream(client, endpoint, *args),
                    lambda: run_with_timeout(lambda: getattr(client, endpoint)(*args, slot=0, max_tokens=4)),
                ):
                    with self.assertRaises(ValueError) as cm:
                        make()
                    self.assertIn(_E_PATHS[endpoint], str(cm.exception))
                    self.assertIn("thinking_cap", str(cm.exception))
        self.assertEqual(self.server.requests, [])  # not even /props or /slots
        # on /completion and /infill the cap has nothing to cap: the request goes as it is
        for endpoint in ("complete", "infill"):
            args, name, text = _E_CASES[endpoint]
            self.serve(endpoint, name)
            completion, events = self.call(endpoint, *args, client=client)
            self.assertEqual((completion.content, completion.thinking_capped), (text, False))
            self.assertNotIn("reasoning_control", self.sent(_E_PATHS[endpoint])[0].json())
        self.assertEqual(self.sent("/v1/chat/completions/control"), [])

    def test_mistakes_are_raised_before_sending(self):
        cases = [
            (TypeError, "complete", (5,), {}),
            (ValueError, "complete", ([],), {}),
            (TypeError, "complete", ("x",), {"prompt": "y"}),
            (TypeError, "infill", (b"x",), {}),
            (TypeError, "infill", ("x",), {"extra": "util.py"}),
            (ValueError, "infill", ("x",), {"extra": [("a.py",)]}),
            (TypeError, "infill", ("x",), {"input_extra": []}),
            (ValueError, "respond", ([],), {}),
            (TypeError, "respond", (["x"],), {}),
            (ValueError, "message", ([],), {}),
            (TypeError, "message", ("hi",), {}),
            (ValueError, "message", (_E_SEA,), {"slot": -1}),
            (TypeError, "complete", ("x",), {"slot": True}),
        ]
        for error, endpoint, args, kw in cases:
            with self.subTest(endpoint=endpoint, args=args, kw=kw), self.assertRaises(error):
                open_stream(self.client, endpoint, *args, **kw)
        self.assertEqual(self.server.requests, [])


class TestEndpointsAsync(AsyncDriver, TestEndpoints):
    pass


# -- the last streamed routes: /v1/completions, /models/sse, load_model(wait=True), /v1/responses/input_tokens


_T_CASE = (("The sky is",), "90_completions_oai_stream_logprobs.raw.txt", "".join(_p_SKY))


def _t_sse(*docs):
    """A router's /models/sse events (``data: <json>`` blocks, as it writes them), one HTTP chunk each."""
    return chunked(*(b"data: %s\n\n" % json.dumps(d, separators=(",", ":")).encode() for d in docs))


def _t_models(*statuses):
    """A router's GET /v1/models answer: (name, status object) per model."""
    return {"data": [{"id": name, "aliases": [name], "status": status} for name, status in statuses], "object": "list"}


class TestLastRoutes(ServerCase):
    """complete_openai (POST /v1/completions) on the real server's bytes, through the same engine as every
    streamed endpoint; count_response_tokens; watch_models (GET /models/sse) and load_model(wait=True)."""

    limits = SOCKETS

    def serve(self, name, path="/v1/completions"):
        raw = load_transcript(name)
        self.server.route("POST", path, lambda req: req.send(raw))
        return raw

    def sent(self, path):
        with self.server.lock:
            return [r for r in self.server.requests if r.path == path]

    def call(self, *args, client=None, **kw):
        events = []
        completion = run_with_timeout(
            lambda: (client or self.client).complete_openai(*args, on_event=events.append, **kw)
        )
        return completion, events

    def test_request_and_transcript_90(self):
        raw = self.serve("90_completions_oai_stream_logprobs.raw.txt")
        client = self.new_client(self.server.address, limits=self.limits, model="alpha")
        self.closers.append(client.close)
        completion, events = self.call("The sky is", slot=1, client=client, max_tokens=8, temperature=0, logprobs=2)
        (req,) = self.sent("/v1/completions")
        head = req.raw_head.decode()
        self.assertTrue(head.startswith("POST /v1/completions HTTP/1.1\r\n"), head)
        self.assertEqual(req.headers["accept"], "text/event-stream")
        self.assertEqual(
            req.json(),
            {
                "prompt": "The sky is",
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": 2,
                "stream": True,
                "id_slot": 1,
                "model": "alpha",
            },
        )
        self.assertEqual(events, [lc.Content(w) for w in _p_SKY])
        docs = [d for d in _t_payloads(raw) if isinstance(d, dict)]
        probs = [c["logprobs"]["content"][0] for d in docs[:-1] for c in d["choices"]]
        self.assertEqual(
            completion,
            lc.Completion(
                id=docs[0]["id"],
                model=_p_GEMMA,
                content=" the limit for the 201",
                reasoning="",
                tool_calls=[],
                finish_reason="length",
                usage=docs[-1]["usage"],
                timings=docs[-1]["timings"],
                choices=(lc.Choice(0, " the limit for the 201", "", [], "length", probs, None),),
            ),
        )
        self.assertEqual((completion.usage["prompt_tokens"], completion.usage["completion_tokens"]), (4, 8))
        self.assertIsNone(completion.final)

    def test_two_prompts_are_two_choices(self):
        self.serve("91_completions_oai_stream_two_prompts.raw.txt")
        completion, events = self.call(["The sky is", "The grass is"], max_tokens=8, logprobs=2)
        self.assertEqual(self.sent("/v1/completions")[0].json()["prompt"], ["The sky is", "The grass is"])
        self.assertEqual([e.choice for e in events], [1, 0] * 8)
        self.assertEqual(
            [(c.index, c.content, c.finish_reason, len(c.logprobs)) for c in completion.choices],
            [(0, "".join(_p_SKY), "length", 8), (1, "".join(_t_GRASS), "length", 8)],
        )

    def test_stream_form_raw_chunks_and_no_slot_or_model(self):
        raw = self.serve("90_completions_oai_stream_logprobs.raw.txt")
        with open_stream(self.client, "complete_openai", "The sky is", raw_chunks=True) as stream:
            self.assertIsNone(stream.completion)
            events = run_with_timeout(lambda: list(stream))
        body = self.sent("/v1/completions")[0].json()
        self.assertEqual(body, {"prompt": "The sky is", "stream": True})
        chunks = [e.data for e in events if type(e) is lc.Chunk]
        self.assertEqual(chunks, [d for d in _t_payloads(raw) if isinstance(d, dict)])
        self.assertEqual(stream.completion.content, "".join(_p_SKY))

    def test_busy_slot_is_waited_out_then_streams(self):
        self.client_with(poll=FAST.poll)  # a Waiting every poll
        raw = load_transcript(_T_CASE[1])
        release = threading.Event()
        self.server.busy[0] = True

        def handler(req):
            while not release.is_set():  # the slot is busy: no byte until it frees
                if req.wait_peer_close(0.02) or req.server.stopping.is_set():
                    return
            req.send(raw)

        self.server.route("POST", "/v1/completions", handler)
        answers = SlotAnswers(self)
        events = []

        def on_event(ev):
            events.append(ev)
            if answers.sort(events)[0].count(lc.Waiting(True)) == 2:
                self.server.busy[0] = False
                release.set()

        completion = run_with_timeout(lambda: self.client.complete_openai("The sky is", slot=0, on_event=on_event))
        self.assertEqual(answers.sort(events)[0][:2], [lc.Waiting(True)] * 2)
        self.assertEqual(waits_first(self, events), [lc.Content(w) for w in _p_SKY])
        self.assertEqual(completion.content, _T_CASE[2])
        self.assertEqual(len(self.sent("/v1/completions")), 1)

    def test_cancel_mid_stream_frees_the_permit(self):
        cut = first_chunk(load_transcript(_T_CASE[1]))

        def handler(req):
            req.send(cut)
            req.wait_peer_close(5)

        self.server.route("POST", "/v1/completions", handler)
        stream = open_stream(self.client, "complete_openai", "The sky is", slot=0)
        self.assertEqual(run_with_timeout(lambda: next(stream)), lc.Content(" the"))
        self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (1, 0))
        stream.cancel()
        self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (0, 0))
        self.assertTrue(self.sent("/v1/completions")[-1].closed_by_peer.wait(10))
        with self.assertRaises(lc.CancelledError):
            run_with_timeout(lambda: next(stream))

    def test_an_error_before_delivery_is_retried_one_after_is_not(self):
        unavailable = b'data: {"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}\n\n'
        answers = [STREAM_HEAD + chunked(unavailable) + b"0\r\n\r\n", load_transcript(_T_CASE[1])]
        self.server.route("POST", "/v1/completions", lambda req: req.send(answers.pop(0)))
        completion, events = self.call("The sky is", slot=0)
        self.assertIsInstance(events[0], lc.Retrying)
        self.assertIn("Loading model", events[0].reason)
        self.assertEqual((events[1:], completion.content), ([lc.Content(w) for w in _p_SKY], _T_CASE[2]))
        self.assertEqual(len(self.sent("/v1/completions")), 2)
        self.serve("96_completions_oai_midstream_error.raw.txt")
        events = []
        with self.assertRaises(lc.ServerError) as caught:
            run_with_timeout(lambda: self.client.complete_openai("x", slot=0, on_event=events.append))
        self.assertEqual((caught.exception.code, caught.exception.type), (500, "server_error"))
        self.assertEqual(events, [lc.Content(w) for w in ["<", "think", ">", " is", " the", " sky", " blue", " is"]])
        self.assertEqual(len(self.sent("/v1/completions")), 3)

    def test_a_stream_cut_before_its_end_is_stream_closed(self):
        cut = first_chunk(load_transcript(_T_CASE[1])) + b"0\r\n\r\n"
        self.server.route("POST", "/v1/completions", lambda req: req.send(cut))
        with self.assertRaises(lc.StreamClosedError):
            self.call("The sky is")

    def test_a_resumable_one_cut_anywhere_resumes(self):
        raw = load_transcript(_T_CASE[1])
        buf = _r_Buffer(self.server, raw, "/v1/completions")
        whole, whole_events = self.call("The sky is", slot=0, resumable="conv-oai")
        self.assertEqual(self.sent("/v1/completions")[0].headers["x-conversation-id"], "conv-oai")
        rng = random.Random(90)
        end = len(raw) - len(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        for cut in sorted({len(buf.head), len(buf.head) + 3, end - 1} | set(rng.sample(range(len(buf.head), end), 40))):
            buf.reset([cut])
            completion, events = self.call("The sky is", slot=0, resumable="conv-oai")
            resumed = [e for e in events if isinstance(e, lc.Resumed)]
            # (a Waiting: a head that came after poll, as on a loaded machine it may)
            told = [e for e in events if not isinstance(e, (lc.Resumed, lc.Waiting))]
            self.assertEqual(told, [e for e in whole_events if not isinstance(e, lc.Waiting)], "cut at %d" % cut)
            self.assertEqual(completion, whole, "cut at %d" % cut)
            self.assertEqual(len(resumed), 1, "cut at %d" % cut)
            self.assertEqual(buf.methods().count("POST"), 1, "cut at %d: the request was sent again" % cut)
        # and resume() reads the buffer with this endpoint's dialect
        stream = self.client.resume("conv-oai", endpoint="complete_openai")
        self.assertEqual(run_with_timeout(lambda: list(stream)), whole_events)

    def test_the_thinking_cap_has_nothing_to_cap_here(self):
        client = self.client_with(thinking_cap=3)
        self.serve(_T_CASE[1])
        completion, _ = self.call("The sky is", client=client)
        self.assertEqual((completion.content, completion.thinking_capped), (_T_CASE[2], False))
        self.assertNotIn("reasoning_control", self.sent("/v1/completions")[0].json())

    def test_mistakes_are_raised_before_sending(self):
        for error, args, kw in (
            (TypeError, (5,), {}),
            (ValueError, ([],), {}),
            (TypeError, ("x",), {"prompt": "y"}),
            (ValueError, ("x",), {"slot": -1}),
            (ValueError, ("x",), {"resumable": ""}),
        ):
            with self.subTest(args=args, kw=kw), self.assertRaises(error):
                open_stream(self.client, "complete_openai", *args, **kw)
        with self.assertRaises(ValueError):
            self.client.resume("conv-1", endpoint="models")
        self.assertEqual(self.server.requests, [])

    def test_count_response_tokens_request_and_answer_97(self):
        raw = load_transcript("97_responses_input_tokens.raw.txt")
        self.server.route("POST", "/v1/responses/input_tokens", lambda req: req.send(raw))
        got = run_with_timeout(
            lambda: self.client.count_response_tokens("Write one sentence about the sea.", instructions="Be brief.")
        )
        self.assertEqual(got, 47)
        (req,) = self.sent("/v1/responses/input_tokens")
        self.assertEqual(req.json(), {"input": "Write one sentence about the sea.", "instructions": "Be brief."})
        self.server.route("POST", "/v1/responses/input_tokens", reply(json_response({"input_tokens": "47"})))
        with self.assertRaises(lc.ProtocolError):
            run_with_timeout(lambda: self.client.count_response_tokens("x"))
        with self.assertRaises(TypeError):
            self.client.count_response_tokens(5)

    # -- GET /models/sse ------------------------------------------------------------------------------

    def sse(self, body, hold=True):
        self.server.route("GET", "/models/sse", serve_body(body, hold))

    def test_watch_models_yields_model_events_and_waits_out_silence(self):
        client = self.client_with(liveness=0.2)  # far shorter than the silence below
        loading = {"model": "beta", "event": "status_change", "data": {"status": "loading"}}
        other = {"model": "alpha", "event": "status_change", "data": {"status": "loaded"}}
        release = threading.Event()

        def handler(req):
            req.send(STREAM_HEAD + _t_sse(loading, other))
            while not release.is_set():
                if req.wait_peer_close(0.02) or req.server.stopping.is_set():
                    return
            req.send(_t_sse({"model": "*", "event": "models_reload"}))
            req.wait_peer_close(5)

        self.server.route("GET", "/models/sse", handler)
        with self.watch(client) as stream:
            got = [run_with_timeout(lambda: next(stream)) for _ in range(2)]
            self.assertEqual(
                got,
                [
                    lc.ModelEvent("beta", "status_change", {"status": "loading"}),
                    lc.ModelEvent("alpha", "status_change", {"status": "loaded"}),
                ],
            )
            threading.Timer(0.8, release.set).start()  # four times liveness of silence
            self.assertEqual(run_with_timeout(lambda: next(stream)), lc.ModelEvent("*", "models_reload", None))
        (req,) = self.sent("/models/sse")
        self.assertTrue(req.raw_head.startswith(b"GET /models/sse HTTP/1.1\r\n"))
        self.assertEqual(req.headers["accept"], "text/event-stream")
        self.assertTrue(req.closed_by_peer.wait(10))  # leaving the with block closed it
        self.assertEqual(self.client._board.gate.snapshot(), {})

    def watch(self, client=None, model=None):
        client = client or self.client
        if isinstance(client, SyncFacade):
            return StreamFacade(client._runner, client._client.watch_models(model))
        return client.watch_models(model)

    def test_watch_models_filters_and_never_routes(self):
        client = self.new_client(self.server.address, limits=self.limits, model="alpha")
        self.closers.append(client.close)
        events = [
            {"model": "beta", "event": "model_status", "data": {"status": "loading"}},
            {"model": "alpha", "event": "status_change", "data": {"status": "loading"}},
            {"model": "*", "event": "models_reload"},
            {"model": "beta", "event": "status_change", "data": {"status": "loaded"}},
        ]
        self.sse(_t_sse(*events) + b"0\r\n\r\n", hold=False)
        stream = self.watch(client, "beta")
        got = []
        with self.assertRaises(lc.StreamClosedError) as caught:
            for event in run_with_timeout(lambda: stream):
                got.append(event)
        self.assertIn("/models/sse", str(caught.exception))
        self.assertEqual(
            got,
            [
                lc.ModelEvent("beta", "model_status", {"status": "loading"}),
                lc.ModelEvent("*", "models_reload", None),  # the router's own, about every model
                lc.ModelEvent("beta", "status_change", {"status": "loaded"}),
            ],
        )
        self.assertEqual([r.path for r in self.server.requests], ["/models/sse"])  # no ?model=, no /slots

    def test_watch_models_cancel_and_errors(self):
        self.sse(_t_sse({"model": "a", "event": "x"}))
        stream = self.watch()
        self.assertEqual(run_with_timeout(lambda: next(stream)), lc.ModelEvent("a", "x", None))
        stream.cancel()
        with self.assertRaises(lc.CancelledError):
            run_with_timeout(lambda: next(stream))
        self.assertTrue(self.sent("/models/sse")[-1].closed_by_peer.wait(10))
        self.server.route(
            "GET",
            "/models/sse",
            reply(json_response({"error": {"code": 503, "message": "Loading"}}, b"503 Unavailable")),
        )
        with self.assertRaises(lc.HTTPStatusError) as caught:
            run_with_timeout(lambda: next(self.watch()))
        self.assertEqual(caught.exception.status, 503)
        self.assertEqual(len(self.sent("/models/sse")), 2)  # not sent again
        with self.assertRaises(TypeError):
            self.client.watch_models(5)

    def test_watch_models_of_a_server_that_is_not_there(self):
        self.server.close()
        with self.assertRaises(lc.ConnectError):
            run_with_timeout(lambda: next(self.watch()))

    # -- load_model(wait=True) -------------------------------------------------------------------------

    def router(self, *answers):
        """POST /models/load answers success; GET /v1/models answers ``answers`` in turn (the last again)."""
        self.server.route("POST", "/models/load", reply(json_response({"success": True})))
        left = list(answers)
        self.server.route("GET", "/v1/models", lambda req: respond_json(req, left.pop(0) if len(left) > 1 else left[0]))

    def test_load_model_waits_until_loaded(self):
        self.client_with(poll=FAST.poll)  # /models asked every poll
        self.router(
            _t_models(("alpha", {"value": "loaded"}), ("beta", {"value": "loading"})),
            _t_models(("alpha", {"value": "loaded"}), ("beta", {"value": "loading"})),
            _t_models(("alpha", {"value": "loaded"}), ("beta", {"value": "loaded"})),
        )
        self.assertEqual(run_with_timeout(lambda: self.client.load_model("beta", wait=True)), {"success": True})
        self.assertEqual(
            [r.path for r in self.server.requests], ["/models/load", "/v1/models", "/v1/models", "/v1/models"]
        )
        self.assertEqual(self.sent("/models/load")[0].json(), {"model": "beta"})
        self.assertEqual(run_with_timeout(lambda: self.client.load_model("beta")), {"success": True})
        self.assertEqual(len(self.sent("/v1/models")), 3)  # without wait: the answer alone

    def test_load_model_that_fails_is_server_error_with_the_router_status(self):
        self.client_with(poll=FAST.poll)  # /models asked every poll
        failed = {"value": "unloaded", "exit_code": 1, "failed": True}
        self.router(_t_models(("broken", {"value": "loading"})), _t_models(("broken", failed)))
        with self.assertRaises(lc.ServerError) as caught:
            run_with_timeout(lambda: self.client.load_model("broken", wait=True))
        self.assertEqual(
            (caught.exception.code, caught.exception.type, caught.exception.error), (1, "load_failed", failed)
        )
        self.assertIn("could not load model 'broken'", str(caught.exception))
        self.assertIn("exit code 1", str(caught.exception))
        self.server.route(
            "POST",
            "/models/load",
            reply(json_response({"error": {"code": 404, "message": "File Not Found"}}, b"404 Not Found")),
        )
        with self.assertRaises(lc.HTTPStatusError) as caught:
            run_with_timeout(lambda: self.client.load_model("nonesuch", wait=True))
        self.assertEqual((caught.exception.status, caught.exception.message), (404, "File Not Found"))

    @real_time
    def test_load_model_that_stays_loading_is_load_timeout(self):
        client = self.client_with(load_wait=0.3, poll=FAST.poll)
        self.router(_t_models(("beta", {"value": "loading"})))
        t = Timer()
        with self.assertRaises(lc.LoadTimeoutError) as caught:
            run_with_timeout(lambda: client.load_model("beta", wait=True))
        self.assertGreaterEqual(t.elapsed, 0.3)
        self.assertLess(t.elapsed, 0.3 + lateness(self))
        self.assertIn("still loading", str(caught.exception))


class TestLastRoutesAsync(AsyncDriver, TestLastRoutes):
    pass


# -- every route of the server: a named call, or a README line saying why not -----------------------------

#: The route list the server registers (a copy of what its tools/server/server.cpp says; see the file)
_ROUTES_FILE = os.path.join(HERE, "dev", "testdata", "server_routes.txt")


#: The route each named call sends (the calls of both clients)
_NAMED_ROUTES = {
    "GET /health": "health",
    "GET /metrics": "metrics",
    "GET /props": "props",
    "GET /v1/models": "models",
    "POST /completion": "complete",
    "POST /v1/completions": "complete_openai",
    "POST /v1/chat/completions": "chat",
    "POST /v1/chat/completions/control": "end_reasoning",
    "POST /v1/responses": "respond",
    "POST /v1/messages": "message",
    "POST /infill": "infill",
    "POST /v1/embeddings": "embed",
    "POST /v1/rerank": "rerank",
    "POST /tokenize": "tokenize",
    "POST /detokenize": "detokenize",
    "POST /apply-template": "apply_template",
    "POST /v1/chat/completions/input_tokens": "count_tokens",
    "POST /v1/responses/input_tokens": "count_response_tokens",
    "POST /v1/messages/count_tokens": "count_message_tokens",
    "GET /lora-adapters": "lora_adapters",
    "POST /lora-adapters": "set_lora_adapters",
    "GET /slots": "slots",
    "POST /slots/:id_slot": "save_slot",  # and restore_slot, erase_slot
    "GET /v1/stream": "resume",
    "POST /v1/streams/lookup": "lookup_streams",
    "DELETE /v1/stream": "delete_stream",
    "POST /models/load": "load_model",
    "POST /models/unload": "unload_model",
    "GET /models/sse": "watch_models",
}


def _routes_of_source(text):
    """The "METHOD PATH" routes of server.cpp's text: its ctx_http.get/post/del/put("...") lines, in order,
    each once."""
    routes = []
    for method, path in re.findall(r'ctx_http\.(get|post|del|put)\s*\(\s*"([^"]+)"', text):
        route = "%s %s" % ("DELETE" if method == "del" else method.upper(), path)
        if route not in routes:
            routes.append(route)
    return routes


def _routes_of_copy(path=_ROUTES_FILE):
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def _routes_of_readme():
    """The README's "Routes without a named call" table: {"METHOD PATH": why}."""
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("### Routes without a named call")
    section = text[start : text.index("\n### ", start + 1)]
    listed = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) == 2:
            for route in re.findall(r"`([A-Z]+ /[^`]*)`", cells[0]):
                listed[route] = cells[1]
    return listed


def _unexplained_routes(routes):
    """The routes that are neither a named call of both clients nor in the README's table; and the README's
    routes the list does not have (stale lines)."""
    listed = _routes_of_readme()
    missing = []
    for route in routes:
        name = _NAMED_ROUTES.get(route)
        if name is not None and hasattr(lc.Client, name) and hasattr(lc.AsyncClient, name):
            continue
        if listed.get(route):
            continue
        missing.append(route)
    return missing, sorted(set(listed) - set(routes))


class TestServerRoutes(unittest.TestCase):
    """Every route the server registers (the copy in dev/testdata/server_routes.txt) is a named call or a
    README line with its reason; a fresh clone runs this on the copy, without the source."""

    def test_every_route_is_a_call_or_in_the_readme(self):
        routes = _routes_of_copy()
        self.assertGreaterEqual(len(routes), 50)
        missing, stale = _unexplained_routes(routes)
        self.assertEqual(missing, [], "routes with neither a call nor a README line (### Routes without a named call)")
        self.assertEqual(stale, [], "README lines of routes the server does not register")
        self.assertEqual(sorted(set(_NAMED_ROUTES) - set(routes)), [], "named calls of routes the server lacks")

    def test_a_new_route_fails_it(self):
        missing, _ = _unexplained_routes(_routes_of_copy() + ["POST /v1/images/generations"])
        self.assertEqual(missing, ["POST /v1/images/generations"])

    def test_the_reader_of_the_source(self):
        text = (
            'ctx_http.get ("/a", h);\n  ctx_http.del ("/b",  x); // c\nctx_http.post("/a", y); ctx_http.get("/a", z);'
        )
        self.assertEqual(_routes_of_source(text), ["GET /a", "DELETE /b", "POST /a"])


def _llama_source():
    """tools/server/server.cpp of the source tree dev/llama-server.sh builds from (None when not unpacked)."""
    try:
        out = subprocess.run(
            ["bash", os.path.join(HERE, "dev", "llama-server.sh"), "source"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            timeout=30,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        return None
    path = os.path.join(out.strip(), "tools", "server", "server.cpp")
    return path if os.path.isfile(path) else None


LLAMA_SERVER_CPP = _llama_source()


@unittest.skipUnless(LLAMA_SERVER_CPP, "no llama.cpp source: run dev/llama-server.sh build (.ci/run does)")
class TestRealServerRoutes(unittest.TestCase):
    """The copy of the route list is the source's own: a server that gains a route fails TestServerRoutes."""

    def test_the_copy_is_the_source_route_list(self):
        with open(LLAMA_SERVER_CPP, encoding="utf-8") as f:
            routes = _routes_of_source(f.read())
        self.assertEqual(routes, _routes_of_copy(), "dev/testdata/server_routes.txt is not %s" % LLAMA_SERVER_CPP)
        self.assertEqual(_unexplained_routes(routes), ([], []))


# -----------------------------------------------------------------------------------------------------
# The rest of the server API, HTTPS and path prefixes: every single-shot call goes through one request
# path, so each is checked for its exact request, its decoded answer and every error class of that path
# -----------------------------------------------------------------------------------------------------


#: A test-only key and self-signed certificate for localhost and 127.0.0.1 (see its README).
_API_TLS_DIR = os.path.join(HERE, "dev", "testdata", "tls")


_API_TLS_CERT = os.path.join(_API_TLS_DIR, "localhost.pem")


_API_TLS_KEY = os.path.join(_API_TLS_DIR, "localhost.key")


#: liveness for the stall tests (waited out once per call); MARGIN is how late an error may come after it.
_API_LIVENESS = 0.4


#: max_body for the cap tests: every answer of the table below fits in it once padded.
_API_MAX_BODY = 256


_API_MSGS = b'[{"role": "user", "content": "hi"}]'


_API_METRICS = (
    "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
    "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 29\n"
)


def _api_calls():
    """Every single-shot call: (name, call, request line, JSON body as sent or None, answer, what the call
    returns for it, answers of valid JSON in the wrong shape).  A str answer is served as text/plain."""
    return [
        (
            "request GET",
            lambda c: c.request("GET", "/v1/models", query={"limit": 2, "q": "a b&c"}),
            b"GET /v1/models?limit=2&q=a+b%26c",
            None,
            {"data": []},
            {"data": []},
            [],
        ),
        (
            "request POST",
            lambda c: c.request("POST", "/infill", {"input_prefix": "def f"}),
            b"POST /infill",
            b'{"input_prefix": "def f"}',
            {"content": "():"},
            {"content": "():"},
            [],
        ),
        (
            "slots",
            lambda c: [(s.id, s.is_processing, s.task, s.raw) for s in c.slots()],
            b"GET /slots",
            None,
            [{"id": 0, "is_processing": True, "id_task": 7}],
            [(0, True, 7, {"id": 0, "is_processing": True, "id_task": 7})],
            [{"slots": []}, [{"id": "0", "is_processing": False}]],
        ),
        ("health", lambda c: c.health(), b"GET /health", None, {"status": "ok"}, {"status": "ok"}, [["ok"]]),
        ("props", lambda c: c.props(), b"GET /props", None, {"total_slots": 2}, {"total_slots": 2}, [[2]]),
        (
            "models",
            lambda c: c.models(),
            b"GET /v1/models",
            None,
            {"data": [{"id": "m"}]},
            {"data": [{"id": "m"}]},
            [[]],
        ),
        (
            "load_model",
            lambda c: c.load_model("m2"),
            b"POST /models/load",
            b'{"model": "m2"}',
            {"success": True},
            {"success": True},
            [[True]],
        ),
        (
            "unload_model",
            lambda c: c.unload_model("m2"),
            b"POST /models/unload",
            b'{"model": "m2"}',
            {"success": True},
            {"success": True},
            [[True]],
        ),
        (
            "end_reasoning",
            lambda c: c.end_reasoning("chatcmpl-1"),
            b"POST /v1/chat/completions/control",
            b'{"id": "chatcmpl-1", "action": "reasoning_end"}',
            {"success": True},
            True,
            [[True]],
        ),
        (
            "tokenize",
            lambda c: c.tokenize("Hi there"),
            b"POST /tokenize",
            b'{"content": "Hi there", "add_special": false, "parse_special": true, "with_pieces": false}',
            {"tokens": [13347, 1070]},
            [13347, 1070],
            [{"tokens": "13347"}, {}, [13347]],
        ),
        (
            "tokenize with pieces",
            lambda c: c.tokenize("Hi", add_special=True, parse_special=False, with_pieces=True),
            b"POST /tokenize",
            b'{"content": "Hi", "add_special": true, "parse_special": false, "with_pieces": true}',
            {"tokens": [{"id": 2, "piece": "<s>"}]},
            [{"id": 2, "piece": "<s>"}],
            [{"pieces": []}],
        ),
        (
            "detokenize",
            lambda c: c.detokenize((13347, 1070)),
            b"POST /detokenize",
            b'{"tokens": [13347, 1070]}',
            {"content": "Hi there"},
            "Hi there",
            [{"content": 5}, {"content": None}],
        ),
        (
            "apply_template",
            lambda c: c.apply_template(MSGS, add_generation_prompt=True),
            b"POST /apply-template",
            b'{"add_generation_prompt": true, "messages": ' + _API_MSGS + b"}",
            {"prompt": "<|im_start|>user\nhi"},
            "<|im_start|>user\nhi",
            [{"prompt": ["x"]}],
        ),
        (
            "count_tokens",
            lambda c: c.count_tokens(MSGS),
            b"POST /v1/chat/completions/input_tokens",
            b'{"messages": ' + _API_MSGS + b"}",
            {"input_tokens": 9},
            9,
            [{"input_tokens": True}, {"input_tokens": 9.5}],
        ),
        (
            "embed",
            lambda c: c.embed(["a", "b"]),
            b"POST /v1/embeddings",
            b'{"input": ["a", "b"]}',
            {"data": [{"index": 1, "embedding": [0.5]}, {"index": 0, "embedding": [-1.0]}]},
            [[-1.0], [0.5]],
            [
                {"data": [{"index": 0}]},
                {"data": {}},
                {"data": [{"index": "1", "embedding": [0.5]}, {"index": 0, "embedding": [-1.0]}]},
                {"data": [{"index": None, "embedding": [0.5]}, {"index": 0, "embedding": [-1.0]}]},
            ],
        ),
        (
            "embed one",
            lambda c: c.embed("a", encoding_format="float"),
            b"POST /v1/embeddings",
            b'{"encoding_format": "float", "input": "a"}',
            {"data": [{"index": 0, "embedding": [0.25, 1.5]}]},
            [[0.25, 1.5]],
            [{"data": [{"index": 0, "embedding": "0.25"}]}],
        ),
        (
            "rerank",
            lambda c: c.rerank("q", ("d0", "d1"), top_n=2),
            b"POST /v1/rerank",
            b'{"top_n": 2, "query": "q", "documents": ["d0", "d1"]}',
            {"results": [{"index": 1, "relevance_score": 0.5}, {"index": 0, "relevance_score": -2}]},
            [{"index": 1, "relevance_score": 0.5}, {"index": 0, "relevance_score": -2}],
            [{"results": {}}],
        ),
        (
            "save_slot",
            lambda c: c.save_slot(1, "s.bin"),
            b"POST /slots/1?action=save",
            b'{"filename": "s.bin"}',
            {"id_slot": 1, "n_saved": 12},
            {"id_slot": 1, "n_saved": 12},
            [[1]],
        ),
        (
            "restore_slot",
            lambda c: c.restore_slot(1, "s.bin"),
            b"POST /slots/1?action=restore",
            b'{"filename": "s.bin"}',
            {"id_slot": 1, "n_restored": 12},
            {"id_slot": 1, "n_restored": 12},
            [[1]],
        ),
        (
            "erase_slot",
            lambda c: c.erase_slot(0),
            b"POST /slots/0?action=erase",
            b"{}",
            {"id_slot": 0, "n_erased": 12},
            {"id_slot": 0, "n_erased": 12},
            [[0]],
        ),
        ("metrics", lambda c: c.metrics(), b"GET /metrics", None, _API_METRICS, _API_METRICS, []),
    ]


def _api_head(line, body=None, host=b"localhost", accept=b"application/json", extra=b""):
    """The request head loopclient sends (as FakeRequest.raw_head holds it: without the blank line).  A
    streamed request closes its connection; a single-shot one (keep_alive by default) does not say."""
    head = line + b" HTTP/1.1\r\nHost: " + host + b"\r\nAccept: " + accept + b"\r\n"
    if body is not None:
        head += b"Content-Type: application/json\r\n"
    if accept == b"text/event-stream":
        head += b"Connection: close\r\n"
    head += b"User-Agent: loopclient/" + lc.__version__.encode() + extra
    if body is not None:
        head += b"\r\nContent-Length: %d" % len(body)
    return head


def _api_body(answer):
    """(body bytes, Content-Type) of an answer: JSON as llama-server writes it, or text for a str."""
    if isinstance(answer, str):
        return answer.encode(), b"text/plain; version=0.0.4"
    return json.dumps(answer, separators=(",", ":")).encode(), b"application/json; charset=utf-8"


def _api_route(server, line, handler):
    method, target = line.decode().split(" ", 1)
    server.route(method, target, handler)


class _UnixServer:
    """A Unix-socket server of the tests' own: an accept thread and a thread per connection (``_serve(conn,
    number)``, numbered from 1 in accept order), every socket tracked so that ``close()`` can shut it down
    (on Linux a ``close()`` alone does not wake a thread blocked in ``recv()``), join the threads and say
    which are still alive.  A subclass sets its own attributes before calling ``__init__``."""

    def __init__(self, prefix, name):
        self.tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        self.path = os.path.join(self.tmp, name)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.sockets = set()
        self.threads = []
        self.connections = 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(64)
        self.listener.settimeout(0.05)
        self._start(self._accept)

    def _start(self, target, *args):
        thread = threading.Thread(target=target, args=args, name="lc-test-server", daemon=True)
        with self.lock:
            self.threads.append(thread)
        thread.start()

    def _track(self, sock):
        with self.lock:
            if self.stopping.is_set():
                sock.close()
                return False
            self.sockets.add(sock)
            return True

    def _untrack(self, sock):
        with self.lock:
            self.sockets.discard(sock)
        sock.close()

    def _accept(self):
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            if self._track(conn):
                with self.lock:
                    self.connections += 1
                    number = self.connections
                self._start(self._serve, conn, number)

    def close(self):
        self.stopping.set()
        self.listener.close()
        with self.lock:
            sockets = list(self.sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(10)
        for sock in sockets:
            sock.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return [t for t in threads if t.is_alive()]


class KeepAliveServer(_UnixServer):
    """A Unix socket server that answers many requests on one connection, as llama-server does for plain
    answers (``Keep-Alive: timeout=5, max=100``).  ``answer(req)`` gives each answer's bytes;
    ``close_after`` answers, it closes the connection (None: when the client does)."""

    def __init__(self, answer, close_after=None):
        self.answer = answer
        self.close_after = close_after
        self.requests = []  # (connection number, request)
        _UnixServer.__init__(self, "lcka", "s.sock")
        self.address = self.path

    def _serve(self, conn, number):
        try:
            conn.settimeout(5)
            served = 0
            while not self.stopping.is_set():
                request = read_request(conn)
                if request is None:
                    return
                with self.lock:
                    self.requests.append((number, request))
                conn.sendall(self.answer(request))
                served += 1
                if self.close_after is not None and served >= self.close_after:
                    return
        except OSError:
            pass
        finally:
            self._untrack(conn)


def keep_alive_answer(doc, headers=b"Keep-Alive: timeout=5, max=100\r\n", version=b"HTTP/1.1", body=None):
    """A plain JSON answer as llama-server sends it, without ``Connection: close``."""
    body = json.dumps(doc).encode() if body is None else body
    return b"%s 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n%s\r\n%s" % (
        version,
        len(body),
        headers,
        body,
    )


class TestDroppedClient(unittest.TestCase):
    def test_a_client_dropped_unclosed_frees_its_kept_connection_at_once(self):
        """No reference cycle holds a kept connection: reference counting closes it, the collector need not."""
        server = KeepAliveServer(lambda req: keep_alive_answer({"tokens": [7]}))
        self.addCleanup(server.close)
        client = lc.Client(server.address, limits=FAST)
        self.assertEqual(run_with_timeout(functools.partial(client.tokenize, "x")), [7])
        ((kept, _, _),) = client._board.idle
        sock = weakref.ref(kept.sock)
        gc.disable()
        self.addCleanup(gc.enable)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # an unclosed socket's, as Python gives for any
            del client, kept
        self.assertIsNone(sock())  # freed, so closed


class TestKeepAlive(ClientFactory, unittest.TestCase):
    """Single-shot calls keep ``Limits.keep_alive`` idle connections and reuse them by the rules."""

    def setUp(self):
        self.fds = fd_count()
        self.servers = []
        self.clients = []

    def tearDown(self):
        for client in self.clients:
            client.close()
        for server in self.servers:
            server.close()
        wait_for(lambda: fd_count() <= self.fds, 5, "descriptors to close")

    def serve(self, answer, close_after=None, **limits):
        server = KeepAliveServer(answer, close_after)
        self.servers.append(server)
        client = self.new_client(server.address, limits=FAST.replace(**limits))
        self.clients.append(client)
        return server, client

    def tokens(self, client, n):
        return [run_with_timeout(lambda: client.tokenize("x")) for _ in range(n)]

    def test_plain_answers_reuse_one_connection(self):
        server, client = self.serve(lambda req: keep_alive_answer({"tokens": [7]}))
        self.assertEqual(self.tokens(client, 3), [[7]] * 3)
        self.assertEqual(server.connections, 1)
        self.assertEqual([n for n, _ in server.requests], [1, 1, 1])
        self.assertNotIn(b"Connection:", server.requests[0][1].head)

    def test_keep_alive_zero_opens_a_connection_per_call(self):
        server, client = self.serve(lambda req: keep_alive_answer({"tokens": [7]}), keep_alive=0)
        self.assertEqual(self.tokens(client, 3), [[7]] * 3)
        self.assertEqual(server.connections, 3)
        self.assertIn(b"\r\nConnection: close\r\n", server.requests[0][1].head + b"\r\n")

    def test_a_kept_connection_the_server_closed_is_resent_once_on_a_new_one(self):
        server, client = self.serve(lambda req: keep_alive_answer({"tokens": [7]}), close_after=1)
        self.assertEqual(self.tokens(client, 3), [[7]] * 3)
        self.assertEqual(server.connections, 3)
        self.assertEqual(len(server.requests), 3)  # the server never saw a request twice

    def test_answers_that_say_close_or_have_no_known_length_are_never_reused(self):
        cases = {
            "Connection: close": keep_alive_answer({"tokens": [7]}, headers=b"Connection: close\r\n"),
            "HTTP/1.0": keep_alive_answer({"tokens": [7]}, version=b"HTTP/1.0"),
            "Keep-Alive timeout=1": keep_alive_answer({"tokens": [7]}, headers=b"Keep-Alive: timeout=1\r\n"),
            "Keep-Alive max=1": keep_alive_answer({"tokens": [7]}, headers=b"Keep-Alive: timeout=5, max=1\r\n"),
        }
        for name, answer in cases.items():
            with self.subTest(name):
                server, client = self.serve(lambda req, a=answer: a)
                self.assertEqual(self.tokens(client, 2), [[7]] * 2)
                self.assertEqual(server.connections, 2)

    def test_a_short_body_fails_and_its_connection_is_not_reused(self):
        answers = iter([keep_alive_answer(None, body=b'{"tokens": [7]}')[:-5], keep_alive_answer({"tokens": [8]})])
        server, client = self.serve(lambda req: next(answers), close_after=1)
        with self.assertRaises(lc.StreamClosedError):
            run_with_timeout(lambda: client.tokenize("x"))
        self.assertEqual(self.tokens(client, 1), [[8]])
        self.assertEqual(server.connections, 2)

    def test_a_connection_idle_past_the_servers_timeout_is_not_reused(self):
        server, client = self.serve(
            lambda req: keep_alive_answer({"tokens": [7]}, headers=b"Keep-Alive: timeout=2\r\n")
        )
        self.assertEqual(self.tokens(client, 1), [[7]])
        time.sleep(1.05)  # the subject: idle longer than the server's timeout less one second
        self.assertEqual(self.tokens(client, 1), [[7]])
        self.assertEqual(server.connections, 2)

    def test_at_most_keep_alive_connections_are_kept(self):
        def answer(req):
            time.sleep(0.2)  # the server's pace: two calls at once are both in flight
            return keep_alive_answer({"tokens": [7]})

        server, client = self.serve(answer, keep_alive=1)
        results = []
        threads = [threading.Thread(target=lambda: results.append(client.tokenize("x")), daemon=True) for _ in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        self.assertEqual(results, [[7], [7]])
        self.assertEqual(server.connections, 2)
        self.assertEqual(self.tokens(client, 2), [[7]] * 2)  # one kept, the other closed
        self.assertEqual(server.connections, 2)
        self.assertEqual(server.requests[-1][0], server.requests[-2][0])

    def test_streams_keep_a_connection_of_their_own(self):
        def answer(req):
            if req.path == "/v1/chat/completions":
                return STREAM_HEAD + content_stream(["ok"])
            return keep_alive_answer({"total_slots": 2})

        server, client = self.serve(answer)
        self.assertEqual(run_with_timeout(lambda: client.chat(MSGS, slot=None)).content, "ok")
        self.assertEqual(run_with_timeout(lambda: client.chat(MSGS, slot=None)).content, "ok")
        paths = [(n, r.path) for n, r in server.requests]
        self.assertEqual([p for _, p in paths], ["/props", "/v1/chat/completions", "/v1/chat/completions"])
        self.assertEqual(len({n for n, _ in paths}), 3)  # STREAM_HEAD says close: no stream reuses


class TestKeepAliveAsync(AsyncDriver, TestKeepAlive):
    pass


class TestKeepAliveFork(unittest.TestCase):
    """A process made by os.fork() never uses its parent's kept connections (threaded client only: asyncio
    does not survive a fork of a running loop)."""

    def test_the_child_opens_its_own_and_the_parent_keeps_its_own(self):
        server = KeepAliveServer(lambda req: keep_alive_answer({"tokens": [os.getpid() % 1000]}))
        self.addCleanup(server.close)
        with lc.Client(server.address, limits=FAST) as client:
            run_with_timeout(lambda: client.tokenize("x"))
            self.assertEqual(server.connections, 1)
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: one call, its outcome through the pipe, and out
                code = 1
                try:
                    client.tokenize("x")
                    os.write(write, b"ok")
                    code = 0
                finally:
                    os._exit(code)
            os.close(write)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.01)
            else:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                self.fail("the child did not finish")
            self.assertEqual(os.read(read, 10), b"ok")
            os.close(read)
            self.assertTrue(os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status)
            self.assertEqual(server.connections, 2)  # the child's own
            run_with_timeout(lambda: client.tokenize("x"))
            self.assertEqual(server.connections, 2)  # the parent's kept connection still serves it
            self.assertEqual([n for n, _ in server.requests], [1, 2, 1])


class _ApiCase(ServerCase):
    def _api_one_request(self, since):
        """The one request the server received since ``since`` requests."""
        with self.server.lock:
            reqs = self.server.requests[since:]
        self.assertEqual(len(reqs), 1, [r.raw_head for r in reqs])
        return reqs[0]

    def _api_nothing_sent(self, client=None):
        """Prove that no call so far connected: a sentinel call is the server's first connection (the
        listener accepts in order, so an earlier connection would have been accepted before it)."""
        self.assertEqual((client or self.client).health(), {"status": "ok"})
        with self.server.lock:
            self.assertEqual([r.raw_head.split(b"\r\n")[0] for r in self.server.requests], [b"GET /health HTTP/1.1"])
            self.assertEqual(len(self.server.conns), 1)


class TestApiCalls(_ApiCase):
    """Each single-shot call: the exact request line, headers and body sent, and the answer decoded."""

    def test_each_call_sends_its_exact_request_and_decodes_the_answer(self):
        for name, call, line, body, answer, value, _ in _api_calls():
            with self.subTest(call=name):
                _api_route(self.server, line, reply(http_response(*_api_body(answer))))
                since = len(self.server.requests)
                got = run_with_timeout(lambda call=call: call(self.client))
                self.assertEqual(got, value)
                self.assertIs(type(got), type(value))
                req = self._api_one_request(since)
                self.assertEqual(req.raw_head, _api_head(line, body))
                self.assertEqual(req.body, body or b"")

    def test_request_bytes_with_api_key_and_headers_whole(self):
        self.server.route("POST", "/tokenize", reply(json_response({"tokens": [1]})))
        client = self.new_client(self.server.address, limits=FAST, api_key="sk-1", headers={"X-Trace": "1"})
        self.closers.append(client.close)
        self.assertEqual(run_with_timeout(lambda: client.tokenize("a\r\nb")), [1])
        req = self.server.requests[0]
        self.assertEqual(
            req.raw_head + b"\r\n\r\n" + req.body,
            b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n"
            b"Content-Type: application/json\r\nUser-Agent: loopclient/%s\r\n"
            b"X-Trace: 1\r\nAuthorization: Bearer sk-1\r\nContent-Length: 88\r\n\r\n"
            b'{"content": "a\\r\\nb", "add_special": false, "parse_special": true, "with_pieces": false}'
            % lc.__version__.encode(),
        )

    def test_request_decodes_json_by_content_type_else_text(self):
        cases = [
            (b"application/json; charset=utf-8", b'{"a":[1,2.5,null]}', b"200 OK", {"a": [1, 2.5, None]}),
            (b"application/problem+json", b'"x"', b"200 OK", "x"),
            (b"text/plain; charset=utf-8", b'{"a":1}', b"200 OK", '{"a":1}'),
            (b"text/html", b"<p>caf\xc3\xa9 \xff</p>", b"200 OK", "<p>caf\u00e9 \ufffd</p>"),
            (b"application/json", b'{"id":3}', b"201 Created", {"id": 3}),
        ]
        for ctype, body, status, value in cases:
            with self.subTest(ctype=ctype, status=status):
                self.server.route("GET", "/x", reply(http_response(body, ctype, "length", status)))
                self.assertEqual(run_with_timeout(lambda: self.client.request("GET", "/x")), value)
        self.server.route("GET", "/plain", reply(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
        self.assertEqual(run_with_timeout(lambda: self.client.request("GET", "/plain")), "ok")  # no Content-Type

    def test_head_and_204_answers_have_no_body(self):
        # RFC 9112 6.3: a HEAD response and a 204 end at their head, whatever Content-Length says; the
        # server keeps the connection open, so reading on would stall.
        def head(req):
            req.send(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\nConnection: close\r\n\r\n"
            )
            req.wait_peer_close(30)

        def no_content(req):
            req.send(b"HTTP/1.1 204 No Content\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
            req.wait_peer_close(30)

        self.server.route("HEAD", "/health", head)
        self.server.route("DELETE", "/slots/0", no_content)
        self.assertEqual(run_with_timeout(lambda: self.client.request("HEAD", "/health")), "")
        self.assertEqual(run_with_timeout(lambda: self.client.request("DELETE", "/slots/0")), "")
        # neither waited for a body: the client closed each connection while the server held it (30 s);
        # reading on would have been StalledError after liveness (2 s)
        self.assertTrue(all(r.closed_by_peer.wait(10) for r in self.server.requests))
        self.assertEqual(
            [r.raw_head for r in self.server.requests],
            [_api_head(b"HEAD /health"), _api_head(b"DELETE /slots/0")],
        )

    def test_query_joins_a_query_already_in_the_path(self):
        self.server.route("GET", "/props?a=1&b=2", reply(json_response({"ok": 1})))
        self.assertEqual(run_with_timeout(lambda: self.client.request("GET", "/props?a=1", query={"b": 2})), {"ok": 1})
        self.assertEqual(self.server.requests[0].raw_head, _api_head(b"GET /props?a=1&b=2"))


class TestApiCallsAsync(AsyncDriver, TestApiCalls):
    pass


class TestApiErrors(VirtualFactory, _ApiCase):
    """Each single-shot call meets each error class of the one request path."""

    def test_unreachable_is_connect_error_with_address_and_cause(self):
        missing = os.path.join(self.server.tmp, "missing.sock")
        bound = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # bound, never listening: refused
        self.closers.append(bound.close)
        bound.bind(("127.0.0.1", 0))
        url = "http://127.0.0.1:%d" % bound.getsockname()[1]
        for address, cause, text in (
            (missing, FileNotFoundError, "no llama-server at %s: the socket file does not exist" % missing),
            (url, ConnectionRefusedError, "no llama-server listening at %s (connection refused)" % url),
        ):
            client = self.new_client(address, limits=FAST)
            self.closers.append(client.close)
            for name, call, *_ in _api_calls():
                with self.subTest(call=name, address=address):
                    with self.assertRaises(lc.ConnectError) as cm:
                        run_with_timeout(lambda call=call: call(client))
                    self.assertEqual(cm.exception.address, address)
                    self.assertIsInstance(cm.exception.__cause__, cause)
                    self.assertEqual(str(cm.exception), text)

    def test_error_status_is_http_status_error_with_the_envelope(self):
        envelope = b'{"error":{"code":500,"message":"slot 1 is busy: boom","type":"server_error"}}'
        not_found = b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}'
        for name, call, line, *_ in _api_calls():
            with self.subTest(call=name):
                self.server.routes.clear()  # the FakeServer's own 404, as llama-server words it
                with self.assertRaises(lc.HTTPStatusError) as cm:
                    run_with_timeout(lambda call=call: call(self.client))
                err = cm.exception
                self.assertEqual((err.status, err.message, err.body), (404, "File Not Found", not_found))
                _api_route(
                    self.server,
                    line,
                    reply(http_response(envelope, b"application/json", "chunked", b"500 Internal Server Error")),
                )
                with self.assertRaises(lc.HTTPStatusError) as cm:
                    run_with_timeout(lambda call=call: call(self.client))
                err = cm.exception
                self.assertEqual((err.status, err.message, err.body), (500, "slot 1 is busy: boom", envelope))
                self.assertEqual(str(err), "HTTP 500: slot 1 is busy: boom")

    def test_silence_is_stalled_after_liveness(self):
        client = self.new_client(self.server.address, limits=FAST.replace(liveness=_API_LIVENESS))
        self.closers.append(client.close)
        for name, call, line, *_ in _api_calls():
            with self.subTest(call=name):
                _api_route(self.server, line, lambda req: req.wait_peer_close(5))
                start = time.monotonic()
                with self.assertRaises(lc.StalledError) as cm:
                    run_with_timeout(lambda call=call: call(client))
                elapsed = time.monotonic() - start
                self.assertIs(type(cm.exception), lc.StalledError)
                self.assertElapsed(elapsed, _API_LIVENESS, early=EARLY)

    def test_silence_after_the_head_is_stalled_but_slow_progress_is_not(self):
        # liveness bounds the gap between two reads, never the whole answer
        client = self.new_client(self.server.address, limits=FAST.replace(liveness=0.4))
        self.closers.append(client.close)
        body = b'{"tokens":[1,2,3,4,5,6,7,8,9]}'

        def drip(req):  # the head, then the body 3 bytes at a time, 0.1 s apart
            req.send(http_response(body, b"application/json")[: -len(body)])
            for i in range(0, len(body), 3):
                time.sleep(0.1)  # the scripted server's pace: slow progress is what this test is about
                if not req.send(body[i : i + 3]):
                    return

        self.server.route("POST", "/tokenize", drip)
        start = time.monotonic()
        self.assertEqual(run_with_timeout(lambda: client.tokenize("x")), [1, 2, 3, 4, 5, 6, 7, 8, 9])
        self.assertGreaterEqual(time.monotonic() - start, 0.8)  # twice liveness, in gaps of 0.1 s

        def head_then_silence(req):
            req.send(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n{"tok')
            req.wait_peer_close(5)

        self.server.route("POST", "/tokenize", head_then_silence)
        start = time.monotonic()
        with self.assertRaises(lc.StalledError):
            run_with_timeout(lambda: client.tokenize("x"))
        self.assertElapsed(time.monotonic() - start, 0.4, early=0.03)

    def test_body_over_max_body_is_protocol_error(self):
        client = self.new_client(self.server.address, limits=FAST.replace(max_body=_API_MAX_BODY))
        self.closers.append(client.close)
        for name, call, line, _, answer, value, _ in _api_calls():
            body, ctype = _api_body(answer)
            self.assertLessEqual(len(body), _API_MAX_BODY)
            pad = (b"#" if isinstance(answer, str) else b" ") * (_API_MAX_BODY - len(body))
            for framing in ("length", "chunked", "close"):
                with self.subTest(call=name, framing=framing):
                    _api_route(self.server, line, reply(http_response(body + pad, ctype, framing)))
                    expect = value + pad.decode() if isinstance(answer, str) else value
                    self.assertEqual(run_with_timeout(lambda call=call: call(client)), expect)  # exactly max_body
                    _api_route(
                        self.server,
                        line,
                        # the connection stays open: the cap alone can end the call
                        reply(http_response(body + pad + b" ", ctype, framing), hold=True),
                    )
                    t = Timer()
                    with self.assertRaises(lc.ProtocolError) as cm:
                        run_with_timeout(lambda call=call: call(client))
                    self.assertIn("max_body", str(cm.exception))
                    self.assertAtOnce(t.elapsed, 1.0)  # at once (and not a StalledError after liveness, 2 s)
        big = json.dumps({"error": {"code": 500, "message": "x" * _API_MAX_BODY}}).encode()
        self.server.route("POST", "/tokenize", reply(http_response(big, b"application/json", status=b"500 Oops")))
        with self.assertRaises(lc.ProtocolError):  # an error body is capped too
            run_with_timeout(lambda: client.tokenize("x"))

    def test_malformed_answer_is_protocol_error(self):
        framing = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
        not_http = b"SSH-2.0-OpenSSH_9.6\r\n"
        for name, call, line, _, answer, _, wrong in _api_calls():
            bad = [framing, not_http]
            if not isinstance(answer, str):  # a JSON answer: broken JSON, and JSON of the wrong shape
                bad.append(http_response(b'{"tokens":[1,', b"application/json; charset=utf-8"))
                bad += [http_response(*_api_body(doc)) for doc in wrong]
            for raw in bad:
                with self.subTest(call=name, answer=raw[-60:]):
                    _api_route(self.server, line, reply(raw))
                    with self.assertRaises(lc.ProtocolError):
                        run_with_timeout(lambda call=call: call(self.client))
            with self.subTest(call=name, answer="cut short"):
                _api_route(self.server, line, reply(b'HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{"a"'))
                with self.assertRaises(lc.StreamClosedError):
                    run_with_timeout(lambda call=call: call(self.client))

    def test_cr_lf_nul_in_method_path_or_query_refused_before_anything_is_sent(self):
        c = self.client
        for method, path, query in (
            ("GET\r\n", "/health", None),
            ("GE\nT", "/health", None),
            ("G\0T", "/health", None),
            ("GET /x", "/health", None),
            ("", "/health", None),
            ("GET", "/health\r\nX-Injected: 1", None),
            ("GET", "/health\n", None),
            ("GET", "/health\r", None),
            ("GET", "/he\0alth", None),
            ("GET", "/he alth", None),
            ("GET", "health", None),
            ("GET", "", None),
            ("GET", "/health", {"a\r\nX-Injected: 1": "v"}),
            ("GET", "/health", {"a": "v\r\nX-Injected: 1"}),
            ("GET", "/health", {"a": "v\n"}),
            ("GET", "/health", {"a": "\0"}),
            ("GET", "/health", {b"a\r": "v"}),
            ("GET", "/health", {"a": b"v\r\n"}),
            ("POST", "/tokenize\r\n", {"a": "1"}),
        ):
            with self.subTest(method=method, path=path, query=query), self.assertRaises(ValueError):
                c.request(method, path, {"content": "x"} if method == "POST" else None, query=query)
        with self.assertRaises(TypeError):  # a query is a dict
            c.request("GET", "/health", query=[("a", "1")])
        self._api_nothing_sent()

    def test_closed_client_refuses_every_call_without_connecting(self):
        client = self.new_client(self.server.address, limits=FAST)
        client.close()
        calls = [(name, call) for name, call, *_ in _api_calls()]
        calls += [("stream", lambda c: c.stream(MSGS, slot=0)), ("chat", lambda c: c.chat(MSGS, slot=None))]
        for name, call in calls:
            with self.subTest(call=name):
                with self.assertRaises(ValueError) as cm:
                    run_with_timeout(lambda call=call: call(client))
                self.assertEqual(str(cm.exception), "this client is closed")
        client.close()  # twice is fine
        for slot in (0, None):  # a stream made before close() and iterated after it is cancelled, unsent
            early = self.new_client(self.server.address, limits=FAST)
            stream = early.stream(MSGS, slot=slot)
            early.close()
            with self.subTest(slot=slot), self.assertRaises(lc.CancelledError):
                run_with_timeout(lambda stream=stream: next(stream))
        self._api_nothing_sent()
        with self.assertRaises(TypeError):
            self.new_client("https://localhost:1", ssl_context="no")


TestApiErrorsSockets, TestApiErrorsSocketsAsync = on_sockets(
    TestApiErrors,
    "test_unreachable_is_connect_error_with_address_and_cause",
    "test_error_status_is_http_status_error_with_the_envelope",
    "test_body_over_max_body_is_protocol_error",
)


class TestApiRouting(_ApiCase):
    """Client(..., model="alpha"): a GET names the model in its query, a JSON object body without a model
    gets it, one with a model keeps its own; request() included."""

    def test_single_shot_calls_are_routed_to_the_default_model(self):
        client = self.new_client(self.server.address, limits=FAST, model="alpha")
        self.closers.append(client.close)
        m = b', "model": "alpha"}'
        for name, call, line, body, answer in (
            ("request GET", lambda c: c.request("GET", "/props"), b"GET /props?model=alpha", None, {}),
            (
                "request GET with a query",
                lambda c: c.request("GET", "/x", query={"n": 2}),
                b"GET /x?n=2&model=alpha",
                None,
                {},
            ),
            (
                "request GET naming a model",
                lambda c: c.request("GET", "/props", query={"model": "beta"}),
                b"GET /props?model=beta",
                None,
                {},
            ),
            (
                "request GET naming a model in its path",
                lambda c: c.request("GET", "/props?model=beta"),
                b"GET /props?model=beta",
                None,
                {},
            ),
            (
                "request POST",
                lambda c: c.request("POST", "/completion", {"prompt": "x"}),
                b"POST /completion",
                b'{"prompt": "x"' + m,
                {},
            ),
            (
                "request POST naming a model",
                lambda c: c.request("POST", "/completion", {"model": "beta", "prompt": "x"}),
                b"POST /completion",
                b'{"model": "beta", "prompt": "x"}',
                {},
            ),
            ("request POST with a list body", lambda c: c.request("POST", "/x", [1]), b"POST /x", b"[1]", {}),
            (
                "request POST without a body",
                lambda c: c.request("POST", "/x", query={"a": 1}),
                b"POST /x?a=1",
                None,
                {},
            ),
            ("slots", lambda c: c.slots(), b"GET /slots?model=alpha", None, []),
            ("slots(model=)", lambda c: c.slots(model="beta"), b"GET /slots?model=beta", None, []),
            ("props", lambda c: c.props(), b"GET /props?model=alpha", None, {"total_slots": 1}),
            ("props(model=)", lambda c: c.props(model="beta"), b"GET /props?model=beta", None, {"total_slots": 1}),
            ("metrics", lambda c: c.metrics(), b"GET /metrics?model=alpha", None, _API_METRICS),
            (
                "tokenize",
                lambda c: c.tokenize("x"),
                b"POST /tokenize",
                b'{"content": "x", "add_special": false, "parse_special": true, "with_pieces": false' + m,
                {"tokens": [1]},
            ),
            ("detokenize", lambda c: c.detokenize([1]), b"POST /detokenize", b'{"tokens": [1]' + m, {"content": "x"}),
            (
                "apply_template",
                lambda c: c.apply_template(MSGS),
                b"POST /apply-template",
                b'{"messages": ' + _API_MSGS + m,
                {"prompt": "p"},
            ),
            (
                "apply_template naming a model",
                lambda c: c.apply_template(MSGS, model="beta"),
                b"POST /apply-template",
                b'{"model": "beta", "messages": ' + _API_MSGS + b"}",
                {"prompt": "p"},
            ),
            (
                "count_tokens",
                lambda c: c.count_tokens(MSGS),
                b"POST /v1/chat/completions/input_tokens",
                b'{"messages": ' + _API_MSGS + m,
                {"input_tokens": 3},
            ),
            ("embed", lambda c: c.embed("a"), b"POST /v1/embeddings", b'{"input": "a"' + m, {"data": []}),
            (
                "rerank",
                lambda c: c.rerank("q", ["d"]),
                b"POST /v1/rerank",
                b'{"query": "q", "documents": ["d"]' + m,
                {"results": []},
            ),
            (
                "save_slot",
                lambda c: c.save_slot(1, "s.bin"),
                b"POST /slots/1?action=save",
                b'{"filename": "s.bin"' + m,
                {},
            ),
            (
                "restore_slot",
                lambda c: c.restore_slot(1, "s.bin"),
                b"POST /slots/1?action=restore",
                b'{"filename": "s.bin"' + m,
                {},
            ),
            ("erase_slot", lambda c: c.erase_slot(1), b"POST /slots/1?action=erase", b'{"model": "alpha"}', {}),
            ("load_model", lambda c: c.load_model("beta"), b"POST /models/load", b'{"model": "beta"}', {}),
            ("unload_model", lambda c: c.unload_model("beta"), b"POST /models/unload", b'{"model": "beta"}', {}),
            (
                "end_reasoning",
                lambda c: c.end_reasoning("chatcmpl-1"),
                b"POST /v1/chat/completions/control",
                b'{"id": "chatcmpl-1", "action": "reasoning_end"' + m,
                {"success": True},
            ),
        ):
            with self.subTest(call=name):
                self.server.routes.clear()  # a request that is not routed as expected gets a 404
                _api_route(self.server, line, reply(http_response(*_api_body(answer))))
                since = len(self.server.requests)
                run_with_timeout(lambda call=call: call(client))
                req = self._api_one_request(since)
                self.assertEqual(req.raw_head, _api_head(line, body))
                self.assertEqual(req.body, body or b"")


class TestApiRoutingAsync(AsyncDriver, TestApiRouting):
    pass


class TestApiPrefix(_ApiCase):
    """http://host:port/llama: every request path carries the prefix, streams and their /slots and /props
    polls included."""

    tcp = True

    def test_every_call_and_stream_carries_the_prefix(self):
        self.client.close()
        self.client = self.new_client(self.server.address + "/llama/", limits=FAST)
        host = self.server.address[len("http://") :].encode()
        self.server.routes.clear()  # an unprefixed request gets a 404
        with self.assertRaises(ValueError):  # "/llama" + "health" would be another path: refused
            self.client.request("GET", "health")
        for name, call, line, body, answer, value, _ in _api_calls():
            with self.subTest(call=name):
                method, target = line.split(b" ", 1)
                prefixed = method + b" /llama" + target
                _api_route(self.server, prefixed, reply(http_response(*_api_body(answer))))
                since = len(self.server.requests)
                self.assertEqual(run_with_timeout(lambda call=call: call(self.client)), value)
                req = self._api_one_request(since)
                self.assertEqual(req.raw_head, _api_head(prefixed, body, host=host))
        with self.server.lock:  # the refused path never connected: one connection per request
            self.assertEqual(len(self.server.conns), len(self.server.requests))

        # streams: the chat, the /slots polls while its head is awaited, /props for slot=None
        self.server.route("GET", "/llama/slots", self.server._slots)
        self.server.route("GET", "/llama/props", lambda req: respond_json(req, {"total_slots": 2}))

        def after_a_poll(req):
            seen = self.server.slots_requests
            wait_for(lambda: self.server.slots_requests > seen, 5, "a /slots poll")
            req.send(STREAM_HEAD + content_stream(["ok"]))

        self.server.route("POST", "/llama/v1/chat/completions", after_a_poll)
        for slot in (0, None):
            completion, events = self.collect(slot=slot)
            self.assertEqual(completion.content, "ok")
            self.assertEqual(events[0], lc.Waiting(False))
            self.assertEqual(events[-1], lc.Content("ok"))
        with self.server.lock:
            paths = [r.path for r in self.server.requests]
        self.assertTrue(all(p.startswith("/llama/") for p in paths), paths)
        self.assertEqual(paths.count("/llama/v1/chat/completions"), 2)
        self.assertGreaterEqual(paths.count("/llama/slots"), 3)  # slots() above, then a poll per chat
        self.assertEqual(paths.count("/llama/props"), 2)  # props() above, then the pool size for slot=None


class TestApiPrefixAsync(AsyncDriver, TestApiPrefix):
    pass


class _ApiTLSServer(FakeServer):
    """The fake server over TLS with the committed test certificate: TCP on ``host``, each accepted
    connection's handshake done in its own thread.  ``handshakes`` holds None per completed handshake and
    the server-side error per failed one."""

    def __init__(self, host="127.0.0.1", **kw):
        self.host = host
        self.handshakes = []
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(_API_TLS_CERT, _API_TLS_KEY)
        super().__init__(tcp=True, **kw)

    def listen(self):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self.host, 0))
        self.address = "https://%s:%d" % (self.host, sock.getsockname()[1])
        sock.listen(64)
        sock.settimeout(0.05)
        self.listener = sock
        thread = threading.Thread(target=self._accept, args=(sock,), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _serve(self, conn):
        conn.settimeout(5)
        try:
            tls = self.context.wrap_socket(conn, server_side=True)
        except OSError as exc:  # the client refused the certificate (or left)
            conn.close()
            with self.lock:
                self.handshakes.append(exc)
            return
        with self.lock:
            self.handshakes.append(None)
            self.conns.append(tls)  # so that close() shuts the TLS connection down
        super()._serve(tls)


@real_time
class TestApiTLS(_ApiCase):
    """https:// against a local TLS server with a self-signed test certificate."""

    def setUp(self):
        self.fds = fd_count()
        self.threads = threading.active_count()
        self.server = _ApiTLSServer()
        self.trusting = ssl.create_default_context(cafile=_API_TLS_CERT)
        self.client = self.new_client(self.server.address, limits=FAST, ssl_context=self.trusting)
        self.closers = []

    def test_stream_and_calls_over_https_with_a_context_that_trusts_the_certificate(self):
        self.server.busy[0] = True
        answers = SlotAnswers(self)
        told_busy = threading.Event()

        def after_a_busy_poll(req):  # the head once the client has read a busy /slots (over TLS too)
            wait_for(told_busy.is_set, 10, "the client to read a /slots answer")
            with self.server.lock:
                self.server.busy[0] = False
            req.send(STREAM_HEAD + content_stream(["Hello", " world"]))

        def on_event(ev):
            events.append(ev)
            if lc.Waiting(True) in answers.sort(events)[0]:
                told_busy.set()

        self.use(after_a_busy_poll)
        events = []
        completion = run_with_timeout(lambda: self.client.chat(MSGS, slot=0, max_tokens=4, on_event=on_event))
        self.assertEqual(completion.content, "Hello world")
        self.assertEqual(answers.sort(events)[0][0], lc.Waiting(True))  # the /slots poll went over TLS too
        self.assertEqual(waits_first(self, events), [lc.Content("Hello"), lc.Content(" world")])
        host = self.server.address[len("https://") :].encode()
        body = (
            b'{"messages": '
            + _API_MSGS
            + b', "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}, "id_slot": 0}'
        )
        req = self.server.chat_requests()[0]
        self.assertEqual(
            req.raw_head, _api_head(b"POST /v1/chat/completions", body, host=host, accept=b"text/event-stream")
        )
        self.assertEqual(req.body, body)
        self.server.route("POST", "/tokenize", reply(json_response({"tokens": [5, 6]})))
        self.assertEqual(run_with_timeout(lambda: self.client.tokenize("x")), [5, 6])
        # the host name is checked too: localhost is in the certificate
        port = self.server.address.rsplit(":", 1)[1]
        by_name = self.new_client("https://localhost:%s" % port, limits=FAST, ssl_context=self.trusting)
        self.closers.append(by_name.close)
        self.assertEqual(run_with_timeout(by_name.health), {"status": "ok"})
        self.assertEqual(self.server.requests[-1].headers["host"], "localhost:%s" % port)
        with self.server.lock:
            paths = [r.path for r in self.server.requests]
        self.assertEqual(paths[-2:], ["/tokenize", "/health"])
        self.assertEqual(sorted(set(paths)), ["/health", "/slots", "/tokenize", "/v1/chat/completions"])

    def _api_refused(self, call, client):
        """``call(client)`` is ConnectError at once, caused by the certificate check; returns it."""
        start = time.monotonic()
        with self.assertRaises(lc.ConnectError) as cm:
            run_with_timeout(lambda: call(client))
        self.assertLess(time.monotonic() - start, lateness(self, 1.0))  # not retried under load_wait (30 s)
        err = cm.exception
        self.assertEqual(err.address, client.address)
        self.assertIsInstance(err.__cause__, ssl.SSLCertVerificationError)
        self.assertEqual(str(err), "TLS with %s failed: %s" % (client.address, err.__cause__.verify_message))
        return err

    def test_untrusted_certificate_is_connect_error_at_once_never_retried(self):
        # verification is on by default: the system store does not trust the test certificate
        client = self.new_client(self.server.address, limits=FAST.replace(load_wait=30.0))
        self.closers.append(client.close)
        events = []
        calls = (
            lambda c: c.health(),
            lambda c: c.tokenize("x"),
            lambda c: c.chat(MSGS, slot=0, on_event=events.append),
            lambda c: list(c.stream(MSGS, slot=1)),
        )
        for n, call in enumerate(calls, 1):
            err = self._api_refused(call, client)
            self.assertEqual(err.__cause__.verify_code, 18)  # X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT
            wait_for(lambda n=n: len(self.server.handshakes) == n, 5, "the server to see the handshake")
        # None retried: a retry connects before its call returns, so before this trusting sentinel, and the
        # listener accepts in order: once the sentinel is answered, every earlier connection was accepted.
        sentinel = self.new_client(self.server.address, limits=FAST, ssl_context=self.trusting)
        self.closers.append(sentinel.close)
        self.assertEqual(run_with_timeout(sentinel.health), {"status": "ok"})
        with self.server.lock:
            self.assertEqual(len(self.server.conns), len(calls) + 2)  # one per call; the sentinel's, and its TLS
            self.assertEqual([h is None for h in self.server.handshakes], [False] * len(calls) + [True])
            self.assertEqual([r.path for r in self.server.requests], ["/health"])  # the sentinel's only
        self.assertEqual(events, [])  # no Retrying

        events = []  # slot=None: asking /props for the pool size fails the same way, and is not the error
        self._api_refused(lambda c: c.chat(MSGS, slot=None, on_event=events.append), client)
        self.assertEqual(events, [])

    def test_host_name_mismatch_is_connect_error(self):
        try:
            other = _ApiTLSServer(host="127.0.0.2")  # loopback too, but not in the certificate
        except OSError as exc:  # pragma: no cover - a host without 127.0.0.0/8 on lo
            self.skipTest("cannot listen on 127.0.0.2: %s" % exc)
        self.closers.append(other.close)
        client = self.new_client(other.address, limits=FAST, ssl_context=self.trusting)
        self.closers.append(client.close)
        for call in (lambda c: c.health(), lambda c: c.chat(MSGS, slot=0)):
            err = self._api_refused(call, client)
            self.assertEqual(err.__cause__.verify_code, 64)  # X509_V_ERR_IP_ADDRESS_MISMATCH
        self.assertEqual(other.requests, [])


class TestApiTLSAsync(AsyncDriver, TestApiTLS):
    pass


#: A self-signed certificate for 127.0.0.1 (EC P-256, valid until 2126) and its key, for the TLS tests.
_TLS_CERT = """-----BEGIN CERTIFICATE-----
MIIBmzCCAUKgAwIBAgIUKBtRaqksrpaSGGLIB9tA9/ZKe68wCgYIKoZIzj0EAwIw
GjEYMBYGA1UEAwwPbG9vcGNsaWVudCB0ZXN0MCAXDTI2MTEzMDIxNTI1OVoYDzIx
MjYxMTA2MjE1MjU5WjAaMRgwFgYDVQQDDA9sb29wY2xpZW50IHRlc3QwWTATBgcq
hkjOPQIBBggqhkjOPQMBBwNCAASf9LPK8Dd7/XJvTESxm5r02EW6nBgGlM7rarQ9
6qKlPomXAAugUsJOel8NT9fjn4zTcs1VpLzd8c01Eu4WyCIVo2QwYjAdBgNVHQ4E
FgQUzaP9BmdN6wTFxE2DrquEi+Vlb8IwHwYDVR0jBBgwFoAUzaP9BmdN6wTFxE2D
rquEi+Vlb8IwDwYDVR0TAQH/BAUwAwEB/zAPBgNVHREECDAGhwR/AAABMAoGCCqG
SM49BAMCA0cAMEQCID00tsp3Q9xxUsh/gWdquVXr9FTbu1gxFm70Q2IwiAqaAiA1
W0Zz7g7ZLnJzRHzeBVfwudzIRMumlqtvDQ5LQUUK7w==
-----END CERTIFICATE-----
"""


_TLS_KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgHE5dGcLh761J5xAz
10jhQsM7aIQCZxJ17Lkzd/JB1hqhRANCAASf9LPK8Dd7/XJvTESxm5r02EW6nBgG
lM7rarQ96qKlPomXAAugUsJOel8NT9fjn4zTcs1VpLzd8c01Eu4WyCIV
-----END PRIVATE KEY-----
"""


class TLSFakeServer(FakeServer):
    """FakeServer behind TLS, with the certificate above; ``address`` is ``https://127.0.0.1:PORT``."""

    def __init__(self):
        super().__init__(tcp=True, listen=False)
        pem = os.path.join(self.tmp, "server.pem")
        with open(pem, "w") as f:
            f.write(_TLS_CERT + _TLS_KEY)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(pem)
        self.listen()
        self.address = self.address.replace("http://", "https://")

    def _serve(self, conn):
        try:
            conn.settimeout(5)
            conn = self.context.wrap_socket(conn, server_side=True)
        except OSError:  # the client refused the certificate, or left
            conn.close()
            return
        super()._serve(conn)


class TestTLS(ServerCase):
    """https://: a private CA through ``ssl_context``; a certificate that does not verify is ConnectError at
    once, never retried, nothing sent."""

    limits = FAST.replace(poll=0.5)  # the connect timeout (TLS handshake included) is max(poll, 0.2)

    def setUp(self):
        super().setUp()
        self.tls = TLSFakeServer()
        self.closers.append(self.tls.close)

    def test_stream_and_single_shot_with_a_private_ca(self):
        self.tls.stream(serve_body(content_stream(["sealed"])))
        client = self.new_client(
            self.tls.address, limits=self.limits, ssl_context=ssl.create_default_context(cadata=_TLS_CERT)
        )
        completion, _ = self.collect(client=client)
        self.assertEqual(completion.content, "sealed")
        self.assertEqual(run_with_timeout(client.health), {"status": "ok"})
        self.assertEqual(self.tls.chat_requests()[0].headers["host"], self.tls.address[len("https://") :])

    @real_time
    def test_certificate_that_does_not_verify_is_connect_error_at_once(self):
        client = self.new_client(self.tls.address, limits=self.limits)  # the system's trust store
        t = Timer()
        events = []
        with self.assertRaises(lc.ConnectError) as cm:
            run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        self.assertLess(t.elapsed, lateness(self, 0.5 + MARGIN))
        self.assertEqual(events, [])  # no Retrying: not a server that is down
        self.assertIsInstance(cm.exception.__cause__, ssl.SSLError)
        self.assertIn("TLS with %s failed" % self.tls.address, str(cm.exception))
        with self.assertRaises(lc.ConnectError):
            run_with_timeout(client.health)
        self.assertEqual(self.tls.requests, [])


class TestTLSAsync(AsyncDriver, TestTLS):
    pass


# -- what both clients must do that the tiers above did not show ------------------------------------------


class TestServerApi(ServerCase):
    """The rest of the server API and router routing (AsyncClient runs Client's own helpers: one code)."""

    def answer(self, doc, seen):
        def handler(req):
            seen.append((req.method, req.path, req.json() if req.body else None))
            respond_json(req, doc)

        return handler

    def test_helpers_send_and_read_as_documented(self):
        seen = []
        routes = {
            ("POST", "/tokenize"): {"tokens": [1, 2]},
            ("POST", "/detokenize"): {"content": "hi"},
            ("POST", "/apply-template"): {"prompt": "<p>"},
            ("POST", "/v1/chat/completions/input_tokens"): {"input_tokens": 7},
            ("POST", "/v1/embeddings"): {"data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}]},
            ("POST", "/v1/rerank"): {"results": [{"index": 0, "relevance_score": 0.5}]},
            ("POST", "/slots/1?action=save"): {"id_slot": 1, "n_saved": 3},
            ("POST", "/slots/1?action=erase"): {"id_slot": 1},
            ("POST", "/models/load"): {"success": True},
            ("GET", "/x?a=1"): {"ok": True},
        }
        for (method, path), doc in routes.items():
            self.server.route(method, path, self.answer(doc, seen))
        self.server.route(
            "GET",
            "/metrics",
            reply(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\nm 1\n"),
        )
        c = self.client
        self.assertEqual(c.tokenize("hi"), [1, 2])
        self.assertEqual(
            seen[-1],
            ("POST", "/tokenize", {"content": "hi", "add_special": False, "parse_special": True, "with_pieces": False}),
        )
        self.assertEqual(c.detokenize([1, 2]), "hi")
        self.assertEqual(c.apply_template(MSGS, add_generation_prompt=True), "<p>")
        self.assertEqual(seen[-1][2], {"messages": MSGS, "add_generation_prompt": True})
        self.assertEqual(c.count_tokens(MSGS), 7)
        self.assertEqual(c.embed(["a", "b"]), [[1.0], [2.0]])
        self.assertEqual(c.rerank("q", ["d"]), [{"index": 0, "relevance_score": 0.5}])
        self.assertEqual(c.save_slot(1, "f.bin"), {"id_slot": 1, "n_saved": 3})
        self.assertEqual(seen[-1], ("POST", "/slots/1?action=save", {"filename": "f.bin"}))
        self.assertEqual(c.erase_slot(1), {"id_slot": 1})
        self.assertEqual(c.load_model("m"), {"success": True})
        self.assertEqual(c.request("GET", "/x", query={"a": 1}), {"ok": True})
        self.assertEqual(c.metrics(), "m 1\n")
        self.server.route("POST", "/tokenize", self.answer({"tokens": "1 2"}, seen))
        with self.assertRaises(lc.ProtocolError):
            c.tokenize("hi")
        with self.assertRaises(lc.HTTPStatusError) as cm:
            c.request("GET", "/missing")
        self.assertEqual(cm.exception.status, 404)
        sent = len(self.server.requests)
        for call, cls in (
            (lambda: c.save_slot(-1, "f"), ValueError),
            (lambda: c.erase_slot(True), TypeError),
            (lambda: c.end_reasoning(5), TypeError),
            (lambda: c.request("GET", "/x\r\nX: y"), ValueError),
            (lambda: c.request("GET", "/x", query={"a": "1\n"}), ValueError),
            (lambda: c.tokenize(object()), TypeError),
        ):
            with self.assertRaises(cls):
                call()
        self.assertEqual(len(self.server.requests), sent, "a caller's mistake reached the server")

    def test_router_routes_every_call_to_the_model(self):
        polls, props, controls = [], [], []
        answers = SlotAnswers(self)
        told = {"busy": threading.Event(), "idle": threading.Event()}

        def slots(req):  # busy until the client was told so, then idle
            polls.append(req.path)
            respond_json(req, [{"id": 0, "is_processing": not told["busy"].is_set()}])

        def chat(req):  # the head once the client was told the slot is idle
            while not told["idle"].is_set() and not req.wait_peer_close(0.02) and not req.server.stopping.is_set():
                pass
            req.send(STREAM_HEAD + reasoning_stream(3))

        def on_event(ev):
            events.append(ev)
            timely = answers.sort(events)[0]
            if lc.Waiting(True) in timely:
                told["busy"].set()
                if lc.Waiting(False) in timely[timely.index(lc.Waiting(True)) :]:
                    told["idle"].set()

        self.server.route("GET", "/slots?model=m1", slots)
        self.server.route(
            "GET", "/props?model=m1", lambda req: (props.append(req.path), respond_json(req, {"total_slots": 1}))
        )
        self.server.route(
            "POST",
            "/v1/chat/completions/control",
            lambda req: (controls.append(req.json()), respond_json(req, {"success": True})),
        )
        self.use(chat)
        client = self.new_client(
            self.server.address, limits=FAST.replace(thinking_cap=1, thinking_overrun=10), model="m1"
        )
        events = []
        completion = run_with_timeout(lambda: client.chat(MSGS, slot=None, on_event=on_event))
        self.assertEqual(self.server.chat_requests()[0].json()["model"], "m1")
        self.assertEqual(props, ["/props?model=m1"])
        self.assertGreaterEqual(len(polls), 2)
        # what /slots?model=m1 said, as it said it: busy, then idle (any reading after busy was told may
        # still carry an answer given before)
        timely = answers.sort(events)[0]
        busy = timely.index(lc.Waiting(False))
        self.assertEqual(timely, [lc.Waiting(True)] * busy + [lc.Waiting(False)] * (len(timely) - busy))
        self.assertGreaterEqual(busy, 1)
        self.assertEqual(controls, [{"id": CID, "action": "reasoning_end", "model": "m1"}])
        self.assertIn(lc.ThinkingCapped(1), events)
        self.assertEqual(completion.content, "yes")
        self.assertEqual([s.id for s in client.slots()], [0])
        self.assertEqual(polls[-1], "/slots?model=m1")

    def test_gates_are_per_model_and_slot(self):
        keeper = Gatekeeper(self.server)
        events, results = {}, {}
        threads = [start_chat(self.client, m, 0, events, results, model="model-" + m) for m in "AB"]
        wait_for(lambda: keeper.arrived("A") and keeper.arrived("B"), what="slot 0 of two models at once")
        # neither was queued by the gate (a head later than the poll is a Waiting, a wait for the server)
        self.assertEqual(
            {m: [e for e in evs if not isinstance(e, lc.Waiting)] for m, evs in events.items()}, {"A": [], "B": []}
        )
        self.assertEqual(self.client._board.gate.snapshot()[("model-A", 0)], (1, 0))
        for m in "AB":
            keeper.release(m)
        for th in threads:
            th.join(5)
        self.assertEqual(sorted(r.content for r in results.values()), ["A", "B"])


class TestServerApiAsync(AsyncDriver, TestServerApi):
    pass


class TestListenQueueFull(ServerCase):
    """A Unix socket whose listen queue is full refuses a (non-blocking) connect with EAGAIN: a connect
    failure, retried with Retrying for a stream and ConnectError for a single-shot call, never a closed
    stream."""

    def full_listener(self):
        late = FakeServer(listen=False)
        self.closers.append(late.close)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(late.path)
        listener.listen(0)
        fillers = []
        self.closers.insert(0, lambda: [s.close() for s in fillers])
        while len(fillers) < 64:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(late.path)
            except BlockingIOError:
                s.close()
                break
            fillers.append(s)
        else:
            self.fail("the listen queue never filled")

        def drain():  # serve the listener from now on: the queue empties
            listener.settimeout(0.05)
            late.listener = listener
            thread = threading.Thread(target=late._accept, args=(listener,), daemon=True)
            late.threads.append(thread)
            thread.start()
            for s in fillers:
                s.close()

        return late, drain

    def test_stream_retries(self):
        late, drain = self.full_listener()
        late.stream(serve_body(content_stream(["in"])))
        client = self.new_client(late.path, limits=FAST)
        events = []

        def on_event(ev):
            events.append(ev)
            if isinstance(ev, lc.Retrying) and ev.attempt == 1:
                drain()

        completion = run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=on_event))
        self.assertEqual(completion.content, "in")
        self.assertIsInstance(events[0], lc.Retrying)
        self.assertIn("temporarily unavailable", events[0].reason)

    def test_single_shot_is_connect_error(self):
        late, drain = self.full_listener()
        client = self.new_client(late.path, limits=FAST)
        with self.assertRaises(lc.ConnectError) as cm:
            run_with_timeout(client.health)
        self.assertIsInstance(cm.exception.__cause__, BlockingIOError)
        drain()


class TestListenQueueFullAsync(AsyncDriver, TestListenQueueFull):
    pass


class TestAsyncClient(ServerCase):
    """What only the asyncio client has: a plain stream(), loops, async with, imports."""

    def test_stream_is_a_plain_call_that_checks_arguments(self):
        client = lc.AsyncClient(self.server.address, limits=FAST)  # outside any loop
        stream = client.stream(MSGS, slot=1)
        self.assertIsInstance(stream, lc.AsyncChatStream)
        self.assertIsNone(stream.completion)
        for bad, cls in (({"slot": True}, TypeError), ({"slot": -1}, ValueError), ({"foo": object()}, TypeError)):
            with self.assertRaises(cls):
                client.stream(MSGS, **bad)
        for kwargs in ({"api_key": "k\r\nX: y"}, {"headers": {"Host": "x"}}, {"limits": {"poll": 1}}):
            with self.assertRaises((ValueError, TypeError)):
                lc.AsyncClient(self.server.address, **kwargs)
        self.assertEqual(self.server.requests, [])

    def test_one_client_serves_loops_one_after_another(self):
        self.use(serve_body(content_stream(["ok"])))
        client = lc.AsyncClient(self.server.address, limits=FAST)

        async def main():
            return (await client.chat(MSGS, slot=None)).content, (await client.props())["total_slots"]

        for _ in range(3):
            self.assertEqual(run_on_new_loop(self, main), ("ok", 2))
        self.assertEqual(sum(1 for r in self.server.requests if r.path == "/props"), 4)  # the pool size: once
        run_on_new_loop(self, client.close)

    def test_two_running_loops_at_once_is_runtime_error(self):
        release = threading.Event()
        self.use(hold_then(content_stream(["late"]), release))
        client = lc.AsyncClient(self.server.address, limits=FAST)
        outcome = {}

        def other_loop():
            async def main():
                return (await client.chat(MSGS, slot=0)).content

            outcome["other"] = asyncio.run(main())

        thread = threading.Thread(target=other_loop, daemon=True)
        thread.start()
        wait_for(lambda: self.server.chat_requests(), what="the other loop's request")

        async def here():
            with self.assertRaises(RuntimeError):
                await client.slots()
            with self.assertRaises(RuntimeError):
                await client.chat(MSGS, slot=1)

        run_on_new_loop(self, here)
        release.set()
        thread.join(5)
        self.assertEqual(outcome["other"], "late")

    def test_async_with_closes_and_on_event_runs_in_the_loop(self):
        self.use(serve_body(content_stream(["a", "b"])))
        threads = []

        async def main():
            async with lc.AsyncClient(self.server.address, limits=FAST) as client:
                reply = await client.chat(MSGS, on_event=lambda ev: threads.append(threading.current_thread()))
                async with client.stream(MSGS) as stream:
                    texts = [ev.text async for ev in stream]
                self.assertEqual(stream.completion.content, "ab")
                return client, reply.content, texts

        client, content, texts = run_on_new_loop(self, main)
        self.assertEqual((content, texts), ("ab", ["a", "b"]))
        self.assertEqual(set(threads), {threading.current_thread()})
        with self.assertRaises(ValueError):
            client.stream(MSGS)

    def test_import_loopclient_does_not_import_asyncio(self):
        out = subprocess.run(
            [
                sys.executable,
                "-S",
                "-c",
                "import sys, loopclient; loopclient.AsyncClient('/tmp/x.sock'); print('asyncio' in sys.modules)",
            ],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        self.assertEqual(out, "False\n")


class TestCallerMistakes(ClientFactory, unittest.TestCase):
    """Each caller mistake is refused by the call that received it, before any connection."""

    def test_bad_addresses(self):
        for bad in (
            "",
            "ftp://x",
            "http://",
            "http://host:99999",
            "http://host:port",
            "http://h/pa th",
            "/tmp/" + "x" * 120,
        ):
            with self.assertRaises(ValueError, msg=bad):
                self.new_client(bad)
        with self.assertRaises(TypeError):
            self.new_client(8080)

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
                self.new_client("/tmp/x.sock", **kwargs)
            self.assertNotIn("k\r\nX", str(cm.exception))
        with self.assertRaises(ValueError):
            lc.encode_request("GET", "/x\r\nY: z", "localhost")

    def test_body_not_serialisable_and_bad_limits(self):
        client = self.new_client("/tmp/lc-none.sock")
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

    def test_refused_arguments(self):
        cases = [
            (TypeError, lambda: lc.Limits(queue_len=1.5)),
            (TypeError, lambda: lc.Limits(max_line=True)),
            (ValueError, lambda: lc.encode_request("GET", "health", "localhost")),
            (ValueError, lambda: lc.encode_request("GET", "/a b", "localhost")),
            (ValueError, lambda: lc.encode_request("GET", "/", "localhost", [("Bad:Name", "v")])),
            (TypeError, lambda: self.new_client("/tmp/x.sock", limits={"poll": 1})),
            (TypeError, lambda: self.new_client("/tmp/x.sock", headers={"X-A": 1})),
            (ValueError, lambda: self.new_client("/tmp/x.sock", headers={"X:A": "1"})),
            (ValueError, lambda: self.new_client("/tmp/x.sock", headers={"Host": "evil"})),
            (ValueError, lambda: self.new_client("/tmp/x.sock", headers={"content-length": "5"})),
            (TypeError, lambda: self.new_client("/tmp/x.sock", api_key=b"k")),
            (TypeError, lambda: self.new_client("/tmp/x.sock").stream(MSGS, slot=True)),
            (TypeError, lambda: self.new_client("/tmp/x.sock").stream(MSGS, slot="0")),
            (TypeError, lambda: self.new_client("/tmp/x.sock").end_reasoning(5)),
            (ValueError, lambda: lc.parse_address("http://:8080")),
            (ValueError, lambda: lc.parse_address("http://[::1")),
            (ValueError, lambda: lc.parse_address("unix://")),
            (ValueError, lambda: lc.parse_address("/tmp/a\0b")),
        ]
        for cls, call in cases:
            with self.assertRaises(cls):
                call()

    def test_path_like_address_and_user_headers_replace_defaults(self):
        self.assertEqual(lc.parse_address(pathlib.Path("/run/x.sock")).target, "/run/x.sock")
        self.assertEqual(lc.parse_address("http://example:80").host, "example")
        # the threaded client's internals: the request bytes its call plan encodes (both clients share _Calls)
        client = lc.Client("/tmp/x.sock", headers={"user-agent": "mine/1"})
        request = client._calls._encode("GET", "/health", None, "application/json")
        self.assertIn(b"\r\nuser-agent: mine/1\r\n", request)
        self.assertNotIn(b"loopclient/", request)
        self.assertTrue(request.endswith(b"\r\n\r\n"))

    def test_value_objects_are_plain_from_import(self):
        out = subprocess.run(
            [
                sys.executable,
                "-S",
                "-c",
                "import sys; import loopclient; loopclient.Client('/tmp/x.sock');"
                "print('dataclasses' in sys.modules, 'typing' in sys.modules, 'inspect' in sys.modules)",
            ],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        self.assertEqual(out, "False False False\n")  # importing and a Client() cost none of them
        self.assertEqual(
            list(inspect.signature(lc.ToolCall).parameters), ["index", "id", "name", "arguments", "choice"]
        )
        self.assertIn("wedge_wait", str(inspect.signature(lc.Limits)))
        with self.assertRaises(AttributeError):
            lc.Limits().poll = 2.0  # type: ignore[misc]
        with self.assertRaises(AttributeError):
            del lc.Content("a").text  # type: ignore[misc]
        self.assertEqual(lc.Limits().replace(poll=2.0).poll, 2.0)
        with self.assertRaises(TypeError):
            lc.Limits().replace(pol=2.0)
        with self.assertRaises(ValueError):
            lc.Limits().replace(poll=-1)
        self.assertEqual(lc.Content("a"), lc.Assembler().feed(chunk_json({"content": "a"}))[0])
        self.assertEqual(hash(lc.Reasoning("r")), hash(lc.Reasoning("r")))
        self.assertNotEqual(lc.Content("r"), lc.Reasoning("r"))
        values = [
            lc.Queued(2),
            lc.Waiting(True, wedged=True),
            lc.Retrying(1, 0.25, "HTTP 503: Loading model"),
            lc.Reasoning("r", choice=1),
            lc.Content("c"),
            lc.ToolCall(0, "id", "f", "{", choice=2),
            lc.ThinkingCapped(3),
            lc.Progress(10, 20, 5, 1.5),
            lc.Chunk({"choices": [{"delta": {"content": "x"}}]}),
            lc.ToolCallResult("id", "f", "{}"),
            lc.Choice(1, "c", "r", [lc.ToolCallResult("id", "f", "{}")], "stop", [{"token": "c"}]),
            lc.Completion("id", "m", "c", "", [], "stop", {"total_tokens": 3}, None),
            lc.Slot(0, True, {"id": 0, "is_processing": True}, task=7, decoded=3, prompt_processed=12),
            lc.Limits(queue_len=1, wedge_wait=None),
        ]
        for value in values:
            with self.subTest(value=value):
                self.assertEqual(copy.copy(value), value)
                self.assertEqual(copy.deepcopy(value), value)
                self.assertEqual(pickle.loads(pickle.dumps(value)), value)
                self.assertEqual(eval(repr(value), vars(lc)), value) if not isinstance(value, lc.Slot) else None
        self.assertEqual(
            repr(lc.Slot(1, False, {"secret": 1})),
            "Slot(id=1, is_processing=False, task=None, decoded=None, prompt_processed=None)",
        )
        deep = copy.deepcopy(values[-3])
        self.assertIsNot(deep.usage, values[-3].usage)


class TestCallerMistakesAsync(AsyncDriver, TestCallerMistakes):
    pass


# =====================================================================================================
# Tier 3. Waits and gates: wait for head, liveness, wedged slots, retries, gate, cancel, thinking cap,
# stress
# =====================================================================================================


class TestVirtualClock(unittest.TestCase):
    """The virtual clock itself: it moves only when every task waits, to the next timer; a wait nothing
    can end is an error; its worker threads end with it."""

    def setUp(self):
        self.threads = threading.active_count()
        self.kernel = VirtualKernel()
        self.kernel.start()

    def tearDown(self):
        self.kernel.stop()
        wait_for(lambda: threading.active_count() <= self.threads, 5, "the workers to end")

    def test_time_jumps_to_the_next_timer_and_tasks_take_turns(self):
        log = []

        def sleeper(name, seconds):
            def task():
                start = time.monotonic()
                time.sleep(seconds)
                log.append((name, time.monotonic() - start))

            return task

        real = _REAL_MONOTONIC()
        tasks = [self.kernel.spawn(sleeper(n, s), n) for n, s in (("b", 2.0), ("a", 1.0), ("c", 0.0))]
        for task in tasks:
            self.assertTrue(self.kernel.join(task, 5.0))
        self.assertEqual([name for name, _ in log], ["c", "a", "b"])
        for (_, took), want in zip(log, (0.0, 1.0, 2.0)):
            self.assertAlmostEqual(took, want, delta=1e-6)
        self.assertAlmostEqual(time.monotonic() - VirtualKernel.ORIGIN, 2.0, delta=1e-6)
        self.assertLess(_REAL_MONOTONIC() - real, 1.0)  # two virtual seconds in no real time
        self.assertEqual(lc._clock(), time.monotonic())

    def test_a_wait_that_nothing_can_end_is_a_deadlock(self):
        never = VirtualEvent(self.kernel)
        self.kernel.spawn(lambda: never.wait(), "waiter")
        with self.assertRaises(VirtualDeadlock):
            never.wait()
        never.set()  # the waiter ends, so that the clock can stop
        self.assertEqual(self.kernel.drain(), set())

    def test_a_read_times_out_at_its_timeout_and_data_wakes_it(self):
        server = VirtualServer(self.kernel)
        try:
            server.route("GET", "/late", lambda req: (time.sleep(0.25), req.send(b"late")))
            conn = self.kernel.connect(lc.parse_address(server.address), lc._NOBODY)
            start = time.monotonic()
            with self.assertRaises(lc._Silence):
                conn.recv(0.1)
            self.assertAlmostEqual(time.monotonic() - start, 0.1, delta=1e-6)
            conn.sendall(b"GET /late HTTP/1.1\r\n\r\n", 1.0)
            self.assertEqual(conn.recv(1.0), b"late")
            self.assertAlmostEqual(time.monotonic() - start, 0.1 + 0.25, delta=1e-6)  # sent at 0.1, answered 0.25 later
            conn.close()
        finally:
            server.close()


# -- the three drivers alike, operation by operation ---------------------------------------------------


@real_time
class TestDriversAlike(unittest.TestCase):
    """Each operation of the plan protocol performed by _SyncRun and _AsyncRun on a real socket (a
    FakeServer) and by VirtualRun on the virtual clock (a VirtualServer): the same result or error (class,
    errno, message), the same requests seen by the server, and the same time taken: exactly on the virtual
    clock, within the margin on the real one (MARGIN, scaled by the machine's pace: ``lateness``).  What lets
    the tiers that run on the virtual clock stand for the real drivers."""

    KINDS = ("sync", "async", "virtual")

    def setUp(self):
        self.fds = fd_count()
        self.threads = threading.active_count()

    def tearDown(self):
        wait_for(lambda: threading.active_count() <= self.threads, 5, "threads to end")
        wait_for(lambda: fd_count() <= self.fds, 5, "descriptors to close")

    def _drive(self, kind, plan, arrange=None, tcp=False, address=None):
        """``plan(run, path)`` (a plan that returns what it found, ``path`` the server's directory) on the
        driver ``kind``: (its value or error, the seconds it took, the requests the server saw)."""
        kernel = loop = None
        if kind == "virtual":
            kernel = VirtualKernel()
            kernel.start()
            server = VirtualServer(kernel, tcp=tcp)
        else:
            server = FakeServer(tcp=tcp)
        try:
            if arrange is not None:
                arrange(server)
            where = address(server) if address else server.address
            start = lc._clock()
            if kind == "async":
                loop = LoopThread()
                client = lc.AsyncClient(where, limits=FAST_FAULTS)

                async def go():
                    run = lc._AsyncRun(client._board_here())
                    run.gen = plan(run, server.tmp)
                    try:
                        return await run.finish()
                    finally:
                        await client.close()

                call = lambda: loop.run(go(), 10)
            else:
                client = lc.Client(where, limits=FAST_FAULTS)
                if kernel is not None:
                    client._board.run_class = VirtualRun
                    client._board.kernel = kernel

                def call():
                    run = client._board.run_class(client._board)
                    run.gen = plan(run, server.tmp)
                    try:
                        return run.finish()
                    finally:
                        client.close()

            try:
                value = run_with_timeout(call, 10)
            except Exception as exc:  # the outcome compared
                value = exc
            took = lc._clock() - start
            with server.lock:
                seen = [(r.method, r.path, r.body) for r in server.requests]
        finally:
            server.close()
            if loop is not None:
                self.assertEqual(loop.close(), [], "the event loop reported problems")
            if kernel is not None:
                kernel.stop()
        return value, took, seen

    def _alike(self, plan, took, arrange=None, tcp=False, address=None):
        """Run ``plan`` on the three drivers; assert they agree and that each took ``took`` seconds; the
        virtual driver's outcome."""
        found = {kind: self._drive(kind, plan, arrange, tcp, address) for kind in self.KINDS}
        want = self._seen_as(found["virtual"][0])
        for kind, (value, elapsed, seen) in found.items():
            with self.subTest(kind):
                self.assertEqual(self._seen_as(value), want)
                self.assertEqual(seen, found["virtual"][2])
                if kind == "virtual":
                    self.assertTrue(took - 1e-6 <= elapsed <= took + 1e-6, elapsed)
                else:
                    self.assertTrue(took - EARLY <= elapsed < took + lateness(self), elapsed)
        return found["virtual"][0]

    @staticmethod
    def _seen_as(value):
        if isinstance(value, BaseException):
            return (type(value).__name__, getattr(value, "errno", None), str(value))
        return value

    # -- the operations ------------------------------------------------------------------------------

    def test_connect_to_a_missing_socket_file_or_a_refusing_one(self):
        def plan(run, path):
            yield (lc._CONNECT, 1.0, False)

        err = self._alike(plan, 0.0, address=lambda s: os.path.join(s.tmp, "missing.sock"))
        self.assertIs(type(err), FileNotFoundError)

        def stale(s):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(os.path.join(s.tmp, "stale.sock"))  # bound, never listening: connect() is refused
            sock.close()
            return os.path.join(s.tmp, "stale.sock")

        err = self._alike(plan, 0.0, address=stale)
        self.assertIs(type(err), ConnectionRefusedError)

    def _exchange(self, then=None):
        """A plan: connect, send a request, read until the end (or ``then(conn)`` after the first bytes)."""
        request = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"

        def plan(run, path):
            conn = yield (lc._CONNECT, 1.0, False)
            yield (lc._SEND, conn, request, 1.0)
            data = b""
            while True:
                more = yield (lc._RECV, conn, 1.0)
                if not more:
                    return data
                data += more
                if then is not None:
                    return (yield from then(conn, data))

        return plan

    def test_send_then_receive_to_the_end(self):
        answer = json_response({"echo": "hello"})
        got = self._alike(self._exchange(), 0.0, lambda s: s.route("POST", "/echo", reply(answer)))
        self.assertEqual(got, answer)

    def test_a_read_that_hears_nothing_is_silence_after_its_timeout(self):
        slack = lateness(self)  # how late a timeout may run out on this machine now (the virtual one: never)

        def then(conn, data):
            start = lc._clock()
            try:
                yield (lc._RECV, conn, 0.3)
            except lc._Silence:
                return ("silence", data, 0.3 - EARLY <= lc._clock() - start < 0.3 + slack)
            return "no silence"

        head = b"HTTP/1.1 200 OK\r\n"
        got = self._alike(self._exchange(then), 0.3, lambda s: s.route("POST", "/echo", reply(head, hold=True)))
        self.assertEqual(got, ("silence", head, True))

    def test_a_reset_is_stream_closed_with_the_os_error(self):
        def reset(req):
            req.send(b"HTTP/1.1 200 OK\r\n")
            req.conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            req.conn.close()  # linger 0: RST instead of FIN

        def then(conn, data):
            return (yield (lc._RECV, conn, 1.0))

        err = self._alike(self._exchange(then), 0.0, lambda s: s.route("POST", "/echo", reset), tcp=True)
        self.assertIs(type(err), lc.StreamClosedError)
        self.assertIn("reset", str(err))

    def test_park_runs_out_or_is_signalled_and_sleep_sleeps(self):
        slack = lateness(self)  # how late a timer may run out on this machine now (the virtual one: never)

        def plan(run, path):
            start = lc._clock()
            yield (lc._PARK, 0.2)  # nobody signals: the timer
            parked = lc._clock() - start

            def wake():
                yield (lc._SLEEP, 0.1)
                run.signal()

            yield (lc._SPAWN, wake())
            yield (lc._PARK, 5.0)  # signalled after 0.1
            yield (lc._SLEEP, 0.15)
            return 0.2 - EARLY <= parked < 0.2 + slack  # the whole 0.45 s: _alike's timing

        self.assertEqual(self._alike(plan, 0.45), True)

    def test_cancel_throws_cancelled_error_into_a_parked_plan(self):
        def plan(run, path):
            def cancel():
                yield (lc._SLEEP, 0.2)
                run.cancel()

            yield (lc._SPAWN, cancel())
            try:
                yield (lc._PARK, None)
            except lc.CancelledError as exc:
                return "cancelled: %s" % exc
            return "not cancelled"

        self.assertEqual(self._alike(plan, 0.2), "cancelled: the request was cancelled")

    def test_a_kept_connection_is_reused(self):
        def plan(run, path):
            conn = yield (lc._CONNECT, 1.0, False)
            yield (lc._KEEP, conn, 5.0)
            again = yield (lc._CONNECT, 1.0, True)
            fresh = yield (lc._CONNECT, 1.0, False)
            return again is conn, again.reused, fresh is conn, fresh.reused

        self.assertEqual(self._alike(plan, 0.0), (True, True, False, False))


class TestWaitForHead(VirtualFactory, ServerCase):
    def budget(self, **kw):
        return lc.Limits(**dict(dict(poll=0.05, liveness=2.0, busy_wait=5.0, load_wait=5.0, idle_grace=5.0), **kw))

    def test_busy_slot_is_waited_out_then_streams(self):
        release = self.event()
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
        self.use(hold_then(b"", self.event()))
        client = self.new_client(self.server.address, limits=self.budget(busy_wait=0.6))
        answers = SlotAnswers(self)
        t = Timer()
        events = []
        with self.assertRaises(lc.WaitTimeoutError) as cm:
            run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        # busy_wait after the busy wait began (on real sockets, a /slots answer later than the poll is an
        # unavailable server for that poll, and busy afterwards starts afresh)
        self.assertElapsed(time.monotonic() - answers.busy_since(t.start), 0.6)
        self.assertIsInstance(cm.exception, TimeoutError)
        timely, _ = answers.sort(events)
        self.assertTrue(timely and all(e == lc.Waiting(True) for e in timely))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(10))

    def test_idle_slot_and_no_head_is_stalled_after_idle_grace(self):
        self.use(hold_then(b"", self.event()))
        client = self.new_client(self.server.address, limits=self.budget(idle_grace=0.5))
        t = Timer()
        events = []
        with self.assertRaises(lc.StalledError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        self.assertElapsed(t.elapsed, 0.5)
        self.assertTrue(events and all(e == lc.Waiting(False) for e in events))

    def test_slots_failing_is_load_timeout_after_load_wait(self):
        self.server.route(
            "GET",
            "/slots",
            lambda req: respond_json(
                req,
                {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}},
                503,
                "Service Unavailable",
            ),
        )
        self.use(hold_then(b"", self.event()))
        client = self.new_client(self.server.address, limits=self.budget(load_wait=0.5))
        t = Timer()
        with self.assertRaises(lc.LoadTimeoutError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        self.assertElapsed(t.elapsed, 0.5)

    def test_budgets_restart_when_the_situation_changes(self):
        # busy, unavailable, busy: each phase ends on the first poll 0.35 s after the phase's own first poll
        # (so the client has seen every phase), under its 0.6 s budget (a late poll only lengthens a phase:
        # 0.25 s to spare); the two busy phases alone outlast busy_wait, and all three take over 1.05 s
        phases = ("busy", "down", "busy")
        state = {"phase": 0, "since": None}
        lock = threading.Lock()
        release = self.event()

        def slots(req):
            with lock:
                now = time.monotonic()
                if state["since"] is None:
                    state["since"] = now
                elif now - state["since"] >= 0.35 and state["phase"] < len(phases):
                    state.update(phase=state["phase"] + 1, since=now)
                    if state["phase"] == len(phases):
                        release.set()  # the last phase is over: the chat's head is sent
                phase = phases[min(state["phase"], len(phases) - 1)]
            if phase == "down":
                respond_json(
                    req, {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}, 503, "x"
                )
            else:
                respond_json(req, [{"id": 0, "is_processing": True}])

        self.server.route("GET", "/slots", slots)
        self.use(hold_then(content_stream(["ok"]), release))
        client = self.new_client(self.server.address, limits=self.budget(busy_wait=0.6, load_wait=0.6))
        events = []
        t = Timer()
        completion = run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        self.assertGreaterEqual(t.elapsed, 3 * 0.35 - EARLY)  # longer than either budget: both restarted
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
        release = self.event()
        self.use(hold_then(content_stream(["ok"]), release))
        client = self.new_client(self.server.address, limits=self.budget(poll=0.05))
        waits = []
        lock = threading.Lock()

        def run(slot):
            def on_event(ev):
                with lock:
                    waits.append(ev)

            return client.chat(MSGS, slot=slot, on_event=on_event)

        threads = [self.start_thread(functools.partial(run, i)) for i in range(5)]
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
        client = self.new_client(self.server.address, limits=self.budget(liveness=0.4))
        t = Timer()
        with self.assertRaises(lc.StalledError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        self.assertElapsed(t.elapsed, 0.4)


TestWaitForHeadSockets, TestWaitForHeadSocketsAsync = on_sockets(
    TestWaitForHead,
    "test_busy_slot_past_busy_wait",
    "test_five_waiters_share_one_slots_request",
    "test_head_silence_after_first_byte_is_stalled_at_liveness",
)


class TestLiveness(VirtualFactory, ServerCase):
    base_limits = FAST.replace(liveness=0.4, busy_wait=1.0, load_wait=5.0, idle_grace=5.0)

    def test_silence_mid_stream_is_stalled(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "partial"}))))
            req.wait_peer_close(5)

        self.use(handler)
        client = self.new_client(self.server.address, limits=self.limits_())
        events = []
        t = Timer()
        with self.assertRaises(lc.StalledError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        self.assertEqual(events, [lc.Content("partial")])
        self.assertElapsed(t.elapsed, 0.4)

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
        stop = self.event()
        self.use(self.pinger(stop))
        client = self.new_client(self.server.address, limits=self.limits_())
        t = Timer()
        with self.assertRaises(lc.StalledError) as cm:
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        stop.set()
        self.assertIn("idle", str(cm.exception))
        self.assertElapsed(t.elapsed, 0.4)

    def test_pings_with_busy_slot_are_waited_until_busy_wait(self):
        stop = self.event()
        self.server.busy[0] = True
        self.use(self.pinger(stop))
        client = self.new_client(self.server.address, limits=self.limits_(busy_wait=1.0))
        t = Timer()
        with self.assertRaises(lc.StalledError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        stop.set()
        self.assertElapsed(t.elapsed, 1.0)

    def test_pings_then_data_completes(self):
        stop = self.event()
        self.server.busy[0] = True
        rest = (
            chunked(sse(chunk_json({"content": "b"})), sse(chunk_json({}, "stop")), b"data: [DONE]\n\n") + b"0\r\n\r\n"
        )
        self.use(self.pinger(stop, then=rest))
        client = self.new_client(self.server.address, limits=self.limits_(busy_wait=5.0))
        self.later(0.7, stop.set)
        completion = run_with_timeout(lambda: client.chat(MSGS, slot=0))
        self.assertEqual(completion.content, "ab")


TestLivenessSockets, TestLivenessSocketsAsync = on_sockets(TestLiveness, "test_silence_mid_stream_is_stalled")


class TestWedgedSlots(VirtualFactory, ServerCase):
    """A processing slot whose progress triple stops moving for wedge_wait is wedged, not busy."""

    WEDGE = 0.6
    limits = FAST.replace(wedge_wait=0.6, busy_wait=3.0, liveness=3.0)

    def setUp(self):
        super().setUp()
        self.state = {
            0: {"id_task": 7, "n_prompt_tokens_processed": 30, "n_decoded": 0, "busy": True},
            1: {"id_task": 9, "n_prompt_tokens_processed": 5, "n_decoded": 3, "busy": False},
        }
        self.moving = {}  # slot: field that advances at each /slots answer
        self.server.route("GET", "/slots", self.slots)

    def slots(self, req):
        entries = []
        with self.server.lock:
            for i, s in sorted(self.state.items()):
                if i in self.moving:
                    s[self.moving[i]] += 1
                entries.append(
                    {
                        "id": i,
                        "id_task": s["id_task"],
                        "n_ctx": 1024,
                        "is_processing": s["busy"],
                        "n_prompt_tokens": 60,
                        "n_prompt_tokens_processed": s["n_prompt_tokens_processed"],
                        "next_token": [{"has_next_token": True, "n_remain": 48, "n_decoded": s["n_decoded"]}],
                    }
                )
        respond_json(req, entries)

    def test_a_request_pinned_to_a_frozen_slot_ends_wedged_within_wedge_wait_and_a_poll(self):
        self.use(hold_then(content_stream(["x"]), self.event()))
        answers = SlotAnswers(self)
        events = []
        t = Timer()
        with self.assertRaises(lc.WedgedSlotError) as cm:
            run_with_timeout(lambda: self.client.chat(MSGS, slot=0, on_event=events.append))
        timely, late = answers.sort(events)
        # on real sockets each poll whose answer came late (an unavailable server for that poll) may put
        # the wedge's verdict off by a poll and the wait for its answer
        self.assertElapsed(t.elapsed, self.WEDGE, late=self.limits.poll * (1 + 2 * len(late)))
        err = cm.exception
        self.assertEqual((err.slot, err.task), (0, 7))
        self.assertGreaterEqual(err.seconds, self.WEDGE)
        self.assertIsInstance(err, lc.StalledError)
        self.assertIsInstance(err, TimeoutError)
        self.assertIn("wedged", str(err))
        self.assertIn("restart", str(err))
        self.assertEqual(events[-1], lc.Waiting(True, wedged=True))
        self.assertTrue(all(e == lc.Waiting(True) for e in timely[:-1]), events)

    def test_a_slow_prompt_or_a_slow_generation_is_busy_however_long(self):
        for field in ("n_prompt_tokens_processed", "n_decoded"):
            with self.subTest(field=field):
                self.moving = {0: field}
                release = self.event()
                self.use(hold_then(content_stream(["ok"]), release))
                self.later(3 * self.WEDGE, release.set)
                completion, events = self.collect()
                self.assertEqual(completion.content, "ok")
                self.assertIn(lc.Waiting(True), events)
                self.assertFalse(any(isinstance(e, lc.Waiting) and e.wedged for e in events))

    def test_without_progress_fields_or_with_wedge_wait_none_busy_is_waited_out(self):
        cases = [("no fields", self.limits), ("wedge_wait None", self.limits.replace(wedge_wait=None))]
        for what, limits in cases:
            with self.subTest(what=what):
                if what == "no fields":
                    self.server.route("GET", "/slots", FakeServer._slots.__get__(self.server))
                    self.server.busy[0] = True
                client = self.new_client(self.server.address, limits=limits.replace(busy_wait=2 * self.WEDGE))
                self.closers.append(client.close)
                self.use(hold_then(content_stream(["x"]), self.event()))
                with self.assertRaises(lc.WaitTimeoutError):
                    run_with_timeout(lambda: client.chat(MSGS, slot=0))

    def test_a_started_stream_whose_slot_freezes_ends_wedged(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))))
            req.wait_peer_close(5)

        self.use(handler)
        events = []
        t = Timer()
        with self.assertRaises(lc.WedgedSlotError) as cm:
            run_with_timeout(lambda: self.client.chat(MSGS, slot=0, on_event=events.append))
        self.assertEqual(events, [lc.Content("a")])
        self.assertEqual(cm.exception.slot, 0)
        self.assertElapsed(t.elapsed, 0.0, late=self.WEDGE + self.limits.poll)

    def test_any_slot_leaves_wedged_slots_out_of_busy(self):
        # slot 0 wedged, slot 1 idle: the pool is not busy, so an unanswered request is stalled, not waiting
        self.use(hold_then(content_stream(["x"]), self.event()))
        client = self.new_client(self.server.address, limits=self.limits.replace(idle_grace=2 * self.WEDGE))
        self.closers.append(client.close)
        events = []
        with self.assertRaises(lc.StalledError) as cm:
            run_with_timeout(lambda: client.chat(MSGS, slot=None, on_event=events.append))
        self.assertNotIsInstance(cm.exception, lc.WedgedSlotError)
        self.assertIn(lc.Waiting(False), events)
        # every slot processing and wedged: nothing can serve the request
        self.state[1].update(busy=True)
        with self.assertRaises(lc.WedgedSlotError):
            run_with_timeout(lambda: client.chat(MSGS, slot=None))

    def test_slot_progress_fields_from_real_bytes(self):
        raw = load_transcript("10_slots_busy.raw.txt")
        body = raw[raw.index(b"\r\n\r\n") + 4 :]
        slots = lc._slots_from(json.loads(body))
        busy = [s for s in slots if s.is_processing]
        self.assertEqual(len(busy), 1)
        entry = busy[0].raw
        self.assertEqual(
            (busy[0].task, busy[0].decoded, busy[0].prompt_processed),
            (entry["id_task"], entry["next_token"][0]["n_decoded"], entry["n_prompt_tokens_processed"]),
        )
        self.assertEqual(lc.Slot(0, False, {}).task, None)


TestWedgedSlotsSockets, TestWedgedSlotsSocketsAsync = on_sockets(
    TestWedgedSlots, "test_a_request_pinned_to_a_frozen_slot_ends_wedged_within_wedge_wait_and_a_poll"
)


class TestRetries(VirtualFactory, ServerCase):
    base_limits = FAST.replace(busy_wait=5.0, load_wait=3.0, idle_grace=5.0)

    def test_socket_appears_after_a_while(self):
        late = self.new_server(listen=False)
        self.closers.append(late.close)
        late.stream(serve_body(content_stream(["up"])))
        client = self.new_client(late.path, limits=self.limits_())
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
        client = self.new_client(self.server.tmp + "/never.sock", limits=self.limits_(load_wait=30.0))
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
        client = self.new_client(self.server.tmp + "/never.sock", limits=self.limits_(load_wait=0.6))
        t = Timer()
        with self.assertRaises(lc.LoadTimeoutError) as cm:
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        self.assertIsInstance(cm.exception.__cause__, FileNotFoundError)
        self.assertElapsed(t.elapsed, 0.6, early=0.01)

    def test_socket_without_listener_is_refused_and_retried(self):
        path = os.path.join(self.server.tmp, "dead.sock")
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(path)  # bound, never listening: connect is refused
        self.closers.append(dead.close)
        client = self.new_client(path, limits=self.limits_(load_wait=0.4))
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
        calls, handler = self.unavailable_then(
            lambda req: respond_json(
                req,
                {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}},
                503,
                "Service Unavailable",
            )
        )
        self.use(handler)
        client = self.new_client(self.server.address, limits=self.limits_())
        completion, events = self.collect(client=client)
        self.assertEqual(completion.content, "fine")
        self.assertEqual(len(calls), 2)
        retry = events[0]
        self.assertIsInstance(retry, lc.Retrying)
        self.assertEqual(retry.attempt, 1)
        self.assertIn("503", retry.reason)
        self.assertIn("Loading model", retry.reason)

    def test_retry_after_seconds_honoured(self):
        calls, handler = self.unavailable_then(
            lambda req: respond_json(
                req, {"error": {"message": "busy", "code": 503}}, 503, "Service Unavailable", b"Retry-After: 1\r\n"
            )
        )
        self.use(handler)
        client = self.new_client(self.server.address, limits=self.limits_())
        t = Timer()
        completion, events = self.collect(client=client)
        self.assertEqual(events[0], lc.Retrying(1, 1.0, "HTTP 503: busy"))
        self.assertElapsed(t.elapsed, 1.0)

    def test_retry_after_http_date_honoured(self):
        def first(req):
            when = email.utils.formatdate(time.time() + 2, usegmt=True)
            respond_json(
                req, {"error": {"message": "busy", "code": 503}}, 503, "x", b"Retry-After: " + when.encode() + b"\r\n"
            )

        calls, handler = self.unavailable_then(first)
        self.use(handler)
        client = self.new_client(self.server.address, limits=self.limits_())
        completion, events = self.collect(client=client)
        self.assertTrue(1.0 <= events[0].delay <= 2.0, events[0])
        self.assertEqual(completion.content, "fine")

    def test_retry_after_beyond_load_wait_fails_at_once(self):
        self.use(
            lambda req: respond_json(
                req, {"error": {"message": "busy", "code": 503}}, 503, "x", b"Retry-After: 3600\r\n"
            )
        )
        client = self.new_client(self.server.address, limits=self.limits_(load_wait=10))
        t = Timer()
        with self.assertRaises(lc.LoadTimeoutError) as cm:
            self.collect(client=client)
        self.assertAtOnce(t.elapsed, 0.3)
        self.assertIsInstance(cm.exception.__cause__, lc.HTTPStatusError)

    def test_first_event_503_error_is_retried(self):
        error = (
            chunked(b'data: {"error":{"code":503,"message":"no slot available","type":"unavailable_error"}}\n\n')
            + b"0\r\n\r\n"
        )
        calls, handler = self.unavailable_then(serve_body(error))
        self.use(handler)
        completion, events = self.collect()
        self.assertEqual(completion.content, "fine")
        self.assertEqual(len(calls), 2)
        self.assertIsInstance(events[0], lc.Retrying)

    def test_first_event_400_error_is_server_error(self):
        error = (
            chunked(b'data: {"error":{"code":400,"message":"bad","type":"invalid_request_error"}}\n\n') + b"0\r\n\r\n"
        )
        self.use(serve_body(error))
        with self.assertRaises(lc.ServerError) as cm:
            self.collect()
        self.assertEqual(cm.exception.code, 400)
        self.assertEqual(len(self.server.chat_requests()), 1)

    def test_error_after_content_is_not_retried(self):
        body = (
            chunked(
                sse(chunk_json({"content": "x"})),
                b'data: {"error":{"code":503,"message":"gone","type":"unavailable_error"}}\n\n',
            )
            + b"0\r\n\r\n"
        )
        self.use(serve_body(body))
        events = []
        with self.assertRaises(lc.ServerError):
            run_with_timeout(lambda: self.client.chat(MSGS, slot=0, on_event=events.append))
        self.assertEqual(events, [lc.Content("x")])
        self.assertEqual(len(self.server.chat_requests()), 1)

    def test_legacy_error_line_first_is_retried(self):
        error = chunked(b'error: {"code":503,"message":"Loading model","type":"unavailable_error"}\n\n') + b"0\r\n\r\n"
        calls, handler = self.unavailable_then(serve_body(error))
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


TestRetriesSockets, TestRetriesSocketsAsync = on_sockets(
    TestRetries,
    "test_socket_appears_after_a_while",
    "test_socket_without_listener_is_refused_and_retried",
    "test_retry_after_seconds_honoured",
)


class TestWaitEdges(VirtualFactory, ServerCase):
    """Edge cases of waiting for a slot: any-slot pools, empty /slots, Retry-After dates."""

    def test_any_slot_all_busy_waits_busy(self):
        self.server.busy[:] = [True, True]
        release = self.event()
        self.use(hold_then(content_stream(["ok"]), release))
        answers = SlotAnswers(self)
        events = []

        def on_event(ev):
            events.append(ev)
            timely = answers.sort(events)[0]
            if len(timely) >= 2:  # told busy twice: a slot frees
                self.server.busy[0] = False
            if lc.Waiting(False) in timely[2:]:  # told it: the head comes
                release.set()

        completion = run_with_timeout(lambda: self.client.chat(MSGS, slot=None, on_event=on_event))
        timely, _ = answers.sort(events)
        self.assertEqual(timely[:2], [lc.Waiting(True), lc.Waiting(True)])
        self.assertIn(lc.Waiting(False), timely[2:])
        self.assertEqual(waits_first(self, events), [lc.Content("ok")])
        self.assertEqual(completion.content, "ok")

    def test_any_slot_pool_grows_when_props_answers_late(self):
        answers = iter(
            [
                lambda req: respond_json(req, {"error": {"message": "Loading model", "code": 503}}, 503, "x"),
                lambda req: respond_json(req, {"total_slots": 2}),
            ]
        )
        self.server.route("GET", "/props", lambda req: next(answers)(req))
        self.use(serve_body(content_stream(["ok"])))
        self.assertEqual(self.collect(slot=None)[0].content, "ok")  # props failed: a pool of one
        self.assertEqual(self.client._board.gate.snapshot()[(None, None)], (0, 0))
        self.assertEqual(self.collect(slot=None)[0].content, "ok")  # props answered: the pool grows
        self.assertEqual(self.client._board.gate._lanes[(None, None)].capacity, 2)

    def test_slots_empty_list_means_idle(self):
        self.server.route("GET", "/slots", lambda req: respond_json(req, []))
        self.use(hold_then(b"", self.event()))
        client = self.new_client(self.server.address, limits=lc.Limits(poll=0.05, idle_grace=0.3))
        with self.assertRaises(lc.StalledError):
            run_with_timeout(lambda: client.chat(MSGS, slot=0))

    def test_retry_after_dates_out_of_range(self):
        self.assertIsNone(lc.parse_retry_after("Fri, 31 Dec 99999 23:59:59 GMT"))
        self.assertIsNone(lc.parse_retry_after("not a date"))
        self.assertEqual(lc.parse_retry_after("Thu, 01 Jan 1970 00:00:00 GMT"), 0.0)
        self.assertEqual(lc.parse_retry_after("Thu, 01 Jan 1970 00:01:40 GMT", now=0.0), 100.0)


TestWaitEdgesSockets, TestWaitEdgesSocketsAsync = on_sockets(TestWaitEdges, "test_any_slot_all_busy_waits_busy")


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


def start_chat(client, marker, slot=0, events=None, results=None, **params):
    """Run a chat in a thread; its events and outcome go to ``events``/``results`` under ``marker``."""
    events = events if events is not None else {}
    results = results if results is not None else {}
    events[marker] = []

    def run():
        try:
            results[marker] = client.chat(
                [{"role": "user", "content": marker}], slot=slot, on_event=events[marker].append, **params
            )
        except BaseException as exc:  # noqa: B036
            results[marker] = exc

    kernel = VirtualKernel.active
    if kernel is not None and kernel.current() is not None:
        return VirtualThread(kernel, run)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class CountingRun(lc._SyncRun):
    """A threaded run (no board: it only waits in a gate) that counts the signals its waker receives."""

    def __init__(self):
        super().__init__(None)
        self.signals = 0

    def signal(self):
        self.signals += 1
        super().signal()


def gate_problems(gate, queue_len=None):
    """What breaks the gate's invariants (the ``_Lane`` docstring), read under the gate's lock; [] if none."""
    if isinstance(gate, GateView):
        return gate.problems(queue_len)
    problems = []
    with gate._lock:
        for key, lane in gate._lanes.items():
            queue, holes = lane.queue, lane.holes
            where = "%r: " % (key,)
            if not 0 <= lane.in_flight <= lane.capacity:
                problems.append(where + "%d in flight, capacity %d" % (lane.in_flight, lane.capacity))
            if queue and lane.in_flight != lane.capacity:
                problems.append(where + "%d wait while a permit is free" % len(queue))
            if queue_len is not None and len(queue) > queue_len:
                problems.append(where + "%d waiting, queue_len %d" % (len(queue), queue_len))
            if holes != sorted(set(holes)) or set(holes) & set(queue):
                problems.append(where + "holes %r not sorted or overlapping the queue" % holes[:10])
            if set(holes) | set(queue) != set(range(lane.head, lane.tail)):
                problems.append(where + "positions do not tile head %d .. tail %d" % (lane.head, lane.tail))
            if (lane.head not in queue) if queue else (lane.head, lane.tail) != (0, 0):
                problems.append(where + "head %d, tail %d for %d queued" % (lane.head, lane.tail, len(queue)))
            if len(holes) > len(queue):
                problems.append(where + "%d holes for %d queued" % (len(holes), len(queue)))
            for rank, pos in enumerate(sorted(queue)):
                ticket = queue[pos]
                if ticket.pos != pos or ticket.granted or ticket.left:
                    problems.append(where + "ticket %d at %d is not a plain waiter" % (ticket.seq, pos))
                if lane.before(ticket) != rank:
                    problems.append(
                        where + "ticket at %d counts %d before it, not %d" % (pos, lane.before(ticket), rank)
                    )
                if ticket.ahead < lane.in_flight + rank:
                    problems.append(where + "ticket at %d announced %d, fewer than now" % (pos, ticket.ahead))
    return problems


class TestGate(ServerCase):
    limits = lc.Limits(poll=0.05, liveness=5.0, busy_wait=10.0, load_wait=5.0, idle_grace=10.0, queue_len=2)

    @real_time
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
        self.assertLess(t.elapsed, lateness(self, 0.1))
        self.assertEqual(events["B"], [lc.Queued(1)])
        self.assertEqual(events["C"], [lc.Queued(2)])
        # A's release hands the permit to B; C learns it moved up on its own timer (within poll)
        keeper.release("A")
        wait_for(lambda: keeper.arrived("B"), what="B to get the permit")
        wait_for(lambda: len(events["C"]) == 2, what="C to hear it moved up")
        self.assertEqual(events["C"], [lc.Queued(2), lc.Queued(1)])
        self.assertFalse(keeper.arrived("C"))
        for marker in "BC":
            keeper.release(marker)
        for th in threads:
            th.join(5)
        self.assertEqual([m for _, m in keeper.order], ["A", "B", "C"])
        self.assertEqual([results[m].content for m in "ABC"], ["A", "B", "C"])
        self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (0, 0))

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

    @real_time
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
        self.assertTrue(b_done.wait(10))
        self.assertLess(t.elapsed, lateness(self, 0.2))
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

    @real_time
    def test_busy_error_names_the_slot_and_the_model(self):
        """A client with model="m1": its BusyError names the slot (or the pool) of m1; the pool for slot=None
        is the size that /props?model=m1 gives, one here."""
        self.server.route("GET", "/slots?model=m1", self.server._slots)
        self.server.route("GET", "/props?model=m1", lambda req: respond_json(req, {"total_slots": 1}))
        client = self.new_client(self.server.address, limits=self.limits, model="m1")
        self.closers.append(client.close)
        keeper = Gatekeeper(self.server)
        for slot, where in ((0, "slot 0 of model m1"), (None, "any slot of model m1")):
            with self.subTest(slot=slot):
                events, results = {}, {}
                a, b, c, d = ("%s%s" % (m, slot) for m in "ABCD")
                threads = [start_chat(client, a, slot, events, results)]
                wait_for(lambda: keeper.arrived(a), what="the first to be sent")
                threads.append(start_chat(client, b, slot, events, results))
                wait_for(lambda: events[b], what="the second to queue")
                threads.append(start_chat(client, c, slot, events, results))
                wait_for(lambda: events[c], what="the third to queue")
                self.assertEqual((events[b], events[c]), ([lc.Queued(1)], [lc.Queued(2)]))  # a pool of one
                t = Timer()
                with self.assertRaises(lc.BusyError) as cm:
                    run_with_timeout(lambda: client.chat([{"role": "user", "content": d}], slot=slot))
                self.assertLess(t.elapsed, lateness(self, 0.1 + MARGIN))
                err = cm.exception
                self.assertEqual((err.slot, err.queue_len, err.waiting), (slot, 2, 2))
                self.assertEqual(str(err), "2 requests already wait for %s (queue_len 2): try later" % where)
                for marker in (a, b, c):
                    keeper.release(marker)
                for th in threads:
                    th.join(5)
                self.assertEqual([results[m].content for m in (a, b, c)], [a, b, c])
        self.assertEqual([m for _, m in keeper.order], ["A0", "B0", "C0", "ANone", "BNone", "CNone"])
        self.assertEqual({r.json()["model"] for r in self.server.chat_requests()}, {"m1"})
        self.assertEqual(sum(1 for r in self.server.requests if r.path.startswith("/props")), 1)

    @real_time
    def test_cancel_wakes_a_queued_request_at_once_whatever_the_poll(self):
        # the threaded client's internals: the stream's run parked on its lock (TestAsyncCancel: asyncio's)
        client = lc.Client(self.server.address, limits=self.limits.replace(poll=30.0))
        self.closers.append(client.close)
        keeper = Gatekeeper(self.server)
        a = start_chat(client, "A", 0)
        wait_for(lambda: keeper.arrived("A"))
        stream = client.stream([{"role": "user", "content": "B"}], slot=0)
        self.assertEqual(run_with_timeout(lambda: next(stream), 5), lc.Queued(1))
        run = stream._run
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(self.next_error(stream)), daemon=True)
        thread.start()
        wait_for(lambda: run.lock.locked(), what="the stream's thread to park in the queue")
        t = Timer()
        stream.cancel()  # the waiter's 30 s timer is far off: only the wake of its own ticket ends the wait
        thread.join(10)
        self.assertFalse(thread.is_alive())
        self.assertLess(t.elapsed, lateness(self, 0.2))
        self.assertIsInstance(outcome[0], lc.CancelledError)
        self.assertEqual(client._board.gate.snapshot()[(None, 0)], (1, 0))
        keeper.release("A")
        a.join(5)
        self.assertEqual([m for _, m in keeper.order], ["A"])

    @staticmethod
    def next_error(stream):
        try:
            next(stream)
        except lc.LoopError as exc:
            return exc
        return None

    def test_queued_is_coalesced_never_repeated_or_increased(self):
        """Twenty waiters on one slot: each hears its place first, then only smaller ones, at most once per
        poll; the request sent at once hears none; the slot serves them in entry order."""
        limits = self.limits.replace(queue_len=20)
        client = self.new_client(self.server.address, limits=limits)
        self.closers.append(client.close)
        keeper = Gatekeeper(self.server)
        heard, results, threads = {}, {}, []

        def run(marker):
            log = heard[marker] = []
            try:
                results[marker] = client.chat(
                    [{"role": "user", "content": marker}],
                    slot=0,
                    on_event=lambda ev: log.append((time.monotonic(), ev)),
                )
            except BaseException as exc:  # noqa: B036
                results[marker] = exc

        markers = ["A"] + ["W%02d" % i for i in range(1, 21)]
        for i, marker in enumerate(markers):
            threads.append(threading.Thread(target=run, args=(marker,), daemon=True))
            threads[-1].start()
            if i == 0:
                wait_for(lambda: keeper.arrived("A"))
            else:  # one at a time, so that the entry order is known
                wait_for(lambda: heard.get(marker), what="%s to queue" % marker)
        last = lambda: [ev.ahead for _, ev in list(heard["W20"]) if isinstance(ev, lc.Queued)]
        # released in batches of five: once a batch is served, W20 stands at a known place, which it hears
        # on its timer, however many smaller steps it heard or skipped while the batch went through
        for batch, place in ((markers[:5], 15), (markers[5:10], 10), (markers[10:15], 5), (markers[15:], None)):
            for marker in batch:
                keeper.release(marker)
            if place is not None:
                wait_for(lambda: place in last(), what="W20 to hear Queued(%d)" % place)
        for thread in threads:
            thread.join(10)
            self.assertFalse(thread.is_alive())
        self.assertEqual([m for _, m in keeper.order], markers)
        self.assertEqual([results[m].content for m in markers], markers)
        self.assertFalse(any(isinstance(ev, lc.Queued) for _, ev in heard["A"]))
        for i, marker in enumerate(markers[1:], 1):
            queued = [(t, ev.ahead) for t, ev in heard[marker] if isinstance(ev, lc.Queued)]
            aheads = [a for _, a in queued]
            self.assertEqual(aheads[0], i, marker)
            self.assertEqual(aheads, sorted(set(aheads), reverse=True), marker)  # only ever smaller
            self.assertGreaterEqual(aheads[-1], 1, marker)
            gaps = [b - a for (a, _), (b, _) in zip(queued, queued[1:])]
            self.assertTrue(all(gap >= limits.poll for gap in gaps), (marker, gaps))
            first_other = next(j for j, (_, ev) in enumerate(heard[marker]) if not isinstance(ev, lc.Queued))
            self.assertEqual(first_other, len(queued), marker)  # every Queued comes before the answer
        self.assertTrue({20, 15, 10, 5} <= set(last()), last())
        self.assertEqual(client._board.gate.snapshot()[(None, 0)], (0, 0))
        self.assertEqual(gate_problems(client._board.gate), [])


class TestGateAsync(AsyncDriver, TestGate):
    pass


class TestGateHandover(unittest.TestCase):
    """The gate alone: a release hands over to one waiter, positions are counted without walking the
    queue, memory is constant per waiter."""

    def wait_in_threads(self, gate, key, n, poll=60.0):
        """``n`` tickets, each waited for in a thread of its own (the queue plan on a run of its own);
        returns (runs, tickets, results, threads) once every thread is parked."""
        runs = [CountingRun() for _ in range(n)]
        tickets = [gate.enter(key, 1, run) for run in runs]
        results = {}

        def wait(i):
            runs[i].gen = lc._queued(gate, tickets[i], poll)
            try:
                results[i] = runs[i].finish()
            except lc.CancelledError as exc:
                results[i] = exc

        threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(n)]
        for thread in threads:
            thread.start()
        wait_for(lambda: all(run.lock.locked() for run in runs), 5, "every waiter to park")
        return runs, tickets, results, threads

    def test_a_release_wakes_the_next_waiter_only(self):
        gate = lc._Gate(threading.Lock(), 100)
        key = (None, 0)
        holder = gate.enter(key, 1)
        runs, tickets, results, threads = self.wait_in_threads(gate, key, 20)
        self.assertEqual([t.ahead for t in tickets], list(range(1, 21)))
        signals = lambda: [run.signals for run in runs]

        gate.leave(holder)
        threads[0].join(5)
        self.assertIsNone(results[0])
        self.assertEqual(signals(), [1] + [0] * 19)
        self.assertEqual(gate.snapshot()[key], (1, 19))

        # a waiter cancelled from the middle: its own run wakes it, and leaving the queue wakes nobody
        runs[7].cancel()
        threads[7].join(5)
        self.assertIsInstance(results[7], lc.CancelledError)
        gate.leave(tickets[7])
        self.assertEqual(signals(), [1] + [0] * 19)
        self.assertEqual(gate.snapshot()[key], (1, 18))

        gate.leave(tickets[0])  # handed to the next in line
        threads[1].join(5)
        self.assertIsNone(results[1])
        self.assertEqual(signals(), [1, 1] + [0] * 18)
        self.assertEqual(sorted(results), [0, 1, 7])  # the rest still sleep on their 60 s timers
        self.assertEqual(gate_problems(gate), [])

        rest = [i for i in range(20) if i not in (0, 1, 7)]
        for i in rest:
            runs[i].cancel()
        for i in rest:
            threads[i].join(5)
            self.assertIsInstance(results[i], lc.CancelledError)
            gate.leave(tickets[i])
        gate.leave(tickets[1])
        self.assertEqual(gate.snapshot()[key], (0, 0))
        self.assertEqual(signals(), [1, 1] + [0] * 18)  # one signal per hand-over, never two
        self.assertEqual(gate_problems(gate), [])

    def test_a_granted_ticket_is_told_even_when_its_release_came_before_wait(self):
        gate = lc._Gate(threading.Lock(), 4)
        key = (None, 0)
        holder = gate.enter(key, 1)
        run = CountingRun()
        ticket = gate.enter(key, 1, run)
        gate.leave(holder)  # granted and signalled before its waiter ever parks
        self.assertTrue(ticket.granted)
        self.assertEqual(run.signals, 1)
        run.gen = lc._queued(gate, ticket, 60.0)
        t = Timer()
        self.assertIsNone(run_with_timeout(run.finish, 5))
        self.assertLess(t.elapsed, 5.0)  # the signal was kept, not lost before the park
        gate.leave(ticket)
        self.assertEqual(gate.snapshot()[key], (0, 0))

    def test_wait_announces_a_smaller_ahead_on_its_timer_only(self):
        gate = lc._Gate(threading.Lock(), 8)
        key = (None, 0)
        holder = gate.enter(key, 1)
        first, second = gate.enter(key, 1), gate.enter(key, 1)
        run = CountingRun()
        third = gate.enter(key, 1, run)
        self.assertEqual(third.ahead, 3)
        run.gen = lc._queued(gate, third, 0.05)
        self.assertEqual(run_with_timeout(run.step, 5), [lc.Queued(3)])
        gate.leave(first)  # cancelled from the queue: nobody is woken, third learns it on its timer
        t = Timer()
        self.assertEqual(run_with_timeout(run.step, 5), [lc.Queued(2)])
        self.assertGreaterEqual(t.elapsed, 0.05 - EARLY)
        self.assertEqual(third.ahead, 2)
        gate.leave(holder)  # second is granted; third is next but is told only when its timer fires
        t = Timer()
        self.assertEqual(run_with_timeout(run.step, 5), [lc.Queued(1)])
        self.assertGreaterEqual(t.elapsed, 0.05 - EARLY)
        self.assertEqual(run.signals, 0)
        run.cancelled = True
        with self.assertRaises(lc.CancelledError):
            run.step()  # checked before parking again
        for ticket in (second, third):
            gate.leave(ticket)
        self.assertEqual(gate.snapshot()[key], (0, 0))

    def test_positions_match_a_plain_list(self):
        """Random enters, cancels from anywhere, releases and pool growth against a list model."""
        rng = random.Random(20261201)
        gate = lc._Gate(threading.Lock(), 10**6)
        key = (None, None)
        queued, held = [], []
        capacity = 1
        renumbered = []
        original = lc._Lane._renumber
        patch = mock.patch.object(lc._Lane, "_renumber", lambda lane: (renumbered.append(1), original(lane)))
        patch.start()
        self.addCleanup(patch.stop)
        for step in range(6000):
            lane = gate._lanes.get(key)
            r = rng.random()
            if r < 0.02 and capacity < 6:
                capacity += 1
                queued.append(gate.enter(key, capacity))
            elif r < 0.47 or not (queued or held):
                queued.append(gate.enter(key, capacity))
            elif r < 0.85 and queued:
                # cancels favour the middle and the tail, where they leave holes
                gate.leave(queued.pop(rng.randrange(1, len(queued)) if len(queued) > 1 else 0))
            elif held:
                gate.leave(held.pop(rng.randrange(len(held))))
            lane = gate._lanes[key]
            moved = [t for t in queued if t.granted]
            self.assertEqual(moved, queued[: len(moved)], "granted out of order at step %d" % step)
            held += moved
            del queued[: len(moved)]
            self.assertEqual(lane.in_flight, len(held))
            for rank, ticket in enumerate(queued):
                self.assertEqual(lane.before(ticket), rank)
            self.assertEqual(gate_problems(gate), [], "step %d" % step)
        self.assertEqual(gate_problems(gate), [])
        self.assertTrue(renumbered)
        for ticket in queued + held:
            gate.leave(ticket)
        self.assertEqual(gate.snapshot()[key], (0, 0))

    def test_churn_behind_a_held_head_stays_bounded(self):
        """Waiters that come and go while the head never moves: the holes they leave are renumbered away."""
        gate = lc._Gate(threading.Lock(), 8)
        key = (None, 0)
        holder = gate.enter(key, 1)
        head = gate.enter(key, 1)
        previous = gate.enter(key, 1)
        lane = gate._lanes[key]
        tracemalloc.start()
        try:
            for i in range(20000):
                if i == 1000:
                    start = tracemalloc.get_traced_memory()[0]
                newer = gate.enter(key, 1)
                gate.leave(previous)  # leaves a hole behind the head every time
                previous = newer
            grown = tracemalloc.get_traced_memory()[0] - start
        finally:
            tracemalloc.stop()
        self.assertLess(grown, 4096)
        self.assertLessEqual(len(lane.holes), len(lane.queue))
        self.assertLessEqual(lane.tail, 8)
        self.assertEqual(lane.before(previous), 1)
        self.assertEqual(gate_problems(gate), [])
        for ticket in (previous, head, holder):
            gate.leave(ticket)
        self.assertEqual(gate.snapshot()[key], (0, 0))

    def test_holes_stay_fewer_than_waiters_as_the_head_moves(self):
        gate = lc._Gate(threading.Lock(), 8)
        key = (None, 0)
        holder = gate.enter(key, 1)
        tickets = [gate.enter(key, 1) for _ in range(6)]  # positions 0 to 5
        for ticket in tickets[2:5]:
            gate.leave(ticket)  # three holes, three waiting: 0, 1 and 5
        lane = gate._lanes[key]
        self.assertEqual((lane.holes, sorted(lane.queue)), ([2, 3, 4], [0, 1, 5]))
        gate.leave(holder)  # 0 is granted; the holes behind the new head would outnumber 1 and 5
        self.assertTrue(tickets[0].granted)
        self.assertEqual(gate_problems(gate), [])
        self.assertEqual([lane.before(t) for t in (tickets[1], tickets[5])], [0, 1])
        for ticket in (tickets[0], tickets[1], tickets[5]):
            gate.leave(ticket)
        self.assertEqual(gate.snapshot()[key], (0, 0))

    def test_memory_per_waiter_is_constant(self):
        def per_waiter(n):
            gate = lc._Gate(threading.Lock(), n)
            gate.enter((None, 0), 1)
            tickets = [None] * n
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                for i in range(n):
                    tickets[i] = gate.enter((None, 0), 1)
                grown = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            return grown / n

        small, large = per_waiter(1000), per_waiter(8000)  # past the small-dict sizes of the queue
        self.assertLess(large, 1024)
        self.assertLess(large, 1.5 * small)

    def test_a_pool_that_grows_admits_the_waiters_that_fit(self):
        gate = lc._Gate(threading.Lock(), 8)
        key = (None, None)
        first = gate.enter(key, 1)  # /props not answered yet: a pool of one
        wakers = [CountingRun() for _ in range(3)]
        waiting = [gate.enter(key, 1, w) for w in wakers]
        self.assertEqual([t.ahead for t in waiting], [1, 2, 3])
        late = gate.enter(key, 3)  # /props answered 3: the first two waiters get the new permits at once
        self.assertEqual([t.granted for t in waiting], [True, True, False])
        self.assertEqual([w.signals for w in wakers], [1, 1, 0])
        self.assertFalse(late.granted)
        self.assertEqual(late.ahead, 4)  # three in flight, one queued before it
        self.assertEqual(gate.snapshot()[key], (3, 2))
        stale = gate.enter(key, 1)  # a caller that had not heard /props yet does not shrink the pool
        self.assertEqual(gate._lanes[key].capacity, 3)
        self.assertEqual(gate.snapshot()[key], (3, 3))
        gate.leave(first)
        self.assertTrue(waiting[2].granted)
        self.assertEqual(gate_problems(gate), [])
        for ticket in waiting + [late, stale]:
            gate.leave(ticket)
        self.assertEqual(gate.snapshot()[key], (0, 0))

    def test_busy_error_names_the_slot_and_the_model(self):
        gate = lc._Gate(threading.Lock(), 1)
        for key, slot, where in (
            ((None, 3), 3, "slot 3"),
            ((None, None), None, "any slot"),
            (("qwen3-4b", 0), 0, "slot 0 of model qwen3-4b"),
            (("qwen3-4b", None), None, "any slot of model qwen3-4b"),
        ):
            with self.subTest(key=key):
                held, queued = gate.enter(key, 1), gate.enter(key, 1)
                with self.assertRaises(lc.BusyError) as caught:
                    gate.enter(key, 1)
                exc = caught.exception
                self.assertEqual((exc.slot, exc.queue_len, exc.waiting), (slot, 1, 1))
                self.assertIn("wait for %s (queue_len 1)" % where, str(exc))
                if key[0] is None:
                    self.assertNotIn("model", str(exc))
                gate.leave(queued)
                gate.leave(held)
        self.assertEqual(set(gate.snapshot().values()), {(0, 0)})

    def test_keys_are_model_and_slot_together(self):
        gate = lc._Gate(threading.Lock(), 4)
        a, b = gate.enter(("a", 0), 1), gate.enter(("b", 0), 1)
        self.assertTrue(a.granted and b.granted)  # slot 0 of model a and of model b are different queues
        gate.leave(a)
        gate.leave(b)


@real_time
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
        self.assertTrue(done.wait(10))
        elapsed = t.elapsed
        self.assertIsInstance(events[-1], lc.CancelledError)
        self.assertLess(elapsed, lateness(self, 0.2))
        return events, elapsed

    def test_cancel_while_streaming_closes_the_connection(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))))
            req.wait_peer_close(5)

        self.cancel_during(handler, lambda evs: lc.Content("a") in evs)  # (a late head: a Waiting first)
        req = self.server.chat_requests()[0]
        self.assertTrue(req.closed_by_peer.wait(10))
        self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (0, 0))

    def test_cancel_while_waiting_for_the_head(self):
        self.server.busy[0] = True
        answers = SlotAnswers(self)
        told = lambda evs: answers.sort([e for e in evs if isinstance(e, lc.Waiting)])[0]
        events, _ = self.cancel_during(hold_then(b"", threading.Event()), told)
        self.assertEqual(told(events)[0], lc.Waiting(True))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(10))

    def test_cancel_while_backing_off(self):
        client = self.new_client(self.server.tmp + "/never.sock", limits=self.limits)
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
        first = run_with_timeout(lambda: next(e for e in stream if not isinstance(e, lc.Waiting)))  # (a late head)
        self.assertEqual(first, lc.Content("a"))
        self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (1, 0))
        stream.cancel()  # nobody is iterating: cleanup happens here
        self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (0, 0))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(10))
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
                    if not isinstance(ev, lc.Waiting):  # (a head later than the poll: Waiting first)
                        return ev

        self.assertEqual(run_with_timeout(body), lc.Content("a"))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(10))
        self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (0, 0))

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
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(10))
        self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (0, 0))

    def test_keyboard_interrupt_in_chat_propagates_as_itself(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))))
            req.wait_peer_close(5)

        self.use(handler)

        def on_event(ev):
            raise KeyboardInterrupt

        with self.assertRaises(KeyboardInterrupt):
            run_with_timeout(lambda: self.client.chat(MSGS, slot=0, on_event=on_event))
        self.assertTrue(self.server.chat_requests()[0].closed_by_peer.wait(10))
        self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (0, 0))

    def test_client_close_cancels_streams(self):
        def handler(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"}))))
            req.wait_peer_close(5)

        self.use(handler)
        stream = self.client.stream(MSGS, slot=0)
        first = run_with_timeout(lambda: next(e for e in stream if not isinstance(e, lc.Waiting)))  # (a late head)
        self.assertEqual(first, lc.Content("a"))
        self.client.close()
        with self.assertRaises(lc.CancelledError):
            next(stream)
        with self.assertRaises(ValueError):
            self.client.stream(MSGS)


class TestCancelAsync(AsyncDriver, TestCancel):
    pass


@real_time
class TestAsyncCancel(ServerCase):
    """``stream.cancel()`` and cancelling the iterating task, while queued, backing off, waiting for the
    head and streaming: the request ends within 0.2 s (``lc.CancelledError`` after ``cancel()``,
    ``asyncio.CancelledError`` for the cancelled task), its socket is closed and its permit released at
    once, and nothing is left behind when the loop closes."""

    limits = lc.Limits(poll=0.05, liveness=5.0, busy_wait=10.0, load_wait=10.0, idle_grace=10.0)

    def cancel_in(self, state, how):
        server = self.server
        address = server.address
        keeper = None
        if state == "queued":
            keeper = Gatekeeper(server)
        elif state == "backing off":
            address = os.path.join(server.tmp, "missing.sock")
        elif state == "head":
            server.busy[0] = True
            self.use(hold_then(b"", threading.Event()))
        else:
            self.use(
                lambda req: (req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "a"})))), req.wait_peer_close(5))
            )
        answers = SlotAnswers(self)
        ready = {
            "queued": lambda evs: evs == [lc.Queued(1)],
            "backing off": lambda evs: any(isinstance(e, lc.Retrying) for e in evs),
            "head": lambda evs: lc.Waiting(True) in answers.sort(list(evs))[0],  # told busy, on an answer
            "streaming": lambda evs: lc.Content("a") in evs,
        }[state]

        async def main():
            async with lc.AsyncClient(address, limits=self.limits) as client:
                first = None
                if keeper is not None:
                    first = asyncio.ensure_future(client.chat([{"role": "user", "content": "A"}], slot=0))
                    await until(lambda: keeper.arrived("A"), what="A in flight")
                stream = client.stream(MSGS, slot=0)
                events = []
                task = asyncio.ensure_future(consume(stream, events))
                await until(lambda: ready(events), what=state)
                start = time.monotonic()
                if how == "cancel()":
                    stream.cancel()
                    self.assertTrue(
                        all(c._transport.is_closing() for c in stream._run._conns), "not closed by cancel()"
                    )
                    self.assertEqual(client._board.gate.snapshot()[(None, 0)], (1 if first else 0, 0))
                else:
                    task.cancel()
                await asyncio.wait({task}, timeout=10)
                elapsed = time.monotonic() - start
                self.assertTrue(task.done())
                if how == "cancel()":
                    self.assertIsInstance(task.exception(), lc.CancelledError)
                else:
                    self.assertTrue(task.cancelled())
                self.assertLess(elapsed, lateness(self, 0.2))
                self.assertFalse(stream._run._conns)
                self.assertEqual(client._board.gate.snapshot()[(None, 0)], (1 if first else 0, 0))
                if state in ("head", "streaming"):
                    request = server.chat_requests()[0]
                    await until(request.closed_by_peer.is_set, 1.0, "the server to see the client go")
                if first is not None:
                    keeper.release("A")
                    self.assertEqual((await first).content, "A")
                    self.assertEqual([m for _, m in keeper.order], ["A"])
                return events

        return run_on_new_loop(self, main)

    def test_cancel_while_queued(self):
        self.assertEqual(self.cancel_in("queued", "cancel()"), [lc.Queued(1)])

    def test_task_cancel_while_queued(self):
        self.assertEqual(self.cancel_in("queued", "task.cancel()"), [lc.Queued(1)])

    def test_cancel_while_backing_off(self):
        self.assertIsInstance(self.cancel_in("backing off", "cancel()")[0], lc.Retrying)

    def test_task_cancel_while_backing_off(self):
        self.assertIsInstance(self.cancel_in("backing off", "task.cancel()")[0], lc.Retrying)

    def test_cancel_while_waiting_for_the_head(self):
        self.assertIn(lc.Waiting(True), self.cancel_in("head", "cancel()"))

    def test_task_cancel_while_waiting_for_the_head(self):
        self.assertIn(lc.Waiting(True), self.cancel_in("head", "task.cancel()"))

    def test_cancel_while_streaming(self):
        self.assertEqual(waits_first(self, self.cancel_in("streaming", "cancel()")), [lc.Content("a")])

    def test_task_cancel_while_streaming(self):
        self.assertEqual(waits_first(self, self.cancel_in("streaming", "task.cancel()")), [lc.Content("a")])

    def test_closing_the_client_cancels_its_streams_and_ends_its_tasks(self):
        self.server.busy[0] = True
        self.server.slots_delay = 3.0  # a /slots poll hangs: the board's task is in flight at close
        self.use(hold_then(b"", threading.Event()))

        async def main():
            client = lc.AsyncClient(self.server.address, limits=self.limits)
            stream = client.stream(MSGS, slot=0)
            task = asyncio.ensure_future(consume(stream, []))
            await until(lambda: self.server.slots_in_flight == 1, what="a /slots poll in flight")
            await client.close()
            await asyncio.wait({task}, timeout=1.0)
            self.assertIsInstance(task.exception(), lc.CancelledError)
            with self.assertRaises(ValueError):
                client.stream(MSGS)
            with self.assertRaises(ValueError):
                await client.slots()

        run_on_new_loop(self, main)  # fails on a task still pending


def reasoning_stream(n_reasoning, content="yes", cid=CID):
    events = [sse(chunk_json({"role": "assistant", "content": None}, cid=cid))]
    events += [sse(chunk_json({"reasoning_content": " r%d" % i}, cid=cid)) for i in range(n_reasoning)]
    events.append(sse(chunk_json({"content": content}, cid=cid)))
    events.append(sse(chunk_json({}, "stop", cid=cid)))
    events.append(b"data: [DONE]\n\n")
    return chunked(*events) + b"0\r\n\r\n"


class TestThinkingCap(ServerCase):
    def capped(self, cap=3, overrun=4):
        return self.new_client(
            self.server.address, limits=lc.Limits(poll=0.05, liveness=2.0, thinking_cap=cap, thinking_overrun=overrun)
        )

    def controlled(self, answer, tokens=4):
        """A server that streams ``tokens`` reasoning tokens (one past a cap of 3: what a server generates
        while the control request travels), then waits for the control endpoint to be called, then sends 1
        more token and content; with no call within 10 s, a finish by length.  In that order whatever the
        machine's pace (a server that kept generating on its own clock would outrun the overrun allowance
        on a loaded machine, where the control request takes longer to come)."""
        ended = threading.Event()
        controls = []

        def control(req):
            controls.append(req.json())
            answer(req)
            ended.set()

        def chat(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"role": "assistant", "content": None}))))
            for i in range(tokens):
                req.send(chunked(sse(chunk_json({"reasoning_content": " r%d" % i}))))
            if not ended.wait(10):
                req.send(chunked(sse(chunk_json({}, "length"))) + b"0\r\n\r\n")
                return
            req.send(
                chunked(
                    sse(chunk_json({"reasoning_content": " last"})),
                    sse(chunk_json({"content": "yes"})),
                    sse(chunk_json({}, "stop")),
                    b"data: [DONE]\n\n",
                )
                + b"0\r\n\r\n"
            )

        self.server.route("POST", "/v1/chat/completions/control", control)
        self.use(chat)
        return controls

    def test_cap_ends_reasoning(self):
        controls = self.controlled(lambda req: respond_json(req, {"success": True}))
        completion, events = self.collect(client=self.capped(cap=3))
        self.assertEqual(self.server.chat_requests()[0].json()["reasoning_control"], True)
        self.assertEqual(controls, [{"id": CID, "action": "reasoning_end"}])
        # (a Waiting first when the head comes later than the 50 ms poll on a loaded machine)
        self.assertEqual(
            waits_first(self, events),
            [
                lc.Reasoning(" r0"),
                lc.Reasoning(" r1"),
                lc.Reasoning(" r2"),
                lc.ThinkingCapped(3),
                lc.Reasoning(" r3"),  # generated while the control request travelled: within the overrun
                lc.Reasoning(" last"),
                lc.Content("yes"),
            ],
        )
        self.assertTrue(completion.thinking_capped)
        self.assertEqual(completion.reasoning_tokens, 5)
        self.assertLessEqual(completion.reasoning_tokens, 3 + 4)
        self.assertEqual(completion.content, "yes")

    def test_server_refuses(self):
        self.controlled(lambda req: respond_json(req, {"success": False}))
        with self.assertRaises(lc.ThinkingOverrunError):
            self.collect(client=self.capped())

    def test_control_endpoint_missing(self):
        self.controlled(
            lambda req: respond_json(req, {"error": {"message": "File Not Found", "code": 404}}, 404, "Not Found")
        )
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


class TestThinkingCapAsync(AsyncDriver, TestThinkingCap):
    pass


class TestStress(ServerCase):
    """Threads x requests over slots, random cancels and random server faults: every request ends in a
    documented way, every permit comes back, BusyError exactly at queue_len, each slot served in entry
    order, every Queued sequence starts at the entry position and only shrinks, and the gate's invariants
    hold throughout (sampled while it runs)."""

    limits = lc.Limits(poll=0.05, liveness=2.0, busy_wait=10.0, load_wait=2.0, idle_grace=10.0, queue_len=2)

    def setUp(self):
        super().setUp()
        self.server.busy = [False] * 4

    def test_sixteen_threads(self):
        self.stress(self.client, threads=16, per_thread=6, slots=4, seed=20261130)

    def test_a_thousand_waiters(self):
        """1,100 threads on two slots with queue_len 500: the first request on each slot is held until
        every thread has entered the gate, and the cancels start then, so 1,000 wait at once (fewer as
        cancels come) and the rest are refused."""
        # load_wait generous: when the held requests are let go, hundreds connect at once and overflow the
        # fake server's listen queue, which is retried under load_wait (a budget this test is not about)
        # liveness and idle_grace generous too: 1,100 threads of one process on a loaded machine leave a
        # stream or a scripted handler unscheduled for seconds (a StalledError after 2 s was seen), and the
        # budgets are not what this test is about
        limits = self.limits.replace(queue_len=500, poll=0.2, load_wait=60.0, liveness=30.0, idle_grace=60.0)
        # the threaded client: 1,100 threads (TestAsyncStress and TestAsyncScale load the asyncio client)
        client = lc.Client(self.server.address, limits=limits)
        self.closers.append(client.close)
        self.stress(
            client,
            threads=1100,
            per_thread=1,
            slots=2,
            seed=20261201,
            pace=(0.0005, 0.002),
            cancel_within=1.0,
            hold_first=True,
        )
        # when the last thread came, each slot held one request in flight and queue_len waiting (this seed
        # puts more than 501 requests on each slot): exact, where the sampler's peak, every 50 ms, may come
        # after the first cancels
        self.assertEqual(self.at_entry, {(None, 0): (1, 500), (None, 1): (1, 500)})

    def stress(
        self, client, threads, per_thread, slots, seed, pace=(0.002, 0.02), cancel_within=0.08, hold_first=False
    ):
        """Run the load; check it; return the most requests seen waiting at once.  ``hold_first``: the
        first request on each slot is held until every thread's first request has entered the gate (or
        was refused); the gate then is ``self.at_entry``, and the cancels' timers start only then."""
        queue_len = client.limits.queue_len
        gate = client._board.gate
        rng = random.Random(seed)
        plans = {}
        arrivals = []
        alock = threading.Lock()
        everyone_in = threading.Event()  # every thread's first request has entered the gate or ended
        deferred = []  # with hold_first: the cancels' timers, started once everyone is in

        def handler(req):
            marker = req.json()["messages"][0]["content"]
            slot = req.json()["id_slot"]
            accepted = self.server.accepted(req)
            with alock:
                first = hold_first and all(s != slot for _, s, _ in arrivals)
                arrivals.append((accepted, slot, marker))
            if first:
                everyone_in.wait(30)
            fault = plans[marker]["fault"]
            if fault == "hold":
                req.wait_peer_close(5)
            elif fault == "close":
                req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "x"})))[:-7])
            elif fault == "error":
                req.send(
                    STREAM_HEAD
                    + chunked(b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n')
                    + b"0\r\n\r\n"
                )
            elif fault == "400":
                respond_json(
                    req, {"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}}, 400, "Bad Request"
                )
            else:
                req.send(STREAM_HEAD + chunked(sse(chunk_json({"role": "assistant", "content": None}))))
                for word in (marker, ""):
                    time.sleep(plans[marker]["pace"])  # the scripted server's generation pace
                    if word and not req.send(chunked(sse(chunk_json({"content": word})))):
                        return
                req.send(chunked(sse(chunk_json({}, "stop")), b"data: [DONE]\n\n") + b"0\r\n\r\n")

        self.use(handler)
        tickets = {}
        refusals = []
        enter = gate.enter
        first_round = [threads]

        def arrived():
            """This thread's first request entered the gate, was refused, or ended before (cancelled)."""
            me = threading.current_thread()
            if not getattr(me, "arrived", False):
                me.arrived = True
                with alock:
                    first_round[0] -= 1
                    if not first_round[0]:
                        self.at_entry = gate.snapshot()
                        everyone_in.set()
                        for timer in deferred:
                            timer.start()

        def recording_enter(key, capacity, waker=None):
            marker = threading.current_thread().marker
            try:
                ticket = enter(key, capacity, waker)
            except lc.BusyError as exc:
                refusals.append((marker, exc.waiting, exc.queue_len, exc.slot, key))
                raise
            finally:
                arrived()
            tickets[marker] = (key, ticket.seq, ticket.ahead, ticket.waker is not None)  # queued at entry
            return ticket

        gate.enter = recording_enter
        outcomes = {}
        heard = {}
        for t in range(threads):
            for n in range(per_thread):
                marker = "t%d-%d" % (t, n)
                fault = rng.choice(["ok"] * 6 + ["close", "error", "400", "hold"])
                plans[marker] = {
                    "fault": fault,
                    "slot": rng.randrange(slots),
                    "pace": rng.uniform(*pace),
                    "cancel": rng.uniform(0.0, cancel_within) if fault == "hold" or rng.random() < 0.15 else None,
                }

        go = threading.Event()

        def worker(t):
            go.wait(30)
            for n in range(per_thread):
                marker = "t%d-%d" % (t, n)
                threading.current_thread().marker = marker
                plan = plans[marker]
                stream = client.stream([{"role": "user", "content": marker}], slot=plan["slot"])
                timer = None
                if plan["cancel"] is not None:
                    timer = threading.Timer(plan["cancel"], stream.cancel)
                    with alock:
                        if hold_first and not everyone_in.is_set():
                            deferred.append(timer)
                        else:
                            timer.start()
                queued = heard[marker] = []
                try:
                    for ev in stream:
                        if type(ev) is lc.Queued:
                            queued.append(ev.ahead)
                    outcomes[marker] = stream.completion.content
                except lc.LoopError as exc:
                    outcomes[marker] = type(exc).__name__
                finally:
                    arrived()  # a request cancelled before it reached the gate never entered it
                    if timer is not None:
                        timer.cancel()
                        if timer.ident is not None:  # a deferred one not started yet ends at once when it is
                            timer.join(2)

        sampled = []
        peak = 0
        stop = threading.Event()

        def sampler():
            nonlocal peak
            while not stop.wait(0.05):
                sampled.extend(gate_problems(gate, queue_len))
                peak = max(peak, sum(w for _, w in gate.snapshot().values()))

        workers = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
        for th in workers:
            th.start()
        watch = threading.Thread(target=sampler, daemon=True)
        watch.start()
        go.set()
        deadline = time.monotonic() + 120
        for th in workers:
            th.join(max(0.1, deadline - time.monotonic()))
            self.assertFalse(th.is_alive(), "a worker hung")
        stop.set()
        watch.join(5)
        # every request ended in a documented way
        allowed = {"BusyError", "CancelledError", "StreamClosedError", "ServerError", "HTTPStatusError"}
        for marker, outcome in outcomes.items():
            self.assertTrue(outcome == marker or outcome in allowed, (marker, outcome))
            if plans[marker]["fault"] == "ok" and plans[marker]["cancel"] is None:
                self.assertIn(outcome, (marker, "BusyError"))
        self.assertEqual(len(outcomes), threads * per_thread)
        # every permit released, and the invariants held whenever they were looked at
        self.assertTrue(all(v == (0, 0) for v in gate.snapshot().values()), gate.snapshot())
        self.assertEqual(sampled[:5], [])
        self.assertEqual(gate_problems(gate, queue_len), [])
        # BusyError exactly when the queue was full, naming its slot
        busy = [m for m, o in outcomes.items() if o == "BusyError"]
        self.assertEqual(sorted(busy), sorted(m for m, *_ in refusals))
        self.assertTrue(all(waiting == qlen == queue_len for _, waiting, qlen, _, _ in refusals), refusals[:5])
        self.assertTrue(all(slot == key[1] for *_, slot, key in refusals))
        self.assertTrue(all(ahead <= queue_len for _, _, ahead, queued in tickets.values() if queued))
        # Queued: the entry position first, then only smaller; none for a request granted at once
        for marker, (_, _, ahead, queued) in tickets.items():
            said = heard[marker]
            if not queued:
                self.assertEqual(said, [], marker)
            elif said:  # a request cancelled at once may not have heard its first one
                self.assertEqual(said[0], ahead, marker)
                self.assertEqual(said, sorted(set(said), reverse=True), marker)
                self.assertGreaterEqual(said[-1], 1, marker)
        # FIFO per slot: each slot's requests connected in the order they entered the gate (taken in the
        # order they connected: a handler thread may come to its request later than the next one's, when
        # the first was cancelled once sent and the next one took its permit)
        arrivals.sort()
        for slot in range(slots):
            seen = [tickets[m][1] for _, s, m in arrivals if s == slot]
            self.assertEqual(seen, sorted(seen), "slot %d out of order" % slot)
        self.assertLessEqual(self.server.slots_max_in_flight, 1)
        return peak


class TestAsyncStress(ServerCase):
    """48 streams over 4 slots on one loop, queue_len 2, with cancel() and task.cancel() and server faults
    at random: every request ends in a documented way, every permit is released, BusyError comes exactly
    when a queue is full, and each slot's requests reach the server in the order they entered its queue."""

    limits = lc.Limits(poll=0.05, liveness=2.0, busy_wait=10.0, load_wait=2.0, idle_grace=10.0, queue_len=2)

    def test_random_cancels_and_faults(self):
        self.server.busy = [False] * 4
        rng = random.Random(20261201)
        plans = {}
        for n in range(48):
            fault = rng.choice(["ok"] * 6 + ["close", "error", "400", "hold"])
            plans["s%d" % n] = {
                "fault": fault,
                "slot": rng.randrange(4),
                "start": rng.uniform(0.0, 0.3),
                "pace": rng.uniform(0.002, 0.02),
                "cancel": rng.uniform(0.0, 0.08) if fault == "hold" or rng.random() < 0.15 else None,
                "how": rng.choice(["cancel()", "task.cancel()"]),
            }
        arrivals = []
        lock = threading.Lock()

        def handler(req):
            marker = req.json()["messages"][0]["content"]
            accepted = self.server.accepted(req)
            with lock:
                arrivals.append((accepted, req.json()["id_slot"], marker))
            fault = plans[marker]["fault"]
            if fault == "hold":
                req.wait_peer_close(5)
            elif fault == "close":
                req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "x"})))[:-7])
            elif fault == "error":
                req.send(
                    STREAM_HEAD + chunked(b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n')
                )
            elif fault == "400":
                respond_json(req, {"error": {"code": 400, "message": "bad"}}, 400, "Bad Request")
            else:
                time.sleep(plans[marker]["pace"])  # the scripted server's generation pace
                req.send(STREAM_HEAD + content_stream([marker]))

        self.use(handler)

        async def main():
            async with lc.AsyncClient(self.server.address, limits=self.limits) as client:
                await client.health()  # the board of this loop exists: its gate can be watched
                gate = client._board.gate
                enter = gate.enter
                entered, refusals, current = [], [], [None]

                def watching_enter(key, capacity, waker=None):
                    full = gate.snapshot().get(key, (0, 0))[1] >= 2
                    try:
                        ticket = enter(key, capacity, waker)
                    except lc.BusyError as exc:
                        refusals.append((current[0], full, exc.waiting, exc.queue_len))
                        raise
                    self.assertFalse(full)
                    entered.append((key[1], current[0]))
                    return ticket

                gate.enter = watching_enter
                outcomes = {}

                async def one(marker):
                    plan = plans[marker]
                    await asyncio.sleep(plan["start"])
                    stream = client.stream([{"role": "user", "content": marker}], slot=plan["slot"])
                    if plan["cancel"] is not None:
                        task = asyncio.current_task()
                        cancel = stream.cancel if plan["how"] == "cancel()" else task.cancel
                        asyncio.get_running_loop().call_later(plan["cancel"], cancel)
                    current[0] = marker  # the gate is entered in this step: no await until then
                    try:
                        async for _ in stream:
                            pass
                        outcomes[marker] = stream.completion.content
                    except lc.LoopError as exc:
                        outcomes[marker] = type(exc).__name__

                tasks = {m: asyncio.ensure_future(one(m)) for m in plans}
                await asyncio.wait(tasks.values(), timeout=30)
                for marker, task in tasks.items():
                    self.assertTrue(task.done(), marker)
                    if task.cancelled():
                        outcomes[marker] = "asyncio.CancelledError"
                return outcomes, entered, refusals, {k: v for k, v in gate.snapshot().items() if v != (0, 0)}

        outcomes, entered, refusals, busy_lanes = run_on_new_loop(self, main)
        allowed = {
            "BusyError",
            "CancelledError",
            "asyncio.CancelledError",
            "StreamClosedError",
            "ServerError",
            "HTTPStatusError",
        }
        self.assertEqual(len(outcomes), 48)
        for marker, outcome in outcomes.items():
            self.assertTrue(outcome == marker or outcome in allowed, (marker, outcome))
            if plans[marker]["fault"] == "ok" and plans[marker]["cancel"] is None:
                self.assertIn(outcome, (marker, "BusyError"))
        self.assertEqual(busy_lanes, {}, "a permit or a place was not released")
        self.assertEqual(sorted(m for m, o in outcomes.items() if o == "BusyError"), sorted(r[0] for r in refusals))
        self.assertTrue(all(full and waiting == qlen == 2 for _, full, waiting, qlen in refusals), refusals)
        # in the order they connected (a handler thread may come to its request later than the next one's, when
        # the first was cancelled once sent and the next one took its permit)
        arrivals.sort()
        for slot in range(4):
            sent = [m for _, s, m in arrivals if s == slot]
            self.assertEqual(sent, [m for s, m in entered if s == slot and m in sent], "slot %d out of order" % slot)
        self.assertLessEqual(self.server.slots_max_in_flight, 1)


#: A fake llama-server for many connections: one asyncio process (so that its memory is not the client's).
#: A chat gets its head and first delta at once; the rest waits until POST /release (which ends the held
#: streams and holds none after it; ``/release?again`` holds the next ones too).  /props says
#: ``total_slots`` is argv[2].
_SCALE_SERVER = r"""
import asyncio, json, sys

path, slots = sys.argv[1], int(sys.argv[2])

def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)

def event(delta, finish=None):
    doc = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "id": "chatcmpl-x", "model": "m"}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
FIRST = chunk(event({"role": "assistant", "content": None}) + event({"content": "w0"}))
REST = chunk(event({"content": " w1"}) + event({}, "stop") + b"data: [DONE]\n\n") + b"0\r\n\r\n"

def answer(doc):
    body = json.dumps(doc).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

async def main():
    held = [asyncio.Event()]

    async def serve(reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            target = head.split(b" ")[1]
            if target.startswith(b"/v1/chat/completions"):
                writer.write(HEAD + FIRST)
                if held:
                    await held[0].wait()
                writer.write(REST)
            elif target.startswith(b"/release"):
                held.pop().set()
                if target.endswith(b"?again"):
                    held.append(asyncio.Event())
                writer.write(answer({}))
            elif target.startswith(b"/props"):
                writer.write(answer({"total_slots": slots}))
            else:
                writer.write(answer([{"id": 0, "is_processing": False}]))
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(serve, path, backlog=4096)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


class TestAsyncScale(unittest.TestCase):
    """1,000 concurrent streams, and 1,000 waiters on one slot, on one event loop: each completes, and the
    memory each costs (tracemalloc, its task included) stays under a fixed bound.  Measured without asyncio's
    debug mode, which records a stack for every future, handle and task (three times the memory)."""

    #: bytes per stream in flight (connection, transport, pump, stream, its task) and per queued waiter;
    #: about twice what Python 3.11 measures (8.5 KiB and 3.6 KiB)
    STREAM_BOUND = 16 * 1024
    WAITER_BOUND = 8 * 1024

    def setUp(self):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 2500:
            if hard != resource.RLIM_INFINITY and hard < 2500:
                self.skipTest("1,000 connections need more file descriptors than ulimit -n allows (%d)" % hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (2500, hard))
            self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))

        self.tmp = tempfile.mkdtemp(prefix="lcs", dir="/tmp")
        self.path = os.path.join(self.tmp, "s.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _SCALE_SERVER, self.path, "1000"], stdout=subprocess.PIPE, text=True
        )
        self.addCleanup(self.stop)
        self.assertEqual(run_with_timeout(self.proc.stdout.readline, 30), "ready\n")

    def stop(self):
        self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def measure(self, n, slot, limits):
        """Start ``n`` streams, wait until each has its first event (or, queued, its Queued), measure, let
        them finish; (bytes per stream, completions, Queued events per stream, server arrival order)."""

        async def main():
            async with lc.AsyncClient(self.path, limits=limits) as client:
                warm = []  # one stream first, so that what is made once per client is not counted
                task = asyncio.ensure_future(consume(client.stream(MSGS, slot=slot), warm))
                await until(lambda: warm, 10, "the warm-up stream")
                await client.request("POST", "/release?again")
                await task
                started = [0]
                queued = {}

                async def one(i):
                    events = queued[i] = []
                    async with client.stream([{"role": "user", "content": str(i)}], slot=slot) as stream:
                        async for ev in stream:
                            if not events:
                                started[0] += 1
                            events.append(ev)
                    return stream.completion.content

                gc.collect()
                tracemalloc.start()
                try:
                    base = tracemalloc.get_traced_memory()[0]
                    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
                    await until(lambda: started[0] == n, 120, "every stream's first event")
                    gc.collect()
                    per_stream = (tracemalloc.get_traced_memory()[0] - base) / n
                finally:
                    tracemalloc.stop()
                await client.request("POST", "/release")
                done = await asyncio.gather(*tasks)
                return per_stream, done, [[e for e in queued[i] if isinstance(e, lc.Queued)] for i in range(n)]

        return run_on_new_loop(self, main, 300, debug=False)

    def test_thousand_streams_in_flight(self):
        per_stream, done, queued = self.measure(1000, None, lc.Limits(poll=5.0, queue_len=8))
        print("\n    1,000 streams in flight: %.1f KiB each (tracemalloc)" % (per_stream / 1024), file=sys.stderr)
        self.assertEqual(done, ["w0 w1"] * 1000)
        self.assertEqual(queued, [[]] * 1000)  # a pool of 1,000 (total_slots): nobody queued
        self.assertLess(per_stream, self.STREAM_BOUND)

    def test_thousand_waiters_on_one_slot(self):
        # poll is longer than the test: a waiter hears Queued only when it enters, so a release must have
        # woken no waiter but the next (a woken waiter would have announced its shrunk position)
        per_waiter, done, queued = self.measure(1000, 0, lc.Limits(poll=600.0, queue_len=1000, busy_wait=600.0))
        print("\n    1,000 on one slot: %.1f KiB per waiter (tracemalloc)" % (per_waiter / 1024), file=sys.stderr)
        self.assertEqual(done, ["w0 w1"] * 1000)
        self.assertEqual(queued[0], [])
        self.assertEqual(queued[1:], [[lc.Queued(i)] for i in range(1, 1000)])
        self.assertLess(per_waiter, self.WAITER_BOUND)


# =====================================================================================================
# Tier 4. Faults: hostile servers, one test per row of the README's fault table, fuzz regressions
# =====================================================================================================

# -----------------------------------------------------------------------------------------------------
# Hostile servers and faults: one test per row of the README's fault table
# -----------------------------------------------------------------------------------------------------
#
# Every test runs against a FakeServer on a real socket, asserts the exact error class, that it came
# within its budget plus MARGIN (and, for a budget, not before it), and inherits ServerCase's check
# that descriptors and threads are back where they started.  Budgets are a fraction of a second so the
# whole tier stays quick; each slow case waits one short budget, never several.


_F_OK_BODY = content_stream(["Hello", " world"])


_F_SSE_HEAD = b"Content-Type: text/event-stream\r\n"


def _f_hold(req):
    """Accept the request and say nothing until the client leaves."""
    req.wait_peer_close(5)


def _f_sequence(*handlers):
    """A handler that answers the n-th request with the n-th handler (the last one repeats)."""
    calls = []
    lock = threading.Lock()

    def handler(req):
        with lock:
            n = len(calls)
            calls.append(n)
        handlers[min(n, len(handlers) - 1)](req)

    return handler


def _f_drip(pieces, interval, limit=4.0):
    """A handler that sends ``pieces`` (an iterable of bytes) one per ``interval`` until the client leaves
    (or ``limit`` seconds pass, so that a client that never gives up still ends)."""

    def handler(req):
        deadline = time.monotonic() + limit
        for piece in pieces:
            if time.monotonic() > deadline or req.server.stopping.is_set():
                return
            if not req.send(piece):
                return
            if interval:
                time.sleep(interval)  # the scripted server's pace

    return handler


def _f_chain(first, rest):
    yield first
    for piece in rest:
        yield piece


def _f_forever(piece):
    while True:
        yield piece


def _f_head(status=b"200 OK", headers=b"", version=b"HTTP/1.1"):
    return b"%s %s\r\nServer: llama.cpp\r\n%sConnection: close\r\n\r\n" % (version, status, headers)


def _f_error_json(code, message, etype):
    return json.dumps({"error": {"code": code, "message": message, "type": etype}}, separators=(",", ":"))


def _f_retry_after(value, status=503):
    doc = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    return json_response(doc, b"%d Service Unavailable" % status, b"Retry-After: %s\r\n" % value)


def _f_padded_line(size):
    """A ``data:`` line of exactly ``size`` bytes (without its newline) holding a valid content chunk."""
    base = b"data: " + chunk_json({"content": "x"}, extra={"pad": ""}).encode()
    line = b"data: " + chunk_json({"content": "x"}, extra={"pad": "p" * (size - len(base))}).encode()
    assert len(line) == size, len(line)
    return line


def _f_secret_free(test, key, exc):
    """Assert that ``key`` appears nowhere in an exception: message, repr, args, cause chain, traceback."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        texts = [str(exc), repr(exc)] + [repr(a) for a in exc.args]
        texts += [repr(v) for v in vars(exc).values()] if hasattr(exc, "__dict__") else []
        texts.append("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        for text in texts:
            test.assertNotIn(key, text)
        exc = exc.__cause__ or exc.__context__


class _f_Case(VirtualFactory, ServerCase):
    """ServerCase with small limits and helpers that time an outcome."""

    limits = FAST_FAULTS

    def _f_run(self, fn, timeout):
        events = self._f_events = []
        t = Timer()
        try:
            value = run_with_timeout(lambda: fn(events), timeout)
        except lc.LoopError as exc:
            value = exc
        return value, t.elapsed

    def _f_chat(self, slot=0, **params):
        return lambda events: self.client.chat(MSGS, slot=slot, on_event=events.append, **params)

    def _f_fails(self, cls, budget=0.0, fn=None, at_once=False, **params):
        """Run ``fn`` (a chat by default); assert it raised exactly ``cls`` within ``budget`` + margin, and
        (a budget error, unless ``at_once``) not before ``budget``.  Returns the error."""
        outcome, elapsed = self._f_run(fn or self._f_chat(**params), budget + 8.0)
        self.assertIs(type(outcome), cls, "expected %s, got %r" % (cls.__name__, outcome))
        after, early = (1e-6, 1e-6) if self.VIRTUAL else (lateness(self), EARLY)  # exact on the virtual clock
        self.assertLessEqual(
            elapsed, budget + after, "%s came after %.6f s (budget %.2f s)" % (cls.__name__, elapsed, budget)
        )
        if budget and not at_once:
            self.assertGreaterEqual(
                elapsed, budget - early, "%s came early: %.6f s (budget %.2f s)" % (cls.__name__, elapsed, budget)
            )
        return outcome

    def _f_succeeds(self, budget=0.0, fn=None, **params):
        outcome, elapsed = self._f_run(fn or self._f_chat(**params), budget + 8.0)
        if isinstance(outcome, BaseException):
            raise outcome
        self.assertLessEqual(elapsed, budget + (1e-6 if self.VIRTUAL else lateness(self)))
        return outcome

    def _f_kinds(self):
        return [type(e).__name__ for e in self._f_events]


# -- connecting ---------------------------------------------------------------------------------------


class TestFaultConnect(_f_Case):
    def _f_missing(self):
        return os.path.join(self.server.tmp, "missing.sock")

    def _f_stale(self):
        path = os.path.join(self.server.tmp, "stale.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.close()  # the file stays, nobody listens: connect() is refused
        return path

    def _f_at(self, address):
        self.client.close()
        self.client = self.new_client(address, limits=FAST_FAULTS)

    def test_socket_file_missing_stream(self):
        self._f_at(self._f_missing())
        err = self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait)
        self.assertIsInstance(err.__cause__, FileNotFoundError)
        self.assertIn("Retrying", self._f_kinds())

    def test_socket_file_missing_single_shot(self):
        self._f_at(self._f_missing())
        err = self._f_fails(lc.ConnectError, fn=lambda ev: self.client.slots())
        self.assertIsInstance(err.__cause__, FileNotFoundError)
        self.assertEqual(err.address, self._f_missing())

    def test_socket_file_without_listener_stream(self):
        self._f_at(self._f_stale())
        err = self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait)
        self.assertIsInstance(err.__cause__, ConnectionRefusedError)

    def test_socket_file_without_listener_single_shot(self):
        self._f_at(self._f_stale())
        err = self._f_fails(lc.ConnectError, fn=lambda ev: self.client.health())
        self.assertIsInstance(err.__cause__, ConnectionRefusedError)

    def test_eof_before_head_is_not_retried(self):
        self.use(lambda req: None)  # read the request, close without a byte
        self._f_fails(lc.StreamClosedError)
        self.assertEqual(len(self.server.chat_requests()), 1)


TestFaultConnectSockets, TestFaultConnectSocketsAsync = on_sockets(
    TestFaultConnect,
    "test_socket_file_missing_stream",
    "test_socket_file_without_listener_single_shot",
    "test_eof_before_head_is_not_retried",
)


class TestFaultReset(_f_Case):
    tcp = True

    def test_reset_before_head_is_not_retried(self):
        def reset(req):
            req.conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            req.conn.close()  # linger 0: RST instead of FIN

        self.use(reset)
        self._f_fails(lc.StreamClosedError)
        self.assertEqual(len(self.server.chat_requests()), 1)

    def test_reset_mid_stream_is_not_replayed(self):
        def reset(req):
            req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "Hi"}))))
            # the RST once the client has delivered the content (an RST may discard bytes still unread)
            wait_for(lambda: lc.Content("Hi") in self._f_events, 5, "the client to deliver the content")
            req.conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            req.conn.close()

        self.use(reset)
        self._f_fails(lc.StreamClosedError)
        self.assertEqual(self._f_kinds(), ["Content"])
        self.assertEqual(len(self.server.chat_requests()), 1)


TestFaultResetSockets, TestFaultResetSocketsAsync = on_sockets(
    TestFaultReset,
    "test_reset_before_head_is_not_retried",
    "test_reset_mid_stream_is_not_replayed",
)


# -- the response head --------------------------------------------------------------------------------


class TestFaultHead(_f_Case):
    def test_garbage_status_line(self):
        self.use(reply(b"HELLO THERE\r\nServer: x\r\n\r\n", hold=True))
        self._f_fails(lc.ProtocolError)

    def test_garbage_banner_then_silence(self):
        # A non-HTTP service on the socket (an SSH banner) that then waits for us: the first line is enough.
        self.use(reply(b"SSH-2.0-OpenSSH_9.6\r\n", hold=True))
        self._f_fails(lc.ProtocolError)

    def test_bad_status_code(self):
        self.use(reply(b"HTTP/1.1 2000 OK\r\n\r\n", hold=True))
        self._f_fails(lc.ProtocolError)

    def test_http2_preface_version(self):
        self.use(reply(b"HTTP/2 200\r\ncontent-type: text/event-stream\r\n\r\n", hold=True))
        self._f_fails(lc.ProtocolError)

    def test_http10_reply_is_accepted(self):
        body = sse(chunk_json({"content": "Hi"}), chunk_json({}, "stop")) + b"data: [DONE]\n\n"
        self.use(reply(b"HTTP/1.0 200 OK\r\n" + _F_SSE_HEAD + b"\r\n" + body))  # no length: until close
        done = self._f_succeeds()
        self.assertEqual((done.content, done.finish_reason), ("Hi", "stop"))

    def test_interim_response_then_stream(self):
        self.use(reply(b"HTTP/1.1 100 Continue\r\n\r\n" + STREAM_HEAD + _F_OK_BODY))
        self.assertEqual(self._f_succeeds().content, "Hello world")

    def test_ten_megabytes_of_headers(self):
        sent = {}

        def handler(req):
            sent["all"] = req.send(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (10 * 1024 * 1024) + b"\r\n\r\n")

        self.use(handler)
        self._f_fails(lc.ProtocolError)
        wait_for(lambda: "all" in sent, 5, "the server to stop sending")
        self.assertFalse(sent["all"], "the client read all 10 MB instead of stopping at the head cap")

    def test_thousand_header_lines(self):
        head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(1000)) + b"\r\n"
        self.use(reply(head + _F_OK_BODY, hold=True))
        self._f_fails(lc.ProtocolError)

    def test_nul_in_header(self):
        self.use(reply(b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nTransfer-Encoding: chunked\r\n\r\n" + _F_OK_BODY))
        self._f_fails(lc.ProtocolError)

    def test_folded_header_line(self):
        # unfolded into the value before it, as RFC 9112 section 5.2 asks of a user agent
        self.use(reply(b"HTTP/1.1 200 OK\r\nX-A: a\r\n  folded\r\nTransfer-Encoding: chunked\r\n\r\n" + _F_OK_BODY))
        self.assertEqual(self._f_succeeds().content, "Hello world")

    def test_eof_in_the_middle_of_the_head(self):
        self.use(reply(b"HTTP/1.1 200 OK\r\nContent-Ty"))
        self._f_fails(lc.StreamClosedError)

    def test_head_trickled_forever(self):
        # One header byte every 20 ms: never silent, never a head.  No progress for liveness: stalled.
        self.use(_f_drip(_f_chain(b"HTTP/1.1 200 OK\r\nX-Slow: ", _f_forever(b"a")), 0.02, limit=2.0))
        self._f_fails(lc.StalledError, FAST_FAULTS.liveness)

    def test_interim_responses_forever(self):
        # "100 Continue" heads forever: each is a whole head but none is the response.
        self.use(_f_drip(_f_forever(b"HTTP/1.1 100 Continue\r\n\r\n"), 0.02, limit=2.0))
        self._f_fails(lc.StalledError, FAST_FAULTS.liveness)


TestFaultHeadSockets, TestFaultHeadSocketsAsync = on_sockets(
    TestFaultHead,
    "test_garbage_banner_then_silence",
    "test_ten_megabytes_of_headers",
    "test_head_trickled_forever",
)


# -- body framing -------------------------------------------------------------------------------------


class TestFaultFraming(_f_Case):
    def _f_cl(self, *values):
        return b"HTTP/1.1 200 OK\r\n" + _F_SSE_HEAD + b"".join(b"Content-Length: %s\r\n" % v for v in values) + b"\r\n"

    def test_conflicting_content_length(self):
        self.use(reply(self._f_cl(b"10", b"20") + b"x" * 20, hold=True))
        self._f_fails(lc.ProtocolError)

    def test_conflicting_content_length_single_shot(self):
        self.server.route(
            "GET", "/slots", reply(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n[]")
        )
        self._f_fails(lc.ProtocolError, fn=lambda ev: self.client.slots())

    def test_negative_content_length(self):
        self.use(reply(self._f_cl(b"-1"), hold=True))
        self._f_fails(lc.ProtocolError)

    def test_non_numeric_content_length(self):
        self.use(reply(self._f_cl(b"12abc"), hold=True))
        self._f_fails(lc.ProtocolError)

    def test_unsupported_transfer_encoding(self):
        self.use(reply(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n" + _F_OK_BODY))
        self._f_fails(lc.ProtocolError)

    def test_chunk_size_ffffffffffffffff(self):
        # A size no signed 64-bit counter holds, followed by a whole stream: refused, not read as one chunk.
        inner = sse(chunk_json({"content": "Hi"}), chunk_json({}, "stop")) + b"data: [DONE]\n\n"
        self.use(serve_body(b"ffffffffffffffff\r\n" + inner))
        self._f_fails(lc.ProtocolError)

    def test_chunk_size_line_without_crlf(self):
        payload = sse(chunk_json({"content": "Hi"}))
        self.use(serve_body(b"%x" % len(payload) + payload, hold=True))  # size runs into the data
        self._f_fails(lc.ProtocolError)

    def test_chunk_size_line_never_ends(self):
        self.use(serve_body(b"1" + b"0" * 5000, hold=True))
        self._f_fails(lc.ProtocolError)

    def test_chunk_data_not_followed_by_crlf(self):
        payload = sse(chunk_json({"content": "Hi"}))
        self.use(serve_body(b"%x\r\n" % len(payload) + payload + b"XX" + b"0\r\n\r\n", hold=True))
        self._f_fails(lc.ProtocolError)

    def test_body_shorter_than_its_length_stream(self):
        body = sse(chunk_json({"content": "Hi"}))
        self.use(reply(self._f_cl(b"%d" % (len(body) + 500)) + body))
        self._f_fails(lc.StreamClosedError)
        self.assertEqual(self._f_kinds(), ["Content"])

    def test_body_shorter_than_its_length_single_shot(self):
        self.server.route("GET", "/slots", reply(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n[{"id":0'))
        self._f_fails(lc.StreamClosedError, fn=lambda ev: self.client.slots())

    def test_close_mid_chunk(self):
        payload = sse(chunk_json({"content": "Hi"}))
        self.use(serve_body(b"%x\r\n" % (len(payload) + 200) + payload))
        self._f_fails(lc.StreamClosedError)
        self.assertEqual(self._f_kinds(), ["Content"])

    def test_close_mid_event(self):
        # Close-delimited body: the last event never gets its blank line, so it is discarded.
        body = sse(chunk_json({"content": "Hi"})) + b"data: " + chunk_json({}, "stop").encode()
        self.use(reply(b"HTTP/1.1 200 OK\r\n" + _F_SSE_HEAD + b"\r\n" + body))
        self._f_fails(lc.StreamClosedError)
        self.assertEqual(self._f_kinds(), ["Content"])

    def test_close_after_finish_without_done_is_clean(self):
        self.use(serve_body(content_stream(["Hi"], done=False)))
        done = self._f_succeeds()
        self.assertEqual((done.content, done.finish_reason), ("Hi", "stop"))

    def test_done_then_connection_held(self):
        # [DONE] completes the response even if the server keeps the connection (and the final 0 chunk).
        body = chunked(sse(chunk_json({"content": "Hi"}), chunk_json({}, "stop")) + b"data: [DONE]\n\n")
        self.use(serve_body(body, hold=True))
        self.assertEqual(self._f_succeeds().content, "Hi")

    def test_html_page_with_200(self):
        page = b"<html><body>\n<h1>Welcome to nginx!</h1>\n</body></html>\n"
        self.use(
            reply(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s" % (len(page), page))
        )
        self._f_fails(lc.StreamClosedError)

    def test_done_without_finish_reason(self):
        self.use(serve_body(content_stream(["Hi"], finish=None)))
        self._f_fails(lc.StreamClosedError)

    def test_empty_chunked_body(self):
        self.use(serve_body(b"0\r\n\r\n"))
        self._f_fails(lc.StreamClosedError)

    def test_error_body_over_max_body(self):
        self.use(reply(b"HTTP/1.1 500 Internal Server Error\r\n\r\n" + b"e" * (FAST_FAULTS.max_body + 10)))
        self._f_fails(lc.ProtocolError)

    def test_single_shot_length_over_max_body(self):
        self.server.route(
            "GET",
            "/slots",
            reply(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (FAST_FAULTS.max_body + 1), hold=True),
        )
        self._f_fails(lc.ProtocolError, fn=lambda ev: self.client.slots())


TestFaultFramingSockets, TestFaultFramingSocketsAsync = on_sockets(
    TestFaultFraming,
    "test_close_mid_chunk",
    "test_done_then_connection_held",
    "test_single_shot_length_over_max_body",
)


# -- SSE lines and events -----------------------------------------------------------------------------


class TestFaultSSE(_f_Case):
    def test_two_mib_line_trickled(self):
        # A 2 MiB line sent one byte a millisecond, slot busy: ProtocolError as max_line is passed, long
        # before the line ends, with the client never holding more than max_line of it.  The error is timed
        # from the byte that took the line past max_line: the server's pace is the machine's (a sleep of a
        # millisecond takes longer on a busy one), the client's answer to that byte is the rule.
        self.client_with(max_line=1024, liveness=5.0, busy_wait=10.0)
        self.server.busy[0] = True
        sent, over = [0], []

        def handler(req):
            if not req.send(STREAM_HEAD + b"200000\r\n" + b"data: "):
                return
            deadline = time.monotonic() + 6
            while sent[0] < 2 * 1024 * 1024 and time.monotonic() < deadline:
                if sent[0] + 1 == 1024 - 6 + 1:  # with "data: ", the line is 1025 bytes: over max_line
                    over.append(time.monotonic())  # before the send: the client may answer it before it returns
                if not req.send(b"x"):
                    return
                sent[0] += 1
                time.sleep(0.001)  # the scripted server's pace: a byte at a time

        self.use(handler)
        self._f_fails(lc.ProtocolError, 4.0, at_once=True)  # long before the line ends (over 30 minutes)
        after = time.monotonic() - over[0]
        self.assertLessEqual(after, 1e-6 if self.VIRTUAL else MARGIN, "ProtocolError %.6f s after the cap" % after)
        self.assertLessEqual(sent[0], 1024 + 64, "the client read %d bytes of a line capped at 1024" % sent[0])

    def test_slow_line_without_event_hits_liveness(self):
        # Bytes trickle but no event completes for liveness, the slot is idle: a stuck stream.
        self.use(_f_drip(_f_chain(STREAM_HEAD + b"100000\r\ndata: ", _f_forever(b"x")), 0.02))
        self._f_fails(lc.StalledError, FAST_FAULTS.liveness)

    def test_line_of_max_line_exactly(self):
        line = _f_padded_line(FAST_FAULTS.max_line)
        self.use(serve_body(chunked(line + b"\n\n") + content_stream(["!"], role=False)))
        done = self._f_succeeds()
        self.assertEqual(done.content, "x!")

    def test_line_of_max_line_plus_one(self):
        line = _f_padded_line(FAST_FAULTS.max_line + 1)
        self.use(serve_body(chunked(line + b"\n\n") + content_stream(["!"], role=False)))
        self._f_fails(lc.ProtocolError)

    def test_event_over_max_line_in_many_data_lines(self):
        self.use(serve_body(chunked(b"data: xx\n" * 2000 + b"\n"), hold=True))
        self._f_fails(lc.ProtocolError)

    def test_half_million_empty_data_lines(self):
        # 512 Ki + 2 empty "data:" lines in one event, max_line 512 KiB: ProtocolError, in linear time
        # (joining the lines one += at a time took seconds; at the default 1 MiB, 15 s).
        self.client_with(max_line=512 * 1024, liveness=30.0)
        body = b"data:\n" * (512 * 1024 + 2) + b"\n"
        self.use(reply(b"HTTP/1.1 200 OK\r\n" + _F_SSE_HEAD + b"\r\n" + body))
        self._f_fails(lc.ProtocolError, 1.0 * TRACED, at_once=True)  # CPU-bound: allow for a line tracer

    def test_invalid_utf8_is_replaced(self):
        raw = sse(chunk_json({"content": "AB"})).replace(b"AB", b"A\xff\xfeB")
        self.use(serve_body(chunked(raw) + content_stream(["!"], role=False)))
        done = self._f_succeeds()
        self.assertEqual(done.content, "A\ufffd\ufffdB!")

    def test_utf8_split_between_reads(self):
        raw = sse(chunk_json({"content": "é€"}, extra=None).replace("\\u00e9\\u20ac", "é€"))
        cut = raw.index("é".encode()) + 1
        pieces = [STREAM_HEAD + chunked(raw[:cut]), chunked(raw[cut:]), content_stream(["!"], role=False)]
        self.use(_f_drip(pieces, 0.02))
        done = self._f_succeeds(0.2)
        self.assertEqual(done.content, "é€!")

    def test_nul_byte_in_data(self):
        raw = sse(chunk_json({"content": "AB"})).replace(b"AB", b"A\x00B")
        self.use(serve_body(chunked(raw) + content_stream(["!"], role=False)))
        self._f_fails(lc.ProtocolError)


TestFaultSSESockets, TestFaultSSESocketsAsync = on_sockets(
    TestFaultSSE,
    "test_two_mib_line_trickled",
    "test_utf8_split_between_reads",
)


# -- JSON payloads ------------------------------------------------------------------------------------


class TestFaultJSON(_f_Case):
    def _f_payload(self, payload):
        self.use(serve_body(chunked(sse(payload)) + content_stream(["!"]), hold=True))
        return self._f_fails(lc.ProtocolError)

    def test_invalid_json(self):
        self._f_payload('{"choices":[{"delta":{"content":"Hi"')

    def test_json_not_an_object(self):
        self._f_payload('["choices"]')

    def test_choices_not_a_list(self):
        self._f_payload('{"choices":{"0":{"index":0,"delta":{"content":"Hi"}}},"id":"x"}')

    def test_delta_is_a_string(self):
        self._f_payload('{"choices":[{"index":0,"finish_reason":null,"delta":"Hi"}],"id":"x"}')

    def test_tool_call_delta_without_index(self):
        self._f_payload(
            chunk_json({"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]})
        )

    def test_deeply_nested_json(self):
        self.client_with(max_line=1024 * 1024)
        self._f_payload('{"choices":' + "[" * 200000 + "]" * 200000 + "}")

    def test_error_code_not_a_decimal(self):
        # fuzz: {"code":"²"} passed str.isdigit() and broke int(): a bare ValueError escaped.
        self.use(serve_body(chunked(sse('{"error":{"code":"\u00b2","message":"x","type":"server_error"}}'))))
        err = self._f_fails(lc.ServerError)
        self.assertIsNone(err.code)


TestFaultJSONSockets, TestFaultJSONSocketsAsync = on_sockets(
    TestFaultJSON,
    "test_invalid_json",
)


# -- silence, pings and the liveness rule -------------------------------------------------------------


class TestFaultWaits(_f_Case):
    def _f_pings(self):
        return _f_drip(_f_chain(STREAM_HEAD, _f_forever(chunked(b": ping\n\n"))), 0.05)

    def test_pings_forever_idle_slot(self):
        self.use(self._f_pings())
        self._f_fails(lc.StalledError, FAST_FAULTS.liveness)

    def test_pings_forever_processing_slot(self):
        self.server.busy[0] = True
        self.use(self._f_pings())
        self._f_fails(lc.StalledError, FAST_FAULTS.busy_wait)

    def test_stall_before_head_idle_slot(self):
        self.use(_f_hold)
        self._f_fails(lc.StalledError, FAST_FAULTS.idle_grace)
        self.assertIn("Waiting", self._f_kinds())

    def test_stall_before_head_busy_slot(self):
        self.server.busy[0] = True
        self.use(_f_hold)
        self._f_fails(lc.WaitTimeoutError, FAST_FAULTS.busy_wait)
        self.assertTrue(all(e.slot_busy for e in self._f_events if isinstance(e, lc.Waiting)))

    def test_stall_mid_stream(self):
        self.use(serve_body(chunked(sse(chunk_json({"content": "Hi"}))), hold=True))
        self._f_fails(lc.StalledError, FAST_FAULTS.liveness)
        self.assertEqual(self._f_kinds(), ["Content"])

    def test_stall_mid_head(self):
        self.use(reply(b"HTTP/1.1 200 OK\r\nContent-Type: text/ev", hold=True))
        self._f_fails(lc.StalledError, FAST_FAULTS.liveness)


TestFaultWaitsSockets, TestFaultWaitsSocketsAsync = on_sockets(
    TestFaultWaits,
    "test_pings_forever_processing_slot",
    "test_stall_before_head_idle_slot",
    "test_stall_mid_stream",
)


# -- error statuses and error events ------------------------------------------------------------------


class TestFaultErrors(_f_Case):
    def test_http_503_forever(self):
        self.use(
            lambda req: respond_json(
                req,
                {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
                503,
                "Service Unavailable",
            )
        )
        self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait)
        self.assertGreaterEqual(len(self.server.chat_requests()), 2)

    def test_http_400_prompt_too_long(self):
        self.use(
            lambda req: respond_json(
                req,
                {
                    "error": {
                        "code": 400,
                        "message": "the request exceeds the available context size",
                        "type": "exceed_context_size_error",
                    }
                },
                400,
                "Bad Request",
            )
        )
        err = self._f_fails(lc.HTTPStatusError)
        self.assertEqual((err.status, err.message), (400, "the request exceeds the available context size"))

    def test_error_status_body_stalls(self):
        # fuzz (client target): a 400 whose body stops short of its Content-Length on a held connection.
        self.use(
            reply(
                b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 116\r\n\r\n-1",
                hold=True,
            )
        )
        self._f_fails(lc.StalledError, FAST_FAULTS.liveness)

    def test_error_body_deeply_nested(self):
        # fuzz (http target): json.loads of the error envelope raised RecursionError.
        body = b'{"error":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"
        self.use(reply(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)))
        err = self._f_fails(lc.HTTPStatusError)
        self.assertEqual(err.status, 400)

    def test_http_500_html_body(self):
        self.use(reply(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 17\r\n\r\n<h1>oops</h1>\r\n\r\n"))
        err = self._f_fails(lc.HTTPStatusError)
        self.assertEqual((err.status, err.message, err.body), (500, "oops", b"<h1>oops</h1>\r\n\r\n"))
        self.assertEqual(str(err), "HTTP 500: oops")  # no Server header, and a status llama-server sends

    def test_error_event_first_503_is_retried(self):
        event = STREAM_HEAD + chunked(sse(_f_error_json(503, "Loading model", "unavailable_error"))) + b"0\r\n\r\n"
        self.use(_f_sequence(reply(event), serve_body(_F_OK_BODY)))
        done = self._f_succeeds(0.25)
        self.assertEqual(done.content, "Hello world")
        self.assertEqual(self._f_kinds()[:1], ["Retrying"])

    def test_error_event_first_503_forever(self):
        event = STREAM_HEAD + chunked(sse(_f_error_json(503, "Loading model", "unavailable_error"))) + b"0\r\n\r\n"
        self.use(reply(event))
        self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait)
        self.assertGreaterEqual(len(self.server.chat_requests()), 2)

    def test_error_event_first_400(self):
        self.use(
            reply(STREAM_HEAD + chunked(sse(_f_error_json(400, "bad grammar", "invalid_request_error"))) + b"0\r\n\r\n")
        )
        err = self._f_fails(lc.ServerError)
        self.assertEqual((err.code, err.message), (400, "bad grammar"))
        self.assertEqual(len(self.server.chat_requests()), 1)

    def test_error_event_after_content(self):
        body = (
            chunked(sse(chunk_json({"content": "Hi"}), _f_error_json(503, "slot gone", "unavailable_error")))
            + b"0\r\n\r\n"
        )
        self.use(serve_body(body))
        err = self._f_fails(lc.ServerError)
        self.assertEqual(err.code, 503)
        self.assertEqual(len(self.server.chat_requests()), 1, "delivered output must never be replayed")

    def test_legacy_error_line(self):
        body = (
            chunked(
                sse(chunk_json({"content": "Hi"})) + b'error: {"code":500,"message":"boom","type":"server_error"}\n\n'
            )
            + b"0\r\n\r\n"
        )
        self.use(serve_body(body))
        err = self._f_fails(lc.ServerError)
        self.assertEqual((err.code, err.message), (500, "boom"))

    def test_legacy_error_line_deeply_nested(self):
        # fuzz (http target): the legacy payload went through json.loads, whose RecursionError escaped.
        self.client_with(max_line=1024 * 1024)
        self.use(serve_body(chunked(b"error: " + b"[" * 100000 + b"]" * 100000 + b"\n\n") + b"0\r\n\r\n"))
        self._f_fails(lc.ServerError)

    def test_legacy_error_line_first_503_is_retried(self):
        legacy = (
            STREAM_HEAD
            + chunked(b'error: {"code":503,"message":"Loading model","type":"unavailable_error"}\n\n')
            + b"0\r\n\r\n"
        )
        self.use(_f_sequence(reply(legacy), serve_body(_F_OK_BODY)))
        done = self._f_succeeds(0.25)
        self.assertEqual(done.content, "Hello world")
        self.assertEqual(len(self.server.chat_requests()), 2)


TestFaultErrorsSockets, TestFaultErrorsSocketsAsync = on_sockets(
    TestFaultErrors,
    "test_http_503_forever",
    "test_error_status_body_stalls",
)


# -- Retry-After --------------------------------------------------------------------------------------


class TestFaultRetryAfter(_f_Case):
    def _f_then_ok(self, value):
        self.use(_f_sequence(reply(_f_retry_after(value)), serve_body(_F_OK_BODY)))

    def _f_delays(self):
        return [e.delay for e in self._f_events if isinstance(e, lc.Retrying)]

    def test_date_beyond_load_wait(self):
        self.use(reply(_f_retry_after(email.utils.formatdate(time.time() + 5, usegmt=True).encode())))
        self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait, at_once=True)
        self.assertEqual(self._f_delays(), [])

    def test_date_in_the_past(self):
        # A hint of 0 s is honoured by not waiting longer; the backoff still applies, or this is a busy loop.
        self._f_then_ok(email.utils.formatdate(time.time() - 60, usegmt=True).encode())
        self._f_succeeds(0.25)
        self.assertEqual(len(self._f_delays()), 1)
        self.assertTrue(0.18 <= self._f_delays()[0] <= 0.25, self._f_delays())

    def test_zero_forever(self):
        # "Retry-After: 0" on every answer: retried at the backoff's pace, not hundreds of times a second.
        self.use(reply(_f_retry_after(b"0")))
        self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait)
        self.assertLessEqual(len(self.server.chat_requests()), 4)

    def test_negative(self):
        self._f_then_ok(b"-5")
        self._f_succeeds(0.25)
        self.assertEqual(len(self._f_delays()), 1)
        self.assertTrue(0.18 <= self._f_delays()[0] <= 0.25, self._f_delays())  # backoff, not the hint

    def test_malformed(self):
        self._f_then_ok(b"soon")
        self._f_succeeds(0.25)
        self.assertTrue(0.18 <= self._f_delays()[0] <= 0.25, self._f_delays())

    def test_huge(self):
        self.use(reply(_f_retry_after(b"99999999999999999999")))
        self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait, at_once=True)
        self.assertEqual(self._f_delays(), [])

    def test_huge_past_float_range(self):
        # 400 digits: float(int(...)) raised a bare OverflowError.
        self.use(reply(_f_retry_after(b"9" * 400)))
        self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait, at_once=True)

    def test_huge_past_int_digit_limit(self):
        # 5000 digits: int() refuses strings over 4300 digits with a bare ValueError.
        self.use(reply(_f_retry_after(b"9" * 5000)))
        self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait, at_once=True)


TestFaultRetryAfterSockets, TestFaultRetryAfterSocketsAsync = on_sockets(
    TestFaultRetryAfter,
    "test_zero_forever",
)


# -- /slots -------------------------------------------------------------------------------------------


class TestFaultSlots(_f_Case):
    def test_slots_garbage_while_waiting(self):
        self.server.route("GET", "/slots", reply(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!"))
        self.use(_f_hold)
        self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait)
        self.assertTrue(all(not e.slot_busy for e in self._f_events if isinstance(e, lc.Waiting)))

    def test_slots_garbage_single_shot(self):
        self.server.route("GET", "/slots", reply(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!"))
        self._f_fails(lc.ProtocolError, fn=lambda ev: self.client.slots())

    def test_slots_wrong_shape_single_shot(self):
        self.server.route("GET", "/slots", lambda req: respond_json(req, [{"id": "0", "is_processing": "yes"}]))
        self._f_fails(lc.ProtocolError, fn=lambda ev: self.client.slots())

    def test_slots_hanging_while_waiting(self):
        self.server.route("GET", "/slots", _f_hold)
        self.use(_f_hold)
        self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait)

    def test_slots_hanging_single_shot(self):
        self.server.route("GET", "/slots", _f_hold)
        self._f_fails(lc.StalledError, FAST_FAULTS.liveness, fn=lambda ev: self.client.slots())

    def test_slots_501_while_waiting(self):
        not_supported = {
            "error": {
                "code": 501,
                "message": "This server does not support slots endpoint.",
                "type": "not_supported_error",
            }
        }
        self.server.route("GET", "/slots", lambda req: respond_json(req, not_supported, 501, "Not Implemented"))
        self.use(_f_hold)
        self._f_fails(lc.WaitTimeoutError, FAST_FAULTS.busy_wait)  # not served: the slots cannot be seen

    def test_slots_501_single_shot(self):
        not_supported = {
            "error": {
                "code": 501,
                "message": "This server does not support slots endpoint.",
                "type": "not_supported_error",
            }
        }
        self.server.route("GET", "/slots", lambda req: respond_json(req, not_supported, 501, "Not Implemented"))
        err = self._f_fails(lc.HTTPStatusError, fn=lambda ev: self.client.slots())
        self.assertEqual((err.status, err.message), (501, "This server does not support slots endpoint."))

    def test_props_not_an_object(self):
        self.server.route("GET", "/props", lambda req: respond_json(req, [1, 2]))
        self._f_fails(lc.ProtocolError, fn=lambda ev: self.client.props())


TestFaultSlotsSockets, TestFaultSlotsSocketsAsync = on_sockets(
    TestFaultSlots,
    "test_slots_hanging_while_waiting",
    "test_slots_garbage_single_shot",
)


# -- behind proxies and balancers: 429, an unseen /slots, the pool's size -----------------------------


def _f_too_many(retry_after=None):
    """llama-swap's answer at its per-model concurrency limit."""
    body = _f_error_json(429, "too many requests for model m1", "rate_limit_error").encode()
    hint = b"Retry-After: %s\r\n" % retry_after if retry_after is not None else b""
    return (
        b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json; charset=utf-8\r\n%s"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (hint, len(body), body)
    )


class TestFaultProxies(_f_Case):
    def _f_retries(self):
        return [e for e in self._f_events if isinstance(e, lc.Retrying)]

    def test_429_with_and_without_retry_after_is_retried_then_served(self):
        for hint in (None, b"0"):
            with self.subTest(retry_after=hint):
                self.use(
                    _f_sequence(reply(_f_too_many(hint)), reply(_f_too_many(hint)), reply(STREAM_HEAD + _F_OK_BODY))
                )
                done = self._f_succeeds(2 * lc.BACKOFF_FIRST + lc.BACKOFF_MAX)
                self.assertEqual(done.content, "Hello world")
                retries = self._f_retries()
                self.assertEqual([r.attempt for r in retries], [1, 2])
                self.assertEqual({r.reason for r in retries}, {"HTTP 429: too many requests for model m1"})
                self.assertEqual(self._f_kinds()[:2], ["Retrying", "Retrying"])
                self.server.requests.clear()

    def test_429_past_busy_wait_is_a_wait_timeout_naming_the_429(self):
        self.client_with(busy_wait=0.8, load_wait=0.3)  # the wrong budget would end it far earlier
        self.use(reply(_f_too_many(b"0")))
        exc = self._f_fails(lc.WaitTimeoutError, 0.8)
        self.assertIn("answered 429 (at capacity)", str(exc))
        self.assertIn("(busy_wait)", str(exc))
        self.assertIsInstance(exc.__cause__, lc.HTTPStatusError)
        self.assertEqual(exc.__cause__.status, 429)

    def test_a_429_hint_past_busy_wait_ends_the_wait_at_once(self):
        self.use(reply(_f_too_many(b"30")))
        self._f_fails(lc.WaitTimeoutError, FAST_FAULTS.busy_wait, at_once=True)
        self.assertEqual(self._f_retries(), [])

    def test_slots_not_served_while_waiting_counts_under_busy_wait(self):
        for status, reason in ((404, b"Not Found"), (403, b"Forbidden"), (405, b"Method Not Allowed"), (501, b"x")):
            with self.subTest(status=status):
                self.server.route(
                    "GET",
                    "/slots",
                    lambda req, s=status, r=reason: respond_json(
                        req, {"error": {"code": s, "message": "no slots here", "type": "x"}}, s, r.decode()
                    ),
                )
                self.client_with(busy_wait=0.8, load_wait=0.3, idle_grace=0.3)
                self.use(_f_hold)
                before = sum(1 for r in self.server.requests if r.path == "/slots")
                exc = self._f_fails(lc.WaitTimeoutError, 0.8)
                self.assertIn("does not serve /slots", str(exc))
                waits = [e for e in self._f_events if isinstance(e, lc.Waiting)]
                self.assertTrue(waits)
                self.assertEqual(set(waits), {lc.Waiting(False, slots_known=False)})
                # asked once: a /slots that is not served is asked again at most every 30 s
                self.assertEqual(sum(1 for r in self.server.requests if r.path == "/slots") - before, 1)

    def test_an_unseen_slot_is_never_wedged(self):
        self.server.route("GET", "/slots", lambda req: respond_json(req, {"error": {"code": 404}}, 404, "Not Found"))
        self.client_with(busy_wait=0.6, wedge_wait=0.1)
        self.use(_f_hold)
        self._f_fails(lc.WaitTimeoutError, 0.6)
        self.assertFalse(any(isinstance(e, lc.Waiting) and e.wedged for e in self._f_events))

    def test_limits_pool_sizes_the_pool_without_asking_props(self):
        client = self.client_with(pool=3)
        keeper = Gatekeeper(self.server)
        events, results = {}, {}
        threads = [start_chat(client, m, None, events, results) for m in "ABC"]
        wait_for(lambda: all(keeper.arrived(m) for m in "ABC"), what="three in flight at once")
        fourth = start_chat(client, "D", None, events, results)
        wait_for(lambda: events["D"], what="D queued")
        self.assertEqual(events["D"], [lc.Queued(3)])
        for marker in "ABCD":
            keeper.release(marker)
        for thread in threads + [fourth]:
            thread.join(5)
        self.assertEqual([results[m].content for m in "ABCD"], list("ABCD"))
        self.assertEqual([r for r in self.server.requests if r.path == "/props"], [])

    def test_props_without_total_slots_is_a_pool_of_four(self):
        self.server.route("GET", "/props", lambda req: respond_json(req, {"role": "balancer"}))
        keeper = Gatekeeper(self.server)
        events, results = {}, {}
        threads = [start_chat(self.client, m, None, events, results) for m in "ABCD"]
        wait_for(lambda: all(keeper.arrived(m) for m in "ABCD"), what="four in flight at once")
        fifth = start_chat(self.client, "E", None, events, results)
        wait_for(lambda: events["E"], what="E queued")
        self.assertEqual(events["E"], [lc.Queued(4)])
        for marker in "ABCDE":
            keeper.release(marker)
        for thread in threads + [fifth]:
            thread.join(5)
        self.assertEqual(sorted(results[m].content for m in "ABCDE"), list("ABCDE"))


TestFaultProxiesSockets, TestFaultProxiesSocketsAsync = on_sockets(
    TestFaultProxies,
    "test_429_with_and_without_retry_after_is_retried_then_served",
    "test_limits_pool_sizes_the_pool_without_asking_props",
)


# -- the reasoning control endpoint -------------------------------------------------------------------


class TestFaultControl(_f_Case):
    limits = FAST_FAULTS.replace(thinking_cap=2)

    def setUp(self):
        super().setUp()
        reasoning = [chunk_json({"reasoning_content": w}) for w in ("a", "b", "c")]
        self.use(serve_body(chunked(sse(*reasoning)), hold=True))

    def _f_control(self, handler):
        self.server.route("POST", "/v1/chat/completions/control", handler)

    def test_control_404(self):
        self._f_control(
            lambda req: respond_json(
                req, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}, 404, "Not Found"
            )
        )
        err = self._f_fails(lc.ThinkingOverrunError)
        self.assertIsInstance(err.__cause__, lc.HTTPStatusError)
        self.assertEqual(err.tokens, 2)

    def test_control_404_single_shot(self):
        err = self._f_fails(lc.HTTPStatusError, fn=lambda ev: self.client.end_reasoning(CID))  # no route: 404
        self.assertEqual(err.status, 404)

    def test_control_success_false(self):
        self._f_control(lambda req: respond_json(req, {"success": False}))
        self._f_fails(lc.ThinkingOverrunError)
        self.assertEqual(self._f_kinds(), ["Reasoning", "Reasoning"])

    def test_control_success_false_single_shot(self):
        self._f_control(lambda req: respond_json(req, {"success": False}))
        self.assertIs(self._f_succeeds(fn=lambda ev: self.client.end_reasoning(CID)), False)

    def test_control_hanging(self):
        self._f_control(_f_hold)
        err = self._f_fails(lc.ThinkingOverrunError, FAST_FAULTS.liveness)
        self.assertIsInstance(err.__cause__, lc.StalledError)


TestFaultControlSockets, TestFaultControlSocketsAsync = on_sockets(
    TestFaultControl,
    "test_control_hanging",
)


# -- resumable streams: a lost connection resumed from the server's buffer ----------------------------


def _r_dechunk(raw):
    """A recorded chunked response: its head (with the blank line) and its body, one piece per HTTP chunk."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    pieces = []
    while True:
        line, _, rest = rest.partition(b"\r\n")
        size = int(line, 16)
        if not size:
            return head + b"\r\n\r\n", pieces
        pieces.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]


def _r_block_ends(body):
    """The body offsets where an event block ends (just after its blank line)."""
    ends, at = [], 0
    while True:
        at = body.find(b"\n\n", at)
        if at < 0:
            return ends
        at += 2
        ends.append(at)


class _r_Routes(dict):
    """FakeServer's routes, looked up without the query string (GET /v1/stream?conv_id=...&from=...)."""

    def get(self, key, default=None):
        method, path = key
        return super().get((method, path.partition("?")[0]), default)


_R_GONE = json.dumps({"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}).encode()


class _r_Buffer:
    """llama-server's resumable streams, on a FakeServer: the streamed POST at ``path`` is answered with a
    recorded response (its body kept as the stream's buffer, under its X-Conversation-Id); GET /v1/stream
    replays the de-chunked body from ``from`` (a chunked 200 text/event-stream, the recorded chunks cut at
    ``from``), POST /v1/streams/lookup and DELETE /v1/stream answer as the server does (76, 77).

    ``cuts``: for the streamed connections in order (the POST, then each GET), what each does: None sends
    it whole; ``K`` sends its first K raw bytes and closes; ``("hold", K)`` sends K bytes and then says
    nothing until the client leaves; ``("wait", K, event)`` sends K bytes and the rest once ``event`` is
    set (or the client leaves).  ``log``: (method, conversation id, from) of every request, in order."""

    def __init__(self, server, raw, path="/v1/chat/completions", cuts=()):
        self.server = server
        self.head, self.pieces = _r_dechunk(raw)
        self.body = b"".join(self.pieces)
        self.raw = self.head + chunked(*self.pieces) + b"0\r\n\r\n"
        self.cuts = list(cuts)
        self.lock = threading.Lock()
        self.log = []
        self.ids = set()
        self.replay_answer = None  # bytes: every GET is answered with them (a 404, a 400)
        self.register_lost_head = True  # a POST cut before its head still runs (87)
        self.on_delete = None  # called (in the server's thread) before DELETE is answered
        self.deleted_while = []  # what on_delete returned, per DELETE
        server.routes = _r_Routes(server.routes)
        server.route("POST", path, self.post)
        server.route("GET", "/v1/stream", self.get)
        server.route("POST", "/v1/streams/lookup", self.lookup)
        server.route("DELETE", "/v1/stream", self.delete)

    def reset(self, cuts=()):
        with self.lock:
            self.cuts = list(cuts)
            self.log = []
            self.ids = set()
            self.deleted_while = []

    def methods(self):
        with self.lock:
            return [entry[0] for entry in self.log]

    def replays(self):
        with self.lock:
            return [entry[2] for entry in self.log if entry[0] == "GET"]

    def _query(self, req):
        query = dict(urllib.parse.parse_qsl(req.path.partition("?")[2]))
        return query.get("conv_id"), query.get("from")

    def _send(self, req, data):
        with self.lock:
            cut = self.cuts.pop(0) if self.cuts else None
        if cut is None:
            req.send(data)
        elif isinstance(cut, int):
            req.send(data[:cut])
        elif cut[0] == "hold":
            req.send(data[: cut[1]])
            req.wait_peer_close(10)
        elif cut[0] == "answer":  # this connection is answered with other bytes (a 503 while restarting)
            req.send(cut[1])
        elif cut[0] == "pause":  # K bytes, then the rest paced over ``seconds``, then cut after ``end`` bytes
            _, at, seconds, end = cut
            req.send(data[:at])
            step = max(1, (end - at) // 20)
            for i in range(at, end, step):
                if req.closed_by_peer.wait(seconds / 20):
                    return cut
                req.send(data[i : min(i + step, end)])
        else:
            req.send(data[: cut[1]])
            deadline = time.monotonic() + 10
            while not cut[2].is_set() and time.monotonic() < deadline:
                if req.wait_peer_close(0.01):
                    return cut
            req.send(data[cut[1] :])
        return cut

    def post(self, req):
        conv = req.headers.get("x-conversation-id")
        with self.lock:
            self.log.append(("POST", conv, None))
            lost_head = self.cuts and self.cuts[0] == 0
            if conv is not None and (self.register_lost_head or not lost_head):
                self.ids.add(conv)
        self._send(req, self.raw)

    def get(self, req):
        conv, start = self._query(req)
        with self.lock:
            self.log.append(("GET", conv, int(start)))
            known = conv in self.ids
            answer = self.replay_answer
        if answer is not None:
            req.send(answer)
        elif not known:
            req.send(http_response(_R_GONE, status=b"404 Not Found"))
        else:
            offset, at, pieces = int(start), 0, []
            for piece in self.pieces:
                if at + len(piece) > offset:
                    pieces.append(piece[max(offset - at, 0) :])
                at += len(piece)
            self._send(req, STREAM_HEAD + chunked(*pieces) + b"0\r\n\r\n")

    def lookup(self, req):
        wanted = req.json()["conversation_ids"]
        with self.lock:
            self.log.append(("LOOKUP", tuple(wanted), None))
            found = [c for c in wanted if c in self.ids]
        doc = [
            {"conversation_id": c, "is_done": True, "total_bytes": len(self.body), "started_at": 1, "completed_at": 2}
            for c in found
        ]
        respond_json(req, doc)

    def delete(self, req):
        conv, _ = self._query(req)
        seen = self.on_delete() if self.on_delete is not None else None
        with self.lock:
            self.log.append(("DELETE", conv, None))
            self.deleted_while.append(seen)
            self.ids.discard(conv)
        req.send(
            b"HTTP/1.1 204 No Content\r\nServer: llama.cpp\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: 0\r\n\r\n"
        )


#: Recorded streams, per endpoint: (transcript, the client call that makes that request).
_R_STREAMS = {
    "chat plain": ("04_chat_stream.raw.txt", "chat"),
    "chat usage": ("06_chat_stream_include_usage.raw.txt", "chat"),
    "chat reasoning": ("14_reasoning_grammar.raw.txt", "chat"),
    "chat tool call": ("18_tools_required_stream.raw.txt", "chat"),
    "completion": ("40_completion_stream_tokens_probs.raw.txt", "complete"),
    "responses": ("50_responses_stream.raw.txt", "respond"),
    "messages": ("60_messages_stream.raw.txt", "message"),
}


_R_PATHS = {
    "chat": "/v1/chat/completions",
    "complete": "/completion",
    "respond": "/v1/responses",
    "message": "/v1/messages",
}


def _r_utf8_stream():
    """A short chat stream whose contents hold two-, three- and four-byte UTF-8 characters, unescaped as
    llama-server writes them."""
    payloads = [chunk_json({"role": "assistant", "content": None})]
    payloads += [chunk_json({"content": word}) for word in ("Grüße", " 日本", " 🌊")]
    payloads.append(chunk_json({}, "stop"))
    raw = [json.dumps(json.loads(p), ensure_ascii=False, separators=(",", ":")) for p in payloads]
    return STREAM_HEAD + chunked(*(sse(p) for p in raw), b"data: [DONE]\n\n") + b"0\r\n\r\n"


class TestFaultResume(_f_Case):
    """Resumable streams: a connection lost after the head is resumed from the server's buffer, never sent
    again; the events (less ``Resumed``) and the ``Completion`` are those of the uncut stream."""

    #: no wait is under test here but liveness: a slow machine must not turn a late head into an error
    limits = FAST_FAULTS.replace(poll=1.0, liveness=2.0, idle_grace=5.0, busy_wait=5.0)

    def _r_buffer(self, raw, call="chat", cuts=()):
        return _r_Buffer(self.server, raw, _R_PATHS[call], cuts)

    def _r_call(self, call="chat", client=None, timeout=10, **params):
        client = client or self.client
        first = "hi" if call in ("complete", "respond") else MSGS
        params.setdefault("resumable", "conv-1")
        params.setdefault("slot", 0)
        if call == "message":
            params.setdefault("max_tokens", 64)
        events = []
        completion = run_with_timeout(lambda: getattr(client, call)(first, on_event=events.append, **params), timeout)
        return completion, events

    def _r_cuts_equal(self, name, offsets=None, sample=None):
        """For each cut offset (every offset of the response, or ``sample`` of them plus the chunk-size lines
        and block ends): the events less Resumed and the Completion equal the uncut stream's."""
        transcript, call = _R_STREAMS[name]
        buf = self._r_buffer(load_transcript(transcript), call)
        whole, whole_events = self._r_call(call)
        self.assertEqual(buf.methods(), ["POST"])
        self.assertNotIn("Resumed", [type(e).__name__ for e in whole_events])
        raw = buf.raw
        if offsets is None:
            offsets = range(len(raw))
            if sample is not None:
                hot = {len(buf.head) - 1, len(buf.head), len(buf.head) + 1}
                at = len(buf.head)
                for piece in buf.pieces:
                    hot.update((at, at + 1, at + 2))  # in the size line
                    at += len(b"%x\r\n" % len(piece)) + len(piece)
                    hot.update((at - 1, at, at + 1, at + 2))  # a block end, and the CRLF after it
                    at += 2
                rng = random.Random(name)
                offsets = sorted(hot | set(rng.sample(range(len(raw)), sample)))
        for cut in offsets:
            buf.reset([cut])
            completion, events = self._r_call(call)
            resumed = [e for e in events if isinstance(e, lc.Resumed)]
            self.assertEqual([e for e in events if not isinstance(e, lc.Resumed)], whole_events, "cut at %d" % cut)
            self.assertEqual(completion, whole, "cut at %d" % cut)
            self.assertEqual(buf.replays(), [e.offset for e in resumed], "cut at %d" % cut)
            self.assertEqual(buf.methods().count("POST"), 1, "cut at %d: the request was sent again" % cut)
            self.assertLessEqual(len(resumed), 1)
            if cut <= len(raw) - len(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                self.assertEqual(len(resumed), 1, "cut at %d was not resumed" % cut)
        return buf, whole, whole_events

    # -- every cut offset, every endpoint ---------------------------------------------------------------

    def test_every_cut_of_a_recorded_messages_stream(self):
        self._r_cuts_equal("messages")

    def test_every_cut_of_a_recorded_tool_call_stream(self):
        self._r_cuts_equal("chat tool call")

    def test_cuts_of_a_recorded_plain_chat(self):
        self._r_cuts_equal("chat plain", sample=150)

    def test_cuts_of_a_recorded_chat_with_usage(self):
        self._r_cuts_equal("chat usage", sample=150)

    def test_cuts_of_a_recorded_chat_with_reasoning(self):
        _, whole, _ = self._r_cuts_equal("chat reasoning", sample=150)
        self.assertTrue(whole.reasoning)

    def test_cuts_of_a_recorded_completion_stream(self):
        self._r_cuts_equal("completion", sample=150)

    def test_cuts_of_a_recorded_responses_stream(self):
        self._r_cuts_equal("responses", sample=150)

    def test_every_cut_inside_a_multibyte_character(self):
        raw = _r_utf8_stream()
        buf = self._r_buffer(raw)
        whole, whole_events = self._r_call()
        self.assertEqual(whole.content, "Grüße 日本 🌊")
        at = buf.raw.index(" 🌊".encode()) + 1
        for cut in range(buf.raw.index("ü".encode()), at + 5):
            buf.reset([cut])
            completion, events = self._r_call()
            self.assertEqual([e for e in events if not isinstance(e, lc.Resumed)], whole_events, cut)
            self.assertEqual(completion, whole)
            self.assertEqual(len(buf.replays()), 1)

    # -- several cuts -----------------------------------------------------------------------------------

    def test_two_cuts_in_one_stream(self):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"))
        whole, whole_events = self._r_call()
        body_at = len(buf.head) + len(b"%x\r\n" % len(buf.pieces[0])) + 200  # in the first chunk's data
        buf.reset([body_at, len(STREAM_HEAD) + 1000])
        completion, events = self._r_call()
        resumed = [e for e in events if isinstance(e, lc.Resumed)]
        self.assertEqual((completion, [e for e in events if not isinstance(e, lc.Resumed)]), (whole, whole_events))
        self.assertEqual([r.attempt for r in resumed], [1, 2])
        self.assertNotIn("Retrying", [type(e).__name__ for e in events])  # data came between: no backoff
        self.assertEqual(len(buf.replays()), 2)
        self.assertEqual(buf.replays()[0], 200)
        self.assertGreater(buf.replays()[1], 200)
        self.assertEqual(buf.replays(), [r.offset for r in resumed])

    def test_a_cut_in_the_head_of_the_replay_is_retried_from_the_same_offset(self):
        buf = self._r_buffer(load_transcript("06_chat_stream_include_usage.raw.txt"))
        whole, whole_events = self._r_call()
        buf.reset([len(buf.head) + 500, 20])
        completion, events = self._r_call()
        kept = [e for e in events if not isinstance(e, (lc.Resumed, lc.Retrying))]
        self.assertEqual((completion, kept), (whole, whole_events))
        offset = buf.replays()[0]
        self.assertEqual(buf.replays(), [offset, offset])
        told = [e for e in events if isinstance(e, (lc.Resumed, lc.Retrying))]
        self.assertEqual([type(e).__name__ for e in told], ["Resumed", "Retrying", "Resumed"])
        self.assertEqual((told[0], told[2]), (lc.Resumed(offset, 1), lc.Resumed(offset, 2)))
        self.assertEqual(told[1].attempt, 1)

    # -- the replay refused -----------------------------------------------------------------------------

    def _r_refused(self, answer):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"))
        buf.replay_answer = answer
        buf.reset([len(buf.head) + 700])
        err = self._f_fails(lc.StreamClosedError, fn=lambda events: self._r_call_events(events.append))
        self.assertEqual(buf.methods(), ["POST", "GET", "DELETE"])
        return err

    def _r_call_events(self, on_event, **params):
        return run_with_timeout(lambda: self.client.chat(MSGS, slot=0, resumable="conv-1", on_event=on_event), 10)

    def test_replay_answered_404_is_stream_closed_saying_so(self):
        err = self._r_refused(http_response(_R_GONE, status=b"404 Not Found"))
        self.assertIn("could not be resumed", str(err))
        self.assertIn("no longer knows it", str(err))
        self.assertIn("HTTP 404", str(err))

    def test_replay_answered_400_is_stream_closed_saying_so(self):
        doc = {"error": {"code": 400, "message": "offset out of range", "type": "invalid_request_error"}}
        err = self._r_refused(json_response(doc, b"400 Bad Request"))
        self.assertIn("could not be resumed", str(err))
        self.assertIn("no longer holds its bytes from offset", str(err))
        self.assertIn("offset out of range", str(err))

    # -- the server gone for a while ----------------------------------------------------------------------

    def _r_gone_then_back(self, refused):
        """The first connection is cut and the server's socket goes away (missing, or a file nobody listens
        on) until the client has said it cannot connect (Retrying); then it listens again and the stream
        finishes."""
        self.client_with(load_wait=5.0)
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"))
        whole, whole_events = self._r_call()
        server = self.server
        events = []

        def cannot_connect():
            return any(isinstance(e, lc.Retrying) and "cannot connect" in e.reason for e in events)

        def post_then_gone(req):
            with buf.lock:
                buf.ids.add(req.headers["x-conversation-id"])
            req.send(buf.raw[: len(buf.head) + 900])
            server.listener.close()
            server.listener = None
            os.unlink(server.path)
            stale = None
            if refused:
                stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                stale.bind(server.path)  # the file is there, nobody listens: connect() is refused
            req.conn.close()
            try:
                wait_for(cannot_connect, 5, "the client to fail to connect")
            finally:
                if stale is not None:
                    stale.close()
                    os.unlink(server.path)
                server.listen()

        server.route("POST", "/v1/chat/completions", post_then_gone)
        buf.reset()
        completion = run_with_timeout(
            lambda: self.client.chat(MSGS, slot=0, resumable="conv-1", on_event=events.append), 10
        )
        retrying = [e for e in events if isinstance(e, lc.Retrying)]
        reason = "Connection refused" if refused else "No such file"
        self.assertTrue(any(reason in e.reason for e in retrying), retrying)
        self.assertEqual(completion, whole)
        self.assertEqual([e for e in events if not isinstance(e, (lc.Resumed, lc.Retrying))], whole_events)
        resumed = [e for e in events if isinstance(e, lc.Resumed)]
        self.assertEqual(resumed[-1].attempt, len(retrying) + 1)  # each failed reattach was told, then retried
        self.assertEqual(buf.replays()[-1], resumed[-1].offset)
        self.assertEqual(len(server.chat_requests()), 2)  # the uncut run, then this one: not sent again

    def test_server_socket_missing_for_a_while_then_back(self):
        self._r_gone_then_back(refused=False)

    def test_server_refusing_for_a_while_then_back(self):
        self._r_gone_then_back(refused=True)

    # -- lost before any byte of the head -------------------------------------------------------------

    def test_lost_before_the_head_and_known_is_resumed_from_zero(self):
        buf = self._r_buffer(load_transcript("06_chat_stream_include_usage.raw.txt"))
        whole, whole_events = self._r_call()
        buf.reset([0])
        completion, events = self._r_call()
        self.assertEqual(buf.methods(), ["POST", "LOOKUP", "GET"])
        self.assertEqual(buf.replays(), [0])
        self.assertEqual(events, [lc.Resumed(0, 1)] + whole_events)
        self.assertEqual(completion, whole)

    def test_lost_before_the_head_and_unknown_is_sent_again(self):
        buf = self._r_buffer(load_transcript("06_chat_stream_include_usage.raw.txt"))
        whole, whole_events = self._r_call()
        buf.register_lost_head = False
        buf.reset([0])
        completion, events = self._r_call()
        self.assertEqual(buf.methods(), ["POST", "LOOKUP", "POST"])
        with buf.lock:
            self.assertEqual([e[1] for e in buf.log], ["conv-1", ("conv-1",), "conv-1"])
        self.assertEqual([type(e).__name__ for e in events[:1]], ["Retrying"])
        self.assertEqual(events[1:], whole_events)
        self.assertEqual(completion, whole)

    # -- a silence of liveness ------------------------------------------------------------------------

    def test_a_silence_of_liveness_is_resumed_once(self):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"))
        whole, whole_events = self._r_call()
        buf.reset([("hold", len(buf.head) + 1200)])
        liveness = self.client.limits.liveness
        t = Timer()
        completion, events = self._r_call()
        self.assertElapsed(t.elapsed, liveness, late=1.0, early=EARLY)
        self.assertEqual((completion, [e for e in events if not isinstance(e, lc.Resumed)]), (whole, whole_events))
        self.assertEqual(len(buf.replays()), 1)
        self.assertEqual(buf.methods(), ["POST", "GET"])

    def test_a_second_silence_after_the_resume_is_stalled(self):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"))
        cut = len(buf.head) + 1200
        buf.reset([("hold", cut), ("hold", len(STREAM_HEAD) + 10)])
        liveness = self.client.limits.liveness
        self._f_fails(lc.StalledError, 2 * liveness, fn=lambda events: self._r_call_events(events.append))
        self.assertEqual(buf.methods(), ["POST", "GET", "DELETE"])

    # -- an early end deletes the stream before the permit is released --------------------------------

    def _r_permit_seen_at_delete(self, buf):
        buf.on_delete = lambda: self.client._board.gate.snapshot().get((None, 0))

    def _r_deleted_then_freed(self, buf):
        self.assertEqual(buf.methods()[-1], "DELETE")
        with buf.lock:
            self.assertEqual(buf.log[-1][1], "conv-1")
        self.assertEqual(buf.deleted_while, [(1, 0)])  # the permit was still held when the DELETE came
        self.assertEqual(self.client._board.gate.snapshot()[(None, 0)], (0, 0))

    def test_cancel_deletes_the_stream_before_the_permit_is_released(self):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"), cuts=[("hold", len(STREAM_HEAD) + 900)])
        self._r_permit_seen_at_delete(buf)
        stream = self.client.stream(MSGS, slot=0, resumable="conv-1")
        self.assertIsInstance(run_with_timeout(lambda: next(stream), 5), lc.Content)
        stream.cancel()
        with self.assertRaises(lc.CancelledError):
            run_with_timeout(lambda: list(stream), 5)
        self._r_deleted_then_freed(buf)
        self.assertEqual(buf.methods(), ["POST", "DELETE"])

    def test_leaving_with_early_deletes_the_stream(self):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"), cuts=[("hold", len(STREAM_HEAD) + 900)])
        self._r_permit_seen_at_delete(buf)

        def read_one():
            with self.client.stream(MSGS, slot=0, resumable="conv-1") as stream:
                return next(stream)

        self.assertIsInstance(run_with_timeout(read_one, 5), lc.Content)
        self._r_deleted_then_freed(buf)

    def test_an_on_event_exception_deletes_the_stream_before_the_permit_is_released(self):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"), cuts=[("hold", len(STREAM_HEAD) + 900)])
        self._r_permit_seen_at_delete(buf)

        def on_event(event):
            raise KeyError("from on_event")

        with self.assertRaises(KeyError):
            self._r_call_events(on_event)
        self._r_deleted_then_freed(buf)
        self.assertEqual(buf.methods(), ["POST", "DELETE"])

    def test_a_server_error_mid_stream_deletes_the_stream_before_the_permit_is_released(self):
        buf = self._r_buffer(load_transcript("17_midstream_error.raw.txt"))
        self._r_permit_seen_at_delete(buf)
        events = []
        with self.assertRaises(lc.ServerError):
            self._r_call_events(events.append)
        self.assertTrue(events)
        self._r_deleted_then_freed(buf)
        self.assertEqual(buf.methods(), ["POST", "DELETE"])

    def test_a_finished_stream_is_not_deleted(self):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"))
        self._r_call()
        self.assertEqual(buf.methods(), ["POST"])

    # -- ids, offsets, resume() -------------------------------------------------------------------------

    def test_a_bad_id_is_value_error_and_nothing_is_sent(self):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"))
        for bad in ("bad id\n", "", "x" * 129, "caf\u00e9"):
            with self.assertRaises(ValueError):
                self.client.chat(MSGS, slot=0, resumable=bad)
        self.assertEqual(buf.methods(), [])

    def test_resumable_true_makes_an_id_and_sends_it(self):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"))
        stream = self.client.stream(MSGS, slot=0, resumable=True)
        self.assertRegex(stream.conversation_id, r"^lc-[0-9a-f]{32}$")
        run_with_timeout(lambda: list(stream), 10)
        with buf.lock:
            self.assertEqual(buf.log, [("POST", stream.conversation_id, None)])
        self.assertIsNone(self.client.stream(MSGS, slot=0).conversation_id)

    def test_offset_is_the_end_of_the_last_yielded_events_block(self):
        buf = self._r_buffer(load_transcript("14_reasoning_grammar.raw.txt"))
        ends = set(_r_block_ends(buf.body))
        stream = self.client.stream(MSGS, slot=0, resumable="conv-1")
        self.assertEqual(stream.offset, 0)
        offsets = []

        def read():
            for _ in stream:
                offsets.append(stream.offset)

        run_with_timeout(read, 10)
        self.assertTrue(offsets)
        self.assertLessEqual(set(offsets) - {0}, ends)
        self.assertEqual(offsets, sorted(offsets))
        self.assertIn(stream.offset, ends)

    def test_resume_from_the_offset_of_a_partial_read_yields_exactly_the_rest(self):
        buf = self._r_buffer(load_transcript("14_reasoning_grammar.raw.txt"))
        whole, whole_events = self._r_call()
        release = self.event()
        buf.reset([("wait", len(buf.head) + len(buf.raw) // 2, release)])
        stream = self.client.stream(MSGS, slot=0, resumable="conv-1")
        read = []

        def until_an_offset():
            while stream.offset == 0:
                read.append(next(stream))

        run_with_timeout(until_an_offset, 10)
        offset = stream.offset
        self.assertIn(offset, _r_block_ends(buf.body))
        other = self.new_client(self.server.address, limits=self.limits)
        self.addCleanup(other.close)
        rest = other.resume("conv-1", offset=offset)
        self.assertEqual(rest.conversation_id, "conv-1")
        tail = run_with_timeout(lambda: list(rest), 10)
        self.assertEqual(read + tail, whole_events)
        self.assertEqual(
            rest.completion.content, whole.content[len("".join(e.text for e in read if isinstance(e, lc.Content))) :]
        )
        self.assertEqual(rest.offset, len(buf.body))
        self.assertEqual(buf.replays(), [offset])
        release.set()
        self.assertEqual(read + run_with_timeout(lambda: list(stream), 10), whole_events)
        self.assertEqual(stream.completion, whole)

    def test_resume_from_zero_reads_the_whole_stream_without_a_request(self):
        buf = self._r_buffer(load_transcript("50_responses_stream.raw.txt"), "respond")
        whole, whole_events = self._r_call("respond")
        stream = self.client.resume("conv-1", endpoint="respond")
        self.assertEqual(run_with_timeout(lambda: list(stream), 10), whole_events)
        self.assertEqual(stream.completion, whole)
        self.assertEqual(buf.methods(), ["POST", "GET"])
        self.assertEqual(buf.replays(), [0])

    def test_resume_of_an_unknown_id_is_stream_closed(self):
        self._r_buffer(load_transcript("04_chat_stream.raw.txt"))
        stream = self.client.resume("nobody")
        with self.assertRaises(lc.StreamClosedError) as caught:
            run_with_timeout(lambda: list(stream), 10)
        self.assertIn("no longer knows it", str(caught.exception))

    def test_lookup_and_delete(self):
        buf = self._r_buffer(load_transcript("04_chat_stream.raw.txt"))
        self._r_call()
        found = self.client.lookup_streams(["conv-1", "other"])
        self.assertEqual([e["conversation_id"] for e in found], ["conv-1"])
        self.assertIs(self.client.delete_stream("conv-1"), True)
        self.assertEqual(self.client.lookup_streams(["conv-1"]), [])
        self.assertEqual(buf.methods(), ["POST", "LOOKUP", "DELETE", "LOOKUP"])


class TestFaultResumeAgain(_f_Case):
    """A resumed stream lost again: a replay answered 503 is asked again after a backoff, and the budget of
    a later loss counts from that loss, not from when data last resumed."""

    limits = FAST_FAULTS.replace(poll=1.0, liveness=2.0, idle_grace=5.0, busy_wait=5.0, load_wait=0.5)

    def _again(self, cuts):
        buf = _r_Buffer(self.server, load_transcript("04_chat_stream.raw.txt"))
        events = []
        whole = run_with_timeout(lambda: self.client.chat(MSGS, slot=0, resumable="conv-1"), 10)
        buf.reset(cuts(buf))
        completion = run_with_timeout(
            lambda: self.client.chat(MSGS, slot=0, resumable="conv-1", on_event=events.append), 10
        )
        return buf, whole, completion, events

    def test_a_replay_answered_503_is_asked_again(self):
        loading = http_response(b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}',
                                status=b"503 Service Unavailable")  # fmt: skip
        buf, whole, completion, events = self._again(lambda buf: [len(buf.head) + 300, ("answer", loading)])
        self.assertEqual(completion, whole)
        told = [type(e).__name__ for e in events if isinstance(e, (lc.Resumed, lc.Retrying))]
        self.assertEqual(told, ["Resumed", "Retrying", "Resumed"])
        retry = [e for e in events if isinstance(e, lc.Retrying)][0]
        self.assertEqual(retry.reason, "HTTP 503: Loading model")
        self.assertEqual(buf.methods(), ["POST", "GET", "GET"])
        self.assertEqual(len(set(buf.replays())), 1)

    def test_a_second_loss_long_after_a_resume_has_a_fresh_load_wait(self):
        def cuts(buf):
            # the first replay streams for 1.0 s, twice load_wait, then is cut; the next answers 503 once
            first = len(buf.head) + 200
            replay = len(STREAM_HEAD) + 40
            return [first, ("pause", replay, 1.0, replay + 600), 0]  # 0: closed before a byte

        buf, whole, completion, events = self._again(cuts)
        self.assertEqual(completion, whole)
        told = [type(e).__name__ for e in events if isinstance(e, (lc.Resumed, lc.Retrying))]
        self.assertEqual(told, ["Resumed", "Resumed", "Retrying", "Resumed"])
        self.assertEqual(buf.methods(), ["POST", "GET", "GET", "GET"])


TestFaultResumeSockets, TestFaultResumeSocketsAsync = on_sockets(
    TestFaultResume,
    "test_cuts_of_a_recorded_responses_stream",
    "test_server_refusing_for_a_while_then_back",
    "test_a_silence_of_liveness_is_resumed_once",
    "test_cancel_deletes_the_stream_before_the_permit_is_released",
)


# -- inputs dev/fuzz.py found, fed again from dev/testdata/fuzz/<hash>.bin ---------------------------------


#: Inputs dev/fuzz.py found, kept as it saves them: the raw bytes of <hash>.bin (copied from dev/fuzz-crashes/).
FUZZ_INPUTS = os.path.join(HERE, "dev", "testdata", "fuzz")


def _f_input(name):
    """The saved fuzz input ``dev/testdata/fuzz/<name>.bin``."""
    with open(os.path.join(FUZZ_INPUTS, name + ".bin"), "rb") as f:
        return f.read()


def _f_saved(target, data, name):
    """Prove ``data`` is the saved input: the fuzzer names a crash by sha1(target NUL input)."""
    return hashlib.sha1(target.encode() + b"\0" + data).hexdigest()[:16] == name


#: The cut points the fuzzer's server sent the client-target inputs with (one send per piece).
_F_CUTS = {
    "e2748cec9571aae2": [
        1,
        2,
        3,
        4,
        6,
        7,
        8,
        11,
        13,
        15,
        16,
        18,
        19,
        20,
        21,
        22,
        24,
        25,
        27,
        28,
        30,
        32,
        33,
        35,
        36,
        38,
        41,
        43,
        45,
        46,
        47,
        51,
        52,
        53,
        54,
        56,
        57,
        58,
        59,
        60,
        61,
        62,
        67,
        68,
        70,
        72,
        74,
        76,
        77,
        78,
        80,
        81,
        82,
        85,
        88,
        89,
        90,
        94,
        95,
        96,
        99,
        101,
        102,
        106,
        107,
        109,
        110,
        111,
        113,
        115,
        116,
        117,
        118,
        119,
        120,
        121,
        123,
        124,
        125,
        127,
        130,
        132,
        135,
    ],
    "0f7c31287867b84c": [
        411,
        463,
        492,
        1598,
        1797,
        2479,
        2817,
        2946,
        3152,
        3167,
        3544,
        3872,
        4090,
        4656,
        5164,
        5199,
        5414,
        6247,
        6599,
        8290,
        8665,
        12333,
        12504,
        13053,
        13071,
        13306,
        13756,
        14157,
        15025,
        15040,
        15846,
        16375,
        16971,
        18159,
        19879,
        21782,
        21900,
        22167,
        22337,
        22414,
        22612,
        23561,
        25262,
        25424,
        25712,
        27230,
        27912,
        28431,
        29891,
        30502,
    ],
}


class TestFaultFuzzRegressions(_f_Case):
    def test_fuzz_e2748cec9571aae2_error_body_stalls(self):
        # client target, connection held open: loopclient._Silence (internal) escaped from _read_body.
        data = _f_input("e2748cec9571aae2")
        self.assertTrue(_f_saved("client", data, "e2748cec9571aae2"))
        pieces = _p_pieces(data, _F_CUTS["e2748cec9571aae2"])

        def handler(req):
            for piece in pieces:  # one send per piece, as the fuzzer's server did
                req.send(piece)
            req.wait_peer_close(5)

        self.use(handler)
        self._f_fails(lc.StalledError, FAST_FAULTS.liveness)

    def test_fuzz_403724efe73ee4d8_deeply_nested_error_body(self):
        # http target: a 503 whose close-delimited body nests 5,000 objects; parse_error_envelope let
        # RecursionError out.  Through the client the 503 is retried (its Retry-After is a past date).
        data = _f_input("403724efe73ee4d8")
        self.assertTrue(_f_saved("http", data, "403724efe73ee4d8"))
        reader = lc.ResponseReader(max_body=65536)
        body = b"".join(reader.feed(data))
        reader.feed_eof()
        self.assertEqual(reader.head.status, 503)
        message, _ = lc.parse_error_envelope(body)
        self.assertTrue(message.startswith('{"error":{"code":503'))
        self.use(reply(data))
        self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait)

    def test_fuzz_080ec222851097f5_error_code_superscript_two(self):
        # assembler target: {"code": "\u00b2"} passed str.isdigit(), then int() raised a bare ValueError.
        data = _f_input("080ec222851097f5")
        self.assertTrue(_f_saved("assembler", data, "080ec222851097f5"))
        asm = lc.Assembler()
        with self.assertRaises(lc.LoopError) as caught:
            for payload in data.decode("utf-8", "surrogatepass").split("\n\x1e"):
                asm.feed(payload)
            asm.completion()
        self.assertIs(type(caught.exception), lc.ServerError)
        self.assertIsNone(caught.exception.code)

    def test_fuzz_5dff79bad8bec29d_many_data_lines_in_one_event(self):
        # sse target, max_line 1 MiB: 605,552 "data:" lines in one event took 5 s (a str += per line).
        data = _f_input("5dff79bad8bec29d")
        self.assertTrue(_f_saved("sse", data, "5dff79bad8bec29d"))
        cuts = [
            114632,
            149591,
            151321,
            202273,
            234323,
            267737,
            294555,
            311822,
            350253,
            411743,
            546256,
            594560,
            665268,
            674184,
            713838,
            740823,
            808220,
            1241270,
            1353040,
            1413642,
            1527123,
            1642733,
            1660069,
            1689020,
            1698772,
            1747410,
            1892217,
            1930808,
            2108136,
            2136392,
            2316960,
            2358204,
            2431132,
            2437755,
            2499227,
            2562357,
            2643570,
            2669312,
            2761979,
            2974146,
            3119869,
            3128443,
            3176700,
            3199854,
            3226151,
            3230152,
            3367604,
            3382109,
            3516771,
            3596593,
        ]
        pieces = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]

        def decode():
            decoder = lc.SSEDecoder(1024 * 1024)
            try:
                for piece in pieces:
                    decoder.feed(piece)
                decoder.close()
            except lc.LoopError:
                pass

        def floor():  # the least a reader does with these bytes: split the lines, keep the data, join it
            kept = [line[5:] for line in b"".join(pieces).split(b"\n") if line.startswith(b"data:")]
            return b"\n".join(kept)

        # CPU time against that floor measured beside it, each the better of two, alternated (the machine's
        # other work moves both): linear is 2-3x the floor; the str += per line was 37-40x.  A line tracer
        # (coverage) multiplies the decoder's Python cost, not the floor's, which it does not trace.
        times = {"decode": [], "floor": []}
        for name, run in [("decode", decode), ("floor", floor), ("floor", floor), ("decode", decode)]:
            start = time.thread_time()
            run()
            times[name].append(time.thread_time() - start)
        ratio = min(times["decode"]) / max(min(times["floor"]), 1e-3)
        self.assertLess(ratio, 10.0 * TRACED, times)

    def test_fuzz_e517c807fa701495_deeply_nested_error_event(self):
        # http target: "event: error" blocks whose data nests 100,000 lists; _json_or_text let RecursionError out.
        data = _f_input("e517c807fa701495")
        self.assertTrue(_f_saved("http", data, "e517c807fa701495"))
        self.client_with(max_line=1024 * 1024)  # as the fuzzer ran it
        self.use(reply(data))
        self._f_fails(lc.ServerError)

    def test_fuzz_0f7c31287867b84c_deeply_nested_error_event_client(self):
        # client target (thinking_cap 2, slot 1, connection held): the same RecursionError, through chat().
        data = _f_input("0f7c31287867b84c")
        self.assertTrue(_f_saved("client", data, "0f7c31287867b84c"))
        pieces = _p_pieces(data, _F_CUTS["0f7c31287867b84c"])

        def handler(req):
            for piece in pieces:
                req.send(piece)
            req.wait_peer_close(5)

        self.client_with(max_line=64 * 1024, thinking_cap=2, thinking_overrun=4)
        self.use(handler)
        self._f_fails(lc.ServerError, slot=1)


TestFaultFuzzRegressionsSockets, TestFaultFuzzRegressionsSocketsAsync = on_sockets(
    TestFaultFuzzRegressions,
    "test_fuzz_e2748cec9571aae2_error_body_stalls",
)


# -- the two clients alike: one behaviour, compared outcome for outcome --------------------------------
#
# Client and AsyncClient drive one engine, so one call against one scripted server must come out the
# same in both: the same events, the same Completion (==), the same error class and message.  What may
# differ is only timing, which differs_between_clients() sets aside: the delay of a Retrying; a number in an
# error message (seconds waited) within MARGIN; how many times in a row one Waiting is heard (one per
# poll, so the two counts may differ by MARGIN / poll; and a first one, before any byte of the answer,
# may be missing from one client when the other heard it for no longer than that: a head late by a few
# polls); and one last Retrying that one client fitted into the end of a budget the other had spent (its
# delay, what was left, within MARGIN) before the same budget error: asyncio's timers wake up to a
# millisecond late (epoll counts milliseconds), threads do not.
# TestDifferential runs the fault table through both; dev/fuzz.py --differential runs the fuzzer's
# client cases through both with the same rules.

# -- the fault table: the one statement of dev/FAULTS.md's tables ------------------------------------
#
# Per section of dev/FAULTS.md (by its heading): the table's columns, and per row the fault (the name of
# the TestDifferential row that runs it, exactly as scripted there), what the server does, the outcome,
# and the tests that pin it.  dev/faults.py writes the tables of dev/FAULTS.md from it;
# TestDifferential.test_dev_faults_md_is_the_fault_table fails when they drift, or when a row's outcome
# does not name the error class its TestDifferential row expects, or names a test that does not exist.

FAULT_TABLE = [
    (
        "Connecting",
        ("fault", "what the server does", "error (and when)", "test"),
        [
            (
                "socket file missing",
                "nothing at the path",
                "`LoadTimeoutError` after `load_wait`, with `Retrying` in between; `__cause__` is `FileNotFoundError`",
                "`TestFaultConnect.test_socket_file_missing_stream`",
            ),
            (
                "socket file missing, single-shot call",
                "nothing at the path",
                "`ConnectError` at once, `.address` as given, `__cause__` is `FileNotFoundError`",
                "`TestFaultConnect.test_socket_file_missing_single_shot`",
            ),
            (
                "socket file with no listener",
                "a stale socket file; connecting is refused",
                "`LoadTimeoutError` after `load_wait`; `__cause__` is `ConnectionRefusedError`",
                "`TestFaultConnect.test_socket_file_without_listener_stream`",
            ),
            (
                "socket file with no listener, single-shot call",
                "connecting is refused",
                "`ConnectError` at once",
                "`TestFaultConnect.test_socket_file_without_listener_single_shot`",
            ),
            (
                "EOF before the head",
                "reads the request, closes without a byte",
                "`StreamClosedError` at once, not retried (*choice*: the server may have started the work)",
                "`TestFaultConnect.test_eof_before_head_is_not_retried`",
            ),
            (
                "connection reset before the head",
                "TCP RST (SO_LINGER 0) after reading the request",
                "`StreamClosedError` at once, not retried",
                "`TestFaultReset.test_reset_before_head_is_not_retried`",
            ),
            (
                "connection reset mid-stream",
                "RST after one content event",
                "`StreamClosedError` at once; the delivered output is never replayed",
                "`TestFaultReset.test_reset_mid_stream_is_not_replayed`",
            ),
        ],
    ),
    (
        "The response head",
        ("fault", "what the server does", "error (and when)", "test"),
        [
            (
                "garbage status line",
                "`HELLO THERE` plus a header block",
                "`ProtocolError` at once",
                "`TestFaultHead.test_garbage_status_line`",
            ),
            (
                "a service that is not HTTP",
                "an SSH banner line, then waits for the client",
                "`ProtocolError` at once: the first line is enough (*choice*)",
                "`TestFaultHead.test_garbage_banner_then_silence`",
            ),
            (
                "bad status code",
                "`HTTP/1.1 2000 OK`",
                "`ProtocolError` at once",
                "`TestFaultHead.test_bad_status_code`",
            ),
            (
                "another HTTP version",
                "`HTTP/2 200`",
                "`ProtocolError` at once",
                "`TestFaultHead.test_http2_preface_version`",
            ),
            (
                "HTTP/1.0 reply",
                "`HTTP/1.0 200` with no length, body until close",
                "no error: framed normally (read until close), `Completion` returned (*choice*)",
                "`TestFaultHead.test_http10_reply_is_accepted`",
            ),
            (
                "interim response",
                "`100 Continue`, then the real response",
                "no error: the interim head is skipped",
                "`TestFaultHead.test_interim_response_then_stream`",
            ),
            (
                "10 MB of headers",
                "one 10 MB header line",
                "`ProtocolError` once 64 KiB of head has arrived; the client closes before the server has sent it all",
                "`TestFaultHead.test_ten_megabytes_of_headers`",
            ),
            (
                "1,000 header lines",
                "1,000 short headers",
                "`ProtocolError` at once (cap: 100 lines)",
                "`TestFaultHead.test_thousand_header_lines`",
            ),
            ("NUL byte in a header", "`X-A: a\\0b`", "`ProtocolError` at once", "`TestFaultHead.test_nul_in_header`"),
            (
                "obsolete line folding",
                "a header line that starts with spaces",
                "no error: unfolded into the previous value with one space (RFC 9112 5.2, as a user agent)",
                "`TestFaultHead.test_folded_header_line`",
            ),
            (
                "EOF inside the head",
                "half a head, then close",
                "`StreamClosedError` at once",
                "`TestFaultHead.test_eof_in_the_middle_of_the_head`",
            ),
            (
                "head trickled forever",
                "one header byte every 20 ms, never a blank line",
                "`StalledError` after `liveness` from the first byte of the head (*choice*: a head that has not finished within `liveness` is no progress)",
                "`TestFaultHead.test_head_trickled_forever`",
            ),
            (
                "interim responses forever",
                "`100 Continue` every 20 ms",
                "`StalledError` after `liveness` (as above)",
                "`TestFaultHead.test_interim_responses_forever`",
            ),
            (
                "stall inside the head",
                "half a head, then silence",
                "`StalledError` after `liveness`",
                "`TestFaultWaits.test_stall_mid_head`",
            ),
        ],
    ),
    (
        "Body framing",
        ("fault", "what the server does", "error (and when)", "test"),
        [
            (
                "conflicting Content-Length headers",
                "`Content-Length: 10` and `Content-Length: 20`",
                "`ProtocolError` at once",
                "`TestFaultFraming.test_conflicting_content_length`",
            ),
            (
                "conflicting Content-Length, single-shot call",
                "the same on `/slots`",
                "`ProtocolError` at once",
                "`TestFaultFraming.test_conflicting_content_length_single_shot`",
            ),
            (
                "negative length",
                "`Content-Length: -1`",
                "`ProtocolError` at once",
                "`TestFaultFraming.test_negative_content_length`",
            ),
            (
                "non-numeric length",
                "`Content-Length: 12abc`",
                "`ProtocolError` at once",
                "`TestFaultFraming.test_non_numeric_content_length`",
            ),
            (
                "unsupported transfer coding",
                "`Transfer-Encoding: gzip, chunked`",
                "`ProtocolError` at once",
                "`TestFaultFraming.test_unsupported_transfer_encoding`",
            ),
            (
                "chunk size ffffffffffffffff",
                "that size line, then a whole valid stream",
                "`ProtocolError` at once: a size that does not fit in 63 bits is malformed (*choice*)",
                "`TestFaultFraming.test_chunk_size_ffffffffffffffff`",
            ),
            (
                "chunk size line without CRLF",
                "the size runs straight into the data",
                "`ProtocolError` at once",
                "`TestFaultFraming.test_chunk_size_line_without_crlf`",
            ),
            (
                "chunk size line that never ends",
                "`1` followed by 5,000 zeros and no newline",
                "`ProtocolError` once 4 KiB of size line has arrived",
                "`TestFaultFraming.test_chunk_size_line_never_ends`",
            ),
            (
                "chunk data without its CRLF",
                "`XX` where the CRLF after the data belongs",
                "`ProtocolError` at once",
                "`TestFaultFraming.test_chunk_data_not_followed_by_crlf`",
            ),
            (
                "body shorter than its length (stream)",
                "`Content-Length` 500 bytes more than is sent, then close",
                "`StreamClosedError` at once, after the `Content` that did arrive",
                "`TestFaultFraming.test_body_shorter_than_its_length_stream`",
            ),
            (
                "body shorter than its length (single-shot)",
                "`/slots` says 100 bytes, sends 8, closes",
                "`StreamClosedError` at once",
                "`TestFaultFraming.test_body_shorter_than_its_length_single_shot`",
            ),
            (
                "close mid-chunk",
                "a chunk 200 bytes short, then close",
                "`StreamClosedError` at once",
                "`TestFaultFraming.test_close_mid_chunk`",
            ),
            (
                "close mid-event",
                "a close-delimited body whose last event has no blank line",
                "`StreamClosedError` at once: the unfinished event is discarded, so there is no `finish_reason`",
                "`TestFaultFraming.test_close_mid_event`",
            ),
            (
                "close after the finish chunk without `[DONE]`",
                "finish chunk, then the final `0` chunk",
                "no error: a clean end after a `finish_reason` returns the `Completion`",
                "`TestFaultFraming.test_close_after_finish_without_done_is_clean`",
            ),
            (
                "`[DONE]`, then the connection stays open",
                "no final `0` chunk, no close",
                "no error: the `Completion` is returned at `[DONE]`, without waiting",
                "`TestFaultFraming.test_done_then_connection_held`",
            ),
            (
                "`[DONE]` without a `finish_reason`",
                "content, then `[DONE]`",
                "`StreamClosedError` at once",
                "`TestFaultFraming.test_done_without_finish_reason`",
            ),
            (
                "empty stream",
                "a 200 head and the final `0` chunk",
                "`StreamClosedError` at once",
                "`TestFaultFraming.test_empty_chunked_body`",
            ),
            (
                "200 with an HTML page",
                "an nginx welcome page",
                "`StreamClosedError` at once: no event, so no `finish_reason`",
                "`TestFaultFraming.test_html_page_with_200`",
            ),
            (
                "error body over `max_body`",
                "a 500 whose body is longer than `max_body` and arrives in the same read as the head",
                "`ProtocolError` at once",
                "`TestFaultFraming.test_error_body_over_max_body`",
            ),
            (
                "single-shot length over `max_body`",
                "`/slots` announces `max_body` + 1 bytes",
                "`ProtocolError` at once, before reading the body",
                "`TestFaultFraming.test_single_shot_length_over_max_body`",
            ),
        ],
    ),
    (
        "SSE lines and events",
        ("fault", "what the server does", "error (and when)", "test"),
        [
            (
                "a 2 MiB line sent one byte at a time",
                "one byte per millisecond, slot busy, `max_line` 1 KiB",
                "`ProtocolError` as soon as `max_line` is passed; the server has sent at most `max_line` + 64 bytes of the line by then",
                "`TestFaultSSE.test_two_mib_line_trickled`",
            ),
            (
                "bytes trickle but no event completes",
                "one byte every 20 ms, idle slot",
                "`StalledError` after `liveness`: the liveness rule asks `/slots` and the slot is idle",
                "`TestFaultSSE.test_slow_line_without_event_hits_liveness`",
            ),
            (
                "a line of `max_line` exactly",
                "a valid chunk padded to 4,096 bytes",
                "no error: the line is accepted",
                "`TestFaultSSE.test_line_of_max_line_exactly`",
            ),
            (
                "a line of `max_line` + 1",
                "the same, one byte longer",
                "`ProtocolError` at once",
                "`TestFaultSSE.test_line_of_max_line_plus_one`",
            ),
            (
                "an event over `max_line` in many lines",
                "2,000 short `data:` lines in one event",
                "`ProtocolError` at once",
                "`TestFaultSSE.test_event_over_max_line_in_many_data_lines`",
            ),
            (
                "half a million empty `data:` lines",
                "524,290 of them in one event, `max_line` 512 KiB",
                "`ProtocolError` within 1 s (time linear in the input)",
                "`TestFaultSSE.test_half_million_empty_data_lines`",
            ),
            (
                "invalid UTF-8",
                "`\\xff\\xfe` inside a content string",
                "no error: replaced by U+FFFD",
                "`TestFaultSSE.test_invalid_utf8_is_replaced`",
            ),
            (
                "a UTF-8 character split between reads",
                "`é` cut in two, 20 ms apart",
                "no error: the character arrives whole",
                "`TestFaultSSE.test_utf8_split_between_reads`",
            ),
            (
                "a NUL byte",
                "a raw NUL inside a JSON string",
                "`ProtocolError` at once (raw control characters are invalid JSON)",
                "`TestFaultSSE.test_nul_byte_in_data`",
            ),
        ],
    ),
    (
        "JSON payloads",
        ("fault", "what the server does", "error (and when)", "test"),
        [
            ("invalid JSON", "a chunk cut short", "`ProtocolError` at once", "`TestFaultJSON.test_invalid_json`"),
            (
                "JSON that is not an object",
                '`["choices"]`',
                "`ProtocolError` at once",
                "`TestFaultJSON.test_json_not_an_object`",
            ),
            (
                "`choices` not a list",
                '`{"choices": {"0": ...}}`',
                "`ProtocolError` at once",
                "`TestFaultJSON.test_choices_not_a_list`",
            ),
            (
                "a delta that is a string",
                '`"delta": "Hi"`',
                "`ProtocolError` at once",
                "`TestFaultJSON.test_delta_is_a_string`",
            ),
            (
                "a tool-call delta without index",
                "id, name and arguments, no `index`",
                "`ProtocolError` at once",
                "`TestFaultJSON.test_tool_call_delta_without_index`",
            ),
            (
                "deeply nested JSON",
                "200,000 nested lists",
                "`ProtocolError` at once",
                "`TestFaultJSON.test_deeply_nested_json`",
            ),
            (
                "an error code that only looks like a number",
                '`{"error": {"code": "²"}}`',
                "`ServerError` at once with `.code` None",
                "`TestFaultJSON.test_error_code_not_a_decimal`",
            ),
        ],
    ),
    (
        "Silence, pings and the liveness rule",
        ("fault", "what the server does", "error (and when)", "test"),
        [
            (
                "pings forever, idle slot",
                "`: ping` every 50 ms, no data; `/slots` says idle",
                "`StalledError` after `liveness`",
                "`TestFaultWaits.test_pings_forever_idle_slot`",
            ),
            (
                "pings forever, processing slot",
                "the same; `/slots` says processing",
                "`StalledError` after `busy_wait`, counted from the last data event",
                "`TestFaultWaits.test_pings_forever_processing_slot`",
            ),
            (
                "stall before the head, idle slot",
                "reads the request, says nothing",
                "`StalledError` after `idle_grace`, with `Waiting(False)` events",
                "`TestFaultWaits.test_stall_before_head_idle_slot`",
            ),
            (
                "stall before the head, busy slot",
                "the same; `/slots` says processing",
                "`WaitTimeoutError` after `busy_wait`, with `Waiting(True)` events",
                "`TestFaultWaits.test_stall_before_head_busy_slot`",
            ),
            (
                "stall mid-stream",
                "one content event, then silence",
                "`StalledError` after `liveness`",
                "`TestFaultWaits.test_stall_mid_stream`",
            ),
        ],
    ),
    (
        "Error statuses and error events",
        ("fault", "what the server does", "error (and when)", "test"),
        [
            (
                "HTTP 503 forever",
                "`503 Loading model` on every attempt",
                "`LoadTimeoutError` after `load_wait`, at least 2 attempts",
                "`TestFaultErrors.test_http_503_forever`",
            ),
            (
                "HTTP 400",
                'the real "exceeds the available context size" envelope',
                "`HTTPStatusError` at once, `.status` 400, `.message` from the envelope",
                "`TestFaultErrors.test_http_400_prompt_too_long`",
            ),
            (
                "HTTP 500 with an HTML body",
                "`<h1>oops</h1>`",
                "`HTTPStatusError` at once, `.message` is the page's first text (`oops`), `.body` the whole page",
                "`TestFaultErrors.test_http_500_html_body`",
            ),
            (
                "error body stalls",
                "a 400 that sends 2 of its 116 bytes, then silence",
                "`StalledError` after `liveness`",
                "`TestFaultErrors.test_error_status_body_stalls`",
            ),
            (
                "error body nested 5,000 deep",
                "a 400 whose envelope cannot be decoded",
                "`HTTPStatusError` at once; the message falls back to the body text",
                "`TestFaultErrors.test_error_body_deeply_nested`",
            ),
            (
                "error event first, code 503",
                '`data: {"error": {"code": 503, ...}}`, then a good stream',
                "retried like an HTTP 503; `Completion` returned after one `Retrying`",
                "`TestFaultErrors.test_error_event_first_503_is_retried`",
            ),
            (
                "error event first, 503 forever",
                "the 503 event on every attempt",
                "`LoadTimeoutError` after `load_wait`",
                "`TestFaultErrors.test_error_event_first_503_forever`",
            ),
            (
                "error event first, code 400",
                '`data: {"error": {"code": 400, ...}}`',
                "`ServerError` at once, `.code` 400, one attempt",
                "`TestFaultErrors.test_error_event_first_400`",
            ),
            (
                "error event after content",
                "content, then a 503 error event",
                "`ServerError` at once, `.code` 503; never replayed",
                "`TestFaultErrors.test_error_event_after_content`",
            ),
            (
                "legacy `error:` line",
                'content, then `error: {"code":500,...}`',
                "`ServerError` at once, `.code` 500",
                "`TestFaultErrors.test_legacy_error_line`",
            ),
            (
                "legacy `error:` line nested 100,000 deep",
                "an `error:` payload that cannot be decoded",
                "`ServerError` at once, the text as its message",
                "`TestFaultErrors.test_legacy_error_line_deeply_nested`",
            ),
            (
                "legacy `error:` line first, code 503",
                "the legacy line, then a good stream",
                "retried; `Completion` returned, 2 requests",
                "`TestFaultErrors.test_legacy_error_line_first_503_is_retried`",
            ),
        ],
    ),
    (
        "503 with Retry-After",
        ("fault", "what the server does", "error (and when)", "test"),
        [
            (
                "Retry-After as a date beyond `load_wait`",
                "an HTTP date 5 s ahead",
                "`LoadTimeoutError` at once, no `Retrying`",
                "`TestFaultRetryAfter.test_date_beyond_load_wait`",
            ),
            (
                "Retry-After as a date in the past",
                "a date a minute ago, then a good stream",
                "retried after the ordinary backoff (0.19–0.25 s), not at once (*choice*: a hint is a floor, so 0 cannot become a busy loop)",
                "`TestFaultRetryAfter.test_date_in_the_past`",
            ),
            (
                "`Retry-After: 0` forever",
                "the same 503 every time",
                "`LoadTimeoutError` after `load_wait`, with at most 4 attempts",
                "`TestFaultRetryAfter.test_zero_forever`",
            ),
            (
                "Retry-After negative",
                "`-5`, then a good stream",
                "no hint: retried after the backoff",
                "`TestFaultRetryAfter.test_negative`",
            ),
            (
                "Retry-After malformed",
                "`soon`, then a good stream",
                "no hint: retried after the backoff",
                "`TestFaultRetryAfter.test_malformed`",
            ),
            (
                "Retry-After huge",
                "20 digits",
                "`LoadTimeoutError` at once (longer than what remains of `load_wait`)",
                "`TestFaultRetryAfter.test_huge`",
            ),
            (
                "Retry-After beyond float range",
                "400 digits",
                "`LoadTimeoutError` at once",
                "`TestFaultRetryAfter.test_huge_past_float_range`",
            ),
            (
                "Retry-After beyond int() digit limit",
                "5,000 digits",
                "`LoadTimeoutError` at once",
                "`TestFaultRetryAfter.test_huge_past_int_digit_limit`",
            ),
        ],
    ),
    (
        "/slots and the other single-shot calls",
        ("fault", "what the server does", "error (and when)", "test"),
        [
            (
                "`/slots` answers garbage while the head is awaited",
                "`not json!`",
                "treated as unavailable: `LoadTimeoutError` after `load_wait`, `Waiting(False)` events",
                "`TestFaultSlots.test_slots_garbage_while_waiting`",
            ),
            (
                "`/slots` answers garbage to `slots()`",
                "the same",
                "`ProtocolError` at once",
                "`TestFaultSlots.test_slots_garbage_single_shot`",
            ),
            (
                "`/slots` entries of the wrong shape",
                '`{"id": "0", "is_processing": "yes"}`',
                "`ProtocolError` at once",
                "`TestFaultSlots.test_slots_wrong_shape_single_shot`",
            ),
            (
                "`/slots` hangs while the head is awaited",
                "accepts, never answers",
                "unavailable: `LoadTimeoutError` after `load_wait`; the poller's connection ends too",
                "`TestFaultSlots.test_slots_hanging_while_waiting`",
            ),
            (
                "`/slots` hangs for `slots()`",
                "accepts, never answers",
                "`StalledError` after `liveness`",
                "`TestFaultSlots.test_slots_hanging_single_shot`",
            ),
            (
                "`/slots` answers 501 while the head is awaited",
                "`--no-slots` servers do this",
                "not served: `WaitTimeoutError` after `busy_wait` (the slots cannot be seen; the server is up)",
                "`TestFaultSlots.test_slots_501_while_waiting`",
            ),
            (
                "`/slots` answers 501 to `slots()`",
                "the same",
                "`HTTPStatusError` at once, `.status` 501",
                "`TestFaultSlots.test_slots_501_single_shot`",
            ),
            (
                "`/props` is not an object",
                "`[1, 2]`",
                "`ProtocolError` at once",
                "`TestFaultSlots.test_props_not_an_object`",
            ),
        ],
    ),
    (
        "Behind proxies and balancers: 429, a hidden /slots",
        ("fault", "what the server (or the proxy in front) does", "error (and when)", "test"),
        [
            (
                "429 at a concurrency limit, then served",
                "429 twice (with and without `Retry-After: 0`), then the stream",
                "no error: `Retrying` twice, reason `HTTP 429: ...`, then the `Completion`",
                "`TestFaultProxies.test_429_with_and_without_retry_after_is_retried_then_served`",
            ),
            (
                "429 for ever",
                "429 with `Retry-After: 0` on every attempt (`busy_wait` 0.8 s, `load_wait` 0.3 s)",
                "`WaitTimeoutError` after `busy_wait`, naming the 429; `__cause__` the `HTTPStatusError` 429",
                "`TestFaultProxies.test_429_past_busy_wait_is_a_wait_timeout_naming_the_429`",
            ),
            (
                "429 with a hint past `busy_wait`",
                "`Retry-After: 30`",
                "`WaitTimeoutError` at once, no `Retrying`",
                "`TestFaultProxies.test_a_429_hint_past_busy_wait_ends_the_wait_at_once`",
            ),
            (
                "`/slots` not served",
                "`/slots` answers 404, 403, 405 or 501 while the head is held back",
                "`WaitTimeoutError` after `busy_wait` (not `load_wait`), `Waiting(False, slots_known=False)` at each poll, `/slots` asked once",
                "`TestFaultProxies.test_slots_not_served_while_waiting_counts_under_busy_wait`, `TestFaultSlots.test_slots_501_while_waiting`",
            ),
        ],
    ),
    (
        "Behind nginx, HAProxy and Caddy: the fronts' own answers",
        ("fault", "what the front does", "error (and when)", "test"),
        [
            (
                "504 from nginx, then served",
                "nginx's 504 page (`Server: nginx/1.22.1`) after its idle timeout, twice",
                "no error: `Retrying` twice under `busy_wait`, reason `HTTP 504 from nginx/1.22.1: the front stopped waiting for a slot`, then the `Completion`",
                "`TestFaultFronts.test_a_504_or_524_is_retried_under_busy_wait_then_served`",
            ),
            (
                "504 without a `Server` header, then served",
                "HAProxy's 504 page",
                "no error: `Retrying` twice under `busy_wait`, reason `HTTP 504 from the front: ...`",
                "`TestFaultFronts.test_a_504_or_524_is_retried_under_busy_wait_then_served`",
            ),
            (
                "504 with an empty body, then served",
                "Caddy's 504 (`Server: Caddy`, no body)",
                "no error: `Retrying` twice under `busy_wait`, reason `HTTP 504 from Caddy: ...`",
                "`TestFaultFronts.test_a_504_or_524_is_retried_under_busy_wait_then_served`",
            ),
            (
                "524, then served",
                "Cloudflare's 524 page",
                "no error: `Retrying` twice under `busy_wait`, reason `HTTP 524 from cloudflare: ...`",
                "`TestFaultFronts.test_a_504_or_524_is_retried_under_busy_wait_then_served`",
            ),
            (
                "504 for ever",
                "nginx's 504 on every attempt (`busy_wait` 0.8 s, `load_wait` 0.3 s)",
                "`WaitTimeoutError` after `busy_wait`, one line naming `HTTP 504`, `nginx/1.22.1` and `busy_wait`; `__cause__` the `HTTPStatusError` with the page in `.body`",
                "`TestFaultFronts.test_a_504_past_busy_wait_is_a_wait_timeout_naming_the_front`",
            ),
            (
                "504 to a resumable request the server holds",
                "nginx's 504 for the POST; the server kept the queued request (lookup knows it)",
                "no error: `Resumed(0, 1)`, the stream replayed from 0, the request not sent again; lookup and replay carry `X-Conversation-Id`",
                "`TestFaultFronts.test_a_resumable_request_cut_by_a_504_and_known_is_resumed_from_zero`",
            ),
            (
                "a resumable stream the front ends cleanly mid-event",
                "Caddy's answer when its server's connection breaks: the chunked body ended by `0` after a chunk cut mid-event (transcript 106)",
                "no error: resumed from the start of the unfinished event (`GET /v1/stream?from=` the last blank line), the events and `Completion` those of the whole stream",
                "`TestFaultFronts.test_a_resumable_stream_a_front_ends_cleanly_mid_event_is_resumed`",
            ),
            (
                "502 with an HTML page, then served",
                "nginx's 502 page (the server's socket gone), twice",
                "no error: `Retrying` twice under `load_wait`, reason `HTTP 502 from nginx/1.22.1: 502 Bad Gateway`",
                "`TestFaultFronts.test_a_502_or_520_to_523_is_retried_under_load_wait_then_served`",
            ),
            (
                "502 with an empty body, then served",
                "Caddy's 502",
                "no error: `Retrying` twice under `load_wait`, reason `HTTP 502 from Caddy: (empty body)`",
                "`TestFaultFronts.test_a_502_or_520_to_523_is_retried_under_load_wait_then_served`",
            ),
            (
                "520 to 523, then served",
                "Cloudflare's pages",
                "no error: `Retrying` twice under `load_wait`, the page's title in the reason",
                "`TestFaultFronts.test_a_502_or_520_to_523_is_retried_under_load_wait_then_served`",
            ),
            (
                "502 for ever",
                "nginx's 502 on every attempt (`load_wait` 0.6 s, `busy_wait` 0.2 s)",
                "`LoadTimeoutError` after `load_wait`, one line naming `load_wait`, `HTTP 502` and `nginx/1.22.1`",
                "`TestFaultFronts.test_a_502_past_load_wait_is_a_load_timeout_naming_the_front`",
            ),
            (
                "503 from HAProxy for ever",
                "HAProxy's 503 page (no server to send to)",
                "`LoadTimeoutError` after `load_wait`; `__cause__` the 503 with `.message` `503 Service Unavailable`",
                "`TestFaultFronts.test_haproxy_s_503_when_its_server_is_gone_is_waited_out_under_load_wait`",
            ),
            (
                "an error page from a front",
                "nginx's 403 page",
                "`HTTPStatusError` at once: `HTTP 403 from nginx/1.22.1: 403 Forbidden`, `.server` the header, `.body` the page",
                "`TestFaultFronts.test_an_error_page_is_one_line_naming_the_front`",
            ),
            (
                "idle `/slots`, several servers",
                "`Limits(servers=2)`; the head held back, `/slots` idle (it may be another server's)",
                "`WaitTimeoutError` after `busy_wait`, not `StalledError` after `idle_grace`; `Waiting(slots_known=False)`",
                "`TestFaultFronts.test_with_several_servers_an_idle_slot_is_no_stall`",
            ),
            (
                "`/slots` answers from two servers",
                "the head held back; `/slots` answers 2 slots, then 3, in turn (`servers` not given)",
                "`WaitTimeoutError` after `busy_wait` from the second poll, not `StalledError`: the client has learnt there are several servers",
                "`TestFaultFronts.test_slots_answers_that_cannot_come_from_one_server_mean_several`",
            ),
        ],
    ),
    (
        "The reasoning control endpoint (`thinking_cap` 2)",
        ("fault", "what the server does", "error (and when)", "test"),
        [
            (
                "control endpoint answers 404",
                "an older server",
                "`ThinkingOverrunError` at once, `.tokens` 2, `__cause__` an `HTTPStatusError`",
                "`TestFaultControl.test_control_404`",
            ),
            (
                "control endpoint 404 for `end_reasoning()`",
                "the same",
                "`HTTPStatusError` at once, `.status` 404",
                "`TestFaultControl.test_control_404_single_shot`",
            ),
            (
                "control endpoint answers `success: false`",
                '`{"success": false}`',
                "`ThinkingOverrunError` at once, after exactly 2 `Reasoning` events",
                "`TestFaultControl.test_control_success_false`",
            ),
            (
                "`success: false` for `end_reasoning()`",
                "the same",
                "no error: `False`",
                "`TestFaultControl.test_control_success_false_single_shot`",
            ),
            (
                "control endpoint hangs",
                "accepts, never answers",
                "`ThinkingOverrunError` after `liveness`, `__cause__` a `StalledError`",
                "`TestFaultControl.test_control_hanging`",
            ),
        ],
    ),
    (
        "Security",
        ("fault", "what the server or caller does", "outcome", "test"),
        [
            (
                "the API key could leak",
                "401, garbage, stall, `/slots` 401, missing socket, CR/LF in the key or the Authorization header",
                "the key is in no error message, repr, args, cause chain, traceback or log record, and in no repr of the client, stream or limits",
                "`TestSecurity.test_api_key_never_in_errors_reprs_or_logs`",
            ),
            (
                "header injection",
                "CR or LF in a header value or name, the key, the address, a path",
                "`ValueError` before anything is sent; the server sees no request",
                "`TestSecurity.test_crlf_in_header_value_name_key_or_path_refused_before_sending`",
            ),
            (
                "a model name carrying CR/LF",
                '`model="gemma\\r\\nX-Injected: yes..."`',
                "sent inside the JSON body, escaped: no raw CR or LF in the body, no injected header, one request",
                "`TestSecurity.test_model_name_with_crlf_cannot_inject_a_header`",
            ),
            (
                "redirects",
                "301, 302, 303, 307, 308 to another server; 302 on `/slots`",
                "`HTTPStatusError` at once; the other server gets no connection",
                "`TestSecurity.test_redirects_are_never_followed`",
            ),
            (
                "a response pointing elsewhere",
                "`Location`, `Content-Location`, `Alt-Svc`, `Link` on a 503, a 200 and a `/slots` 307",
                "every socket the client opens goes to the address it was given",
                "`TestSecurity.test_a_response_never_makes_the_client_connect_elsewhere`",
            ),
        ],
    ),
    (
        "Inputs the fuzzer found (`dev/fuzz.py`), fed again as saved",
        ("fault", "input", "error (and when)", "test"),
        [
            (
                "error body stalls on a held connection",
                "`dev/fuzz-crashes/e2748cec9571aae2.bin` (client target)",
                "`StalledError` after `liveness`",
                "`TestFaultFuzzRegressions.test_fuzz_e2748cec9571aae2_error_body_stalls`",
            ),
            (
                "503 with an error body nested 5,000 deep",
                "`403724efe73ee4d8.bin` (http target)",
                "the envelope falls back to text; through the client, `LoadTimeoutError` after `load_wait`",
                "`TestFaultFuzzRegressions.test_fuzz_403724efe73ee4d8_deeply_nested_error_body`",
            ),
            (
                'error code `"²"`',
                "`080ec222851097f5.bin` (assembler target)",
                "`ServerError`, `.code` None",
                "`TestFaultFuzzRegressions.test_fuzz_080ec222851097f5_error_code_superscript_two`",
            ),
            (
                "605,552 `data:` lines in one event",
                "`5dff79bad8bec29d.bin` (sse target, `max_line` 1 MiB)",
                "within 1 s of CPU time; through the client, `StreamClosedError` (the stream ends without `[DONE]`)",
                "`TestFaultFuzzRegressions.test_fuzz_5dff79bad8bec29d_many_data_lines_in_one_event`",
            ),
            (
                "`event: error` with data nested 100,000 deep",
                "`e517c807fa701495.bin` (http target)",
                "`ServerError` at once",
                "`TestFaultFuzzRegressions.test_fuzz_e517c807fa701495_deeply_nested_error_event`",
            ),
            (
                "`event: error` nested deep, through `chat()`",
                "`0f7c31287867b84c.bin` (client target, `thinking_cap` 2, slot 1, held)",
                "`ServerError` at once",
                "`TestFaultFuzzRegressions.test_fuzz_0f7c31287867b84c_deeply_nested_error_event_client`",
            ),
        ],
    ),
]


def fault_tables_markdown(text):
    """``text`` (dev/FAULTS.md) with each table under a heading of FAULT_TABLE written from it."""
    tables = {heading: (columns, rows) for heading, columns, rows in FAULT_TABLE}
    lines = text.split("\n")
    out, heading, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            heading = line[3:]
        if heading in tables and line.startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            columns, rows = tables.pop(heading)
            out.append("| %s |" % " | ".join(columns))
            out.append("|%s" % ("---|" * len(columns)))
            out.extend("| %s |" % " | ".join(row) for row in rows)
            i += 2
            while i < len(lines) and lines[i].startswith("| "):
                i += 1
            continue
        out.append(line)
        i += 1
    assert not tables, "sections of FAULT_TABLE without a table in dev/FAULTS.md: %s" % sorted(tables)
    return "\n".join(out)


_D_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _d_event(event):
    return event.replace(delay=0.0) if isinstance(event, lc.Retrying) else event


def _d_runs(events):
    """The events with what is timing set aside, as [event, n]: n equal Waiting events in a row, else 1."""
    runs = []
    for event in map(_d_event, events):
        if runs and isinstance(event, lc.Waiting) and runs[-1][0] == event:
            runs[-1][1] += 1
        else:
            runs.append([event, 1])
    return runs


def _d_message(text):
    """The message with each number replaced by ``#``, and the numbers."""
    return _D_NUMBER.sub("#", text), [float(n) for n in _D_NUMBER.findall(text)]


def _d_text(value):
    if isinstance(value, BaseException):
        return "%s(%r)" % (type(value).__name__, str(value))
    return repr(value)


def differs_between_clients(sync, other, poll, margin=MARGIN):
    """None when ``sync`` and ``other``, each ``(events, Completion or exception)`` of one call (from
    Client and from AsyncClient), are alike but for timing (see above); else what differs, as
    ``"<what>: <detail>"``.  ``poll`` is the clients' ``Limits.poll``."""
    (sync_events, sync_value), (async_events, async_value) = sync, other
    failed = isinstance(sync_value, BaseException) or isinstance(async_value, BaseException)
    if failed and type(sync_value) is not type(async_value):
        return "outcome differs (sync %s / async %s): sync %s, async %s" % (
            type(sync_value).__name__,
            type(async_value).__name__,
            _d_text(sync_value)[:500],
            _d_text(async_value)[:500],
        )
    if failed:
        (sync_text, sync_numbers), (async_text, async_numbers) = (
            _d_message(str(sync_value)),
            _d_message(str(async_value)),
        )
        if sync_text != async_text or any(abs(a - b) > margin for a, b in zip(sync_numbers, async_numbers)):
            return "message differs (%s): sync %r, async %r" % (
                type(sync_value).__name__,
                str(sync_value)[:500],
                str(async_value)[:500],
            )
    elif sync_value != async_value:
        return "completion differs: sync %r, async %r" % (sync_value, async_value)
    sync_runs, async_runs = _d_runs(sync_events), _d_runs(async_events)
    waited = [bool(runs) and isinstance(runs[0][0], lc.Waiting) for runs in (sync_runs, async_runs)]
    if waited[0] != waited[1]:  # a head late by a few polls in one client only
        runs = sync_runs if waited[0] else async_runs
        if runs[0][1] * poll <= margin:
            del runs[0]
    if failed and isinstance(sync_value, lc._BudgetError) and abs(len(sync_runs) - len(async_runs)) == 1:
        longer = sync_runs if len(sync_runs) > len(async_runs) else async_runs
        last = longer[-1][0]
        if isinstance(last, lc.Retrying) and last.delay <= margin:  # one more attempt at the budget's end
            del longer[-1]
    unlike = [
        i for i, (a, b) in enumerate(zip(sync_runs, async_runs)) if a[0] != b[0] or abs(a[1] - b[1]) * poll > margin
    ]
    if unlike or len(sync_runs) != len(async_runs):
        at = unlike[0] if unlike else min(len(sync_runs), len(async_runs))
        return "events differ (%d sync, %d async; runs from %d): sync %r, async %r" % (
            len(sync_events),
            len(async_events),
            at,
            [tuple(r) for r in sync_runs[at : at + 3]],
            [tuple(r) for r in async_runs[at : at + 3]],
        )
    return None


#: One part of a row of dev/FAULTS.md as TestDifferential runs it: ``arrange(server)`` scripts the fake
#: server (called again before each client, so that a handler's state starts afresh); ``act(client,
#: events)`` is the call; ``expect`` the documented outcome (an exception class, ``lc.Completion``, or a
#: value); ``budget`` its budget (``at_once``: it must not take it); ``address(server)`` where the client
#: connects; ``changes`` to FAST_FAULTS; ``client`` keywords for the constructor.
_DPart = collections.namedtuple("_DPart", "arrange act expect budget at_once address changes client tcp")


def _d_chat(slot=0, **params):
    return lambda client, events: client.chat(MSGS, slot=slot, on_event=events.append, **params)


def _d_part(
    arrange=None,
    act=None,
    expect=lc.Completion,
    budget=0.0,
    at_once=False,
    address=None,
    changes=None,
    client=None,
    tcp=False,
):
    return _DPart(
        arrange or (lambda s: None),
        act or _d_chat(),
        expect,
        budget,
        at_once,
        address,
        changes or {},
        client or {},
        tcp,
    )


def _d_stream(handler):
    return lambda s: s.stream(handler)


def _d_drip(pieces, interval, limit=4.0):
    """Arrange ``_f_drip`` of a fresh ``pieces()`` (a generator is used up by the first client)."""
    return lambda s: s.stream(_f_drip(pieces(), interval, limit))


def _d_reply(data, hold=False):
    return _d_stream(reply(data, hold))


def _d_slots(handler):
    return lambda s: s.route("GET", "/slots", handler)


def _d_slots_reply(data, hold=False):
    return _d_slots(reply(data, hold))


def _d_missing(s):
    return os.path.join(s.tmp, "missing.sock")


def _d_stale(s):
    path = os.path.join(s.tmp, "stale.sock")
    if not os.path.exists(path):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.close()  # the file stays, nobody listens: connect() is refused
    return path


def _d_reset(after=b""):
    def handler(req):
        if after:
            req.send(after)
            time.sleep(0.05)
        req.conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        req.conn.close()  # linger 0: RST instead of FIN

    return _d_stream(handler)


def _d_busy(arrange):
    def both(s):
        s.busy[0] = True
        arrange(s)

    return both


def _d_json(doc, status=200, reason="OK", extra=b""):
    return lambda req: respond_json(req, doc, status, reason, extra)


def _d_pieces(data, cuts):
    pieces = _p_pieces(data, cuts)

    def handler(req):
        for piece in pieces:  # one send per piece, as the fuzzer's server did
            req.send(piece)
        req.wait_peer_close(5)

    return _d_stream(handler)


_D_LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
_D_NO_SLOTS = {"error": {"code": 501, "message": "This server does not support slots endpoint.", "type": "x"}}
_D_CL = b"HTTP/1.1 200 OK\r\n" + _F_SSE_HEAD
_D_OK = STREAM_HEAD + _F_OK_BODY


class TestDifferential(_f_Case):
    """The virtual driver and AsyncClient on a real socket are one behaviour: every row of dev/FAULTS.md
    (each scripted server behaviour, built as the fault tier builds it), and the cases that used to tell
    the clients apart, run through both against the same scripted server (a VirtualServer, then a
    FakeServer on the same path or port); the events, the Completion, the error class and message must be
    alike (differs_between_clients: alike but for timing), and each must be the documented outcome within
    its budget: exactly on the virtual clock, within MARGIN on the real one.  AsyncClient is the real
    driver compared, its step loop being the one VirtualRun does not mirror (Client's is: TestDriversAlike
    compares the three operation by operation).  One subTest per row, named by the row."""

    VIRTUAL = False  # the test's own fixture is real; each row makes a virtual clock for its virtual run

    def setUp(self):
        super().setUp()
        self._d_loop = LoopThread()
        self._d_kernel = None

    def tearDown(self):
        problems = self._d_loop.close()
        super().tearDown()
        self.assertEqual(problems, [], "the event loop reported problems")

    # -- running a row through both clients ---------------------------------------------------------

    def _d_client(self, kind, *args, **kw):
        if kind == "virtual":
            client = lc.Client(*args, **kw)
            client._board.run_class = VirtualRun
            client._board.kernel = self._d_kernel
            return client
        facade = SyncFacade(self._d_loop, *args, **kw)
        self._d_loop.facades.append(facade)
        return facade

    def _d_both(self, name, scenario, tcp=False):
        """``scenario(kind, make, server)`` -> a list of (events, value), run for "async" on a FakeServer,
        then for "virtual" on a VirtualServer at the same address (and with the same directory); every
        pair must be alike."""
        with self.subTest(name):
            real = FakeServer(tcp=tcp)
            outcomes, sent = {}, {}
            try:
                for kind in ("async", "virtual"):
                    if kind == "virtual":
                        kernel = self._d_kernel = VirtualKernel()
                        kernel.start()
                        server = VirtualServer(kernel, tcp=tcp, like=real)
                    else:
                        server = real
                    try:
                        outcomes[kind] = scenario(kind, lambda *a, k=kind, **kw: self._d_client(k, *a, **kw), server)
                        with server.lock:  # the same requests (how many is timing; so is asking /slots)
                            sent[kind] = {
                                (r.raw_head, r.body) for r in server.requests if r.path.split("?")[0] != "/slots"
                            }
                    finally:
                        if kind == "virtual":
                            try:
                                server.close()
                            finally:
                                kernel.stop()
                                self._d_kernel = None
            finally:
                real.close()
            self.assertEqual(sent["virtual"], sent["async"], "%s: the clients sent different requests" % name)
            self.assertEqual(len(outcomes["virtual"]), len(outcomes["async"]))
            for i, (virtual, other) in enumerate(zip(outcomes["virtual"], outcomes["async"])):
                differs = differs_between_clients(virtual, other, FAST_FAULTS.poll)
                self.assertIsNone(differs, "%s (part %d): the clients differ: %s" % (name, i + 1, differs))
            return outcomes

    def _d_run(self, kind, make, server, part):
        """One part through one client: (events, value); the value is the documented one, in its time."""
        part.arrange(server)
        events = []
        sent = len(server.requests)
        t = Timer()
        try:
            client = make(
                part.address(server) if part.address else server.address,
                limits=FAST_FAULTS.replace(**part.changes),
                **part.client,
            )
        except ValueError as exc:  # refused before anything is sent
            client, value = None, exc
        if client is not None:
            try:
                value = run_with_timeout(lambda: part.act(client, events), part.budget + 8.0)
            except Exception as exc:  # the outcome under test, whatever it is
                value = exc
            finally:
                client.close()
        elapsed = t.elapsed
        if isinstance(value, ValueError):
            self.assertEqual(len(server.requests), sent, "%s: a request was sent before the ValueError" % kind)
        if isinstance(value, BaseException) and _F_KEY in repr(part.client):
            _f_secret_free(self, _F_KEY, value)
        if isinstance(part.expect, type):
            self.assertIs(type(value), part.expect, "%s: expected %s, got %r" % (kind, part.expect.__name__, value))
        else:
            self.assertEqual(value, part.expect, kind)
        if kind == "virtual":  # exact: the budget, or (none) the retry delays the client announced
            took = part.budget or sum(e.delay for e in events if isinstance(e, lc.Retrying))
            self.assertLessEqual(elapsed, took + 1e-6, "%s: %.6f s (budget %.2f s)" % (kind, elapsed, part.budget))
            if not part.at_once:
                self.assertGreaterEqual(elapsed, took - 1e-6, "%s: early, %.6f s" % (kind, elapsed))
        else:
            self.assertLessEqual(
                elapsed, part.budget + MARGIN, "%s: %.3f s (budget %.2f s)" % (kind, elapsed, part.budget)
            )
            if part.budget and not part.at_once:
                self.assertGreaterEqual(elapsed, part.budget - EARLY, "%s: early, %.3f s" % (kind, elapsed))
        return events, value

    def _d_row(self, name, *parts):
        tcp = any(p.tcp for p in parts)
        return self._d_both(name, lambda kind, make, server: [self._d_run(kind, make, server, p) for p in parts], tcp)

    def _d_table(self, rows):
        for name, parts in rows:
            self._d_row(name, *parts)

    # -- the rows of dev/FAULTS.md, table by table ---------------------------------------------------

    def _d_connecting(self):
        lw = FAST_FAULTS.load_wait
        return [
            ("socket file missing", [_d_part(address=_d_missing, expect=lc.LoadTimeoutError, budget=lw)]),
            (
                "socket file missing, single-shot call",
                [_d_part(address=_d_missing, act=lambda c, ev: c.slots(), expect=lc.ConnectError)],
            ),
            ("socket file with no listener", [_d_part(address=_d_stale, expect=lc.LoadTimeoutError, budget=lw)]),
            (
                "socket file with no listener, single-shot call",
                [_d_part(address=_d_stale, act=lambda c, ev: c.health(), expect=lc.ConnectError)],
            ),
            ("EOF before the head", [_d_part(_d_stream(lambda req: None), expect=lc.StreamClosedError)]),
            ("connection reset before the head", [_d_part(_d_reset(), expect=lc.StreamClosedError, tcp=True)]),
            (
                "connection reset mid-stream",
                [
                    _d_part(
                        _d_reset(STREAM_HEAD + chunked(sse(chunk_json({"content": "Hi"})))),
                        expect=lc.StreamClosedError,
                        budget=0.05,
                        at_once=True,
                        tcp=True,
                    )
                ],
            ),
        ]

    def _d_head(self):
        lv = FAST_FAULTS.liveness
        http10 = sse(chunk_json({"content": "Hi"}), chunk_json({}, "stop")) + b"data: [DONE]\n\n"
        return [
            (
                "garbage status line",
                [_d_part(_d_reply(b"HELLO THERE\r\nServer: x\r\n\r\n", True), expect=lc.ProtocolError)],
            ),
            (
                "a service that is not HTTP",
                [_d_part(_d_reply(b"SSH-2.0-OpenSSH_9.6\r\n", True), expect=lc.ProtocolError)],
            ),
            ("bad status code", [_d_part(_d_reply(b"HTTP/1.1 2000 OK\r\n\r\n", True), expect=lc.ProtocolError)]),
            (
                "another HTTP version",
                [
                    _d_part(
                        _d_reply(b"HTTP/2 200\r\ncontent-type: text/event-stream\r\n\r\n", True),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
            ("HTTP/1.0 reply", [_d_part(_d_reply(b"HTTP/1.0 200 OK\r\n" + _F_SSE_HEAD + b"\r\n" + http10))]),
            ("interim response", [_d_part(_d_reply(b"HTTP/1.1 100 Continue\r\n\r\n" + _D_OK))]),
            (
                "10 MB of headers",
                [
                    _d_part(
                        _d_reply(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (10 * 1024 * 1024) + b"\r\n\r\n"),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
            (
                "1,000 header lines",
                [
                    _d_part(
                        _d_reply(
                            b"HTTP/1.1 200 OK\r\n"
                            + b"".join(b"X-H%d: v\r\n" % i for i in range(1000))
                            + b"\r\n"
                            + _F_OK_BODY,
                            True,
                        ),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
            (
                "NUL byte in a header",
                [
                    _d_part(
                        _d_reply(b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nTransfer-Encoding: chunked\r\n\r\n" + _F_OK_BODY),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
            # the table says ProtocolError; TestFaultHead.test_folded_header_line (and the client) unfold it
            (
                "obsolete line folding",
                [
                    _d_part(
                        _d_reply(
                            b"HTTP/1.1 200 OK\r\nX-A: a\r\n  folded\r\nTransfer-Encoding: chunked\r\n\r\n" + _F_OK_BODY
                        )
                    )
                ],
            ),
            ("EOF inside the head", [_d_part(_d_reply(b"HTTP/1.1 200 OK\r\nContent-Ty"), expect=lc.StreamClosedError)]),
            (
                "head trickled forever",
                [
                    _d_part(
                        _d_drip(lambda: _f_chain(b"HTTP/1.1 200 OK\r\nX-Slow: ", _f_forever(b"a")), 0.02, limit=2.0),
                        expect=lc.StalledError,
                        budget=lv,
                    )
                ],
            ),
            (
                "interim responses forever",
                [
                    _d_part(
                        _d_drip(lambda: _f_forever(b"HTTP/1.1 100 Continue\r\n\r\n"), 0.02, limit=2.0),
                        expect=lc.StalledError,
                        budget=lv,
                    )
                ],
            ),
            (
                "stall inside the head",
                [
                    _d_part(
                        _d_reply(b"HTTP/1.1 200 OK\r\nContent-Type: text/ev", True), expect=lc.StalledError, budget=lv
                    )
                ],
            ),
        ]

    def _d_framing(self):
        hi = sse(chunk_json({"content": "Hi"}))
        page = b"<html><body>\n<h1>Welcome to nginx!</h1>\n</body></html>\n"
        slots = lambda c, ev: c.slots()
        return [
            (
                "conflicting Content-Length headers",
                [
                    _d_part(
                        _d_reply(_D_CL + b"Content-Length: 10\r\nContent-Length: 20\r\n\r\n" + b"x" * 20, True),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
            (
                "conflicting Content-Length, single-shot call",
                [
                    _d_part(
                        _d_slots_reply(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n[]"),
                        slots,
                        lc.ProtocolError,
                    )
                ],
            ),
            (
                "negative length",
                [_d_part(_d_reply(_D_CL + b"Content-Length: -1\r\n\r\n", True), expect=lc.ProtocolError)],
            ),
            (
                "non-numeric length",
                [_d_part(_d_reply(_D_CL + b"Content-Length: 12abc\r\n\r\n", True), expect=lc.ProtocolError)],
            ),
            (
                "unsupported transfer coding",
                [
                    _d_part(
                        _d_reply(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n" + _F_OK_BODY),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
            (
                "chunk size ffffffffffffffff",
                [
                    _d_part(
                        _d_reply(
                            STREAM_HEAD
                            + b"ffffffffffffffff\r\n"
                            + sse(chunk_json({"content": "Hi"}), chunk_json({}, "stop"))
                            + b"data: [DONE]\n\n"
                        ),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
            (
                "chunk size line without CRLF",
                [_d_part(_d_reply(STREAM_HEAD + b"%x" % len(hi) + hi, True), expect=lc.ProtocolError)],
            ),
            (
                "chunk size line that never ends",
                [_d_part(_d_reply(STREAM_HEAD + b"1" + b"0" * 5000, True), expect=lc.ProtocolError)],
            ),
            (
                "chunk data without its CRLF",
                [
                    _d_part(
                        _d_reply(STREAM_HEAD + b"%x\r\n" % len(hi) + hi + b"XX" + b"0\r\n\r\n", True),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
            (
                "body shorter than its length (stream)",
                [
                    _d_part(
                        _d_reply(_D_CL + b"Content-Length: %d\r\n\r\n" % (len(hi) + 500) + hi),
                        expect=lc.StreamClosedError,
                    )
                ],
            ),
            (
                "body shorter than its length (single-shot)",
                [
                    _d_part(
                        _d_slots_reply(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n[{"id":0'),
                        slots,
                        lc.StreamClosedError,
                    )
                ],
            ),
            (
                "close mid-chunk",
                [_d_part(_d_reply(STREAM_HEAD + b"%x\r\n" % (len(hi) + 200) + hi), expect=lc.StreamClosedError)],
            ),
            (
                "close mid-event",
                [
                    _d_part(
                        _d_reply(_D_CL + b"\r\n" + hi + b"data: " + chunk_json({}, "stop").encode()),
                        expect=lc.StreamClosedError,
                    )
                ],
            ),
            (
                "close after the finish chunk without `[DONE]`",
                [_d_part(_d_reply(STREAM_HEAD + content_stream(["Hi"], done=False)))],
            ),
            (
                "`[DONE]`, then the connection stays open",
                [
                    _d_part(
                        _d_reply(
                            STREAM_HEAD
                            + chunked(sse(chunk_json({"content": "Hi"}), chunk_json({}, "stop")) + b"data: [DONE]\n\n"),
                            True,
                        )
                    )
                ],
            ),
            (
                "`[DONE]` without a `finish_reason`",
                [_d_part(_d_reply(STREAM_HEAD + content_stream(["Hi"], finish=None)), expect=lc.StreamClosedError)],
            ),
            ("empty stream", [_d_part(_d_reply(STREAM_HEAD + b"0\r\n\r\n"), expect=lc.StreamClosedError)]),
            (
                "200 with an HTML page",
                [
                    _d_part(
                        _d_reply(
                            b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s"
                            % (len(page), page)
                        ),
                        expect=lc.StreamClosedError,
                    )
                ],
            ),
            (
                "error body over `max_body`",
                [
                    _d_part(
                        _d_reply(b"HTTP/1.1 500 Internal Server Error\r\n\r\n" + b"e" * (FAST_FAULTS.max_body + 10)),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
            (
                "single-shot length over `max_body`",
                [
                    _d_part(
                        _d_slots_reply(
                            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (FAST_FAULTS.max_body + 1), True
                        ),
                        slots,
                        lc.ProtocolError,
                    )
                ],
            ),
        ]

    def _d_sse(self):
        def trickle(req):
            if not req.send(STREAM_HEAD + b"200000\r\n" + b"data: "):
                return
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline and req.send(b"x"):
                time.sleep(0.001)

        split = sse(chunk_json({"content": "é€"}, extra=None).replace("\\u00e9\\u20ac", "é€"))
        cut = split.index("é".encode()) + 1
        bang = content_stream(["!"], role=False)
        return [
            (
                "a 2 MiB line sent one byte at a time",
                [
                    _d_part(
                        _d_busy(_d_stream(trickle)),
                        expect=lc.ProtocolError,
                        budget=1024 * 0.0011 + 0.5,
                        at_once=True,
                        changes=dict(max_line=1024, liveness=5.0, busy_wait=10.0),
                    )
                ],
            ),
            (
                "bytes trickle but no event completes",
                [
                    _d_part(
                        _d_drip(lambda: _f_chain(STREAM_HEAD + b"100000\r\ndata: ", _f_forever(b"x")), 0.02),
                        expect=lc.StalledError,
                        budget=FAST_FAULTS.liveness,
                    )
                ],
            ),
            (
                "a line of `max_line` exactly",
                [_d_part(_d_reply(STREAM_HEAD + chunked(_f_padded_line(FAST_FAULTS.max_line) + b"\n\n") + bang))],
            ),
            (
                "a line of `max_line` + 1",
                [
                    _d_part(
                        _d_reply(STREAM_HEAD + chunked(_f_padded_line(FAST_FAULTS.max_line + 1) + b"\n\n") + bang),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
            (
                "an event over `max_line` in many lines",
                [_d_part(_d_reply(STREAM_HEAD + chunked(b"data: xx\n" * 2000 + b"\n"), True), expect=lc.ProtocolError)],
            ),
            (
                "half a million empty `data:` lines",
                [
                    _d_part(
                        _d_reply(_D_CL + b"\r\n" + b"data:\n" * (512 * 1024 + 2) + b"\n"),
                        expect=lc.ProtocolError,
                        budget=1.0 * TRACED,
                        at_once=True,
                        changes=dict(max_line=512 * 1024, liveness=30.0),
                    )
                ],
            ),
            (
                "invalid UTF-8",
                [
                    _d_part(
                        _d_reply(
                            STREAM_HEAD
                            + chunked(sse(chunk_json({"content": "AB"})).replace(b"AB", b"A\xff\xfeB"))
                            + bang
                        )
                    )
                ],
            ),
            (
                "a UTF-8 character split between reads",
                [
                    _d_part(
                        _d_stream(_f_drip([STREAM_HEAD + chunked(split[:cut]), chunked(split[cut:]), bang], 0.02)),
                        budget=0.2,
                        at_once=True,
                    )
                ],
            ),
            (
                "a NUL byte",
                [
                    _d_part(
                        _d_reply(
                            STREAM_HEAD + chunked(sse(chunk_json({"content": "AB"})).replace(b"AB", b"A\x00B")) + bang
                        ),
                        expect=lc.ProtocolError,
                    )
                ],
            ),
        ]

    def _d_json_rows(self):
        def payload(text, **changes):
            return [
                _d_part(
                    _d_reply(STREAM_HEAD + chunked(sse(text)) + content_stream(["!"]), True),
                    expect=lc.ProtocolError,
                    changes=changes,
                )
            ]

        call = chunk_json(
            {"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}
        )
        return [
            ("invalid JSON", payload('{"choices":[{"delta":{"content":"Hi"')),
            ("JSON that is not an object", payload('["choices"]')),
            ("`choices` not a list", payload('{"choices":{"0":{"index":0,"delta":{"content":"Hi"}}},"id":"x"}')),
            (
                "a delta that is a string",
                payload('{"choices":[{"index":0,"finish_reason":null,"delta":"Hi"}],"id":"x"}'),
            ),
            ("a tool-call delta without index", payload(call)),
            ("deeply nested JSON", payload('{"choices":' + "[" * 200000 + "]" * 200000 + "}", max_line=1024 * 1024)),
            (
                "an error code that only looks like a number",
                [
                    _d_part(
                        _d_reply(
                            STREAM_HEAD
                            + chunked(sse('{"error":{"code":"\u00b2","message":"x","type":"server_error"}}'))
                        ),
                        expect=lc.ServerError,
                    )
                ],
            ),
        ]

    def _d_waits(self):
        pings = _d_drip(lambda: _f_chain(STREAM_HEAD, _f_forever(chunked(b": ping\n\n"))), 0.05)
        hold = _d_stream(_f_hold)
        return [
            ("pings forever, idle slot", [_d_part(pings, expect=lc.StalledError, budget=FAST_FAULTS.liveness)]),
            (
                "pings forever, processing slot",
                [_d_part(_d_busy(pings), expect=lc.StalledError, budget=FAST_FAULTS.busy_wait)],
            ),
            (
                "stall before the head, idle slot",
                [_d_part(hold, expect=lc.StalledError, budget=FAST_FAULTS.idle_grace)],
            ),
            (
                "stall before the head, busy slot",
                [_d_part(_d_busy(hold), expect=lc.WaitTimeoutError, budget=FAST_FAULTS.busy_wait)],
            ),
            (
                "stall mid-stream",
                [
                    _d_part(
                        _d_reply(STREAM_HEAD + chunked(sse(chunk_json({"content": "Hi"}))), True),
                        expect=lc.StalledError,
                        budget=FAST_FAULTS.liveness,
                    )
                ],
            ),
        ]

    def _d_errors(self):
        lw = FAST_FAULTS.load_wait
        event503 = STREAM_HEAD + chunked(sse(_f_error_json(503, "Loading model", "unavailable_error"))) + b"0\r\n\r\n"
        legacy503 = (
            STREAM_HEAD
            + chunked(b'error: {"code":503,"message":"Loading model","type":"unavailable_error"}\n\n')
            + b"0\r\n\r\n"
        )
        nested = b'{"error":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"
        too_long = {
            "error": {
                "code": 400,
                "message": "the request exceeds the available context size",
                "type": "exceed_context_size_error",
            }
        }
        return [
            (
                "HTTP 503 forever",
                [
                    _d_part(
                        _d_stream(_d_json(_D_LOADING, 503, "Service Unavailable")),
                        expect=lc.LoadTimeoutError,
                        budget=lw,
                    )
                ],
            ),
            ("HTTP 400", [_d_part(_d_stream(_d_json(too_long, 400, "Bad Request")), expect=lc.HTTPStatusError)]),
            (
                "HTTP 500 with an HTML body",
                [
                    _d_part(
                        _d_reply(
                            b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 17\r\n\r\n<h1>oops</h1>\r\n\r\n"
                        ),
                        expect=lc.HTTPStatusError,
                    )
                ],
            ),
            (
                "error body stalls",
                [
                    _d_part(
                        _d_reply(
                            b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 116\r\n\r\n-1",
                            True,
                        ),
                        expect=lc.StalledError,
                        budget=FAST_FAULTS.liveness,
                    )
                ],
            ),
            (
                "error body nested 5,000 deep",
                [
                    _d_part(
                        _d_reply(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(nested), nested)),
                        expect=lc.HTTPStatusError,
                    )
                ],
            ),
            (
                "error event first, code 503",
                [_d_part(lambda s: s.stream(_f_sequence(reply(event503), reply(_D_OK))), budget=0.25, at_once=True)],
            ),
            ("error event first, 503 forever", [_d_part(_d_reply(event503), expect=lc.LoadTimeoutError, budget=lw)]),
            (
                "error event first, code 400",
                [
                    _d_part(
                        _d_reply(
                            STREAM_HEAD
                            + chunked(sse(_f_error_json(400, "bad grammar", "invalid_request_error")))
                            + b"0\r\n\r\n"
                        ),
                        expect=lc.ServerError,
                    )
                ],
            ),
            (
                "error event after content",
                [
                    _d_part(
                        _d_reply(
                            STREAM_HEAD
                            + chunked(
                                sse(chunk_json({"content": "Hi"}), _f_error_json(503, "slot gone", "unavailable_error"))
                            )
                            + b"0\r\n\r\n"
                        ),
                        expect=lc.ServerError,
                    )
                ],
            ),
            (
                "legacy `error:` line",
                [
                    _d_part(
                        _d_reply(
                            STREAM_HEAD
                            + chunked(
                                sse(chunk_json({"content": "Hi"}))
                                + b'error: {"code":500,"message":"boom","type":"server_error"}\n\n'
                            )
                            + b"0\r\n\r\n"
                        ),
                        expect=lc.ServerError,
                    )
                ],
            ),
            (
                "legacy `error:` line nested 100,000 deep",
                [
                    _d_part(
                        _d_reply(
                            STREAM_HEAD + chunked(b"error: " + b"[" * 100000 + b"]" * 100000 + b"\n\n") + b"0\r\n\r\n"
                        ),
                        expect=lc.ServerError,
                        changes=dict(max_line=1024 * 1024),
                    )
                ],
            ),
            (
                "legacy `error:` line first, code 503",
                [_d_part(lambda s: s.stream(_f_sequence(reply(legacy503), reply(_D_OK))), budget=0.25, at_once=True)],
            ),
        ]

    def _d_retry_after(self):
        lw = FAST_FAULTS.load_wait

        def then_ok(value):
            return lambda s: s.stream(
                _f_sequence(reply(_f_retry_after(value() if callable(value) else value)), reply(_D_OK))
            )

        def forever(value, budget_at_once=True):
            return _d_part(
                lambda s: s.stream(reply(_f_retry_after(value() if callable(value) else value))),
                expect=lc.LoadTimeoutError,
                budget=lw,
                at_once=budget_at_once,
            )

        ahead = lambda: email.utils.formatdate(time.time() + 5, usegmt=True).encode()
        past = lambda: email.utils.formatdate(time.time() - 60, usegmt=True).encode()
        return [
            ("Retry-After as a date beyond `load_wait`", [forever(ahead)]),
            ("Retry-After as a date in the past", [_d_part(then_ok(past), budget=0.25, at_once=True)]),
            ("`Retry-After: 0` forever", [forever(b"0", budget_at_once=False)]),
            ("Retry-After negative", [_d_part(then_ok(b"-5"), budget=0.25, at_once=True)]),
            ("Retry-After malformed", [_d_part(then_ok(b"soon"), budget=0.25, at_once=True)]),
            ("Retry-After huge", [forever(b"99999999999999999999")]),
            ("Retry-After beyond float range", [forever(b"9" * 400)]),
            ("Retry-After beyond int() digit limit", [forever(b"9" * 5000)]),
        ]

    def _d_slots_rows(self):
        garbage = _d_slots_reply(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!")
        hold = _d_stream(_f_hold)

        def both(*arrangements):
            def arrange(s):
                for a in arrangements:
                    a(s)

            return arrange

        slots = lambda c, ev: c.slots()
        return [
            (
                "`/slots` answers garbage while the head is awaited",
                [_d_part(both(garbage, hold), expect=lc.LoadTimeoutError, budget=FAST_FAULTS.load_wait)],
            ),
            ("`/slots` answers garbage to `slots()`", [_d_part(garbage, slots, lc.ProtocolError)]),
            (
                "`/slots` entries of the wrong shape",
                [_d_part(_d_slots(_d_json([{"id": "0", "is_processing": "yes"}])), slots, lc.ProtocolError)],
            ),
            (
                "`/slots` hangs while the head is awaited",
                [_d_part(both(_d_slots(_f_hold), hold), expect=lc.LoadTimeoutError, budget=FAST_FAULTS.load_wait)],
            ),
            (
                "`/slots` hangs for `slots()`",
                [_d_part(_d_slots(_f_hold), slots, lc.StalledError, FAST_FAULTS.liveness)],
            ),
            # the table says LoadTimeoutError after load_wait; TestFaultSlots (and the client): not served,
            # so the slot cannot be seen, waited out under busy_wait
            (
                "`/slots` answers 501 while the head is awaited",
                [
                    _d_part(
                        both(_d_slots(_d_json(_D_NO_SLOTS, 501, "Not Implemented")), hold),
                        expect=lc.WaitTimeoutError,
                        budget=FAST_FAULTS.busy_wait,
                    )
                ],
            ),
            (
                "`/slots` answers 501 to `slots()`",
                [_d_part(_d_slots(_d_json(_D_NO_SLOTS, 501, "Not Implemented")), slots, lc.HTTPStatusError)],
            ),
            (
                "`/props` is not an object",
                [
                    _d_part(
                        lambda s: s.route("GET", "/props", _d_json([1, 2])), lambda c, ev: c.props(), lc.ProtocolError
                    )
                ],
            ),
        ]

    def _d_control(self):
        reasoning = STREAM_HEAD + chunked(sse(*[chunk_json({"reasoning_content": w}) for w in ("a", "b", "c")]))

        def with_control(handler):
            def arrange(s):
                s.stream(reply(reasoning, hold=True))
                if handler is not None:
                    s.route("POST", "/v1/chat/completions/control", handler)

            return arrange

        capped = dict(thinking_cap=2)
        not_found = _d_json(
            {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}, 404, "Not Found"
        )
        refused = _d_json({"success": False})
        end = lambda c, ev: c.end_reasoning(CID)
        return [
            (
                "control endpoint answers 404",
                [_d_part(with_control(not_found), expect=lc.ThinkingOverrunError, changes=capped)],
            ),
            (
                "control endpoint 404 for `end_reasoning()`",
                [_d_part(with_control(None), end, lc.HTTPStatusError, changes=capped)],
            ),
            (
                "control endpoint answers `success: false`",
                [_d_part(with_control(refused), expect=lc.ThinkingOverrunError, changes=capped)],
            ),
            ("`success: false` for `end_reasoning()`", [_d_part(with_control(refused), end, False, changes=capped)]),
            (
                "control endpoint hangs",
                [
                    _d_part(
                        with_control(_f_hold),
                        expect=lc.ThinkingOverrunError,
                        budget=FAST_FAULTS.liveness,
                        changes=capped,
                    )
                ],
            ),
        ]

    def _d_security(self):
        key = {"api_key": _F_KEY}
        unauthorized = _d_json(
            {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}, 401, "Unauthorized"
        )
        steer = (
            b"Location: http://10.255.255.1:9/\r\nContent-Location: unix:///tmp/evil.sock\r\n"
            b'Alt-Svc: h2="10.255.255.1:443"\r\nLink: <http://10.255.255.1/>; rel=preconnect\r\n'
        )
        unavailable = b"HTTP/1.1 503 Service Unavailable\r\n" + steer + b"Retry-After: 0\r\nContent-Length: 0\r\n\r\n"
        steered = b"HTTP/1.1 200 OK\r\n" + steer + b"Transfer-Encoding: chunked\r\n\r\n" + _F_OK_BODY

        def elsewhere(s):
            s.stream(_f_sequence(reply(unavailable), reply(steered)))
            s.route(
                "GET", "/slots", reply(b"HTTP/1.1 307 Temporary Redirect\r\n" + steer + b"Content-Length: 0\r\n\r\n")
            )

        def redirect(status):
            location = b"http://127.0.0.1:9/v1/chat/completions"  # nothing listens: a followed redirect fails otherwise
            return _d_part(
                _d_reply(_f_head(status, b"Location: " + location + b"\r\nContent-Length: 0\r\n")),
                expect=lc.HTTPStatusError,
            )

        slots = lambda c, ev: c.slots()
        return [
            (
                "the API key could leak",
                [
                    _d_part(_d_stream(unauthorized), expect=lc.HTTPStatusError, client=key),
                    _d_part(_d_reply(b"HELLO\r\n\r\n"), expect=lc.ProtocolError, client=key),
                    _d_part(
                        _d_reply(STREAM_HEAD + chunked(sse(chunk_json({"content": "Hi"}))), True),
                        expect=lc.StalledError,
                        budget=FAST_FAULTS.liveness,
                        client=key,
                    ),
                    _d_part(
                        _d_slots(_d_json({"error": {"code": 401, "message": "Invalid API Key"}}, 401, "Unauthorized")),
                        slots,
                        lc.HTTPStatusError,
                        client=key,
                    ),
                    _d_part(address=_d_missing, act=lambda c, ev: c.props(), expect=lc.ConnectError, client=key),
                    _d_part(address=_d_missing, expect=lc.LoadTimeoutError, budget=FAST_FAULTS.load_wait, client=key),
                    _d_part(expect=ValueError, client={"api_key": _F_KEY + "\r\n"}),
                    _d_part(expect=ValueError, client={"headers": {"Authorization": "Bearer " + _F_KEY + "\n"}}),
                ],
            ),
            (
                "header injection",
                [
                    _d_part(expect=ValueError, client={"headers": {"X-Trace": "1\r\nX-Injected: yes"}}),
                    _d_part(expect=ValueError, client={"headers": {"X-Trace\r\nX-Injected": "1"}}),
                    _d_part(expect=ValueError, client={"headers": {"X-Trace": "1\nX-Injected: yes"}}),
                    _d_part(expect=ValueError, client={"api_key": "key\nX-Injected: yes"}),
                    _d_part(expect=ValueError, address=lambda s: "http://127.0.0.1:8080/\r\nX-Injected: yes"),
                    _d_part(
                        _d_reply(_D_OK),
                        act=lambda c, ev: c.request("GET", "/slots\r\nX-Injected: yes"),
                        expect=ValueError,
                    ),
                ],
            ),
            (
                "a model name carrying CR/LF",
                [_d_part(_d_reply(_D_OK), _d_chat(model="gemma\r\nX-Injected: yes\r\n\r\nGET /slots HTTP/1.1"))],
            ),
            (
                "redirects",
                [
                    redirect(status)
                    for status in (
                        b"301 Moved Permanently",
                        b"302 Found",
                        b"303 See Other",
                        b"307 Temporary Redirect",
                        b"308 Permanent Redirect",
                    )
                ]
                + [
                    _d_part(
                        _d_slots_reply(
                            _f_head(b"302 Found", b"Location: http://127.0.0.1:9/slots\r\nContent-Length: 0\r\n")
                        ),
                        slots,
                        lc.HTTPStatusError,
                    )
                ],
            ),
            ("a response pointing elsewhere", [_d_part(elsewhere), _d_part(elsewhere, slots, lc.HTTPStatusError)]),
        ]

    def _d_fuzz(self):
        def served(name, target):
            data = _f_input(name)
            self.assertTrue(_f_saved(target, data, name))
            return data

        assembler = served("080ec222851097f5", "assembler").decode("utf-8", "surrogatepass").split("\n\x1e")
        return [
            (
                "error body stalls on a held connection",
                [
                    _d_part(
                        _d_pieces(
                            served("e2748cec9571aae2", "client"),
                            _F_CUTS["e2748cec9571aae2"],
                        ),
                        expect=lc.StalledError,
                        budget=FAST_FAULTS.liveness,
                    )
                ],
            ),
            (
                "503 with an error body nested 5,000 deep",
                [
                    _d_part(
                        _d_reply(served("403724efe73ee4d8", "http")),
                        expect=lc.LoadTimeoutError,
                        budget=FAST_FAULTS.load_wait,
                    )
                ],
            ),
            # the assembler's payloads, served as the events of a stream: the first is the error event
            (
                'error code `"²"`',
                [_d_part(_d_reply(STREAM_HEAD + chunked(sse(*assembler)) + b"0\r\n\r\n"), expect=lc.ServerError)],
            ),
            # the SSE bytes, served as a close-delimited stream at the max_line the fuzzer used (and a liveness
            # longer than the parsing: CPU-bound, it is timing otherwise)
            (
                "605,552 `data:` lines in one event",
                [
                    _d_part(
                        _d_reply(_D_CL + b"\r\n" + served("5dff79bad8bec29d", "sse")),
                        expect=lc.StreamClosedError,
                        budget=1.0 * TRACED,
                        at_once=True,
                        changes=dict(max_line=1024 * 1024, liveness=30.0),
                    )
                ],
            ),
            (
                "`event: error` with data nested 100,000 deep",
                [
                    _d_part(
                        _d_reply(served("e517c807fa701495", "http")),
                        expect=lc.ServerError,
                        changes=dict(max_line=1024 * 1024),
                    )
                ],
            ),
            (
                "`event: error` nested deep, through `chat()`",
                [
                    _d_part(
                        _d_pieces(
                            served("0f7c31287867b84c", "client"),
                            _F_CUTS["0f7c31287867b84c"],
                        ),
                        _d_chat(slot=1),
                        lc.ServerError,
                        changes=dict(max_line=64 * 1024, thinking_cap=2, thinking_overrun=4),
                    )
                ],
            ),
        ]

    _D_TABLES = (
        "_d_connecting",
        "_d_head",
        "_d_framing",
        "_d_sse",
        "_d_json_rows",
        "_d_waits",
        "_d_errors",
        "_d_retry_after",
        "_d_slots_rows",
        "_d_control",
        "_d_proxies",
        "_d_fronts",
        "_d_security",
        "_d_fuzz",
    )

    def test_the_comparison_sets_aside_timing_only(self):
        poll = FAST_FAULTS.poll
        differ = lambda a, b: differs_between_clients(a, b, poll)
        done = lc.Completion(CID, MODEL, "Hi", "", [], "stop", None, None)
        waited = lc.LoadTimeoutError("the server at /s stayed unreachable or loading for 0.6 s (load_wait)")
        later = lc.LoadTimeoutError("the server at /s stayed unreachable or loading for 0.9 s (load_wait)")
        late = lc.LoadTimeoutError("the server at /s stayed unreachable or loading for 1.0 s (load_wait)")
        retry = lc.Retrying(1, 0.2, "HTTP 503: Loading model")
        wait = lc.Waiting(False)
        hi = lc.Content("Hi", 0)
        # alike: Retrying's delay, seconds within MARGIN, a run of one Waiting a few polls longer
        self.assertIsNone(differ(([retry, hi], done), ([retry.replace(delay=0.24), hi], done)))
        self.assertIsNone(differ(([retry], waited), ([retry], later if MARGIN >= 0.3 else waited)))
        self.assertIsNone(differ(([wait] * 8, waited), ([wait] * 6, waited)))
        self.assertIsNone(differ(([wait, hi], done), ([hi], done)))  # the head came a poll later
        # one more attempt at the end of the budget, before the same budget error
        self.assertIsNone(differ(([retry], waited), ([retry, lc.Retrying(2, 0.0001, retry.reason)], waited)))
        # different: anything else
        self.assertIn("events differ", differ(([retry, hi], done), ([hi], done)))
        self.assertIn("events differ", differ(([retry], done), ([lc.Retrying(2, 0.2, retry.reason)], done)))
        self.assertIn("events differ", differ(([wait], done), ([lc.Waiting(True)], done)))
        self.assertIn("events differ", differ(([wait] * 20 + [hi], done), ([hi], done)))
        self.assertIn("events differ", differ(([hi, wait], done), ([hi], done)))
        self.assertIn("events differ", differ(([wait] * 20, waited), ([wait], waited)))
        self.assertIn(
            "events differ", differ(([], lc.ProtocolError("x")), ([lc.Retrying(1, 0.0001, "r")], lc.ProtocolError("x")))
        )
        self.assertIn("completion differs", differ(([hi], done), ([hi], done.replace(finish_reason="length"))))
        self.assertIn("outcome differs", differ(([], waited), ([], lc.StalledError(str(waited)))))
        self.assertIn("outcome differs", differ(([hi], done), ([hi], lc.StreamClosedError("closed"))))
        self.assertIn(
            "message differs", differ(([], waited), ([], late if MARGIN < 0.4 else lc.LoadTimeoutError("other")))
        )
        self.assertIn("message differs", differ(([], lc.HTTPStatusError(400, "a")), ([], lc.HTTPStatusError(500, "a"))))
        self.assertIn("message differs", differ(([], lc.ServerError(1, "m")), ([], lc.ServerError(1, "n"))))

    def _d_rows(self):
        return {name: parts for table in self._D_TABLES for name, parts in getattr(self, table)()}

    def test_every_row_of_the_fault_table_is_here(self):
        here = [name for table in self._D_TABLES for name, _ in getattr(self, table)()]
        stated = [row[0] for _, _, rows in FAULT_TABLE for row in rows]
        self.assertEqual(sorted(here), sorted(stated))
        self.assertEqual(len(here), len(set(here)))
        self.assertEqual(len(stated), len(set(stated)))

    def test_dev_faults_md_is_the_fault_table(self):
        with open(os.path.join(HERE, "dev", "FAULTS.md"), encoding="utf-8") as f:
            text = f.read()
        self.assertEqual(text, fault_tables_markdown(text), "dev/FAULTS.md drifted from FAULT_TABLE: run dev/faults.py")

    def test_each_row_states_what_it_runs(self):
        """A row's outcome names the error its parts expect (or says there is none), and the budget it is
        waited out for ("after `liveness`"); its tests exist."""
        budgets = ("liveness", "busy_wait", "load_wait", "idle_grace")
        rows = self._d_rows()
        for heading, _, table in FAULT_TABLE:
            for fault, _, outcome, tests in table:
                with self.subTest(fault):
                    for part in rows[fault]:
                        if heading == "Security":  # its outcomes are properties of every error
                            break
                        if isinstance(part.expect, type) and issubclass(part.expect, BaseException):
                            self.assertIn("`%s`" % part.expect.__name__, outcome)
                        else:
                            self.assertTrue("no error" in outcome or "retried" in outcome, outcome)
                        for name in budgets:
                            if part.budget and not part.at_once and part.budget == getattr(FAST_FAULTS, name):
                                self.assertIn("`%s`" % name, outcome)
                    named = re.findall(r"`(Test\w+)\.(test\w+)`", tests)
                    self.assertTrue(named, tests)
                    for cls, method in named:
                        self.assertTrue(callable(getattr(globals().get(cls), method, None)), "%s.%s" % (cls, method))

    def test_connecting(self):
        self._d_table(self._d_connecting())

    def test_the_response_head(self):
        self._d_table(self._d_head())

    def test_body_framing(self):
        self._d_table(self._d_framing())

    def test_sse_lines_and_events(self):
        self._d_table(self._d_sse())

    def test_json_payloads(self):
        self._d_table(self._d_json_rows())

    def test_silence_pings_and_the_liveness_rule(self):
        self._d_table(self._d_waits())

    def test_error_statuses_and_error_events(self):
        self._d_table(self._d_errors())

    def test_503_with_retry_after(self):
        self._d_table(self._d_retry_after())

    def test_slots_and_the_other_single_shot_calls(self):
        self._d_table(self._d_slots_rows())

    def test_the_reasoning_control_endpoint(self):
        self._d_table(self._d_control())

    def test_security(self):
        self._d_table(self._d_security())

    def test_inputs_the_fuzzer_found(self):
        self._d_table(self._d_fuzz())

    # -- the cases that used to tell the clients apart, and the proxies' rows -------------------------

    def _d_held(self, kind, make, server, limits, slot, steps, **client):
        """Chats held by a Gatekeeper: ``steps`` start them (a marker) and release them (``-marker``), each
        step waiting for what it did to be seen (a release, for the chat to be in flight and to have heard a
        Waiting: how many is timing, whether any is not); a marker in upper case runs in this thread, at
        once (its outcome an error, e.g. BusyError).  Their (events, value), in the order of their markers."""
        client = make(server.address, limits=limits, **client)
        keeper = Gatekeeper(server)
        events, results, threads = {}, {}, []
        try:
            for step in steps:
                if step.startswith("-"):  # once it is in flight and has heard a Waiting (then both clients have)
                    marker = step[1:]
                    wait_for(lambda: keeper.arrived(marker), what=marker + " in flight")
                    wait_for(lambda: any(isinstance(e, lc.Waiting) for e in events[marker]), what=marker + " waiting")
                    keeper.release(marker)
                elif step.isupper():
                    events[step] = []
                    t = Timer()
                    try:
                        results[step] = client.chat(
                            [{"role": "user", "content": step}], slot=slot, on_event=events[step].append
                        )
                    except lc.LoopError as exc:
                        results[step] = exc
                    self.assertLessEqual(t.elapsed, MARGIN, "%s: %s took %.3f s" % (kind, step, t.elapsed))
                else:
                    threads.append(start_chat(client, step, slot, events, results))
                    wait_for(
                        lambda m=step: keeper.arrived(m) or any(isinstance(e, lc.Queued) for e in events[m]), what=step
                    )
            for thread in threads:
                thread.join(10)
        finally:
            for marker in events:
                keeper.release(marker)
            client.close()
        return [(events[m], results[m]) for m in sorted(events)]

    def test_cases_that_used_to_differ(self):
        head_only = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n"
        self._d_row(
            "HEAD with a Content-Length and no body",
            _d_part(
                lambda s: s.route("HEAD", "/health", reply(head_only, hold=True)),
                lambda c, ev: c.request("HEAD", "/health"),
                "",
            ),
        )
        over = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        over += chunked(*[b"[" + b" " * 8190 + b"]"] * 9)  # 72 KiB of chunks, the last chunk never sent
        self._d_row(
            "a chunked single-shot answer over max_body",
            _d_part(_d_slots_reply(over, hold=True), lambda c, ev: c.slots(), lc.ProtocolError),
        )

        held = FAST_FAULTS.replace(idle_grace=5.0, busy_wait=5.0)

        def busy(kind, make, server):
            server.route("GET", "/slots?model=m1", server._slots)
            outcomes = self._d_held(
                kind, make, server, held.replace(queue_len=1), 0, ["a", "b", "C", "-a", "-b"], model="m1"
            )
            self.assertIs(type(outcomes[0][1]), lc.BusyError)
            self.assertEqual(
                str(outcomes[0][1]), "1 requests already wait for slot 0 of model m1 (queue_len 1): try later"
            )
            self.assertEqual([o[1].content for o in outcomes[1:]], ["a", "b"])
            return outcomes

        self._d_both("BusyError for slot 0 of model m1", busy)

        def pool(size):
            def scenario(kind, make, server):
                limits = held if size is None else held.replace(pool=size)
                n = size or len(server.busy)  # without Limits.pool: /props's total_slots
                first = [chr(ord("a") + i) for i in range(n)]
                last = chr(ord("a") + n)
                steps = first + [last] + ["-" + m for m in first + [last]]  # the last one waits, Queued(n)
                outcomes = self._d_held(kind, make, server, limits, None, steps)
                self.assertEqual([o[1].content for o in outcomes], first + [last])
                self.assertEqual([e for e in outcomes[-1][0] if isinstance(e, lc.Queued)], [lc.Queued(n)])
                return outcomes

            return scenario

        self._d_both("a slot=None pool with Limits(pool=3)", pool(3))
        self._d_both("a slot=None pool without Limits.pool", pool(None))

    def test_behind_proxies(self):
        self._d_table(self._d_proxies())

    def test_behind_fronts(self):
        self._d_table(self._d_fronts())

    def _d_fronts(self):
        backoff = 2 * lc.BACKOFF_FIRST + lc.BACKOFF_MAX
        busy = dict(busy_wait=1.0, load_wait=0.1)  # the wrong budget would end a retried 504 early
        load = dict(load_wait=1.0, busy_wait=0.1)

        def then_ok(name):
            answer = front_answer(name)  # a fresh sequence per client: the first would use a shared one up
            return lambda s: s.stream(_f_sequence(reply(answer), reply(answer), reply(_D_OK)))

        def served(name, changes):
            return [_d_part(then_ok(name), budget=backoff, at_once=True, changes=changes)]

        def resumable(s):
            _FrontBuffer(s, load_transcript("04_chat_stream.raw.txt"), posts=[front_answer("nginx 504")])

        def caddy_cut(s):
            buf = _FrontBuffer(s, load_transcript("04_chat_stream.raw.txt"))
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nServer: Caddy\r\nServer: llama.cpp\r\n"
            buf.posts = [head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(buf.body[:900]) + b"0\r\n\r\n"]

        def two_servers(s):
            lists = [[{"id": i, "id_task": 3, "is_processing": False} for i in range(n)] for n in (2, 3)]
            asked = []

            def slots(req):
                asked.append(1)
                respond_json(req, lists[(len(asked) - 1) % 2])

            s.route("GET", "/slots", slots)
            s.stream(_f_hold)

        page = b"<html>\r\n<head><title>403 Forbidden</title></head>\r\n</html>\r\n"
        forbidden = (
            b"HTTP/1.1 403 Forbidden\r\nServer: nginx/1.22.1\r\nContent-Type: text/html\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(page), page)
        )
        return [
            ("504 from nginx, then served", served("nginx 504", busy)),
            ("504 without a `Server` header, then served", served("haproxy 504", busy)),
            ("504 with an empty body, then served", served("caddy 504", busy)),
            ("524, then served", served("cloudflare 524", busy)),
            (
                "504 for ever",
                [
                    _d_part(
                        _d_reply(front_answer("nginx 504")),
                        expect=lc.WaitTimeoutError,
                        budget=0.8,
                        changes=dict(load_wait=0.3),
                    )
                ],
            ),
            (
                "504 to a resumable request the server holds",
                [_d_part(resumable, act=_d_chat(resumable="conv-1"), changes=dict(busy_wait=1.0))],
            ),
            (
                "a resumable stream the front ends cleanly mid-event",
                [_d_part(caddy_cut, act=_d_chat(resumable="conv-1"))],
            ),
            ("502 with an HTML page, then served", served("nginx 502", load)),
            ("502 with an empty body, then served", served("caddy 502", load)),
            ("520 to 523, then served", [p for n in (520, 521, 522, 523) for p in served("cloudflare %d" % n, load)]),
            (
                "502 for ever",
                [
                    _d_part(
                        _d_reply(front_answer("nginx 502")),
                        expect=lc.LoadTimeoutError,
                        budget=0.6,
                        changes=dict(busy_wait=0.2),
                    )
                ],
            ),
            (
                "503 from HAProxy for ever",
                [
                    _d_part(
                        _d_reply(front_answer("haproxy 503")),
                        expect=lc.LoadTimeoutError,
                        budget=0.6,
                        changes=dict(busy_wait=0.2),
                    )
                ],
            ),
            ("an error page from a front", [_d_part(_d_reply(forbidden), expect=lc.HTTPStatusError)]),
            (
                "idle `/slots`, several servers",
                [
                    _d_part(
                        _d_stream(_f_hold),
                        expect=lc.WaitTimeoutError,
                        budget=0.8,
                        changes=dict(servers=2, idle_grace=0.2, load_wait=0.3),
                    )
                ],
            ),
            (
                "`/slots` answers from two servers",
                [
                    _d_part(
                        two_servers,
                        expect=lc.WaitTimeoutError,
                        budget=0.8 + 2 * FAST_FAULTS.poll,
                        at_once=True,
                        changes=dict(idle_grace=0.3, load_wait=0.3),
                    )
                ],
            ),
        ]

    def _d_proxies(self):
        slots = _d_slots(_d_json({"error": {"code": 404, "message": "no slots here", "type": "x"}}, 404, "Not Found"))

        def then_ok(hint):
            return lambda s: s.stream(_f_sequence(reply(_f_too_many(hint)), reply(_f_too_many(hint)), reply(_D_OK)))

        def both(*arrangements):
            return lambda s: [a(s) for a in arrangements]

        backoff = 2 * lc.BACKOFF_FIRST + lc.BACKOFF_MAX
        return [
            (
                "429 at a concurrency limit, then served",
                [
                    _d_part(then_ok(None), budget=backoff, at_once=True),
                    _d_part(then_ok(b"0"), budget=backoff, at_once=True),
                ],
            ),
            (
                "429 for ever",
                [
                    _d_part(
                        _d_reply(_f_too_many(b"0")),
                        expect=lc.WaitTimeoutError,
                        budget=0.8,
                        changes=dict(load_wait=0.3),
                    )
                ],
            ),
            (
                "429 with a hint past `busy_wait`",
                [_d_part(_d_reply(_f_too_many(b"30")), expect=lc.WaitTimeoutError, budget=0.8, at_once=True)],
            ),
            (
                "`/slots` not served",
                [
                    _d_part(
                        both(slots, _d_stream(_f_hold)),
                        expect=lc.WaitTimeoutError,
                        budget=0.8,
                        changes=dict(load_wait=0.3, idle_grace=0.3),
                    )
                ],
            ),
        ]


# =====================================================================================================
# Tier 5. Security: the API key never leaks
# =====================================================================================================


# -- security -----------------------------------------------------------------------------------------


_F_KEY = "sk-loopclient-SECRET-7f3a9c"


@real_time
class TestSecurity(_f_Case):
    VIRTUAL = False  # on real sockets: where the client connects (a spy on socket.connect, a decoy server)

    def _f_keyed(self, address=None):
        self.client.close()
        self.client = self.new_client(address or self.server.address, limits=FAST_FAULTS, api_key=_F_KEY)
        return self.client

    def test_api_key_never_in_errors_reprs_or_logs(self):
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage() + repr(record.args) + repr(record.__dict__))

        root = logging.getLogger()
        keep, level = Keep(logging.DEBUG), root.level
        root.addHandler(keep)
        root.setLevel(logging.DEBUG)
        try:
            client = self._f_keyed()
            errors = []
            self.use(
                lambda req: respond_json(
                    req,
                    {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}},
                    401,
                    "Unauthorized",
                )
            )
            errors.append(self._f_fails(lc.HTTPStatusError))
            self.assertEqual(self.server.chat_requests()[0].headers["authorization"], "Bearer " + _F_KEY)
            self.use(reply(b"HELLO\r\n\r\n"))
            errors.append(self._f_fails(lc.ProtocolError))
            self.use(serve_body(chunked(sse(chunk_json({"content": "Hi"}))), hold=True))
            errors.append(self._f_fails(lc.StalledError, FAST_FAULTS.liveness))
            self.server.route(
                "GET",
                "/slots",
                lambda req: respond_json(
                    req, {"error": {"code": 401, "message": "Invalid API Key"}}, 401, "Unauthorized"
                ),
            )
            errors.append(self._f_fails(lc.HTTPStatusError, fn=lambda ev: client.slots()))
            stream = client.stream(MSGS, slot=0)
            texts = [repr(client), str(client), repr(stream), repr(client.limits)]
            stream.cancel()
            self._f_keyed(os.path.join(self.server.tmp, "missing.sock"))
            errors.append(self._f_fails(lc.ConnectError, fn=lambda ev: self.client.props()))
            errors.append(self._f_fails(lc.LoadTimeoutError, FAST_FAULTS.load_wait))
            for bad in ({"api_key": _F_KEY + "\r\n"}, {"headers": {"Authorization": "Bearer " + _F_KEY + "\n"}}):
                with self.assertRaises(ValueError) as caught:
                    self.new_client(self.server.address, **bad)
                errors.append(caught.exception)
            for err in errors:
                _f_secret_free(self, _F_KEY, err)
            for text in texts + records:
                self.assertNotIn(_F_KEY, text)
        finally:
            root.removeHandler(keep)
            root.setLevel(level)

    def test_crlf_in_header_value_name_key_or_path_refused_before_sending(self):
        with self.assertRaises(ValueError):
            self.new_client(self.server.address, headers={"X-Trace": "1\r\nX-Injected: yes"})
        with self.assertRaises(ValueError):
            self.new_client(self.server.address, headers={"X-Trace\r\nX-Injected": "1"})
        with self.assertRaises(ValueError):
            self.new_client(self.server.address, headers={"X-Trace": "1\nX-Injected: yes"})
        with self.assertRaises(ValueError):
            self.new_client(self.server.address, api_key="key\nX-Injected: yes")
        with self.assertRaises(ValueError):
            self.new_client("http://127.0.0.1:8080/\r\nX-Injected: yes")
        with self.assertRaises(ValueError):
            lc.encode_request("GET", "/slots\r\nX-Injected: yes", "localhost")
        with self.assertRaises(ValueError):
            lc.encode_request("GET", "/slots", "localhost", [("X-A", "1\rX-Injected: yes")])
        self.assertEqual(self.server.requests, [])

    def test_model_name_with_crlf_cannot_inject_a_header(self):
        self.use(serve_body(_F_OK_BODY))
        evil = "gemma\r\nX-Injected: yes\r\n\r\nGET /slots HTTP/1.1"
        self._f_succeeds(model=evil)
        req = self.server.chat_requests()[0]
        self.assertNotIn("x-injected", req.headers)
        self.assertNotIn(b"X-Injected", req.raw_head)
        self.assertNotIn(b"\r", req.body)
        self.assertNotIn(b"\n", req.body)
        self.assertEqual(req.json()["model"], evil)
        self.assertEqual(len(self.server.requests), 1)

    def test_redirects_are_never_followed(self):
        decoy = FakeServer(tcp=True)
        try:
            decoy.stream(serve_body(_F_OK_BODY))
            for status in (
                b"301 Moved Permanently",
                b"302 Found",
                b"303 See Other",
                b"307 Temporary Redirect",
                b"308 Permanent Redirect",
            ):
                location = decoy.address.encode() + b"/v1/chat/completions"
                self.use(reply(_f_head(status, b"Location: " + location + b"\r\nContent-Length: 0\r\n")))
                err = self._f_fails(lc.HTTPStatusError)
                self.assertEqual(err.status, int(status[:3]))
            self.server.route(
                "GET",
                "/slots",
                reply(
                    _f_head(b"302 Found", b"Location: " + decoy.address.encode() + b"/slots\r\nContent-Length: 0\r\n")
                ),
            )
            self.assertEqual(self._f_fails(lc.HTTPStatusError, fn=lambda ev: self.client.slots()).status, 302)
            self.assertEqual(decoy.requests, [])
        finally:
            decoy.close()

    def test_a_response_never_makes_the_client_connect_elsewhere(self):
        seen = []
        original = socket.socket.connect

        def spy(sock, address):
            seen.append(address)
            return original(sock, address)

        steer = (
            b"Location: http://10.255.255.1:9/\r\nContent-Location: unix:///tmp/evil.sock\r\n"
            b'Alt-Svc: h2="10.255.255.1:443"\r\nLink: <http://10.255.255.1/>; rel=preconnect\r\n'
        )
        unavailable = b"HTTP/1.1 503 Service Unavailable\r\n" + steer + b"Retry-After: 0\r\nContent-Length: 0\r\n\r\n"
        stream = b"HTTP/1.1 200 OK\r\n" + steer + b"Transfer-Encoding: chunked\r\n\r\n" + _F_OK_BODY
        self.use(_f_sequence(reply(unavailable), reply(stream)))
        self.server.route(
            "GET", "/slots", reply(b"HTTP/1.1 307 Temporary Redirect\r\n" + steer + b"Content-Length: 0\r\n\r\n")
        )
        socket.socket.connect = spy
        try:
            self._f_succeeds()
            self._f_fails(lc.HTTPStatusError, fn=lambda ev: self.client.slots())
        finally:
            del socket.socket.connect
        self.assertIs(socket.socket.connect, original)
        self.assertTrue(seen)
        self.assertEqual(set(seen), {self.server.path})


class TestSecurityAsync(AsyncDriver, TestSecurity):
    pass


# =====================================================================================================
# Tier 6. The command line
# =====================================================================================================


class QuickLimits(lc.Limits):
    """``lc.Limits`` for the command line in tests: FAST_CLI, with what the command line changes."""

    __slots__ = ()

    def __init__(self, **changes):
        quick = {name: getattr(FAST_CLI, name) for name in lc.Limits.__match_args__}
        quick.update(changes)
        super().__init__(**quick)


class CLICase(ServerCase):
    def run_main(self, argv, stdin="", out=None):
        out, err = out or io.StringIO(), io.StringIO()
        with mock.patch.object(sys, "stdin", io.StringIO(stdin)), mock.patch.object(
            lc, "Limits", QuickLimits
        ), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_with_timeout(lambda: lc.main(argv))
        return code, out.getvalue(), err.getvalue()

    def main_ok(self, *argv, stdin="", out=None):
        code, out, err = self.run_main(["--socket", self.server.path] + list(argv), stdin, out)
        self.assertEqual(code, 0, err)
        return out, err

    def main_fails(self, *argv, address=None, code=1):
        """The error is one line, last on stderr (status lines such as retries may precede it)."""
        got, out, err = self.run_main(["--socket", address or self.server.path] + list(argv))
        self.assertEqual(got, code, (out, err))
        self.assertNotIn("Traceback", err)
        lines = err.splitlines()
        self.assertTrue(lines[-1].startswith("loopclient: "), err)
        self.assertEqual(sum(line.startswith("loopclient: ") for line in lines), 1, err)
        return lines[-1]


class TestCommandLine(CLICase):
    def test_chat_prompt_streams_to_stdout_and_figures_to_stderr(self):
        self.use(serve_body(content_stream(["Hello", " world"])))
        out, err = self.main_ok(
            "chat", "Say hello", "--max-tokens", "8", "--temperature", "0", "--slot", "1", "--system", "Be brief"
        )
        self.assertEqual(out, "Hello world\n")
        self.assertRegex(err, r"^\[8 tokens, first token \d+\.\d\d s, 77\.8 tokens/s, finish: stop\]\n$")
        body = self.server.chat_requests()[0].json()
        self.assertEqual(
            body["messages"], [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say hello"}]
        )
        self.assertEqual((body["max_tokens"], body["temperature"], body["id_slot"]), (8, 0.0, 1))

    def test_chat_reads_a_piped_prompt(self):
        self.use(serve_body(content_stream(["ok"])))
        out, _ = self.main_ok("chat", stdin="from stdin\n")
        self.assertEqual(out, "ok\n")
        self.assertEqual(
            self.server.chat_requests()[0].json()["messages"], [{"role": "user", "content": "from stdin\n"}]
        )
        self.assertNotIn("id_slot", self.server.chat_requests()[0].json())

    def test_chat_json(self):
        self.use(serve_body(content_stream(["a", "b"])))
        out, _ = self.main_ok("chat", "x", "--json")
        doc = json.loads(out)
        self.assertEqual((doc["content"], doc["finish_reason"], doc["id"], doc["usage"]), ("ab", "stop", CID, USAGE))

    def test_chat_reasoning_goes_to_stderr_and_cap_is_sent(self):
        self.server.route("POST", "/v1/chat/completions/control", lambda req: respond_json(req, {"success": True}))
        self.use(serve_body(reasoning_stream(3)))
        out, err = self.main_ok("chat", "think", "--thinking-cap", "2")
        self.assertEqual(out, "yes\n")
        self.assertTrue(err.startswith(" r0 r1\nthinking capped at 2 tokens\n r2\n"), err)
        self.assertTrue(self.server.chat_requests()[0].json()["reasoning_control"])

    def test_waits_and_retries_are_announced(self):
        release = threading.Event()
        self.server.busy[0] = True
        answers = SlotAnswers(self)

        def free():  # once a /slots reading was made on an answer (a busy one): the line is due
            wait_for(lambda: True in answers.answered, 10, "a /slots reading on an answer")
            self.server.busy[0] = False
            release.set()

        threading.Thread(target=free, daemon=True).start()
        self.use(hold_then(content_stream(["done"]), release))
        out, err = self.main_ok("chat", "x", "--slot", "0")
        self.assertEqual(out, "done\n")
        self.assertRegex(err, r"waiting \d+ s: the slot is busy\n")

    @real_time
    def test_slots_table(self):
        looks = []

        def slots(req):
            looks.append(time.monotonic())
            respond_json(
                req,
                [
                    {"id": 0, "id_task": 5, "n_ctx": 1024, "is_processing": True, "next_token": [{"n_decoded": 17}]},
                    {"id": 1, "n_ctx": 1024, "is_processing": False, "next_token": [{"n_decoded": 0}]},
                    {
                        "id": 2,
                        "id_task": 8,
                        "n_ctx": 1024,
                        "is_processing": True,
                        "next_token": [{"n_decoded": len(looks)}],
                    },
                ],
            )

        self.server.route("GET", "/slots", slots)
        out, _ = self.main_ok("slots")  # two looks a poll apart: slot 0 has not moved, slot 2 has
        self.assertEqual(len(looks), 2)
        self.assertRegex(
            out,
            r"^slot  state  task  decoded  n_ctx  still\n0     busy   5     17       1024   0\.\d s\n"
            r"1     idle         0        1024\n2     busy   8     2        1024\n$",
        )
        del looks[:]
        t = Timer()
        out, _ = self.main_ok("slots", "--watch", "0.4")  # past wedge_wait (0.2 s in these tests)
        self.assertGreaterEqual(t.elapsed, 0.4)
        self.assertLess(t.elapsed, 0.4 + lateness(self))
        self.assertGreaterEqual(len(looks), 4)
        self.assertRegex(
            out,
            r"^\d\d:\d\d:\d\d slot 0 busy task 5 decoded 17\n\d\d:\d\d:\d\d slot 1 idle\n"
            r"\d\d:\d\d:\d\d slot 2 busy task 8 decoded 1\n\d\d:\d\d:\d\d slot 0 wedged task 5 decoded 17 still 0\.\d s\n$",
        )

    def test_models_and_tokens(self):
        listing = {
            "object": "list",
            "data": [
                {"id": "alpha", "object": "model", "status": {"value": "loaded"}},
                {"id": "beta-longer", "object": "model", "status": {"value": "unloaded"}},
                {"id": "plain", "object": "model"},
            ],
        }
        self.server.route("GET", "/v1/models", lambda req: respond_json(req, listing))
        out, _ = self.main_ok("models")
        self.assertEqual(out, "model        status\nalpha        loaded\nbeta-longer  unloaded\nplain        loaded\n")
        self.server.route("POST", "/tokenize", lambda req: respond_json(req, {"tokens": [1, 2, 3]}))
        self.assertEqual(self.main_ok("tokens", "a b c")[0], "3\n")
        self.assertEqual(self.main_ok("tokens", stdin="from stdin")[0], "3\n")
        bodies = [r.json() for r in self.server.requests if r.path == "/tokenize"]
        self.assertEqual([b["content"] for b in bodies], ["a b c", "from stdin"])

    @real_time
    def test_model_api_key_and_wait_options(self):
        self.server.route("GET", "/health?model=alpha", lambda req: respond_json(req, {"status": "ok"}))
        code, out, err = self.run_main(["--socket", self.server.path, "--model", "alpha", "--api-key", "k-1", "health"])
        self.assertEqual((code, out), (0, '{"status": "ok"}\n'), err)
        req = self.server.requests[-1]
        self.assertEqual((req.path, req.headers["authorization"]), ("/health?model=alpha", "Bearer k-1"))
        self.use(serve_body(content_stream(["ok"])))
        with mock.patch.dict(os.environ, {"LLAMA_MODEL": "beta", "LLAMA_API_KEY": "k-2"}):
            out, _ = self.main_ok("chat", "x")
        req = self.server.chat_requests()[-1]
        self.assertEqual((out, req.json()["model"], req.headers["authorization"]), ("ok\n", "beta", "Bearer k-2"))
        self.assertIs(req.json()["return_progress"], True)
        t = Timer()
        err = self.main_fails("--wait", "0.6", "chat", "x", address=self.server.tmp + "/none.sock")
        self.assertGreaterEqual(t.elapsed, 0.6)
        self.assertLess(t.elapsed, 0.6 + lateness(self, MARGIN + 0.5))
        self.assertIn("0.6 s (load_wait)", err)

    def test_health_and_props(self):
        self.assertEqual(self.main_ok("health")[0], '{"status": "ok"}\n')
        self.assertEqual(json.loads(self.main_ok("props")[0])["total_slots"], 2)

    def test_url_and_environment(self):
        tcp = FakeServer(tcp=True)
        self.closers.append(tcp.close)
        code, out, _ = self.run_main(["--url", tcp.address, "health"])
        self.assertEqual((code, out), (0, '{"status": "ok"}\n'))
        with mock.patch.dict(os.environ, {"LLAMA_SERVER": self.server.path}):
            code, out, _ = self.run_main(["health"])
        self.assertEqual((code, out), (0, '{"status": "ok"}\n'))

    def test_each_error_is_one_line_and_exit_1(self):
        err = self.main_fails("health", address=self.server.tmp + "/none.sock")
        self.assertIn("no llama-server at %s/none.sock" % self.server.tmp, err)
        self.assertIn("start llama-server, or pass --socket", err)
        err = self.main_fails("chat", "x", address=self.server.tmp + "/none.sock")
        self.assertIn("stayed unreachable or loading", err)
        self.server.route(
            "GET",
            "/health",
            lambda req: respond_json(
                req, {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}, 503, "x"
            ),
        )
        self.assertIn("HTTP 503: Loading model", self.main_fails("health"))
        self.server.route("GET", "/props", reply(b"SSH-2.0-OpenSSH\r\n\r\n"))
        self.assertIn("malformed status line", self.main_fails("props"))
        self.server.route("GET", "/slots", lambda req: req.wait_peer_close(3))
        self.assertIn("no answer", self.main_fails("slots"))
        cases = [
            (chunked(sse(chunk_json({"content": "x"})))[:-5], "closed"),
            (
                chunked(b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n') + b"0\r\n\r\n",
                "boom",
            ),
            (chunked(b"data: {not json\n\n") + b"0\r\n\r\n", "invalid JSON"),
        ]
        for body, text in cases:
            self.use(serve_body(body))
            self.assertIn(text, self.main_fails("chat", "x"))

    def test_usage_errors_exit_2(self):
        for argv in (["bogus"], ["chat", "--slot", "x"], [], ["--url", "ftp://x", "health"]):
            code, out, err = self.run_main(argv)
            self.assertEqual(code, 2, argv)
            self.assertNotIn("Traceback", err)
        code, out, err = self.run_main(["chat", "hi", "--slot", "-1"])  # refused by the call, not argparse
        self.assertEqual((code, out, err), (2, "", "loopclient: error: slot must not be negative\n"))
        self.assertEqual(self.server.chat_requests(), [])
        code, out, _ = self.run_main(["--version"])
        self.assertEqual((code, out), (0, "loopclient %s\n" % lc.__version__))

    def test_answer_options_shape_the_body(self):
        self.use(serve_body(content_stream(["ok"])))
        out, _ = self.main_ok(
            "chat",
            "x",
            "--stop",
            "\\n",
            "--stop",
            "END\\\\n",
            "--ignore-eos",
            "--max-tokens",
            "5",
            "--param",
            "top_k=40",
            "--param",
            'grammar=root ::= "a"',
            "--param",
            "logit_bias=[[1, -1]]",
            "--param",
            'name="8"',
            "--param",
            "max_tokens=9",
            "--param",
            "empty=",
        )
        self.assertEqual(out, "ok\n")
        body = self.server.chat_requests()[0].json()
        self.assertEqual(
            {
                k: body[k]
                for k in ("stop", "ignore_eos", "max_tokens", "top_k", "grammar", "logit_bias", "name", "empty")
            },
            {
                "stop": ["\n", "END\\n"],
                "ignore_eos": True,
                "max_tokens": 9,  # --param is applied last
                "top_k": 40,
                "grammar": 'root ::= "a"',  # not JSON: the text as it is
                "logit_bias": [[1, -1]],
                "name": "8",
                "empty": "",
            },
        )
        self.assertIs(body["return_progress"], True)
        self.use(serve_body(content_stream(["ok"])))
        self.main_ok("chat", "x", "--param", "return_progress=false")
        body = self.server.chat_requests()[1].json()
        self.assertIs(body["return_progress"], False)
        self.assertNotIn("stop", body)
        self.assertNotIn("ignore_eos", body)

    def test_bad_params_are_usage_errors(self):
        cases = [
            (["--param", "top_k"], "loopclient chat: error: argument --param: expected KEY=VALUE, got 'top_k'"),
            (["--param", "=1"], "loopclient chat: error: argument --param: expected KEY=VALUE, got '=1'"),
            (["--param", "stream=false"], "loopclient: error: --param stream: loopclient sets stream itself"),
            (["--param", "messages=[]"], "loopclient: error: --param messages: loopclient sets messages itself"),
            (
                ["--param", "id_slot=1"],
                "loopclient: error: --param id_slot: loopclient sets id_slot itself: use --slot",
            ),
        ]
        for extra, line in cases:
            code, out, err = self.run_main(["--socket", self.server.path, "chat", "x"] + extra)
            self.assertEqual((code, out, err.splitlines()[-1]), (2, "", line), err)
        self.assertEqual(self.server.chat_requests(), [])

    def test_unescape(self):
        for text, want in [
            ("\\n", "\n"),
            ("a\\tb\\r", "a\tb\r"),
            ("\\\\n", "\\n"),
            ("\\x\\", "\\x\\"),
            ("plain", "plain"),
            ("", ""),
        ]:
            self.assertEqual(lc._unescape(text), want, text)

    @real_time
    def test_slots_watch_logs_a_line_per_change(self):
        looks = []
        answers = [
            [
                {"id": 0, "is_processing": False},
                {"id": 1, "id_task": 3, "is_processing": True, "next_token": [{"n_decoded": 1}]},
            ],
            [
                {"id": 0, "id_task": 4, "is_processing": True, "next_token": [{"n_decoded": 0}]},
                {"id": 1, "id_task": 3, "is_processing": True, "next_token": [{"n_decoded": 2}]},
            ],
        ]

        def slots(req):
            looks.append(time.monotonic())
            if len(looks) <= len(answers):
                respond_json(req, answers[len(looks) - 1])
            else:  # slot 0 keeps moving, so it is never wedged; slot 1 is done
                respond_json(
                    req,
                    [
                        {"id": 0, "id_task": 4, "is_processing": True, "next_token": [{"n_decoded": len(looks)}]},
                        {"id": 1, "is_processing": False, "next_token": [{"n_decoded": 9}]},
                    ],
                )

        self.server.route("GET", "/slots", slots)
        t = Timer()
        out, _ = self.main_ok("slots", "--watch", "0.3")
        self.assertLess(t.elapsed, 0.3 + lateness(self))
        self.assertGreaterEqual(len(looks), 4)
        self.assertLessEqual(len(looks), 0.3 / 0.05 + 2)  # one look a poll
        self.assertRegex(out, r"^(\d\d:\d\d:\d\d [^\n]*\n)*$")
        self.assertEqual(
            [line[9:] for line in out.splitlines()],
            ["slot 0 idle", "slot 1 busy task 3 decoded 1", "slot 0 busy task 4 decoded 0", "slot 1 idle"],
        )

    SLOTS_REFUSED = {"error": {"code": 501, "message": "slots endpoint is disabled"}}

    def slots_refused_at(self, refused_looks):
        """/slots answers one idle slot but at the looks numbered in ``refused_looks`` (from 1), which it
        refuses; returns the line a refused look shows and the list of the looks' times."""
        self.server.route("GET", "/slots", lambda req: respond_json(req, self.SLOTS_REFUSED, 501, "Not Implemented"))
        with self.assertRaises(lc.LoopError) as caught:
            lc.Client(self.server.path).slots()
        looks = []

        def slots(req):
            looks.append(time.monotonic())
            if len(looks) in refused_looks:
                respond_json(req, self.SLOTS_REFUSED, 501, "Not Implemented")
            else:
                respond_json(req, [{"id": 0, "is_processing": False}])

        self.server.route("GET", "/slots", slots)
        return "no answer: %s" % caught.exception, looks

    def test_slots_watch_shows_a_look_without_answer_and_goes_on(self):
        refused, looks = self.slots_refused_at((2, 3))  # the server restarting: refused twice, then back
        out, _ = self.main_ok("slots", "--watch", "0.3")
        self.assertGreaterEqual(len(looks), 4)
        self.assertEqual([line[9:] for line in out.splitlines()], ["slot 0 idle", refused, "slot 0 idle"])
        looks.clear()
        out, _ = self.main_ok("slots", "--watch", "0.3", out=TtyText())
        drawings = re.split("\x1b\\[[0-9]+A\r\x1b\\[J", out)
        self.assertEqual(len(drawings), len(looks))
        self.assertGreaterEqual(len(looks), 4)
        tables = [drawing.splitlines()[1:] for drawing in drawings]
        idle = ["slot  state  task  decoded  n_ctx  still", tables[0][1]]
        self.assertRegex(idle[1], r"^0 +idle")
        self.assertEqual(tables, [idle, [refused], [refused]] + [idle] * (len(looks) - 3))

    def test_slots_watch_logs_each_outage_even_when_its_error_is_the_last_ones(self):
        refused, looks = self.slots_refused_at((2, 4))  # two outages with the same error, an answer between
        out, _ = self.main_ok("slots", "--watch", "0.4")
        self.assertGreaterEqual(len(looks), 5)
        lines = ["slot 0 idle", refused, "slot 0 idle", refused, "slot 0 idle"]
        self.assertEqual([line[9:] for line in out.splitlines()], lines)

    def test_slots_watch_redraws_the_table_on_a_terminal(self):
        looks = []

        def slots(req):
            looks.append(time.monotonic())
            respond_json(
                req,
                [
                    {
                        "id": 0,
                        "id_task": 7,
                        "n_ctx": 1024,
                        "is_processing": True,
                        "next_token": [{"n_decoded": len(looks)}],
                    }
                ],
            )

        self.server.route("GET", "/slots", slots)
        out, _ = self.main_ok("slots", "--watch", "0.12", out=TtyText())
        drawings = out.split("\x1b[3A\r\x1b[J")
        self.assertEqual(len(drawings), len(looks))
        self.assertGreaterEqual(len(looks), 3)
        head = "slots of %s, every 0.05 s for 0.12 s  " % self.server.path
        for i, drawing in enumerate(drawings):
            self.assertTrue(drawing.startswith(head), drawing)
            self.assertRegex(
                drawing[len(head) :],
                r"^\d\d:\d\d:\d\d\nslot  state  task  decoded  n_ctx  still\n0     busy   7     %d +1024\n$" % (i + 1),
            )


class TtyText(io.StringIO):
    def isatty(self):
        return True


class TestConsole(unittest.TestCase):
    def test_terminal_status_lines_overwrite_and_reasoning_is_dimmed(self):
        out, err = io.StringIO(), TtyText()
        console = lc._Console(out, err)
        for event in (
            lc.Queued(2),
            lc.Queued(1),
            lc.Retrying(1, 0.25, "HTTP 503: Loading model"),
            lc.Waiting(True),
            lc.Reasoning("hmm"),
            lc.ThinkingCapped(1),
            lc.Reasoning("."),
            lc.Content("Hi"),
            lc.ToolCall(0, "c1", "f", "{"),
            lc.ToolCall(0, None, None, "}"),
        ):
            console.event(event)
        self.assertEqual(out.getvalue(), "Hi\n[tool call 0] f {}")
        text = err.getvalue()
        self.assertTrue(
            text.startswith(
                "\r\x1b[Kqueued: 2 ahead of this request\r\x1b[Kqueued: 1 ahead of this request"
                "\r\x1b[Kretry 1 in 0.2 s: HTTP 503: Loading model\r\x1b[Kwaiting 0 s: the slot is busy"
                "\r\x1b[K\x1b[2mhmm\x1b[0m\n\r\x1b[Kthinking capped at 1 tokens\n\x1b[2m.\x1b[0m\n"
            ),
            text,
        )

    def test_prompt_progress_and_wedged_waits_on_the_status_line(self):
        out, err = io.StringIO(), TtyText()
        console = lc._Console(out, err)
        for event in (
            lc.Waiting(True, wedged=True),
            lc.Progress(0, 8000, 0, 0.0),
            lc.Progress(1234, 8000, 512, 950.5),
            lc.Progress(8000, 8000, 512, 4100.0),
            lc.Content("A"),
        ):
            console.event(event)
        self.assertEqual(
            err.getvalue(),
            "\r\x1b[Kwaiting 0 s: the slot is wedged\r\x1b[Kprompt 0/8,000 tokens, 0%"
            "\r\x1b[Kprompt 1,234/8,000 tokens, 15%\r\x1b[Kprompt 8,000/8,000 tokens, 100%\r\x1b[K",
        )
        self.assertEqual(out.getvalue(), "A")

    def test_the_first_token_completes_a_prompt_that_stopped_short(self):
        """The real server's last progress chunk can say 47 of 51; the first token means the whole prompt."""
        for err, want in [
            (
                TtyText(),
                "\r\x1b[Kprompt 0/51 tokens, 0%\r\x1b[Kprompt 47/51 tokens, 92%\r\x1b[Kprompt 51/51 tokens, 100%\r\x1b[K",
            ),
            (io.StringIO(), "prompt 0/51 tokens, 0%\nprompt 47/51 tokens, 92%\nprompt 51/51 tokens, 100%\n"),
        ]:
            console = lc._Console(io.StringIO(), err)
            for event in (lc.Progress(0, 51, 0, 0.0), lc.Progress(47, 51, 0, 9.0), lc.Content("A"), lc.Content("B")):
                console.event(event)
            self.assertEqual(err.getvalue(), want)

    def test_off_a_terminal_progress_is_a_line_a_quarter(self):
        err = io.StringIO()
        console = lc._Console(io.StringIO(), err)
        for processed in range(0, 8001, 100):
            console.event(lc.Progress(processed, 8000, 0, 0.0))
        console.event(lc.Content("A"))
        self.assertEqual(
            err.getvalue(),
            "prompt 0/8,000 tokens, 0%\nprompt 2,000/8,000 tokens, 25%\nprompt 4,000/8,000 tokens, 50%\n"
            "prompt 6,000/8,000 tokens, 75%\nprompt 8,000/8,000 tokens, 100%\n",
        )
        err = io.StringIO()  # a prompt served from the cache at once: one line, and no second 100%
        console = lc._Console(io.StringIO(), err)
        for event in (lc.Progress(51, 51, 51, 0.0), lc.Content("A")):
            console.event(event)
        self.assertEqual(err.getvalue(), "prompt 51/51 tokens, 100%\n")

    def test_figures(self):
        console = lc._Console(io.StringIO(), io.StringIO())
        completion = lc.Completion(
            "id",
            "m",
            "x",
            "r",
            [],
            "stop",
            None,
            {"predicted_n": 3, "predicted_per_second": 9.5},
            reasoning_tokens=2,
            thinking_capped=True,
        )
        self.assertEqual(console.figures(completion), "[3 tokens, 9.5 tokens/s, 2 reasoning (capped), finish: stop]")


class TestCommandLineInProcess(CLICase):
    def test_conversation_keeps_history(self):
        answers = iter(["Hi there", "Fine"])
        self.use(lambda req: req.send(STREAM_HEAD + content_stream([next(answers)])))
        with mock.patch.object(sys, "stdin", TtyText("hello\n\nhow are you?\n")), contextlib.redirect_stdout(
            io.StringIO()
        ) as out, contextlib.redirect_stderr(io.StringIO()) as err:
            code = run_with_timeout(lambda: lc.main(["--socket", self.server.path, "chat", "--system", "Be kind"]))
        self.assertEqual(code, 0, err.getvalue())
        self.assertEqual(out.getvalue(), "Hi there\nFine\n")
        self.assertEqual(err.getvalue().count("> "), 4)
        self.assertEqual(
            self.server.chat_requests()[1].json()["messages"],
            [
                {"role": "system", "content": "Be kind"},
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "Hi there"},
                {"role": "user", "content": "how are you?"},
            ],
        )

    def test_interrupt_exits_130(self):
        with mock.patch.object(lc.Client, "chat", side_effect=KeyboardInterrupt), contextlib.redirect_stderr(
            io.StringIO()
        ) as err:
            code = lc.main(["--socket", self.server.path, "chat", "hi"])
        self.assertEqual(code, 130)
        self.assertEqual(err.getvalue(), "\nloopclient: interrupted\n")


class TestCommandLineTerminal(ServerCase):
    """The conversation mode, the answer options, the slots view and Ctrl-C, driven through a
    pseudo-terminal (stdin, stdout and stderr all on it, as in a shell)."""

    def spawn(self, *argv):
        """``loopclient.py --socket SERVER argv...`` on a new pty: what it writes collects in ``self.seen``."""
        master, slave = pty.openpty()
        # The child makes the pty its controlling terminal, so that ^C becomes SIGINT as in a real shell, and
        # restores SIGINT's default first: a non-interactive shell starts a background job (nohup ... &) with
        # SIGINT ignored, which the child would inherit (Python then installs no KeyboardInterrupt for it).
        launcher = (
            "import fcntl, os, signal, sys, termios; signal.signal(signal.SIGINT, signal.SIG_DFL); os.setsid(); "
            "fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", launcher, os.path.join(HERE, "loopclient.py"), "--socket", self.server.path]
            + list(argv),
            stdin=slave,
            stdout=slave,
            stderr=slave,
            close_fds=True,
        )
        os.close(slave)
        self.master = master
        self.seen = bytearray()

    def tearDown(self):
        if getattr(self, "master", None) is not None:  # before ServerCase counts the descriptors
            self.reap()
        super().tearDown()

    def reap(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        # drain so the pty closes cleanly
        try:
            while select.select([self.master], [], [], 0)[0] and os.read(self.master, 4096):
                pass
        except OSError:
            pass
        os.close(self.master)

    def read_until(self, needle, count=1, timeout=10):
        deadline = time.monotonic() + timeout
        while self.seen.count(needle) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    "no %r on the terminal; saw %r (exit %r)" % (needle, bytes(self.seen), self.proc.poll())
                )
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    self.seen.extend(os.read(self.master, 4096))
                except OSError:  # the child closed the pty: nothing more will come
                    break

    def read_to_exit(self, timeout=10):
        code = self.proc.wait(timeout)
        while select.select([self.master], [], [], 0.2)[0]:
            try:
                data = os.read(self.master, 4096)
            except OSError:
                break
            if not data:
                break
            self.seen.extend(data)
        return code

    def test_conversation_then_ctrl_c(self):
        turns = []

        def handler(req):
            turns.append(req.json()["messages"])
            if len(turns) == 1:
                req.send(STREAM_HEAD + content_stream(["Hi", " there"]))
            else:
                req.send(STREAM_HEAD + chunked(sse(chunk_json({"content": "thinking..."}))))
                req.wait_peer_close(10)

        self.use(handler)
        self.spawn("chat")
        self.read_until(b"> ")
        os.write(self.master, b"hello\n")
        self.read_until(b"Hi there")
        self.read_until(b"finish: stop]")
        self.read_until(b"> ", count=2)
        os.write(self.master, b"and you?\n")
        self.read_until(b"thinking...")
        os.write(self.master, b"\x03")  # the terminal turns it into SIGINT for the foreground process
        self.assertEqual(self.proc.wait(10), 130)
        self.assertEqual(
            turns[1],
            [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "Hi there"},
                {"role": "user", "content": "and you?"},
            ],
        )
        self.assertTrue(self.server.chat_requests()[1].closed_by_peer.wait(10))

    def test_answer_options_and_prompt_progress_on_a_terminal(self):
        def progress(processed):
            return sse(_p_progress(processed, total=51))

        self.use(serve_body(chunked(progress(0), progress(47)) + content_stream(["Hi", " there"])))
        self.spawn(
            "chat", "x", "--stop", "\\n", "--stop", "Question:", "--ignore-eos", "--max-tokens", "64",
            "--param", "top_k=1", "--param", "samplers=[\"top_k\"]",
        )  # fmt: skip
        self.assertEqual(self.read_to_exit(), 0, bytes(self.seen))
        self.assertRegex(
            bytes(self.seen),
            rb"^\r\x1b\[Kprompt 0/51 tokens, 0%\r\x1b\[Kprompt 47/51 tokens, 92%\r\x1b\[Kprompt 51/51 tokens, 100%"
            rb"\r\x1b\[KHi there\r\n\[8 tokens, first token \d+\.\d\d s, 77\.8 tokens/s, finish: stop\]\r\n$",
        )
        body = self.server.chat_requests()[0].json()
        self.assertEqual(
            {k: body[k] for k in ("stop", "ignore_eos", "max_tokens", "top_k", "samplers", "return_progress")},
            {
                "stop": ["\n", "Question:"],
                "ignore_eos": True,
                "max_tokens": 64,
                "top_k": 1,
                "samplers": ["top_k"],
                "return_progress": True,
            },
        )

    @real_time
    def test_slots_watch_redraws_in_place_until_ctrl_c(self):
        looks = []

        def slots(req):
            looks.append(time.monotonic())
            respond_json(
                req,
                [
                    {
                        "id": 0,
                        "id_task": 7,
                        "n_ctx": 1024,
                        "is_processing": True,
                        "next_token": [{"n_decoded": len(looks)}],
                    }
                ],
            )

        self.server.route("GET", "/slots", slots)
        self.spawn("slots", "--watch")  # every poll (1 s by default) until Ctrl-C
        redraw = b"\x1b[3A\r\x1b[J"  # up over the three lines drawn, clear to the end of the screen
        self.read_until(redraw, count=2)
        os.write(self.master, b"\x03")
        self.assertEqual(self.read_to_exit(), 130)
        drawings = bytes(self.seen).split(redraw)
        self.assertGreaterEqual(len(drawings), 3)
        end = b"^C\r\nloopclient: interrupted\r\n"  # the terminal echoes ^C; then the CLI's line
        self.assertTrue(drawings[-1].endswith(end), drawings[-1])
        drawings[-1] = drawings[-1][: -len(end)]
        head = b"slots of %s, every 1 s until Ctrl-C  " % self.server.path.encode()
        for i, drawing in enumerate(drawings):
            self.assertTrue(drawing.startswith(head), drawing)
            self.assertRegex(
                drawing[len(head) :],
                rb"^\d\d:\d\d:\d\d\r\nslot  state  task  decoded  n_ctx  still\r\n0     busy   7     %d +1024\r\n$"
                % (i + 1),
            )
        gaps = [b - a for a, b in zip(looks, looks[1:])]
        self.assertTrue(all(0.9 < gap < 1.0 + lateness(self) for gap in gaps), gaps)


class TestCommandLineWithoutSSL(CLICase):
    """A Python built without ``ssl``: https:// is a ValueError that says so, from both clients, and one
    line from the command line (exit 1); Unix sockets and http:// need no ssl."""

    NO_SSL = (
        "https:// needs Python's ssl module, which this Python (%s) lacks: use a Python built with ssl "
        "(OpenSSL), or reach the server over http:// or a Unix socket" % sys.executable
    )

    def test_https_without_ssl(self):
        with mock.patch.dict(sys.modules, {"ssl": None}):  # import ssl now raises ImportError
            for cls in (lc.Client, lc.AsyncClient):
                with self.assertRaises(ValueError) as caught:
                    cls("https://127.0.0.1:1")
                self.assertEqual(str(caught.exception), self.NO_SSL)
                self.assertIsInstance(caught.exception.__cause__, ImportError)
            for argv in (["health"], ["chat", "hi"], ["slots", "--watch", "1"]):
                code, out, err = self.run_main(["--url", "https://127.0.0.1:1"] + argv)
                self.assertEqual((code, out, err), (1, "", "loopclient: %s\n" % self.NO_SSL), argv)
            self.assertEqual(self.main_ok("health")[0], '{"status": "ok"}\n')
            tcp = FakeServer(tcp=True)
            self.closers.append(tcp.close)
            self.assertEqual(self.run_main(["--url", tcp.address, "health"])[:2], (0, '{"status": "ok"}\n'))


class TestCommandLineLastRoutes(CLICase):
    """``complete --openai`` (/v1/completions) and ``models --watch`` (a router's /models/sse)."""

    def test_complete_openai_streams_the_text_and_sends_max_tokens(self):
        raw = load_transcript("92_completions_oai_stream_progress.raw.txt")
        self.server.route("POST", "/v1/completions", lambda req: req.send(raw))
        out, err = self.main_ok("complete", "--openai", "The sky is", "--max-tokens", "8", "--slot", "0")
        self.assertEqual(out, " the limit for the 201\n")
        self.assertEqual(err.splitlines()[:2], ["prompt 3/4 tokens, 75%", "prompt 4/4 tokens, 100%"])
        self.assertRegex(
            err.splitlines()[-1], r"^\[8 tokens, first token \d+\.\d\d s, \d+\.\d tokens/s, finish: length\]$"
        )
        (req,) = [r for r in self.server.requests if r.path == "/v1/completions"]
        self.assertEqual(
            req.json(),
            {"prompt": "The sky is", "return_progress": True, "max_tokens": 8, "stream": True, "id_slot": 0},
        )
        self.assertEqual([r.path for r in self.server.requests if r.path == "/completion"], [])

    def test_models_watch_prints_each_event_until_the_router_closes_it(self):
        events = [
            {"model": "beta", "event": "model_status", "data": {"status": "loading"}},
            {"model": "alpha", "event": "status_change", "data": {"status": "loaded"}},
            {"model": "*", "event": "models_reload"},
        ]
        self.server.route("GET", "/models/sse", serve_body(_t_sse(*events) + b"0\r\n\r\n"))
        got, out, err = self.run_main(["--socket", self.server.path, "models", "--watch"])
        self.assertEqual(
            out,
            'beta model_status {"status": "loading"}\nalpha status_change {"status": "loaded"}\n* models_reload\n',
        )
        self.assertEqual(got, 1)
        self.assertIn("/models/sse", err)
        self.assertNotIn("Traceback", err)
        got, out, _ = self.run_main(["--socket", self.server.path, "--model", "beta", "models", "--watch"])
        self.assertEqual(out, 'beta model_status {"status": "loading"}\n* models_reload\n')


class TestCommandLineEndpoints(CLICase):
    """``complete`` and ``infill``: /completion and /infill through ``main(argv)``, on captured bytes."""

    def serve(self, path, name):
        raw = load_transcript(name)
        self.server.route("POST", path, lambda req: req.send(raw))

    def bodies(self, path):
        return [r.json() for r in self.server.requests if r.path == path]

    def text_file(self, name, text):
        path = os.path.join(self.server.tmp, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def test_complete_streams_the_text_to_stdout_and_figures_to_stderr(self):
        self.serve("/completion", "40_completion_stream_tokens_probs.raw.txt")
        out, err = self.main_ok("complete", "The sky is", "--max-tokens", "8", "--temperature", "0", "--slot", "1")
        self.assertEqual(out, " the limit for the 201\n")
        self.assertRegex(err, r"^\[8 tokens, first token \d+\.\d\d s, 20\.2 tokens/s, finish: length\]\n$")
        self.assertEqual(
            self.bodies("/completion"),
            [
                {
                    "prompt": "The sky is",
                    "n_predict": 8,  # --max-tokens, in /completion's own name
                    "temperature": 0.0,
                    "return_progress": True,
                    "stream": True,
                    "id_slot": 1,
                }
            ],
        )

    def test_complete_reads_a_piped_prompt_and_shows_progress(self):
        self.serve("/completion", "41_completion_stream_progress.raw.txt")
        out, err = self.main_ok("complete", stdin="The sky is")
        self.assertEqual(out, " the limit for the 201\n")
        lines = err.splitlines()
        self.assertEqual(lines[:-1], ["prompt 3/4 tokens, 75%", "prompt 4/4 tokens, 100%"])
        self.assertRegex(lines[-1], r"^\[8 tokens, first token \d+\.\d\d s, \d+\.\d tokens/s, finish: length\]$")
        self.assertEqual(
            self.bodies("/completion"), [{"prompt": "The sky is", "return_progress": True, "stream": True}]
        )

    def test_complete_json(self):
        self.serve("/completion", "40_completion_stream_tokens_probs.raw.txt")
        out, err = self.main_ok("complete", "The sky is", "--json", "--param", "return_tokens=true")
        self.assertEqual(err, "")
        doc = json.loads(out)
        self.assertEqual((doc["content"], doc["finish_reason"], doc["id"]), (" the limit for the 201", "length", None))
        self.assertEqual(doc["tokens"], _p_SKY_TOKENS)
        self.assertEqual(doc["final"]["stop_type"], "limit")
        self.assertEqual(
            (doc["usage"]["prompt_tokens"], doc["usage"]["completion_tokens"], doc["usage"]["total_tokens"]), (4, 8, 12)
        )
        self.assertEqual(len(doc["choices"][0]["logprobs"]), 8)
        self.assertIs(self.bodies("/completion")[0]["return_tokens"], True)

    def test_complete_answer_options_shape_the_body(self):
        self.serve("/completion", "46_completion_stream_stop_word.raw.txt")
        out, err = self.main_ok(
            "complete",
            "The sky is",
            "--stop",
            " the",
            "--ignore-eos",
            "--max-tokens",
            "16",
            "--param",
            "n_probs=2",
            "--param",
            'lora=[{"id": 0, "scale": 1.0}]',
        )
        self.assertEqual(out, "\n")  # the stop word held back: no text at all
        self.assertTrue(err.endswith("finish: stop]\n"), err)
        self.assertEqual(
            self.bodies("/completion")[0],
            {
                "prompt": "The sky is",
                "stop": [" the"],
                "ignore_eos": True,
                "n_predict": 16,
                "n_probs": 2,
                "lora": [{"id": 0, "scale": 1.0}],
                "return_progress": True,
                "stream": True,
            },
        )

    def test_param_n_predict_wins_over_max_tokens(self):
        """--param is applied last (its help says so), and n_predict is what --max-tokens becomes."""
        self.serve("/completion", "40_completion_stream_tokens_probs.raw.txt")
        self.main_ok("complete", "x", "--max-tokens", "8", "--param", "n_predict=3")
        self.main_ok("complete", "x", "--param", "max_tokens=5")
        self.main_ok("complete", "x", "--max-tokens", "8", "--param", "max_tokens=5")
        self.assertEqual([b["n_predict"] for b in self.bodies("/completion")], [3, 5, 5])
        self.assertTrue(all("max_tokens" not in b for b in self.bodies("/completion")))

    def test_infill_reads_prefix_and_suffix_files(self):
        self.serve("/infill", "48_infill_stream.raw.txt")
        prefix = self.text_file("prefix.py", "def add(a, b):\n    ")
        suffix = self.text_file("suffix.py", "\n    return c\n")
        out, err = self.main_ok("infill", "--prefix", prefix, "--suffix", suffix, "--max-tokens", "8", "--slot", "0")
        self.assertEqual(out, "\n    " * 4 + "\n")
        self.assertRegex(err, r"^\[8 tokens, first token \d+\.\d\d s, 13\.2 tokens/s, finish: length\]\n$")
        self.assertEqual(
            self.bodies("/infill"),
            [
                {
                    "input_prefix": "def add(a, b):\n    ",
                    "input_suffix": "\n    return c\n",
                    "n_predict": 8,
                    "return_progress": True,
                    "stream": True,
                    "id_slot": 0,
                }
            ],
        )

    def test_infill_reads_stdin_for_dash(self):
        self.serve("/infill", "48_infill_stream.raw.txt")
        out, _ = self.main_ok("infill", "--prefix", "-", stdin="def add(a, b):\n    ")
        self.assertEqual(out, "\n    " * 4 + "\n")
        suffix_first = self.text_file("prefix.py", "def add(a, b):\n    ")
        out, _ = self.main_ok("infill", "--prefix", suffix_first, "--suffix", "-", "--json", stdin="\n    return c\n")
        self.assertEqual(json.loads(out)["tokens"], [107, 140] * 4)
        self.assertEqual(
            [(b["input_prefix"], b["input_suffix"]) for b in self.bodies("/infill")],
            [("def add(a, b):\n    ", ""), ("def add(a, b):\n    ", "\n    return c\n")],
        )

    def test_infill_extra_files_through_param(self):
        self.serve("/infill", "48_infill_stream.raw.txt")
        prefix = self.text_file("prefix.py", "def add(a, b):\n    ")
        self.main_ok(
            "infill",
            "--prefix",
            prefix,
            "--param",
            'input_extra=[{"filename": "util.py", "text": "def sub(): pass\\n"}]',
        )
        self.assertEqual(
            self.bodies("/infill")[0]["input_extra"], [{"filename": "util.py", "text": "def sub(): pass\n"}]
        )

    def test_infill_on_a_model_without_fim_tokens_is_one_line(self):
        self.serve("/infill", "49_infill_not_supported.raw.txt")
        prefix = self.text_file("prefix.py", "def add(a, b):\n    ")
        line = self.main_fails("infill", "--prefix", prefix)
        self.assertIn("HTTP 501: Infill is not supported by this model: prefix token is missing.", line)
        self.assertEqual(len(self.bodies("/infill")), 1)

    def test_usage_errors_exit_2_and_send_nothing(self):
        prefix = self.text_file("prefix.py", "x")
        cases = [
            (["infill"], "loopclient infill: error: the following arguments are required: --prefix"),
            (
                ["infill", "--prefix", self.server.tmp + "/missing.py"],
                "loopclient: error: cannot read %s/missing.py: No such file or directory" % self.server.tmp,
            ),
            (
                ["infill", "--prefix", prefix, "--suffix", self.server.tmp],
                "loopclient: error: cannot read %s: Is a directory" % self.server.tmp,
            ),
            (
                ["complete", "x", "--param", "prompt=y"],
                "loopclient: error: --param prompt: loopclient sets prompt itself",
            ),
            (
                ["infill", "--prefix", prefix, "--param", "input_prefix=y"],
                "loopclient: error: --param input_prefix: loopclient sets input_prefix itself",
            ),
            (
                ["infill", "--prefix", prefix, "--param", "input_suffix=y"],
                "loopclient: error: --param input_suffix: loopclient sets input_suffix itself",
            ),
            (
                ["complete", "x", "--param", "stream=false"],
                "loopclient: error: --param stream: loopclient sets stream itself",
            ),
            (["complete", "x", "--slot", "-1"], "loopclient: error: slot must not be negative"),
            (
                ["infill", "--prefix", prefix, "--param", 'input_extra={"a": 1}'],
                "loopclient: error: extra must be an iterable of (filename, text) pairs or dicts, not {'a': 1}",
            ),
        ]
        for argv, line in cases:
            with self.subTest(argv=argv):
                code, out, err = self.run_main(["--socket", self.server.path] + argv)
                self.assertEqual((code, out, err.splitlines()[-1]), (2, "", line), err)
                self.assertNotIn("Traceback", err)
        self.assertEqual([r.path for r in self.server.requests if r.method == "POST"], [])


class RealTierSummary(unittest.TestSuite):
    """This module's tests, as ``load_tests`` hands them to unittest.  The tests run in worker processes
    (ParallelRun), then the real tier in this process.  When real-server tests (classes named ``TestReal*``)
    were skipped, one line on stderr at exit, after unittest's own summary, says how many and which of the
    variables this file reads (``LOOPCLIENT_REAL_*``) are unset."""

    def run(self, result, debug=False):
        if debug:
            return super().run(result, debug)
        tests = list(_flat_tests(self))
        real = [test for test in tests if type(test).__name__.startswith("TestReal")]
        others = [test for test in tests if not type(test).__name__.startswith("TestReal")]
        jobs = _test_jobs()
        load = BusyLoad.for_run()
        try:
            if jobs > 1 and len(others) > 1:
                ParallelRun(others, jobs).run(result)
                result = unittest.TestSuite(real).run(result)
            else:
                result = unittest.TestSuite(tests).run(result)
        finally:
            load.stop()
        if not getattr(self, "_summary", False):
            self._summary = True
            import atexit  # only for this line at the end of a run

            atexit.register(self.report, result)
        return result

    @staticmethod
    def report(result):
        real = "TestReal"  # the README's examples (TestRealReadmeExamples) run against the real demo server too
        skipped = [test for test, _ in result.skipped if type(test).__name__.startswith(real)]
        if skipped:
            import re

            with open(__file__, encoding="utf-8") as source:
                names = dict.fromkeys(re.findall(r"\bLOOPCLIENT_REAL_[A-Z_]+\b", source.read()))
            unset = [name for name in names if not os.environ.get(name)]
            sys.stderr.write(
                "test_loopclient: %d real-server tests were skipped; to run them set %s "
                "(dev/llama-server.sh starts the servers, .ci/run does it all; dev/TESTING.md)\n"
                % (len(skipped), ", ".join(unset) or "the LOOPCLIENT_REAL_* variables")
            )


def _flat_tests(suite):
    """The test cases in ``suite``, in order (suites within suites opened)."""
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            yield from _flat_tests(test)
        else:
            yield test


class BusyLoad:
    """``LOOPCLIENT_TEST_LOAD=N``: N processes beside the run, each keeping a CPU busy (a Python loop), so
    that a test that holds only on an idle machine fails in CI rather than on a user's loaded one.  The
    run starts them once (``RealTierSummary.run``, or ``setUpModule`` when tests are named on the command
    line) and stops them when it ends, whatever ends it (``stop()`` in a ``finally``, and at exit); each
    also ends by itself as soon as the process that started it is gone (a run killed by a signal), and
    after ``LIFETIME`` seconds at most."""

    LIFETIME = 2 * 3600
    SPIN = (
        "import os, sys, time\n"
        "parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])\n"
        "while os.getppid() == parent and time.monotonic() < end:\n"
        "    for _ in range(100000):\n"
        "        pass\n"
    )
    #: the run's load: started by the first ``for_run()`` of a run (a worker process made by fork sees it
    #: started, and leaves it to the process that started it)
    current = None

    def __init__(self, count, lifetime=LIFETIME):
        self.count, self.lifetime, self.owner, self.procs = count, lifetime, os.getpid(), []

    @classmethod
    def for_run(cls):
        """The run's load, started on the first call (none when LOOPCLIENT_TEST_LOAD is unset or 0)."""
        if cls.current is None:
            count = int(os.environ.get("LOOPCLIENT_TEST_LOAD") or 0)
            cls.current = cls(count)
            if count > 0:
                cls.current.start()
                sys.stderr.write(
                    "test_loopclient: LOOPCLIENT_TEST_LOAD=%d: %d busy processes beside the run\n" % (count, count)
                )
        return cls.current

    def start(self):
        import atexit  # only when a load runs

        argv = [sys.executable, "-S", "-c", self.SPIN, str(os.getpid()), str(self.lifetime)]
        atexit.register(self.stop)
        for _ in range(self.count):
            self.procs.append(
                subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        return self

    def stop(self):
        """End the busy processes and reap them; only in the process that started them; idempotent."""
        if os.getpid() != self.owner:
            return
        procs, self.procs = self.procs, []
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(10)


def setUpModule():
    BusyLoad.for_run()  # tests named on the command line: no load_tests hook, the load starts here


def tearDownModule():
    BusyLoad.for_run().stop()


def _test_jobs():
    """How many worker processes run the tests: LOOPCLIENT_TEST_JOBS, or by default twice the CPUs (most of a
    test's time is spent waiting on sockets and budgets), at most 4; 1 runs them all in this process, in
    order, as unittest does.  Workers are made by fork, so where there is none, 1."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    wanted = os.environ.get("LOOPCLIENT_TEST_JOBS")
    if wanted:
        return max(1, int(wanted))
    return max(1, min(4, 2 * (os.cpu_count() or 1)))


class RemoteFailure(AssertionError):
    """A test's failure in a worker process: ``test_id`` the test's id, ``text`` the worker's traceback of
    it, which the parent's result prints as it is (``_verbatim``)."""

    def __init__(self, test_id, text):
        super().__init__(test_id, text)
        self.test_id, self.text = test_id, text

    def __str__(self):
        return self.text


class RemoteError(Exception):
    """A test's error in a worker process (or the worker's death): ``test_id`` and ``text`` as for
    RemoteFailure."""

    def __init__(self, test_id, text):
        super().__init__(test_id, text)
        self.test_id, self.text = test_id, text

    def __str__(self):
        return self.text


@contextlib.contextmanager
def _verbatim(result):
    """While ``result`` takes a worker's outcomes: a failure replayed from a worker is formatted as the
    worker's own traceback text, as a run in one process prints it (titled by the test's exception, not by
    RemoteFailure, which has no traceback in this process).  unittest's results format every error through
    their ``_exc_info_to_string``; any other exception goes through theirs."""
    own = getattr(result, "_exc_info_to_string", None)
    if own is None:  # not a unittest.TestResult: str(exception) is the traceback text all the same
        yield
        return
    kept = vars(result).get("_exc_info_to_string")

    def text(err, test):
        if isinstance(err[1], (RemoteFailure, RemoteError)):
            return err[1].text
        return own(err, test)

    result._exc_info_to_string = text
    try:
        yield
    finally:
        if kept is None:
            del result._exc_info_to_string
        else:
            result._exc_info_to_string = kept


class RemoteSubTest:
    """A failed subtest of a worker's test, as the parent's result prints it."""

    failureException = AssertionError  # read by TextTestResult.addSubTest (3.11+) to print FAIL or ERROR

    def __init__(self, test, description, subtest_id):
        self.test, self.description, self.subtest_id = test, description, subtest_id

    def id(self):
        return self.subtest_id

    def shortDescription(self):
        return None

    def __str__(self):
        return self.description


class _Recorder(unittest.TestResult):
    """A worker's result: each call as a record the parent replays into its own result."""

    def __init__(self, index, buffer):
        super().__init__()
        self.index, self.buffer, self.records = index, buffer, []

    def _key(self, test):
        return self.index.get(id(test), str(test))  # a test, or an _ErrorHolder's description

    def startTest(self, test):
        super().startTest(test)
        self.records.append(("start", self._key(test), time.monotonic()))

    def stopTest(self, test):
        super().stopTest(test)
        self.records.append(("stop", self._key(test), time.monotonic()))

    def addSuccess(self, test):
        self.records.append(("success", self._key(test)))

    def addFailure(self, test, err):
        self.records.append(("failure", self._key(test), self._exc_info_to_string(err, test)))

    def addError(self, test, err):
        self.records.append(("error", self._key(test), self._exc_info_to_string(err, test)))

    def addSkip(self, test, reason):
        self.records.append(("skip", self._key(test), reason))

    def addExpectedFailure(self, test, err):
        self.records.append(("expected failure", self._key(test), self._exc_info_to_string(err, test)))

    def addUnexpectedSuccess(self, test):
        self.records.append(("unexpected success", self._key(test)))

    def addSubTest(self, test, subtest, err):
        if err is not None:
            kind = "subfailure" if issubclass(err[0], test.failureException) else "suberror"
            text = self._exc_info_to_string(err, test)
            self.records.append((kind, self._key(test), str(subtest), text, subtest.id()))


class ParallelRun:
    """Runs ``tests`` in ``jobs`` worker processes made by fork, and replays each test's outcome into the
    caller's result as the test ends: the same lines, counts and failure texts as a run in one process.

    A task is one test, or a whole class when the class has fixtures of its own (setUpClass), so that they
    run once.  Workers take the next task from a shared counter, so a long test holds up only its worker.
    A worker that dies (a crash, os._exit) fails the test it was running, and the tasks it did not take are
    taken by the others, or run here when none is left."""

    def __init__(self, tests, jobs):
        self.tests = tests
        self.index = {id(test): i for i, test in enumerate(tests)}
        tasks, classes = [], {}
        for i, test in enumerate(tests):
            cls = type(test)
            if cls.setUpClass.__func__ is unittest.TestCase.setUpClass.__func__:
                tasks.append([i])
            elif cls in classes:
                classes[cls].append(i)
            else:
                classes[cls] = [i]
                tasks.append(classes[cls])
        self.tasks, self.jobs = tasks, min(jobs, len(tasks))

    def run(self, result):
        import multiprocessing
        from multiprocessing.connection import wait

        context = multiprocessing.get_context("fork")
        counter = context.Value("i", 0)
        sys.stdout.flush()
        sys.stderr.flush()
        workers = {}
        for _ in range(self.jobs):
            ours, theirs = context.Pipe(duplex=False)
            process = context.Process(target=self._work, args=(counter, theirs, getattr(result, "buffer", False)))
            process.start()
            theirs.close()
            workers[ours] = [process, None]  # the task it is running
        try:
            while workers:
                for conn in wait(list(workers)):
                    try:
                        message = conn.recv()
                    except EOFError:
                        process, task = workers.pop(conn)
                        process.join(10)
                        if task is not None:
                            self._died(result, task, process.exitcode)
                        conn.close()
                        continue
                    if message[0] == "task":
                        workers[conn][1] = message[1]
                    else:
                        workers[conn][1] = None
                        self._replay(result, message[1])
                if result.shouldStop:
                    break
        finally:
            for conn, (process, _) in workers.items():
                process.terminate()
                process.join(10)
                conn.close()
        with counter.get_lock():
            left, counter.value = counter.value, len(self.tasks)
        if not result.shouldStop:
            unittest.TestSuite([self.tests[i] for task in self.tasks[left:] for i in task]).run(result)
        return result

    def _work(self, counter, conn, buffer):
        while True:
            with counter.get_lock():
                number = counter.value
                counter.value += 1
            if number >= len(self.tasks):
                break
            task = self.tasks[number]
            conn.send(("task", task))
            recorder = _Recorder(self.index, buffer)
            unittest.TestSuite([self.tests[i] for i in task]).run(recorder)
            conn.send(("done", recorder.records))
        conn.close()

    def _test(self, key):
        return self.tests[key] if isinstance(key, int) else unittest.suite._ErrorHolder(key)

    def _replay(self, result, records):
        with _verbatim(result):
            self._replay_records(result, records)

    def _replay_records(self, result, records):
        started = {}
        for record in records:
            kind, test = record[0], self._test(record[1])
            if kind == "start":
                started[record[1]] = record[2]
                result.startTest(test)
            elif kind == "stop":
                if hasattr(result, "addDuration"):  # 3.12: python -m unittest --durations N
                    result.addDuration(test, record[2] - started.pop(record[1], record[2]))
                result.stopTest(test)
            elif kind == "success":
                result.addSuccess(test)
            elif kind == "failure":
                result.addFailure(test, (RemoteFailure, RemoteFailure(test.id(), record[2]), None))
            elif kind == "error":
                result.addError(test, (RemoteError, RemoteError(test.id(), record[2]), None))
            elif kind == "skip":
                result.addSkip(test, record[2])
            elif kind == "expected failure":
                result.addExpectedFailure(test, (RemoteFailure, RemoteFailure(test.id(), record[2]), None))
            elif kind == "unexpected success":
                result.addUnexpectedSuccess(test)
            else:
                error = RemoteFailure if kind == "subfailure" else RemoteError
                sub = RemoteSubTest(test, record[2], record[4])
                result.addSubTest(test, sub, (error, error(sub.id(), record[3]), None))

    def _died(self, result, task, code):
        why = "the worker process running this test ended (exit code %s) before the test did\n" % code
        with _verbatim(result):
            for i in task:
                test = self.tests[i]
                result.startTest(test)
                result.addError(test, (RemoteError, RemoteError(test.id(), why), None))
                result.stopTest(test)


def _worker_outcomes():
    """A test class with each outcome a test can have, for TestParallelRun.  Made when that test runs, so
    that the loader, which collects every TestCase subclass at module level, never runs it."""

    class WorkerOutcomes(unittest.TestCase):
        def test_a_pass(self):
            pass

        def test_b_fail(self):
            self.assertEqual(1, 2)

        def test_c_error(self):
            raise KeyError("k")

        def test_d_skip(self):
            self.skipTest("why")

        def test_e_subtests(self):
            for i in range(3):
                with self.subTest(i=i):
                    self.assertNotEqual(i, 1)

        def test_f_dies(self):
            os._exit(7)

        def test_g_pass(self):
            pass

    return WorkerOutcomes


_PARALLEL_OUTCOMES = """
import io, json, sys, unittest
sys.path.insert(0, sys.argv[1])
import test_loopclient as t
cls = t._worker_outcomes()
tests = [cls(name) for name in unittest.defaultTestLoader.getTestCaseNames(cls)]
stream = io.StringIO()
result = t.ParallelRun(tests, 2).run(unittest.TextTestResult(unittest.runner._WritelnDecorator(stream), True, 2))
result.printErrors()
alone = unittest.TextTestResult(unittest.runner._WritelnDecorator(io.StringIO()), True, 2)
unittest.TestSuite([cls(name) for name in unittest.defaultTestLoader.getTestCaseNames(cls) if name != "test_f_dies"]).run(alone)
name = lambda test: str(test).split(" ", 1)[0]
texts = lambda pairs: [[str(t), text, t.id()] for t, text in pairs]
print(json.dumps({
    "run": result.testsRun, "printed": stream.getvalue(), "skipped": [[name(t), why] for t, why in result.skipped],
    "failures": texts(result.failures), "errors": texts(result.errors),
    "alone": texts(alone.failures) + texts(alone.errors),
}))
"""


class TestParallelRun(unittest.TestCase):
    """ParallelRun replays what its workers' tests did into the caller's result, here a verbose TextTestResult
    (what ``python3 -m unittest -v`` and .ci/run print).  It runs in a process of its own: forking, as
    ParallelRun does, is safe only in a process with no other thread, and a test runs beside the suite's."""

    def test_worker_outcomes_are_replayed_into_the_callers_result(self):
        argv = [sys.executable] + (["-S"] if sys.flags.no_site else []) + ["-c", _PARALLEL_OUTCOMES, HERE]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=HERE)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertNotIn("DeprecationWarning", done.stderr)
        got = json.loads(done.stdout.splitlines()[-1])
        self.assertEqual(got["run"], 7)
        self.assertEqual(got["skipped"], [["test_d_skip", "why"]])
        failures = {t: text for t, text, _ in got["failures"]}
        errors = {t: text for t, text, _ in got["errors"]}
        self.assertEqual(sorted(t.split(" ")[0] for t in failures), ["test_b_fail", "test_e_subtests"])
        self.assertEqual(sorted(t.split(" ")[0] for t in errors), ["test_c_error", "test_f_dies"])
        subtest = [t for t in failures if t.startswith("test_e_subtests")]
        self.assertTrue(subtest[0].endswith("(i=1)"), subtest)
        texts = {t.split(" ")[0]: text for t, text in list(failures.items()) + list(errors.items())}
        self.assertIn("AssertionError: 1 != 2", texts["test_b_fail"])
        self.assertIn("AssertionError: 1 == 1", texts["test_e_subtests"])
        self.assertIn("KeyError: 'k'", texts["test_c_error"])
        self.assertIn("exit code 7", texts["test_f_dies"])
        out = got["printed"]
        for test, status in [("a_pass", "ok"), ("b_fail", "FAIL"), ("c_error", "ERROR"), ("d_skip", "skipped 'why'")]:
            self.assertRegex(out, r"test_%s \(.*\) \.\.\. %s\n" % (test, re.escape(status)))
        self.assertRegex(out, r"FAIL: test_e_subtests \(.*\) \(i=1\)\n")
        self.assertRegex(out, r"ERROR: test_f_dies \(.*\)\n")
        # each failure as a run in one process gives it: the test's own id and its own traceback, titled by
        # the test's exception, not by the class that carried it from the worker
        replayed = {t: (text, i) for t, text, i in got["failures"] + got["errors"] if not t.startswith("test_f_dies")}
        self.assertEqual(replayed, {t: (text, i) for t, text, i in got["alone"]})
        self.assertNotIn("Remote", out)
        for t in replayed:
            self.assertTrue(replayed[t][0].startswith("Traceback (most recent call last):\n"), replayed[t][0])
        self.assertRegex(out, r"ERROR: test_f_dies \(.*\)\n-{70}\nthe worker process running this test ended")


def _busy_children(pid):
    """The pids of the running busy processes (BusyLoad) whose parent is ``pid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open("/proc/%s/cmdline" % name, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == pid and fields[0] != b"Z" and BusyLoad.SPIN.encode() in argv:
            found.append(int(name))
    return sorted(found)


def _ended(pid):
    """The process ``pid`` is gone, or a zombie (its parent gone, nobody reaped it yet)."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def _cpu_seconds(pid):
    with open("/proc/%d/stat" % pid, "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_LOAD_RUN = """
import os, sys, unittest
sys.path.insert(0, sys.argv[1])
import test_loopclient as t
main = os.getpid()

class Seen(unittest.TestCase):
    def test_a(self):
        with open(sys.argv[2], "a") as f:
            f.write("%d %s\\n" % (os.getpid(), t._busy_children(main)))

    test_b = test_a

tests = [Seen("test_a"), Seen("test_b")]
result = t.RealTierSummary(tests).run(unittest.TestResult())
print(main, result.testsRun, len(result.failures + result.errors), t._busy_children(main))
"""


class TestBusyLoad(unittest.TestCase):
    """LOOPCLIENT_TEST_LOAD=N runs N busy processes beside the tests, for as long as the run, never longer."""

    def test_the_run_starts_them_and_stops_them(self):
        seen = os.path.join(tempfile.mkdtemp(prefix="lcload"), "seen")
        self.addCleanup(shutil.rmtree, os.path.dirname(seen))
        argv = [sys.executable] + (["-S"] if sys.flags.no_site else []) + ["-c", _LOAD_RUN, HERE, seen]
        env = dict(os.environ, LOOPCLIENT_TEST_LOAD="3", LOOPCLIENT_TEST_JOBS="2")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=HERE, env=env)
        self.assertEqual(done.returncode, 0, done.stderr)
        main, outcome = done.stdout.strip().split(" ", 1)
        self.assertEqual(outcome, "2 0 []")  # two tests passed; no busy process left once it ran
        self.assertIn("LOOPCLIENT_TEST_LOAD=3: 3 busy processes beside the run", done.stderr)
        with open(seen, encoding="ascii") as f:
            lines = [line.split(" ", 1) for line in f.read().splitlines()]
        self.assertEqual(len(lines), 2)
        self.assertNotIn(main, [line[0] for line in lines])  # in worker processes
        busy = [json.loads(line[1]) for line in lines]
        self.assertEqual(busy[0], busy[1])  # the same three all through the run
        self.assertEqual(len(busy[0]), 3)
        self.assertTrue(all(_ended(pid) for pid in busy[0]))

    def test_without_the_variable_there_is_none(self):
        env = {k: v for k, v in os.environ.items() if k != "LOOPCLIENT_TEST_LOAD"}
        seen = os.path.join(tempfile.mkdtemp(prefix="lcload"), "seen")
        self.addCleanup(shutil.rmtree, os.path.dirname(seen))
        argv = [sys.executable] + (["-S"] if sys.flags.no_site else []) + ["-c", _LOAD_RUN, HERE, seen]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=HERE, env=env)
        self.assertEqual(done.returncode, 0, done.stderr)
        with open(seen, encoding="ascii") as f:
            self.assertEqual([line.split(" ", 1)[1] for line in f.read().splitlines()], ["[]", "[]"])
        self.assertNotIn("busy processes", done.stderr)

    def test_each_keeps_a_cpu_busy_until_stopped(self):
        load = BusyLoad(2, lifetime=60).start()
        self.addCleanup(load.stop)
        pids = [proc.pid for proc in load.procs]
        self.assertEqual(_busy_children(os.getpid()), sorted(pids))
        wait_for(lambda: all(_cpu_seconds(pid) >= 0.2 for pid in pids), 30, "both to use CPU")
        load.stop()
        self.assertTrue(all(_ended(pid) for pid in pids))
        self.assertEqual(load.procs, [])
        load.stop()  # again: nothing to do

    def test_one_ends_with_the_process_that_started_it(self):
        # a run killed by a signal stops nothing: its busy processes see their parent gone and end
        script = "import os, sys; sys.path.insert(0, sys.argv[1]); import test_loopclient as t\n"
        script += "load = t.BusyLoad(1).start(); print(load.procs[0].pid, flush=True); os._exit(0)\n"
        argv = [sys.executable] + (["-S"] if sys.flags.no_site else []) + ["-c", script, HERE]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=HERE)
        self.assertEqual(done.returncode, 0, done.stderr)
        pid = int(done.stdout)
        wait_for(lambda: _ended(pid), 30, "the orphaned busy process to end")

    def test_one_ends_after_its_lifetime(self):
        load = BusyLoad(1, lifetime=0.2).start()
        self.addCleanup(load.stop)
        self.assertEqual(load.procs[0].wait(30), 0)


def load_tests(loader, tests, pattern):
    return RealTierSummary([tests])


# =====================================================================================================
# Tier 7. Against a real llama-server (LOOPCLIENT_REAL_SOCKET, and LOOPCLIENT_REAL_URL for TCP; see .ci/run)
# =====================================================================================================


REAL_SOCKET = os.environ.get("LOOPCLIENT_REAL_SOCKET")


REAL_URL = os.environ.get("LOOPCLIENT_REAL_URL")


SKIP_REAL = "no real llama-server: run dev/llama-server.sh start and set LOOPCLIENT_REAL_SOCKET (.ci/run does)"


QUESTION = [{"role": "user", "content": "Think step by step: is the sky blue?"}]


def real_token_ids(client, text):
    """The token ids the real server gives ``text`` (special tokens parsed, no BOS added)."""
    return client.tokenize(text, add_special=False, parse_special=True)


def grammar(client, reps):
    """Reasoning forced as the model's own tokens: ``<think>``, ``reps`` letters, ``</think>``, the answer.

    The tags are written as token ids from the running server; the text "<think>" in a grammar tokenizes
    differently, and then no thinking budget or control ever triggers."""

    def tokens(text):
        return " ".join("<[%d]>" % i for i in real_token_ids(client, text))

    return 'root ::= %s [a-z ]{%s} %s "the answer is yes"' % (tokens("<think>"), reps, tokens("</think>"))


def no_natural_close(client):
    """A ``logit_bias`` that keeps the model from writing ``</think>`` itself before the grammar's most.

    Unforced, the model thinks "step by step" (3 tokens) and closes; a thinking cap of 3 then races the
    model's own close, and the server, injecting a second ``</think>``, fails the grammar (HTTP 500
    "Unexpected empty grammar stack").  With the close's first token biased away, only the cap (or the
    grammar's upper bound) ends reasoning."""
    return [[real_token_ids(client, "</think>")[0], -100]]


WEATHER_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def real_server_command(sock_path):
    """The command that starts another instance of the provisioned server on ``sock_path``."""
    script = os.path.join(HERE, "dev", "llama-server.sh")
    binary = subprocess.run([script, "path"], capture_output=True, text=True, timeout=60, check=True).stdout.split(
        "\n"
    )[0]
    args = subprocess.run([script, "args"], capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    return [binary] + args + ["--host", sock_path]


class TestRealServerConfigured(unittest.TestCase):
    def test_ci_runs_the_real_tier(self):
        """Under CI (LOOPCLIENT_REQUIRE_REAL=1) the real tier must run, not skip."""
        if not os.environ.get("LOOPCLIENT_REQUIRE_REAL"):
            self.skipTest("the real tier is optional outside CI")
        self.assertTrue(REAL_SOCKET, "LOOPCLIENT_REAL_SOCKET is not set")
        self.assertTrue(REAL_URL, "LOOPCLIENT_REAL_URL is not set")
        with lc.Client(REAL_SOCKET) as client:
            self.assertEqual(client.health(), {"status": "ok"})


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealServer(ClientFactory, unittest.TestCase):
    limits = lc.Limits(poll=0.2, liveness=20.0, busy_wait=60.0, load_wait=60.0, idle_grace=20.0)

    def setUp(self):
        self.client = self.new_client(REAL_SOCKET, limits=self.limits)
        self.fds = fd_count()
        wait_for(
            lambda: not any(s.is_processing for s in self.client.slots()), 30, "the real server's slots to be idle"
        )

    def tearDown(self):
        self.client.close()

    def chat(self, client=None, messages=MSGS, timeout=60, **kw):
        events = []
        completion = run_with_timeout(
            lambda: (client or self.client).chat(messages, on_event=events.append, **kw), timeout
        )
        return completion, events

    def streamed_equals_unstreamed(self, client):
        params = {"max_tokens": 24, "temperature": 0, "seed": 42}
        msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
        completion, events = self.chat(client, msgs, slot=0, **params)
        plain = client.request("POST", "/v1/chat/completions", dict(params, messages=msgs, id_slot=0))
        self.assertEqual(completion.content, plain["choices"][0]["message"]["content"])
        self.assertEqual(completion.content, "".join(e.text for e in events if isinstance(e, lc.Content)))
        self.assertEqual(completion.finish_reason, plain["choices"][0]["finish_reason"])
        self.assertTrue(completion.id.startswith("chatcmpl-"))
        self.assertEqual(completion.usage["completion_tokens"], plain["usage"]["completion_tokens"])
        self.assertIsNotNone(completion.timings)

    def test_streamed_matches_unstreamed_over_unix_socket(self):
        self.streamed_equals_unstreamed(self.client)

    @unittest.skipUnless(REAL_URL, "no TCP instance: set LOOPCLIENT_REAL_URL (.ci/run does)")
    def test_streamed_matches_unstreamed_over_tcp(self):
        with self.new_client(REAL_URL, limits=self.limits) as client:
            self.streamed_equals_unstreamed(client)

    def test_single_shot_calls(self):
        self.assertEqual(self.client.health(), {"status": "ok"})
        self.assertEqual(self.client.props()["total_slots"], 2)
        self.assertEqual([s.id for s in self.client.slots()], [0, 1])
        self.assertEqual(self.client.models()["object"], "list")

    def test_same_slot_from_two_clients_waits_busy_then_completes(self):
        other = self.new_client(REAL_SOCKET, limits=self.limits)
        self.addCleanup(other.close)
        first_events, results = [], {}
        started = threading.Event()

        def first():
            def on_event(ev):
                first_events.append(ev)
                started.set()

            results["first"] = other.chat(
                MSGS, slot=0, on_event=on_event, max_tokens=150, ignore_eos=True, temperature=0
            )
            results["first_done"] = time.monotonic()

        thread = threading.Thread(target=first, daemon=True)
        thread.start()
        self.assertTrue(started.wait(30))
        completion, events = self.chat(slot=0, max_tokens=8, temperature=0)
        done = time.monotonic()
        thread.join(60)
        self.assertIn(lc.Waiting(True), events)
        self.assertEqual(events.index(lc.Waiting(True)), 0)
        self.assertGreaterEqual(done, results["first_done"])
        self.assertEqual(results["first"].usage["completion_tokens"], 150)
        self.assertEqual(completion.usage["completion_tokens"], 8)

    def test_three_on_one_slot_with_queue_len_one(self):
        client = self.new_client(REAL_SOCKET, limits=self.limits.replace(queue_len=1))
        self.addCleanup(client.close)
        events, results = {}, {}
        params = {"max_tokens": 60, "ignore_eos": True, "temperature": 0}
        threads = [start_chat(client, "A", 0, events, results, **params)]
        wait_for(lambda: any(isinstance(e, lc.Content) for e in events["A"]), 30)
        threads.append(start_chat(client, "B", 0, events, results, **params))
        wait_for(lambda: events["B"], 30)
        threads.append(start_chat(client, "C", 0, events, results, **params))
        for th in threads:
            th.join(60)
        self.assertIsInstance(results["C"], lc.BusyError)
        self.assertEqual(events["B"][0], lc.Queued(1))
        self.assertIsInstance(results["A"], lc.Completion)
        self.assertIsInstance(results["B"], lc.Completion)

    def test_any_slot_runs_two_at_once(self):
        overlap = threading.Barrier(2, timeout=30)
        results = {}

        def run(name):
            def on_event(ev):
                if isinstance(ev, lc.Content) and name not in results:
                    results[name] = "streaming"
                    overlap.wait()  # both streams deliver before either finishes

            results[name + "-completion"] = self.client.chat(MSGS, on_event=on_event, max_tokens=40, ignore_eos=True)

        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in "AB"]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        self.assertEqual(results["A-completion"].usage["completion_tokens"], 40)
        self.assertEqual(results["B-completion"].usage["completion_tokens"], 40)

    def test_reasoning_forced_by_grammar(self):
        completion, events = self.chat(
            messages=QUESTION, slot=0, max_tokens=150, temperature=0, grammar=grammar(self.client, "24,300")
        )
        reasoning = [e for e in events if isinstance(e, lc.Reasoning)]
        self.assertGreater(len(reasoning), 3)
        self.assertEqual(completion.reasoning, "".join(e.text for e in reasoning))
        self.assertEqual(completion.reasoning_tokens, len(reasoning))
        self.assertEqual(completion.content, "the answer is yes")
        self.assertEqual(completion.finish_reason, "stop")
        first_content = next(i for i, e in enumerate(events) if isinstance(e, lc.Content))
        self.assertTrue(all(isinstance(e, lc.Reasoning) for e in events[:first_content]))

    def test_token_chunks_read_by_their_tail_as_whole_parses_read_them(self):
        # llama-server repeats a token chunk's JSON but for the text: once one is parsed whole, the stream's
        # later tokens are read by the tail learned from it (reasoning's and content's, which share it).  The
        # same request read with whole parses only gives the same tokens and completion.
        kw = dict(messages=QUESTION, slot=0, max_tokens=150, temperature=0, grammar=grammar(self.client, "24,300"))
        parsed, parsed_whole, scan = [], [], lc._scan_json

        with mock.patch.object(lc, "_scan_json", lambda text, at: parsed.append(text) or scan(text, at)):
            completion, events = self.chat(**kw)
        learn_none = mock.patch.object(lc.Assembler, "_learn_tail", lambda asm, payload, content: None)
        with mock.patch.object(
            lc, "_scan_json", lambda text, at: parsed_whole.append(text) or scan(text, at)
        ), learn_none:
            whole, whole_events = self.chat(**kw)
        tokens = [e for e in events if type(e) in (lc.Reasoning, lc.Content)]
        self.assertEqual(tokens, [e for e in whole_events if type(e) in (lc.Reasoning, lc.Content)])
        self.assertEqual(len(parsed_whole), len(tokens) + 3)  # every chunk parsed whole: role, tokens, finish, usage
        self.assertGreater(len([e for e in tokens if type(e) is lc.Reasoning]), 24)
        self.assertEqual(completion.content, "the answer is yes")
        for name in ("content", "reasoning", "finish_reason", "reasoning_tokens"):
            self.assertEqual(getattr(completion, name), getattr(whole, name), name)
        self.assertEqual(completion.usage["completion_tokens"], whole.usage["completion_tokens"])
        # parsed whole: the role's chunk, the finish's, the usage's, and a token's only when its tail was new:
        # the first token of each second (the tail's "created"), since the server makes about 10 a second
        docs = [json.loads(p) for p in parsed]
        self.assertEqual([d["choices"][0]["delta"] for d in docs[:1]], [{"role": "assistant", "content": None}])
        self.assertEqual([d["choices"][0]["finish_reason"] for d in docs[-2:-1]], ["stop"])
        self.assertEqual([(d["choices"], "usage" in d) for d in docs[-1:]], [([], True)])
        seconds = [d["created"] for d in docs[1:-2]]
        self.assertEqual(len(seconds), len(set(seconds)), [p[:90] for p in parsed])
        self.assertLess(len(seconds), len(tokens), [p[:90] for p in parsed])

    def test_thinking_cap_ends_reasoning(self):
        client = self.new_client(REAL_SOCKET, limits=self.limits.replace(thinking_cap=3, thinking_overrun=8))
        self.addCleanup(client.close)
        completion, events = self.chat(
            client,
            QUESTION,
            slot=0,
            max_tokens=300,
            temperature=0,
            grammar=grammar(self.client, "1,300"),
            logit_bias=no_natural_close(self.client),
        )
        self.assertIn(lc.ThinkingCapped(3), events)
        capped = events.index(lc.ThinkingCapped(3))
        self.assertEqual(sum(isinstance(e, lc.Reasoning) for e in events[:capped]), 3)
        self.assertTrue(completion.thinking_capped)
        self.assertLessEqual(completion.reasoning_tokens, 3 + 8)
        self.assertEqual(completion.content, "the answer is yes")

    def test_forced_tool_call(self):
        completion, events = self.chat(
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            slot=0,
            max_tokens=60,
            temperature=0,
            tools=WEATHER_TOOL,
            tool_choice="required",
            parallel_tool_calls=False,
            logit_bias=[['{"name": "', 10]],
        )
        calls = [e for e in events if isinstance(e, lc.ToolCall)]
        self.assertEqual((calls[0].index, calls[0].name), (0, "get_weather"))
        self.assertTrue(calls[0].id)
        self.assertEqual(len(completion.tool_calls), 1)
        call = completion.tool_calls[0]
        self.assertEqual((call.id, call.name), (calls[0].id, "get_weather"))
        self.assertIsInstance(json.loads(call.arguments), dict)
        self.assertEqual(completion.finish_reason, "tool_calls")

    def test_prompt_over_the_context_is_400(self):
        with self.assertRaises(lc.HTTPStatusError) as cm:
            self.chat(messages=[{"role": "user", "content": "word " * 3000}], slot=0, max_tokens=8)
        self.assertEqual(cm.exception.status, 400)
        self.assertIn("exceeds the available context size", cm.exception.message)

    def test_midstream_error_is_server_error_not_replayed(self):
        events = []
        with self.assertRaises(lc.ServerError) as cm:
            run_with_timeout(
                lambda: self.client.chat(
                    QUESTION,
                    slot=0,
                    on_event=events.append,
                    max_tokens=150,
                    temperature=0,
                    grammar=grammar(self.client, "20,300"),
                    thinking_budget_tokens=5,
                ),
                60,
            )
        self.assertEqual(cm.exception.code, 500)
        self.assertTrue(any(isinstance(e, lc.Reasoning) for e in events))
        self.assertFalse(any(isinstance(e, lc.Retrying) for e in events))

    @real_time
    def test_cancel_frees_the_slot_within_a_second(self):
        stream = self.client.stream(MSGS, slot=1, max_tokens=500, ignore_eos=True)
        got = threading.Event()
        outcome = []

        def run():
            try:
                for ev in stream:
                    if isinstance(ev, lc.Content):
                        got.set()
            except lc.CancelledError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.assertTrue(got.wait(30))
        self.assertTrue(self.client.slots()[1].is_processing)
        t = Timer()
        stream.cancel()
        thread.join(10)
        self.assertIsInstance(outcome[0], lc.CancelledError)
        self.assertLess(t.elapsed, lateness(self, 0.2))
        # measured from the cancel: the server notices the closed socket and frees the slot
        wait_for(lambda: not self.client.slots()[1].is_processing, 1.0 - t.elapsed, "slot 1 to go idle")


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealServerLifecycle(unittest.TestCase):
    """Instances of our own: started after the client, and killed mid-stream."""

    def setUp(self):
        self.subprocess = subprocess
        self.tmp = tempfile.mkdtemp(prefix="lcr", dir="/tmp")
        self.sock = os.path.join(self.tmp, "own.sock")
        self.command = real_server_command(self.sock)
        self.proc = None
        self.log = open(os.path.join(self.tmp, "server.log"), "wb")

    def start(self):
        self.proc = self.subprocess.Popen(self.command, stdout=self.log, stderr=self.log, stdin=self.subprocess.DEVNULL)

    def tearDown(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_client_starts_before_the_server(self):
        client = lc.Client(self.sock, limits=lc.Limits(poll=0.2, liveness=20.0, load_wait=60.0))
        self.addCleanup(client.close)
        events = []

        def on_event(ev):
            events.append(ev)
            if isinstance(ev, lc.Retrying) and ev.attempt == 2:
                self.start()

        completion = run_with_timeout(
            lambda: client.chat(MSGS, slot=0, on_event=on_event, max_tokens=8, temperature=0), 90
        )
        retries = [e for e in events if isinstance(e, lc.Retrying)]
        self.assertGreaterEqual(len(retries), 2)
        self.assertIn("No such file", retries[0].reason)
        self.assertEqual(completion.usage["completion_tokens"], 8)
        # between the socket appearing and the model loading, /health-style 503s are retried too
        self.assertTrue(all(("503" in e.reason or "connect" in e.reason) for e in retries))

    def test_server_killed_mid_stream(self):
        self.start()
        client = lc.Client(self.sock, limits=lc.Limits(poll=0.2, liveness=5.0, load_wait=60.0))
        self.addCleanup(client.close)
        wait_for(lambda: _healthy(client), 60, "our own server to load")
        events = []
        killed = []

        def on_event(ev):
            events.append(ev)
            if isinstance(ev, lc.Content) and not killed:
                self.proc.kill()
                killed.append(time.monotonic())

        with self.assertRaises((lc.StreamClosedError, lc.StalledError)):
            run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=on_event, max_tokens=400, ignore_eos=True), 30)
        self.assertLess(time.monotonic() - killed[0], 2.0)


def _healthy(client):
    try:
        return client.health() == {"status": "ok"}
    except lc.LoopError:
        return False


# -----------------------------------------------------------------------------------------------------
# The real server: everything it streams, the rest of its API, router mode, a path prefix
# -----------------------------------------------------------------------------------------------------

REAL_ROUTER = os.environ.get("LOOPCLIENT_REAL_ROUTER")


REAL_EMBED = os.environ.get("LOOPCLIENT_REAL_EMBED")


REAL_PREFIX = os.environ.get("LOOPCLIENT_REAL_PREFIX")


REAL_LIMITS = lc.Limits(poll=0.2, liveness=20.0, busy_wait=60.0, load_wait=60.0, idle_grace=20.0)


SEA = [{"role": "user", "content": "Write one sentence about the sea."}]


def _real_chat(client, messages=SEA, timeout=60, **kw):
    events = []
    completion = run_with_timeout(lambda: client.chat(messages, on_event=events.append, **kw), timeout)
    return completion, events


def _idle(client):
    wait_for(lambda: not any(s.is_processing for s in client.slots()), 30, "the real server's slots to be idle")


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealStreams(unittest.TestCase):
    """Choices, prompt progress and log probabilities, as the real server streams them."""

    def setUp(self):
        self.client = lc.Client(REAL_SOCKET, limits=REAL_LIMITS)
        self.addCleanup(self.client.close)
        _idle(self.client)

    def test_two_choices_each_equal_the_unstreamed_single_reply(self):
        params = {"max_tokens": 16, "temperature": 0, "seed": 3}
        completion, events = _real_chat(self.client, slot=0, n=2, **params)
        self.assertEqual([c.index for c in completion.choices], [0, 1])
        plain = self.client.request("POST", "/v1/chat/completions", dict(params, messages=SEA, id_slot=0))
        single = plain["choices"][0]["message"]["content"]
        for choice in completion.choices:
            self.assertEqual(choice.content, single)
            self.assertEqual(choice.finish_reason, plain["choices"][0]["finish_reason"])
            text = "".join(e.text for e in events if isinstance(e, lc.Content) and e.choice == choice.index)
            self.assertEqual(text, single)
        self.assertEqual(completion.content, single)

    def test_prompt_progress_ends_with_the_whole_prompt(self):
        long = [{"role": "user", "content": "Summarise: " + "the tide comes in and goes out again. " * 40}]
        completion, events = _real_chat(self.client, long, slot=0, max_tokens=4, return_progress=True)
        progress = [e for e in events if isinstance(e, lc.Progress)]
        self.assertTrue(progress, events[:5])
        self.assertEqual(progress[-1].processed, progress[-1].total)
        self.assertEqual([p.processed for p in progress], sorted(p.processed for p in progress))
        first_text = next(i for i, e in enumerate(events) if isinstance(e, lc.Content))
        self.assertLess(events.index(progress[-1]), first_text)
        self.assertEqual(progress[-1].total, completion.usage["prompt_tokens"])

    def test_logprobs_one_entry_per_completion_token(self):
        completion, _ = _real_chat(self.client, slot=0, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
        entries = completion.logprobs
        self.assertEqual(len(entries), completion.usage["completion_tokens"])
        self.assertEqual("".join(e["token"] for e in entries), completion.content)
        self.assertTrue(all(len(e["top_logprobs"]) == 2 for e in entries))

    def test_raw_chunks_come_before_their_events(self):
        _, events = _real_chat(self.client, slot=0, max_tokens=6, temperature=0, raw_chunks=True)
        chunks = [e for e in events if isinstance(e, lc.Chunk)]
        self.assertTrue(chunks)
        for i, event in enumerate(events):
            if isinstance(event, lc.Content):
                self.assertIsInstance(events[i - 1], (lc.Chunk, lc.Content))
        first = next(i for i, e in enumerate(events) if isinstance(e, lc.Content))
        self.assertEqual(events[first - 1].data["choices"][0]["delta"]["content"], events[first].text)


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealAPI(unittest.TestCase):
    """The rest of the server API, each call on the real server."""

    def setUp(self):
        self.client = lc.Client(REAL_SOCKET, limits=REAL_LIMITS)
        self.addCleanup(self.client.close)
        _idle(self.client)

    def test_tokenize_detokenize_round_trip(self):
        text = "The sea is calm tonight."
        tokens = self.client.tokenize(text)
        self.assertTrue(tokens and all(isinstance(t, int) for t in tokens))
        self.assertEqual(self.client.detokenize(tokens), text)
        pieces = self.client.tokenize(text, with_pieces=True)
        self.assertEqual("".join(p["piece"] for p in pieces), text)

    def test_count_tokens_and_apply_template_match_the_chat(self):
        completion, _ = _real_chat(self.client, slot=1, max_tokens=4, temperature=0)
        self.assertEqual(self.client.count_tokens(SEA), completion.usage["prompt_tokens"])
        prompt = self.client.apply_template(SEA)
        self.assertIn(SEA[0]["content"], prompt)
        counted = self.client.tokenize(prompt, add_special=True, parse_special=True)
        self.assertEqual(len(counted), completion.usage["prompt_tokens"])

    def test_slot_save_erase_restore(self):
        if not os.environ.get("LOOPCLIENT_REAL_SLOT_DIR"):
            self.fail("LOOPCLIENT_REAL_SLOT_DIR is not set: the server needs --slot-save-path")
        params = {"slot": 0, "max_tokens": 4, "temperature": 0}
        _real_chat(self.client, **params)
        saved = self.client.save_slot(0, "loopclient-test.bin")
        self.assertGreater(saved["n_saved"], 0)
        self.assertEqual(self.client.erase_slot(0)["id_slot"], 0)
        erased, _ = _real_chat(self.client, **params)
        self.assertEqual(erased.timings["cache_n"], 0)
        self.client.erase_slot(0)
        restored = self.client.restore_slot(0, "loopclient-test.bin")
        self.assertEqual(restored["n_restored"], saved["n_saved"])
        again, _ = _real_chat(self.client, **params)
        self.assertGreater(again.timings["cache_n"], 0)

    def test_metrics(self):
        text = self.client.metrics()
        self.assertIn("llamacpp:prompt_tokens_total", text)

    def test_request_any_endpoint_json_and_text(self):
        self.assertEqual(self.client.request("GET", "/health"), {"status": "ok"})
        with self.assertRaises(lc.HTTPStatusError) as cm:
            self.client.request("GET", "/no-such-endpoint")
        self.assertEqual(cm.exception.status, 404)
        self.assertIsInstance(self.client.request("GET", "/metrics"), str)

    @unittest.skipUnless(REAL_EMBED, "no embeddings instance: set LOOPCLIENT_REAL_EMBED (.ci/run does)")
    def test_embed_one_vector_per_input(self):
        client = lc.Client(REAL_EMBED, limits=REAL_LIMITS)
        self.addCleanup(client.close)
        meta = client.models()["data"][0].get("meta") or {}
        vectors = client.embed(["the sea", "a mountain", "the sea"])
        self.assertEqual(len(vectors), 3)
        size = meta.get("n_embd", len(vectors[0]))
        self.assertTrue(all(len(v) == size for v in vectors))
        # the same text twice: the same vector but for float noise of the batch it was computed in
        self.assertGreater(_cosine(vectors[0], vectors[2]), 0.9999)
        self.assertLess(_cosine(vectors[0], vectors[1]), _cosine(vectors[0], vectors[2]))
        self.assertEqual(len(client.embed("one")), 1)

    @unittest.skipUnless(REAL_PREFIX, "no --api-prefix instance: set LOOPCLIENT_REAL_PREFIX (.ci/run does)")
    def test_a_path_prefix(self):
        client = lc.Client(REAL_PREFIX, limits=REAL_LIMITS)
        self.addCleanup(client.close)
        self.assertEqual(client.health(), {"status": "ok"})
        self.assertTrue(client.slots())
        completion, _ = _real_chat(client, slot=0, max_tokens=4, temperature=0)
        self.assertEqual(completion.finish_reason, "length")
        bare = lc.Client(REAL_PREFIX.rsplit("/", 1)[0], limits=REAL_LIMITS)
        self.addCleanup(bare.close)
        with self.assertRaises(lc.HTTPStatusError):
            bare.health()


@unittest.skipUnless(REAL_ROUTER, "no router instance: set LOOPCLIENT_REAL_ROUTER (.ci/run does)")
class TestRealRouter(unittest.TestCase):
    """llama-server --models-dir: the model under two names, alpha and beta."""

    def setUp(self):
        self.client = lc.Client(REAL_ROUTER, limits=REAL_LIMITS, model="alpha")
        self.addCleanup(self.client.close)
        for name in ("alpha", "beta"):
            wait_for(lambda: _loaded(self.client, name), 60, "model %s to load" % name)
            wait_for(
                lambda: not any(s.is_processing for s in self.client.slots(model=name)), 30, "idle slots of " + name
            )

    def test_a_busy_slot_of_a_model_is_busy_not_loading(self):
        first = threading.Thread(
            target=lambda: _real_chat(self.client, slot=0, max_tokens=96, ignore_eos=True), daemon=True
        )
        first.start()
        self.addCleanup(first.join, 60)
        wait_for(lambda: self.client.slots()[0].is_processing, 20, "alpha's slot 0 to be busy")
        other = lc.Client(REAL_ROUTER, limits=REAL_LIMITS, model="alpha")
        self.addCleanup(other.close)
        completion, events = _real_chat(other, slot=0, max_tokens=4)
        self.assertIn(lc.Waiting(True), events)
        self.assertFalse(any(isinstance(e, lc.Retrying) for e in events), events)
        self.assertTrue(completion.content)

    def test_slot_0_of_two_models_runs_at_once(self):
        spans = {}

        def run(name):
            start = time.monotonic()
            _real_chat(self.client, slot=0, model=name, max_tokens=48, ignore_eos=True)
            spans[name] = (start, time.monotonic())

        threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in ("alpha", "beta")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        self.assertEqual(set(spans), {"alpha", "beta"})
        (a0, a1), (b0, b1) = spans["alpha"], spans["beta"]
        self.assertLess(max(a0, b0), min(a1, b1))  # they overlapped: neither queued behind the other

    def test_thinking_cap_through_the_router(self):
        client = lc.Client(REAL_ROUTER, limits=REAL_LIMITS.replace(thinking_cap=3, thinking_overrun=8), model="alpha")
        self.addCleanup(client.close)
        completion, events = _real_chat(
            client,
            QUESTION,
            slot=0,
            max_tokens=300,
            temperature=0,
            grammar=grammar(client, "1,300"),
            logit_bias=no_natural_close(client),
        )
        self.assertIn(lc.ThinkingCapped(3), events)
        self.assertTrue(completion.thinking_capped)

    def test_load_and_unload_change_what_models_reports(self):
        self.client.unload_model("beta")
        wait_for(lambda: _status(self.client, "beta") == "unloaded", 30, "beta to unload")
        self.client.load_model("beta")
        wait_for(lambda: _status(self.client, "beta") == "loaded", 60, "beta to load")


def _cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)


def _status(client, name):
    for item in client.models()["data"]:
        if item.get("id") == name:
            status = item.get("status")
            return status.get("value") if isinstance(status, dict) else status
    return None


def _loaded(client, name):
    if _status(client, name) != "loaded":
        try:
            client.load_model(name)
        except lc.HTTPStatusError:
            pass
        return False
    return True


REAL_DEMO = os.environ.get("LOOPCLIENT_REAL_DEMO")


COLOURS = {"red", "orange", "yellow", "green", "blue", "indigo", "violet", "purple", "pink", "black", "white", "grey"}


@unittest.skipUnless(REAL_DEMO, "no demo server: set LOOPCLIENT_REAL_DEMO to dev/llama-server.sh demo's socket")
class TestRealDemo(unittest.TestCase):
    """The command line against `dev/llama-server.sh demo`, at temperature 0 to be repeatable: the answer
    ends where the request says (the server itself stops at no newline)."""

    def loopclient(self, *argv):
        done = subprocess.run(
            [sys.executable, os.path.join(HERE, "loopclient.py"), "--socket", REAL_DEMO] + list(argv),
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        return done.stdout, done.stderr.splitlines()[-1]

    def test_readme_demo_names_colours_and_stops(self):
        """The README's demo command: one line, ended by its --stop '\\n'."""
        out, figures = self.loopclient(
            "chat", "Name three colours.", "--stop", "\\n", "--max-tokens", "40", "--temperature", "0"
        )
        words = set(out.lower().replace(",", " ").replace(".", " ").split())
        self.assertGreaterEqual(len(words & COLOURS), 3, out)
        self.assertRegex(figures, r"^\[\d+ tokens, .*finish: stop\]$")
        self.assertEqual(out.count("\n"), 1, out)

    def test_without_a_stop_the_answer_goes_past_its_line(self):
        out, figures = self.loopclient("chat", "Name three colours.", "--max-tokens", "40", "--temperature", "0")
        self.assertGreater(out.count("\n"), 1, out)
        self.assertRegex(figures, r"^\[40 tokens, .*finish: length\]$")

    def test_a_long_answer_has_as_many_tokens_as_asked(self):
        out, figures = self.loopclient(
            "chat", "Write about the sea.", "--max-tokens", "120", "--ignore-eos", "--temperature", "0"
        )
        self.assertRegex(figures, r"^\[120 tokens, first token \d+\.\d\d s, \d+\.\d tokens/s, finish: length\]$")
        self.assertGreater(out.count("\n"), 2, out)
        out, _ = self.loopclient(
            "chat", "Write about the sea.", "--max-tokens", "120", "--ignore-eos", "--temperature", "0", "--json"
        )
        doc = json.loads(out)
        self.assertEqual((doc["usage"]["completion_tokens"], doc["finish_reason"]), (120, "length"))


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealServerAsync(AsyncDriver, TestRealServer):
    """The real tier's streaming, busy-slot, thinking-cap and cancel tests, through AsyncClient."""


for _name in list(vars(TestRealServer)):
    if _name.startswith("test_") and _name not in (
        "test_streamed_matches_unstreamed_over_unix_socket",
        "test_streamed_matches_unstreamed_over_tcp",
        "test_same_slot_from_two_clients_waits_busy_then_completes",
        "test_reasoning_forced_by_grammar",
        "test_token_chunks_read_by_their_tail_as_whole_parses_read_them",
        "test_thinking_cap_ends_reasoning",
        "test_cancel_frees_the_slot_within_a_second",
    ):
        setattr(TestRealServerAsync, _name, None)


class ConcurrencyProxy(_UnixServer):
    """A proxy in front of a real server, as llama-swap behaves at its per-model concurrency limit: on a
    Unix socket of its own, it answers ``GET /slots`` with 404 (not served), a request past ``limit`` in
    flight through it with 429 and ``Retry-After: 1``, and forwards any other request to ``upstream``
    (asking it to close the connection after its answer), piping the response back byte for byte until
    the server closes.  Every socket call has a timeout; ``close()`` shuts every socket down (a ``close()``
    alone does not wake a thread blocked in ``recv()`` on Linux) and joins the threads."""

    def __init__(self, upstream, limit=2):
        self.upstream = upstream
        self.limit = limit
        self.in_flight = self.max_in_flight = 0
        self.forwarded, self.refused, self.slots_asked = [], 0, 0
        _UnixServer.__init__(self, "lcproxy", "proxy.sock")

    def _serve(self, conn, number):
        try:
            conn.settimeout(5)
            request = read_request(conn)
            if request is None:
                return
            if request.method == "GET" and request.path.split("?")[0] == "/slots":
                with self.lock:
                    self.slots_asked += 1
                conn.sendall(
                    b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: 9\r\n"
                    b"Connection: close\r\n\r\nnot found"
                )
                return
            with self.lock:
                admitted = self.in_flight < self.limit
                if admitted:
                    self.in_flight += 1
                    self.max_in_flight = max(self.max_in_flight, self.in_flight)
                    self.forwarded.append(request.path)
                else:
                    self.refused += 1
            if not admitted:
                conn.sendall(_f_too_many(b"1"))
                return
            try:
                self._forward(conn, request)
            finally:
                with self.lock:
                    self.in_flight -= 1
        except OSError:
            pass
        finally:
            self._untrack(conn)

    def _forward(self, conn, request):
        lines = [line for line in request.head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if not self._track(upstream):
            return
        try:
            upstream.settimeout(5)
            upstream.connect(self.upstream)
            upstream.sendall(b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n" + request.body)
            upstream.settimeout(0.5)
            deadline = time.monotonic() + 120
            while not self.stopping.is_set() and time.monotonic() < deadline:
                try:
                    data = upstream.recv(65536)
                except socket.timeout:
                    continue
                if not data:
                    return  # the server closed: so does the proxy, after the last byte
                conn.sendall(data)
        finally:
            self._untrack(upstream)


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealProxy(ClientFactory, unittest.TestCase):
    """The real server behind ConcurrencyProxy (llama-swap at its per-model limit of 2 in flight): eight
    chats with ``slot=None`` at once, from a client whose pool admits all eight (``Limits.pool``; the
    server's own total_slots would hold them to 2 and the proxy would never refuse), all finish; the ones
    the proxy refused heard a ``Retrying`` naming the 429 and were sent again after its hint; ``/slots``
    is not served, so any ``Waiting`` says the slots are unknown."""

    def setUp(self):
        with lc.Client(REAL_SOCKET, limits=REAL_LIMITS) as direct:
            _idle(direct)
        self.proxy = ConcurrencyProxy(REAL_SOCKET, limit=2)
        self.client = self.new_client(self.proxy.path, limits=REAL_LIMITS.replace(pool=8))

    def tearDown(self):
        self.client.close()
        alive = self.proxy.close()
        self.assertEqual(alive, [], "the proxy's threads did not end")

    def test_eight_chats_through_a_proxy_at_its_concurrency_limit(self):
        events, results = {}, {}
        t = Timer()
        markers = ["Name a colour, number %d." % i for i in range(8)]
        threads = [start_chat(self.client, m, None, events, results, max_tokens=8, temperature=0) for m in markers]
        for thread in threads:
            thread.join(120)
        self.assertFalse(any(thread.is_alive() for thread in threads), "a chat did not end within 120 s")
        failed = {m: r for m, r in results.items() if not isinstance(r, lc.Completion)}
        self.assertEqual(failed, {})
        self.assertEqual(sorted(results), sorted(markers))
        for marker in markers:
            self.assertTrue(results[marker].finish_reason, (marker, results[marker]))
        retries = [e for m in markers for e in events[m] if isinstance(e, lc.Retrying)]
        self.assertTrue(retries, "no chat heard a Retrying: the proxy refused none (refused %d)" % self.proxy.refused)
        self.assertEqual({r.reason for r in retries}, {"HTTP 429: too many requests for model m1"})
        self.assertTrue(all(r.delay >= 1.0 for r in retries), [r.delay for r in retries])  # the hint is a floor
        waits = {e for m in markers for e in events[m] if isinstance(e, lc.Waiting)}
        self.assertLessEqual(waits, {lc.Waiting(False, slots_known=False)})
        self.assertEqual(self.proxy.max_in_flight, 2)
        self.assertEqual(self.proxy.refused, len(retries))
        self.assertEqual(self.proxy.forwarded.count("/v1/chat/completions"), 8)
        print(
            "\n    %s: 8 chats through the proxy in %.1f s: %d refused with 429 and retried, %d Waiting events"
            % (
                self.CLIENT,
                t.elapsed,
                len(retries),
                sum(isinstance(e, lc.Waiting) for m in markers for e in events[m]),
            ),
            file=sys.stderr,
        )


class TestRealProxyAsync(AsyncDriver, TestRealProxy):
    pass


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealWedge(unittest.TestCase):
    """A server of our own, wedged on purpose by dev/soak.py's recipe (8 threads, short answers, the slot
    cycling 0, 1, any): a request pinned to the wedged slot ends in WedgedSlotError, not a 10-minute wait."""

    def setUp(self):
        spec = importlib.util.spec_from_file_location("loopclient_soak", os.path.join(HERE, "dev", "soak.py"))
        self.soak = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.soak)
        self.tmp = tempfile.mkdtemp(prefix="lcw", dir="/tmp")
        self.sock = os.path.join(self.tmp, "wedge.sock")
        self.log = open(os.path.join(self.tmp, "server.log"), "wb")
        self.proc = subprocess.Popen(real_server_command(self.sock), stdout=self.log, stderr=subprocess.STDOUT)
        self.addCleanup(self.stop)
        probe = lc.Client(self.sock)
        self.addCleanup(probe.close)
        wait_for(lambda: _healthy(probe), 60, "our own server to load")

    def stop(self):
        self.proc.kill()  # a wedged server ignores SIGTERM while streams are in flight
        self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_a_request_pinned_to_a_wedged_slot_ends_in_wedged_slot_error(self):
        limits = REAL_LIMITS.replace(poll=0.5, wedge_wait=3.0)
        deadline = time.monotonic() + 240
        while True:  # a wedge may dissolve before the probe lands (the server frees it after a quiet second)
            left = deadline - time.monotonic()
            wedge = self.soak.provoke_wedge(self.sock, seconds=max(left, 10.0))
            self.assertIsNotNone(wedge, "this llama-server build did not wedge a slot under the soak recipe")
            slot, task = wedge
            client = lc.Client(self.sock, limits=limits)
            events = []
            t = Timer()
            try:
                run_with_timeout(lambda: client.chat(MSGS, slot=slot, max_tokens=4, on_event=events.append), 60)
            except lc.WedgedSlotError as exc:
                err = exc
                break
            finally:
                client.close()
                still = wedge.still()  # None once the keeper saw the slot leave that task
                wedge.close()
            self.assertIsNone(still, "the request was served while the slot stayed wedged")
            self.assertGreater(deadline - time.monotonic(), 0, "the wedge dissolved before every probe")
        self.assertLess(t.elapsed, limits.wedge_wait + limits.poll + MARGIN + 1.0)
        self.assertEqual((err.slot, err.task), (slot, task))
        self.assertGreaterEqual(err.seconds, limits.wedge_wait)
        self.assertEqual(events[-1], lc.Waiting(True, wedged=True))
        self.assertIn("task %d" % task, str(err))


# -----------------------------------------------------------------------------------------------------
# The real server's other endpoints: /completion, /infill, /v1/responses, /v1/messages, count_tokens, LoRA
# -----------------------------------------------------------------------------------------------------


#: `dev/llama-server.sh start-fim`'s socket: the fill-in-the-middle model with the test LoRA adapter at 0
REAL_FIM = os.environ.get("LOOPCLIENT_REAL_FIM")


SKIP_FIM = "no fill-in-the-middle server: run dev/llama-server.sh start-fim and set LOOPCLIENT_REAL_FIM (.ci/run does)"


#: The captures' infill (48): a function with its body missing, and a file beside it
FIM_PREFIX, FIM_SUFFIX = "def add(a, b):\n    ", "\n    return c\n"


FIM_EXTRA = [("util.py", "def sub(a, b):\n    return a - b\n")]


WEATHER_TOOL_RESPONSES = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealEndpoints(ClientFactory, unittest.TestCase):
    """complete, infill, respond and message on the real server (and the FIM server for infill and LoRA),
    at temperature 0 so that answers compare exactly; short answers, generous timeouts."""

    def setUp(self):
        self.client = self.new_client(REAL_SOCKET, limits=REAL_LIMITS)
        self.addCleanup(self.client.close)
        _idle(self.client)

    def fim(self):
        client = self.new_client(REAL_FIM, limits=REAL_LIMITS)
        self.addCleanup(client.close)
        _idle(client)
        return client

    def run_call(self, endpoint, *args, client=None, timeout=120, **kw):
        events = []
        method = getattr(client or self.client, endpoint)
        completion = run_with_timeout(lambda: method(*args, on_event=events.append, **kw), timeout)
        return completion, events

    def text_of(self, events, choice=0):
        return "".join(e.text for e in events if isinstance(e, lc.Content) and e.choice == choice)

    def test_complete_equals_the_unstreamed_answer(self):
        body = {"prompt": "The sky is", "n_predict": 8, "temperature": 0}
        plain = self.client.request("POST", "/completion", body)
        completion, events = self.run_call("complete", "The sky is", n_predict=8, temperature=0)
        self.assertEqual(completion.content, plain["content"])
        self.assertEqual(self.text_of(events), plain["content"])
        self.assertEqual((completion.finish_reason, completion.final["stop_type"]), ("length", plain["stop_type"]))
        self.assertEqual(completion.usage["completion_tokens"], plain["tokens_predicted"])
        self.assertEqual(completion.usage["prompt_tokens"], plain["tokens_evaluated"])
        self.assertIsNone(completion.id)
        self.assertTrue(completion.final["stop"])
        self.assertIsNotNone(completion.timings)
        # with return_tokens and n_probs, on slot 0: the same ids, and one log-probability entry per token
        extra = {"return_tokens": True, "n_probs": 2}
        plain = self.client.request("POST", "/completion", dict(body, id_slot=0, **extra))
        completion, _ = self.run_call("complete", "The sky is", slot=0, n_predict=8, temperature=0, **extra)
        self.assertEqual(completion.content, plain["content"])
        self.assertEqual(completion.tokens, plain["tokens"])
        self.assertEqual(len(completion.tokens), 8)
        self.assertEqual(completion.final["id_slot"], 0)
        entries = completion.logprobs
        self.assertEqual(len(entries), len(completion.tokens))
        self.assertEqual([e["id"] for e in entries], completion.tokens)
        self.assertEqual("".join(e["token"] for e in entries), completion.content)
        self.assertTrue(all(len(e["top_logprobs"]) == 2 for e in entries))

    def test_a_token_id_prompt(self):
        ids = self.client.tokenize("The sky is", add_special=True)  # with the BOS the model needs
        text, _ = self.run_call("complete", "The sky is", n_predict=8, temperature=0)
        completion, _ = self.run_call("complete", ids, n_predict=8, temperature=0, return_tokens=True)
        self.assertEqual(completion.content, text.content)
        self.assertEqual(completion.usage["prompt_tokens"], len(ids))

    def test_two_prompts_give_two_choices(self):
        prompts = ["The sky is", "The grass is"]
        singles = [self.run_call("complete", p, n_predict=8, temperature=0)[0].content for p in prompts]
        completion, events = self.run_call("complete", prompts, n_predict=8, temperature=0)
        self.assertEqual([c.index for c in completion.choices], [0, 1])
        self.assertEqual([c.content for c in completion.choices], singles)
        self.assertEqual([self.text_of(events, i) for i in (0, 1)], singles)
        self.assertEqual([c.finish_reason for c in completion.choices], ["length", "length"])
        self.assertEqual(completion.usage["completion_tokens"], 16)

    def test_busy_slot_is_waited_out(self):
        other = self.new_client(REAL_SOCKET, limits=REAL_LIMITS)
        self.addCleanup(other.close)
        started, results = threading.Event(), {}

        def first():
            def on_event(ev):
                if isinstance(ev, lc.Content):
                    started.set()

            results["first"] = other.complete(
                "The sky is", slot=0, on_event=on_event, n_predict=150, ignore_eos=True, temperature=0
            )
            results["first_done"] = time.monotonic()

        thread = threading.Thread(target=first, daemon=True)
        thread.start()
        self.assertTrue(started.wait(60))
        completion, events = self.run_call("complete", "The grass is", slot=0, n_predict=8, temperature=0)
        done = time.monotonic()
        thread.join(120)
        self.assertEqual(events[0], lc.Waiting(True))
        self.assertGreaterEqual(done, results["first_done"])
        self.assertEqual(results["first"].usage["completion_tokens"], 150)
        self.assertEqual(completion.usage["completion_tokens"], 8)

    @real_time
    def test_cancel_frees_the_slot_within_a_second(self):
        stream = open_stream(self.client, "complete", "The sky is", slot=1, n_predict=500, ignore_eos=True)
        got, outcome = threading.Event(), []

        def run():
            try:
                for ev in stream:
                    if isinstance(ev, lc.Content):
                        got.set()
            except lc.CancelledError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.assertTrue(got.wait(60))
        self.assertTrue(self.client.slots()[1].is_processing)
        t = Timer()
        stream.cancel()
        thread.join(10)
        self.assertIsInstance(outcome[0], lc.CancelledError)
        self.assertLess(t.elapsed, lateness(self, 0.2))
        wait_for(lambda: not self.client.slots()[1].is_processing, 1.0 - t.elapsed, "slot 1 to go idle")

    def test_message_and_respond_give_chat_text_and_token_count(self):
        chat, _ = self.run_call("chat", _E_SEA, slot=0, max_tokens=16, temperature=0)
        message, events = self.run_call("message", _E_SEA, max_tokens=16, temperature=0)
        respond, _ = self.run_call("respond", _E_SEA[0]["content"], slot=0, max_output_tokens=16, temperature=0)
        self.assertEqual(message.content, chat.content)
        self.assertEqual(respond.content, chat.content)
        self.assertEqual(self.text_of(events), chat.content)
        counts = [c.usage["completion_tokens"] for c in (chat, message, respond)]
        self.assertEqual(counts, [16, 16, 16])
        self.assertEqual(message.usage["prompt_tokens"], chat.usage["prompt_tokens"])
        self.assertEqual(respond.usage["prompt_tokens"], chat.usage["prompt_tokens"])
        self.assertEqual((chat.finish_reason, message.finish_reason), ("length", "length"))
        # Responses says completed even at max_output_tokens: only the count tells
        self.assertEqual((respond.finish_reason, respond.final["status"]), ("stop", "completed"))
        self.assertTrue(respond.id.startswith("resp_"))
        self.assertTrue(message.id.startswith("chatcmpl-"))

    def test_respond_reasoning_by_grammar(self):
        completion, events = self.run_call(
            "respond",
            QUESTION[0]["content"],
            slot=0,
            max_output_tokens=150,
            temperature=0,
            grammar=grammar(self.client, "24,300"),
        )
        reasoning = [e for e in events if isinstance(e, lc.Reasoning)]
        self.assertGreater(len(reasoning), 3)
        self.assertEqual(completion.reasoning, "".join(e.text for e in reasoning))
        self.assertEqual(completion.reasoning_tokens, len(reasoning))
        self.assertEqual(completion.content, "the answer is yes")
        first_content = next(i for i, e in enumerate(events) if isinstance(e, lc.Content))
        self.assertTrue(all(isinstance(e, lc.Reasoning) for e in events[:first_content]))
        self.assertEqual([item["type"] for item in completion.final["output"]], ["reasoning", "message"])

    def test_respond_tool_call_with_whole_arguments(self):
        completion, events = self.run_call(
            "respond",
            "What is the weather in Paris?",
            slot=0,
            max_output_tokens=60,
            temperature=0,
            tools=WEATHER_TOOL_RESPONSES,
            tool_choice="required",
            parallel_tool_calls=False,
            logit_bias=[['{"name": "', 10]],
        )
        calls = [e for e in events if isinstance(e, lc.ToolCall)]
        self.assertEqual((calls[0].index, calls[0].name), (0, "get_weather"))
        self.assertTrue(calls[0].id.startswith("call_"), calls[0])
        self.assertEqual(len(completion.tool_calls), 1)
        call = completion.tool_calls[0]
        self.assertEqual((call.id, call.name), (calls[0].id, "get_weather"))
        self.assertEqual(call.arguments, "".join(e.arguments for e in calls))
        self.assertIsInstance(json.loads(call.arguments)["city"], str)
        self.assertEqual(completion.finish_reason, "tool_calls")

    def test_count_message_tokens_equals_the_prompt_tokens_of_message(self):
        msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
        completion, _ = self.run_call("message", msgs, max_tokens=4, temperature=0)
        self.assertEqual(self.client.count_message_tokens(msgs), completion.usage["prompt_tokens"])
        system = "You answer in one word."
        completion, _ = self.run_call("message", msgs, max_tokens=4, temperature=0, system=system)
        self.assertEqual(self.client.count_message_tokens(msgs, system=system), completion.usage["prompt_tokens"])

    def test_thinking_cap_is_value_error_on_respond_and_message(self):
        client = self.new_client(REAL_SOCKET, limits=REAL_LIMITS.replace(thinking_cap=3))
        self.addCleanup(client.close)
        with self.assertRaises(ValueError):
            run_with_timeout(lambda: client.respond(QUESTION[0]["content"], slot=0, max_output_tokens=8), 30)
        with self.assertRaises(ValueError):
            run_with_timeout(lambda: client.message(QUESTION, max_tokens=8), 30)
        completion, _ = self.run_call("complete", "The sky is", client=client, slot=0, n_predict=4, temperature=0)
        self.assertEqual((completion.usage["completion_tokens"], completion.thinking_capped), (4, False))

    def test_infill_without_fim_tokens_is_501(self):
        with self.assertRaises(lc.HTTPStatusError) as cm:
            self.run_call("infill", FIM_PREFIX, FIM_SUFFIX, slot=0, n_predict=8)
        self.assertEqual(cm.exception.status, 501)
        self.assertTrue(cm.exception.message.startswith("Infill is not supported by this model:"), cm.exception.message)

    @unittest.skipUnless(REAL_FIM, SKIP_FIM)
    def test_infill_streams_a_middle(self):
        fim = self.fim()
        params = {"n_predict": 8, "temperature": 0}
        completion, events = self.run_call(
            "infill", FIM_PREFIX, FIM_SUFFIX, client=fim, extra=FIM_EXTRA, slot=0, **params
        )
        body = dict(params, input_prefix=FIM_PREFIX, input_suffix=FIM_SUFFIX, id_slot=0)
        body["input_extra"] = [{"filename": name, "text": text} for name, text in FIM_EXTRA]
        plain = fim.request("POST", "/infill", body)
        self.assertEqual(completion.content, plain["content"])
        self.assertEqual(self.text_of(events), plain["content"])
        self.assertTrue(completion.content)
        self.assertEqual((completion.usage["completion_tokens"], completion.finish_reason), (8, "length"))
        # the FIM tokens (7, 8, 9) around prefix and suffix: the model's own template, not ours
        self.assertIn("<unused1>" + FIM_PREFIX + "<unused2>" + FIM_SUFFIX + "<unused3>", completion.final["prompt"])

    @unittest.skipUnless(REAL_FIM, SKIP_FIM)
    def test_lora_adapters_list_the_adapter_at_scale_0(self):
        adapters = self.fim().lora_adapters()
        self.assertEqual([(a["id"], a["scale"]) for a in adapters], [(0, 0.0)])
        self.assertTrue(adapters[0]["path"].endswith("lora-test-r4.gguf"), adapters)

    @unittest.skipUnless(REAL_FIM, SKIP_FIM)
    def test_a_request_lora_changes_the_text(self):
        fim = self.fim()
        params = {"n_predict": 8, "temperature": 0}
        base, _ = self.run_call("complete", "The sky is", client=fim, **params)
        scaled, _ = self.run_call("complete", "The sky is", client=fim, lora=[{"id": 0, "scale": 1.0}], **params)
        zero, _ = self.run_call("complete", "The sky is", client=fim, lora=[{"id": 0, "scale": 0.0}], **params)
        self.assertNotEqual(scaled.content, base.content)
        self.assertEqual(zero.content, base.content)
        self.assertEqual(scaled.usage["completion_tokens"], 8)

    @unittest.skipUnless(REAL_FIM, SKIP_FIM)
    def test_set_lora_adapters_changes_the_default_and_back(self):
        fim = self.fim()
        params = {"n_predict": 8, "temperature": 0}
        base, _ = self.run_call("complete", "The sky is", client=fim, **params)
        scaled, _ = self.run_call("complete", "The sky is", client=fim, lora=[{"id": 0, "scale": 1.0}], **params)
        try:
            self.assertEqual(fim.set_lora_adapters([{"id": 0, "scale": 1.0}]), {"success": True})
            self.assertEqual(fim.lora_adapters()[0]["scale"], 1.0)
            default, _ = self.run_call("complete", "The sky is", client=fim, **params)
            self.assertEqual(default.content, scaled.content)
            self.assertEqual(fim.set_lora_adapters([{"id": 0, "scale": 0.0}]), {"success": True})
            self.assertEqual(fim.lora_adapters()[0]["scale"], 0.0)
            restored, _ = self.run_call("complete", "The sky is", client=fim, **params)
            self.assertEqual(restored.content, base.content)
        finally:  # the server is shared: its default goes back to scale 0 whatever happened
            with lc.Client(REAL_FIM, limits=REAL_LIMITS) as restore:
                restore.set_lora_adapters([{"id": 0, "scale": 0.0}])


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealEndpointsAsync(AsyncDriver, TestRealEndpoints):
    """The same on AsyncClient."""


def _watch(client, model=None):
    """``client.watch_models(model)``: for AsyncDriver's facade, its AsyncStream behind blocking iteration."""
    if isinstance(client, SyncFacade):
        return StreamFacade(client._runner, client._client.watch_models(model))
    return client.watch_models(model)


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealLastRoutes(ClientFactory, unittest.TestCase):
    """complete_openai and count_response_tokens on the real server, at temperature 0."""

    def setUp(self):
        self.client = self.new_client(REAL_SOCKET, limits=REAL_LIMITS)
        self.addCleanup(self.client.close)
        _idle(self.client)

    def run_call(self, *args, client=None, timeout=120, **kw):
        events = []
        method = (client or self.client).complete_openai
        completion = run_with_timeout(lambda: method(*args, on_event=events.append, **kw), timeout)
        return completion, events

    def test_two_prompts_with_logprobs_equal_the_unstreamed_answer(self):
        prompts = ["The sky is", "The grass is"]
        body = {"prompt": prompts, "max_tokens": 8, "temperature": 0, "logprobs": 2}
        plain = self.client.request("POST", "/v1/completions", body)
        completion, events = self.run_call(prompts, max_tokens=8, temperature=0, logprobs=2)
        by_index = sorted(plain["choices"], key=lambda c: c["index"])
        self.assertEqual([c.index for c in completion.choices], [0, 1])
        self.assertEqual([c.content for c in completion.choices], [c["text"] for c in by_index])
        self.assertEqual([c.finish_reason for c in completion.choices], [c["finish_reason"] for c in by_index])
        for i, (ours, theirs) in enumerate(zip(completion.choices, by_index)):
            text = "".join(e.text for e in events if isinstance(e, lc.Content) and e.choice == i)
            self.assertEqual(text, theirs["text"])
            entries = theirs["logprobs"]["content"]
            self.assertEqual(len(ours.logprobs), 8)
            self.assertEqual([e["id"] for e in ours.logprobs], [e["id"] for e in entries])
            self.assertEqual(
                [[t["token"] for t in e["top_logprobs"]] for e in ours.logprobs],
                [[t["token"] for t in e["top_logprobs"]] for e in entries],
            )
            self.assertEqual("".join(e["token"] for e in ours.logprobs), ours.content)
        self.assertEqual(completion.usage["completion_tokens"], plain["usage"]["completion_tokens"])
        self.assertEqual(completion.usage["prompt_tokens"], plain["usage"]["prompt_tokens"])
        self.assertTrue(completion.id.startswith("chatcmpl-"))
        self.assertIsNone(completion.final)

    def test_busy_slot_is_waited_out(self):
        other = self.new_client(REAL_SOCKET, limits=REAL_LIMITS)
        self.addCleanup(other.close)
        started, results = threading.Event(), {}

        def first():
            def on_event(ev):
                if isinstance(ev, lc.Content):
                    started.set()

            results["first"] = other.complete_openai(
                "The sky is", slot=0, on_event=on_event, max_tokens=150, ignore_eos=True, temperature=0
            )
            results["first_done"] = time.monotonic()

        thread = threading.Thread(target=first, daemon=True)
        thread.start()
        self.assertTrue(started.wait(60))
        completion, events = self.run_call("The grass is", slot=0, max_tokens=8, temperature=0)
        done = time.monotonic()
        thread.join(120)
        self.assertEqual(events[0], lc.Waiting(True))
        self.assertGreaterEqual(done, results["first_done"])
        self.assertEqual(results["first"].usage["completion_tokens"], 150)
        self.assertEqual(completion.usage["completion_tokens"], 8)

    def test_cancel_frees_the_slot(self):
        stream = open_stream(self.client, "complete_openai", "The sky is", slot=0, max_tokens=300, ignore_eos=True)
        first = run_with_timeout(lambda: next(e for e in stream if isinstance(e, lc.Content)), 60)
        self.assertIsInstance(first, lc.Content)
        self.assertTrue(self.client.slots()[0].is_processing)
        t = Timer()
        stream.cancel()
        wait_for(lambda: not self.client.slots()[0].is_processing, 2.0, "slot 0 to be free after the cancel")
        self.assertLess(t.elapsed, 2.0)
        with self.assertRaises(lc.CancelledError):
            run_with_timeout(lambda: next(stream))

    def test_a_resumable_one_cut_by_a_proxy_resumes(self):
        params = {"max_tokens": 120, "temperature": 0, "ignore_eos": True}
        uncut, _ = self.run_call("Once upon a time", slot=0, **params)
        proxy = CutProxy(REAL_SOCKET, 3000)
        self.addCleanup(proxy.close)
        client = self.new_client(proxy.path, limits=REAL_LIMITS)
        self.addCleanup(client.close)
        completion, events = self.run_call("Once upon a time", client=client, slot=0, resumable=True, **params)
        self.assertEqual(proxy.cuts, 1)
        resumed = [e for e in events if isinstance(e, lc.Resumed)]
        self.assertEqual(len(resumed), 1, resumed)
        self.assertGreater(resumed[0].offset, 0)
        self.assertEqual(completion.content, uncut.content)
        self.assertEqual("".join(e.text for e in events if isinstance(e, lc.Content)), uncut.content)
        self.assertEqual(completion.usage["completion_tokens"], 120)

    def test_count_response_tokens_is_what_respond_counts(self):
        counted = run_with_timeout(lambda: self.client.count_response_tokens(_E_SEA[0]["content"]), 30)
        plain = self.client.request("POST", "/v1/responses/input_tokens", {"input": _E_SEA[0]["content"]})
        self.assertEqual(counted, plain["input_tokens"])
        completion = run_with_timeout(
            lambda: self.client.respond(_E_SEA[0]["content"], max_output_tokens=4, temperature=0), 60
        )
        self.assertEqual(counted, completion.usage["prompt_tokens"])
        more = run_with_timeout(
            lambda: self.client.count_response_tokens(_E_SEA[0]["content"], instructions="Answer in French."), 30
        )
        self.assertGreater(more, counted)


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealLastRoutesAsync(AsyncDriver, TestRealLastRoutes):
    """The same on AsyncClient."""


def _reload_router():
    """The router reads its models directory again (``GET /models?reload=1``)."""
    with lc.Client(REAL_ROUTER, limits=REAL_LIMITS) as client:
        client.request("GET", "/models", query={"reload": "1"})


@unittest.skipUnless(REAL_ROUTER, "no router instance: set LOOPCLIENT_REAL_ROUTER (.ci/run does)")
class TestRealRouterModels(ClientFactory, unittest.TestCase):
    """watch_models and load_model(wait=True) on the real router (dev/llama-server.sh start-router): beta
    unloaded, then loaded while watched; a model file in the router's models directory that cannot load."""

    def setUp(self):
        self.client = self.new_client(REAL_ROUTER, limits=REAL_LIMITS)
        self.addCleanup(self.client.close)

    def unloaded(self, name):
        if _status(self.client, name) == "loading":
            wait_for(lambda: _status(self.client, name) == "loaded", 60, "%s to load" % name)
        if _status(self.client, name) != "unloaded":
            self.client.unload_model(name)
            wait_for(lambda: _status(self.client, name) == "unloaded", 30, "%s to unload" % name)

    def test_watch_models_sees_a_model_load(self):
        self.unloaded("beta")
        seen = []
        with _watch(self.client, "beta") as stream:
            # the router sends nothing until something happens: read in a thread; the router's reload
            # event ("*") says the watch is open, then beta is loaded
            def read():
                for event in stream:
                    seen.append(event)
                    if event.event == "status_change" and (event.data or {}).get("status") == "loaded":
                        return

            reader = threading.Thread(target=read, daemon=True)
            reader.start()

            def open_():
                self.client.request("GET", "/models", query={"reload": "1"})
                return any(e.event == "models_reload" for e in seen)

            wait_for(open_, 10, "the watch to see the router's reload")
            self.assertEqual(run_with_timeout(lambda: self.client.load_model("beta"), 30), {"success": True})
            reader.join(90)
            self.assertFalse(reader.is_alive(), seen)
        self.assertEqual({e.model for e in seen}, {"beta", "*"})
        statuses = [(e.event, (e.data or {}).get("status")) for e in seen if e.model == "beta"]
        self.assertEqual(statuses[0], ("model_status", "loading"))
        self.assertIn(("status_change", "loading"), statuses)
        self.assertEqual(statuses[-1], ("status_change", "loaded"))
        self.assertEqual(seen[-1].data["info"]["id"], "beta")
        self.assertEqual(_status(self.client, "beta"), "loaded")

    def test_complete_openai_is_routed_to_the_model(self):
        wait_for(lambda: _loaded(self.client, "alpha"), 90, "alpha to load")
        client = self.new_client(REAL_ROUTER, limits=REAL_LIMITS, model="alpha")
        self.addCleanup(client.close)
        events = []
        completion = run_with_timeout(
            lambda: client.complete_openai("The sky is", slot=0, on_event=events.append, max_tokens=8, temperature=0),
            90,
        )
        self.assertEqual(completion.model, "alpha")
        self.assertEqual(completion.usage["completion_tokens"], 8)
        self.assertEqual("".join(e.text for e in events if isinstance(e, lc.Content)), completion.content)

    def test_load_model_wait_returns_once_loaded(self):
        self.unloaded("beta")
        t = Timer()
        self.assertEqual(run_with_timeout(lambda: self.client.load_model("beta", wait=True), 90), {"success": True})
        self.assertEqual(_status(self.client, "beta"), "loaded")
        self.assertLess(t.elapsed, 60)

    def test_load_model_wait_of_a_file_that_cannot_load_raises_the_router_status(self):
        models = REAL_ROUTER[: -len(".sock")] + ".models"  # where start-router puts the model symlinks
        self.assertTrue(os.path.isdir(models), models)
        name = "broken-%d-%s" % (os.getpid(), self.CLIENT)
        path = os.path.join(models, name + ".gguf")
        with open(path, "wb") as f:
            f.write(b"GGUF" + b"\0" * 60)  # the magic, then nothing a loader can read
        self.addCleanup(_reload_router)  # a client of its own: the test's (an AsyncDriver's loop) is gone by then
        self.addCleanup(os.unlink, path)
        self.client.request("GET", "/models", query={"reload": "1"})  # the router reads its directory again
        self.assertEqual(_status(self.client, name), "unloaded")
        with self.assertRaises(lc.ServerError) as caught:
            run_with_timeout(lambda: self.client.load_model(name, wait=True), 90)
        self.assertEqual((caught.exception.code, caught.exception.type), (1, "load_failed"))
        self.assertIs(caught.exception.error["failed"], True)
        self.assertIn("could not load model %r" % name, str(caught.exception))
        with self.assertRaises(lc.HTTPStatusError) as caught:
            run_with_timeout(lambda: self.client.load_model("nonesuch-%d" % os.getpid(), wait=True), 30)
        self.assertEqual(caught.exception.status, 404)


@unittest.skipUnless(REAL_ROUTER, "no router instance: set LOOPCLIENT_REAL_ROUTER (.ci/run does)")
class TestRealRouterModelsAsync(AsyncDriver, TestRealRouterModels):
    """The same on AsyncClient."""


# -----------------------------------------------------------------------------------------------------
# Resumable streams on the real server: a proxy of our own cuts the connection, a process is killed
# -----------------------------------------------------------------------------------------------------


class CutProxy(_UnixServer):
    """A threaded Unix-socket proxy to ``upstream`` that cuts the first streamed response's connection (a
    POST that asks for ``text/event-stream``) after ``cut`` raw bytes: both ends are shut down, as a lost
    connection.  Every other connection is forwarded whole.  ``cuts``: connections cut so far."""

    def __init__(self, upstream, cut):
        self.upstream = upstream
        self.cut = cut
        self.cuts = 0
        _UnixServer.__init__(self, "lcp", "proxy.sock")

    def _serve(self, conn, number):
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if not self._track(up):
            self._untrack(conn)
            return
        try:
            conn.settimeout(30)
            up.settimeout(120)
            up.connect(self.upstream)
            head = b""
            while b"\r\n\r\n" not in head:
                more = conn.recv(65536)
                if not more:
                    return
                head += more
            with self.lock:
                cutting = self.cuts == 0 and head.startswith(b"POST ") and b"text/event-stream" in head
                if cutting:
                    self.cuts += 1
            up.sendall(head)
            self._start(self._pipe, conn, up)
            sent = 0
            while True:
                data = up.recv(65536)
                if not data:
                    break
                if cutting and sent + len(data) >= self.cut:
                    conn.sendall(data[: self.cut - sent])
                    break
                conn.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (conn, up):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._untrack(sock)

    @staticmethod
    def _pipe(src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    return
                dst.sendall(data)
        except OSError:
            pass


#: The long chat of the resumable tests: 300 tokens at temperature 0, so that an uncut run says the same.
STORY = [{"role": "user", "content": "Write a long story about the sea."}]
STORY_PARAMS = {"max_tokens": 300, "temperature": 0, "seed": 1}


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealResume(ClientFactory, unittest.TestCase):
    """Resumable streams against the real server: cut by a proxy, resumed from its buffer; read by another
    process after the first was killed; deleted when they end early, so that the slot is free at once."""

    limits = REAL_LIMITS

    def setUp(self):
        self.client = self.new_client(REAL_SOCKET, limits=self.limits)
        self.addCleanup(self.client.close)
        _idle(self.client)

    def uncut(self):
        """The 300-token story from an uncut, non-resumable run."""
        with lc.Client(REAL_SOCKET, limits=REAL_LIMITS) as client:
            completion, _ = _real_chat(client, STORY, 120, slot=0, **STORY_PARAMS)
        return completion

    def slot_idle(self):
        return not self.client.slots()[0].is_processing

    def test_a_cut_connection_is_resumed_and_nothing_is_lost_or_repeated(self):
        proxy = CutProxy(REAL_SOCKET, 3000)
        self.addCleanup(proxy.close)
        client = self.new_client(proxy.path, limits=self.limits)
        self.addCleanup(client.close)
        events = []
        stream = client.stream(STORY, slot=0, resumable=True, **STORY_PARAMS)
        run_with_timeout(lambda: events.extend(stream), 120)
        completion = stream.completion
        self.assertEqual(proxy.cuts, 1)
        resumed = [e for e in events if isinstance(e, lc.Resumed)]
        self.assertEqual(len(resumed), 1, resumed)
        self.assertGreater(resumed[0].offset, 0)
        self.assertEqual(completion.usage["completion_tokens"], 300)
        self.assertEqual("".join(e.text for e in events if isinstance(e, lc.Content)), completion.content)
        replay = self.client.resume(stream.conversation_id)
        run_with_timeout(lambda: list(replay), 60)
        self.assertEqual(replay.completion.content, completion.content)
        self.assertEqual(replay.completion.usage, completion.usage)
        found = self.client.lookup_streams([stream.conversation_id])
        self.assertEqual([(e["is_done"], e["total_bytes"]) for e in found], [(True, replay.offset)])
        # the end of the last event's block: the finish and usage chunks, which yield none, may come after it
        self.assertLessEqual(stream.offset, replay.offset)
        self.assertEqual(self.uncut().content, completion.content)
        self.assertIs(self.client.delete_stream(stream.conversation_id), True)

    def test_a_killed_process_s_stream_is_read_whole_by_another(self):
        conversation = "lc-test-killed-%d-%s" % (os.getpid(), self.CLIENT)
        script = (
            "import sys; sys.path.insert(0, %r); import loopclient as lc\n"
            "client = lc.Client(%r)\n"
            "for event in client.stream(%r, slot=0, resumable=%r, **%r):\n"
            "    if isinstance(event, lc.Content):\n"
            "        sys.stdout.write('.\\n'); sys.stdout.flush()\n"
        ) % (HERE, REAL_SOCKET, STORY, conversation, STORY_PARAMS)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        self.addCleanup(proc.wait, 10)
        self.addCleanup(proc.stdout.close)
        deadline = time.monotonic() + 60
        heard = 0
        while heard < 20:
            ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
            self.assertTrue(ready, "the child streamed nothing within 60 s")
            line = proc.stdout.readline()
            self.assertEqual(line, b".\n", "the child ended before it was killed")
            heard += 1
        os.kill(proc.pid, signal.SIGKILL)
        self.assertEqual(proc.wait(10), -signal.SIGKILL)
        self.assertFalse(self.slot_idle(), "the server stopped generating when the child died")
        stream = self.client.resume(conversation)
        events = run_with_timeout(lambda: list(stream), 120)
        completion = stream.completion
        self.assertEqual(completion.usage["completion_tokens"], 300)
        self.assertEqual("".join(e.text for e in events if isinstance(e, lc.Content)), completion.content)
        self.assertEqual(completion.content, self.uncut().content)
        self.assertIs(self.client.delete_stream(conversation), True)

    def _freed_within_a_second(self, conversation):
        t = Timer()
        wait_for(self.slot_idle, 1.0 + MARGIN, "the slot to be free after the stream ended early")
        self.assertLess(t.elapsed, 1.0 + MARGIN)
        self.assertEqual(self.client.lookup_streams([conversation]), [])  # deleted: the server forgot it

    @real_time
    def test_cancel_frees_the_slot_within_a_second(self):
        stream = self.client.stream(STORY, slot=0, resumable=True, ignore_eos=True, **STORY_PARAMS)
        contents = []

        def read_some():
            for event in stream:
                if isinstance(event, lc.Content):
                    contents.append(event)
                    if len(contents) == 5:
                        return

        run_with_timeout(read_some, 60)
        self.assertFalse(self.slot_idle())
        stream.cancel()
        with self.assertRaises(lc.CancelledError):
            run_with_timeout(lambda: list(stream), 5)
        self._freed_within_a_second(stream.conversation_id)

    def test_an_on_event_exception_frees_the_slot_within_a_second(self):
        conversation = "lc-test-on-event-%d-%s" % (os.getpid(), self.CLIENT)
        contents = []

        def on_event(event):
            if isinstance(event, lc.Content):
                contents.append(event)
                if len(contents) == 5:
                    raise KeyError("enough")

        with self.assertRaises(KeyError):
            run_with_timeout(
                lambda: self.client.chat(
                    STORY, slot=0, resumable=conversation, ignore_eos=True, on_event=on_event, **STORY_PARAMS
                ),
                60,
            )
        self._freed_within_a_second(conversation)

    def test_without_the_delete_the_server_keeps_generating(self):
        """What the DELETE is for: a resumable stream whose connection is lost keeps its slot busy."""
        conversation = "lc-test-no-delete-%d-%s" % (os.getpid(), self.CLIENT)
        body = json.dumps(dict(STORY_PARAMS, messages=STORY, stream=True, id_slot=0, ignore_eos=True)).encode()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        sock.connect(REAL_SOCKET)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"X-Conversation-Id: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (conversation.encode(), len(body), body)
        )
        data = b""
        while data.count(b"data: ") < 5:
            more = sock.recv(65536)
            self.assertTrue(more, data[:300])
            data += more
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        cut = Timer()
        still = []
        while cut.elapsed < 1.0 + MARGIN:  # the time the DELETE frees it in: still processing all along
            still.append(not self.slot_idle())
        self.assertTrue(all(still), still)
        found = self.client.lookup_streams([conversation])
        self.assertEqual([(e["conversation_id"], e["is_done"]) for e in found], [(conversation, False)])
        self.assertIs(self.client.delete_stream(conversation), True)
        self._freed_within_a_second(conversation)

    def test_a_finished_stream_is_deleted(self):
        conversation = "lc-test-finished-%d-%s" % (os.getpid(), self.CLIENT)
        completion, _ = _real_chat(self.client, SEA, slot=0, resumable=conversation, max_tokens=16, temperature=0)
        self.assertTrue(completion.content)
        found = _marked_done(self.client, conversation)
        self.assertEqual([(e["conversation_id"], e["is_done"]) for e in found], [(conversation, True)])
        self.assertGreater(found[0]["total_bytes"], 0)
        self.assertIs(self.client.delete_stream(conversation), True)
        self.assertEqual(self.client.lookup_streams([conversation]), [])
        with self.assertRaises(lc.StreamClosedError) as caught:
            run_with_timeout(lambda: list(self.client.resume(conversation)), 30)
        self.assertIn("no longer knows it", str(caught.exception))


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealResumeAsync(AsyncDriver, TestRealResume):
    test_without_the_delete_the_server_keeps_generating = None  # no client in it: the threaded run has it


# =====================================================================================================
# Behind real fronts: nginx, HAProxy and Caddy, from the configurations in dev/fronts
# =====================================================================================================


FRONTS_DIR = os.path.join(HERE, "dev", "fronts")


#: Each front: its template in dev/fronts, how it names a server, and its balancing policies.
FRONT_KINDS = {
    "nginx": {
        "file": "nginx.conf",
        "server": "server unix:%s max_fails=0;",
        "join": "\n        ",
        "balance": {"pin": "hash $http_x_conversation_id consistent;", "least": "least_conn;", "rr": ""},
    },
    "haproxy": {
        "file": "haproxy.cfg",
        "server": "server s%d unix@%s",
        "join": "\n    ",
        "balance": {"pin": "hdr(X-Conversation-Id)", "least": "leastconn", "rr": "roundrobin"},
    },
    "caddy": {
        "file": "Caddyfile",
        "server": "unix/%s",
        "join": " ",
        "balance": {"pin": "header X-Conversation-Id", "least": "least_conn", "rr": "round_robin"},
    },
}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def render_front(kind, servers, balance="pin", timeout=2, directory="/tmp", port=0, tls_port=0):
    """The configuration of ``kind`` ("nginx", "haproxy", "caddy") from its template in dev/fronts, in front
    of ``servers`` (Unix socket paths), balancing by ``balance`` ("pin": by X-Conversation-Id, "least",
    "rr"), with an idle timeout of ``timeout`` seconds toward the servers."""
    spec = FRONT_KINDS[kind]
    with open(os.path.join(FRONTS_DIR, spec["file"]), encoding="utf-8") as f:
        text = f.read()
    if kind == "haproxy":
        lines = [spec["server"] % (i, path) for i, path in enumerate(servers)]
    else:
        lines = [spec["server"] % path for path in servers]
    fill = {
        "@DIR@": directory,
        "@PORT@": str(port),
        "@TLS_PORT@": str(tls_port),
        "@CERT@": _API_TLS_CERT,
        "@KEY@": _API_TLS_KEY,
        "@TIMEOUT@": str(timeout),
        "@BALANCE@": spec["balance"][balance],
        "@SERVERS@": spec["join"].join(lines),
    }
    lines = text.splitlines(True)
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("#"):  # the comments name the placeholders: they stay
            for name, value in fill.items():
                line = line.replace(name, value)
            assert not re.search(r"@[A-Z_]+@", line), line
            lines[i] = line
    return "".join(lines)


class Front:
    """A real front (nginx, HAProxy or Caddy) of the test's own, in the foreground, on free ports, from its
    dev/fronts template (see ``render_front``); ``url`` (and ``tls_url`` for nginx) once it listens.
    ``close()`` stops it (SIGTERM, then SIGKILL to its process group) and removes its directory."""

    def __init__(self, kind, servers, balance="pin", timeout=2):
        self.kind = kind
        self.tmp = tempfile.mkdtemp(prefix="lcfront", dir="/tmp")
        self.port, self.tls_port = free_port(), free_port()
        self.config = os.path.join(self.tmp, FRONT_KINDS[kind]["file"])
        with open(self.config, "w", encoding="utf-8") as f:
            f.write(render_front(kind, servers, balance, timeout, self.tmp, self.port, self.tls_port))
        env = dict(os.environ, HOME=self.tmp, XDG_DATA_HOME=self.tmp, XDG_CONFIG_HOME=self.tmp)
        command = {
            "nginx": ["nginx", "-c", self.config, "-p", self.tmp, "-e", os.path.join(self.tmp, "error.log")],
            "haproxy": ["haproxy", "-f", self.config, "-db"],
            "caddy": ["caddy", "run", "--config", self.config, "--adapter", "caddyfile"],
        }[kind]
        self.log = open(os.path.join(self.tmp, "front.log"), "wb")
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.url = "http://127.0.0.1:%d" % self.port
        self.tls_url = "https://127.0.0.1:%d" % self.tls_port if kind == "nginx" else None
        try:
            self._wait_listening(10.0)
        except BaseException:
            self.close()
            raise

    def _wait_listening(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError("%s exited (%s): %s" % (self.kind, self.proc.returncode, self.output()))
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError("%s did not listen within %.0f s: %s" % (self.kind, timeout, self.output()))
                time.sleep(0.02)  # polling for a process we just started; no event to wait on

    def output(self):
        self.log.flush()
        with open(os.path.join(self.tmp, "front.log"), "rb") as f:
            return f.read()[-2000:].decode("utf-8", "replace")

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # nginx's master stops and reaps its worker: no orphan left behind
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its group is left
        except OSError:
            pass
        self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


# -- what the fronts answer, captured from the real ones (dev/testdata/transcripts 100-105) -------------


def front_answer(name):
    """A front's own answer, byte for byte: "nginx 504", "nginx 502", "haproxy 504", "haproxy 503",
    "caddy 504", "caddy 502" (captured), or "cloudflare 520" ... "cloudflare 524" (made, as Cloudflare's
    pages look: a title naming the host and the status, ``Server: cloudflare``)."""
    files = {
        "nginx 504": "100_nginx_504_queued.raw.txt",
        "nginx 502": "101_nginx_502_server_gone.raw.txt",
        "haproxy 504": "102_haproxy_504_queued.raw.txt",
        "haproxy 503": "103_haproxy_503_server_gone.raw.txt",
        "caddy 504": "104_caddy_504_queued.raw.txt",
        "caddy 502": "105_caddy_502_server_gone.raw.txt",
    }
    if name in files:
        return load_transcript(files[name])
    status = int(name.split()[1])
    title = CLOUDFLARE_TITLES[status]
    page = (
        b'<!DOCTYPE html>\n<!--[if lt IE 7]> <html class="no-js ie6 oldie" lang="en-US"> <![endif]-->\n'
        b"<head>\n<title>llm.example.com | %d: %s</title>\n"
        b'<meta charset="UTF-8" />\n</head>\n<body>\n<div id="cf-wrapper">\n'
        b"<h1>%s&nbsp;<span>Error code %d</span></h1>\n</div>\n</body>\n</html>\n" % (status, title, title, status)
    )
    return (
        b"HTTP/1.1 %d \r\nDate: Thu, 03 Dec 2026 08:00:00 GMT\r\nContent-Type: text/html; charset=UTF-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\nServer: cloudflare\r\nCF-RAY: 8f1c2d3e4f5a6b7c-AMS\r\n\r\n%s"
        % (status, len(page), page)
    )


CLOUDFLARE_TITLES = {
    520: b"Web server is returning an unknown error",
    521: b"Web server is down",
    522: b"Connection timed out",
    523: b"Origin is unreachable",
    524: b"A timeout occurred",
}


def front_page(name):
    """The body of ``front_answer(name)``."""
    return front_answer(name).partition(b"\r\n\r\n")[2]


#: Who each front says it is, in a message: its Server header, or "the front" (HAProxy sends none).
FRONT_NAMES = {"nginx": "nginx/1.22.1", "haproxy": "the front", "caddy": "Caddy", "cloudflare": "cloudflare"}


class TestParserFrontPages(unittest.TestCase):
    """Error bodies that are not JSON become one line: a page's title (else its first text), whitespace
    collapsed, at most 200 characters; the error names the front from its Server header."""

    def test_the_real_fronts_pages(self):
        for name, message in (
            ("nginx 504", "504 Gateway Time-out"),
            ("nginx 502", "502 Bad Gateway"),
            ("haproxy 504", "504 Gateway Time-out"),  # no <title>: the first text
            ("haproxy 503", "503 Service Unavailable"),
            ("caddy 504", "(empty body)"),
            ("caddy 502", "(empty body)"),
            ("cloudflare 524", "llm.example.com | 524: A timeout occurred"),
        ):
            with self.subTest(name):
                self.assertEqual(lc.parse_error_envelope(front_page(name)), (message, None))

    def test_one_line_at_most_200_characters(self):
        one = lambda body: lc.parse_error_envelope(body)[0]
        self.assertEqual(
            one(b"<html><head><title>\n  504\t Gateway \r\n Time-out \n</title></head></html>"), "504 Gateway Time-out"
        )
        self.assertEqual(
            one(b"  upstream connect error\nor disconnect/reset before headers\n"),
            "upstream connect error or disconnect/reset before headers",
        )
        self.assertEqual(
            one(b"<p>a &lt; b&nbsp;&amp; c</p>"), "a < b & c"
        )  # entities decoded, the no-break space collapsed too
        self.assertEqual(one(b"<html><title> </title><body>\n<h1> Bad\n gateway </h1><p>more</p>"), "Bad gateway")
        self.assertEqual(
            one(b"<html><head><style>h1 {color: red}</style><script>x()</script></head><h1>Down</h1>"), "Down"
        )
        self.assertEqual(one(b"error: a < b"), "error: a < b")  # text, not a page: the "<" stays
        self.assertEqual(one(b"<!DOCTYPE html>\n<!-- a comment -->\n<html></html>\n"), "(empty body)")
        self.assertEqual(one(b" \r\n\t "), "(empty body)")
        self.assertEqual(one(b""), "(empty body)")
        long = one(b"<title>" + b"word " * 100 + b"</title>")
        self.assertEqual(len(long), 200)
        self.assertEqual(long, ("word " * 40)[:197].rstrip() + "...")
        self.assertEqual(len(one(b"x" * 100000)), 200)
        self.assertEqual(one(b"<title>\xff caf\xc3\xa9</title>"), "\ufffd caf\xe9")
        for body in (
            b"<h1>a\nb</h1>",
            b"a\rb",
            "a\x85b\u2028c".encode(),
            b"<title>a\nb</title>",
        ):
            self.assertNotIn("\n", one(body))
            self.assertNotIn("\r", one(body))

    def test_a_json_envelope_is_read_as_before(self):
        body = b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'
        self.assertEqual(lc.parse_error_envelope(body)[0], "File Not Found")

    def test_the_error_names_the_front(self):
        page = front_page("nginx 504")
        err = lc.HTTPStatusError(504, "504 Gateway Time-out", page, "nginx/1.22.1")
        self.assertEqual(str(err), "HTTP 504 from nginx/1.22.1: 504 Gateway Time-out")
        self.assertEqual(
            (err.status, err.message, err.body, err.server), (504, "504 Gateway Time-out", page, "nginx/1.22.1")
        )
        for status, server, text in (
            (504, None, "HTTP 504 from the front: m"),  # a status llama-server never sends
            (502, None, "HTTP 502 from the front: m"),
            (520, None, "HTTP 520 from the front: m"),
            (524, None, "HTTP 524 from the front: m"),
            (503, None, "HTTP 503: m"),  # llama-server sends 503 itself
            (404, "llama.cpp", "HTTP 404: m"),
            (502, "llama.cpp", "HTTP 502: m"),  # llama.cpp says it answered: no front to name
            (403, "nginx/1.22.1", "HTTP 403 from nginx/1.22.1: m"),
            (503, "Caddy", "HTTP 503 from Caddy: m"),
            (400, None, "HTTP 400: m"),
        ):
            with self.subTest(status=status, server=server):
                err = lc.HTTPStatusError(status, "m", b"", server)
                self.assertEqual((str(err), err.server), (text, server))
        self.assertEqual(lc.HTTPStatusError(500, "m").server, None)  # the old signature still works


class _FrontBuffer(_r_Buffer):
    """``_r_Buffer`` behind a front: the POST, the GETs and the lookups may first be answered by the front
    itself (``posts``, ``gets``, ``lookups``: raw answers used in order, then the server answers).  A POST
    the front answered still reached the server, which keeps it (a queued resumable request: 87) unless
    ``register_lost_head`` is False."""

    def __init__(self, server, raw, posts=(), gets=(), lookups=(), cuts=()):
        self.posts, self.gets, self.lookups = list(posts), list(gets), list(lookups)
        _r_Buffer.__init__(self, server, raw, cuts=cuts)

    def _front(self, answers):
        with self.lock:
            return answers.pop(0) if answers else None

    def post(self, req):
        answer = self._front(self.posts)
        if answer is None:
            return _r_Buffer.post(self, req)
        conv = req.headers.get("x-conversation-id")
        with self.lock:
            self.log.append(("POST", conv, None))
            if conv is not None and self.register_lost_head:
                self.ids.add(conv)
        req.send(answer)

    def get(self, req):
        answer = self._front(self.gets)
        if answer is None:
            return _r_Buffer.get(self, req)
        conv, start = self._query(req)
        with self.lock:
            self.log.append(("GET", conv, int(start)))
        req.send(answer)

    def lookup(self, req):
        answer = self._front(self.lookups)
        if answer is None:
            return _r_Buffer.lookup(self, req)
        with self.lock:
            self.log.append(("LOOKUP", tuple(req.json()["conversation_ids"]), None))
        req.send(answer)

    def carried(self):
        """(method, path, X-Conversation-Id) of each request the server saw but /slots and /props."""
        with self.server.lock:
            requests = list(self.server.requests)
        return [
            (r.method, r.path.partition("?")[0], r.headers.get("x-conversation-id"))
            for r in requests
            if r.path.partition("?")[0] not in ("/slots", "/props")
        ]


_FR_GONE_404 = http_response(_R_GONE, status=b"404 Not Found")


class TestFaultFronts(_f_Case):
    """What nginx, HAProxy, Caddy (and Cloudflare) answer on their own, byte for byte, before anything was
    delivered: a 504 or 524 (the front stopped waiting: the request was queued for a slot) is waited out
    under busy_wait, a 502 or 520-523 (the front cannot reach the server) under load_wait; resumable
    requests are looked up and resumed rather than sent twice; several servers behind one address are no
    reason to call a slot stalled or wedged."""

    def _fr_retries(self):
        return [e for e in self._f_events if isinstance(e, lc.Retrying)]

    def _fr_one_line(self, err):
        self.assertNotIn("\n", str(err))
        self.assertNotIn("\r", str(err))

    # -- 504 and 524: the front stopped waiting for a slot ---------------------------------------------

    def test_a_504_or_524_is_retried_under_busy_wait_then_served(self):
        for name in ("nginx 504", "haproxy 504", "caddy 504", "cloudflare 524"):
            with self.subTest(name):
                # load_wait shorter than the second backoff: the wrong budget would end it
                self.client_with(busy_wait=1.0, load_wait=0.1)
                answer = front_answer(name)
                self.use(_f_sequence(reply(answer), reply(answer), reply(STREAM_HEAD + _F_OK_BODY)))
                done = self._f_succeeds(2 * lc.BACKOFF_FIRST + lc.BACKOFF_MAX)
                self.assertEqual(done.content, "Hello world")
                status = name.split()[1]
                reason = "HTTP %s from %s: the front stopped waiting for a slot" % (
                    status,
                    FRONT_NAMES[name.split()[0]],
                )
                self.assertEqual([(r.attempt, r.reason) for r in self._fr_retries()], [(1, reason), (2, reason)])
                # (a Waiting comes in between when a head is a poll late on a busy machine)
                self.assertEqual(
                    [k for k in self._f_kinds() if k != "Waiting"], ["Retrying", "Retrying", "Content", "Content"]
                )
                self.assertEqual(len(self.server.chat_requests()), 3)
                self.server.requests.clear()

    def test_a_504_past_busy_wait_is_a_wait_timeout_naming_the_front(self):
        for name in ("nginx 504", "haproxy 504", "caddy 504", "cloudflare 524"):
            with self.subTest(name):
                self.client_with(busy_wait=0.8, load_wait=0.3)
                self.use(reply(front_answer(name)))
                err = self._f_fails(lc.WaitTimeoutError, 0.8)
                self._fr_one_line(err)
                self.assertIn("HTTP %s" % name.split()[1], str(err))
                self.assertIn(FRONT_NAMES[name.split()[0]], str(err))
                self.assertIn("busy_wait", str(err))
                self.assertIsInstance(err.__cause__, lc.HTTPStatusError)
                self.assertEqual(err.__cause__.body, front_page(name))

    def test_a_resumable_request_cut_by_a_504_and_known_is_resumed_from_zero(self):
        raw = load_transcript("04_chat_stream.raw.txt")
        buf = _FrontBuffer(self.server, raw)
        whole, whole_events = self.collect(resumable="conv-1")
        buf.reset()
        self.server.requests.clear()
        buf.posts = [front_answer("nginx 504")]
        completion, events = self.collect(resumable="conv-1")
        self.assertEqual(buf.methods(), ["POST", "LOOKUP", "GET"])  # not sent again: it keeps its place
        self.assertEqual(buf.replays(), [0])
        self.assertEqual(events, [lc.Resumed(0, 1)] + whole_events)
        self.assertEqual(completion, whole)
        self.assertEqual(
            buf.carried(),
            [
                ("POST", "/v1/chat/completions", "conv-1"),
                ("POST", "/v1/streams/lookup", "conv-1"),
                ("GET", "/v1/stream", "conv-1"),
            ],
        )

    def test_a_resumable_request_cut_by_a_504_and_unknown_is_sent_again(self):
        buf = _FrontBuffer(self.server, load_transcript("04_chat_stream.raw.txt"), posts=[front_answer("haproxy 504")])
        buf.register_lost_head = False
        completion, events = self.collect(resumable="conv-1")
        self.assertEqual(buf.methods(), ["POST", "LOOKUP", "POST"])
        reason = "HTTP 504 from the front: the front stopped waiting for a slot"
        self.assertEqual([(type(e), e.attempt, e.reason) for e in events[:1]], [(lc.Retrying, 1, reason)])
        self.assertEqual(completion.content, "".join(e.text for e in events if isinstance(e, lc.Content)))
        self.assertEqual([c for _, _, c in buf.carried()], ["conv-1"] * 3)

    def test_a_504_answering_a_resume_is_looked_up_and_resumed_again(self):
        raw = load_transcript("04_chat_stream.raw.txt")
        buf = _FrontBuffer(self.server, raw)
        whole, whole_events = self.collect(resumable="conv-1")
        cut = len(buf.head) + 900
        buf.reset([cut])
        self.server.requests.clear()
        buf.gets = [front_answer("nginx 504")]
        completion, events = self.collect(resumable="conv-1")
        self.assertEqual(buf.methods(), ["POST", "GET", "LOOKUP", "GET"])
        self.assertEqual(len(set(buf.replays())), 1, buf.replays())  # the same offset asked again
        self.assertEqual([e for e in events if not isinstance(e, lc.Resumed)], whole_events)
        self.assertEqual(completion, whole)
        self.assertEqual({c for _, _, c in buf.carried()}, {"conv-1"})

    # -- 502 and 520-523: the front cannot reach the server ----------------------------------------------

    def test_a_502_or_520_to_523_is_retried_under_load_wait_then_served(self):
        pages = {
            "nginx 502": "502 Bad Gateway",
            "caddy 502": "(empty body)",
            "cloudflare 520": "llm.example.com | 520: Web server is returning an unknown error",
            "cloudflare 521": "llm.example.com | 521: Web server is down",
            "cloudflare 522": "llm.example.com | 522: Connection timed out",
            "cloudflare 523": "llm.example.com | 523: Origin is unreachable",
        }
        for name, text in pages.items():
            with self.subTest(name):
                self.client_with(load_wait=1.0, busy_wait=0.1)  # busy_wait would end it: the wrong budget
                answer = front_answer(name)
                self.use(_f_sequence(reply(answer), reply(answer), reply(STREAM_HEAD + _F_OK_BODY)))
                done = self._f_succeeds(2 * lc.BACKOFF_FIRST + lc.BACKOFF_MAX)
                self.assertEqual(done.content, "Hello world")
                reason = "HTTP %s from %s: %s" % (name.split()[1], FRONT_NAMES[name.split()[0]], text)
                self.assertEqual([(r.attempt, r.reason) for r in self._fr_retries()], [(1, reason), (2, reason)])
                # (a Waiting comes in between when a head is a poll late on a busy machine)
                self.assertEqual(
                    [k for k in self._f_kinds() if k != "Waiting"], ["Retrying", "Retrying", "Content", "Content"]
                )
                self.server.requests.clear()

    def test_a_502_past_load_wait_is_a_load_timeout_naming_the_front(self):
        for name in ("nginx 502", "caddy 502", "cloudflare 521"):
            with self.subTest(name):
                self.client_with(load_wait=0.6, busy_wait=0.2)
                self.use(reply(front_answer(name)))
                err = self._f_fails(lc.LoadTimeoutError, 0.6)
                self._fr_one_line(err)
                self.assertIn("HTTP %s" % name.split()[1], str(err))
                self.assertIn(FRONT_NAMES[name.split()[0]], str(err))
                self.assertIn("load_wait", str(err))
                self.assertIsInstance(err.__cause__, lc.HTTPStatusError)
                self.assertEqual(err.__cause__.body, front_page(name))

    def test_haproxy_s_503_when_its_server_is_gone_is_waited_out_under_load_wait(self):
        self.client_with(load_wait=0.6, busy_wait=0.2)
        self.use(reply(front_answer("haproxy 503")))
        err = self._f_fails(lc.LoadTimeoutError, 0.6)
        self._fr_one_line(err)
        self.assertIn("load_wait", str(err))
        cause = err.__cause__
        self.assertIsInstance(cause, lc.HTTPStatusError)
        self.assertEqual((cause.status, cause.message, cause.server), (503, "503 Service Unavailable", None))
        self.assertEqual(cause.body, front_page("haproxy 503"))
        self.assertEqual({r.reason for r in self._fr_retries()}, {"HTTP 503: 503 Service Unavailable"})

    # -- an error page, not retried: one line naming the front, the page kept ----------------------------

    def test_an_error_page_is_one_line_naming_the_front(self):
        page = b"<html>\r\n<head><title>403 Forbidden</title></head>\r\n<body>\r\n<center><h1>403 Forbidden</h1></center>\r\n<hr><center>nginx/1.22.1</center>\r\n</body>\r\n</html>\r\n"
        forbidden = (
            b"HTTP/1.1 403 Forbidden\r\nServer: nginx/1.22.1\r\nContent-Type: text/html\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (len(page), page)
        )
        self.use(reply(forbidden))
        err = self._f_fails(lc.HTTPStatusError)
        self.assertEqual(str(err), "HTTP 403 from nginx/1.22.1: 403 Forbidden")
        self.assertEqual((err.status, err.server, err.body), (403, "nginx/1.22.1", page))
        self.assertEqual(len(self.server.chat_requests()), 1)  # not retried
        for name, text in (
            ("nginx 504", "HTTP 504 from nginx/1.22.1: 504 Gateway Time-out"),
            ("haproxy 504", "HTTP 504 from the front: 504 Gateway Time-out"),
            ("caddy 502", "HTTP 502 from Caddy: (empty body)"),
            ("haproxy 503", "HTTP 503: 503 Service Unavailable"),
        ):
            with self.subTest(name):
                self.server.route("GET", "/props", reply(front_answer(name)))
                with self.assertRaises(lc.HTTPStatusError) as caught:
                    run_with_timeout(self.client.props, 5)
                self.assertEqual(str(caught.exception), text)
                self.assertEqual(caught.exception.body, front_page(name))
        self.server.route("GET", "/props", reply(json_response(json.loads(_R_GONE), b"404 Not Found")))
        with self.assertRaises(lc.HTTPStatusError) as caught:
            run_with_timeout(self.client.props, 5)
        self.assertEqual((str(caught.exception), caught.exception.server), ("HTTP 404: File Not Found", "llama.cpp"))

    def test_health_of_a_front_that_answers_plain_text(self):
        ok = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 2\r\nConnection: close\r\n\r\nOK"
        self.server.route("GET", "/health", reply(ok))
        self.assertEqual(run_with_timeout(self.client.health, 5), {"status": "ok", "body": "OK"})
        self.server.route("GET", "/health", reply(http_response(b"{}", framing="length")))
        self.assertEqual(run_with_timeout(self.client.health, 5), {})
        self.server.route("GET", "/health", reply(http_response(b'{"status":', framing="length")))
        with self.assertRaises(lc.ProtocolError):  # JSON cut short is still malformed JSON
            run_with_timeout(self.client.health, 5)
        self.server.route("GET", "/health", reply(front_answer("nginx 502")))
        with self.assertRaises(lc.HTTPStatusError) as caught:
            run_with_timeout(self.client.health, 5)
        self.assertEqual(str(caught.exception), "HTTP 502 from nginx/1.22.1: 502 Bad Gateway")

    # -- several servers behind one address ------------------------------------------------------------

    def test_limits_servers(self):
        self.assertEqual(lc.Limits().servers, 1)
        self.assertEqual(lc.Limits(servers=3).servers, 3)
        for bad in (0, -1):
            with self.assertRaises(ValueError):
                lc.Limits(servers=bad)

    def test_with_several_servers_an_idle_slot_is_no_stall(self):
        self.client_with(servers=2, idle_grace=0.2, busy_wait=0.8, load_wait=0.3)
        self.use(_f_hold)
        self._f_fails(lc.WaitTimeoutError, 0.8)
        waits = [e for e in self._f_events if isinstance(e, lc.Waiting)]
        self.assertTrue(waits)
        self.assertEqual({(e.slots_known, e.wedged) for e in waits}, {(False, False)})

    def test_with_several_servers_a_still_slot_is_never_wedged(self):
        still = [
            {
                "id": 0,
                "id_task": 7,
                "is_processing": True,
                "n_prompt_tokens": 5,
                "n_prompt_tokens_processed": 5,
                "next_token": [{"n_decoded": 0, "n_remain": 60, "has_next_token": True}],
            },
            {"id": 1, "id_task": -1, "is_processing": False},
        ]
        self.server.route("GET", "/slots", lambda req: respond_json(req, still))
        self.client_with(servers=2, wedge_wait=0.1, busy_wait=0.6, load_wait=0.3)
        self.use(_f_hold)
        self._f_fails(lc.WaitTimeoutError, 0.6)
        waits = [e for e in self._f_events if isinstance(e, lc.Waiting)]
        self.assertTrue(waits)
        self.assertEqual({(e.slots_known, e.wedged) for e in waits}, {(False, False)})

    def test_with_several_servers_the_pool_is_servers_times_total_slots(self):
        client = self.client_with(servers=2)
        keeper = Gatekeeper(self.server)
        events, results = {}, {}
        threads = [start_chat(client, m, None, events, results) for m in "ABCD"]
        wait_for(lambda: all(keeper.arrived(m) for m in "ABCD"), what="four in flight at once (2 servers x 2 slots)")
        fifth = start_chat(client, "E", None, events, results)
        wait_for(lambda: events["E"], what="E queued")
        self.assertEqual(events["E"], [lc.Queued(4)])
        for marker in "ABCDE":
            keeper.release(marker)
        for thread in threads + [fifth]:
            thread.join(5)
        self.assertEqual(sorted(results[m].content for m in "ABCDE"), list("ABCDE"))
        # Limits.pool still overrides
        client = self.client_with(servers=2, pool=1)
        keeper = Gatekeeper(self.server)
        events, results = {}, {}
        first = start_chat(client, "F", None, events, results)
        wait_for(lambda: keeper.arrived("F"), what="F in flight")
        second = start_chat(client, "G", None, events, results)
        wait_for(lambda: events["G"], what="G queued")
        self.assertEqual(events["G"], [lc.Queued(1)])
        keeper.release("F")
        keeper.release("G")
        for thread in (first, second):
            thread.join(5)
        self.assertEqual([results[m].content for m in "FG"], ["F", "G"])

    def test_slots_answers_that_cannot_come_from_one_server_mean_several(self):
        idle = lambda n, task: [{"id": i, "id_task": task, "is_processing": False} for i in range(n)]
        for name, answers, several in (
            ("the slot count changes", [idle(2, 3), idle(3, 3)], True),
            # one server's slot may take a task queued for it after a later one: no proof of several
            ("a slot's id_task goes back", [idle(2, 9), idle(2, 4)], False),
        ):
            with self.subTest(name):
                asked = []

                def slots(req, answers=answers):
                    asked.append(1)
                    respond_json(req, answers[(len(asked) - 1) % 2])

                self.server.route("GET", "/slots", slots)
                self.client_with(idle_grace=0.3, busy_wait=0.8, load_wait=0.3)  # servers not given: learnt
                self.use(_f_hold)
                outcome, elapsed = self._f_run(self._f_chat(), 8.0)
                waits = [e for e in self._f_events if isinstance(e, lc.Waiting)]
                if several:
                    self.assertIs(type(outcome), lc.WaitTimeoutError, repr(outcome))  # not StalledError at idle_grace
                    self.assertGreaterEqual(elapsed, 0.8 - EARLY)
                    self.assertLessEqual(elapsed, 0.8 + 2 * FAST_FAULTS.poll + MARGIN)
                    self.assertEqual(waits[-1].slots_known, False)
                else:
                    self.assertIs(type(outcome), lc.StalledError, repr(outcome))  # one server's idle slot
                    self.assertLess(elapsed, 0.8 - EARLY)
                    self.assertEqual(waits[-1].slots_known, True)

    def test_with_several_servers_a_failing_slots_is_no_unavailable_server(self):
        # The front answers /slots 502 (it could not reach the server it chose); the request is in flight.
        self.server.route("GET", "/slots", lambda req: respond_json(req, {"error": "bad gateway"}, 502, "Bad Gateway"))
        self.client_with(servers=2, idle_grace=0.3, busy_wait=0.8, load_wait=0.3)
        self.use(_f_hold)
        outcome, elapsed = self._f_run(self._f_chat(), 8.0)
        self.assertIs(type(outcome), lc.WaitTimeoutError, repr(outcome))  # not LoadTimeoutError at load_wait
        self.assertGreaterEqual(elapsed, 0.8 - EARLY)
        self.assertLessEqual(elapsed, 0.8 + 2 * FAST_FAULTS.poll + MARGIN)
        waits = [e for e in self._f_events if isinstance(e, lc.Waiting)]
        self.assertTrue(waits)
        self.assertEqual({w.slots_known for w in waits}, {False})

    # -- resumable streams over several servers: the id on every request, a 404 asked again ---------------

    def test_a_cancelled_resumable_stream_is_deleted_with_its_conversation_id(self):
        buf = _FrontBuffer(
            self.server, load_transcript("04_chat_stream.raw.txt"), cuts=[("hold", len(STREAM_HEAD) + 900)]
        )
        stream = self.client.stream(MSGS, slot=0, resumable="conv-9")
        self.assertIsInstance(run_with_timeout(lambda: next(stream), 5), lc.Content)
        stream.cancel()
        with self.assertRaises(lc.CancelledError):
            run_with_timeout(lambda: list(stream), 5)
        wait_for(lambda: "DELETE" in buf.methods(), what="the DELETE")
        self.assertEqual(
            buf.carried(), [("POST", "/v1/chat/completions", "conv-9"), ("DELETE", "/v1/stream", "conv-9")]
        )

    def test_with_several_servers_a_404_on_a_resume_is_asked_again(self):
        raw = load_transcript("04_chat_stream.raw.txt")
        buf = _FrontBuffer(self.server, raw)
        whole, whole_events = self.collect(resumable="conv-1")
        cut = len(buf.head) + 900
        self.client_with(servers=2)
        buf.reset([cut])
        buf.gets = [_FR_GONE_404]  # the first resume reached the other server
        completion, events = self.collect(resumable="conv-1")
        self.assertEqual(buf.methods(), ["POST", "GET", "GET"])
        self.assertEqual(len(set(buf.replays())), 1, buf.replays())
        resumed = [e for e in events if isinstance(e, lc.Resumed)]
        self.assertEqual([e.offset for e in resumed], buf.replays())
        self.assertEqual([e for e in events if not isinstance(e, (lc.Resumed, lc.Retrying))], whole_events)
        self.assertEqual(completion, whole)
        # two 404s from two servers: the stream is unknown
        buf.reset([cut])
        buf.gets = [_FR_GONE_404, _FR_GONE_404]
        err = self._f_fails(
            lc.StreamClosedError,
            fn=lambda events: self.client.chat(MSGS, slot=0, resumable="conv-1", on_event=events.append),
        )
        self.assertIn("no longer knows it", str(err))
        self.assertEqual(buf.methods(), ["POST", "GET", "GET", "DELETE"])  # every early end deletes the stream

    def test_a_resumable_stream_a_front_ends_cleanly_mid_event_is_resumed(self):
        # Caddy, when its server's connection breaks mid-stream, ends its own chunked body cleanly: the last
        # chunk cut mid-event, then the terminating chunk (transcript 106). The stream has not ended: it is
        # resumed from the bytes received, as a lost connection is.
        caddy = load_transcript("106_caddy_upstream_cut_mid_stream.raw.txt")
        self.assertTrue(caddy.endswith(b"\r\n0\r\n\r\n") and b"[DONE]" not in caddy)
        raw = load_transcript("04_chat_stream.raw.txt")
        buf = _FrontBuffer(self.server, raw)
        whole, whole_events = self.collect(resumable="conv-1")
        buf.reset()
        cut = 900  # inside an event
        self.assertNotIn(buf.body[cut - 2 : cut], (b"\n\n",))
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nServer: Caddy\r\nServer: llama.cpp\r\n"
        buf.posts = [head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(buf.body[:cut]) + b"0\r\n\r\n"]
        completion, events = self.collect(resumable="conv-1")
        self.assertEqual(buf.methods(), ["POST", "GET"])
        # the unfinished event was dropped with the body: the replay starts where it starts
        self.assertEqual(buf.replays(), [buf.body[:cut].rfind(b"\n\n") + 2])
        self.assertEqual([e for e in events if not isinstance(e, lc.Resumed)], whole_events)
        self.assertEqual(completion, whole)

    def test_with_one_server_a_404_on_a_resume_is_final(self):
        buf = _FrontBuffer(self.server, load_transcript("04_chat_stream.raw.txt"), cuts=[len(STREAM_HEAD) + 900])
        buf.gets = [_FR_GONE_404]
        err = self._f_fails(
            lc.StreamClosedError,
            fn=lambda events: self.client.chat(MSGS, slot=0, resumable="conv-1", on_event=events.append),
        )
        self.assertIn("no longer knows it", str(err))
        self.assertEqual(buf.methods(), ["POST", "GET", "DELETE"])  # every early end deletes the stream

    def test_with_several_servers_a_404_on_a_lookup_is_asked_again(self):
        raw = load_transcript("04_chat_stream.raw.txt")
        buf = _FrontBuffer(self.server, raw)
        whole, whole_events = self.collect(resumable="conv-1")
        self.client_with(servers=2, busy_wait=1.0)
        buf.reset()
        buf.posts, buf.lookups = [front_answer("nginx 504")], [_FR_GONE_404]
        completion, events = self.collect(resumable="conv-1")
        self.assertEqual(buf.methods(), ["POST", "LOOKUP", "LOOKUP", "GET"])
        self.assertEqual(events, [lc.Resumed(0, 1)] + whole_events)
        self.assertEqual(completion, whole)
        # a 404 from each server: unknown, so it is sent again
        buf.reset()
        buf.posts, buf.lookups = [front_answer("nginx 504")], [_FR_GONE_404, _FR_GONE_404]
        completion, events = self.collect(resumable="conv-1")
        self.assertEqual(buf.methods(), ["POST", "LOOKUP", "LOOKUP", "POST"])
        self.assertEqual(completion, whole)


TestFaultFrontsSockets, TestFaultFrontsSocketsAsync = on_sockets(
    TestFaultFronts,
    "test_a_504_or_524_is_retried_under_busy_wait_then_served",
    "test_a_resumable_request_cut_by_a_504_and_known_is_resumed_from_zero",
    "test_health_of_a_front_that_answers_plain_text",
)
# -----------------------------------------------------------------------------------------------------
# Cancelling while the connect is in progress
# -----------------------------------------------------------------------------------------------------


def full_tcp_listener(test):
    """A TCP listener on 127.0.0.1 whose accept queue is full (nobody accepts): a new connect neither
    completes nor fails, the SYN goes unanswered.  Its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    test.closers.append(lambda: [s.close() for s in fillers + [listener]])  # before the fd count
    while len(fillers) < 64:
        s = socket.socket()
        s.settimeout(0.3)
        try:
            s.connect(listener.getsockname())
        except socket.timeout:  # the queue is full: this connect hangs, as the client's will
            s.close()
            return "http://127.0.0.1:%d" % listener.getsockname()[1]
        fillers.append(s)
    test.fail("the accept queue never filled")


def full_unix_listener(test):
    """A Unix listener whose listen queue is full: a connect fails at once with EAGAIN.  Its path."""
    where = tempfile.mkdtemp(prefix="lc", dir="/tmp")
    path = os.path.join(where, "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    fillers = []

    def close():
        for s in fillers + [listener]:
            s.close()
        shutil.rmtree(where, True)

    test.closers.append(close)  # before the fd count
    while len(fillers) < 64:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            return path
        fillers.append(s)
    test.fail("the listen queue never filled")


@real_time
class TestCancelDuringConnect(ServerCase):
    """``cancel()`` 0.1 s into a request whose connect cannot complete ends it within 0.2 s: the socket is
    registered before it connects, so the cancel shuts it down (a TCP connect then fails at once).  The
    connect timeout (``poll``) and the ``/props`` one (``liveness``, for ``slot=None``) are far longer."""

    #: a connect waits max(poll, 0.2) s, /props liveness: both far past the 0.2 s a cancel may take
    slow = FAST.replace(poll=1.5, liveness=6.0, load_wait=10.0)

    def cancel_in_connect(self, address, slot):
        client = self.new_client(address, limits=self.slow)
        self.closers.append(client.close)
        stream = client.stream(MSGS, slot=slot)
        events = []
        cancelled = []

        def cancel():
            cancelled.append(time.monotonic())
            stream.cancel()

        timer = threading.Timer(0.1, cancel)
        timer.start()
        self.addCleanup(timer.cancel)
        with self.assertRaises(lc.CancelledError):
            run_with_timeout(lambda: events.extend(stream), 15)
        took = time.monotonic() - cancelled[0]
        self.assertLess(took, lateness(self, 0.2 + MARGIN), "cancelled %.2f s after cancel()" % took)
        return events

    def test_tcp_pinned_slot(self):
        self.assertEqual(self.cancel_in_connect(full_tcp_listener(self), 0), [])  # no Retrying: still connecting

    def test_tcp_any_slot(self):  # the /props connect first
        self.assertEqual(self.cancel_in_connect(full_tcp_listener(self), None), [])

    def test_tls_handshake(self):  # a listener that accepts and never answers the ClientHello
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        accepted = []
        self.closers.append(lambda: [s.close() for s in accepted + [listener]])
        threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
        self.assertEqual(self.cancel_in_connect("https://127.0.0.1:%d" % listener.getsockname()[1], 0), [])
        # it was connected, in the handshake: the connection is there to accept (the accepting thread may
        # come to it only now, on a busy machine)
        wait_for(lambda: accepted, 5, "the listener to accept the connection")
        self.assertEqual(len(accepted), 1)

    def test_unix_pinned_slot(self):  # EAGAIN at once: cancelled in the retries' backoff
        events = self.cancel_in_connect(full_unix_listener(self), 0)
        self.assertTrue(events and all(isinstance(ev, lc.Retrying) for ev in events), events)

    def test_unix_any_slot(self):
        events = self.cancel_in_connect(full_unix_listener(self), None)
        self.assertTrue(all(isinstance(ev, lc.Retrying) for ev in events), events)


class TestCancelDuringConnectAsync(AsyncDriver, TestCancelDuringConnect):
    pass


class TestAsyncClientLoopsInTurn(unittest.TestCase):
    """An ``AsyncClient`` made outside any loop and used by two event loops in turn (``asyncio.run``
    twice): ``close()`` on the second closes the connection kept for the first, whose loop has ended."""

    def test_close_closes_the_ended_loops_kept_connection(self):
        server = KeepAliveServer(lambda req: keep_alive_answer({"tokens": [7]}))
        self.addCleanup(server.close)
        fds = fd_count()
        client = lc.AsyncClient(server.address, limits=FAST)

        async def first():
            return await client.tokenize("x")

        async def second():
            try:
                return await client.tokenize("x")
            finally:
                await client.close()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            self.assertEqual(asyncio.run(first()), [7])
            self.assertEqual(fd_count(), fds + 2)  # the connection kept for the first loop, and the server's end
            self.assertEqual(asyncio.run(second()), [7])
            # the server's ends close once the client's have (its thread sees the end of the connection)
            wait_for(lambda: fd_count() <= fds, 5, "the sockets to close after close() (not the collector)")
            gc.collect()
        self.assertEqual([str(w.message) for w in caught if issubclass(w.category, ResourceWarning)], [])
        self.assertEqual(server.connections, 2)  # the first loop's connection was not reused by the second

    def test_over_tls_too(self):
        server = _ApiTLSServer()
        self.addCleanup(server.close)
        held = []

        def tokenize(req):  # answer, then hold the connection open as llama-server does until the client goes
            held.append(req)
            req.send(keep_alive_answer({"tokens": [7]}))
            req.wait_peer_close(10)

        server.route("POST", "/tokenize", tokenize)
        fds = fd_count()
        trusting = ssl.create_default_context(cafile=_API_TLS_CERT)
        client = lc.AsyncClient(server.address, limits=FAST, ssl_context=trusting)

        async def first():
            return await client.tokenize("x")

        async def second():
            try:
                return await client.tokenize("x")
            finally:
                await client.close()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            self.assertEqual(asyncio.run(first()), [7])
            self.assertFalse(held[0].closed_by_peer.is_set())  # kept for the first loop
            self.assertEqual(asyncio.run(second()), [7])
            wait_for(lambda: all(req.closed_by_peer.is_set() for req in held), 5, "the server to see both closed")
            wait_for(lambda: fd_count() <= fds, 5, "the sockets to close after close() (not the collector)")
            gc.collect()
        self.assertEqual([str(w.message) for w in caught if issubclass(w.category, ResourceWarning)], [])
        self.assertEqual(len(held), 2)

    def test_close_on_another_loop_closes_the_ended_loops_kept_connection(self):
        server = KeepAliveServer(lambda req: keep_alive_answer({"tokens": [7]}))
        self.addCleanup(server.close)
        fds = fd_count()
        client = lc.AsyncClient(server.address, limits=FAST)

        async def first():
            return await client.tokenize("x")

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            self.assertEqual(asyncio.run(first()), [7])
            self.assertEqual(fd_count(), fds + 2)
            asyncio.run(client.close())
            wait_for(lambda: fd_count() <= fds, 5, "the sockets to close after close() (not the collector)")
            gc.collect()
        self.assertEqual([str(w.message) for w in caught if issubclass(w.category, ResourceWarning)], [])


# -----------------------------------------------------------------------------------------------------
# What the client says: the loopclient logger, and addresses told as early as they can be
# -----------------------------------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        logging.Handler.__init__(self, logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


class _Logged:
    """A test with the ``loopclient`` logger at DEBUG, its records collected: ``self.logged(level)``."""

    def capture_log(self):
        self.log = _Records()
        logger = logging.getLogger("loopclient")
        level = logger.level
        logger.addHandler(self.log)
        logger.setLevel(logging.DEBUG)

        def restore():
            logger.removeHandler(self.log)
            logger.setLevel(level)

        self.addCleanup(restore)

    def logged(self, level=None, waits=False):
        """(level name, message) of the records at ``level``; without ``waits``, not the waits for a head (a
        loaded machine may be slower than ``poll`` to answer, and a request then says it waits)."""
        return [
            (r.levelname, r.getMessage())
            for r in self.log.records
            if (level is None or r.levelno == level) and (waits or ": waiting for the response:" not in r.getMessage())
        ]


UNAVAILABLE_503 = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 0\r\nContent-Length: 0\r\n\r\n"


class TestLogging(_Logged, ServerCase):
    """The ``loopclient`` logger: retries, waits and the error that ends a stream at INFO (the events say
    the same to the caller), connects and kept connections at DEBUG."""

    def setUp(self):
        super().setUp()
        self.capture_log()

    def test_a_retry_is_logged_at_info_with_its_reason(self):
        self.use(_f_sequence(reply(UNAVAILABLE_503), serve_body(content_stream(["ok"]))))
        completion, events = self.collect()
        self.assertEqual(completion.content, "ok")
        retry = past_the_first_waits(events)[0]  # (a 503 later than the poll: a Waiting first)
        self.assertIsInstance(retry, lc.Retrying)
        self.assertEqual(
            self.logged(logging.INFO),
            [("INFO", "%s: retry 1 in %.2f s: %s" % (self.server.address, retry.delay, retry.reason))],
        )

    def test_a_wait_for_a_busy_slot_is_logged_at_info(self):
        release = threading.Event()
        self.server.busy[0] = True

        def free():
            self.server.busy[0] = False
            release.set()

        self.use(hold_then(content_stream(["done"]), release))
        answers = SlotAnswers(self)
        events = []

        def on_event(ev):  # told busy (on an answer): the slot frees
            events.append(ev)
            if lc.Waiting(True) in answers.sort(events)[0]:
                free()

        completion = run_with_timeout(lambda: self.client.chat(MSGS, slot=0, on_event=on_event))
        self.assertEqual(completion.content, "done")
        self.assertIn(lc.Waiting(True), answers.sort(events)[0])
        self.assertIn(
            ("INFO", "%s: waiting for the response: the slot is busy" % self.server.address), self.logged(waits=True)
        )

    def test_the_error_that_ends_a_stream_is_logged_at_info(self):
        self.use(reply(http_response(b'{"error":{"code":400,"message":"bad","type":"x"}}', status=b"400 Bad Request")))
        with self.assertRaises(lc.HTTPStatusError) as caught:
            self.collect()
        self.assertEqual(
            self.logged(logging.INFO), [("INFO", "%s: HTTPStatusError: %s" % (self.server.address, caught.exception))]
        )

    def test_a_connect_is_logged_at_debug(self):
        self.use(serve_body(content_stream(["ok"])))
        self.collect()
        self.assertIn(("DEBUG", "%s: connected" % self.server.address), self.logged(logging.DEBUG))

    def test_kept_connections_are_logged_at_debug(self):
        server = KeepAliveServer(lambda req: keep_alive_answer({"tokens": [7]}))
        self.closers.append(server.close)
        client = self.new_client(server.address, limits=FAST)
        self.closers.insert(0, client.close)
        for _ in range(2):
            self.assertEqual(run_with_timeout(lambda: client.tokenize("x")), [7])
        where = server.address
        self.assertEqual(
            self.logged(logging.DEBUG),
            [
                ("DEBUG", "%s: connected" % where),
                ("DEBUG", "%s: connection kept for reuse (4 s idle at most)" % where),
                ("DEBUG", "%s: reusing a kept connection" % where),
                ("DEBUG", "%s: connection kept for reuse (4 s idle at most)" % where),
            ],
        )

    def test_nothing_is_logged_below_the_loggers_level(self):
        logging.getLogger("loopclient").setLevel(logging.WARNING)
        self.use(_f_sequence(reply(UNAVAILABLE_503), serve_body(content_stream(["ok"]))))
        _, events = self.collect()
        self.assertIsInstance(past_the_first_waits(events)[0], lc.Retrying)  # (a late 503: a Waiting first)
        self.assertEqual(self.logged(), [])


class TestLoggingAsync(AsyncDriver, TestLogging):
    pass


class TestLoggingCostsNothing(unittest.TestCase):
    """loopclient never imports logging: a program that does not log does not pay for it."""

    def test_no_logging_without_the_program_importing_it(self):
        code = (
            "import sys, loopclient as lc\n"
            "c = lc.Client('/nonexistent/s.sock', limits=lc.Limits(load_wait=0.3))\n"
            "try:\n    c.chat([{'role': 'user', 'content': 'x'}], slot=0)\n"
            "except lc.LoadTimeoutError:\n    pass\n"
            "print('logging' in sys.modules)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=30, check=True
        ).stdout
        self.assertEqual(out, "False\n")


@real_time
class TestAddressTold(_Logged, ServerCase):
    """A wrong address is told as early as it honestly can be: a path that is a file or a directory is
    ConnectError at once (it cannot become a socket while it is there), for a stream as for a single-shot
    call; a socket file that never existed is waited for, logged once as a WARNING, and the final
    LoadTimeoutError says so; host:port without a scheme is ValueError at construction."""

    limits = FAST.replace(load_wait=0.4)

    def setUp(self):
        super().setUp()
        self.capture_log()
        self.where = tempfile.mkdtemp(prefix="lc", dir="/tmp")
        self.closers.append(lambda: shutil.rmtree(self.where, True))

    def not_a_socket(self, path, what):
        client = self.new_client(path, limits=self.limits)
        self.closers.insert(0, client.close)
        events = []
        elapsed = Timer()
        with self.assertRaises(lc.ConnectError) as caught:
            run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        self.assertLess(elapsed.elapsed, lateness(self, 0.2 + MARGIN))  # at once: not retried for load_wait
        self.assertEqual(events, [])
        self.assertEqual(
            str(caught.exception), "%s is %s, not a socket: no llama-server can listen there" % (path, what)
        )
        with self.assertRaises(lc.ConnectError) as single:
            run_with_timeout(client.health)
        self.assertEqual(str(single.exception), str(caught.exception))

    def test_a_regular_file_is_connect_error_at_once(self):
        path = os.path.join(self.where, "s.sock")
        open(path, "w").close()
        self.not_a_socket(path, "a regular file")

    def test_a_directory_is_connect_error_at_once(self):
        self.not_a_socket(self.where, "a directory")

    def test_a_path_below_a_file_is_connect_error_at_once(self):
        path = os.path.join(self.where, "file")
        open(path, "w").close()
        self.not_a_socket(os.path.join(path, "s.sock"), "below a regular file")

    def test_a_socket_file_never_made_is_a_warning_and_the_error_says_it(self):
        path = os.path.join(self.where, "s.sock")
        client = self.new_client(path, limits=self.limits)
        self.closers.insert(0, client.close)
        events = []
        with self.assertRaises(lc.LoadTimeoutError) as caught:
            run_with_timeout(lambda: client.chat(MSGS, slot=0, on_event=events.append))
        self.assertGreater(len([ev for ev in events if isinstance(ev, lc.Retrying)]), 1)
        self.assertTrue(
            str(caught.exception).endswith(": the socket file %s never existed since the client was made" % path),
            caught.exception,
        )
        self.assertEqual(
            self.logged(logging.WARNING),
            [
                (
                    "WARNING",
                    "%s: no socket file there (none since the client was made): is llama-server started with "
                    "--host %s? waiting for it" % (path, path),
                )
            ],
        )  # once, at the first failed attempt

    def test_a_socket_file_that_was_there_is_no_warning(self):
        path = os.path.join(self.where, "s.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.close()  # the file stays: refused, as a server that stopped leaves it
        client = self.new_client(path, limits=self.limits)
        self.closers.insert(0, client.close)
        with self.assertRaises(lc.LoadTimeoutError) as caught:
            run_with_timeout(lambda: client.chat(MSGS, slot=0))
        self.assertNotIn("never existed", str(caught.exception))
        self.assertIsInstance(caught.exception.__cause__, ConnectionRefusedError)
        self.assertEqual(self.logged(logging.WARNING), [])

    def test_host_port_without_a_scheme_is_value_error(self):
        for text in ("localhost:8080", "127.0.0.1:8080", "[::1]:8080", "llama.example:80/"):
            with self.subTest(text), self.assertRaises(ValueError) as caught:
                self.new_client(text)
            self.assertIn("use http://%s" % text, str(caught.exception))
        self.assertEqual(self.new_client("./localhost:8080").address, "./localhost:8080")  # a file of that name


class TestAddressToldAsync(AsyncDriver, TestAddressTold):
    pass


class TestCommandLineFirstUse(CLICase):
    """What a first use of the command line meets: its options named in its errors, slots as JSON, a
    default cap on chat's answer, -v, and waits told in a few lines."""

    def test_slots_json_is_the_servers_slots(self):
        out, _ = self.main_ok("slots", "--json")
        raw = [s.raw for s in run_with_timeout(self.client.slots)]
        self.assertEqual(json.loads(out), raw)
        self.assertEqual([s["id"] for s in raw], [0, 1])

    def test_slots_json_with_watch_is_a_usage_error(self):
        self.assertEqual(
            self.main_fails("slots", "--json", "--watch", "1", code=2),
            "loopclient: error: --json shows the slots once: without --watch",
        )

    def test_usage_errors_name_the_command_lines_options(self):
        self.assertEqual(
            self.main_fails("--wait", "-1", "health", code=2),
            "loopclient: error: --wait: must not be negative, got -1.0",
        )
        self.assertEqual(
            self.main_fails("chat", "x", "--thinking-cap", "-2", code=2),
            "loopclient: error: --thinking-cap: must not be negative, got -2",
        )
        self.assertEqual(self.server.requests, [])

    def test_host_port_without_a_scheme_is_a_usage_error(self):
        code, out, err = self.run_main(["--url", "localhost:8080", "health"])
        self.assertEqual((code, out), (2, ""))
        self.assertEqual(
            err,
            "loopclient: error: 'localhost:8080' is host:port without a scheme: use http://localhost:8080 "
            "(a socket file of that name: ./localhost:8080)\n",
        )

    def test_chat_caps_the_answer_unless_told(self):
        self.use(serve_body(content_stream(["ok"])))
        for argv, cap in (
            ((), {"max_tokens": lc.CHAT_MAX_TOKENS}),
            (("--max-tokens", "5"), {"max_tokens": 5}),
            (("--param", "n_predict=7"), {"n_predict": 7}),
            (("--param", "max_completion_tokens=9"), {"max_completion_tokens": 9}),
        ):
            with self.subTest(argv):
                self.server.requests.clear()
                self.main_ok("chat", "x", *argv)
                body = self.server.chat_requests()[0].json()
                caps = {k: body[k] for k in ("max_tokens", "n_predict", "max_completion_tokens") if k in body}
                self.assertEqual(caps, cap)
        self.assertEqual(lc.CHAT_MAX_TOKENS, 2048)
        self.assertIn("default 2048", lc._parser()._subparsers._group_actions[0].choices["chat"].format_help())

    def test_verbose_logs_retries_on_stderr(self):
        self.use(_f_sequence(reply(UNAVAILABLE_503), serve_body(content_stream(["ok"]))))
        for flag, debug in (("-v", False), ("-vv", True)):
            with self.subTest(flag):
                # (load_wait 5 s, not the tests' 0.3 s: the retry's connect and answer take longer than the
                # 0.3 s left after its backoff on a loaded machine)
                out, err = self.main_ok(flag, "--wait", "5", "chat", "x", "--slot", "0")
                self.assertEqual(out, "ok\n")
                self.assertIn("loopclient: INFO: %s: retry 1 in " % self.server.path, err)
                self.assertEqual("loopclient: DEBUG: %s: connected" % self.server.path in err, debug)
                self.use(_f_sequence(reply(UNAVAILABLE_503), serve_body(content_stream(["ok"]))))
        logger = logging.getLogger("loopclient")  # main() leaves the logger as it found it
        self.assertEqual((logger.level, logger.propagate), (logging.NOTSET, True))
        self.assertFalse([h for h in logger.handlers if not isinstance(h, (logging.NullHandler, _Records))])

    def test_a_socket_file_never_made_is_named_in_the_status_line(self):
        path = os.path.join(self.server.tmp, "never.sock")
        line = self.main_fails("chat", "x", address=path)
        code, _, err = self.run_main(["--socket", path, "chat", "x"])
        self.assertIn("no socket file %s yet: is llama-server started with --host %s? (retry 1, " % (path, path), err)
        self.assertIn("never existed since the client was made", line)


class TestConsoleWaits(unittest.TestCase):
    """Off a terminal a wait is a line when it changes, else at most one each quarter of its budget (not
    one per retry); on a terminal it is one line, redrawn in place."""

    def retries(self, err, reasons, every=2.0):
        client = lc.Client("http://127.0.0.1:9", limits=lc.Limits(load_wait=120.0))
        self.addCleanup(client.close)
        now = [1000.0]
        with mock.patch.object(lc.time, "monotonic", lambda: now[0]):
            console = lc._Console(io.StringIO(), err, client)
            for n, reason in enumerate(reasons):
                console.event(lc.Retrying(n + 1, 1.5, reason))
                now[0] += every
        return err.getvalue()

    def test_off_a_terminal_60_retries_over_load_wait_are_four_lines(self):
        text = self.retries(io.StringIO(), ["cannot connect: Connection refused"] * 60)  # one each 2 s for 120 s
        self.assertEqual(
            [line.split(":")[0] for line in text.splitlines()],
            ["retry 1 in 1.5 s", "retry 16 in 1.5 s", "retry 31 in 1.5 s", "retry 46 in 1.5 s"],
        )

    def test_off_a_terminal_a_new_reason_is_told_at_once(self):
        text = self.retries(io.StringIO(), ["cannot connect: Connection refused"] * 3 + ["HTTP 503: Loading model"])
        self.assertEqual(
            text, "retry 1 in 1.5 s: cannot connect: Connection refused\nretry 4 in 1.5 s: HTTP 503: Loading model\n"
        )

    def test_on_a_terminal_one_line_redrawn(self):
        text = self.retries(TtyText(), ["cannot connect: Connection refused"] * 60)
        self.assertNotIn("\n", text)
        self.assertEqual(text.count("\r\x1b[K"), 60)
        self.assertTrue(text.endswith("\r\x1b[Kretry 60 in 1.5 s: cannot connect: Connection refused"))


class TestCommandLineTerminalStdin(TestCommandLineTerminal):
    """``tokens`` and ``complete`` without TEXT on a terminal say that they read it from there (and how to
    end it) rather than wait in silence."""

    def test_tokens_says_it_reads_the_terminal(self):
        self.server.route("POST", "/tokenize", lambda req: respond_json(req, {"tokens": [1, 2, 3]}))
        self.spawn("tokens")
        self.read_until(b"loopclient: reading the text from the terminal: end it with Ctrl-D (Ctrl-C to quit)")
        os.write(self.master, b"one two\n\x04")
        self.assertEqual(self.read_to_exit(), 0, bytes(self.seen))
        self.assertIn(b"\r\n3\r\n", bytes(self.seen))
        tokenized = [r for r in self.server.requests if r.path == "/tokenize"]
        self.assertEqual(tokenized[0].json()["content"], "one two\n")

    def test_complete_says_it_reads_the_terminal(self):
        self.server.route("POST", "/completion", serve_body(b""))  # never reached: Ctrl-C first
        self.spawn("complete")
        self.read_until(b"loopclient: reading the prompt from the terminal: end it with Ctrl-D (Ctrl-C to quit)")
        os.write(self.master, b"\x03")
        self.assertEqual(self.read_to_exit(), 130, bytes(self.seen))
        self.assertEqual(self.server.requests, [])


for _name in dir(TestCommandLineTerminal):  # the base class runs its own tests
    if _name.startswith("test_"):
        setattr(TestCommandLineTerminalStdin, _name, None)


#: The socket the README's examples use, as it tells the user to start it (dev/llama-server.sh demo).
README_DEMO_SOCKET = "/tmp/loopclient-llama/demo.sock"


def readme_python_blocks():
    """The README's ```python blocks: (line number, code)."""
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return [
        (text.count("\n", 0, found.start()) + 2, found.group(1))
        for found in re.finditer(r"^```python\n(.*?)^```$", text, re.M | re.S)
    ]


@unittest.skipUnless(REAL_DEMO, "no demo server: set LOOPCLIENT_REAL_DEMO to dev/llama-server.sh demo's socket")
class TestRealReadmeExamples(unittest.TestCase):
    """Every ```python block of the README runs as written against the demo server: the one change is the
    demo socket's path, the test's own server for the one the README tells the user to start."""

    def test_the_readme_has_examples(self):
        self.assertGreaterEqual(len(readme_python_blocks()), 5)

    def test_every_python_block_runs(self):
        for line, code in readme_python_blocks():
            with self.subTest(line=line):
                others = set(re.findall(r"[\"'](/[^\"']*\.sock)[\"']", code)) - {README_DEMO_SOCKET}
                self.assertEqual(others, set(), "an example at line %d uses another socket than the demo's" % line)
                done = subprocess.run(
                    [sys.executable, "-c", code.replace(README_DEMO_SOCKET, REAL_DEMO)],
                    cwd=HERE,
                    env=dict(os.environ, PYTHONPATH=HERE),
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                self.assertEqual(done.returncode, 0, "README line %d:\n%s%s" % (line, done.stdout, done.stderr))
                self.assertTrue(done.stdout.strip(), "README line %d printed nothing" % line)


class TestFrontConfigurations(unittest.TestCase):
    """The configurations in dev/fronts are the README's, and fill in to a working file."""

    def test_the_readme_shows_each_configuration_as_it_is(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        section = readme[readme.index("\n## Behind nginx, HAProxy and Caddy\n") :]
        section = section[: section.index("\n## ", 1)]
        for kind, lang in (("nginx", "nginx"), ("haproxy", "haproxy"), ("caddy", "caddyfile")):
            with open(os.path.join(FRONTS_DIR, FRONT_KINDS[kind]["file"]), encoding="utf-8") as f:
                text = f.read()
            self.assertIn("```%s\n%s```\n" % (lang, text), section, "the README's %s differs from dev/fronts" % kind)

    def test_every_placeholder_is_filled(self):
        for kind in FRONT_KINDS:
            for balance in ("pin", "least", "rr"):
                text = render_front(kind, ["/tmp/a.sock", "/tmp/b.sock"], balance, 7, "/tmp/x", 1234, 1235)
                code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
                self.assertFalse([line for line in code if re.search(r"@[A-Z_]+@", line)], kind)
                self.assertTrue(any("1234" in line for line in code), kind)
                self.assertEqual(
                    sum("/tmp/a.sock" in line or "/tmp/b.sock" in line for line in code), 1 if kind == "caddy" else 2
                )
                self.assertTrue(any(re.search(r"\b7s\b", line) for line in code), kind)


#: The second test server, for the cases with several servers behind one front (.ci/run starts it).
REAL_SOCKET2 = os.environ.get("LOOPCLIENT_REAL_SOCKET2")


SKIP_SECOND = (
    "no second llama-server: run dev/llama-server.sh start SOCKET2 and set LOOPCLIENT_REAL_SOCKET2 (.ci/run does)"
)


def _require(test, ok, why):
    """Skip the test when ``ok`` is false, or fail it under LOOPCLIENT_REQUIRE_REAL=1 (CI)."""
    if ok:
        return
    if os.environ.get("LOOPCLIENT_REQUIRE_REAL"):
        raise AssertionError("LOOPCLIENT_REQUIRE_REAL is set, but: " + why)
    raise unittest.SkipTest(why)


def _front_binaries():
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in FRONT_KINDS if shutil.which(name, path=path) is None]


class Holder:
    """A real long generation holding ``slot`` of the server at ``address`` (a client of its own, the
    output thrown away) until ``release()``: requests for that slot wait, and get no byte, meanwhile."""

    def __init__(self, address, slot):
        self.client = lc.Client(address, limits=REAL_LIMITS)
        self.stream = self.client.stream(
            [{"role": "user", "content": "Write a very long story about the sea."}],
            slot=slot,
            max_tokens=900,
            ignore_eos=True,
            temperature=0,
        )
        self.tokens, self.error, self.finished = 0, None, False
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, name="lc-test-holder", daemon=True)
        self.thread.start()
        if not self.started.wait(30):
            self.release()
            raise AssertionError("the holder's generation did not start within 30 s")

    def _run(self):
        try:
            for event in self.stream:
                if isinstance(event, lc.Content):
                    self.tokens += 1
                    self.started.set()
            self.finished = True
        except lc.CancelledError:
            pass
        except lc.LoopError as exc:
            self.error = exc
        finally:
            self.started.set()

    def release(self):
        """End the generation (the slot frees within ~50 ms); True when it was still running."""
        running = self.thread.is_alive() and self.error is None and not self.finished
        self.stream.cancel()
        self.thread.join(10)
        self.client.close()
        return running


def _prompt_work(client):
    """The prompt tokens the server has taken in so far (processed and cached), from /metrics."""
    found = dict(re.findall(r"^llamacpp:(prompt_tokens(?:_cached)?_total) (\d+)", client.metrics(), re.M))
    return sum(int(v) for v in found.values())


#: What a front's own answers look like in the messages: nginx and Caddy name themselves.
_REAL_FRONT_NAMES = {"nginx": "nginx/1.22.1", "haproxy": "the front", "caddy": "Caddy"}


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealFronts(ClientFactory, unittest.TestCase):
    """loopclient behind real nginx, HAProxy and Caddy (Debian's packages), each run by the test from its
    dev/fronts configuration with a 2 s idle timeout toward the server, in front of the real test server
    (and the second one, LOOPCLIENT_REAL_SOCKET2, for the cases with two): a request queued behind a slot
    busy three times that long finishes; over two servers a burst finishes; a resumable stream cut between
    a front and its server resumes through the front, pinned by its conversation id; a front whose server
    is gone is a LoadTimeoutError after load_wait; TLS at nginx; kept connections."""

    TIMEOUT = 2  # the fronts' idle timeout, in seconds (nginx takes whole seconds)
    HOLD = 3 * TIMEOUT
    #: the idle timeout where no queue wait is under test: on two busy cores a token can take longer than
    #: 2 s to come, and then the front cuts the stream itself (a resumable one is resumed, again and again)
    LONG = 10
    limits = REAL_LIMITS.replace(poll=0.2, busy_wait=30.0, load_wait=10.0)

    @classmethod
    def setUpClass(cls):
        missing = _front_binaries()
        if missing:
            _require(cls, False, "not installed: %s (apt-get install -y nginx haproxy caddy)" % ", ".join(missing))
        cls.fronts = {}
        try:
            for kind in FRONT_KINDS:
                cls.fronts[kind] = Front(kind, [REAL_SOCKET], "pin", cls.TIMEOUT)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for front in cls.fronts.values():
            front.close()
        cls.fronts = {}

    def setUp(self):
        self.direct = lc.Client(REAL_SOCKET, limits=REAL_LIMITS)
        self.addCleanup(self.direct.close)
        _idle(self.direct)

    def front(self, kind, servers, balance="pin", timeout=None):
        front = Front(kind, servers, balance, timeout or self.TIMEOUT)
        self.addCleanup(front.close)
        return front

    def client_for(self, address, ssl_context=None, **changes):
        kw = {} if ssl_context is None else {"ssl_context": ssl_context}
        client = self.new_client(address, limits=self.limits.replace(**changes), **kw)
        self.addCleanup(client.close)
        return client

    def hold(self, address, slot):
        holder = Holder(address, slot)
        self.addCleanup(holder.release)
        return holder

    def chat(self, client, messages, timeout=90, **params):
        events = []
        completion = run_with_timeout(lambda: client.chat(messages, on_event=events.append, **params), timeout)
        return completion, events

    def release_after(self, holders, seconds):
        """Release ``holders`` ``seconds`` from now (the hold is the scripted duration of the test); the
        returned list gets, per holder, whether it was still generating then."""
        running = []

        def release():
            running.extend(holder.release() for holder in holders)

        timer = threading.Timer(seconds, release)
        timer.start()
        self.addCleanup(timer.join, 30)
        self.addCleanup(timer.cancel)
        return running

    # -- a request queued behind a busy slot for longer than the front's idle timeout ------------------

    def chats(self, clients, messages, timeout=90, **params):
        """One chat per front at once (``clients``: kind -> client; ``messages``: kind -> its one message):
        kind -> (Completion or exception, events)."""
        events, results = {}, {}
        threads = {
            kind: start_chat(c, messages[kind], events=events, results=results, **params) for kind, c in clients.items()
        }
        for thread in threads.values():
            thread.join(timeout)
        self.assertFalse(
            [k for k, thread in threads.items() if thread.is_alive()], "chats still running after %d s" % timeout
        )
        return {kind: (results[messages[kind]], events[messages[kind]]) for kind in clients}

    def test_a_chat_queued_past_the_front_s_idle_timeout_finishes(self):
        # one chat through each front at once, all for the slot the holder keeps busy for 3x the timeout
        clients = {kind: self.client_for(front.url) for kind, front in self.fronts.items()}
        holder = self.hold(REAL_SOCKET, 0)
        running = self.release_after([holder], self.HOLD)
        messages = {kind: "Name a colour (%s, %s)." % (kind, self.CLIENT) for kind in clients}
        outcomes = self.chats(clients, messages, slot=0, max_tokens=4, temperature=0)
        self.assertEqual(running, [True], "the holder ended before the hold did")
        for kind, (completion, events) in outcomes.items():
            with self.subTest(kind):
                self.assertIsInstance(
                    completion, lc.Completion, "events: %r" % [e for e in events if not isinstance(e, lc.Waiting)][:12]
                )
                self.assertTrue(completion.content and completion.finish_reason, completion)
                reasons = [e.reason for e in events if isinstance(e, lc.Retrying)]
                reason = "HTTP 504 from %s: the front stopped waiting for a slot" % _REAL_FRONT_NAMES[kind]
                self.assertGreaterEqual(len(reasons), self.HOLD // self.TIMEOUT - 1, reasons)  # cut every 2 s
                self.assertEqual(set(reasons), {reason})
                self.assertFalse([e for e in events if isinstance(e, lc.Resumed)])

    def test_a_resumable_chat_queued_past_the_front_s_idle_timeout_is_resumed_not_sent_again(self):
        clients = {kind: self.client_for(front.url) for kind, front in self.fronts.items()}
        filler = " ".join("word%d" % i for i in range(120))
        holder = self.hold(REAL_SOCKET, 0)
        before = _prompt_work(self.direct)
        running = self.release_after([holder], self.HOLD)
        messages = {
            kind: "Note %s-%s-%d-%d: %s. Name a colour." % (kind, self.CLIENT, os.getpid(), time.monotonic_ns(), filler)
            for kind in clients
        }
        outcomes = self.chats(clients, messages, slot=0, max_tokens=4, temperature=0, resumable=True)
        self.assertEqual(running, [True], "the holder ended before the hold did")
        prompts = []
        for kind, (completion, events) in outcomes.items():
            with self.subTest(kind):
                self.assertIsInstance(
                    completion, lc.Completion, "events: %r" % [e for e in events if not isinstance(e, lc.Waiting)][:12]
                )
                self.assertTrue(completion.content and completion.finish_reason, completion)
                resumed = [e for e in events if isinstance(e, lc.Resumed)]
                self.assertTrue(resumed, "no Resumed: %r" % events[:5])
                self.assertEqual(resumed[0], lc.Resumed(0, 1))
                prompts.append(completion.usage["prompt_tokens"])
        work = _prompt_work(self.direct) - before
        # each prompt once: about their own tokens; one sent again would be taken in twice (processed or cached)
        self.assertLess(work, sum(prompts) + min(prompts) // 2, "prompts of %r tokens, %d taken in" % (prompts, work))
        self.assertGreaterEqual(work, sum(prompts) - 8 * len(prompts))

    # -- two servers behind one front ------------------------------------------------------------------

    def own_server(self, slots):
        """A server of the test's own with ``slots`` slots, at the lowest CPU priority (a generation that
        only holds its slot must not starve the server under test on a 2-core machine); its socket."""
        tmp = tempfile.mkdtemp(prefix="lcown", dir="/tmp")
        sock = os.path.join(tmp, "own.sock")
        command = real_server_command(sock)
        command[command.index("-np") + 1] = str(slots)
        log = open(os.path.join(tmp, "server.log"), "wb")
        proc = subprocess.Popen(["nice", "-n", "19"] + command, stdout=log, stderr=subprocess.STDOUT)

        def stop():
            proc.kill()
            proc.wait(10)
            log.close()
            shutil.rmtree(tmp, ignore_errors=True)

        self.addCleanup(stop)
        probe = lc.Client(sock)
        self.addCleanup(probe.close)
        wait_for(lambda: _healthy(probe), 60, "our own server to load")
        return sock

    def test_a_burst_over_two_servers_one_of_them_held_all_finishes(self):
        _require(self, REAL_SOCKET2, SKIP_SECOND)
        other = lc.Client(REAL_SOCKET2, limits=REAL_LIMITS)
        self.addCleanup(other.close)
        _idle(other)
        held = self.own_server(1)  # one slot: one generation holds the whole server
        # a longer idle timeout here: the chats share the other server's two slots and two cores with the
        # holder, and a token can take longer than 2 s to come (the front then cuts the stream itself; seen
        # at twice the timeout, 4 s, on a loaded machine)
        timeout = 3 * self.TIMEOUT
        policies = [(kind, b) for kind in FRONT_KINDS for b in ("rr", "least")]
        fronts = {p: self.front(p[0], [held, REAL_SOCKET2], p[1], timeout) for p in policies}
        clients = {p: self.client_for(f.url, servers=2, busy_wait=60.0) for p, f in fronts.items()}
        holder = self.hold(held, 0)
        running = self.release_after([holder], 2 * timeout)
        events, results = {}, {}
        markers = {p: ["Name a colour, %s %s %d." % (p[0], p[1], i) for i in range(3)] for p in policies}
        threads = [
            start_chat(clients[p], m, None, events, results, max_tokens=4, temperature=0)
            for p in policies
            for m in markers[p]
        ]
        for thread in threads:
            thread.join(120)
        self.assertFalse(any(thread.is_alive() for thread in threads), "a chat did not end within 120 s")
        # the holder held its server until the hold ended, or until every chat had finished
        self.assertTrue(running == [True] or (not running and holder.thread.is_alive()), running)
        for p in policies:
            with self.subTest("%s %s" % p):
                failed = {m: results[m] for m in markers[p] if not isinstance(results[m], lc.Completion)}
                told = {m: [e for e in events[m] if not isinstance(e, lc.Waiting)][:8] for m in failed}
                self.assertEqual(failed, {}, "events: %r" % told)
                for m in markers[p]:
                    self.assertTrue(results[m].content and results[m].finish_reason, results[m])
                # no slot called wedged (a poll that failed, a front's 504 to a /slots the held server was
                # slow to answer, is a Waiting of an unavailable server, not of a wedged one)
                self.assertFalse([e for m in markers[p] for e in events[m] if isinstance(e, lc.Waiting) and e.wedged])

    def test_a_resumable_stream_cut_behind_the_front_resumes_pinned_to_its_server(self):
        _require(self, REAL_SOCKET2, SKIP_SECOND)
        for kind in FRONT_KINDS:
            with self.subTest(kind):
                proxy = CutProxy(REAL_SOCKET, 1500)
                self.addCleanup(proxy.close)
                servers = [proxy.path, REAL_SOCKET2]
                conversation = self._pinned_to_the_proxy(kind, servers, proxy)
                front = self.front(kind, servers, timeout=self.LONG)  # afresh: no connection kept from the probes
                client = self.client_for(front.url, servers=2)
                stream = client.stream(STORY, slot=0, resumable=conversation, max_tokens=60, temperature=0, seed=1)
                events = run_with_timeout(lambda: list(stream), 90)
                self.assertEqual(proxy.cuts, 1)
                resumed = [e for e in events if isinstance(e, lc.Resumed)]
                self.assertEqual(len(resumed), 1, resumed)
                self.assertGreater(resumed[0].offset, 0)
                completion = stream.completion
                self.assertEqual(completion.usage["completion_tokens"], 60)
                self.assertEqual("".join(e.text for e in events if isinstance(e, lc.Content)), completion.content)
                # the server that ran it knows it (done a few ms after the last byte reached us)
                with lc.Client(REAL_SOCKET, limits=REAL_LIMITS) as first:
                    found = _marked_done(first, conversation)
                self.assertEqual([(e["conversation_id"], e["is_done"]) for e in found], [(conversation, True)])
                self.direct.delete_stream(conversation)

    def _pinned_to_the_proxy(self, kind, servers, proxy):
        """A conversation id that ``kind``, pinning by X-Conversation-Id over ``servers``, sends through
        ``proxy`` (asked with GET /health on a front of its own, closed again)."""
        probe = Front(kind, servers, "pin", self.LONG)
        try:
            for n in range(40):
                conversation = "lc-front-%s-%s-%d-%d" % (kind, self.CLIENT, os.getpid(), n)
                before = proxy.connections
                with lc.Client(
                    probe.url, headers={"X-Conversation-Id": conversation}, limits=lc.Limits(keep_alive=0)
                ) as c:
                    self.assertEqual(c.health(), {"status": "ok"})
                if proxy.connections > before:
                    return conversation
        finally:
            probe.close()
        self.fail("%s sent none of 40 conversation ids to the first server" % kind)

    # -- the front's server gone --------------------------------------------------------------------

    @real_time
    def test_a_front_whose_server_is_gone(self):
        gone = tempfile.mkdtemp(prefix="lcgone", dir="/tmp")
        self.addCleanup(shutil.rmtree, gone, True)
        for kind in FRONT_KINDS:
            with self.subTest(kind):
                front = self.front(kind, [os.path.join(gone, "llama.sock")])
                client = self.client_for(front.url, load_wait=1.0)
                t = Timer()
                with self.assertRaises(lc.LoadTimeoutError) as caught:
                    self.chat(client, MSGS, 30, max_tokens=4)
                err = caught.exception
                self.assertGreaterEqual(t.elapsed, 1.0 - EARLY)
                self.assertLess(t.elapsed, 1.0 + lateness(self, MARGIN + 0.5))
                self.assertNotIn("\n", str(err))
                self.assertIn("load_wait", str(err))
                status = 503 if kind == "haproxy" else 502  # HAProxy: no server to send to
                if status == 502:
                    self.assertIn("HTTP 502", str(err))
                    self.assertIn(_REAL_FRONT_NAMES[kind], str(err))
                self.assertIsInstance(err.__cause__, lc.HTTPStatusError)
                self.assertEqual(err.__cause__.status, status)
                # a single-shot call: one readable line, the page kept
                with self.assertRaises(lc.HTTPStatusError) as caught:
                    run_with_timeout(client.props, 10)
                err = caught.exception
                line = {
                    "nginx": "HTTP 502 from nginx/1.22.1: 502 Bad Gateway",
                    "haproxy": "HTTP 503: 503 Service Unavailable",
                    "caddy": "HTTP 502 from Caddy: (empty body)",
                }[kind]
                self.assertEqual(str(err), line)
                self.assertEqual(
                    err.body, front_page({"nginx": "nginx 502", "haproxy": "haproxy 503", "caddy": "caddy 502"}[kind])
                )

    # -- TLS at nginx, kept connections ------------------------------------------------------------------

    @real_time
    def test_tls_at_nginx_with_a_private_ca(self):
        url = self.front("nginx", [REAL_SOCKET], timeout=self.LONG).tls_url
        trusted = self.client_for(url, ssl_context=ssl.create_default_context(cafile=_API_TLS_CERT))
        self.assertEqual(run_with_timeout(trusted.health, 10), {"status": "ok"})
        completion, _ = self.chat(trusted, SEA, 60, slot=0, max_tokens=8, temperature=0)
        self.assertTrue(completion.content and completion.finish_reason)
        untrusted = self.client_for(url)  # the default context does not trust the private CA
        for call in (untrusted.health, lambda: untrusted.chat(MSGS, max_tokens=4)):
            t = Timer()
            with self.assertRaises(lc.ConnectError) as caught:
                run_with_timeout(call, 10)
            self.assertLess(t.elapsed, lateness(self, MARGIN + 0.5))  # at once: no load_wait for a certificate
            self.assertNotIn("\n", str(caught.exception))

    def test_two_hundred_single_shot_calls_over_kept_connections(self):
        for kind, front in self.fronts.items():
            with self.subTest(kind):
                client = self.client_for(front.url)
                before = _tcp_connections(front.port)
                for _ in range(200):
                    self.assertEqual(client.health(), {"status": "ok"})
                opened = _tcp_connections(front.port) - before
                self.assertLessEqual(len(opened), 4, "%d connections for 200 calls" % len(opened))


def _tcp_connections(port):
    """The loopback TCP connections to ``port`` (ESTABLISHED or TIME_WAIT), each as the set of its two ends:
    a call that opened a connection of its own leaves one behind in TIME_WAIT."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, remote, state = row.split()[1:4]
            ports = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
            if port in ports and state in ("01", "06"):
                found.add(frozenset((local, remote)))  # both ends of a loopback connection count once
    return found


class TestRealFrontsAsync(AsyncDriver, TestRealFronts):
    pass


# -----------------------------------------------------------------------------------------------------
# A resumable request on a slow server behind a front
# -----------------------------------------------------------------------------------------------------

#: What llama-server's GET /v1/stream sends when the stream it replays is dropped before any byte of it:
#: the head, then the end of an empty body (the session was finalized as it was evicted).
_SLOW_EMPTY_REPLAY = (
    b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: close\r\n\r\n0\r\n\r\n"
)


class _DroppingBuffer(_FrontBuffer):
    """``_FrontBuffer`` on a loaded server: the request queued behind a busy slot, whose connection the front
    closed (its 504), is dropped by the server before it starts (this build cancels it once a second passes
    without a token from any slot): the first ``drops`` GETs find the session going (the head, then an empty
    body) and forget it; the next POST is kept and served."""

    def __init__(self, server, raw, drops=1, **kw):
        self.drops = drops
        _FrontBuffer.__init__(self, server, raw, **kw)

    def get(self, req):
        conv, start = self._query(req)
        with self.lock:
            dropping = self.drops > 0 and conv in self.ids
            if dropping:
                self.drops -= 1
                self.ids.discard(conv)
                self.log.append(("GET", conv, int(start)))
        if not dropping:
            return _FrontBuffer.get(self, req)
        req.send(_SLOW_EMPTY_REPLAY)


class TestSlowServerBehindAFront(_f_Case):
    """A resumable request queued behind a busy slot past a front's idle timeout, on a server too slow to
    keep it: a server that dropped it before it started (nothing of it came) gets it again; a lookup the front
    answered itself (504: the server was slow to answer it) is no "unknown", so the request is not sent twice;
    a stream of which bytes came is never sent again."""

    #: no wait is under test but busy_wait: a late head on a loaded machine must not become an error
    limits = FAST_FAULTS.replace(poll=1.0, liveness=2.0, idle_grace=5.0, busy_wait=20.0)

    def _whole(self, buf):
        whole, whole_events = self.collect(resumable="conv-1")
        buf.reset()
        self.server.requests.clear()
        return whole, whole_events

    def test_a_queued_request_the_server_dropped_is_sent_again(self):
        buf = _DroppingBuffer(self.server, load_transcript("04_chat_stream.raw.txt"), drops=0)
        whole, whole_events = self._whole(buf)
        buf.posts, buf.drops = [front_answer("nginx 504")], 1
        completion, events = self.collect(resumable="conv-1")
        # the 504: looked up, known, its buffer read from 0; the server dropped it meanwhile (an empty replay),
        # the buffer asked again (404): nothing of it came, so it is sent again, and served
        self.assertEqual(buf.methods(), ["POST", "LOOKUP", "GET", "GET", "POST"])
        self.assertEqual(buf.replays(), [0, 0])
        told = [e for e in events if isinstance(e, (lc.Resumed, lc.Retrying))]
        self.assertEqual([type(e).__name__ for e in told], ["Resumed", "Retrying", "Resumed", "Retrying"])
        self.assertEqual((told[0], told[2]), (lc.Resumed(0, 1), lc.Resumed(0, 2)))
        self.assertEqual((told[1].attempt, told[3].attempt), (1, 1))  # a reattach's backoff, then the attempts'
        self.assertIn("while it waited for a slot", told[1].reason)
        self.assertEqual(told[3].reason, lc._DROPPED)
        self.assertEqual([e for e in events if not isinstance(e, (lc.Resumed, lc.Retrying))], whole_events)
        self.assertEqual(completion, whole)
        self.assertEqual({c for _, _, c in buf.carried()}, {"conv-1"})

    def test_one_dropped_again_and_again_waits_under_busy_wait(self):
        buf = _DroppingBuffer(self.server, load_transcript("04_chat_stream.raw.txt"), drops=100)
        self.client_with(busy_wait=6.0)
        buf.posts = [front_answer("haproxy 504")] * 100
        err = self._f_fails(lc.WaitTimeoutError, 6.0, resumable="conv-1")
        self.assertIn("busy_wait", str(err))
        posts = buf.methods().count("POST")
        self.assertGreater(posts, 2)  # sent again each time it was dropped, never given up as unknown
        self.assertEqual(buf.methods()[-1], "DELETE")  # the early end deletes it, as every early end does

    def test_a_lookup_the_front_answers_itself_is_no_unknown(self):
        buf = _FrontBuffer(self.server, load_transcript("04_chat_stream.raw.txt"))
        whole, whole_events = self._whole(buf)
        buf.posts, buf.lookups = [front_answer("nginx 504")], [front_answer("nginx 504")]
        completion, events = self.collect(resumable="conv-1")
        # the lookup got no answer from the server: its buffer is asked (after a backoff), and it is there
        self.assertEqual(buf.methods(), ["POST", "LOOKUP", "GET"])  # not sent twice: it kept its place
        self.assertEqual(buf.replays(), [0])
        reason = "HTTP 504 from nginx/1.22.1: the front stopped waiting for a slot"
        self.assertEqual([(type(e), e.attempt, e.reason) for e in events[:1]], [(lc.Retrying, 1, reason)])
        self.assertEqual(events[1:], [lc.Resumed(0, 1)] + whole_events)
        self.assertEqual(completion, whole)

    def test_a_connection_lost_before_the_head_and_a_failed_lookup_is_no_unknown(self):
        buf = _FrontBuffer(self.server, load_transcript("04_chat_stream.raw.txt"))
        whole, whole_events = self._whole(buf)
        buf.reset([0])  # the POST's connection closed before any byte; the server keeps it (87)
        buf.lookups = [front_answer("nginx 502")]
        completion, events = self.collect(resumable="conv-1")
        self.assertEqual(buf.methods(), ["POST", "LOOKUP", "GET"])
        self.assertEqual(events, [lc.Resumed(0, 1)] + whole_events)
        self.assertEqual(completion, whole)

    def test_a_stream_of_which_bytes_came_is_never_sent_again(self):
        raw = load_transcript("04_chat_stream.raw.txt")
        buf = _DroppingBuffer(self.server, raw, drops=0, cuts=[len(STREAM_HEAD) + 900])
        buf.gets = [_FR_GONE_404]
        err = self._f_fails(lc.StreamClosedError, resumable="conv-1")
        self.assertIn("no longer knows it", str(err))
        self.assertEqual(buf.methods(), ["POST", "GET", "DELETE"])


TestSlowServerBehindAFrontSockets, TestSlowServerBehindAFrontSocketsAsync = on_sockets(
    TestSlowServerBehindAFront,
    "test_a_queued_request_the_server_dropped_is_sent_again",
    "test_a_lookup_the_front_answers_itself_is_no_unknown",
)


# -----------------------------------------------------------------------------------------------------
# Fronts on a loaded machine: resumable chats queued past the idle timeout, then cut mid-answer
# -----------------------------------------------------------------------------------------------------


class MidAnswerCut(_UnixServer):
    """A threaded Unix-socket proxy to a llama-server, between a front and it: the first streamed answer
    (``text/event-stream``: a POST's, or a ``GET /v1/stream`` replay's) of each conversation (its
    ``X-Conversation-Id``) is cut once ``cut`` bytes of it have passed its head: both ends are shut down
    mid-answer, as a front's idle timeout does to a server slower than it between two tokens.  Each
    connection carries one request (the proxy asks the server to close after it: ``Connection: close``);
    a request's end of file is passed on, so the server sees its client go.  ``cut_conversations``: the ids
    whose answer was cut, in order."""

    def __init__(self, upstream, cut):
        self.upstream, self.cut = upstream, cut
        self.cut_conversations = []
        _UnixServer.__init__(self, "lcm", "proxy.sock")

    def _serve(self, conn, number):
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if not self._track(up):
            self._untrack(conn)
            return
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                more = conn.recv(65536)
                if not more:
                    return
                head += more
            head, _, rest = head.partition(b"\r\n\r\n")
            found = re.search(rb"(?im)^x-conversation-id:[ \t]*(\S+)", head)
            conversation = found.group(1).decode() if found else None
            lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
            up.connect(self.upstream)
            up.sendall(b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n" + rest)
            self._start(self._request_rest, conn, up)
            self._answer(conn, up, conversation)
        except OSError:
            pass
        finally:
            for sock in (conn, up):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._untrack(sock)

    @staticmethod
    def _request_rest(conn, up):
        """The rest of the request, then its end of file."""
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    up.shutdown(socket.SHUT_WR)
                    return
                up.sendall(data)
        except OSError:
            pass

    def _answer(self, conn, up, conversation):
        head = b""
        while b"\r\n\r\n" not in head:
            more = up.recv(65536)
            if not more:
                conn.sendall(head)
                return
            head += more
        head, _, body = head.partition(b"\r\n\r\n")
        with self.lock:
            cutting = (
                conversation is not None
                and conversation not in self.cut_conversations
                and head.startswith(b"HTTP/1.1 200")
                and b"text/event-stream" in head
            )
        conn.sendall(head + b"\r\n\r\n")
        passed = 0
        while True:
            if cutting and passed + len(body) >= self.cut:
                conn.sendall(body[: self.cut - passed])
                with self.lock:
                    self.cut_conversations.append(conversation)
                return
            conn.sendall(body)
            passed += len(body)
            body = up.recv(65536)
            if not body:
                return


def start_own_server(slots, log_dir=None):
    """A llama-server of the caller's own (the provisioned binary and model, ``dev/llama-server.sh args``)
    with ``slots`` slots on a Unix socket in a directory of its own, once it answers /health: (socket,
    stop), ``stop()`` killing it and removing the directory."""
    tmp = tempfile.mkdtemp(prefix="lcown", dir="/tmp")
    sock = os.path.join(tmp, "own.sock")
    command = real_server_command(sock)
    command[command.index("-np") + 1] = str(slots)
    log = open(os.path.join(log_dir or tmp, "server.log"), "ab")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def stop():
        proc.kill()
        proc.wait(10)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)

    try:
        with lc.Client(sock) as probe:
            wait_for(lambda: proc.poll() is None and _healthy(probe), 60, "our own server to load")
    except BaseException:
        stop()
        raise
    return sock, stop


#: The chats of the loaded fronts' tests: one per front, each its own prompt (so that the quiet run and
#: the loaded one read the same prompt), at temperature 0 with a seed, the prompt processed afresh each time
#: (``cache_prompt`` off: a cached prefix is computed in other batches, which may change a close choice).
LOADED_PROMPTS = {
    "nginx": "Write a short story about a lighthouse keeper and the sea.",
    "haproxy": "Write a short story about a fisherman and a storm.",
}
LOADED_PARAMS = {"max_tokens": 16, "temperature": 0, "seed": 1, "cache_prompt": False}


def loaded_chat(client, kind, events, **params):
    """One loaded fronts' chat (for AsyncDriver's facade, waited for up to 600 s, not its 60): its
    Completion, or the error it ended in; its events go to ``events``."""
    messages, params = [{"role": "user", "content": LOADED_PROMPTS[kind]}], dict(LOADED_PARAMS, **params)
    try:
        if isinstance(client, SyncFacade):
            return client._runner.run(client._client.chat(messages, on_event=events.append, **params), 600)
        return client.chat(messages, on_event=events.append, **params)
    except lc.LoopError as exc:
        return exc


@unittest.skipUnless(REAL_SOCKET, SKIP_REAL)
class TestRealFrontsLoaded(ClientFactory, unittest.TestCase):
    """nginx and HAProxy with a 4 s idle timeout in front of a llama-server of the test's own with one slot,
    on a loaded machine (``LOADED`` busy processes beside it, as ``LOOPCLIENT_TEST_LOAD`` runs them): a
    resumable chat through each, queued behind another client's generation for three times the timeout
    (each front gives up on it, 504, and the client reads it from the server's buffer instead of sending it
    again), then cut mid-answer (a proxy between the front and the server), finishes with the text a quiet
    run of the same chat gives (temperature 0, a seed), through both clients; no StreamClosedError while
    the server lives.  ``dev/loaded-fronts.py`` runs the same case again and again."""

    TIMEOUT = 4
    HOLD = 3 * TIMEOUT
    LOADED = 4
    CUT = 1200  # body bytes of the answer before the cut: four tokens (about 280 bytes each) of sixteen
    KINDS = ("nginx", "haproxy")
    limits = REAL_LIMITS.replace(poll=0.5, busy_wait=180.0, load_wait=30.0)

    @classmethod
    def setUpClass(cls):
        missing = [kind for kind in _front_binaries() if kind in cls.KINDS]
        if missing:
            _require(cls, False, "not installed: %s (apt-get install -y nginx haproxy)" % ", ".join(missing))
        cls.sock, cls.stop_server = start_own_server(1)
        cls.load = None
        try:
            with lc.Client(cls.sock, limits=REAL_LIMITS) as quiet:  # the reference, before any load
                cls.quiet = {kind: _real_quiet(quiet, kind) for kind in cls.KINDS}
            cls.load = BusyLoad(cls.LOADED).start()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if cls.load is not None:
            cls.load.stop()
        cls.stop_server()

    def test_resumable_chats_queued_past_the_timeout_and_cut_mid_answer_finish_exact(self):
        proxies, clients = {}, {}
        for kind in self.KINDS:
            proxies[kind] = MidAnswerCut(self.sock, self.CUT)
            self.addCleanup(proxies[kind].close)
            front = Front(kind, [proxies[kind].path], "pin", self.TIMEOUT)
            self.addCleanup(front.close)
            clients[kind] = self.new_client(front.url, limits=self.limits)
            self.addCleanup(clients[kind].close)
        holder = Holder(self.sock, 0)
        self.addCleanup(holder.release)
        running = []
        timer = threading.Timer(self.HOLD, lambda: running.append(holder.release()))
        timer.start()
        self.addCleanup(timer.join, 30)
        events = {kind: [] for kind in self.KINDS}
        outcomes = {}
        threads = [
            threading.Thread(
                target=lambda k=kind: outcomes.__setitem__(k, loaded_chat(clients[k], k, events[k], resumable=True)),
                daemon=True,
            )
            for kind in self.KINDS
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        self.assertFalse([t for t in threads if t.is_alive()], "a chat did not end within 600 s")
        timer.join(30)
        self.assertEqual(running, [True], "the holder ended before the hold did")
        for kind in self.KINDS:
            with self.subTest(kind):
                told = [e for e in events[kind] if isinstance(e, (lc.Resumed, lc.Retrying))]
                completion = outcomes[kind]
                self.assertIsInstance(completion, lc.Completion, "told: %r" % told)
                self.assertEqual(completion.content, self.quiet[kind])
                self.assertEqual(completion.usage["completion_tokens"], LOADED_PARAMS["max_tokens"])
                self.assertEqual("".join(e.text for e in events[kind] if isinstance(e, lc.Content)), completion.content)
                resumed = [e for e in told if isinstance(e, lc.Resumed)]
                # queued past the timeout: read from the server's buffer from 0; cut mid-answer (by the
                # proxy, or before it by the front itself, when a token took longer than its timeout):
                # resumed from the bytes received
                self.assertEqual(resumed[0].offset, 0, told)
                self.assertTrue([e for e in resumed if e.offset > 0], told)
                self.assertLessEqual(len(proxies[kind].cut_conversations), 1)


class TestRealFrontsLoadedAsync(AsyncDriver, TestRealFrontsLoaded):
    pass


def _real_quiet(client, kind):
    """The reference answer of ``kind``'s loaded chat: the same chat, straight to the server, nothing else
    running."""
    events = []
    completion = run_with_timeout(lambda: loaded_chat(client, kind, events), 120)
    if not isinstance(completion, lc.Completion):
        raise completion
    return completion.content
