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

    python3 dev/capture.py --socket RUN_DIR/llama.sock --fim-socket RUN_DIR/fim.sock [NAME...]
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
        note = "<<< RESPONSE (raw bytes, %d recv() calls, first at %.3fs, last at %.3fs)\n" % (len(self.recvs), first, last)
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


def responses_body(**extra):
    body = {"input": "Write one sentence about the sea.", "max_output_tokens": 8, "temperature": 0, "seed": SEED, "stream": True}
    body.update(extra)
    return body


TOOL_PROMPT = "What is the weather in Paris?"


@capture
def responses(a):
    """/v1/responses streamed: text; reasoning by grammar; a tool call; max_output_tokens; an error."""
    Exchange(a.socket, "POST", "/v1/responses", responses_body()).run().save("50_responses_stream.raw.txt")
    body = responses_body(input="Think step by step: is the sky blue?", max_output_tokens=40, grammar=GRAMMAR_SHORT)
    Exchange(a.socket, "POST", "/v1/responses", body).run().save("51_responses_reasoning_grammar.raw.txt")
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_SCHEMA}]
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
        input="Think step by step: is the sky blue?", max_output_tokens=150, grammar=GRAMMAR_ERR, thinking_budget_tokens=5
    )
    Exchange(a.socket, "POST", "/v1/responses", body).run().save("54_responses_midstream_error.raw.txt")
    Exchange(a.socket, "POST", "/v1/responses", responses_body(stream=False)).run().save("55_responses_nonstream.raw.txt")


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
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "water is a liquid", "signature": ""}, {"type": "text", "text": "yes"}]},
    {"role": "user", "content": "Is fire hot?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "fire burns", "signature": ""}, {"type": "text", "text": "yes"}]},
    {"role": "user", "content": "Is ice cold?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "ice is frozen water", "signature": ""}, {"type": "text", "text": "yes"}]},
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", help="the test server's Unix socket (dev/llama-server.sh start)")
    ap.add_argument("--fim-socket", help="the fill-in-the-middle server's socket (dev/llama-server.sh start-fim)")
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
