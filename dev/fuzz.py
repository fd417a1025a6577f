#!/usr/bin/env python3
"""Fuzz loopclient.py with mutated llama-server responses (standard library only, seeded, time-bounded).

    python3 dev/fuzz.py                   # 60 s, seed 1
    python3 dev/fuzz.py --seconds 600 --seed 7
    python3 dev/fuzz.py --long            # hours (4 h unless --seconds says otherwise)
    python3 dev/fuzz.py --inputs 5000 --seed 7 --target http    # exactly these inputs, one target
    python3 dev/fuzz.py --differential --inputs 2000 --seed 7   # Client and AsyncClient compared
    python3 dev/fuzz.py --replay dev/fuzz-crashes/<hash>.bin

The seeds' stream pieces and JSON answers and the servers' request reader are test_loopclient's (imported,
not copied).
Inputs are recorded llama-server responses (dev/testdata/transcripts, captured from a real server, and the
built-in seeds below), mutated by bit flips, byte sets, dictionary insertions, splices of two seeds,
truncations, repeated and dropped spans, and structural JSON edits, then cut at random points into the
pieces that successive reads return.  Targets:

    http       ResponseReader -> SSEDecoder -> Assembler, the parsing a streamed request does
    chunked    ChunkedDecoder alone
    sse        SSEDecoder alone
    assembler  Assembler fed mutated chunk payloads
    dialect    ResponseReader -> SSEDecoder -> the /completion, Responses, Messages, /v1/completions or
               /models/sse dialect, stopping where the dialect says its stream ended (or at [DONE] for
               /v1/completions; built-in seeds in the real shapes, and captures 40-66, 90-99)
    dialect_payloads  one of those dialects fed mutated payloads (structural edits with their own keys)
    client     the whole Client, chat() against a Unix socket server thread serving the mutated bytes
    differential  the client target's cases (the same inputs for the same seed) through Client and then
               AsyncClient (asyncio.run), against the same server: the events, the Completion, the error
               class and message must be alike but for timing (test_loopclient's differs_between_clients:
               Retrying's delay, seconds in a message within MARGIN, how many polls heard the same
               Waiting, one attempt more at a budget's end).  A difference runs again (DIFF_RERUNS): one
               that a rerun does not repeat is printed as TIMING, one that every rerun repeats is a
               violation.  Only run on its own (--differential), never in the mix

Rules, each breach a violation: only ``LoopError`` subclasses may escape; no input may take more than a
second (CPU time for the parsers, wall time for the client, whose budgets are a fraction of that); the
decoders' buffers stay under their caps after every feed; the tracemalloc peak of an input stays under a
bound linear in its caps and its size; events and completions hold the types the API documents; the
client leaves no thread or descriptor behind; a dialect's Completion holds exactly what its events
delivered (text per choice, reasoning, each call's id, name and arguments), with integer usage counts and
token ids.  A violating input is written to ``dev/fuzz-crashes/<hash>.bin`` (its raw bytes; ``<hash>.json`` says how to replay it) and printed.  A
fixed crash stays as a regression test: copy ``<hash>.bin`` as it is to ``dev/testdata/fuzz/`` and add a
row, with its part, to test_loopclient's fault table (FAULT_TABLE's "Inputs the fuzzer found": _d_fuzz),
which reads it with ``_f_input("<hash>", target)`` (a parser target's input fed to the
parser itself: a test of TestFaultFuzzRegressions).  Everything
an input does is decided by ``random.Random`` seeded from ``--seed`` and the input's number, so a run is
repeatable.  The last line reads ``fuzz: N inputs, V violations in T s (seed S)``; the exit code is 1 when
V is not 0.
"""

from __future__ import annotations

import argparse
import base64
import glob
import hashlib
import json
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
import tracemalloc
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import loopclient as lc  # noqa: E402
from test_loopclient import (  # noqa: E402
    STREAM_HEAD,
    _p_block_delta,
    _p_block_start,
    _p_dialect_http,
    _p_msg_end,
    _p_msg_start,
    _p_native,
    _p_native_stop,
    _p_resp,
    _p_resp_text_stream,
    _p_typed,
    chunk_json,
    chunked,
    differs_between_clients,
    json_response,
    read_request,
    sse,
)

CRASH_DIR = os.path.join(HERE, "fuzz-crashes")
TRANSCRIPTS = os.environ.get("LOOPCLIENT_TRANSCRIPTS") or os.path.join(HERE, "testdata", "transcripts")

#: Longest input the mutators build, and the longest a "big" input may be (one in BIG_EVERY).
MAX_INPUT = 256 * 1024
MAX_BIG_INPUT = 2 * 1024 * 1024
BIG_EVERY = 200
#: No input may take longer than this (seconds).
TIME_LIMIT = 1.0
#: An input still running after this long is interrupted and reported as a hang.
HANG_LIMIT = 10.0
#: One input in TRACE_EVERY runs under tracemalloc, which slows allocation-heavy parsing by up to this much.
TRACE_EVERY = 4
TRACE_SLOWDOWN = 20

# The client's budgets: small enough that any chain of them ends well inside TIME_LIMIT.
CLIENT_LIMITS = lc.Limits(
    poll=0.02,
    liveness=0.15,
    busy_wait=0.2,
    load_wait=0.2,
    idle_grace=0.1,
    max_line=64 * 1024,
    max_body=256 * 1024,
    queue_len=1,
    thinking_overrun=4,
)
CLIENT_LIMITS_CAPPED = CLIENT_LIMITS.replace(thinking_cap=2)

# =====================================================================================================
# Seeds
# =====================================================================================================

# The canned stream pieces (STREAM_HEAD, chunk_json, sse, chunked) are test_loopclient's.


def _chunk(delta=None, finish=None, extra=None, choices=True):
    return chunk_json(delta, finish, extra=extra, choices=choices)


def _chunked(*parts):
    """A whole chunked body: test_loopclient's chunks, then the last chunk."""
    return chunked(*parts) + b"0\r\n\r\n"


_TIMINGS = {"prompt_n": 29, "prompt_ms": 76.7, "predicted_n": 16, "predicted_ms": 192.7, "predicted_per_second": 77.8}
_USAGE = {"completion_tokens": 8, "prompt_tokens": 26, "total_tokens": 34}


def builtin_seeds():
    """(name, kind, bytes): kind "stream" (a chat response) or "json" (a single-shot response)."""
    role = _chunk({"role": "assistant", "content": None})
    words = [_chunk({"content": w}) for w in ("Hello", " wor", "ld", " \u00e9\u20ac")]
    finish = _chunk({}, "stop", {"timings": _TIMINGS})
    usage = _chunk(choices=False, extra={"usage": _USAGE, "timings": _TIMINGS})
    reasoning = [_chunk({"reasoning_content": w}) for w in ("is", " the", " sky")]
    tools = [
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "{"},
                    }
                ]
            }
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"city": '}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_2", "function": {"name": "f", "arguments": "{}"}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        _chunk({}, "tool_calls"),
    ]
    error503 = json.dumps({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
    error500 = json.dumps({"error": {"code": 500, "message": "got exception", "type": "server_error"}})
    return [
        (
            "stream",
            "stream",
            STREAM_HEAD
            + _chunked(
                sse(role, words[0]), *[sse(w) for w in words[1:]], sse(finish) + sse(usage), b"data: [DONE]\n\n"
            ),
        ),
        (
            "reasoning",
            "stream",
            STREAM_HEAD + _chunked(sse(role), *[sse(r) for r in reasoning], sse(words[0], finish), b"data: [DONE]\n\n"),
        ),
        ("tools", "stream", STREAM_HEAD + _chunked(*[sse(t) for t in [role] + tools], b"data: [DONE]\n\n")),
        (
            "pings",
            "stream",
            STREAM_HEAD
            + _chunked(b": ping\n\n", b": ping\n\n", sse(words[0]), b":\r\n\r\n", sse(finish), b"data: [DONE]\n\n"),
        ),
        ("error-event-503", "stream", STREAM_HEAD + _chunked(sse(error503))),
        ("error-after-content", "stream", STREAM_HEAD + _chunked(sse(role, words[0]), sse(error500))),
        ("legacy-error", "stream", STREAM_HEAD + _chunked(b"error: " + error500.encode() + b"\n\n")),
        (
            "crlf-bom",
            "stream",
            STREAM_HEAD
            + _chunked(
                b"\xef\xbb\xbfdata: " + words[0].encode() + b"\r\n\r\n",
                b"event: message\rdata: " + finish.encode() + b"\r\r",
            ),
        ),
        (
            "http10",
            "stream",
            b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + sse(words[0], finish) + b"data: [DONE]\n\n",
        ),
        (
            "content-length",
            "stream",
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
            % (len(sse(words[0], finish)), sse(words[0], finish)),
        ),
        ("interim", "stream", b"HTTP/1.1 100 Continue\r\n\r\n" + STREAM_HEAD + _chunked(sse(words[0], finish))),
        (
            "503-retry-after",
            "stream",
            json_response(json.loads(error503), b"503 Service Unavailable", b"Retry-After: 0\r\n"),
        ),
        (
            "503-date",
            "stream",
            json_response(
                json.loads(error503), b"503 Service Unavailable", b"Retry-After: Wed, 21 Oct 2015 07:28:00 GMT\r\n"
            ),
        ),
        (
            "400",
            "stream",
            json_response(
                {
                    "error": {
                        "code": 400,
                        "message": "the request exceeds the available context size",
                        "type": "exceed_context_size_error",
                    }
                },
                b"400 Bad Request",
            ),
        ),
        (
            "trailers",
            "stream",
            STREAM_HEAD[:-2] + b"Trailer: X-T\r\n\r\n" + _chunked(sse(words[0], finish))[:-2] + b"X-T: 1\r\n\r\n",
        ),
        (
            "slots",
            "json",
            json_response(
                [{"id": 0, "n_ctx": 1024, "is_processing": False}, {"id": 1, "n_ctx": 1024, "is_processing": True}]
            ),
        ),
        ("slots-busy", "json", json_response([{"id": 0, "n_ctx": 1024, "is_processing": True}])),
        ("props", "json", json_response({"total_slots": 2, "build_info": "b0-unknown"})),
        ("control", "json", json_response({"success": True})),
        ("control-refused", "json", json_response({"success": False})),
    ]


def transcript_seeds():
    seeds = []
    for path in sorted(glob.glob(os.path.join(TRANSCRIPTS, "*.raw.txt"))):
        with open(path, "rb") as f:
            raw = f.read()
        marker = raw.find(b"<<< RESPONSE")
        if marker < 0:
            continue
        response = raw[raw.index(b"\n", marker) + 1 :]
        kind = "stream" if b"text/event-stream" in response[:2000] or b"/v1/chat/completions" in raw[:300] else "json"
        seeds.append((os.path.basename(path), kind, response))
        if kind == "stream":
            line = raw[raw.find(b"\n") + 1 :].split(b"\n", 1)[0].split()
            dialect = DIALECT_PATHS.get(line[1] if len(line) > 1 else b"")
            if dialect is not None:
                seeds.append((os.path.basename(path), "dialect:" + dialect, response))
    return seeds


#: The request path of a captured stream -> the dialect that reads it.
DIALECT_PATHS = {
    b"/completion": "native",
    b"/infill": "native",
    b"/v1/responses": "responses",
    b"/v1/messages": "messages",
    b"/v1/completions": "text",
    b"/models/sse": "models",
}
DIALECTS = {
    "native": lc._NativeAssembler,
    "responses": lc._ResponsesAssembler,
    "messages": lc._MessagesAssembler,
    "text": lc._TextAssembler,
    "models": lc._ModelEvents,
    "route": lc._RouteChunks,  # stream_route(): any route's data events as Chunks
}
#: The dialects whose stream ends at a [DONE] payload (the others end by their own ``done``, or never)
DONE_ENDS = (lc._TextAssembler, lc._RouteChunks)


def dialect_seeds():
    """(name, "dialect:<name>", bytes): streams of /completion, Responses and Messages in the real shapes."""
    native_one = [sse(_native(" the", [506])), sse(_native(" sea", [5442], predicted=2)), sse(_native_stop())]
    progress = {"total": 4, "cache": 0, "processed": 4, "time_ms": 12.5}
    native_two = [
        b"data: null\n\n",
        sse(_native("", [0], 1, 0, 5, extra={"prompt_progress": progress})),
        sse(
            _native(
                " the", [506], 0, extra={"completion_probabilities": [{"id": 506, "token": " the", "logprob": -0.5}]}
            )
        ),
        sse(_native(" one", [886], 1, evaluated=5)),
        sse(_native_stop(0, "eos")),
        sse(_native(" two", [1156], 1, 2, 5)),
        sse(_native_stop(1, "word")),
    ]
    native_error = [
        sse(_native("a", [1])),
        sse(json.dumps({"error": {"code": 500, "message": "m", "type": "server_error"}})),
    ]
    text, _ = _p_resp_text_stream([" the", " sea", "."], reasoning=["Let", " me"])
    call = {"id": "fc_1", "arguments": "", "call_id": "call_1", "name": "get_weather", "type": "function_call"}
    calls = [
        _p_resp("response.created", response={"id": "resp_1", "object": "response", "status": "in_progress"}),
        _p_resp("response.output_item.added", item=call),
        _p_resp("response.function_call_arguments.delta", delta='{"city":', item_id="fc_1"),
        _p_resp("response.function_call_arguments.delta", delta='"Paris"}', item_id="fc_1"),
        _p_resp("response.output_item.done", item=dict(call, arguments='{"city":"Paris"}')),
        _p_resp(
            "response.completed",
            response={
                "id": "resp_1",
                "status": "completed",
                "output": [call],
                "usage": {"input_tokens": 9, "output_tokens": 3},
            },
        ),
    ]
    incomplete, _ = _p_resp_text_stream(["a"], status="incomplete", incomplete="max_output_tokens")
    failed = text[:5] + [
        _p_resp("response.failed", response={"id": "resp_1", "error": {"code": "server_error", "message": "m"}})
    ]
    messages = [
        _p_msg_start(),
        {"type": "ping"},
        _p_block_start(0, {"type": "thinking", "thinking": ""}),
        _p_block_delta(0, "thinking_delta", thinking="Let"),
        _p_block_delta(0, "signature_delta", signature=""),
        _p_block_start(1, {"type": "text", "text": ""}),
        _p_block_delta(1, "text_delta", text="Sure"),
        _p_block_start(2, {"type": "tool_use", "id": "toolu_1", "name": "get_weather"}),
        _p_block_delta(2, "input_json_delta", partial_json='{"city":'),
        _p_block_delta(2, "input_json_delta", partial_json='"Paris"}'),
        {"type": "content_block_stop", "index": 2},
    ] + _p_msg_end("tool_use")
    overloaded = messages[:7] + [{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}]
    bare = messages[:9] + [{"code": 500, "message": "does not match the expected format", "type": "server_error"}]
    entry = {"id": 506, "token": " the", "bytes": [32, 116, 104, 101], "logprob": -0.5, "top_logprobs": []}

    def oai_text(index, piece, finish=None, **extra):
        """A /v1/completions chunk as this server streams it."""
        choice = {"text": piece, "index": index, "logprobs": extra.pop("logprobs", None), "finish_reason": finish}
        doc = {"choices": [choice], "created": 1, "model": "m", "object": "text_completion", "id": "chatcmpl-1"}
        doc.update(extra)
        return sse(json.dumps(doc, separators=(",", ":")))

    usage = {
        "completion_tokens": 2,
        "prompt_tokens": 4,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    text_two = [
        b"data: null\n\n",
        oai_text(0, "", prompt_progress=progress),
        oai_text(1, " one", logprobs={"content": [entry]}),
        oai_text(0, " the", logprobs={"content": [entry]}),
        oai_text(1, "", "length", usage=usage, timings={"predicted_n": 2}),
        oai_text(0, " sea"),
        oai_text(0, "", "stop", usage=usage),
        b"data: [DONE]\n\n",
    ]
    text_error = [oai_text(0, "a"), sse(json.dumps({"error": {"code": 500, "message": "m", "type": "server_error"}}))]
    model_events = [
        sse(json.dumps({"model": "beta", "event": "model_status", "data": {"status": "loading"}})),
        sse(json.dumps({"model": "beta", "event": "status_change", "data": {"status": "loaded", "info": {}}})),
        sse(json.dumps({"model": "*", "event": "models_reload"})),
    ]
    return [
        (
            "text-one",
            "dialect:text",
            _p_dialect_http([oai_text(0, " the"), oai_text(0, "", "length", usage=usage), b"data: [DONE]\n\n"]),
        ),
        ("text-two", "dialect:text", _p_dialect_http(text_two)),
        ("text-error", "dialect:text", _p_dialect_http(text_error)),
        ("models", "dialect:models", _p_dialect_http(model_events)),
        ("native-one", "dialect:native", _p_dialect_http(native_one)),
        ("native-two", "dialect:native", _p_dialect_http(native_two)),
        ("native-error", "dialect:native", _p_dialect_http(native_error)),
        ("responses-text", "dialect:responses", _p_dialect_http([_p_typed(b) for b in text])),
        ("responses-calls", "dialect:responses", _p_dialect_http([_p_typed(b) for b in calls])),
        ("responses-incomplete", "dialect:responses", _p_dialect_http([sse(json.dumps(b)) for b in incomplete])),
        ("responses-failed", "dialect:responses", _p_dialect_http([_p_typed(b) for b in failed])),
        ("messages", "dialect:messages", _p_dialect_http([_p_typed(d) for d in messages])),
        # stream_route(): any route's events, in every shape (chat, native, Responses, text, an error)
        (
            "route-chat",
            "dialect:route",
            _p_dialect_http([sse(chunk_json({"content": "Hi"})), sse(chunk_json({}, "stop")), b"data: [DONE]\n\n"]),
        ),
        ("route-native", "dialect:route", _p_dialect_http(native_two)),
        ("route-responses", "dialect:route", _p_dialect_http([_p_typed(b) for b in text])),
        (
            "route-text",
            "dialect:route",
            _p_dialect_http([b"data: hello\n\n", b"data: 42\n\n", b"data: [1,\ndata: 2]\n\n", b"data: null\n\n"]),
        ),
        (
            "route-error",
            "dialect:route",
            _p_dialect_http([sse(json.dumps({"a": 1})), sse(json.dumps({"error": {"code": 503, "message": "x"}}))]),
        ),
        ("messages-overloaded", "dialect:messages", _p_dialect_http([_p_typed(d) for d in overloaded])),
        (
            "messages-bare-error",
            "dialect:messages",
            _p_dialect_http([_p_typed(d) for d in bare[:-1]] + [sse(json.dumps(bare[-1]))]),
        ),
    ]


_native, _native_stop = _p_native, _p_native_stop


class Corpus:
    def __init__(self):
        self.seeds = builtin_seeds() + transcript_seeds() + dialect_seeds()
        self.streams = [s[2] for s in self.seeds if s[1] == "stream"]
        self.dialects = {name: [s[2] for s in self.seeds if s[1] == "dialect:" + name] for name in DIALECTS}
        self.dialect_payloads = {
            name: [p for data in streams for p in sse_payloads(dechunk(split_head(data)[1]))]
            for name, streams in self.dialects.items()
        }
        self.jsons = [s[2] for s in self.seeds if s[1] == "json"]
        self.all = [s[2] for s in self.seeds]
        self.bodies = [split_head(s)[1] for s in self.streams]
        self.sse_bodies = [dechunk(b) for b in self.bodies]
        self.payloads = [p for b in self.sse_bodies for p in sse_payloads(b)]
        self.slots = [s[2] for s in self.seeds if s[0].startswith(("slots", "02_", "10_"))]
        self.controls = [s[2] for s in self.seeds if s[0].startswith("control")]


def split_head(response):
    end = response.find(b"\r\n\r\n")
    if end < 0:
        return response, b""
    head = response[: end + 4]
    if head.startswith(b"HTTP/1.1 100"):
        rest_head, body = split_head(response[end + 4 :])
        return head + rest_head, body
    return head, response[end + 4 :]


def dechunk(body):
    try:
        return b"".join(lc.ChunkedDecoder().feed(body))
    except lc.LoopError:
        return body


def sse_payloads(body):
    try:
        return [data for _, data in lc.SSEDecoder().feed(body)]
    except lc.LoopError:
        return []


# =====================================================================================================
# Mutators
# =====================================================================================================

TOKENS = [
    b"\r\n",
    b"\n",
    b"\r",
    b"\r\n\r\n",
    b"\n\n",
    b"\r\r",
    b"data: ",
    b"data:",
    b"error: ",
    b": ping\n\n",
    b"event: error\n",
    b"event: message\n",
    b"id: 1\n",
    b"retry: 5\n",
    b"[DONE]",
    b"0\r\n\r\n",
    b"ffffffffffffffff",
    b"-1",
    b";ext=1",
    b"Content-Length: ",
    b"Content-Length: 7\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip\r\n",
    b"Retry-After: ",
    b"Retry-After: 9999999999999999999999\r\n",
    b"Retry-After: -1\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/1.0 200 OK\r\n",
    b"HTTP/1.1 503 Service Unavailable\r\n",
    b"\xef\xbb\xbf",
    b"\x00",
    b"\xff",
    b"\xc3",
    b"\xe2\x82",
    b"\t",
    b" ",
    b":",
    b'"',
    b"\\",
    b"\\u0000",
    b"\\ud800",
    b'"\xc2\xb2"',
    b'"\\u00b2"',
    b"1e999",
    b"-0",
    b"NaN",
    b"9" * 30,
    b"null",
    b"true",
    b'""',
    b"{}",
    b"[]",
    b"[[[[[[[[[[[[[[[[",
    b'{"error":{"code":503,"message":"x","type":"unavailable_error"}}',
    b'{"error":{"code":"503"}}',
    b'"index":',
    b'"index":-1',
    b'"index":1e3',
    b'"tool_calls":[{}]',
    b'"tool_calls":"x"',
    b'"choices":{}',
    b'"delta":"x"',
    b'"finish_reason":"stop"',
    b'"finish_reason":1',
    b'"usage":[]',
    b'"timings":1',
    b'"reasoning_content":"r"',
    b'"content":7',
    b'"is_processing":true',
    b'"success":true',
    b'"id":"x"',
]
#: Lines that cost the most per byte: repeated, they probe for time that grows faster than the input.
HOT_LINES = [b"data:\n", b"data: x\n", b": \n", b"\n", b"\r", b"x", b"data:\r\n", b"event: e\n", b"0\r\n"]


def m_bitflip(rng, data, corpus):
    if not data:
        return data
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf)


def m_byteset(rng, data, corpus):
    if not data:
        return data
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        buf[rng.randrange(len(buf))] = rng.choice(b'\r\n\x00\xff :;"{}[],0123456789abcdefx-\t\\\xc3\x80')
    return bytes(buf)


def m_insert(rng, data, corpus):
    i = rng.randint(0, len(data))
    token = rng.choice(TOKENS)
    if rng.random() < 0.1:
        token *= rng.randint(2, 100)
    return data[:i] + token + data[i:]


def m_splice(rng, data, corpus):
    other = rng.choice(corpus.all)
    i = rng.randint(0, len(data))
    j = rng.randint(0, len(other))
    return data[:i] + other[j:]


def m_truncate(rng, data, corpus):
    return data[: rng.randint(0, len(data))]


def m_repeat(rng, data, corpus):
    if not data:
        return data
    i = rng.randrange(len(data))
    j = min(len(data), i + rng.randint(1, 64))
    return data[:j] + data[i:j] * rng.randint(1, 64) + data[j:]


def m_drop(rng, data, corpus):
    if not data:
        return data
    i = rng.randrange(len(data))
    j = min(len(data), i + rng.randint(1, 256))
    return data[:i] + data[j:]


def m_swap_case(rng, data, corpus):
    if not data:
        return data
    i = rng.randrange(len(data))
    j = min(len(data), i + rng.randint(1, 16))
    return data[:i] + data[i:j].swapcase() + data[j:]


def m_json(rng, data, corpus):
    """Find a JSON object in the bytes and edit its structure (keeps the framing intact when it can)."""
    start = data.find(b"{", rng.randrange(len(data)) if data else 0)
    if start < 0:
        start = data.find(b"{")
    if start < 0:
        return data
    end = data.find(b"\n", start)
    end = len(data) if end < 0 else end
    text = data[start:end].rstrip(b"\r")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return data
    new = json.dumps(mutate_doc(rng, doc), separators=(",", ":"), ensure_ascii=rng.random() < 0.5).encode(
        "utf-8", "surrogatepass"
    )
    return data[:start] + new + data[start + len(text) :]


def m_deep(rng, data, corpus):
    """Deep nesting where a JSON value may start (json.dumps cannot build it: it recurses)."""
    i = data.find(b":", rng.randrange(len(data))) + 1 if data else 0
    depth = rng.choice([1000, 5000, 100000])
    opener, closer = (b"[", b"]") if rng.random() < 0.5 else (b'{"a":', b"}")
    return data[:i] + opener * depth + b"1" + closer * depth + data[i:]


def m_big(rng, data, corpus):
    """A long run of one hot line, or of a span of the input, somewhere in it (up to MAX_BIG_INPUT)."""
    i = rng.randint(0, len(data))
    if rng.random() < 0.7:
        piece = rng.choice(HOT_LINES)
    else:
        j = min(len(data), i + rng.randint(1, 300))
        piece = data[i:j] or b"x"
    count = rng.randint(1000, MAX_BIG_INPUT // len(piece))
    return data[:i] + piece * count + data[i:]


MUTATORS = [
    m_bitflip,
    m_byteset,
    m_insert,
    m_insert,
    m_splice,
    m_truncate,
    m_repeat,
    m_drop,
    m_swap_case,
    m_json,
    m_json,
    m_deep,
]

PALETTE = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**70,
    10**30,
    1.5,
    float("inf"),
    "",
    "x",
    "\u00b2",
    "\ud800",
    "\x00",
    "503",
    "unavailable_error",
    [],
    {},
    [None],
    [{}],
    {"index": None},
    {"index": 0},
    "stop",
    "a" * 300,
]
KEYS = [
    "error",
    "choices",
    "delta",
    "tool_calls",
    "index",
    "finish_reason",
    "usage",
    "timings",
    "reasoning_content",
    "content",
    "id",
    "function",
    "arguments",
    "name",
    "code",
    "message",
    "type",
    "role",
    "model",
    "success",
    "is_processing",
    "total_slots",
]


def mutate_doc(rng, doc, depth=0, keys=None):
    """A copy of a JSON document with one random edit somewhere inside it (new keys from ``keys``, else KEYS)."""
    keys = keys or KEYS
    if depth > 8 or not isinstance(doc, (dict, list)) or rng.random() < 0.2:
        choice = rng.random()
        if choice < 0.75:
            value = rng.choice(PALETTE)
            return json.loads(json.dumps(value)) if not isinstance(value, float) else value
        if choice < 0.9:
            return [doc] * rng.randint(1, 3)
        nested = doc
        for _ in range(rng.choice([10, 100, 400])):  # deeper: m_deep, as json.dumps recurses
            nested = [nested]
        return nested
    if isinstance(doc, dict):
        doc = dict(doc)
        roll = rng.random()
        if doc and roll < 0.6:
            key = rng.choice(sorted(doc))
            doc[key] = mutate_doc(rng, doc[key], depth + 1, keys)
        elif doc and roll < 0.75:
            del doc[rng.choice(sorted(doc))]
        else:
            doc[rng.choice(keys)] = mutate_doc(rng, rng.choice(PALETTE), depth + 1, keys)
        return doc
    doc = list(doc)
    if doc and rng.random() < 0.7:
        i = rng.randrange(len(doc))
        doc[i] = mutate_doc(rng, doc[i], depth + 1, keys)
    elif doc and rng.random() < 0.5:
        del doc[rng.randrange(len(doc))]
    else:
        doc.append(mutate_doc(rng, rng.choice(PALETTE), depth + 1, keys))
    return doc


def mutate(rng, data, corpus, big=False):
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 4, 6])):
        data = rng.choice(MUTATORS)(rng, data, corpus)
        if len(data) > MAX_INPUT:
            data = data[:MAX_INPUT]
    if big:
        data = m_big(rng, data, corpus)[:MAX_BIG_INPUT]
    return data


def splits(rng, size):
    """Where successive reads end: a sorted list of cut offsets (an input of one read has none)."""
    roll = rng.random()
    if size <= 1 or roll < 0.3:
        return []
    if roll < 0.4 and size <= 4096:
        return list(range(1, size))  # byte by byte
    count = min(size - 1, rng.choice([1, 2, 3, 5, 10, 50, 200]))
    return sorted({rng.randrange(1, size) for _ in range(count)})


def pieces(data, cuts):
    out = []
    last = 0
    for cut in cuts:
        out.append(data[last:cut])
        last = cut
    out.append(data[last:])
    return out


# =====================================================================================================
# Checks
# =====================================================================================================


class Violation(Exception):
    """A rule was broken (an escaping exception is carried as the cause)."""


class Hang(BaseException):
    """Raised by the watchdog signal in the main thread."""


def check_reader(reader):
    buf = getattr(reader, "_buf", None)
    if reader.head is None and buf is not None and len(buf) > getattr(reader, "_max_head", lc.MAX_HEAD):
        raise Violation("ResponseReader holds %d bytes of head, over its cap" % len(buf))
    body = getattr(reader, "_body", None)
    if isinstance(body, lc.ChunkedDecoder):
        check_chunked(body)


def check_chunked(decoder):
    pending = getattr(decoder, "_pending", b"")
    if len(pending) > lc.MAX_CHUNK_LINE + 2:
        raise Violation("ChunkedDecoder holds %d pending bytes, over MAX_CHUNK_LINE" % len(pending))


def check_sse(decoder):
    cap = decoder.max_line
    buf = getattr(decoder, "_buf", b"")
    if len(buf) > cap:
        raise Violation("SSEDecoder holds a partial line of %d bytes, over max_line %d" % (len(buf), cap))
    data = getattr(decoder, "_data", None)
    if isinstance(data, list):  # pieces joined at dispatch: summing them here at every feed would be quadratic
        size = max(len(data) - 1 + (len(data[-1]) if data else 0), getattr(decoder, "_size", 0))
    else:
        size = len(data or "")
    if size > cap + 1:
        raise Violation("SSEDecoder holds an event of %d chars, over max_line %d" % (size, cap))
    lead = getattr(decoder, "_lead", None)
    if lead is not None and len(lead) > 3:
        raise Violation("SSEDecoder holds %d lead bytes" % len(lead))


EVENT_TYPES = {
    lc.Reasoning: (("text", str), ("choice", int)),
    lc.Content: (("text", str), ("choice", int)),
    lc.ToolCall: (
        ("index", int),
        ("id", (str, type(None))),
        ("name", (str, type(None))),
        ("arguments", str),
        ("choice", int),
    ),
    lc.Progress: (("processed", int), ("total", int), ("cache", int), ("time_ms", float)),
    lc.Chunk: (("data", dict),),
    lc.ModelEvent: (("model", str), ("event", str), ("data", (dict, type(None)))),
}
#: stream_route()'s chunks hold any JSON value, or the event's text
ROUTE_EVENT_TYPES = dict(EVENT_TYPES)
ROUTE_EVENT_TYPES[lc.Chunk] = (("data", (dict, list, str, int, float, bool, type(None))),)
CLIENT_EVENT_TYPES = dict(EVENT_TYPES)
CLIENT_EVENT_TYPES.update(
    {
        lc.Queued: (("ahead", int),),
        lc.Waiting: (("slot_busy", bool), ("wedged", bool)),
        lc.Retrying: (("attempt", int), ("delay", float), ("reason", str)),
        lc.ThinkingCapped: (("tokens", int),),
    }
)


def check_events(events, table=EVENT_TYPES):
    for event in events:
        fields = table.get(type(event))
        if fields is None:
            raise Violation("unexpected event %r" % (event,))
        for name, kind in fields:
            value = getattr(event, name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise Violation("event %s.%s is %r" % (type(event).__name__, name, value))
        if isinstance(event, (lc.Reasoning, lc.Content)) and not event.text:
            raise Violation("empty %s event" % type(event).__name__)


def check_completion(done, route=False):
    """The types a Completion documents; ``route``: stream_route()'s, which may be empty (no finish, no usage)
    but never holds text."""
    if not isinstance(done, lc.Completion):
        raise Violation("not a Completion: %r" % (done,))
    if route and (done.content or done.reasoning or done.tool_calls or done.reasoning_tokens):
        raise Violation("stream_route()'s Completion holds text: %r" % (done,))
    for name in ("content", "reasoning", "finish_reason"):
        if route and name == "finish_reason" and done.finish_reason is None:
            continue
        if not isinstance(getattr(done, name), str):
            raise Violation("Completion.%s is %r" % (name, getattr(done, name)))
    for name in ("usage", "timings"):
        if getattr(done, name) is not None and not isinstance(getattr(done, name), dict):
            raise Violation("Completion.%s is %r" % (name, getattr(done, name)))
    if not isinstance(done.tool_calls, list):
        raise Violation("Completion.tool_calls is %r" % (done.tool_calls,))
    for call in done.tool_calls:
        if (
            not isinstance(call.arguments, str)
            or not isinstance(call.id, (str, type(None)))
            or not isinstance(call.name, (str, type(None)))
        ):
            raise Violation("bad tool call %r" % (call,))


# =====================================================================================================
# Targets (each: (rng, corpus, big) -> case dict; run(case) -> outcome, raising Violation or anything else)
# =====================================================================================================


def make_http(rng, corpus, big):
    data = mutate(rng, rng.choice(corpus.streams if rng.random() < 0.8 else corpus.all), corpus, big)
    return {
        "target": "http",
        "data": data,
        "cuts": splits(rng, len(data)),
        "max_line": rng.choice([64, 4096, 64 * 1024, 1024 * 1024]),
        "max_body": rng.choice([None, 1024, 64 * 1024]),
    }


def run_http(case):
    reader = lc.ResponseReader(max_body=case["max_body"])
    sse = None
    asm = lc.Assembler()
    events = []

    error_body = []

    def handle(body_pieces):
        nonlocal sse
        if reader.head is None:
            return False
        if reader.head.status != 200:  # the client keeps an error body and reads its envelope
            error_body.extend(body_pieces)
            return False
        if sse is None:
            sse = lc.SSEDecoder(case["max_line"])
        for piece in body_pieces:
            for kind, payload in sse.feed(piece):
                if kind == "error":
                    raise (
                        lc._error_from(lc._json_or_text(payload))
                        if hasattr(lc, "_error_from")
                        else lc.ServerError(None, payload)
                    )
                if payload == "[DONE]":
                    return True
                events.extend(asm.feed(payload))
            check_sse(sse)
        return False

    for piece in pieces(case["data"], case["cuts"]):
        got = reader.feed(piece)
        check_reader(reader)
        if handle(got):
            check_events(events)
            return asm.completion()
        if reader.done:
            break
    if not reader.done:
        reader.feed_eof()
    if sse is not None:
        for kind, payload in sse.close():
            if kind != "error" and payload != "[DONE]":
                events.extend(asm.feed(payload))
    check_events(events)
    head = reader.head
    if head is not None and head.status != 200:
        message, _ = lc.parse_error_envelope(b"".join(error_body))
        hint = lc.parse_retry_after(head.get("retry-after"))
        if not isinstance(message, str) or (hint is not None and not (isinstance(hint, float) and hint >= 0)):
            raise Violation("error envelope %r, Retry-After hint %r" % (message, hint))
        return head.status
    return asm.completion()


def make_chunked(rng, corpus, big):
    data = mutate(rng, rng.choice(corpus.bodies), corpus, big)
    return {"target": "chunked", "data": data, "cuts": splits(rng, len(data))}


def run_chunked(case):
    decoder = lc.ChunkedDecoder()
    size = 0
    for piece in pieces(case["data"], case["cuts"]):
        for out in decoder.feed(piece):
            if not isinstance(out, (bytes, bytearray, memoryview)):
                raise Violation("ChunkedDecoder yielded %r" % type(out))
            size += len(out)
        check_chunked(decoder)
        if decoder.done:
            return size
    decoder.feed_eof()
    return size


def make_sse(rng, corpus, big):
    data = mutate(rng, rng.choice(corpus.sse_bodies), corpus, big)
    return {
        "target": "sse",
        "data": data,
        "cuts": splits(rng, len(data)),
        "max_line": rng.choice([16, 300, 4096, 1024 * 1024]),
    }


def run_sse(case):
    decoder = lc.SSEDecoder(case["max_line"])
    count = 0
    for piece in pieces(case["data"], case["cuts"]) + [None]:
        out = decoder.close() if piece is None else decoder.feed(piece)
        for kind, payload in out:
            if not isinstance(kind, str) or not isinstance(payload, str):
                raise Violation("SSEDecoder yielded (%r, %r)" % (type(kind), type(payload)))
            if len(payload) > case["max_line"]:
                raise Violation("an event of %d chars passed max_line %d" % (len(payload), case["max_line"]))
            count += 1
        check_sse(decoder)
    return count


def make_assembler(rng, corpus, big):
    start = rng.randrange(len(corpus.payloads))
    payloads = corpus.payloads[start : start + rng.randint(1, 12)]
    out = []
    for payload in payloads:
        roll = rng.random()
        if roll < 0.45:
            try:
                payload = json.dumps(
                    mutate_doc(rng, json.loads(payload)), separators=(",", ":"), ensure_ascii=rng.random() < 0.5
                )
            except (ValueError, RecursionError):
                pass
        elif roll < 0.7:
            payload = mutate(rng, payload.encode("utf-8", "surrogatepass"), corpus).decode("utf-8", "replace")
        out.append(payload)
    if rng.random() < 0.3:
        out.insert(
            rng.randint(0, len(out)), json.dumps(mutate_doc(rng, {"error": {"code": 500, "message": "m", "type": "t"}}))
        )
    data = "\n\x1e".join(out).encode("utf-8", "surrogatepass")
    return {"target": "assembler", "data": data, "cuts": []}


def run_assembler(case):
    asm = lc.Assembler()
    events = []
    for payload in case["data"].decode("utf-8", "surrogatepass").split("\n\x1e"):
        if payload == "[DONE]":
            break
        events.extend(asm.feed(payload))
    check_events(events)
    done = asm.completion()
    check_completion(done)
    return done


# -- the other endpoints' dialects (/completion and /infill, Responses, Messages) --------------------------

#: Keys the dialects read, for the structural edits of their payloads.
DIALECT_KEYS = KEYS + [
    "stop",
    "stop_type",
    "tokens",
    "completion_probabilities",
    "prompt_progress",
    "tokens_evaluated",
    "tokens_predicted",
    "item",
    "item_id",
    "output_index",
    "call_id",
    "response",
    "output",
    "incomplete_details",
    "reason",
    "text",
    "thinking",
    "partial_json",
    "content_block",
    "stop_reason",
    "stop_sequence",
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "logprobs",
    "model",
    "event",
    "data",
]
DIALECT_TYPES = [
    "response.output_text.delta",
    "response.output_text.done",
    "response.reasoning_text.delta",
    "response.function_call_arguments.delta",
    "response.output_item.added",
    "response.output_item.done",
    "response.completed",
    "response.incomplete",
    "response.failed",
    "function_call",
    "message_start",
    "content_block_start",
    "content_block_delta",
    "message_delta",
    "message_stop",
    "text_delta",
    "thinking_delta",
    "input_json_delta",
    "tool_use",
    "error",
]


def check_dialect(asm, events, done):
    """The rules every dialect keeps: the Completion holds what the events delivered, in order (text per
    choice, reasoning, each call's id, name and arguments), chat's usage keys are integers, ``final`` is an
    object and the token ids integers."""
    check_completion(done, route=isinstance(asm, lc._RouteChunks))
    if not asm.done and not isinstance(asm, (lc._NativeAssembler,) + DONE_ENDS):
        raise Violation("a Completion from %s before its stream's end" % type(asm).__name__)
    texts, reasoning, calls = {}, {}, {}
    for event in events:
        if type(event) is lc.Content:
            texts[event.choice] = texts.get(event.choice, "") + event.text
        elif type(event) is lc.Reasoning:
            reasoning[event.choice] = reasoning.get(event.choice, "") + event.text
        elif type(event) is lc.ToolCall:
            entry = calls.setdefault(event.index, [None, None, ""])
            entry[0] = entry[0] or event.id
            entry[1] = entry[1] or event.name
            entry[2] += event.arguments
    for choice in done.choices:
        if choice.content != texts.get(choice.index, "") or choice.reasoning != reasoning.get(choice.index, ""):
            raise Violation("choice %d holds text its events did not deliver" % choice.index)
        if choice.tokens is not None and not all(type(t) is int for t in choice.tokens):
            raise Violation("token ids %r" % (choice.tokens,))
    got = [[c.id, c.name, c.arguments] for c in done.tool_calls]
    if got != [calls[i] for i in sorted(calls)]:
        raise Violation("tool calls %r, the events gave %r" % (got, calls))
    if done.usage is not None and not isinstance(asm, (lc.Assembler, lc._RouteChunks)):  # as sent there
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            if type(done.usage.get(key)) is not int:
                raise Violation("usage[%r] is %r" % (key, done.usage.get(key)))
    if done.final is not None and not isinstance(done.final, dict):
        raise Violation("Completion.final is %r" % (done.final,))
    if asm.reasoning_tokens != sum(1 for e in events if type(e) is lc.Reasoning):
        raise Violation("%d reasoning tokens for %d Reasoning events" % (asm.reasoning_tokens, len(reasoning)))


def _event_types(asm):
    return ROUTE_EVENT_TYPES if isinstance(asm, lc._RouteChunks) else EVENT_TYPES


def make_dialect(rng, corpus, big):
    name = rng.choice(sorted(DIALECTS))
    seeds = corpus.dialects[name] if rng.random() < 0.85 else corpus.streams
    data = mutate(rng, rng.choice(seeds), corpus, big)
    return {
        "target": "dialect",
        "dialect": name,
        "data": data,
        "cuts": splits(rng, len(data)),
        "raw_chunks": rng.random() < 0.2,
    }


def run_dialect(case):
    """ResponseReader -> SSEDecoder -> the dialect, stopping where it says its stream ended."""
    reader = lc.ResponseReader()
    sse_decoder = lc.SSEDecoder(64 * 1024)
    asm = DIALECTS[case["dialect"]](case["raw_chunks"])
    events = []

    def payloads(items):
        for kind, payload in items:
            if kind == "error":
                raise lc._error_from(lc._json_or_text(payload))
            if payload == "[DONE]" and isinstance(asm, DONE_ENDS):  # the pump's reading of it
                return True
            events.extend(asm.feed(payload))
            if asm.done:
                return True
        return False

    for piece in pieces(case["data"], case["cuts"]):
        for body in reader.feed(piece):
            if reader.head is not None and reader.head.status != 200:
                continue
            if payloads(sse_decoder.feed(body)):
                check_events(events, _event_types(asm))
                done = asm.completion()
                check_dialect(asm, [e for e in events if type(e) is not lc.Chunk], done)
                return done
            check_sse(sse_decoder)
        check_reader(reader)
        if reader.done:
            break
    if not reader.done:
        reader.feed_eof()
    payloads(sse_decoder.close())
    check_events(events, _event_types(asm))
    done = asm.completion()
    check_dialect(asm, [e for e in events if type(e) is not lc.Chunk], done)
    return done


def make_dialect_payloads(rng, corpus, big):
    name = rng.choice(sorted(DIALECTS))
    source = corpus.dialect_payloads[name]
    start = rng.randrange(len(source))
    out = []
    for payload in source[start : start + rng.randint(1, 16)]:
        roll = rng.random()
        if roll < 0.5:
            try:
                doc = json.loads(payload)
                if isinstance(doc, dict) and rng.random() < 0.2:
                    doc["type"] = rng.choice(DIALECT_TYPES)
                payload = json.dumps(mutate_doc(rng, doc, keys=DIALECT_KEYS), separators=(",", ":"))
            except (ValueError, RecursionError):
                pass
        elif roll < 0.65:
            payload = mutate(rng, payload.encode("utf-8", "surrogatepass"), corpus).decode("utf-8", "replace")
        out.append(payload)
    if rng.random() < 0.2:
        out.insert(rng.randint(0, len(out)), rng.choice(source))
    data = "\n\x1e".join(out).encode("utf-8", "surrogatepass")
    return {"target": "dialect_payloads", "dialect": name, "data": data, "cuts": [], "raw_chunks": rng.random() < 0.2}


def run_dialect_payloads(case):
    asm = DIALECTS[case["dialect"]](case["raw_chunks"])
    events = []
    for payload in case["data"].decode("utf-8", "surrogatepass").split("\n\x1e"):
        if payload == "[DONE]" and isinstance(asm, DONE_ENDS):
            break
        events.extend(asm.feed(payload))
        if asm.done:
            break
    check_events(events, _event_types(asm))
    done = asm.completion()
    check_dialect(asm, [e for e in events if type(e) is not lc.Chunk], done)
    return done


# -- the whole client ---------------------------------------------------------------------------------


class Server:
    """A Unix socket server thread answering by path from ``script``: (bytes, cuts, hold)."""

    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix="lcfz")
        self.path = os.path.join(self.tmp, "s.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(64)
        self.sock.settimeout(0.05)
        self.script = {}
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.active = 0
        self.connections = 0
        self.thread = threading.Thread(target=self._accept, name="fuzz-accept", daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self.lock:
                self.active += 1
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), name="fuzz-conn", daemon=True).start()

    def _serve(self, conn):
        try:
            conn.settimeout(2.0)
            request = read_request(conn)
            if request is None:
                return
            answer = self.script.get(request.path)
            if answer is None:
                conn.sendall(
                    json_response(
                        {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}},
                        b"404 Not Found",
                    )
                )
                return
            response, cuts, hold = answer
            for i, piece in enumerate(pieces(response, cuts)):
                conn.sendall(piece)
                if i % 7 == 6:
                    time.sleep(0.001)
            if hold:
                conn.settimeout(0.05)
                deadline = time.monotonic() + 1.5
                while time.monotonic() < deadline and not self.stopping.is_set():
                    try:
                        if not conn.recv(4096):
                            break
                    except socket.timeout:
                        continue
        except OSError:
            pass
        finally:
            conn.close()
            with self.lock:
                self.active -= 1

    def close(self):
        self.stopping.set()
        self.sock.close()
        self.thread.join(2)
        try:
            os.unlink(self.path)
            os.rmdir(self.tmp)
        except OSError:
            pass


_SERVER = None


def server():
    global _SERVER
    if _SERVER is None:
        _SERVER = Server()
    return _SERVER


def make_client(rng, corpus, big):
    chat = mutate(rng, rng.choice(corpus.streams), corpus)
    slots = rng.choice(corpus.slots)
    if rng.random() < 0.3:
        slots = mutate(rng, slots, corpus)
    control = rng.choice(corpus.controls)
    if rng.random() < 0.3:
        control = mutate(rng, control, corpus)
    return {
        "target": "client",
        "data": chat,
        "cuts": splits(rng, len(chat)),
        "hold": rng.random() < 0.15,
        "slots": slots,
        "control": control,
        "capped": rng.random() < 0.25,
        "slot": rng.choice([0, 0, 0, 1, None]),
    }


def _fds():
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # pragma: no cover - not Linux
        return 0


def _client_threads():
    return [t for t in threading.enumerate() if t.name.startswith("loopclient")]


def _serve_case(case):
    """The scripted server for a client case: its chat stream, /slots and control answers."""
    srv = server()
    srv.script = {
        "/v1/chat/completions": (case["data"], case["cuts"], case["hold"]),
        "/slots": (case["slots"], [], False),
        "/props": (json_response({"total_slots": 2}), [], False),
        "/v1/chat/completions/control": (case["control"], [], False),
    }
    return srv


def _client_limits(case):
    return CLIENT_LIMITS_CAPPED if case["capped"] else CLIENT_LIMITS


def _check_no_leak(srv, fds):
    """Nothing leaks: the client's threads end and every descriptor closes (the server's with them)."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and (_client_threads() or srv.active or _fds() > fds):
        time.sleep(0.002)
    if _client_threads() or _fds() > fds:
        raise Violation(
            "leak after the request: threads %s, %d descriptors over %d (server connections open: %d)"
            % ([t.name for t in _client_threads()], _fds() - fds, fds, srv.active)
        )


def run_client(case):
    srv = _serve_case(case)
    fds = case.setdefault("_fds", _fds())
    client = lc.Client(srv.path, limits=_client_limits(case))
    events = []
    start = time.monotonic()
    try:
        done = client.chat([{"role": "user", "content": "hi"}], slot=case["slot"], on_event=events.append)
    finally:
        case["_seconds"] = time.monotonic() - start
        client.close()
        check_events(events, CLIENT_EVENT_TYPES)
        _check_no_leak(srv, fds)
    check_completion(done)
    return done


# -- the two clients alike: Client and AsyncClient on the same scripted server ------------------------


def _sync_outcome(srv, case):
    """(events, Completion or LoopError, seconds) of ``Client.chat`` on the case."""
    client = lc.Client(srv.path, limits=_client_limits(case))
    events = []
    start = time.monotonic()
    try:
        value = client.chat([{"role": "user", "content": "hi"}], slot=case["slot"], on_event=events.append)
    except lc.LoopError as exc:
        value = exc
    finally:
        seconds = time.monotonic() - start
        client.close()
    return events, value, seconds


def _async_outcome(srv, case):
    """The same through ``AsyncClient.chat``, on an event loop of its own (asyncio.run, no executor)."""
    import asyncio

    async def main():
        client = lc.AsyncClient(srv.path, limits=_client_limits(case))
        events = []
        start = time.monotonic()
        try:
            value = await client.chat([{"role": "user", "content": "hi"}], slot=case["slot"], on_event=events.append)
        except lc.LoopError as exc:
            value = exc
        finally:
            seconds = time.monotonic() - start
            await client.close()
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if left:
            raise Violation("the AsyncClient left %d tasks after close(): %r" % (len(left), left[:3]))
        return events, value, seconds

    return asyncio.run(main())


#: A case whose two outcomes differ runs again, this many times, before the difference is a violation:
#: the client cases trickle bytes and wait out budgets of a tenth of a second, so on a loaded machine one
#: run's outcome can turn on a few milliseconds.  A difference that a rerun does not repeat is reported
#: as timing (printed, counted, not a violation); one that every rerun repeats is a violation.
DIFF_RERUNS = 2


def _both_outcomes(srv, case, fds):
    """(sync (events, value), async (events, value), the longer run's seconds)."""
    # a retry's delay is jittered with the random module: both clients draw the same jitter
    random.seed(case_id(case))
    sync_events, sync_value, sync_seconds = _sync_outcome(srv, case)
    check_events(sync_events, CLIENT_EVENT_TYPES)
    _check_no_leak(srv, fds)
    random.seed(case_id(case))
    async_events, async_value, async_seconds = _async_outcome(srv, case)
    check_events(async_events, CLIENT_EVENT_TYPES)
    _check_no_leak(srv, fds)
    return (sync_events, sync_value), (async_events, async_value), max(sync_seconds, async_seconds)


def run_differential(case):
    """The case through ``Client`` and then ``AsyncClient``, against the same scripted server: events,
    Completion, error class and message must be alike but for timing (test_loopclient's
    differs_between_clients, the rules of TestDifferential)."""
    srv = _serve_case(case)
    fds = case.setdefault("_fds", _fds())
    sync, other, seconds = _both_outcomes(srv, case, fds)
    case["_seconds"] = seconds
    differs = differs_between_clients(sync, other, CLIENT_LIMITS.poll)
    if differs is not None:
        for _ in range(DIFF_RERUNS):
            again_sync, again_other, _ = _both_outcomes(srv, case, fds)
            if differs_between_clients(again_sync, again_other, CLIENT_LIMITS.poll) is None:
                case["_timing"] = differs
                break
        else:
            raise Violation(differs)
    value = sync[1]
    if isinstance(value, BaseException):
        raise value
    check_completion(value)
    return value


#: name: (make a case, run it, weight).  A client input costs ~70 parser inputs (sockets, threads, and the
#: budgets it waits out), so it gets about a third of the time at this weight.
TARGETS = {
    "http": (make_http, run_http, 35),
    "chunked": (make_chunked, run_chunked, 12),
    "sse": (make_sse, run_sse, 17),
    "assembler": (make_assembler, run_assembler, 35),
    "dialect": (make_dialect, run_dialect, 25),
    "dialect_payloads": (make_dialect_payloads, run_dialect_payloads, 20),
    "client": (make_client, run_client, 1),
    # the client cases again, through both clients: run on its own (--differential), never in the mix
    "differential": (make_client, run_differential, 0),
}


# =====================================================================================================
# The loop
# =====================================================================================================


def _on_alarm(signum, frame):
    raise Hang("the input ran for more than %.0f s" % HANG_LIMIT)


def run_case(case, trace):
    """(outcome text, seconds, peak bytes or None); raises Violation for a broken rule."""
    run = TARGETS[case["target"]][1]
    wall = case["target"] in ("client", "differential")
    clock = time.monotonic if wall else time.thread_time  # the parsers: this thread's CPU time only
    if trace:  # tracemalloc was started just before: its peak counts this input only
        base = tracemalloc.get_traced_memory()[0]
    signal.setitimer(signal.ITIMER_REAL, HANG_LIMIT)
    start = clock()
    try:
        try:
            outcome = run(case)
            text = "ok %s" % type(outcome).__name__
        except lc.LoopError as exc:
            text = "raised %s" % type(exc).__name__
        except Violation:
            raise
        except Hang as exc:
            raise Violation("hang: %s" % exc) from exc
        except BaseException as exc:  # noqa: B036 - anything else escaping is the finding
            raise Violation("%s escaped: %s" % (type(exc).__name__, str(exc)[:200])) from exc
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = case.pop("_seconds", None) or (clock() - start)
    peak = None
    if trace:
        peak = tracemalloc.get_traced_memory()[1] - base
        size = len(case["data"]) + len(case.get("slots", b"")) + len(case.get("control", b""))
        line_cap = min(case.get("max_line", 64 * 1024), size + 1)
        # buffers are capped; what grows with the input is the output (text) and one event's JSON tree
        bound = 4 * 1024 * 1024 + 3 * size + 64 * line_cap
        if peak > bound:
            raise Violation("memory: peak %d bytes for a %d-byte input (bound %d)" % (peak, size, bound))
    limit = TIME_LIMIT * (TRACE_SLOWDOWN if trace and not wall else 1)
    if seconds > limit:
        raise Violation(
            "slow: %.2f s for a %d-byte input (limit %.1f s%s)"
            % (seconds, len(case["data"]), limit, ", traced" if trace else "")
        )
    return text, seconds, peak


def make_case(seed, index, corpus, only=None):
    rng = random.Random("%d:%d" % (seed, index))
    names = sorted(TARGETS) if only is None else [only]
    weights = [TARGETS[n][2] for n in names] if only is None else [1]
    name = rng.choices(names, weights)[0]
    big = name in ("http", "sse", "chunked") and rng.randrange(BIG_EVERY) == 0
    case = TARGETS[name][0](rng, corpus, big)
    case["target"] = name  # the differential target makes its cases with make_client
    case["seed"], case["index"] = seed, index
    return case


def case_id(case):
    return hashlib.sha1(case["target"].encode() + b"\0" + case["data"]).hexdigest()[:16]


def save(case, message, detail):
    os.makedirs(CRASH_DIR, exist_ok=True)
    name = case_id(case)
    with open(os.path.join(CRASH_DIR, name + ".bin"), "wb") as f:
        f.write(case["data"])
    meta = {k: v for k, v in case.items() if k != "data" and not k.startswith("_")}
    for key in ("slots", "control"):
        if key in meta:
            meta[key] = base64.b64encode(meta[key]).decode()
    meta["violation"] = message
    meta["detail"] = detail
    with open(os.path.join(CRASH_DIR, name + ".json"), "w") as f:
        json.dump(meta, f, indent=1)
    return os.path.join(CRASH_DIR, name + ".bin")


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    with open(path[: -len(".bin")] + ".json") as f:
        meta = json.load(f)
    for key in ("slots", "control"):
        if key in meta:
            meta[key] = base64.b64decode(meta[key])
    meta["data"] = data
    return meta


def signature(case, exc):
    """Violations with the same signature are one finding (one saved input, counted many times)."""
    cause = exc.__cause__
    where = ""
    if cause is not None and cause.__traceback__ is not None:
        frame = traceback.extract_tb(cause.__traceback__)[-1]
        where = "%s:%s" % (os.path.basename(frame.filename), frame.name)
    kind = str(exc).split(":")[0] if cause is None else type(cause).__name__
    return (case["target"], kind, where)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, help="how long to run (default 60; 4 hours with --long)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--long", action="store_true", help="run for hours")
    parser.add_argument("--target", choices=sorted(TARGETS), help="fuzz one target only")
    parser.add_argument(
        "--differential",
        action="store_const",
        const="differential",
        dest="target",
        help="the client target's cases through Client and AsyncClient, compared (--target differential)",
    )
    parser.add_argument("--inputs", type=int, help="stop after this many inputs (a repeatable run)")
    parser.add_argument("--replay", metavar="FILE", nargs="+", help="run saved inputs (dev/fuzz-crashes/*.bin) once")
    args = parser.parse_args(argv)
    if args.seconds is not None:
        seconds = args.seconds
    elif args.inputs is not None:  # exactly that many inputs, however long they take
        seconds = float("inf")
    else:
        seconds = 4 * 3600.0 if args.long else 60.0
    signal.signal(signal.SIGALRM, _on_alarm)
    tracemalloc.start()
    tracemalloc.stop()

    if args.replay:
        bad = 0
        for path in args.replay:
            case = load(path)
            try:
                text, took, _ = run_case(case, trace=False)
                print("%s: %s: %s in %.3f s" % (path, case["target"], text, took))
            except Violation as exc:
                bad += 1
                print("%s: %s: VIOLATION %s" % (path, case["target"], exc))
                traceback.print_exception(
                    type(exc.__cause__ or exc), exc.__cause__ or exc, (exc.__cause__ or exc).__traceback__
                )
        return 1 if bad else 0

    corpus = Corpus()
    started = time.monotonic()
    counts = dict.fromkeys(TARGETS, 0)
    spent = dict.fromkeys(TARGETS, 0.0)
    outcomes = {}
    findings = {}
    violations = 0
    timing = []  # the differential target's differences that a rerun did not repeat
    index = 0
    peak_max = 0
    slowest = (0.0, "")
    last_report = started
    print(
        "fuzz: %d seeds (%d from transcripts), seed %d, %.0f s"
        % (len(corpus.seeds), len(transcript_seeds()), args.seed, seconds)
    )
    sys.stdout.flush()
    try:
        while time.monotonic() - started < seconds and (args.inputs is None or index < args.inputs):
            case = make_case(args.seed, index, corpus, args.target)
            index += 1
            trace = index % TRACE_EVERY == 0
            if trace:
                tracemalloc.start()
            began = time.monotonic()
            try:
                text, took, peak = run_case(case, trace)
                counts[case["target"]] += 1
                key = "%s %s" % (case["target"], text)
                outcomes[key] = outcomes.get(key, 0) + 1
                if peak is not None:
                    peak_max = max(peak_max, peak)
                if took > slowest[0]:
                    slowest = (took, case["target"])
                if case.get("_timing"):
                    timing.append(index - 1)
                    print("TIMING (input %d): %s; a rerun agreed" % (index - 1, case["_timing"][:600]))
                    sys.stdout.flush()
            except Violation as exc:
                counts[case["target"]] += 1
                violations += 1
                sig = signature(case, exc)
                if sig not in findings:
                    detail = "".join(
                        traceback.format_exception(
                            type(exc.__cause__ or exc), exc.__cause__ or exc, (exc.__cause__ or exc).__traceback__
                        )
                    )
                    path = save(case, str(exc), detail)
                    findings[sig] = [1, path]
                    print(
                        "VIOLATION #%d (%s, input %d): %s\n  saved %s\n  input %r%s"
                        % (
                            len(findings),
                            case["target"],
                            index - 1,
                            exc,
                            path,
                            case["data"][:300],
                            "..." if len(case["data"]) > 300 else "",
                        )
                    )
                    sys.stdout.write("  " + detail.strip().replace("\n", "\n  ") + "\n")
                    sys.stdout.flush()
                else:
                    findings[sig][0] += 1
            finally:
                spent[case["target"]] += time.monotonic() - began
                if trace:
                    tracemalloc.stop()
            now = time.monotonic()
            if now - last_report >= 15:
                last_report = now
                print("fuzz: %.0f s, %d inputs, %d violations" % (now - started, index, violations))
                sys.stdout.flush()
    finally:
        if _SERVER is not None:
            _SERVER.close()
    elapsed = time.monotonic() - started
    print("fuzz: per target: " + ", ".join("%s %d (%.0f s)" % (n, c, spent[n]) for n, c in sorted(counts.items())))
    print("fuzz: outcomes: " + ", ".join("%s %d" % (k, v) for k, v in sorted(outcomes.items())))
    print("fuzz: slowest input %.3f s (%s), largest traced peak %.1f MiB" % (slowest[0], slowest[1], peak_max / 2**20))
    for sig, (count, path) in sorted(findings.items()):
        print("fuzz: finding %s x%d -> %s" % ("/".join(sig), count, path))
    if timing:
        print(
            "fuzz: %d differences between the clients that a rerun did not repeat (timing): inputs %s"
            % (len(timing), timing)
        )
    print("fuzz: %d inputs, %d violations in %.1f s (seed %d)" % (index, violations, elapsed, args.seed))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
