"""Mutations of loopclient.py that the fault tests must catch: ``python3 dev/mutations.py``.

Each mutation is a small change in a code path the fault table's rows run (a wrong error class, a missing
retry, an off-by-one in a cap, a skipped close, a wrong message or attribute).  The script applies each one
to a copy of loopclient.py in a temporary directory, beside a copy of test_loopclient.py (``dev`` and the
README linked in), runs the tests that cover that path, and reports the mutation caught when they fail.
Before the mutations it runs the same tests on the unchanged copy, which must pass: a test that fails
without a mutation proves nothing.

    python3 dev/mutations.py                      # each mutation against the tests as they are
    python3 dev/mutations.py --old COMMIT         # also against test_loopclient.py as of COMMIT
    python3 dev/mutations.py --only NAME ...      # some of them

With ``--old``, each mutation also runs against the test file of that commit: the tests it names in
``old`` (the TestFault* methods that stated the fault before the fault table became its one statement),
and that commit's TestDifferential tests named in ``new``, so the table can be shown to catch what the
methods it replaced caught.  What it printed when the TestFault* methods that restated a row were removed
(``--old 12adba1``, the commit before): every mutation the old methods caught, the table catches; twelve of
the seventeen passed the old differential test, which checked the error class, the budget and that the
clients agreed, not the events, causes, messages and requests a row states.

    mutation                           old TestFault*     old TestDifferential   TestDifferential
    connect-error-cause                caught             missed                 caught
    error-page-title                   caught             missed                 caught
    error-code-not-decimal             caught             missed                 caught
    backoff-halved                     caught             missed                 caught
    capacity-message                   caught             missed                 caught
    unseen-slots-asked-every-poll      caught             missed                 caught
    head-cap-too-big                   caught             caught                 caught
    line-cap-off-by-one                caught             missed                 caught
    thinking-tokens-off-by-one         caught             missed                 caught
    busy-slot-waits-idle               caught             missed                 caught
    async-close-skipped                caught             missed                 caught
    event-503-not-retried              caught             caught                 caught
    body-cap-off-by-one                caught             caught                 caught
    connect-error-address              caught             missed                 caught
    hint-past-budget-waited            caught             missed                 caught
    close-mid-chunk-wrong-class        caught             caught                 caught
    lost-plain-stream-sent-again       caught             caught                 caught

The last two are in the paths of fetch(), timeout= and stream_route(), whose TestFaultAnswers methods went
later (``--old 0c9fa40``, the commit that brought them):

    deadline-phase-wrong               caught             missed                 caught
    text-chunk-dropped                 caught             missed                 caught

The last two came with the rows of a ``/slots`` answer later than ``poll``, which the test as it was
before them did not have (its ``old`` is that test: ``--old`` of the commit before them shows it missed).

Exit status 1 when a mutation is missed (or a test fails unmutated).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: ``text`` in loopclient.py (exactly once) replaced by ``mutant``; ``new``: the tests (of today's
#: test_loopclient.py) that must catch it; ``old``: the TestFault* tests that stated the fault before.
Mutation = collections.namedtuple("Mutation", "name what text mutant new old")

MUTATIONS = [
    Mutation(
        "connect-error-cause",
        "a ConnectError without its __cause__ (the OSError)",
        "                raise _connect_error(self.addr, exc) from exc\n",
        "                raise _connect_error(self.addr, exc) from None\n",
        ["TestDifferential.test_connecting"],
        [
            "TestFaultConnect.test_socket_file_missing_single_shot",
            "TestFaultConnect.test_socket_file_without_listener_single_shot",
        ],
    ),
    Mutation(
        "error-page-title",
        "an error page's message keeps the <title> tags",
        "            text = found.group(1)\n",
        "            text = found.group(0)\n",
        ["TestDifferential.test_behind_fronts"],
        ["TestFaultFronts.test_an_error_page_is_one_line_naming_the_front"],
    ),
    Mutation(
        "error-code-not-decimal",
        'an error event\'s code "²" read as 0, not None',
        "        if not isinstance(code, int) or isinstance(code, bool):\n            code = None\n",
        "        if not isinstance(code, int) or isinstance(code, bool):\n            code = 0\n",
        ["TestDifferential.test_json_payloads"],
        ["TestFaultJSON.test_error_code_not_a_decimal"],
    ),
    Mutation(
        "backoff-halved",
        "the first retry waits half the backoff (a Retry-After of 0 s or a bad one then waits 0.1 s)",
        "        delay = self.delay * (1.0 - 0.25 * random.random())\n",
        "        delay = self.delay * 0.5 * (1.0 - 0.25 * random.random())\n",
        ["TestDifferential.test_503_with_retry_after"],
        [
            "TestFaultRetryAfter.test_date_in_the_past",
            "TestFaultRetryAfter.test_negative",
            "TestFaultRetryAfter.test_malformed",
        ],
    ),
    Mutation(
        "capacity-message",
        "the WaitTimeoutError of a 429 for ever no longer says it answered 429 (at capacity)",
        "answered 429 (at capacity) for {waited:.1f} s (busy_wait)",
        "answered 429 for {waited:.1f} s (busy_wait)",
        ["TestDifferential.test_behind_proxies"],
        ["TestFaultProxies.test_429_past_busy_wait_is_a_wait_timeout_naming_the_429"],
    ),
    Mutation(
        "unseen-slots-asked-every-poll",
        "a /slots that is not served is asked again at every poll, not every 30 s",
        "UNSEEN_POLL = 30.0\n",
        "UNSEEN_POLL = 0.0\n",
        ["TestDifferential.test_behind_proxies"],
        ["TestFaultProxies.test_slots_not_served_while_waiting_counts_under_busy_wait"],
    ),
    Mutation(
        "head-cap-too-big",
        "the response head's cap is 16 MiB, not 64 KiB: a 10 MB header line is read whole",
        "MAX_HEAD = 64 * 1024\n",
        "MAX_HEAD = 16 * 1024 * 1024\n",
        ["TestDifferential.test_the_response_head"],
        [
            "TestFaultHead.test_ten_megabytes_of_headers",
            "TestFaultHeadSockets.test_ten_megabytes_of_headers",
            "TestFaultHeadSocketsAsync.test_ten_megabytes_of_headers",
        ],
    ),
    Mutation(
        "line-cap-off-by-one",
        "an unfinished SSE line of max_line bytes is already too long",
        "            if len(buf) + rest > max_line:\n",
        "            if len(buf) + rest >= max_line:\n",
        ["TestDifferential.test_sse_lines_and_events"],
        [
            "TestFaultSSE.test_two_mib_line_trickled",
            "TestFaultSSESockets.test_two_mib_line_trickled",
            "TestFaultSSESocketsAsync.test_two_mib_line_trickled",
        ],
    ),
    Mutation(
        "thinking-tokens-off-by-one",
        "ThinkingOverrunError.tokens one more than the cap when ending the reasoning failed",
        "    return _hinted(ThinkingOverrunError(text, tokens), _UNCAP)\n",
        "    return _hinted(ThinkingOverrunError(text, tokens + 1), _UNCAP)\n",
        ["TestDifferential.test_the_reasoning_control_endpoint"],
        ["TestFaultControl.test_control_404"],
    ),
    Mutation(
        "busy-slot-waits-idle",
        "every Waiting says the slot is idle, a busy one too",
        "        yield [Waiting(state == BUSY, slots_known=state not in _UNSEEN)]\n",
        "        yield [Waiting(False, slots_known=state not in _UNSEEN)]\n",
        ["TestDifferential.test_silence_pings_and_the_liveness_rule"],
        ["TestFaultWaits.test_stall_before_head_busy_slot"],
    ),
    Mutation(
        "async-close-skipped",
        "AsyncClient's connection is never closed (its transport is left open on the loop)",
        "                self._transport.abort()\n        self._alarm.ring()\n",
        "                pass\n        self._alarm.ring()\n",
        ["TestDifferential.test_sse_lines_and_events"],
        ["TestFaultSSESocketsAsync.test_two_mib_line_trickled"],
    ),
    Mutation(
        "event-503-not-retried",
        "an error event with code 503 (or unavailable_error) is not retried",
        '    return err.code == 503 or err.type in ("unavailable_error", "overloaded_error")\n',
        "    return False\n",
        ["TestDifferential.test_error_statuses_and_error_events"],
        [
            "TestFaultErrors.test_error_event_first_503_is_retried",
            "TestFaultErrors.test_legacy_error_line_first_503_is_retried",
        ],
    ),
    Mutation(
        "body-cap-off-by-one",
        "a single-shot answer announcing max_body + 1 bytes is read (the cap is passed by one byte)",
        "            if self._max_body is not None and length > self._max_body:\n",
        "            if self._max_body is not None and length > self._max_body + 1:\n",
        ["TestDifferential.test_body_framing"],
        [
            "TestFaultFraming.test_single_shot_length_over_max_body",
            "TestFaultFramingSockets.test_single_shot_length_over_max_body",
        ],
    ),
    Mutation(
        "connect-error-address",
        "a ConnectError's address is not the one the client was given",
        '        text = "cannot connect to %s: %s" % (addr.text, exc)\n    err = _hinted(ConnectError(text, addr.text), _START_IT)\n',
        '        text = "cannot connect to %s: %s" % (addr.text, exc)\n    err = _hinted(ConnectError(text, None), _START_IT)\n',
        ["TestDifferential.test_connecting"],
        ["TestFaultConnect.test_socket_file_missing_single_shot"],
    ),
    Mutation(
        "hint-past-budget-waited",
        "a Retry-After past what is left of the budget is waited out instead of ending the wait at once",
        "        if left <= 0 or (retry.hint is not None and retry.hint > left):  # a hint past the budget: now\n",
        "        if left <= 0:\n",
        ["TestDifferential.test_503_with_retry_after", "TestDifferential.test_behind_proxies"],
        [
            "TestFaultRetryAfter.test_huge",
            "TestFaultRetryAfter.test_date_beyond_load_wait",
            "TestFaultProxies.test_a_429_hint_past_busy_wait_ends_the_wait_at_once",
        ],
    ),
    Mutation(
        "close-mid-chunk-wrong-class",
        "a connection closed in the middle of a chunk is ProtocolError, not StreamClosedError",
        '            raise StreamClosedError("the connection closed in the middle of a chunk")\n',
        '            raise ProtocolError("the connection closed in the middle of a chunk")\n',
        ["TestDifferential.test_body_framing"],
        ["TestFaultFraming.test_close_mid_chunk", "TestFaultFraming.test_body_shorter_than_its_length_stream"],
    ),
    Mutation(
        "lost-plain-stream-sent-again",
        "a plain (not resumable) stream whose connection is lost is sent again, delivered output and all",
        "        if req.conversation is None:\n"
        '            raise _hinted(loss, _CUT % ("in the middle of the answer" if pump.head else "before answering"))\n',
        "        if req.conversation is None:\n"
        "            self.retry = _Retry(str(loss), None, loss)\n"
        "            return self._back_off\n",
        ["TestDifferential.test_connecting"],
        [
            "TestFaultConnect.test_eof_before_head_is_not_retried",
            "TestFaultReset.test_reset_mid_stream_is_not_replayed",
        ],
    ),
    Mutation(
        "deadline-phase-wrong",
        "a call's timeout= running out while it reads the answer says it ran out while it waited",
        '_RECV: "answer",',
        '_RECV: "wait",',
        ["TestDifferential.test_answers_as_the_server_gave_them"],
        [
            "TestFaultAnswers.test_timeout_on_a_silent_server",
            "TestFaultAnswers.test_timeout_on_an_answer_that_trickles",
        ],
    ),
    Mutation(
        "text-chunk-dropped",
        "stream_route() drops a data event that is not JSON instead of giving its text as a Chunk",
        "        except ValueError:\n            return [Chunk(payload)]\n",
        "        except ValueError:\n            return []\n",
        ["TestDifferential.test_answers_as_the_server_gave_them"],
        ["TestFaultAnswers.test_stream_route_of_text_data"],
    ),
    Mutation(
        "late-slots-unavailable",
        "a /slots answer later than poll is taken for an unavailable server (the poll waits poll, not for it)",
        "            deadline = asked + _slots_timeout(limits)\n",
        "            deadline = asked + limits.poll\n",
        ["TestDifferential.test_slots_and_the_other_single_shot_calls"],
        ["TestDifferential.test_slots_and_the_other_single_shot_calls"],
    ),
    Mutation(
        "late-slots-outlast-the-budget",
        "a budget that runs out while a late /slots answer is awaited ends the wait only when it comes",
        "            if until is not None:\n                deadline = min(deadline, until)\n",
        "",
        ["TestDifferential.test_slots_and_the_other_single_shot_calls"],
        ["TestDifferential.test_slots_and_the_other_single_shot_calls"],
    ),
]


def _tree(tests, mutant):
    """A temporary directory with ``tests`` (test_loopclient.py's text), ``mutant`` (loopclient.py's) and
    links to dev/ and README.md."""
    where = tempfile.mkdtemp(prefix="lc-mutant-")
    with open(os.path.join(where, "test_loopclient.py"), "w", encoding="utf-8") as f:
        f.write(tests)
    with open(os.path.join(where, "loopclient.py"), "w", encoding="utf-8") as f:
        f.write(mutant)
    for name in ("dev", "README.md"):
        os.symlink(os.path.join(ROOT, name), os.path.join(where, name))
    return where


def _run(tests, source, names, timeout):
    """True when ``names`` (test ids in test_loopclient) pass against ``source``."""
    where = _tree(tests, source)
    try:
        env = dict(os.environ, LOOPCLIENT_TEST_JOBS="1", PYTHONDONTWRITEBYTECODE="1")
        for key in [k for k in env if k.startswith("LOOPCLIENT_REAL_")]:
            del env[key]
        ids = ["test_loopclient." + name for name in names]
        try:
            done = subprocess.run(
                [sys.executable, "-m", "unittest", "-q"] + ids,
                cwd=where,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _old_tests(commit):
    return subprocess.run(
        ["git", "show", "%s:test_loopclient.py" % commit], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", metavar="COMMIT", help="also run the mutations against test_loopclient.py of COMMIT")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutations only")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test run (default 600)")
    args = parser.parse_args(argv)
    with open(os.path.join(ROOT, "loopclient.py"), encoding="utf-8") as f:
        source = f.read()
    with open(os.path.join(ROOT, "test_loopclient.py"), encoding="utf-8") as f:
        tests = f.read()
    old = _old_tests(args.old) if args.old else None
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error("no such mutation: %s" % ", ".join(sorted(unknown)))
    for m in chosen:
        if source.count(m.text) != 1:
            parser.error("%s: its text is in loopclient.py %d times, not once" % (m.name, source.count(m.text)))
    runs = [("TestDifferential", tests, "new")]
    if old is not None:
        runs = [("old TestFault*", old, "old"), ("old TestDifferential", old, "new")] + runs
    failed = False
    for label, text, field in runs:  # unmutated, every test must pass
        names = sorted({n for m in chosen for n in getattr(m, field)})
        if not _run(text, source, names, args.timeout):
            print("unmutated, %s fails: %s" % (label, " ".join(names)))
            failed = True
    if failed:
        return 1
    print("%-38s %s" % ("mutation", "   ".join("%-20s" % label for label, _, _ in runs)))
    for m in chosen:
        mutant = source.replace(m.text, m.mutant)
        start = time.monotonic()
        caught = [not _run(text, mutant, getattr(m, field), args.timeout) for _, text, field in runs]
        print(
            "%-38s %s  (%.0f s)"
            % (m.name, "   ".join("%-20s" % ("caught" if c else "missed") for c in caught), time.monotonic() - start),
            flush=True,
        )
        if not caught[-1] or (old is not None and caught[0] and not caught[-1]):
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
