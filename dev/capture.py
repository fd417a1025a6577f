#!/usr/bin/env python3
"""Capture raw exchanges with a real llama-server, byte for byte, into dev/testdata/transcripts.

Standard library only. Each capture sends one HTTP/1.1 request over a Unix socket (Connection: close) and
records every byte received, in the format of the other files there (what test_loopclient's
load_transcript() and _p_testdata_transcript() read):

    >>> REQUEST
    <request bytes, CRLF head and body>\\n\\n<<< RESPONSE (raw bytes, N recv() calls, first at Xs, last at Ys)
    <response bytes exactly as received: status line, headers, chunk-size lines, SSE>

Usage (servers started with dev/llama-server.sh: `start` for the test server, `start-fim` for the
fill-in-the-middle one):

    python3 dev/capture.py --socket RUN_DIR/llama.sock --fim-socket RUN_DIR/fim.sock \
        [--router-socket RUN_DIR/router.sock] [NAME...]
    python3 dev/capture.py --list

With no NAME every capture is made. Generations are at temperature 0 (greedy) with a fixed seed, so the
text is the same from run to run on one machine; ids, timestamps and timings differ. Captures that need
two connections at once (a resumed stream, a queued request) write a .txt note next to their .raw.txt
files with what happened when.
"""

import argparse
import json
import os
import socket
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "testdata", "transcripts")

# the grammar that forces <think> ... </think> as the tokens the template's reasoning tags tokenize to
THINK = 'root ::= <[236820]> <[36345]> <[236813]> [a-z ]{%s} <[954]> <[36345]> <[236813]> "the answer is yes"'
GRAMMAR = THINK % "1,300"
GRAMMAR_SHORT = THINK % "1,20"  # reasoning of a few tokens, then the content
GRAMMAR_ERR = THINK % "20,300"  # with a reasoning budget of 5: an error in mid-stream
SEED = 42
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


# -- the wire ------------------------------------------------------------------------------------------


def build_request(method, path, body=None, headers=()):
    """The request bytes: a JSON body (json.dumps' default separators) or raw bytes, Connection: close."""
    head = "%s %s HTTP/1.1\r\nHost: localhost\r\n" % (method, path)
    data = b""
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head += "Content-Type: application/json\r\nContent-Length: %d\r\n" % len(data)
    for name, value in headers:
        head += "%s: %s\r\n" % (name, value)
    head += "Connection: close\r\n\r\n"
    return head.encode() + data


class Exchange:
    """One request on its own connection; every recv() recorded with its time since the send."""

    def __init__(self, sock_path, method, path, body=None, headers=(), timeout=60.0):
        self.request = build_request(method, path, body, headers)
        self.recvs = []  # (seconds since the send, bytes)
        self.closed_by_us = False
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(sock_path)
        self.t0 = time.monotonic()
        self.sock.sendall(self.request)

    def recv_some(self):
        """One recv(); False at EOF."""
        data = self.sock.recv(65536)
        if not data:
            return False
        self.recvs.append((time.monotonic() - self.t0, data))
        return True

    def run(self, until=None):
        """Receive until EOF, or until ``until(received_bytes)`` is true (then close: a client cut)."""
        try:
            while self.recv_some():
                if until is not None and until(self.raw):
                    self.close()
                    self.closed_by_us = True
                    break
        finally:
            self.close()
        return self

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    @property
    def raw(self):
        return b"".join(d for _, d in self.recvs)

    def transcript(self):
        first = self.recvs[0][0] if self.recvs else 0.0
        last = self.recvs[-1][0] if self.recvs else 0.0
        note = "<<< RESPONSE (raw bytes, %d recv() calls, first at %.3fs, last at %.3fs)\n" % (
            len(self.recvs),
            first,
            last,
        )
        return b">>> REQUEST\n" + self.request + b"\n\n" + note.encode() + self.raw

    def save(self, name):
        path = os.path.join(OUT, name)
        with open(path, "wb") as f:
            f.write(self.transcript())
        print("wrote %s (%d bytes)" % (os.path.relpath(path), os.path.getsize(path)), file=sys.stderr)
        return self

    # -- reading what came back
    def head_body(self):
        head, _, rest = self.raw.partition(b"\r\n\r\n")
        return head, rest

    @property
    def status(self):
        return int(self.raw.split(b" ", 2)[1]) if self.raw else None

    def body(self):
        """The body, de-chunked when chunked (what a resumable stream's offsets count)."""
        head, rest = self.head_body()
        if b"transfer-encoding: chunked" not in head.lower():
            return rest
        return dechunk(rest)[0]

    def json(self):
        return json.loads(self.body())

    def events(self):
        return sse_events(self.body())


def dechunk(data):
    """(body, complete): the chunked-encoded ``data`` decoded; complete when the last chunk (0) was seen."""
    out = b""
    while True:
        line, sep, rest = data.partition(b"\r\n")
        if not sep:
            return out, False
        size = int(line.split(b";")[0], 16)
        if size == 0:
            return out, True
        if len(rest) < size + 2:
            return out + rest[:size], False
        out += rest[:size]
        data = rest[size + 2 :]


def sse_events(body):
    """[(event or None, parsed data or raw str)] of an SSE body; comment lines come as (":", text)."""
    events = []
    for block in body.decode("utf-8", "replace").split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith(":"):
                events.append((":", line))
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            text = "\n".join(data)
            try:
                events.append((event, json.loads(text)))
            except ValueError:
                events.append((event, text))
    return events


def call(sock_path, method, path, body=None, headers=(), timeout=60.0):
    """One whole exchange (not saved)."""
    return Exchange(sock_path, method, path, body, headers, timeout).run()


def slots(sock_path):
    return call(sock_path, "GET", "/slots").json()


def wait_idle(sock_path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(s["is_processing"] for s in slots(sock_path)):
            return True
        time.sleep(0.05)
    return False


def tokenize(sock_path, text, add_special=True):
    """Token ids of ``text``; with add_special the <bos> the server puts before a text prompt (a prompt of
    ids gets none added: without it this model answers <start_of_image> over and over)."""
    return call(sock_path, "POST", "/tokenize", {"content": text, "add_special": add_special}).json()["tokens"]


def in_thread(fn, *args):
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except Exception as e:  # reported by the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


class Notes:
    """A timing note (.txt) for a capture that involves more than one connection."""

    def __init__(self, name):
        self.name = name
        self.lines = []
        self.t0 = time.monotonic()

    def __call__(self, fmt, *args):
        line = "t=%.3fs " % (time.monotonic() - self.t0) + (fmt % args if args else fmt)
        self.lines.append(line)
        print("  " + line, file=sys.stderr)

    def save(self):
        path = os.path.join(OUT, self.name)
        with open(path, "w") as f:
            f.write("\n".join(self.lines) + "\n")
        print("wrote %s" % os.path.relpath(path), file=sys.stderr)


# -- the captures --------------------------------------------------------------------------------------

CAPTURES = []


def capture(fn):
    CAPTURES.append(fn)
    return fn


def completion_body(**extra):
    body = {"prompt": "The sky is", "n_predict": 8, "temperature": 0, "seed": SEED, "stream": True}
    body.update(extra)
    return body


@capture
def completion_stream(a):
    """/completion streamed with return_tokens and n_probs 2 (per-token probs, last chunk with stop_type)."""
    Exchange(a.socket, "POST", "/completion", completion_body(return_tokens=True, n_probs=2)).run().save(
        "40_completion_stream_tokens_probs.raw.txt"
    )


@capture
def completion_progress(a):
    """/completion streamed with return_progress: prompt_progress before the first token."""
    Exchange(a.socket, "POST", "/completion", completion_body(return_progress=True)).run().save(
        "41_completion_stream_progress.raw.txt"
    )


@capture
def completion_token_ids(a):
    """/completion streamed, the prompt as token ids from /tokenize."""
    ids = tokenize(a.socket, "The sky is")
    Exchange(a.socket, "POST", "/completion", completion_body(prompt=ids, return_tokens=True)).run().save(
        "42_completion_stream_token_ids.raw.txt"
    )


@capture
def completion_two_prompts(a):
    """/completion streamed with two prompts: chunks of index 0 and 1 interleave."""
    body = completion_body(prompt=["The sky is", "The grass is"])
    Exchange(a.socket, "POST", "/completion", body).run().save("43_completion_stream_two_prompts.raw.txt")


@capture
def completion_nonstream(a):
    """/completion without streaming, one prompt (an object) and two (an array)."""
    Exchange(a.socket, "POST", "/completion", completion_body(stream=False, return_tokens=True, n_probs=2)).run().save(
        "44_completion_nonstream.raw.txt"
    )
    body = completion_body(stream=False, prompt=["The sky is", "The grass is"])
    Exchange(a.socket, "POST", "/completion", body).run().save("45_completion_nonstream_two_prompts.raw.txt")


@capture
def completion_stop_word(a):
    """/completion streamed, stopped by a stop word (stop_type word, stopping_word)."""
    body = completion_body(n_predict=16, stop=[" the"])
    Exchange(a.socket, "POST", "/completion", body).run().save("46_completion_stream_stop_word.raw.txt")


@capture
def completion_eos(a):
    """/completion streamed to the end of generation: a grammar that ends, then the EOS token (stop_type eos)."""
    body = completion_body(prompt="Think step by step: is the sky blue?", n_predict=40, grammar=GRAMMAR_SHORT)
    Exchange(a.socket, "POST", "/completion", body).run().save("39_completion_stream_eos.raw.txt")


@capture
def completion_midstream_error(a):
    """/completion streamed: the reasoning grammar with {20,300} and a 5-token budget: an error chunk."""
    body = completion_body(
        prompt="Think step by step: is the sky blue?",
        n_predict=150,
        grammar=GRAMMAR_ERR,
        reasoning_budget_tokens=5,
        reasoning_budget_start_tag="<think>",
        reasoning_budget_end_tags=["</think>"],
        reasoning_budget_message="",  # without it no end tag is forced, and the budget never acts
    )
    Exchange(a.socket, "POST", "/completion", body).run().save("47_completion_midstream_error.raw.txt")


@capture
def infill(a):
    """/infill streamed on the fill-in-the-middle model; and the 501 of the plain model."""
    body = {
        "input_prefix": "def add(a, b):\n    ",
        "input_suffix": "\n    return c\n",
        "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
        "n_predict": 8,
        "temperature": 0,
        "seed": SEED,
        "stream": True,
    }
    if a.fim_socket:
        Exchange(a.fim_socket, "POST", "/infill", body).run().save("48_infill_stream.raw.txt")
    Exchange(a.socket, "POST", "/infill", body).run().save("49_infill_not_supported.raw.txt")
    if a.fim_socket:
        # the same recipe as /completion's error in mid-stream
        body = dict(
            body,
            n_predict=150,
            grammar=GRAMMAR_ERR,
            reasoning_budget_tokens=5,
            reasoning_budget_start_tag="<think>",
            reasoning_budget_end_tags=["</think>"],
            reasoning_budget_message="",
        )
        Exchange(a.fim_socket, "POST", "/infill", body).run().save("38_infill_midstream_error.raw.txt")


def responses_body(**extra):
    body = {
        "input": "Write one sentence about the sea.",
        "max_output_tokens": 8,
        "temperature": 0,
        "seed": SEED,
        "stream": True,
    }
    body.update(extra)
    return body


TOOL_PROMPT = "What is the weather in Paris?"


@capture
def responses(a):
    """/v1/responses streamed: text; reasoning by grammar; a tool call; max_output_tokens; an error."""
    Exchange(a.socket, "POST", "/v1/responses", responses_body()).run().save("50_responses_stream.raw.txt")
    body = responses_body(input="Think step by step: is the sky blue?", max_output_tokens=40, grammar=GRAMMAR_SHORT)
    Exchange(a.socket, "POST", "/v1/responses", body).run().save("51_responses_reasoning_grammar.raw.txt")
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER_SCHEMA,
        }
    ]
    body = responses_body(
        input=TOOL_PROMPT,
        max_output_tokens=40,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        logit_bias=[['{"name": "', 10]],
    )
    Exchange(a.socket, "POST", "/v1/responses", body).run().save("52_responses_tool_call.raw.txt")
    body = responses_body(input="Tell me a story about a cat.", max_output_tokens=4)
    Exchange(a.socket, "POST", "/v1/responses", body).run().save("53_responses_max_output_tokens.raw.txt")
    body = responses_body(
        input="Think step by step: is the sky blue?",
        max_output_tokens=150,
        grammar=GRAMMAR_ERR,
        thinking_budget_tokens=5,
    )
    Exchange(a.socket, "POST", "/v1/responses", body).run().save("54_responses_midstream_error.raw.txt")
    Exchange(a.socket, "POST", "/v1/responses", responses_body(stream=False)).run().save(
        "55_responses_nonstream.raw.txt"
    )


def messages_body(**extra):
    body = {
        "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    body.update(extra)
    return body


# earlier assistant turns with thinking blocks: the template renders them as <think>...</think>, and the
# base model, greedy, goes on in the same pattern (a grammar is not passed on by /v1/messages)
FEW_SHOT_THINKING = [
    {"role": "user", "content": "Is water wet?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "water is a liquid", "signature": ""},
            {"type": "text", "text": "yes"},
        ],
    },
    {"role": "user", "content": "Is fire hot?"},
    {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "fire burns", "signature": ""}, {"type": "text", "text": "yes"}],
    },
    {"role": "user", "content": "Is ice cold?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "ice is frozen water", "signature": ""},
            {"type": "text", "text": "yes"},
        ],
    },
    {"role": "user", "content": "Is the sky blue?"},
]


def tool_turn(city, n, thinking=None):
    """An earlier question answered by a tool_use, its tool_result and the answer (few-shot for the base
    model: /v1/messages does not pass logit_bias on, and tool_choice alone does not make it call)."""
    call_blocks = [{"type": "tool_use", "id": "toolu_%d" % n, "name": "get_weather", "input": {"city": city}}]
    if thinking:
        call_blocks.insert(0, {"type": "thinking", "thinking": thinking, "signature": ""})
    return [
        {"role": "user", "content": "What is the weather in %s?" % city},
        {"role": "assistant", "content": call_blocks},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_%d" % n, "content": "sunny"}]},
        {"role": "assistant", "content": "It is sunny in %s." % city},
    ]


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_SCHEMA}]


@capture
def messages(a):
    """/v1/messages streamed: text; reasoning; tool_use; max_tokens; count_tokens; an error."""
    Exchange(a.socket, "POST", "/v1/messages", messages_body()).run().save("60_messages_stream.raw.txt")
    body = messages_body(messages=FEW_SHOT_THINKING, max_tokens=24, thinking={"type": "enabled", "budget_tokens": 100})
    Exchange(a.socket, "POST", "/v1/messages", body).run().save("61_messages_thinking.raw.txt")
    body = messages_body(
        messages=tool_turn("Rome", 1) + tool_turn("Oslo", 2) + [{"role": "user", "content": TOOL_PROMPT}],
        max_tokens=30,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    Exchange(a.socket, "POST", "/v1/messages", body).run().save("62_messages_tool_use.raw.txt")
    body = messages_body(messages=[{"role": "user", "content": "Tell me a story about a cat."}], max_tokens=4)
    Exchange(a.socket, "POST", "/v1/messages", body).run().save("63_messages_max_tokens.raw.txt")
    count = {"messages": body["messages"]}
    Exchange(a.socket, "POST", "/v1/messages/count_tokens", count).run().save("64_messages_count_tokens.raw.txt")
    body = messages_body(messages=FEW_SHOT_THINKING, max_tokens=12, thinking={"type": "enabled", "budget_tokens": 2})
    Exchange(a.socket, "POST", "/v1/messages", body).run().save("65_messages_thinking_budget.raw.txt")
    Exchange(a.socket, "POST", "/v1/messages", messages_body(stream=False)).run().save("66_messages_nonstream.raw.txt")
    # tools offered (tool_choice auto), earlier turns that thought and then called, a thinking budget of 1:
    # the tool call streams, then the chat parser fails: "event: error" in mid-stream
    history = tool_turn("Rome", 1, "i need the weather tool") + tool_turn("Oslo", 2, "i need the weather tool")
    body = messages_body(
        messages=history + [{"role": "user", "content": TOOL_PROMPT}],
        max_tokens=30,
        tools=ANTHROPIC_TOOLS,
        thinking={"type": "enabled", "budget_tokens": 1},
    )
    Exchange(a.socket, "POST", "/v1/messages", body).run().save("67_messages_midstream_error.raw.txt")


CHAT = {
    "messages": [{"role": "user", "content": "Tell me a story about a cat."}],
    "max_tokens": 40,
    "temperature": 0,
    "stream": True,
}


@capture
def resumable(a):
    """A chat stream with X-Conversation-Id, cut after a few events; lookup; replay from 0 and from N; DELETE."""
    notes = Notes("70_resumable_stream.txt")
    conv = "lc-" + os.urandom(16).hex()
    hdr = [("X-Conversation-Id", conv)]
    wait_idle(a.socket)
    first = Exchange(a.socket, "POST", "/v1/chat/completions", CHAT, hdr)
    # cut after the head and three data events
    first.run(until=lambda raw: raw.count(b"data: ") >= 3)
    kept = first.body()
    notes("cut the first connection after %d de-chunked body bytes (%d raw bytes)", len(kept), len(first.raw))
    first.save("70_resumable_stream_cut.raw.txt")
    look = Exchange(a.socket, "POST", "/v1/streams/lookup", {"conversation_ids": [conv]}).run()
    notes("lookup while it runs: %s", look.body().decode())
    look.save("71_resumable_lookup_running.raw.txt")
    resumed = Exchange(a.socket, "GET", "/v1/stream?conv_id=%s&from=%d" % (conv, len(kept))).run()
    notes("GET from=%d: status %s, %d de-chunked bytes", len(kept), resumed.status, len(resumed.body()))
    resumed.save("72_resumable_replay_from_n.raw.txt")
    look = Exchange(a.socket, "POST", "/v1/streams/lookup", {"conversation_ids": [conv]}).run()
    notes("lookup after it ended: %s", look.body().decode())
    look.save("73_resumable_lookup_done.raw.txt")
    whole = Exchange(a.socket, "GET", "/v1/stream?conv_id=%s&from=0" % conv).run()
    whole.save("74_resumable_replay_from_0.raw.txt")
    total = json.loads(look.body())[0]["total_bytes"]
    notes("GET from=0: %d de-chunked bytes; lookup total_bytes %d", len(whole.body()), total)
    notes("cut part + resumed part == replay from 0: %s", kept + resumed.body() == whole.body())
    notes("replay from 0 starts with the cut part: %s", whole.body().startswith(kept))
    past = Exchange(a.socket, "GET", "/v1/stream?conv_id=%s&from=%d" % (conv, total + 100), timeout=5).run()
    notes("GET from=total+100 after the end: status %s, body %r", past.status, past.body()[:200])
    past.save("75_resumable_replay_past_end.raw.txt")
    gone = Exchange(a.socket, "DELETE", "/v1/stream?conv_id=%s" % conv).run()
    notes("DELETE: %r", gone.raw)
    gone.save("76_resumable_delete.raw.txt")
    unknown = Exchange(a.socket, "GET", "/v1/stream?conv_id=%s&from=0" % conv).run()
    notes("GET after DELETE: %r", unknown.raw[-200:])
    unknown.save("77_resumable_unknown.raw.txt")
    look = Exchange(a.socket, "POST", "/v1/streams/lookup", {"conversation_ids": [conv]}).run()
    notes("lookup after DELETE: %s", look.body().decode())
    again = Exchange(a.socket, "DELETE", "/v1/stream?conv_id=%s" % conv).run()
    notes("DELETE again (unknown id): status %s", again.status)
    notes.save()


# -- experiments: what the server does, written down as notes (.txt) ------------------------------------


class SlotPoller:
    """Polls /slots every 50 ms in a thread: [(t, [(id, is_processing, id_task, n_decoded)])]."""

    def __init__(self, sock_path, notes):
        self.sock_path, self.notes, self.seen, self.running = sock_path, notes, [], True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while self.running:
            try:
                now = [
                    (x["id"], x["is_processing"], x.get("id_task"), (x.get("next_token") or [{}])[0].get("n_decoded"))
                    for x in slots(self.sock_path)
                ]
                self.seen.append((time.monotonic() - self.notes.t0, now))
            except OSError:
                pass
            time.sleep(0.05)

    def stop(self):
        self.running = False
        self.thread.join()
        return self.seen

    def busy_slots(self):
        return sorted({i for _, now in self.seen for i, busy, _, _ in now if busy})

    def write(self, every=4):
        for n, (t, now) in enumerate(self.seen):
            if n % every == 0 or n == len(self.seen) - 1:
                self.notes.lines.append("  slots t=%.2fs %s" % (t, now))


LONG_CHAT = {
    "messages": [{"role": "user", "content": "Tell me a story about a cat."}],
    "max_tokens": 30,
    "temperature": 0,
    "stream": True,
}

LONG_BODIES = {
    "/completion": {"prompt": "Tell me a story about a cat.", "n_predict": 30, "temperature": 0, "stream": True},
    "/infill": {
        "input_prefix": "def add(a, b):\n",
        "input_suffix": "\n",
        "n_predict": 30,
        "temperature": 0,
        "stream": True,
    },
    "/v1/chat/completions": LONG_CHAT,
    "/v1/responses": {
        "input": "Tell me a story about a cat.",
        "max_output_tokens": 30,
        "temperature": 0,
        "stream": True,
    },
    "/v1/messages": {
        "messages": [{"role": "user", "content": "Tell me a story about a cat."}],
        "max_tokens": 30,
        "temperature": 0,
        "stream": True,
    },
}


def first_byte_time(ex):
    return ex.recvs[0][0] if ex.recvs else None


@capture
def id_slot(a):
    """Per endpoint: is id_slot honoured (/slots while it runs), and does a second request on the same
    slot get no byte until the first ends?"""
    notes = Notes("80_id_slot_per_endpoint.txt")
    for path, body in LONG_BODIES.items():
        sock = a.fim_socket if path == "/infill" else a.socket
        if sock is None:
            continue
        wait_idle(sock)
        for want in (1, 0):
            poll = SlotPoller(sock, notes)
            Exchange(sock, "POST", path, dict(body, id_slot=want)).run()
            poll.stop()
            notes("%s id_slot=%d: busy slots seen %s", path, want, poll.busy_slots())
        wait_idle(sock)
        t_send = time.monotonic()
        first = Exchange(sock, "POST", path, dict(body, id_slot=1))
        t1, box1 = in_thread(first.run)
        time.sleep(0.3)
        second = Exchange(
            sock, "POST", path, dict(body, id_slot=1, **({"n_predict": 4} if "n_predict" in body else {}))
        )
        t_second = time.monotonic() - t_send
        t2, box2 = in_thread(second.run)
        t1.join()
        t2.join()
        end_first = first.recvs[-1][0]
        notes(
            "%s two requests with id_slot 1: first ended at %.3fs; second sent at %.3fs, its first byte at %.3fs "
            "(%.3fs after the first ended)",
            path,
            end_first,
            t_second,
            t_second + first_byte_time(second),
            t_second + first_byte_time(second) - end_first,
        )
    notes.save()


@capture
def progress(a):
    """return_progress on /v1/responses and /v1/messages: where prompt_progress appears, if at all."""
    notes = Notes("81_return_progress.txt")
    long_input = (
        "The lighthouse keeper kept a log of every ship that passed the point. " * 6 + "Question: what did he keep?"
    )
    r = Exchange(
        a.socket, "POST", "/v1/responses", responses_body(input=long_input, max_output_tokens=3, return_progress=True)
    ).run()
    r.save("56_responses_stream_progress.raw.txt")
    for ev, d in r.events():
        if isinstance(d, dict) and "prompt_progress" in d:
            notes("/v1/responses: event %s carries prompt_progress %s", ev, d["prompt_progress"])
    m = Exchange(
        a.socket,
        "POST",
        "/v1/messages",
        messages_body(
            messages=[{"role": "user", "content": long_input + " again"}], max_tokens=3, return_progress=True
        ),
    ).run()
    notes("/v1/messages: prompt_progress in the body: %s", b"prompt_progress" in m.body())
    notes.save()


@capture
def same_text(a):
    """At temperature 0: /v1/messages, /v1/responses and /v1/chat/completions, the same prompt and limit."""
    notes = Notes("82_same_text_three_endpoints.txt")
    for prompt, limit in (("Write one sentence about the sea.", 16), ("Tell me a story about a cat.", 24)):
        msgs = [{"role": "user", "content": prompt}]
        chat = call(
            a.socket, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": limit, "temperature": 0}
        ).json()
        resp = call(
            a.socket, "POST", "/v1/responses", {"input": prompt, "max_output_tokens": limit, "temperature": 0}
        ).json()
        mess = call(a.socket, "POST", "/v1/messages", {"messages": msgs, "max_tokens": limit, "temperature": 0}).json()
        texts = (
            chat["choices"][0]["message"]["content"],
            resp["output"][0]["content"][0]["text"],
            mess["content"][0]["text"],
        )
        counts = (chat["usage"]["completion_tokens"], resp["usage"]["output_tokens"], mess["usage"]["output_tokens"])
        prompts = (
            chat["usage"]["prompt_tokens"],
            resp["usage"]["input_tokens"],
            mess["usage"]["input_tokens"] + mess["usage"].get("cache_read_input_tokens", 0),
        )
        notes("%r max %d: texts chat/responses/messages %r; equal %s", prompt, limit, texts, len(set(texts)) == 1)
        notes("  completion tokens %s; prompt tokens %s (messages: input + cache_read)", counts, prompts)
        count = call(a.socket, "POST", "/v1/messages/count_tokens", {"messages": msgs}).json()
        notes("  /v1/messages/count_tokens %s", count)
    notes.save()


@capture
def control(a):
    """reasoning_control on /v1/responses and /v1/messages: which id does /v1/chat/completions/control take?"""
    notes = Notes("83_reasoning_control_other_endpoints.txt")
    # chat, for reference
    chat = {
        "messages": [{"role": "user", "content": "Think step by step: is the sky blue?"}],
        "max_tokens": 100,
        "temperature": 0,
        "stream": True,
        "grammar": GRAMMAR,
        "reasoning_control": True,
    }
    for path, body in (
        ("/v1/chat/completions", chat),
        (
            "/v1/responses",
            responses_body(
                input="Think step by step: is the sky blue?",
                max_output_tokens=100,
                grammar=GRAMMAR,
                reasoning_control=True,
            ),
        ),
        (
            "/v1/messages",
            messages_body(
                messages=FEW_SHOT_THINKING,
                max_tokens=100,
                reasoning_control=True,
                thinking={"type": "enabled", "budget_tokens": 50},
            ),
        ),
    ):
        wait_idle(a.socket)
        ex = Exchange(a.socket, "POST", path, body)
        ids, sent = [], []

        def until(raw, ex=ex):
            if sent:
                return False
            events = sse_events(dechunk(raw.partition(b"\r\n\r\n")[2])[0])
            if len(events) < 4:
                return False
            for _, d in events:
                if isinstance(d, dict):
                    for key in ("id",):
                        if isinstance(d.get(key), str):
                            ids.append(d[key])
                    for sub in ("response", "message", "item"):
                        if isinstance(d.get(sub), dict) and isinstance(d[sub].get("id"), str):
                            ids.append(d[sub]["id"])
            for cid in sorted(set(ids)):
                r = call(a.socket, "POST", "/v1/chat/completions/control", {"id": cid, "action": "reasoning_end"})
                sent.append((cid, r.status, r.body().decode()))
            return False

        ex.run(until=until)
        for cid, status, answer in sent:
            notes("%s: control with id %s -> %s %s", path, cid, status, answer)
        kinds = [(e, (d.get("type") if isinstance(d, dict) else d)) for e, d in ex.events()]
        reasoning = sum(
            1
            for e, d in ex.events()
            if isinstance(d, dict)
            and (
                "reasoning_content" in json.dumps(d.get("choices", ""))
                or d.get("type") == "response.reasoning_text.delta"
                or (isinstance(d.get("delta"), dict) and d["delta"].get("type") == "thinking_delta")
            )
        )
        notes(
            "  %d reasoning deltas in all; chatcmpl anywhere in the body: %s; events: %d",
            reasoning,
            b"chatcmpl" in ex.body(),
            len(kinds),
        )
        ex.save(
            {
                "/v1/chat/completions": "84_chat_reasoning_control.raw.txt",
                "/v1/responses": "85_responses_reasoning_control.raw.txt",
                "/v1/messages": "86_messages_reasoning_control.raw.txt",
            }[path]
        )
    notes.save()


@capture
def resumable_endpoints(a):
    """X-Conversation-Id on /completion, /v1/responses, /v1/messages: buffered and replayed too?"""
    notes = Notes("78_resumable_other_endpoints.txt")
    for path, body in (
        ("/completion", completion_body(n_predict=16)),
        ("/v1/responses", responses_body(max_output_tokens=16)),
        ("/v1/messages", messages_body(max_tokens=16)),
        ("/v1/chat/completions", dict(CHAT, max_tokens=16)),
    ):
        wait_idle(a.socket)
        conv = "lc-" + os.urandom(16).hex()
        first = Exchange(a.socket, "POST", path, body, [("X-Conversation-Id", conv)])
        first.run(until=lambda raw: raw.count(b"data: ") >= 2)
        kept = first.body()
        look = call(a.socket, "POST", "/v1/streams/lookup", {"conversation_ids": [conv]}).body().decode()
        rest = call(a.socket, "GET", "/v1/stream?conv_id=%s&from=%d" % (conv, len(kept)))
        whole = call(a.socket, "GET", "/v1/stream?conv_id=%s&from=0" % conv)
        ok = kept + rest.body() == whole.body()
        notes(
            "%s: cut after %d body bytes; lookup %s; resumed %s %d bytes; prefix+rest == replay: %s; ends %r",
            path,
            len(kept),
            look,
            rest.status,
            len(rest.body()),
            ok,
            whole.body()[-60:],
        )
        if path != "/v1/chat/completions":
            call(a.socket, "DELETE", "/v1/stream?conv_id=%s" % conv)
    bad = call(a.socket, "GET", "/v1/stream?conv_id=%s&from=abc" % conv)
    notes("GET /v1/stream?conv_id=<known>&from=abc: %s %s", bad.status, bad.body().decode())
    call(a.socket, "DELETE", "/v1/stream?conv_id=%s" % conv)
    bad = call(a.socket, "GET", "/v1/stream?from=0")
    notes("GET /v1/stream?from=0 (no conv_id): %s %s", bad.status, bad.body().decode())
    bad = call(a.socket, "DELETE", "/v1/stream")
    notes("DELETE /v1/stream (no conv_id): %s %s", bad.status, bad.body().decode())
    notes.save()


@capture
def resumable_cancel(a):
    """A resumable chat cut by the client: does generation go on until its end, or until DELETE?"""
    notes = Notes("79_resumable_cancel_delete.txt")
    for delete in (False, True):
        # without DELETE: 40 tokens, waited for to their end; with DELETE: 200, cut short by it
        long_chat = dict(CHAT, max_tokens=200 if delete else 40, ignore_eos=True, id_slot=0)
        wait_idle(a.socket)
        conv = "lc-" + os.urandom(16).hex()
        poll = SlotPoller(a.socket, notes)
        first = Exchange(a.socket, "POST", "/v1/chat/completions", long_chat, [("X-Conversation-Id", conv)])
        first.run(until=lambda raw: raw.count(b"data: ") >= 3)
        notes("cut the connection (delete=%s)", delete)
        if delete:
            time.sleep(0.5)
            r = call(a.socket, "DELETE", "/v1/stream?conv_id=%s" % conv)
            notes("DELETE -> %s", r.status)
        t_cut = time.monotonic()
        since = t_cut - notes.t0
        while time.monotonic() - t_cut < 30:
            if poll.seen and not poll.seen[-1][1][0][1] and time.monotonic() - t_cut > 0.3:
                break
            time.sleep(0.05)
        poll.stop()
        free = ["%.3fs" % t for t, now in poll.seen if not now[0][1] and t > since]
        notes(
            "slot 0 free again at t=%s; max n_decoded seen %s",
            free[0] if free else None,
            max((now[0][3] or 0) for _, now in poll.seen),
        )
        look = call(a.socket, "POST", "/v1/streams/lookup", {"conversation_ids": [conv]}).body().decode()
        notes("lookup afterwards: %s", look)
        if not delete:
            replay = call(a.socket, "GET", "/v1/stream?conv_id=%s&from=0" % conv).events()
            last = [d for _, d in replay if isinstance(d, dict) and d.get("timings")]
            notes(
                "replay: %d events, the last with timings: finish %s, predicted_n %s",
                len(replay),
                last[-1]["choices"][0]["finish_reason"] if last else None,
                last[-1]["timings"]["predicted_n"] if last else None,
            )
        poll.write(every=5)
        call(a.socket, "DELETE", "/v1/stream?conv_id=%s" % conv)
    notes.save()


@capture
def resumable_queued(a):
    """A resumable request queued behind a busy slot, its connection closed before its head."""
    notes = Notes("87_resumable_queued_lost_head.txt")
    wait_idle(a.socket)
    poll = SlotPoller(a.socket, notes)
    busy = Exchange(a.socket, "POST", "/v1/chat/completions", dict(CHAT, max_tokens=120, ignore_eos=True, id_slot=0))
    tb, _ = in_thread(busy.run)
    time.sleep(0.3)
    conv = "lc-" + os.urandom(16).hex()
    queued = Exchange(
        a.socket, "POST", "/v1/chat/completions", dict(CHAT, max_tokens=10, id_slot=0), [("X-Conversation-Id", conv)]
    )
    time.sleep(0.2)
    queued.close()
    notes("queued request sent and its connection closed before any byte")
    while tb.is_alive():
        notes(
            "lookup while the slot is busy: %s",
            call(a.socket, "POST", "/v1/streams/lookup", {"conversation_ids": [conv]}).body().decode(),
        )
        tb.join(0.5)
    notes("the busy request ended")
    for _ in range(8):
        notes("lookup: %s", call(a.socket, "POST", "/v1/streams/lookup", {"conversation_ids": [conv]}).body().decode())
        time.sleep(0.5)
    poll.stop()
    r = call(a.socket, "GET", "/v1/stream?conv_id=%s&from=0" % conv, timeout=10)
    notes("GET /v1/stream from=0: %s, %d body bytes", r.status, len(r.body()))
    notes("tasks seen on slot 0: %s", sorted({now[0][2] for _, now in poll.seen}))
    poll.write(every=10)
    notes.save()


@capture
def router_resumable(a):
    """Router mode: do /v1/streams/lookup, GET /v1/stream and DELETE need ?model=?"""
    if not a.router_socket:
        print("  (no --router-socket: skipped)", file=sys.stderr)
        return
    r = a.router_socket
    notes = Notes("88_router_resumable.txt")
    conv = "lc-" + os.urandom(16).hex()
    body = dict(CHAT, model="alpha", max_tokens=30)
    first = Exchange(r, "POST", "/v1/chat/completions", body, [("X-Conversation-Id", conv)], timeout=120)
    first.run(until=lambda raw: raw.count(b"data: ") >= 3)
    kept = first.body()
    notes("cut the first connection after %d body bytes (status %s)", len(kept), first.status)
    for path in ("/v1/streams/lookup", "/v1/streams/lookup?model=alpha"):
        x = call(r, "POST", path, {"conversation_ids": [conv]})
        notes("POST %s: %s %s", path, x.status, x.body().decode()[:300])
    x = Exchange(r, "GET", "/v1/stream?conv_id=%s&from=%d" % (conv, len(kept)), timeout=60).run()
    x.save("89_router_replay_from_n.raw.txt")
    whole = call(r, "GET", "/v1/stream?conv_id=%s&from=0&model=alpha" % conv)
    notes(
        "GET /v1/stream from=N without model: %s, %d bytes; with model=alpha from 0: %s, %d bytes; prefix+rest == replay: %s",
        x.status,
        len(x.body()),
        whole.status,
        len(whole.body()),
        kept + x.body() == whole.body(),
    )
    x = call(r, "DELETE", "/v1/stream?conv_id=%s" % conv)
    notes("DELETE without model: %s", x.status)
    x = call(r, "POST", "/v1/streams/lookup", {"conversation_ids": [conv]})
    notes("lookup after DELETE: %s %s", x.status, x.body().decode())
    x = call(r, "GET", "/v1/stream?conv_id=%s&from=0" % conv)
    notes("GET after DELETE: %s %s", x.status, x.body().decode()[:200])
    x = call(r, "GET", "/v1/stream?conv_id=lc-unknown&from=0")
    notes("GET unknown id: %s %s", x.status, x.body().decode()[:200])
    notes.save()


def oai_completion_body(**extra):
    body = {"prompt": "The sky is", "max_tokens": 8, "temperature": 0, "seed": SEED, "stream": True}
    body.update(extra)
    return body


@capture
def openai_completions(a):
    """/v1/completions (OpenAI text completions) streamed: logprobs 2 (90), two prompts with logprobs (91),
    return_progress (92), an error in mid-stream (96); unstreamed, two prompts with logprobs (93); echo
    (94) and suffix (95) refused; /v1/responses/input_tokens (97)."""
    path = "/v1/completions"
    Exchange(a.socket, "POST", path, oai_completion_body(logprobs=2)).run().save(
        "90_completions_oai_stream_logprobs.raw.txt"
    )
    body = oai_completion_body(prompt=["The sky is", "The grass is"], logprobs=2)
    Exchange(a.socket, "POST", path, body).run().save("91_completions_oai_stream_two_prompts.raw.txt")
    Exchange(a.socket, "POST", path, oai_completion_body(return_progress=True)).run().save(
        "92_completions_oai_stream_progress.raw.txt"
    )
    body = oai_completion_body(prompt=["The sky is", "The grass is"], logprobs=2, stream=False)
    Exchange(a.socket, "POST", path, body).run().save("93_completions_oai_nonstream_two_prompts.raw.txt")
    Exchange(a.socket, "POST", path, oai_completion_body(echo=True)).run().save("94_completions_oai_echo.raw.txt")
    Exchange(a.socket, "POST", path, oai_completion_body(suffix=" and blue.")).run().save(
        "95_completions_oai_suffix.raw.txt"
    )
    body = oai_completion_body(
        prompt="Think step by step: is the sky blue?",
        max_tokens=150,
        grammar=GRAMMAR_ERR,
        reasoning_budget_tokens=5,
        reasoning_budget_start_tag="<think>",
        reasoning_budget_end_tags=["</think>"],
        reasoning_budget_message="",
    )
    Exchange(a.socket, "POST", path, body).run().save("96_completions_oai_midstream_error.raw.txt")
    body = {"input": "Write one sentence about the sea.", "instructions": "Be brief."}
    Exchange(a.socket, "POST", "/v1/responses/input_tokens", body).run().save("97_responses_input_tokens.raw.txt")


def wait_status(r, name, want, timeout=90.0):
    """Until GET /models shows ``name`` with status ``want``: its status object."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in call(r, "GET", "/models").json()["data"]:
            if m["id"] == name and m["status"]["value"] == want:
                return m["status"]
        time.sleep(0.1)
    raise RuntimeError("%s never became %s" % (name, want))


def watch_until(r, needle, action, timeout=90.0):
    """GET /models/sse, ``action()`` once it is open, read until ``needle`` is in the bytes: the Exchange."""
    ex = Exchange(r, "GET", "/models/sse", timeout=timeout)
    t, box = in_thread(ex.run, lambda raw: needle in raw)
    time.sleep(0.5)  # the route sends nothing until something happens: give it time to subscribe
    action()
    t.join(timeout)
    if "error" in box:
        raise box["error"]
    return ex


@capture
def router_models_sse(a):
    """Router mode: GET /models/sse while beta is unloaded and loaded again (98); a model file that cannot
    load (99, and the note 99): its events, /models/load's answer and /models' status of it."""
    if not a.router_socket:
        print("  (no --router-socket: skipped)", file=sys.stderr)
        return
    r = a.router_socket
    notes = Notes("99_router_load_broken.txt")
    status = {m["id"]: m["status"]["value"] for m in call(r, "GET", "/models").json()["data"]}
    if status.get("beta") == "loading":
        wait_status(r, "beta", "loaded")
    if status.get("beta") != "unloaded":
        call(r, "POST", "/models/unload", {"model": "beta"})
        wait_status(r, "beta", "unloaded")

    def load_beta():
        notes("POST /models/load beta: %s", call(r, "POST", "/models/load", {"model": "beta"}).body().decode())

    ex = watch_until(r, b'"model":"beta","event":"status_change","data":{"status":"loaded"', load_beta)
    notes("GET /models/sse head: %r", ex.head_body()[0].decode())
    notes("events while beta loaded: %s", [d for _, d in ex.events()])
    ex.save("98_router_models_sse.raw.txt")
    models = a.router_models or r[: -len(".sock")] + ".models"
    broken = os.path.join(models, "broken.gguf")
    with open(broken, "wb") as f:
        f.write(b"GGUF" + b"\0" * 60)  # the magic, then nothing a loader can read
    try:
        reload = call(r, "GET", "/models?reload=1").json()
        notes("after GET /models?reload=1: %s", [(m["id"], m["status"]["value"]) for m in reload["data"]])

        def load_broken():
            x = call(r, "POST", "/models/load", {"model": "broken"})
            notes("POST /models/load broken: %s %s", x.status, x.body().decode())

        ex = watch_until(r, b'"model":"broken","event":"status_change","data":{"status":"unloaded"', load_broken)
        notes("events while broken loaded: %s", [d for _, d in ex.events()])
        ex.save("99_router_load_broken.raw.txt")
        for m in call(r, "GET", "/models").json()["data"]:
            if m["id"] == "broken":
                notes("GET /models shows broken as: %s", json.dumps(m["status"]))
        x = call(r, "POST", "/v1/chat/completions", dict(CHAT, model="broken", stream=False))
        notes("a chat request for broken: %s %s", x.status, x.body().decode()[:300])
        x = call(r, "POST", "/models/load", {"model": "nonesuch"})
        notes("POST /models/load nonesuch: %s %s", x.status, x.body().decode())
        x = call(r, "POST", "/models/load", {"model": "beta"})
        notes("POST /models/load beta (loaded): %s %s", x.status, x.body().decode())
    finally:
        os.unlink(broken)
        call(r, "GET", "/models?reload=1")
    notes.save()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", help="the test server's Unix socket (dev/llama-server.sh start)")
    ap.add_argument("--fim-socket", help="the fill-in-the-middle server's socket (dev/llama-server.sh start-fim)")
    ap.add_argument(
        "--router-socket", help="a router's socket (dev/llama-server.sh start-router), for router_resumable"
    )
    ap.add_argument(
        "--router-models", help="the router's --models-dir (default: its socket with .sock replaced by .models)"
    )
    ap.add_argument("--list", action="store_true", help="list the captures")
    ap.add_argument("names", nargs="*")
    a = ap.parse_args()
    if a.list:
        for fn in CAPTURES:
            print("%-24s %s" % (fn.__name__, fn.__doc__))
        return 0
    if not a.socket:
        ap.error("--socket is required")
    names = a.names or [fn.__name__ for fn in CAPTURES]
    known = {fn.__name__: fn for fn in CAPTURES}
    for name in names:
        if name not in known:
            ap.error("unknown capture %r (see --list)" % name)
    os.makedirs(OUT, exist_ok=True)
    for name in names:
        print("== %s" % name, file=sys.stderr)
        wait_idle(a.socket)
        known[name](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
