#!/usr/bin/env python3
"""Benchmarks for loopclient.py (standard library only): each figure is a ratio against a floor measured in
the same run, the two alternated (ABBA order, so drift cancels), reported as median and spread (min..max).

    python3 dev/bench.py              # figures 1 to 6, full sizes
    python3 dev/bench.py --quick      # smaller sizes, a smoke check
    python3 dev/bench.py --only 3     # one figure
    python3 dev/bench.py --profile    # cProfile of figure 1's loopclient side (top functions)
    python3 dev/bench.py --profile 4  # figure 4's request cost item by item, beside the floor
    python3 dev/bench.py --async      # figure 7 only: figure 1 through AsyncClient
    python3 dev/bench.py --native     # figure 9 only: a native /completion stream, both clients
    python3 dev/bench.py --single-shot --socket S --url http://127.0.0.1:P   # figure 8, a REAL server
    python3 dev/bench.py --setup-httpx  # httpx (pinned) into the bench's own venv, for figure 8

Figures:
    1. Stream throughput: events/s reading a 200,000-event llama-server stream over a Unix socket, against
       a tight hand-written reader (de-chunk, split lines, json.loads, append).  Target >= 0.90x.
    2. Import cost: a fresh interpreter running ``import loopclient`` and ``Client(...)`` against ``import socket, json,
       threading``, bytecode cached.  Target <= 1.15x.
    3. Memory: peak RSS growth (VmHWM) of a fresh process streaming the 200,000 events, against a budget
       of the assembled text length plus 8 MiB (the floor reader's growth is shown beside it).
    4. Per-request overhead: 2,000 sequential five-event streams against an instant server, against a
       floor that does the least a correct reader does with the same bytes: a new connection, de-chunk,
       split lines, json.loads each event, join the content.  Target >= 0.80x.
    5. Many waiters: 64 threads, 5,000 requests over 8 pinned slots with Limits(queue_len=8), against a
       floor that queues on the client side too: a threading.Semaphore per slot, one connection per
       request parsed as in figure 4, the same 64 threads.  Requests/s, target >= 0.80x; every request
       served or refused with BusyError, at most one /slots request in flight.
    6. Queue scaling: 10, 100, 1,000 and 4,000 requests waiting on one client (a thread per request in
       flight or waiting), on one slot and on a ``slot=None`` pool of 8, against an instant server (poll
       1 s, so each waiter also wakes on its timer about once a second): wall and process CPU time per
       request served while the queue stays full, as ratios to 10 waiting in the same pass.  Target
       <= 1.5x at 4,000.  Starting the threads (bounded: one per request, 512 KiB stacks), entering the
       queue and the first generation (all entered at once, so their poll timers fire together) are
       timed apart; the floor crew of figure 5 is measured beside it for scale.
    7. Async stream throughput (``--async``): figure 1 read through ``AsyncClient`` on an event loop, against
       the same floor.  Target >= 0.90x.
    8. Single-shot calls (``--single-shot``), against a REAL llama-server (``dev/llama-server.sh start`` /
       ``start-tcp PORT``): calls per second of ``client.tokenize(text)`` in a loop, one client object
       reused, beside http.client on ONE persistent connection (the floor), http.client with a new
       connection per call, and httpx's pooled ``httpx.Client`` (when installed: ``--setup-httpx``), over
       the Unix socket and over TCP; the contenders interleaved in rounds (A B C, then C B A, ...), and
       after each TCP run the sockets it left in TIME-WAIT towards the server's port (/proc/net/tcp).  With
       a loopclient whose ``Limits`` has ``keep_alive``, both ``keep_alive=0`` and the default are shown.
       Target: loopclient >= 1.00x on both transports, at most a few (5) TIME-WAIT after a TCP run.
    9. Native stream throughput (``--native``): ``stream_complete()`` reading a 200,000-token ``/completion``
       stream in llama-server's own shape (one ``{"index","content","tokens","stop":false,...}`` object per
       token, transcript 42's ``stop: true`` chunk last, no ``[DONE]``), through ``Client`` and through
       ``AsyncClient``, against figure 1's floor reading the same bytes (json.loads each payload, join
       ``content``).  Target >= 0.90x.

Every server is a separate process (fork), so it never competes with the measured reader for the GIL.
The exit code is 0 even when a figure fails: this is a report.  The Markdown table at the end is for the
README.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _lc_root(argv):
    """The checkout whose loopclient.py is measured: ``--root DIR``, else this one."""
    for i, arg in enumerate(argv):
        if arg == "--root" and i + 1 < len(argv):
            return os.path.abspath(argv[i + 1])
        if arg.startswith("--root="):
            return os.path.abspath(arg.split("=", 1)[1])
    return ROOT


#: ``--root DIR`` measures another checkout's loopclient.py with this script's figures (an older round
#: beside this one, in the same session); the shared fixtures then come from that checkout's test module,
#: which matches its loopclient.py.
LC_ROOT = _lc_root(sys.argv)
sys.path.insert(0, LC_ROOT)
import loopclient as lc  # noqa: E402  (imported by path: the repository root, or --root)

_ctx = multiprocessing.get_context("fork")

# -----------------------------------------------------------------------------------------------------
# Fixtures: bytes in the real server's shape (dev/testdata/transcripts/04 and 06)
# -----------------------------------------------------------------------------------------------------

# The real server's byte shapes, shared with the tests.
from test_loopclient import CID, MODEL, STREAM_HEAD, TIMINGS, USAGE, load_transcript, read_request  # noqa: E402

MSGS = [{"role": "user", "content": "Write one sentence about the sea."}]

# Token-sized pieces, as a tokenizer cuts prose: leading spaces, punctuation, newlines, a quote, a
# Latin-1 letter (the server writes UTF-8 unescaped).
WORDS = tuple(
    [
        "Write",
        " one",
        " sentence",
        " about",
        " the",
        " sea",
        ".",
        "\n",
        "The",
        " sea",
        " is",
        " a",
        " vast",
        ",",
        " restless",
        " expanse",
        " of",
        " salt",
        " water",
        " that",
        " covers",
        " most",
        " of",
        " the",
        " planet",
        ",",
        " shaping",
        " weather",
        ",",
        " trade",
        " and",
        " the",
        " stories",
        " we",
        " tell",
        ".",
        "\n\n",
        "Sailors",
        " call",
        " it",
        ' "',
        "the",
        " deep",
        '"',
        ";",
        " poets",
        " call",
        " it",
        " a",
        " mirror",
        ".",
        " Caf",
        "é",
        " owners",
        " by",
        " the",
        " harbour",
        " simply",
        " call",
        " it",
        " business",
        ".",
        "\n",
    ]
)


def chunk_json(delta=None, finish=None, extra=None, choices=True):
    """One chunk payload as llama-server writes it (key order, separators, raw UTF-8)."""
    doc = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta if delta is not None else {}}]
        if choices
        else []
    }
    doc.update(
        {
            "created": 1796006109,
            "id": CID,
            "model": MODEL,
            "system_fingerprint": "b0-unknown",
            "object": "chat.completion.chunk",
        }
    )
    if extra:
        doc.update(extra)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sse(payload):
    return b"data: " + payload + b"\n\n"


def chunk(body):
    return b"%x\r\n%s\r\n" % (len(body), body)


def stream_text(n_events, words=WORDS):
    return "".join(words[i % len(words)] for i in range(n_events))


def stream_response(n_events, words=WORDS):
    """The whole response, head included: role chunk sharing an HTTP chunk with the first delta, one HTTP
    chunk per content delta, finish (with timings) and usage chunks sharing one, [DONE], the 0 chunk."""
    framed = {w: chunk(sse(chunk_json({"content": w}))) for w in set(words)}
    parts = [
        STREAM_HEAD,
        chunk(sse(chunk_json({"role": "assistant", "content": None})) + sse(chunk_json({"content": words[0]}))),
    ]
    parts.extend(framed[words[i % len(words)]] for i in range(1, n_events))
    fin = sse(chunk_json({}, "stop", extra={"timings": TIMINGS}))
    fin += sse(chunk_json(choices=False, extra={"usage": USAGE, "timings": TIMINGS}))
    parts += [chunk(fin), chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"]
    return b"".join(parts)


def json_response(doc):
    body = json.dumps(doc, separators=(",", ":")).encode()
    return (
        b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: application/json; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )


PROMPT = "Write one sentence about the sea."
#: The real /completion stream these chunks copy: its head, and its last chunk (``stop: true``) verbatim.
NATIVE_TRANSCRIPT = "42_completion_stream_token_ids.raw.txt"


def native_response(n_events, words=WORDS):
    """A native ``/completion`` stream in llama-server's shape (transcript 42): one HTTP chunk per token,
    ``data: {"index":0,"content":...,"tokens":[id],"stop":false,"id_slot":-1,"tokens_predicted":n,
    "tokens_evaluated":4}``, then the transcript's own ``stop: true`` chunk (model, settings, timings) and
    the 0 chunk; no ``[DONE]``."""
    raw = load_transcript(NATIVE_TRANSCRIPT)
    head, _, body = raw.partition(b"\r\n\r\n")
    last = [line for line in body.split(b"\n") if line.startswith(b"data: {") and b'"stop":true' in line][-1]
    ids = {w: 400 + i for i, w in enumerate(sorted(set(words)))}
    quoted = {w: json.dumps(w, ensure_ascii=False).encode("utf-8") for w in set(words)}
    parts = [head + b"\r\n\r\n"]
    for i in range(n_events):
        w = words[i % len(words)]
        parts.append(
            chunk(
                b'data: {"index":0,"content":%s,"tokens":[%d],"stop":false,"id_slot":-1,"tokens_predicted":%d,'
                b'"tokens_evaluated":4}\n\n' % (quoted[w], ids[w], i + 1)
            )
        )
    parts += [chunk(last + b"\n\n"), b"0\r\n\r\n"]
    return b"".join(parts)


# -----------------------------------------------------------------------------------------------------
# Server processes: the parent binds and listens, the forked child accepts (so it is ready at once)
# -----------------------------------------------------------------------------------------------------


class ServerProcess:
    def __init__(self, target, *args):
        self.dir = tempfile.mkdtemp(prefix="lcb", dir="/tmp")
        self.path = os.path.join(self.dir, "s.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(256)
        ours, theirs = _ctx.Pipe()
        self.proc = _ctx.Process(target=target, args=(listener, theirs) + args, daemon=True)
        self.proc.start()
        listener.close()
        theirs.close()
        if not ours.poll(120):
            self.close()
            raise RuntimeError("server process did not start")
        self.info = ours.recv()
        self.control = ours  # a server that takes orders reads them here (see _instant_server)

    def close(self):
        self.control.close()
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(10)
        shutil.rmtree(self.dir, ignore_errors=True)


SEND_SLICE = 4 * 1024 * 1024


def _stream_sender(listener, pipe, n_events, native=False):
    """Replays the pre-built stream (chat's, or with ``native`` /completion's) to every POST, in 4 MiB
    sendall() calls; answers /props."""
    blob = memoryview(native_response(n_events) if native else stream_response(n_events))
    props = json_response({"total_slots": 1, "build_info": "b0-unknown"})
    pipe.send(len(blob))
    pipe.close()
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                req = read_request(conn)
                if req is None:
                    continue
                if req[1] not in ("/v1/chat/completions", "/completion"):
                    conn.sendall(props)
                    continue
                for i in range(0, len(blob), SEND_SLICE):
                    conn.sendall(blob[i : i + SEND_SLICE])
            except OSError:  # the reader stops at [DONE] and may close before the final 0 chunk
                pass


def _instant_server(listener, pipe, response, n_slots=1):
    """One connection at a time: read the request, answer the canned response, close.  /props says
    ``n_slots``.  When the parent has sent "hold", the next chat request is held until it sends "go"
    (and, the server being sequential, every request behind it waits too)."""
    props = json_response({"total_slots": n_slots})
    pipe.send(None)
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                req = read_request(conn)
                if req is None:
                    continue
                if req[1] != "/v1/chat/completions":
                    conn.sendall(props)
                    continue
                if pipe.poll() and pipe.recv() == "hold":
                    pipe.recv()  # "go"
                conn.sendall(response)
            except (OSError, EOFError):
                pass


def _slot_server(listener, pipe, response, n_slots, slots_delay, hold_every, hold):
    """A thread per connection, like llama-server's HTTP pool.  A slot serves one chat at a time (the next
    request for it gets no byte until the previous one is answered, as in transcript 21); every
    ``hold_every``-th chat holds its slot ``hold`` seconds before the head, so waiters poll /slots.  /slots
    answers after ``slots_delay`` and counts how many are in flight at once."""
    lock = threading.Lock()
    slot_locks = [threading.Lock() for _ in range(n_slots)]
    busy = [False] * n_slots
    stats = {}

    def reset():
        stats.update(chats=0, held=0, slots_requests=0, slots_in_flight=0, slots_max_in_flight=0)

    def handle(conn):
        with conn:
            try:
                req = read_request(conn)
                if req is None:
                    return
                path, body = req.path, req.body
                if path == "/v1/chat/completions":
                    slot = json.loads(body).get("id_slot", 0) % n_slots
                    with slot_locks[slot]:
                        busy[slot] = True
                        with lock:
                            stats["chats"] += 1
                            held = hold_every and stats["chats"] % hold_every == 0
                            stats["held"] += bool(held)
                        if held:
                            time.sleep(hold)
                        conn.sendall(response)
                        busy[slot] = False
                elif path == "/slots":
                    with lock:
                        stats["slots_requests"] += 1
                        stats["slots_in_flight"] += 1
                        stats["slots_max_in_flight"] = max(stats["slots_max_in_flight"], stats["slots_in_flight"])
                    try:
                        time.sleep(slots_delay)
                        conn.sendall(
                            json_response([{"id": i, "n_ctx": 1024, "is_processing": b} for i, b in enumerate(busy)])
                        )
                    finally:
                        with lock:
                            stats["slots_in_flight"] -= 1
                elif path == "/stats":
                    with lock:
                        doc = dict(stats)
                    conn.sendall(json_response(doc))
                elif path == "/reset":
                    with lock:
                        reset()
                    conn.sendall(json_response({}))
                else:
                    conn.sendall(json_response({"total_slots": n_slots}))
            except OSError:
                pass

    reset()
    pipe.send(None)
    pipe.close()
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def raw_get(path, target):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
        s.sendall(b"GET %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n" % target.encode())
        data = b""
        while True:
            more = s.recv(65536)
            if not more:
                break
            data += more
    finally:
        s.close()
    return json.loads(data.partition(b"\r\n\r\n")[2])


def streams_of(client):
    """What builds a client's streamed requests: its ``_Streams``, or in an older checkout its ``_Calls``."""
    return getattr(client, "_streams", None) or getattr(client, "_calls", None)


def chat_stream_request(streams, slot):
    """The streamed chat request of MSGS on ``slot`` (``streams`` from ``streams_of``): a row of the endpoint
    table (stream_request), or in an older checkout chat_request."""
    if hasattr(streams, "stream_request"):
        return streams.stream_request("chat", (MSGS,), {}, slot)
    return streams.chat_request(MSGS, slot, {})


def request_bytes(client, slot):
    """The exact bytes loopclient sends for MSGS on ``slot`` (built by loopclient itself)."""
    streams = streams_of(client)  # the request logic apart from the client
    if hasattr(streams, "stream_request") or hasattr(streams, "chat_request"):
        data = chat_stream_request(streams, slot).request
    else:
        data = getattr(client.stream(MSGS, slot=slot), "_request", None)
    if not isinstance(data, bytes):  # private names changed: build an equivalent request
        body = json.dumps(
            {"messages": MSGS, "stream": True, "stream_options": {"include_usage": True}, "id_slot": slot}
        ).encode()
        data = lc.encode_request(
            "POST",
            "/v1/chat/completions",
            "localhost",
            [
                ("Accept", "text/event-stream"),
                ("Content-Type", "application/json"),
                ("Connection", "close"),
                ("User-Agent", "loopclient/" + lc.__version__),
            ],
            body,
        )
    return data


# -----------------------------------------------------------------------------------------------------
# Measurement helpers
# -----------------------------------------------------------------------------------------------------


def alternate(measure_a, measure_b, pairs):
    """[(a, b)] from ``pairs`` pairs, in ABBA order so that a slow drift hits both sides alike."""
    out = []
    for i in range(pairs):
        if i % 2 == 0:
            a = measure_a()
            b = measure_b()
        else:
            b = measure_b()
            a = measure_a()
        out.append((a, b))
    return out


class Figure:
    def __init__(self, number, name, unit, lc_value, floor_value, ratios, target, passed, note="", versus="floor"):
        self.number = number
        self.name = name
        self.unit = unit
        self.lc_value = lc_value
        self.floor_value = floor_value
        self.ratios = ratios
        self.target = target
        self.passed = passed
        self.note = note
        self.versus = versus  # what the ratio divides by

    @property
    def median(self):
        return statistics.median(self.ratios)

    def spread(self):
        return "%.2f..%.2f" % (min(self.ratios), max(self.ratios))

    @property
    def verdict(self):
        return "info" if self.passed is None else "PASS" if self.passed else "FAIL"

    def line(self):
        return "[%d] %s: loopclient %s, %s %s; ratio %.3f (%s, %d pairs), target %s: %s%s" % (
            self.number,
            self.name,
            self.lc_value,
            self.versus,
            self.floor_value,
            self.median,
            self.spread(),
            len(self.ratios),
            self.target,
            self.verdict,
            ("\n    " + self.note) if self.note else "",
        )


def fmt_rate(x, unit):
    return "{:,.0f} {}".format(x, unit)


def collect():
    gc.collect()


# -----------------------------------------------------------------------------------------------------
# 1 and 3. Stream throughput and memory
# -----------------------------------------------------------------------------------------------------

RECV = lc.RECV_SIZE if isinstance(getattr(lc, "RECV_SIZE", None), int) else 256 * 1024


def floor_stream(path, request, native=False):
    """The least a correct reader does: one socket, de-chunk, split lines, json.loads each data line,
    append the content (chat's ``choices[0].delta.content``, or with ``native`` /completion's ``content``).
    No checks.  Returns (content events, text)."""
    loads = json.loads
    parts = []
    append = parts.append
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(request)
    recv = s.recv
    data = b""
    while b"\r\n\r\n" not in data:
        data += recv(RECV)
    data = data[data.index(b"\r\n\r\n") + 4 :]
    left = 0  # chunk bytes still due, its closing CRLF included
    pending = b""  # a partial chunk-size line
    tail = b""  # a partial SSE line
    done = False
    while True:
        if pending:
            data = pending + data
            pending = b""
        out = []
        pos = 0
        end = len(data)
        while pos < end:
            if left:
                take = end - pos
                if take >= left:
                    if left > 2:
                        out.append(data[pos : pos + left - 2])
                    pos += left
                    left = 0
                else:
                    if left > 2:
                        out.append(data[pos : pos + min(take, left - 2)])
                    left -= take
                    pos = end
                continue
            nl = data.find(b"\n", pos)
            if nl < 0:
                pending = data[pos:]
                break
            size = int(data[pos:nl], 16)
            pos = nl + 1
            if not size:
                done = True
                break
            left = size + 2
        block = tail + b"".join(out)
        cut = block.rfind(b"\n") + 1
        tail = block[cut:]
        if native:
            for line in block[:cut].decode().split("\n"):
                if line.startswith("data: {"):
                    text = loads(line[6:]).get("content")
                    if text:
                        append(text)
        else:
            for line in block[:cut].decode().split("\n"):
                if line.startswith("data: {"):
                    choices = loads(line[6:])["choices"]
                    if choices:
                        text = choices[0]["delta"].get("content")
                        if text:
                            append(text)
        if done:
            break
        data = recv(RECV)
        if not data:
            break
    s.close()
    return len(parts), "".join(parts)


def _read(path, open_stream):
    """``open_stream(client)`` on a fresh ``Client``, iterated; returns (content events, completion text)."""
    client = lc.Client(path)
    n = 0
    with open_stream(client) as stream:
        for ev in stream:
            if type(ev) is lc.Content:
                n += 1
    client.close()
    return n, stream.completion.content


def lc_stream(path):
    """loopclient's stream, iterated; returns (content events, completion text)."""
    return _read(path, lambda client: client.stream(MSGS, slot=0))


#: The reader's own CPU seconds in the last ``timed()`` call (the servers are other processes): on a shared
#: machine a reader that is descheduled loses wall time, not CPU time, so the CPU ratio is the steadier one.
LAST_CPU = [0.0]


def timed(fn, *args):
    collect()
    c0 = time.process_time()
    t0 = time.perf_counter()
    result = fn(*args)
    dt = time.perf_counter() - t0
    LAST_CPU[0] = time.process_time() - c0
    return dt, result


def cpu_note(cpu):
    """The CPU-time ratio beside the wall-time one: ``cpu`` maps True (the floor) and False (loopclient)
    to events per CPU second, one per run, the warm-up first."""
    ratios = [x / y for x, y in zip(cpu[False][1:], cpu[True][1:])]
    return "events per CPU second of the reading process: ratio %.3f (%.2f..%.2f)" % (
        statistics.median(ratios),
        min(ratios),
        max(ratios),
    )


def fig_stream(cfg, server, request, text):
    n_events = cfg.events

    def check(result, who):
        n, got = result
        if n != n_events or got != text:
            raise AssertionError(
                "%s read %d events / %d chars; expected %d / %d" % (who, n, len(got), n_events, len(text))
            )

    cpu = {False: [], True: []}

    def a():
        dt, res = timed(lc_stream, server.path)
        check(res, "loopclient")
        cpu[False].append(n_events / LAST_CPU[0])
        return n_events / dt

    def b():
        dt, res = timed(floor_stream, server.path, request)
        check(res, "floor")
        cpu[True].append(n_events / LAST_CPU[0])
        return n_events / dt

    a(), b()  # warm-up
    results = alternate(a, b, cfg.pairs)
    return stream_figure(1, "stream throughput (%d events, %.1f MB)" % (n_events, server.info / 1e6), results, cpu)


def stream_figure(number, name, results, cpu):
    """A stream-throughput figure (1, 7, 9) from alternated (loopclient, floor) events/s: target 0.90x."""
    ratios = [x / y for x, y in results]
    return Figure(
        number,
        name,
        "events/s",
        fmt_rate(statistics.median(x for x, _ in results), "ev/s"),
        fmt_rate(statistics.median(y for _, y in results), "ev/s"),
        ratios,
        ">= 0.90x",
        statistics.median(ratios) >= 0.90,
        cpu_note(cpu),
    )


_MEM_CHILD = "--child-mem"


def vm_hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child_mem(mode, path):
    """Runs in a fresh interpreter: VmHWM growth over one 200,000-event stream."""
    request = request_bytes(lc.Client(path), 0)
    gc.collect()
    before = vm_hwm()
    n, text = lc_stream(path) if mode == "lc" else floor_stream(path, request)
    after = vm_hwm()
    print(json.dumps({"growth": after - before, "before": before, "events": n, "chars": len(text)}))


def fig_memory(cfg, server, text):
    exe = os.path.realpath(sys.executable)
    budget = len(text) + 8 * 1024 * 1024

    def run(mode):
        out = subprocess.run(
            [exe, os.path.abspath(__file__), _MEM_CHILD, mode, server.path, "--root=" + LC_ROOT],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode != 0:
            raise RuntimeError("memory child failed: %s" % out.stderr[-2000:])
        doc = json.loads(out.stdout.strip().splitlines()[-1])
        if doc["events"] != cfg.events or doc["chars"] != len(text):
            raise AssertionError("memory child read %r" % doc)
        return doc["growth"]

    results = alternate(lambda: run("lc"), lambda: run("floor"), max(2, cfg.pairs))
    ratios = [x / budget for x, _ in results]
    worst = max(x for x, _ in results)
    return Figure(
        3,
        "memory, peak RSS growth streaming %d events" % cfg.events,
        "bytes",
        "%.2f MiB (worst %.2f)" % (statistics.median(x for x, _ in results) / 2**20, worst / 2**20),
        "%.2f MiB" % (statistics.median(y for _, y in results) / 2**20),
        ratios,
        "<= 1.00 of text (%.2f MiB) + 8 MiB, worst run" % (len(text) / 2**20),
        worst <= budget,
        "ratio = loopclient growth / budget; the floor reader's growth is shown for scale",
    )


# -----------------------------------------------------------------------------------------------------
# 2. Import cost
# -----------------------------------------------------------------------------------------------------


def fig_import(cfg):
    exe = os.path.realpath(sys.executable)
    cache = tempfile.mkdtemp(prefix="lcb-pyc", dir="/tmp")
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # measure what users get: bytecode cached
    pre = "import sys; sys.path.insert(0, %r); " % LC_ROOT
    target = pre + "import loopclient; loopclient.Client('/tmp/x.sock')"  # what a program pays
    floor = pre + "import socket, json, threading"

    def runner(flags):
        def run(code):
            t0 = time.perf_counter()
            subprocess.run([exe] + flags + ["-X", "pycache_prefix=" + cache, "-c", code], env=env, check=True)
            return time.perf_counter() - t0

        return run

    figures = []
    try:
        for flags, label in (([], "plain"), (["-I", "-S"], "-I -S, for information")):
            run = runner(flags)
            for _ in range(3):  # warm the bytecode cache and the page cache
                run(target), run(floor)
            results = alternate(lambda: run(target), lambda: run(floor), cfg.import_pairs)
            ratios = [x / y for x, y in results]
            med = statistics.median(ratios)
            figures.append(
                Figure(
                    2,
                    "import cost (%s)" % label,
                    "ms",
                    "%.1f ms" % (1000 * statistics.median(x for x, _ in results)),
                    "%.1f ms" % (1000 * statistics.median(y for _, y in results)),
                    ratios,
                    "<= 1.15x" if not flags else "(info)",
                    med <= 1.15 if not flags else None,
                )
            )
        # For information: no bytecode cache at all (what PYTHONDONTWRITEBYTECODE=1 with no __pycache__ gives).
        # The standard library keeps its own cached bytecode; loopclient.py is compiled on every import
        # (unless a __pycache__ sits beside it).
        env_nc = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")

        def run_nc(code):
            t0 = time.perf_counter()
            subprocess.run([exe, "-c", code], env=env_nc, check=True)
            return time.perf_counter() - t0

        nc = alternate(lambda: run_nc(target), lambda: run_nc(floor), 5)
        figures[0].note = (
            "with PYTHONDONTWRITEBYTECODE=1 (as in this sandbox) loopclient costs %.1f ms vs %.1f ms%s"
            % (
                1000 * statistics.median(x for x, _ in nc),
                1000 * statistics.median(y for _, y in nc),
                " (a __pycache__ is beside it)"
                if os.path.isdir(os.path.join(LC_ROOT, "__pycache__"))
                else ", compiled on every import",
            )
        )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return figures


# -----------------------------------------------------------------------------------------------------
# 4. Per-request overhead
# -----------------------------------------------------------------------------------------------------

SHORT = ("The", " sea", " is", " wide", ".")


def short_response():
    return stream_response(len(SHORT), SHORT)


def fig_requests(cfg):
    response = short_response()
    server = ServerProcess(_instant_server, response)
    try:
        client = lc.Client(server.path)
        request = request_bytes(client, 0)
        n = cfg.requests

        def a():
            collect()
            events = 0
            t0 = time.perf_counter()
            for _ in range(n):
                for ev in client.stream(MSGS, slot=0):
                    events += 1
            dt = time.perf_counter() - t0
            if events != 5 * n:
                raise AssertionError("loopclient got %d events, expected %d" % (events, 5 * n))
            return n / dt

        def b():
            collect()
            events = 0
            t0 = time.perf_counter()
            for _ in range(n):
                got, text = floor_stream(server.path, request)
                events += got
            dt = time.perf_counter() - t0
            if events != 5 * n or text != "".join(SHORT):
                raise AssertionError("the floor got %d events, expected %d" % (events, 5 * n))
            return n / dt

        a(), b()
        results = alternate(a, b, cfg.pairs)
        client.close()
    finally:
        server.close()
    ratios = [x / y for x, y in results]
    med = statistics.median(ratios)
    return Figure(
        4,
        "per-request overhead (%d sequential 5-event streams)" % n,
        "req/s",
        fmt_rate(statistics.median(x for x, _ in results), "req/s"),
        fmt_rate(statistics.median(y for _, y in results), "req/s"),
        ratios,
        ">= 0.80x",
        med >= 0.80,
        "floor: a new connection per request, de-chunk, split lines, json.loads each event, join the content",
    )


# -----------------------------------------------------------------------------------------------------
# 5. Many waiters
# -----------------------------------------------------------------------------------------------------

N_THREADS = 64
N_SLOTS = 8


def many(path, total, slot_of, limits):
    """``N_THREADS`` threads share ``total`` requests; returns (seconds, served, busy, errors, events)."""
    client = lc.Client(path, limits=limits)
    counter = itertools.count()
    lock = threading.Lock()
    tally = {"served": 0, "busy": 0, "events": 0, "errors": []}
    barrier = threading.Barrier(N_THREADS + 1)

    def worker(t):
        slot = slot_of(t)
        served = busy = events = 0
        errors = []
        barrier.wait()
        while next(counter) < total:
            try:
                with client.stream(MSGS, slot=slot) as stream:
                    for ev in stream:
                        if type(ev) is lc.Content:
                            events += 1
                served += 1
            except lc.BusyError:
                busy += 1
            except Exception as exc:
                errors.append(repr(exc))
        with lock:
            tally["served"] += served
            tally["busy"] += busy
            tally["events"] += events
            tally["errors"] += errors

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(N_THREADS)]
    for thread in threads:
        thread.start()
    collect()
    barrier.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join(600)
    dt = time.perf_counter() - t0
    client.close()
    return dt, tally


def many_floor(path, total, requests):
    """The floor for figure 5: ``N_THREADS`` threads share ``total`` requests and queue on the client side
    too, on a ``threading.Semaphore`` per slot (it wakes one waiter per release), each request on a new
    connection, parsed as figure 4's floor parses it.  Returns (seconds, events)."""
    counter = itertools.count()
    sems = [threading.Semaphore(1) for _ in range(N_SLOTS)]
    barrier = threading.Barrier(N_THREADS + 1)
    counts = []

    def worker(t):
        slot = t % N_SLOTS
        request = requests[slot]
        sem = sems[slot]
        events = 0
        barrier.wait()
        while next(counter) < total:
            with sem:
                events += floor_stream(path, request)[0]
        counts.append(events)

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(N_THREADS)]
    for thread in threads:
        thread.start()
    collect()
    barrier.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join(600)
    return time.perf_counter() - t0, sum(counts)


def fig_waiters(cfg):
    total = cfg.waiter_requests
    hold_every = max(1, total // 10)  # ten slow requests per run
    server = ServerProcess(_slot_server, short_response(), N_SLOTS, 0.005, hold_every, 0.12)
    limits = lc.Limits(queue_len=8, poll=0.05)
    problems = []
    slots_seen = []

    def gated():
        raw_get(server.path, "/reset")
        dt, tally = many(server.path, total, lambda t: t % N_SLOTS, limits)
        stats = raw_get(server.path, "/stats")
        if tally["served"] + tally["busy"] != total or tally["errors"]:
            problems.append(
                "%d served + %d busy of %d, errors %s" % (tally["served"], tally["busy"], total, tally["errors"][:3])
            )
        if tally["events"] != 5 * tally["served"] or stats["chats"] != tally["served"]:
            problems.append(
                "%d events for %d served, server saw %d chats" % (tally["events"], tally["served"], stats["chats"])
            )
        if stats["slots_max_in_flight"] > 1:
            problems.append("%d /slots requests in flight at once" % stats["slots_max_in_flight"])
        slots_seen.append((stats["slots_requests"], stats["slots_max_in_flight"], tally["busy"]))
        return total / dt

    def floor():
        raw_get(server.path, "/reset")
        dt, events = many_floor(server.path, total, requests)
        if events != 5 * total:
            problems.append("floor: %d events for %d requests" % (events, total))
        return total / dt

    # Thread t pins slot t % 8, so eight threads share each slot and seven of them queue on the client
    # side: in loopclient's gate, or on the floor's semaphore.  The same server, request count and
    # held requests (every tenth of the run holds its slot 0.12 s before the head, so loopclient's
    # waiters also poll /slots).  Throughput: requests per second, loopclient over the floor.
    try:
        requests = [request_bytes(lc.Client(server.path), s) for s in range(N_SLOTS)]
        results = alternate(gated, floor, cfg.waiter_pairs)
    finally:
        server.close()
    ratios = [x / y for x, y in results]
    med = statistics.median(ratios)
    note = "checks: %s; /slots requests per loopclient run %s, most in flight at once %d; BusyError %d" % (
        "all requests served or refused, events complete" if not problems else "; ".join(problems[:4]),
        [s[0] for s in slots_seen],
        max(s[1] for s in slots_seen),
        sum(s[2] for s in slots_seen),
    )
    return Figure(
        5,
        "many waiters (%d threads, %d requests, %d slots, queue_len 8)" % (N_THREADS, total, N_SLOTS),
        "req/s",
        fmt_rate(statistics.median(x for x, _ in results), "req/s"),
        fmt_rate(statistics.median(y for _, y in results), "req/s"),
        ratios,
        ">= 0.80x, checks pass",
        med >= 0.80 and not problems,
        note,
    )


# -----------------------------------------------------------------------------------------------------
# 7. Async stream throughput
# -----------------------------------------------------------------------------------------------------


def _read_async(path, open_stream):
    """``open_stream(client)`` on a fresh ``AsyncClient`` and event loop, iterated; (content events, text)."""
    import asyncio

    async def main():
        n = 0
        async with lc.AsyncClient(path) as client, open_stream(client) as stream:
            async for ev in stream:
                if type(ev) is lc.Content:
                    n += 1
        return n, stream.completion.content

    return asyncio.run(main())


def lc_stream_async(path):
    """loopclient's AsyncClient stream, iterated on a fresh event loop; returns (content events, text)."""
    return _read_async(path, lambda client: client.stream(MSGS, slot=0))


def fig_async_stream(cfg):
    """Figure 1's stream and floor, the stream read through AsyncClient; its own server process."""
    n_events = cfg.events
    text = stream_text(n_events)
    server = ServerProcess(_stream_sender, n_events)
    try:
        request = request_bytes(lc.Client(server.path), 0)
        cpu = {False: [], True: []}

        def rate(fn, *args):
            dt, (n, got) = timed(fn, *args)
            if n != n_events or got != text:
                raise AssertionError("%s read %d events / %d chars" % (fn.__name__, n, len(got)))
            cpu[fn is floor_stream].append(n_events / LAST_CPU[0])
            return n_events / dt

        rate(lc_stream_async, server.path), rate(floor_stream, server.path, request)  # warm-up
        results = alternate(
            lambda: rate(lc_stream_async, server.path), lambda: rate(floor_stream, server.path, request), cfg.pairs
        )
    finally:
        server.close()
    return stream_figure(7, "async stream throughput (%d events, AsyncClient)" % n_events, results, cpu)


# -----------------------------------------------------------------------------------------------------
# 9. Native /completion stream throughput
# -----------------------------------------------------------------------------------------------------


def native_request(client):
    """The exact bytes ``stream_complete(PROMPT, slot=0)`` sends (built by loopclient itself)."""
    streams = streams_of(client)
    if hasattr(streams, "stream_request"):  # a row of the endpoint table
        return streams.stream_request("complete", (PROMPT,), {}, 0).request
    return streams.endpoint_request("complete", lc._native_body(PROMPT, {}), 0).request


def lc_native(path):
    """``Client.stream_complete()``, iterated; returns (content events, completion text)."""
    return _read(path, lambda client: client.stream_complete(PROMPT, slot=0))


def lc_native_async(path):
    """``AsyncClient.stream_complete()``, iterated on a fresh event loop; returns (content events, text)."""
    return _read_async(path, lambda client: client.stream_complete(PROMPT, slot=0))


def fig_native(cfg):
    """Figure 1 for ``/completion``: ``stream_complete()`` reading a native stream of ``cfg.events`` tokens,
    through ``Client`` and through ``AsyncClient``, each against the floor reading the same bytes (de-chunk,
    split lines, json.loads each payload, join ``content``), alternated."""
    n_events = cfg.events
    text = stream_text(n_events)
    server = ServerProcess(_stream_sender, n_events, True)
    figures = []
    try:
        request = native_request(lc.Client(server.path))
        cpu = {}

        def rate(fn, *args):
            dt, (n, got) = timed(fn, *args)
            if n != n_events or got != text:
                raise AssertionError("%s read %d events / %d chars" % (fn.__name__, n, len(got)))
            cpu[fn is floor_stream].append(n_events / LAST_CPU[0])
            return n_events / dt

        def floor():
            return rate(floor_stream, server.path, request, True)

        for fn, label in ((lc_native, "Client"), (lc_native_async, "AsyncClient")):
            cpu.update({False: [], True: []})
            rate(fn, server.path), floor()  # warm-up
            results = alternate(lambda: rate(fn, server.path), floor, cfg.pairs)
            name = "native /completion stream throughput (%d tokens, %.1f MB, %s.stream_complete)" % (
                n_events,
                server.info / 1e6,
                label,
            )
            figures.append(stream_figure(9, name, results, cpu))
    finally:
        server.close()
    return figures


# -----------------------------------------------------------------------------------------------------
# 6. Queue scaling
# -----------------------------------------------------------------------------------------------------

#: Stack size of the benchmark's crew threads: 4,000 threads at the default 8 MiB would reserve 32 GiB of
#: address space for stacks that use a few pages.
CREW_STACK = 512 * 1024


class Crew:
    """``n`` threads, started once (timed apart, with small stacks) and reused over rounds.  In a round
    each thread sends ``per_thread`` (at least 3) requests one after the other, all let go at once, and a
    request that finishes goes back to the end of the queue, so the queue stays full until the first
    thread has sent its last request.  The server holds the first chat until every thread without a
    permit reports itself queued.  Timed apart:

    - entering: from letting the threads go to all of them queued, per thread;
    - first generation: the first ``n`` requests served, all of which entered at once (their poll timers
      fire together: a herd), per request;
    - steady: the next ``n * (per_thread - 2)`` requests, which entered one by one as others finished,
      per request.  This is the figure.  The tail after it, where the queue empties, is not timed.

    ``one(queued)`` sends one request, calls ``queued()`` if it waits, and returns its event count."""

    def __init__(self, n, one, waiting, per_thread):
        self.n = n
        self.one = one
        self.waiting = waiting  # how many call queued() at the start of a round: n less the permits
        self.per_thread = per_thread
        self.marks = {n: "first", n * (per_thread - 1): "steady"}
        self.steady = n * (per_thread - 2)
        self.lock = threading.Lock()
        self.start = threading.Barrier(n + 1)
        self.all_queued = threading.Event()
        self.done = threading.Event()
        self.state = {}
        self.problems = []
        old = threading.stack_size(CREW_STACK)
        try:
            t0 = time.perf_counter()
            self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(n)]
            for thread in self.threads:
                thread.start()
            self.spawn = (time.perf_counter() - t0) / n
        finally:
            threading.stack_size(old)

    def _queued(self):
        with self.lock:
            self.state["queued"] += 1
            if self.state["queued"] == self.waiting:
                self.all_queued.set()

    def _work(self):
        state = self.state
        while True:
            self.start.wait(600)
            if state.get("stop"):
                return
            queued = self._queued
            for _ in range(self.per_thread):
                try:
                    events = self.one(queued)
                except Exception as exc:
                    events = 0
                    self.problems.append(repr(exc))
                queued = None
                with self.lock:
                    state["events"] += events
                    state["served"] += 1
                    mark = self.marks.get(state["served"])
                    if mark is not None:
                        state[mark] = (time.perf_counter(), time.process_time())
                    if state["served"] == self.n * self.per_thread:
                        self.done.set()

    def round(self, server):
        """One round; returns seconds (wall, CPU) of entering, first generation and steady, in that order."""
        self.state.update(queued=0, served=0, events=0)
        self.all_queued.clear()
        self.done.clear()
        if not self.waiting:
            self.all_queued.set()
        server.control.send("hold")
        collect()
        self.start.wait(600)
        t0, c0 = time.perf_counter(), time.process_time()
        if not self.all_queued.wait(600):
            raise RuntimeError("the crew did not queue in 600 s")
        t1, c1 = time.perf_counter(), time.process_time()
        server.control.send("go")
        if not self.done.wait(600):
            raise RuntimeError("the crew's round did not finish in 600 s")
        (t2, c2), (t3, c3) = self.state["first"], self.state["steady"]
        if self.state["events"] != 5 * self.n * self.per_thread:
            self.problems.append(
                "%d events in a round of %d requests" % (self.state["events"], self.n * self.per_thread)
            )
        return t1 - t0, c1 - c0, t2 - t1, c2 - c1, t3 - t2, c3 - c2

    def close(self):
        self.state["stop"] = True
        self.start.wait(600)
        for thread in self.threads:
            thread.join(60)


def crew_lc(server, n, slot, capacity, per_thread, aheads, poll=1.0):
    """loopclient's crew; appends the ``ahead`` each queued request first hears to ``aheads``."""
    client = lc.Client(server.path, limits=lc.Limits(queue_len=n, poll=poll))
    for _ in client.stream(MSGS, slot=slot):  # warm: the connection path, and /props for a pool
        pass

    def one(queued):
        events = 0
        first = True
        for ev in client.stream(MSGS, slot=slot):
            if type(ev) is lc.Content:
                events += 1
            elif type(ev) is lc.Queued and first:
                first = False
                aheads.append(ev.ahead)
                if queued is not None:
                    queued()
        return events

    return Crew(n, one, n - capacity, per_thread), client.close


def crew_floor(server, n, slot, capacity, per_thread, aheads):
    """The same crew on figure 5's floor: a semaphore of ``capacity``, raw sockets, the same parse."""
    sem = threading.Semaphore(capacity)
    request = request_bytes(lc.Client(server.path), slot)

    def one(queued):
        if queued is not None:
            queued()  # just before it blocks: the floor has no event to say it waits
        with sem:
            return floor_stream(server.path, request)[0]

    return Crew(n, one, n, per_thread), lambda: None


def fig_scaling(cfg):
    """Per-request wall and CPU time with ``w`` requests waiting on one client, for each ``w`` of
    ``cfg.crews``, as ratios to the smallest in the same pass; passes alternate the order of the sizes
    (ABBA).  The floor crew (semaphore, raw sockets) is measured beside it at both ends, for scale."""
    sizes = cfg.crews
    small, big = sizes[0], sizes[-1]
    figures = []
    for label, capacity, slot in (("one slot", 1, 0), ("pool of 8", 8, None)):
        server = ServerProcess(_instant_server, short_response(), capacity)
        # (kind, waiting) -> one row per pass: µs (wall, CPU) entering per thread, then per request the
        # first generation and steady, then µs per thread to start the threads
        per = {}
        aheads = {}
        problems = []
        try:
            for p in range(2 * cfg.crew_pairs):
                for waiting in sizes if p % 2 == 0 else sizes[::-1]:
                    kinds = ("lc", "floor") if waiting in (small, big) else ("lc",)
                    for kind in kinds if p % 2 == 0 else kinds[::-1]:
                        n = waiting + capacity
                        per_thread = 2 + max(1, cfg.crew_requests // n)
                        heard = aheads.setdefault(waiting, []) if kind == "lc" else []
                        make = crew_lc if kind == "lc" else crew_floor
                        crew, close = make(server, n, slot, capacity, per_thread, heard)
                        try:
                            times = crew.round(server)
                        finally:
                            crew.close()
                            close()
                        row = [1e6 * x / n for x in times[:4]] + [1e6 * x / crew.steady for x in times[4:]]
                        per.setdefault((kind, waiting), []).append(row + [1e6 * crew.spawn])
                        problems += ["%s %s, %d waiting: %s" % (kind, label, waiting, t) for t in crew.problems[:2]]
        finally:
            server.close()

        def med(kind, waiting, i):
            return statistics.median(x[i] for x in per[(kind, waiting)])

        def ratio(kind, waiting, i):
            return statistics.median(b[i] / a[i] for a, b in zip(per[(kind, small)], per[(kind, waiting)]))

        for metric, i in (("wall", 4), ("CPU", 5)):
            ratios = [b[i] / a[i] for a, b in zip(per[("lc", small)], per[("lc", big)])]
            note = (
                "steady µs per request %s; ratio at %s; the floor crew %.0f -> %.0f µs (%.2fx).  First generation "
                "(all entered at once) µs per request %s, %.2fx; the floor's %.2fx.  Entering µs per thread %s"
                % (
                    ", ".join("%d: %.0f" % (w, med("lc", w, i)) for w in sizes),
                    ", ".join("%d: %.2fx" % (w, ratio("lc", w, i)) for w in sizes[1:-1]),
                    med("floor", small, i),
                    med("floor", big, i),
                    ratio("floor", big, i),
                    ", ".join("%d: %.0f" % (w, med("lc", w, i - 2)) for w in sizes),
                    ratio("lc", big, i - 2),
                    ratio("floor", big, i - 2),
                    ", ".join("%d: %.0f" % (w, med("lc", w, i - 4)) for w in sizes),
                )
            )
            if i == 4:
                note += "; thread start (not timed) µs per thread %s; median Queued.ahead heard %s" % (
                    ", ".join("%d: %.0f" % (w, med("lc", w, 6)) for w in sizes),
                    ", ".join("%d: %d" % (w, statistics.median(aheads[w])) for w in sizes),
                )
            if problems:
                note += "; PROBLEMS: " + "; ".join(problems[:4])
            figures.append(
                Figure(
                    6,
                    "queue scaling, %s: %s per request, %d waiting vs %d" % (label, metric, big, small),
                    "µs",
                    "%.0f µs" % med("lc", big, i),
                    "%.0f µs" % med("lc", small, i),
                    ratios,
                    "<= 1.5x",
                    statistics.median(ratios) <= 1.5 and not problems,
                    note,
                    versus="%d waiting" % small,
                )
            )
    return figures


# -----------------------------------------------------------------------------------------------------
# 8. Single-shot calls against a real llama-server (--single-shot)
# -----------------------------------------------------------------------------------------------------

#: httpx, pinned, lives in a virtual environment of the benchmark's own (``--setup-httpx`` makes it); the
#: figure runs without it and says so.
HTTPX_VERSION = "0.28.1"
BENCH_VENV = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loopclient", "benchvenv")

TOKENIZE_TEXT = "The sea is a vast, restless expanse of salt water that covers most of the planet."


def setup_httpx():
    """Create the benchmark's venv and install the pinned httpx into it (the only thing it holds)."""
    if not os.path.exists(os.path.join(BENCH_VENV, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", BENCH_VENV], check=True)
    subprocess.run(
        [
            os.path.join(BENCH_VENV, "bin", "python"),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            "httpx==" + HTTPX_VERSION,
        ],
        check=True,
    )


def import_httpx():
    """httpx from the benchmark's venv (the site-packages of this interpreter's version), else from this
    interpreter's own path; None when neither has it."""
    site = os.path.join(BENCH_VENV, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")
    if os.path.isdir(site) and site not in sys.path:
        sys.path.append(site)
    try:
        import httpx
    except ImportError:
        return None
    return httpx


class _Connects:
    """Counts connect() calls on every socket of this process (http.client, httpx and loopclient all
    connect through ``socket.socket.connect``): connections opened per run, on either transport; and keeps
    the local port of each TCP one, so that the TIME-WAIT sockets a run left can be told from older ones."""

    count = 0
    ports = set()
    _orig = None

    @classmethod
    def install(cls):
        if cls._orig is None:
            orig = cls._orig = socket.socket.connect

            def connect(sock, address):
                cls.count += 1
                orig(sock, address)
                if sock.family != socket.AF_UNIX:
                    cls.ports.add(sock.getsockname()[1])

            socket.socket.connect = connect

    @classmethod
    def uninstall(cls):
        if cls._orig is not None:
            socket.socket.connect = cls._orig
            cls._orig = None


def time_wait(port):
    """The TCP sockets of this network namespace in TIME-WAIT with ``port`` at one end, as a set of
    (local, remote) address pairs, read from /proc/net/tcp{,6} (state 06)."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != "06":
                continue
            local, remote = fields[1], fields[2]
            if int(local.rsplit(":", 1)[1], 16) == port or int(remote.rsplit(":", 1)[1], 16) == port:
                found.add((local, remote))
    return found


def _tw_split(entries, port, ours):
    """(client side, server side) of the TIME-WAIT sockets of the connections whose client port is in
    ``ours``: a TIME-WAIT socket is the client's when its remote port is the server's (the client closed
    first), the server's when its local port is (the server closed first).  Counting by the run's own
    ports, not by what is new since the run began: TIME-WAIT lasts 60 s, and on loopback (tcp_tw_reuse=2)
    a new connection may take over the port of an old one in TIME-WAIT."""
    client = server = 0
    for local, remote in entries:
        lport, rport = int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)
        if rport == port and lport in ours:
            client += 1
        elif lport == port and rport in ours:
            server += 1
    return client, server


def _unix_http_connection(path, timeout):
    import http.client

    class UnixHTTPConnection(http.client.HTTPConnection):
        def connect(self):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(path)
            except BaseException:
                sock.close()
                raise
            self.sock = sock

    return UnixHTTPConnection("localhost", timeout=timeout)


def _hc_connection(transport, target):
    import http.client

    if transport == "unix":
        return _unix_http_connection(target, 30)
    host, port = target
    return http.client.HTTPConnection(host, port, timeout=30)


def _tokenize_body(text):
    """The body loopclient's tokenize() sends (its defaults), so every contender does the same work."""
    return {"content": text, "add_special": False, "parse_special": True, "with_pieces": False}


_HC_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


def _hc_call(conn, text):
    conn.request("POST", "/tokenize", json.dumps(_tokenize_body(text)).encode(), _HC_HEADERS)
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError("POST /tokenize answered %d: %r" % (response.status, data[:200]))
    return json.loads(data)["tokens"]


#: How often the floor's persistent connection was found closed by the server when reused (llama-server
#: closes a connection idle for 5 s, the Keep-Alive timeout it advertises): it then reconnects and sends again.
STALE = {"count": 0}


def single_shot_contenders(transport, target, url, httpx):
    """[(name, call, close)] for one transport: ``call(text)`` returns the token ids.  The first is the
    floor: http.client on one persistent connection.  http.client reconnects by itself when the server
    said it closes (llama-server does after 100 requests on a connection: ``Keep-Alive: max=100``), but
    not when the server closed an idle connection (after 5 s, while the other contenders ran): then the
    send fails or no answer comes, and the floor does what its users must, reconnects and sends again."""
    import http.client

    out = []
    persistent = _hc_connection(transport, target)

    def floor(text):
        try:
            return _hc_call(persistent, text)
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            STALE["count"] += 1
            persistent.close()
            return _hc_call(persistent, text)

    out.append(("http.client, one persistent connection (floor)", floor, persistent.close))

    def fresh(text):
        conn = _hc_connection(transport, target)
        try:
            return _hc_call(conn, text)
        finally:
            conn.close()

    out.append(("http.client, a new connection per call", fresh, lambda: None))
    if httpx is None:
        out.append(("httpx not installed (dev/bench.py --setup-httpx)", None, None))
    else:
        if transport == "unix":
            hx = httpx.Client(transport=httpx.HTTPTransport(uds=target), base_url="http://localhost", trust_env=False)
        else:
            hx = httpx.Client(base_url=url, trust_env=False)

        def hx_call(text):
            response = hx.post("/tokenize", json=_tokenize_body(text))
            if response.status_code != 200:
                raise RuntimeError("httpx: POST /tokenize answered %d" % response.status_code)
            return response.json()["tokens"]

        out.append(("httpx %s, httpx.Client pool" % httpx.__version__, hx_call, hx.close))
    address = target if transport == "unix" else url
    try:
        lc.Limits(keep_alive=0)
    except TypeError:  # this loopclient has no keep-alive: it opens a connection per call
        client = lc.Client(address)
        out.append(("loopclient (a connection per call: no Limits.keep_alive)", client.tokenize, client.close))
    else:
        client0 = lc.Client(address, limits=lc.Limits(keep_alive=0))
        out.append(("loopclient, Limits(keep_alive=0)", client0.tokenize, client0.close))
        client = lc.Client(address)
        out.append(
            ("loopclient, default Limits (keep_alive=%r)" % (client.limits.keep_alive,), client.tokenize, client.close)
        )
    return out


def fig_single_shot(cfg, transport, target, url, httpx):
    """Calls per second of ``tokenize(text)`` in a loop, each contender's one client object reused, the
    contenders interleaved in rounds (A B C ..., then reversed: ... C B A, so drift hits each alike); the
    ratio of each to the floor in the same round; over TCP the TIME-WAIT sockets each run left."""
    n = cfg.calls
    port = target[1] if transport == "tcp" else None
    contenders = single_shot_contenders(transport, target, url, httpx)
    live = [c for c in contenders if c[1] is not None]
    rates = {c[0]: [] for c in live}
    connects = {c[0]: [] for c in live}
    waits = {c[0]: [] for c in live}  # (client side, server side) per run
    expected = None
    _Connects.install()
    try:
        for name, call, _ in live:  # warm: connections, pools, imports, the server's cache
            for _ in range(20):
                got = call(TOKENIZE_TEXT)
            if expected is None:
                expected = got
            elif got != expected:
                raise AssertionError("%s answered %r, the floor %r" % (name, got[:8], expected[:8]))
        for r in range(cfg.pairs):
            for name, call, _ in live if r % 2 == 0 else live[::-1]:
                collect()
                _Connects.ports = set()
                c0 = _Connects.count
                t0 = time.perf_counter()
                for _ in range(n):
                    call(TOKENIZE_TEXT)
                dt = time.perf_counter() - t0
                connects[name].append(_Connects.count - c0)
                rates[name].append(n / dt)
                if port:
                    waits[name].append(_tw_split(time_wait(port), port, _Connects.ports))
    finally:
        _Connects.uninstall()
        for _, call, close in live:
            close()
    floor_name = live[0][0]
    rows = []
    for name, call, _ in contenders:
        if call is None:
            rows.append((name, None, None, None, None))
            continue
        ratios = [x / y for x, y in zip(rates[name], rates[floor_name])]
        tw = None
        if port:
            tw = (
                statistics.median(w[0] for w in waits[name]),
                statistics.median(w[1] for w in waits[name]),
                max(sum(w) for w in waits[name]),
            )
        rows.append((name, statistics.median(rates[name]), ratios, statistics.median(connects[name]), tw))
    return rows


def print_single_shot(cfg, transport, where, rows):
    port_note = ", TIME-WAIT sockets left per run (client side / server side)" if transport == "tcp" else ""
    print(
        "\n[8] single-shot: client.tokenize(%d chars) x %d calls over %s (%s), %d rounds%s"
        % (
            len(TOKENIZE_TEXT),
            cfg.calls,
            "a Unix socket" if transport == "unix" else "TCP",
            where,
            cfg.pairs,
            port_note,
        )
    )
    print("    the floor found its idle connection closed by the server %d times (and sent again)" % STALE["count"])
    print(
        "| contender | calls/s (median) | ratio to floor, median (min..max) | connections per run | TIME-WAIT after a run |"
    )
    print("|---|---|---|---|---|")
    for name, rate, ratios, conns, tw in rows:
        if rate is None:
            print("| %s | - | - | - | - |" % name)
            continue
        tw_text = "-" if tw is None else "%d (%d / %d; worst %d)" % (tw[0] + tw[1], tw[0], tw[1], tw[2])
        print(
            "| %s | %s | %.3f (%.2f..%.2f) | %d | %s |"
            % (name, fmt_rate(rate, "calls/s"), statistics.median(ratios), min(ratios), max(ratios), conns, tw_text)
        )
    sys.stdout.flush()


def single_shot_figures(cfg, transport, rows):
    """Figure lines for the loopclient rows: at least as fast as the floor, and over TCP at most a few
    (5) sockets left in TIME-WAIT by a run."""
    figures = []
    floor_rate = rows[0][1]
    for name, rate, ratios, conns, tw in rows:
        if rate is None or not name.startswith("loopclient"):
            continue
        passed = statistics.median(ratios) >= 1.0
        note = "%d connections per %d calls" % (conns, cfg.calls)
        target = ">= 1.00x"
        if tw is not None:
            note += "; TIME-WAIT after a run: %d client side, %d server side (worst run %d in all)" % tw
            passed = passed and tw[2] <= 5
            target += ", <= 5 TIME-WAIT"
        figures.append(
            Figure(
                8,
                "single-shot tokenize, %s: %s" % ("Unix socket" if transport == "unix" else "TCP", name),
                "calls/s",
                fmt_rate(rate, "calls/s"),
                fmt_rate(floor_rate, "calls/s"),
                ratios,
                target,
                passed,
                note,
            )
        )
    return figures


def run_single_shot(cfg, args):
    if not args.socket and not args.url:
        raise SystemExit(
            "--single-shot needs a real llama-server: --socket PATH and/or --url http://127.0.0.1:PORT "
            "(dev/llama-server.sh start / start-tcp PORT)"
        )
    httpx = import_httpx()
    print(
        "httpx: %s"
        % (
            "%s from %s" % (httpx.__version__, os.path.dirname(httpx.__file__))
            if httpx
            else "not installed (python3 dev/bench.py --setup-httpx installs httpx==%s into %s)"
            % (HTTPX_VERSION, BENCH_VENV)
        )
    )
    figures = []
    for transport, where in (("unix", args.socket), ("tcp", args.url)):
        if not where:
            continue
        if transport == "unix":
            target = where
            url = None
        else:
            addr = lc.parse_address(where)
            if addr.unix or addr.tls or addr.prefix:
                raise SystemExit("--url must be http://host:port")
            target, url = addr.target, where
        t0 = time.perf_counter()
        STALE["count"] = 0
        rows = fig_single_shot(cfg, transport, target, url, httpx)
        print_single_shot(cfg, transport, where, rows)
        print("    (%.1f s)" % (time.perf_counter() - t0))
        figures += single_shot_figures(cfg, transport, rows)
    return figures


# -----------------------------------------------------------------------------------------------------
# Profile
# -----------------------------------------------------------------------------------------------------


def profile(cfg):
    import cProfile
    import pstats

    server = ServerProcess(_stream_sender, cfg.events)
    try:
        lc_stream(server.path)
        prof = cProfile.Profile()
        prof.enable()
        n, _ = lc_stream(server.path)
        prof.disable()
        print("cProfile of loopclient reading %d events (cProfile inflates per-call costs):" % n)
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    finally:
        server.close()


class _FakeSock:
    """A socket that answers ``response`` to its first recv() and then EOF, and does no I/O: what a request
    costs in Python alone, with the transport taken out."""

    response = b""
    family = socket.AF_UNIX  # the requests measured go to a socket path

    def __init__(self, *args):
        self._left = _FakeSock.response

    def settimeout(self, timeout):
        pass

    def setsockopt(self, *args):
        pass

    def connect(self, address):
        pass

    def sendall(self, data):
        pass

    def recv(self, size):
        data, self._left = self._left, b""
        return data

    def shutdown(self, how):
        pass

    def close(self):
        pass


def _fake_socket_module():
    """Stands in for the ``socket`` module inside loopclient and this script while the Python-only costs are
    measured; everything but ``socket()`` is the real module's."""
    import types

    module = types.ModuleType("socket")
    module.__dict__.update(vars(socket))
    module.socket = _FakeSock
    return module


def _best_us(fn, n, repeat=7):
    """The fastest of ``repeat`` runs of ``fn()`` ``n`` times, in µs per call (the least noisy estimate of
    what the code itself costs on a shared machine)."""
    best = None
    for _ in range(repeat):
        collect()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = (time.perf_counter() - t0) / n * 1e6
        best = dt if best is None else min(best, dt)
    return best


class _NoIO:
    """While active: loopclient and this script see the no-I/O socket (``_FakeSock`` answering ``response``)."""

    def __init__(self, response):
        self.response = response

    def __enter__(self):
        global socket
        _FakeSock.response = self.response
        fake = _fake_socket_module()
        self.real = socket
        lc.socket = socket = fake

    def __exit__(self, *exc):
        global socket
        lc.socket = socket = self.real


class _StubPump:
    """Stands in for ``ResponsePump``: hands over ``events`` and ``ready``'s outcome at the first read, so
    that what a request costs around its parsing can be measured alone."""

    ready = None
    events = []

    def __init__(self, limits, raw_chunks=False, dialect=None):
        self.head = None
        self.failed = self.cap_due = self.outcome = None
        self.progressed = self.delivered = self.streaming = False
        self.received = self.boundary = 0

    def feed(self, data):
        ready = self.ready
        self.head = ready.head
        self.outcome = ready.outcome
        self.received, self.boundary = ready.received, ready.boundary
        self.progressed = self.delivered = True
        return list(self.events)

    def feed_eof(self):
        return []

    def verdict(self):  # as ResponsePump.verdict: what the plan does next, once the events are handed out
        return self.failed or self.outcome


class _Stubbed:
    def __enter__(self):
        self.pump = lc.ResponsePump
        lc.ResponsePump = _StubPump

    def __exit__(self, *exc):
        lc.ResponsePump = self.pump


class _Both:
    def __init__(self, *managers):
        self.managers = managers

    def __enter__(self):
        for m in self.managers:
            m.__enter__()

    def __exit__(self, *exc):
        for m in reversed(self.managers):
            m.__exit__(*exc)


def _line(fn):
    return fn.__code__.co_firstlineno


def request_cost_items(path):
    """[(name, where in loopclient.py, fn, weight, context)]: the pieces of figure 4's request, each run
    alone; ``fn()`` costs ``weight`` times one request's share.  ``path`` is a socket path (no I/O is done:
    the whole-request items run on a fake socket)."""
    response = short_response()
    client = lc.Client(path)
    board = client._board
    calls = client._calls
    limits = client.limits
    request = request_bytes(client, 0)
    noio = _NoIO(response)

    def lc_request():
        for _ in client.stream(MSGS, slot=0):
            pass

    def floor_request():
        floor_stream(path, request)

    ready = lc.ResponsePump(limits)
    _StubPump.events = ready.feed(response)
    _StubPump.ready = ready
    body = {"messages": MSGS, "stream": True, "stream_options": {"include_usage": True}, "id_slot": 0}
    payload = json.dumps(body, allow_nan=False).encode("utf-8")
    headers = [("Accept", "text/event-stream"), ("Content-Type", "application/json"), ("Connection", "close")]
    headers += calls._headers
    run = lc._SyncRun(board)
    streams = streams_of(client)
    stream_req = chat_stream_request(streams, 0)
    head_block = response[: response.index(b"\r\n\r\n") + 1]  # as ResponseReader hands it: the last CR kept
    chunked = response[response.index(b"\r\n\r\n") + 4 :]
    body_bytes = b"".join(lc.ResponseReader().feed(response))
    payloads = [p for _, p in lc.SSEDecoder(limits.max_line).feed(body_bytes) if p != "[DONE]"]
    finished = lc.Assembler()
    for p in payloads:
        finished.feed(p)
    addr = calls.addr

    def gate():
        board.gate.leave(board.gate.enter((None, 0), 1))

    def add_discard():
        board.add(run)
        board.discard(run)

    def assemble():
        asm = lc.Assembler()
        for p in payloads:
            asm.feed(p)
        asm.completion()

    def floor_loads():
        for p in payloads:
            json.loads(p)

    def conn():
        made = lc._Conn(run)
        made.open(addr, 1.0, None)
        made.close()

    def fake_sock():
        _FakeSock().close()

    cs = lc.Stream
    building = getattr(type(streams), "stream_request", None) or lc._Calls.chat_request  # an older checkout's name
    # the request's life: _Streams.stream and _StreamLife, or an older checkout's _Calls.stream with _attempt
    life = [getattr(type(streams), "stream_plan", None) or type(streams).stream] + [
        f
        for f in (getattr(getattr(lc, "_StreamLife", None), "run_all", None), getattr(lc._Calls, "_attempt", None))
        if f
    ]
    return [
        ("TOTAL loopclient: figure 4's request, no I/O", "", lc_request, 1, noio),
        ("TOTAL floor: the same bytes, no I/O", "", floor_request, 1, noio),
        (
            "the request's life around the parsing: the plan's generators and the driver's step, __next__ and "
            "its lock, the socket object, clocks, cleanup (a stub pump hands over the events)",
            "Stream.__next__ (l. %d), _SyncRun.step (l. %d), %s (l. %s)"
            % (
                _line(cs.__next__),
                _line(lc._SyncRun.step),
                " / ".join(f.__qualname__ for f in life),
                ", ".join(str(_line(f)) for f in life),
            ),
            lc_request,
            1,
            _Both(noio, _Stubbed()),
        ),
        (
            "  of which _Conn() + close() (Lock, timeout), beyond the socket's own calls",
            "_Conn.__init__, open (l. %d)" % _line(lc._Conn.__init__),
            conn,
            1,
            noio,
        ),
        ("  (the no-I/O socket's own calls, subtracted above)", "", fake_sock, -1, noio),
        (
            "  of which Stream() (a _SyncRun: its three locks, one the waker's bell; the plan's generator)",
            "Stream.__init__ (l. %d), _SyncRun.__init__ (l. %d)" % (_line(cs.__init__), _line(lc._SyncRun.__init__)),
            lambda: lc.Stream(board, stream_req),
            1,
            None,
        ),
        (
            "  of which gate enter + leave, uncontended",
            "_Gate.enter / leave (l. %d, %d)" % (_line(lc._Gate.enter), _line(lc._Gate.leave)),
            gate,
            1,
            None,
        ),
        ("  of which board add + discard", "_Board.add / discard (l. %d)" % _line(lc._Board.add), add_discard, 1, None),
        (
            "  of which _Waits()",
            "_Waits.__init__ (l. %d)" % _line(lc._Waits.__init__),
            lambda: lc._Waits(limits, 0, addr.text),
            1,
            None,
        ),
        (
            "  of which stream(): body, checks, routing, json.dumps, encode_request",
            "%s (l. %d)" % (building.__qualname__, _line(building)),
            lambda: chat_stream_request(streams, 0),
            1,
            None,
        ),
        (
            "    of which json.dumps(body)",
            "_Calls._encode (l. %d)" % _line(lc._Calls._encode),
            # what _Calls._encode calls (an older checkout has no _dumps: json.dumps, as it did)
            lambda: getattr(lc, "_dumps", functools.partial(json.dumps, allow_nan=False))(body).encode("utf-8"),
            1,
            None,
        ),
        (
            "    of which encode_request (header checks, join)",
            "encode_request (l. %d)" % _line(lc.encode_request),
            lambda: lc.encode_request("POST", "/v1/chat/completions", "localhost", headers, payload),
            1,
            None,
        ),
        (
            "ResponsePump() + feed(the whole response): head, chunks, SSE, 8 payloads, Completion",
            "ResponsePump.feed (l. %d)" % _line(lc.ResponsePump.feed),
            lambda: lc.ResponsePump(limits).feed(response),
            1,
            None,
        ),
        (
            "  of which ResponsePump() alone",
            "ResponsePump.__init__ (l. %d)" % _line(lc.ResponsePump.__init__),
            lambda: lc.ResponsePump(limits),
            1,
            None,
        ),
        (
            "  of which ResponseReader: head + de-chunk",
            "ResponseReader.feed (l. %d)" % _line(lc.ResponseReader.feed),
            lambda: lc.ResponseReader().feed(response),
            1,
            None,
        ),
        (
            "    of which _parse_head (%d header lines)" % head_block.count(b"\n"),
            "_parse_head (l. %d)" % _line(lc._parse_head),
            lambda: lc._parse_head(head_block, lc.MAX_HEADERS),
            1,
            None,
        ),
        (
            "    of which ChunkedDecoder.feed (%d chunks)" % (chunked.count(b"\r\n") // 2),
            "ChunkedDecoder._feed (l. %d)" % _line(lc.ChunkedDecoder._feed),
            lambda: lc.ChunkedDecoder().feed(chunked),
            1,
            None,
        ),
        (
            "  of which SSEDecoder.feed",
            "SSEDecoder._lines (l. %d)" % _line(lc.SSEDecoder._lines),
            lambda: lc.SSEDecoder(limits.max_line).feed(body_bytes),
            1,
            None,
        ),
        (
            "  of which Assembler: %d payloads + completion()" % len(payloads),
            "Assembler.feed (l. %d)" % _line(lc.Assembler.feed),
            assemble,
            1,
            None,
        ),
        (
            "    of which completion() (Choice, Completion)",
            "Assembler.completion (l. %d)" % _line(lc.Assembler.completion),
            finished.completion,
            1,
            None,
        ),
        ("(the floor's json.loads of the same %d payloads)" % len(payloads), "", floor_loads, 1, None),
    ]


def _syscall_items(n):
    """The transport's extra system calls, timed (they cost the kernel, which an instruction count of the
    process misses): a timeout on the socket is an ioctl(FIONBIO) per settimeout() and a poll() before each
    recv and send."""
    a, b = socket.socketpair()
    try:

        def settimeout():
            a.settimeout(1.0)
            a.settimeout(2.0)

        def ping():
            b.send(b"x")
            a.recv(16)

        ioctl = _best_us(settimeout, n) / 2 * 3
        a.settimeout(None)
        blocking = _best_us(ping, n)
        a.settimeout(5.0)
        timed = _best_us(ping, n)
    finally:
        a.close()
        b.close()
    return [
        (
            "settimeout() x 3 (an ioctl each: at connect, then liveness for the send, poll for the reads)",
            "_Conn.__init__ / sendall / recv (l. %d)" % _line(lc._Conn.__init__),
            ioctl,
        ),
        (
            "poll() before the send and the recv (a socket with a timeout)",
            "_Conn.sendall / recv",
            2 * (timed - blocking),
        ),
    ]


_INSTR_CHILD = "--child-instructions"
_MARK = os.getppid  # a C function called nowhere else: callgrind dumps its counts before each call


def child_instructions(path, k):
    """Runs under callgrind (--dump-before=os_getppid*): each item ``k`` times between two marks."""
    items = request_cost_items(path)
    for _name, _where, fn, _weight, ctx in items:  # warm: imports, caches, first-call paths
        with ctx or _Both():
            for _ in range(20):
                fn()
    _MARK()
    for _name, _where, fn, _weight, ctx in items:
        with ctx or _Both():
            _MARK()
            for _ in range(k):
                fn()
            _MARK()
    _MARK()


def _instructions(k):
    """{index: instructions per call} of ``request_cost_items``, counted by callgrind; None without valgrind."""
    if not shutil.which("valgrind"):
        return None
    out = tempfile.mkdtemp(prefix="lcb-cg", dir="/tmp")
    try:
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--dump-before=os_getppid*",
                "--callgrind-out-file=" + os.path.join(out, "cg.out"),
                os.path.realpath(sys.executable),
                os.path.abspath(__file__),
                _INSTR_CHILD,
                "/tmp/lcb-none.sock",
                str(k),
                "--root=" + LC_ROOT,  # the checkout measured, as figure 3's child is told
            ],
            check=True,
            capture_output=True,
            timeout=1800,
        )
        numbered = []  # the dumps before each mark, in order (the one at exit has no number: not used)
        for name in os.listdir(out):
            suffix = name.rsplit(".", 1)[1]
            if not suffix.isdigit():
                continue
            with open(os.path.join(out, name)) as f:
                totals = [line for line in f.read().splitlines() if line.startswith(("summary:", "totals:"))]
            numbered.append((int(suffix), int(totals[0].split()[1]) if totals else 0))
        counts = [c for _, c in sorted(numbered)]
        # dump 1 runs to the first mark (imports, warm-up), dump 2 to the first item's opening mark; then
        # each item inside its marks, and what lies between two items: every second dump from the third
        inside = counts[2::2]
        return {i: c / k for i, c in enumerate(inside)}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def profile_requests(cfg, instructions=False):
    """Figure 4's request cost, item by item: timed (best of 7 runs of each item alone), and with
    ``instructions`` counted by callgrind (noise-free); then the whole request beside the floor, real
    sockets; then a cProfile of it."""
    import cProfile
    import pstats

    n = max(500, cfg.requests)
    server = ServerProcess(_instant_server, short_response())
    try:
        items = request_cost_items(server.path)
        times = []
        for _name, _where, fn, _weight, ctx in items:
            with ctx or _Both():
                times.append(_best_us(fn, n))
        syscalls = _syscall_items(n * 5)
        client = lc.Client(server.path)
        request = request_bytes(client, 0)

        def lc_request():
            for _ in client.stream(MSGS, slot=0):
                pass

        real = alternate(
            lambda: _best_us(lc_request, n // 5, 3),
            lambda: _best_us(lambda: floor_stream(server.path, request), n // 5, 3),
            3,
        )
        counts = _instructions(200) if instructions else None
        print(
            "Figure 4's request (5 content events, 8 payloads), per request; times are the best of 7 runs on a "
            "shared machine (compare them, do not quote one alone)%s"
            % ("; instructions counted by callgrind in the client process" if counts else "")
        )
        lc_real, floor_real = min(a for a, _ in real), min(b for _, b in real)
        print(
            "  with real sockets (figure 4's server): loopclient %.1f µs, floor %.1f µs: ratio %.2f, gap %.1f µs"
            % (lc_real, floor_real, floor_real / lc_real, lc_real - floor_real)
        )
        print()
        print("| cost item | µs per request | instructions | where in loopclient.py |")
        print("|---|---|---|---|")
        for i, (name, where, _fn, weight, _ctx) in enumerate(items):
            if weight < 0:
                continue
            us = times[i]
            ins = counts.get(i) if counts else None
            if i + 1 < len(items) and items[i + 1][3] < 0:  # less what the next (subtracted) item costs
                us -= times[i + 1]
                ins = None if ins is None or counts.get(i + 1) is None else ins - counts[i + 1]
            print("| %s | %.2f | %s | %s |" % (name, us, "-" if ins is None else "{:,.0f}".format(ins), where))
        for name, where, us in syscalls:
            print("| %s | %.2f | (kernel) | %s |" % (name, us, where))
        sys.stdout.flush()
        for _ in range(20):
            lc_request()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(cfg.requests):
            lc_request()
        prof.disable()
        print("\ncProfile of %d figure-4 requests (cProfile inflates per-call costs):" % cfg.requests)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    finally:
        server.close()


# -----------------------------------------------------------------------------------------------------
# Main
# -----------------------------------------------------------------------------------------------------


def futex_hash(slots):
    """Size this process's private futex hash (prctl PR_FUTEX_HASH, Linux 6.16+); says what happened.

    Every futex wake walks one bucket's chain; the kernel gives a threaded process 4 buckets per CPU (at
    least 16), so on a small machine thousands of sleeping threads make each wake walk hundreds of
    entries.  That is the kernel's cost, paid by any thread-per-waiter queue (the floor crew too)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(78, 1, slots, 0, 0) != 0:  # PR_FUTEX_HASH, PR_FUTEX_HASH_SET_SLOTS
        return "futex hash not set (%s)" % os.strerror(ctypes.get_errno())
    return "futex hash %d buckets" % libc.prctl(78, 2, 0, 0, 0)  # PR_FUTEX_HASH_GET_SLOTS


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, a smoke check")
    parser.add_argument(
        "--only", type=int, choices=(1, 2, 3, 4, 5, 6, 7, 9), metavar="N", help="run figure N only (8: --single-shot)"
    )
    parser.add_argument("--pairs", type=int, help="pairs per figure, rounds for figure 8 (default 5; 2 with --quick)")
    parser.add_argument(
        "--profile",
        nargs="?",
        type=int,
        const=1,
        choices=(1, 4),
        metavar="N",
        help="cProfile figure 1's loopclient side (N=1, the default), or figure 4's request cost by item "
        "beside the floor, then a cProfile (N=4); then exit",
    )
    parser.add_argument("--async", dest="async_stream", action="store_true", help="figure 7 (AsyncClient) only")
    parser.add_argument(
        "--native", action="store_true", help="figure 9 only: the native /completion stream, both clients"
    )
    parser.add_argument(
        "--futex-hash",
        type=int,
        metavar="SLOTS",
        help="Linux 6.16+: give this process a private futex hash of SLOTS buckets (by default 4 per CPU, at "
        "least 16), to see how much of figure 6 is the kernel walking long futex chains",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="with --profile 4: also count each item's instructions under valgrind's callgrind (noise-free; slow)",
    )
    parser.add_argument(
        "--single-shot",
        action="store_true",
        help="figure 8 only: tokenize() calls per second against a REAL llama-server (give --socket and/or --url)",
    )
    parser.add_argument(
        "--root",
        metavar="DIR",
        help="measure DIR/loopclient.py (another checkout, e.g. the last round's) with this script's figures",
    )
    parser.add_argument("--calls", type=int, default=1500, metavar="N", help="figure 8: calls per run (default 1500)")
    parser.add_argument("--socket", metavar="PATH", help="figure 8: the real server's Unix socket")
    parser.add_argument("--url", metavar="URL", help="figure 8: the real server over TCP, http://127.0.0.1:PORT")
    parser.add_argument(
        "--setup-httpx",
        action="store_true",
        help="install httpx==%s (figure 8's pooled contender) into %s, then exit" % (HTTPX_VERSION, BENCH_VENV),
    )
    args = parser.parse_args(argv)
    if args.setup_httpx:
        setup_httpx()
        return 0
    cfg = argparse.Namespace(
        events=20_000 if args.quick else 200_000,
        pairs=args.pairs or (2 if args.quick else 5),
        import_pairs=10 if args.quick else 40,
        requests=300 if args.quick else 2_000,
        waiter_requests=600 if args.quick else 5_000,
        waiter_pairs=args.pairs or (2 if args.quick else 5),
        crews=(10, 100, 1_000) if args.quick else (10, 100, 1_000, 4_000),
        crew_requests=1_000 if args.quick else 4_000,
        crew_pairs=args.pairs or (1 if args.quick else 2),
        calls=args.calls,
    )
    if args.profile == 4:
        profile_requests(cfg, args.instructions)
        return 0
    if args.profile:
        profile(cfg)
        return 0
    print(
        "loopclient %s (%s), Python %s, %s, %d CPUs%s%s"
        % (
            lc.__version__,
            lc.__file__,
            sys.version.split()[0],
            os.path.realpath(sys.executable),
            os.cpu_count() or 0,
            ", --quick" if args.quick else "",
            ", " + futex_hash(args.futex_hash) if args.futex_hash else "",
        )
    )
    wanted = [args.only] if args.only else [1, 2, 3, 4, 5, 6]
    if args.async_stream or args.native:
        wanted = ([7] if args.async_stream else []) + ([9] if args.native else [])
    figures = []
    sender = None
    if args.single_shot:
        wanted = []
        figures = run_single_shot(cfg, args)
    try:
        for number in wanted:
            t0 = time.perf_counter()
            if number in (1, 3) and sender is None:
                sender = ServerProcess(_stream_sender, cfg.events)
            if number == 1:
                request = request_bytes(lc.Client(sender.path), 0)
                new = [fig_stream(cfg, sender, request, stream_text(cfg.events))]
            elif number == 2:
                new = fig_import(cfg)
            elif number == 3:
                new = [fig_memory(cfg, sender, stream_text(cfg.events))]
            elif number == 4:
                new = [fig_requests(cfg)]
            elif number == 7:
                new = [fig_async_stream(cfg)]
            elif number == 9:
                new = fig_native(cfg)
            elif number == 5:
                new = [fig_waiters(cfg)]
            else:
                new = fig_scaling(cfg)
            for fig in new:
                print(fig.line())
            print("    (%.1f s)" % (time.perf_counter() - t0))
            sys.stdout.flush()
            figures += new
    finally:
        if sender is not None:
            sender.close()
    print()
    print("| # | figure | loopclient | floor | ratio, median (min..max) | target | result |")
    print("|---|---|---|---|---|---|---|")
    for fig in figures:
        print(
            "| %d | %s | %s | %s | %.3f (%s) | %s | %s |"
            % (
                fig.number,
                fig.name,
                fig.lc_value,
                fig.floor_value,
                fig.median,
                fig.spread(),
                fig.target,
                "**FAIL**" if fig.verdict == "FAIL" else fig.verdict,
            )
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == _MEM_CHILD:
        child_mem(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 5 and sys.argv[1] == _INSTR_CHILD:
        child_instructions(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
