#!/usr/bin/env python3
"""Resumable chats behind nginx and HAProxy on a loaded machine, again and again (standard library only;
the test module's helpers, imported by path from the repository root).

    python3 dev/loaded-fronts.py                 # 10 runs, 4 busy processes, a 4 s idle timeout
    python3 dev/loaded-fronts.py --runs 3 --busy 8 --timeout 4 --hold 12 --tokens 32 --cut 1500

What one run does, as ``TestRealFrontsLoaded`` does once per client: a llama-server of the script's own
with one slot (started once, from ``dev/llama-server.sh``'s build), nginx and HAProxy in front of it with
an idle timeout of ``--timeout`` seconds toward the server, each through a proxy that cuts the first
streamed answer of each conversation ``--cut`` bytes past its head (``MidAnswerCut``); ``--busy`` busy
processes beside them all along (``BusyLoad``); another client's long generation holding the slot for
``--hold`` seconds; and meanwhile four resumable chats, one per front and client (``Client``,
``AsyncClient``), queued behind it past the front's timeout, then cut mid-answer.  Each must finish with the
text the same chat gave before the load started (temperature 0, a seed, the prompt processed afresh): the
script prints, per chat, its outcome, how long it took, and what the client told (``Retrying`` and
``Resumed`` events), and at the end how many of all finished exact.  Exit 1 when one did not.

Its run directory is ``LOOPCLIENT_LLAMA_RUN_DIR`` (the server's log goes there), else a temporary one; the
server, the fronts, the proxies and the busy processes are stopped when it ends, whatever ends it.
"""

import argparse
import asyncio
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import loopclient as lc  # noqa: E402 - after the path
import test_loopclient as t  # noqa: E402

KINDS = ("nginx", "haproxy")
CLIENTS = ("Client", "AsyncClient")


def chat(kind, client_kind, url, limits, events):
    """One chat through the front at ``url`` with ``client_kind``: its Completion or the error it ended in."""
    if client_kind == "Client":
        with lc.Client(url, limits=limits) as client:
            return t.loaded_chat(client, kind, events, resumable=True)

    async def main():
        async with lc.AsyncClient(url, limits=limits) as client:
            try:
                return await client.chat(
                    [{"role": "user", "content": t.LOADED_PROMPTS[kind]}],
                    on_event=events.append,
                    resumable=True,
                    **t.LOADED_PARAMS,
                )
            except lc.LoopError as exc:
                return exc

    return asyncio.run(main())


def one_run(number, args, sock, quiet):
    """The chats of run ``number``: a list of (kind, client, ok, line)."""
    limits = t.TestRealFrontsLoaded.limits
    proxies, fronts = {}, {}
    try:
        for kind in KINDS:
            proxies[kind] = t.MidAnswerCut(sock, args.cut)
            fronts[kind] = t.Front(kind, [proxies[kind].path], "session", args.timeout)
        holder = t.Holder(sock, 0)
        released = []
        timer = threading.Timer(args.hold, lambda: released.append(holder.release()))
        timer.start()
        outcomes, events, took = {}, {}, {}
        started = time.monotonic()

        def run(key):
            events[key] = []
            outcomes[key] = chat(key[0], key[1], fronts[key[0]].url, limits, events[key])
            took[key] = time.monotonic() - started

        threads = [threading.Thread(target=run, args=((k, c),), daemon=True) for k in KINDS for c in CLIENTS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(900)
        timer.join(30)
        holder.release()
        results = []
        for key in sorted(outcomes):
            outcome = outcomes[key]
            told = [e for e in events[key] if isinstance(e, (lc.Resumed, lc.Retrying))]
            resumed = [e for e in told if isinstance(e, lc.Resumed)]
            if not isinstance(outcome, lc.Completion):
                ok, what = False, "ended in %r" % (outcome,)
            elif outcome.content != quiet[key[0]]:
                ok, what = False, "text differs from the quiet run's: %r" % outcome.content
            elif not (resumed and resumed[0].offset == 0 and any(e.offset > 0 for e in resumed)):
                ok, what = False, "not queued past the timeout and cut mid-answer: %r" % told
            else:
                ok, what = True, "exact"
            line = "run %d %-7s %-11s %-5s %5.1f s  %s; told %s" % (
                number,
                key[0],
                key[1],
                "OK" if ok else "FAIL",
                took.get(key, float("nan")),
                what,
                ", ".join(_told(e) for e in told),
            )
            results.append((key[0], key[1], ok, line))
        if released != [True]:
            results.append(("holder", "", False, "run %d: the holder ended before the hold did" % number))
        if len(outcomes) < len(threads):
            results.append(("chats", "", False, "run %d: a chat did not end within 900 s" % number))
        return results
    finally:
        for front in fronts.values():
            front.close()
        for proxy in proxies.values():
            proxy.close()


def _told(event):
    if isinstance(event, lc.Resumed):
        return "Resumed(%d, %d)" % (event.offset, event.attempt)
    return "Retrying(%d: %s)" % (event.attempt, event.reason[:60])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--busy", type=int, default=4, help="busy processes beside them (default 4)")
    parser.add_argument("--timeout", type=int, default=4, help="the fronts' idle timeout, s (default 4)")
    parser.add_argument("--hold", type=float, default=12.0, help="how long the slot is held, s (default 12)")
    parser.add_argument("--tokens", type=int, default=t.LOADED_PARAMS["max_tokens"])
    parser.add_argument("--cut", type=int, default=t.TestRealFrontsLoaded.CUT, help="body bytes before the cut")
    args = parser.parse_args(argv)
    t.LOADED_PARAMS["max_tokens"] = args.tokens
    log_dir = os.environ.get("LOOPCLIENT_LLAMA_RUN_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    sock, stop = t.start_own_server(1, log_dir)
    load = None
    try:
        with lc.Client(sock, limits=t.REAL_LIMITS) as direct:
            quiet = {kind: t._real_quiet(direct, kind) for kind in KINDS}
        load = t.BusyLoad(args.busy).start()
        print("quiet texts: %r" % quiet, flush=True)
        results = []
        for number in range(1, args.runs + 1):
            for kind, client, ok, line in one_run(number, args, sock, quiet):
                print(line, flush=True)
                results.append((kind in KINDS, ok))
        chats = [ok for is_chat, ok in results if is_chat]
        print(
            "%d of %d chats finished exact (%d runs, %d busy processes, a %d s idle timeout)"
            % (sum(chats), len(chats), args.runs, args.busy, args.timeout)
        )
        return 0 if all(ok for _, ok in results) else 1
    finally:
        if load is not None:
            load.stop()
        stop()


if __name__ == "__main__":
    sys.exit(main())
