#!/usr/bin/env python3
"""Conversations across several llama-servers: how many prompt tokens the later turns of a conversation
make the servers read, as a ratio to the tokens that were new since the conversation's last prompt (its
reply and the new user line), side by side in one run for

    one server          the first server alone (-np 2): llama-server finds the conversation's slot, or its
                        RAM prompt cache, on its own
    round-robin         both servers behind nginx round-robin, the client sending no session key
                        (Limits(session=False)): a turn may land on the server that never saw it
    nginx, haproxy,     both servers behind each front's README configuration (dev/fronts.py, balance "session":
    caddy               by X-Session-Id), the client sending its session keys (the default)

The workload: CONVERSATIONS conversations, each with its own system prompt of about 500 tokens, TURNS
turns each (a short user line, a reply of REPLY tokens at temperature 0), PARALLEL at a time, all
through ONE shared Client with no header set by hand.  The prompt tokens a turn made the server read are
llama-server's own count (``timings.prompt_n`` of the stream's last chunk); the new tokens are counted by
the first server (``/apply-template`` then ``/tokenize`` of each turn's messages: this turn's prompt less
the last turn's).  Each configuration's system prompts start with a tag of their own, so that no
configuration finds another's conversations in a cache.

    export LOOPCLIENT_LLAMA_RUN_DIR=/tmp/lc-$USER
    S1=$(dev/llama-server.sh start | tail -n 1)
    S2=$(dev/llama-server.sh start $LOOPCLIENT_LLAMA_RUN_DIR/second.sock | tail -n 1)
    python3 dev/sessions.py $S1 $S2                  # every configuration
    python3 dev/sessions.py $S1 $S2 --only nginx     # one (or a comma-separated few)

The fronts are Debian's nginx, HAProxy and Caddy, started from dev/fronts as the tests start them
(test_loopclient.Front).  Standard library only; the exit code is 0 even when a figure misses its
target (1.15): this is a report.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import loopclient as lc  # noqa: E402

TARGET = 1.15
CONFIGS = ("one server", "round-robin", "nginx", "haproxy", "caddy")
WORDS = [
    *("harbour", "lantern", "orchard", "granite", "meadow", "compass", "violet", "ember", "willow", "quartz"),
    *("falcon", "marble", "canyon", "saffron", "glacier", "thistle", "cobalt", "juniper", "beacon", "tundra"),
]


def system_prompt(tag, n):
    """About 500 tokens of text of its own for conversation ``n`` of configuration ``tag``."""
    facts = []
    for i in range(26):
        a, b, c = WORDS[(n * 7 + i) % len(WORDS)], WORDS[(n * 3 + 2 * i) % len(WORDS)], WORDS[(i * 5 + n) % len(WORDS)]
        facts.append("Fact %d of conversation %d: the %s keeps the %s near the %s." % (i + 1, n, a, b, c))
    return "[%s %d] You answer in one short sentence. %s" % (tag, n, " ".join(facts))


USER_LINES = (
    "Name one thing from the facts.",
    "And another one?",
    "Which fact do you like best?",
    "Say it in other words.",
    "Thank you. One more?",
    "What comes next?",
)


class Conversation:
    def __init__(self, tag, n):
        self.messages = [{"role": "system", "content": system_prompt(tag, n)}]
        self.turns = []  # (prompt_n, cache_n, messages sent)

    def turn(self, client, t, reply):
        self.messages.append({"role": "user", "content": USER_LINES[t % len(USER_LINES)]})
        sent = list(self.messages)
        completion = client.chat(sent, max_tokens=reply, temperature=0, seed=1)
        timings = completion.timings or {}
        self.turns.append((timings.get("prompt_n"), timings.get("cache_n"), sent))
        self.messages.append({"role": "assistant", "content": completion.content})


def run_workload(client, tag, conversations, turns, parallel, reply):
    """Run the workload through ``client``: ``parallel`` threads, each taking every ``parallel``-th
    conversation and going round them turn by turn (so that others' turns come between two of one
    conversation's).  The conversations, and the wall time."""
    convs = [Conversation(tag, n) for n in range(conversations)]
    errors = []

    def worker(mine):
        try:
            for t in range(turns):
                for conv in mine:
                    conv.turn(client, t, reply)
        except Exception as exc:  # a report, not a crash: the row says it failed
            errors.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(convs[j::parallel],)) for j in range(parallel)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return convs, time.monotonic() - started


def prompt_tokens(counter, messages):
    """The prompt tokens of ``messages`` as the server renders and tokenizes them."""
    return len(counter.tokenize(counter.apply_template(messages), add_special=True))


def figures(counter, convs):
    """(read, new, misplaced) over the later turns: prompt tokens the servers read, tokens new since the
    conversation's last prompt, and turns that read more than half their whole prompt again."""
    read = new = misplaced = 0
    for conv in convs:
        sizes = [prompt_tokens(counter, sent) for _, _, sent in conv.turns]
        for t in range(1, len(conv.turns)):
            prompt_n = conv.turns[t][0]
            read += prompt_n
            new += sizes[t] - sizes[t - 1]
            if prompt_n > sizes[t] / 2:
                misplaced += 1
    return read, new, misplaced


def configuration(name, servers, stack):
    """(address, Limits) of configuration ``name``; a front it starts is pushed on ``stack``."""
    if name == "one server":
        return servers[0], lc.Limits()
    import test_loopclient as tests  # the fronts as the tests start them, from dev/fronts

    kind, balance = ("nginx", "rr") if name == "round-robin" else (name, "session")
    front = tests.Front(kind, servers, balance, timeout=60)
    stack.append(front)
    return front.url, lc.Limits(servers=2, session=name != "round-robin")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("servers", nargs=2, help="the two servers' sockets (dev/llama-server.sh start)")
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--reply", type=int, default=12, help="reply tokens per turn")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")]
    nonce = "%x" % int(time.time())
    rows = []
    with lc.Client(args.servers[0]) as counter:
        for name in names:
            stack = []
            try:
                address, limits = configuration(name, list(args.servers), stack)
                with lc.Client(address, limits=limits) as client:
                    convs, wall = run_workload(
                        client, "%s %s" % (name, nonce), args.conversations, args.turns, args.parallel, args.reply
                    )
                read, new, misplaced = figures(counter, convs)
                later = args.conversations * (args.turns - 1)
                rows.append((name, read / new, read, new, "%d of %d" % (misplaced, later), wall))
            except lc.LoopError as exc:
                rows.append((name, None, 0, 0, "failed: %s" % exc, 0.0))
            finally:
                for front in stack:
                    front.close()
            print("  %s done" % name, file=sys.stderr)
    print(
        "\n%d conversations x %d turns, %d at a time, replies of %d tokens; later turns' prompt tokens read / new"
        % (args.conversations, args.turns, args.parallel, args.reply)
    )
    print("| configuration | read / new | read | new | turns that read their prompt again | wall |")
    print("|---|---|---|---|---|---|")
    for name, ratio, read, new, misplaced, wall in rows:
        shown = (
            "-"
            if ratio is None
            else "%.2f%s" % (ratio, "" if ratio <= TARGET or name == "round-robin" else " (over %.2f)" % TARGET)
        )
        print("| %s | %s | %d | %d | %s | %.1f s |" % (name, shown, read, new, misplaced, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
