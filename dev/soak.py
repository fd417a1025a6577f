#!/usr/bin/env python3
"""Soak a real llama-server with concurrent streams and early cancels, and watch ``/slots`` for wedged slots
(standard library only; loopclient is imported by path from the repository root and used through its public
API only: ``Client``, ``stream``, ``ChatStream.cancel``, ``slots``, ``Limits`` and the error classes).

    python3 dev/soak.py SOCK                                   # the reported pattern, 120 s cap
    python3 dev/soak.py SOCK --recipe fast --stop-on-wedge --confirm 3 --seconds 90
    python3 dev/soak.py SOCK --recipe fast --stop-on-wedge --probe  # persists? pinned request? other slot?
    python3 dev/soak.py SOCK --restart-at 20 --pidfile P --restart-cmd 'dev/llama-server.sh start SOCK'
    python3 dev/soak.py SOCK --terminate --pidfile P           # at the end: time SIGTERM (SIGKILL after 15 s)
    python3 dev/soak.py SOCK --resumable-fraction 0.5 --cut-at 1500,4000 --max-tokens 48,120   # cut, resumed

The pattern: ``--threads`` threads on one ``lc.Client`` (``--client-per-thread``: one each), ``--requests``
requests each (``--loop``: until stopped); request ``i`` of thread ``t`` is pinned to ``--slots[(t + i) % len]``
(``none`` = any slot), ``max_tokens`` drawn from ``--max-tokens``, temperature ``--temperature``; a drawn
``--cancel-fraction`` of the streams are cancelled after a drawn ``--cancel-at`` count of content events, by
``stream.cancel()`` or by leaving the ``with`` block (``--cancel-how``, drawn).  Every request runs under small
``lc.Limits`` (``LIMITS``: liveness 10 s, busy_wait 30 s, load_wait 30 s), so the soak always ends; ``--seconds``
caps the whole run; it stops when /slots has failed for 10 s (the server died).

Resumable streams (``--resumable-fraction``): a drawn share of the streams are sent with an id
(``resumable=``) through a proxy of the soak's own (``CutProxy``, a Unix socket), which cuts the connection
of each one's request after a drawn ``--cut-at`` count of raw bytes; the client resumes it from the server's
buffer.  Each one that ends with a ``Completion`` is checked: its content events joined equal its content,
and equal the server's replay of it from 0 (``resume()`` on a direct client): nothing lost, nothing
repeated (else ``BUG:resumable-content-differs``); it is then deleted.  One cancelled or left early must be
gone from ``/v1/streams/lookup`` (its DELETE was said; else ``BUG:resumable-not-deleted``).  At the end
every slot must be idle within ``--idle-wait`` seconds (``slots_busy_at_end``).

A monitor thread polls ``/slots`` every ``--poll`` seconds (its own client) and remembers, per slot, when the
triple (id_task, n_prompt_tokens_processed, next_token[0].n_decoded) last changed while ``is_processing``.  A
processing slot whose triple has not changed for ``--wedge-after`` seconds is reported as wedged.  A stalled
server (CPU starvation on a loaded machine) freezes every slot alike for seconds and looks the same: a wedge
is only certain when it outlives the soak's streams (``--confirm``, ``provoke_wedge``).

What was measured with this script (2 cores, gemma3-270m, -np 2) is in the commit messages that changed
``FAST``; in short: this build wedges a slot in its prompt phase (n_decoded 0) within seconds under the FAST
load, cancels are not needed for it, and once every client socket is closed the wedge lasts only while the
server keeps producing results for someone at least once a second (a /slots poll counts): llama-server checks
for a vanished client only after a full second without any result, then cancels the task and frees the slot.

For tests: ``provoke_wedge(address, seconds=..., wedge_after=...)`` runs FAST until a slot wedges, closes every
stream it opened, checks that the wedge persists without them, and returns ``Wedge((slot_id, id_task))`` (with
a keeper thread polling /slots so that it stays; ``close()`` it) or None.  ``probe_pinned``, ``serves``,
``examine_wedge`` and ``stop_server`` are the checks around a wedge.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import loopclient as lc  # noqa: E402  (imported by path: the repository root)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: Budgets for every soak request: small, so that a wedged slot costs seconds, not the 10-minute default.
LIMITS = {"poll": 0.5, "liveness": 10.0, "busy_wait": 30.0, "load_wait": 30.0, "idle_grace": 10.0}

PROMPTS = (
    "The three primary colours are",
    "Once upon a time, in a small village by the sea,",
    "Question: What is the capital of France?\nAnswer:",
    "The quick brown fox",
    "Here is a list of fruits: apple, banana,",
    "In 1969, the first humans",
    "def fibonacci(n):",
    "The weather today is",
)

#: The reported pattern (the defaults of ``soak``; it ran 8 x 12 requests, not in a loop).
REPORTED = {
    "threads": 8,
    "requests": 12,
    "slots": (0, 1, None),
    "max_tokens": (4, 16, 48),
    "temperature": 0.7,
    "cancel_fraction": 0.25,
    "cancel_at": (1, 3, 8),
    "cancel_how": ("cancel", "exit"),
}


def _triple(raw: Dict[str, Any]) -> Tuple[Any, Any, Any]:
    nt = raw.get("next_token")
    first = nt[0] if isinstance(nt, list) and nt and isinstance(nt[0], dict) else {}
    return (raw.get("id_task"), raw.get("n_prompt_tokens_processed"), first.get("n_decoded"))


def _n_remain(raw: Dict[str, Any]) -> Any:
    nt = raw.get("next_token")
    return nt[0].get("n_remain") if isinstance(nt, list) and nt and isinstance(nt[0], dict) else None


def trim_slot(raw: Dict[str, Any]) -> Dict[str, Any]:
    """The /slots entry without its long fields (prompt text, sampler params), for reports."""
    out = {k: v for k, v in raw.items() if k not in ("params", "prompt", "generated")}
    params = raw.get("params")
    if isinstance(params, dict):
        out["params"] = {k: params[k] for k in ("n_predict", "temperature", "seed", "stream") if k in params}
    if "prompt" in raw:
        out["prompt"] = str(raw["prompt"])[:60]
    if "generated" in raw:
        out["generated"] = str(raw["generated"])[:60]
    return out


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -----------------------------------------------------------------------------------------------------
# The /slots monitor
# -----------------------------------------------------------------------------------------------------


class Monitor(threading.Thread):
    """Polls /slots every ``interval`` seconds and tracks how long each processing slot's triple has not moved.

    ``wedges`` maps slot id to a record (dict) made when the slot first stayed still for ``wedge_after`` seconds:
    ``slot``, ``task``, ``triple``, ``n_remain``, ``detected_at`` (seconds since the monitor started),
    ``seconds`` (longest stillness seen), ``released_at`` (None while it lasts), ``raw`` (the /slots entry).
    """

    def __init__(
        self,
        address: str,
        interval: float = 0.5,
        wedge_after: float = 5.0,
        on_wedge: Optional[Callable[[Dict[str, Any]], None]] = None,
    ) -> None:
        super().__init__(name="soak-monitor", daemon=True)
        self.client = lc.Client(address, limits=lc.Limits(liveness=5.0))
        self.interval = interval
        self.wedge_after = wedge_after
        self.on_wedge = on_wedge
        self.t0 = time.monotonic()
        self.halt = threading.Event()
        self.lock = threading.Lock()
        self.state = {}  # type: Dict[int, Tuple[Tuple[Any, Any, Any], float]]  # slot -> (triple, changed at)
        self.last = {}  # type: Dict[int, Dict[str, Any]]  # slot -> last raw entry
        self.wedges = {}  # type: Dict[int, Dict[str, Any]]
        self.history = []  # type: List[Dict[str, Any]]  # every wedge record, released ones too
        self.polls = 0
        self.errors = {}  # type: Dict[str, int]
        self.max_still = {}  # type: Dict[int, float]  # longest stillness of a processing slot, wedged or not
        #: longest stillness that ended by the slot moving or going idle: how close a healthy slot came to
        #: ``wedge_after`` (a margin for choosing it); a wedge released by a cancel counts here too
        self.max_recovered = 0.0
        #: stillness episodes of at least ``wedge_after / 2`` that ended: (slot, triple, seconds, "moved"/"idle",
        #: ended at); "idle" means the task went away (finished or cancelled), "moved" that it went on
        self.episodes = []  # type: List[Tuple[int, List[Any], float, str, float]]
        self.down_since = None  # type: Optional[float]  # first failed /slots poll of the current failing run

    def run(self) -> None:
        while not self.halt.is_set():
            started = time.monotonic()
            self.poll_once()
            self.halt.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def poll_once(self) -> None:
        try:
            slots = self.client.slots()
        except lc.LoopError as exc:
            with self.lock:
                name = type(exc).__name__
                self.errors[name] = self.errors.get(name, 0) + 1
                if self.down_since is None:
                    self.down_since = time.monotonic()
                self.state.clear()  # a restarted server numbers its tasks afresh
                for record in self.wedges.values():
                    if record["released_at"] is None:
                        record["released_at"] = round(time.monotonic() - self.t0, 2)
                        record["released_by"] = "server unreachable: " + name
                self.wedges = {k: v for k, v in self.wedges.items() if v["released_at"] is None}
            return
        now = time.monotonic()
        fresh = []
        with self.lock:
            self.polls += 1
            self.down_since = None
            for s in slots:
                self.last[s.id] = s.raw
                triple = _triple(s.raw)
                prev = self.state.get(s.id)
                if (not s.is_processing or prev is None or prev[0] != triple) and prev is not None:
                    self.max_recovered = max(self.max_recovered, now - prev[1])
                    if now - prev[1] >= self.wedge_after / 2:
                        self.episodes.append(
                            (
                                s.id,
                                list(prev[0]),
                                round(now - prev[1], 2),
                                "moved"
                                if s.is_processing and triple[0] == prev[0][0]
                                else "idle"
                                if not s.is_processing
                                else "next task",
                                round(now - self.t0, 2),
                            )
                        )
                if not s.is_processing:
                    self.state.pop(s.id, None)
                    self._release(s.id, now, "idle")
                    continue
                if prev is None or prev[0] != triple:
                    self.state[s.id] = (triple, now)
                    self._release(s.id, now, "moved")
                    continue
                still = now - prev[1]
                self.max_still[s.id] = max(self.max_still.get(s.id, 0.0), still)
                record = self.wedges.get(s.id)
                if record is not None:
                    record["seconds"] = round(still, 2)
                    record["raw"] = s.raw
                elif still >= self.wedge_after:
                    # how long the other processing slots had not moved: all frozen alike hints at a stalled
                    # server (CPU starvation) rather than one wedged slot; the persistence check tells
                    others = {o: round(now - st[1], 2) for o, st in self.state.items() if o != s.id}
                    record = {
                        "slot": s.id,
                        "task": triple[0],
                        "triple": list(triple),
                        "n_remain": _n_remain(s.raw),
                        "detected_at": round(now - self.t0, 2),
                        "still_since": round(prev[1] - self.t0, 2),
                        "seconds": round(still, 2),
                        "released_at": None,
                        "others_still": others,
                        "raw": s.raw,
                    }
                    self.wedges[s.id] = record
                    self.history.append(record)
                    fresh.append(record)
        for record in fresh:
            if self.on_wedge is not None:
                self.on_wedge(record)

    def _release(self, slot: int, now: float, why: str) -> None:
        record = self.wedges.pop(slot, None)
        if record is not None:
            record["released_at"] = round(now - self.t0, 2)
            record["released_by"] = why

    def down_for(self) -> float:
        """Seconds /slots has failed without a break (0.0 while it answers)."""
        with self.lock:
            return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def still(self, slot: int) -> Optional[float]:
        """Seconds the processing slot's triple has not moved (None when idle or unknown)."""
        with self.lock:
            prev = self.state.get(slot)
            return None if prev is None else time.monotonic() - prev[1]

    def stop(self) -> None:
        self.halt.set()
        self.join(10.0)
        self.client.close()


# -----------------------------------------------------------------------------------------------------
# The soak
# -----------------------------------------------------------------------------------------------------


class _Run:
    def __init__(self) -> None:
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.active = set()  # type: set
        self.outcomes = {}  # type: Dict[str, int]
        self.examples = {}  # type: Dict[str, str]
        self.started = 0
        self.cancel_planned = 0

    def count(self, key: str, exc: Optional[BaseException] = None) -> None:
        with self.lock:
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            if exc is not None and key not in self.examples:
                self.examples[key] = str(exc)[:200]

    def cancel_all(self) -> None:
        with self.lock:
            streams = list(self.active)
        for stream in streams:
            stream.cancel()


# -----------------------------------------------------------------------------------------------------
# Resumable streams: a proxy that cuts their connections, and the check of what they delivered
# -----------------------------------------------------------------------------------------------------


def _connect(address: str) -> socket.socket:
    """A connected socket to the server at ``address`` (a socket path, unix:///path or http://host:port)."""
    if address.startswith("http://"):
        host, _, port = address[len("http://") :].partition("/")[0].rpartition(":")
        return socket.create_connection((host.strip("[]"), int(port or 80)), timeout=60)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(address[len("unix://") :] if address.startswith("unix://") else address)
    return sock


class CutProxy:
    """A threaded Unix-socket proxy to ``upstream``: a request carrying an ``X-Conversation-Id`` that was
    planned (``plan(id, cut)``) has its response's connection cut after ``cut`` raw bytes, once (both ends
    shut down, as a lost connection); everything else is forwarded whole.  ``cuts``: connections cut."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.path = "/tmp/lc-soak-proxy-%d.sock" % os.getpid()
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.lock = threading.Lock()
        self.plans = {}  # type: Dict[bytes, int]
        self.cuts = 0
        self.stopping = threading.Event()
        self.socks = set()  # type: set
        self.threads = []  # type: List[threading.Thread]
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(64)
        self.listener.settimeout(0.1)
        self._spawn(self._accept)

    def plan(self, conversation: str, cut: int) -> None:
        with self.lock:
            self.plans[conversation.encode()] = cut

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name="soak-proxy", daemon=True)
        with self.lock:
            self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        up = None
        with self.lock:
            self.socks.add(conn)
        try:
            conn.settimeout(120)
            head = b""
            while b"\r\n\r\n" not in head:
                more = conn.recv(65536)
                if not more:
                    return
                head += more
            cut = None
            for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"x-conversation-id" and head.startswith(b"POST "):
                    with self.lock:
                        cut = self.plans.pop(value.strip(), None)
            up = _connect(self.upstream)
            up.settimeout(120)
            with self.lock:
                self.socks.add(up)
            up.sendall(head)
            self._spawn(self._pipe, conn, up)
            sent = 0
            while True:
                data = up.recv(65536)
                if not data:
                    break
                if cut is not None and sent + len(data) >= cut:
                    conn.sendall(data[: cut - sent])
                    with self.lock:
                        self.cuts += 1
                    break
                conn.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (conn, up):
                if sock is None:
                    continue
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
                with self.lock:
                    self.socks.discard(sock)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    return
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.stopping.set()
        self.listener.close()
        with self.lock:
            socks, threads = list(self.socks), list(self.threads)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(5)
        if os.path.exists(self.path):
            os.unlink(self.path)


class _Resumable:
    """What the resumable streams of a soak share: the proxy, a client behind it, a direct client for the
    checks (the server's replay, lookup, DELETE), the cut points, and the tallies."""

    def __init__(self, address: str, limits: lc.Limits, fraction: float, cut_at: Sequence[int]) -> None:
        self.proxy = CutProxy(address)
        self.client = lc.Client(self.proxy.path, limits=limits)
        self.direct = lc.Client(address, limits=limits)
        self.fraction = fraction
        self.cut_at = list(cut_at)
        self.tally = collections.Counter()  # type: Dict[str, int]

    def count(self, key: str, n: int = 1) -> None:
        with self.proxy.lock:
            self.tally[key] += n

    def check_finished(self, run: _Run, conversation: str, texts: List[str], completion: lc.Completion) -> None:
        """A resumable stream ended with its Completion: its content is that of the server's replay from 0."""
        replay = self.direct.resume(conversation)
        try:
            events = list(replay)
        except lc.LoopError as exc:
            run.count("BUG:resumable-replay-" + type(exc).__name__, exc)
            return
        replayed = "".join(e.text for e in events if isinstance(e, lc.Content) and e.choice == 0)
        if "".join(texts) != completion.content or replayed != completion.content:
            run.count(
                "BUG:resumable-content-differs",
                ValueError("%s: streamed %r, replay %r" % (conversation, "".join(texts)[:60], replayed[:60])),
            )
        else:
            self.count("checked-equal")
        self.direct.delete_stream(conversation)

    def check_forgotten(self, run: _Run, conversation: str) -> None:
        """A resumable stream ended early: its DELETE was said, so the server no longer knows it."""
        if self.direct.lookup_streams([conversation]):
            run.count("BUG:resumable-not-deleted", ValueError(conversation))
            self.direct.delete_stream(conversation)
        else:
            self.count("deleted-after-early-end")

    def close(self) -> None:
        self.client.close()
        self.direct.close()
        self.proxy.close()


def _one(
    run: _Run,
    client: lc.Client,
    rng: random.Random,
    slot: Optional[int],
    max_tokens: int,
    temperature: float,
    cancel_at: Optional[int],
    how: str,
    resumable: Optional[_Resumable] = None,
) -> None:
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    params = {}  # type: Dict[str, Any]
    if resumable is not None:  # through the proxy, which cuts its connection
        client = resumable.client
        params["resumable"] = conversation = "soak-%s" % os.urandom(12).hex()
        resumable.proxy.plan(conversation, rng.choice(resumable.cut_at))
        resumable.count("streams")
    stream = client.stream(
        messages, slot=slot, max_tokens=max_tokens, temperature=temperature, seed=rng.randrange(1 << 30), **params
    )
    texts = []  # type: List[str]
    with run.lock:
        run.active.add(stream)
        run.started += 1
        run.cancel_planned += cancel_at is not None
    try:
        left = cancelled = False
        with stream:
            n = 0
            for event in stream:
                if isinstance(event, lc.Resumed) and resumable is not None:
                    resumable.count("resumed")
                if isinstance(event, lc.Content):
                    if event.choice == 0:
                        texts.append(event.text)
                    n += 1
                    if cancel_at is not None and n >= cancel_at:
                        if how == "exit":
                            left = True
                            break  # leaving the with block cancels quietly
                        cancelled = True
                        stream.cancel()  # the next step raises CancelledError
        if left:
            run.count("left-with-block")
            if resumable is not None:
                resumable.check_forgotten(run, conversation)
        elif stream.completion is not None:
            run.count("Completion")
            if resumable is not None:
                resumable.check_finished(run, conversation, texts, stream.completion)
        else:
            run.count("ended-without-completion")
    except lc.CancelledError as exc:
        # ours (planned), the soak's stop closing streams in flight, or one nobody asked for (a client bug)
        key = "CancelledError" if cancelled else "CancelledError@stop" if run.stop.is_set() else "BUG:CancelledError"
        run.count(key, exc)
        if resumable is not None:
            resumable.check_forgotten(run, conversation)
    except lc.LoopError as exc:
        run.count(type(exc).__name__, exc)
        if resumable is not None:
            resumable.check_forgotten(run, conversation)
    except Exception as exc:  # a bug in the client: record it, keep soaking
        run.count("BUG:" + type(exc).__name__, exc)
    finally:
        with run.lock:
            run.active.discard(stream)


def _pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (nothing reaps a background server here)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :][:1] not in ("Z", "X")


def _read_pid(pidfile: str) -> Optional[int]:
    try:
        with open(pidfile) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def stop_server(pid: int, term_wait: float = 15.0, kill_wait: float = 5.0) -> Dict[str, Any]:
    """SIGTERM ``pid``, wait up to ``term_wait`` s for it to exit (a zombie counts as exited), then SIGKILL.
    Returns ``{"sigterm_exit_s": float or None, "sigkilled": bool, "gone": bool}``."""
    out = {"pid": pid, "sigterm_exit_s": None, "sigkilled": False, "gone": False}  # type: Dict[str, Any]
    if not _pid_alive(pid):
        out["gone"] = True
        return out
    t0 = time.monotonic()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    while time.monotonic() - t0 < term_wait:
        if not _pid_alive(pid):
            out["sigterm_exit_s"] = round(time.monotonic() - t0, 2)
            out["gone"] = True
            return out
        time.sleep(0.05)
    out["sigkilled"] = True
    t1 = time.monotonic()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while time.monotonic() - t1 < kill_wait:
        if not _pid_alive(pid):
            out["gone"] = True
            out["sigkill_exit_s"] = round(time.monotonic() - t1, 2)
            break
        time.sleep(0.05)
    return out


def _restart(pidfile: Optional[str], cmd: Optional[str], log: Callable[[str], None]) -> Dict[str, Any]:
    out = {}  # type: Dict[str, Any]
    t0 = time.monotonic()
    pid = _read_pid(pidfile) if pidfile else None
    if pid is not None and _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
        while _pid_alive(pid) and time.monotonic() - t0 < 5.0:
            time.sleep(0.02)
        out["killed_pid"] = pid
        out["dead_after_s"] = round(time.monotonic() - t0, 2)
        log("restart: SIGKILL pid %d (gone after %.2f s)" % (pid, out["dead_after_s"]))
    else:
        log("restart: no live pid in %r" % pidfile)
    if cmd:
        t1 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
            )
            out["cmd_rc"] = proc.returncode
            out["cmd_tail"] = (proc.stderr + proc.stdout).strip().splitlines()[-2:]
        except subprocess.TimeoutExpired:
            out["cmd_rc"] = "timeout"
        out["restart_s"] = round(time.monotonic() - t1, 2)
        log("restart: %r rc=%s after %.2f s" % (cmd, out["cmd_rc"], out["restart_s"]))
    return out


def soak(
    address: str,
    *,
    threads: int = 8,
    requests: int = 12,
    slots: Sequence[Optional[int]] = (0, 1, None),
    max_tokens: Sequence[int] = (4, 16, 48),
    temperature: float = 0.7,
    cancel_fraction: float = 0.25,
    cancel_at: Sequence[int] = (1, 3, 8),
    cancel_how: Sequence[str] = ("cancel", "exit"),
    seed: int = 0,
    seconds: float = 120.0,
    wedge_after: float = 5.0,
    stop_on_wedge: bool = False,
    poll: float = 0.5,
    client_per_thread: bool = False,
    loop: bool = False,
    restart_at: Optional[float] = None,
    pidfile: Optional[str] = None,
    restart_cmd: Optional[str] = None,
    limits: Optional[Dict[str, float]] = None,
    down_after: float = 10.0,
    log: Optional[Callable[[str], None]] = None,
    keep_monitor: bool = False,
    resumable_fraction: float = 0.0,
    cut_at: Sequence[int] = (1500, 4000, 9000),
    idle_wait: float = 10.0,
) -> Dict[str, Any]:
    """Run the pattern once (or repeatedly with ``loop``) within ``seconds``; return the report dict.

    Every stream the soak opened is closed (and every worker thread joined) before this returns.  With
    ``keep_monitor`` the running ``Monitor`` is returned under ``"monitor_thread"`` for the caller to stop
    (so that /slots traffic goes on without a gap: see ``Wedge``).
    """
    say = log or (lambda text: None)
    fds_before, threads_before = open_fds(), threading.active_count()
    t0 = time.monotonic()
    run = _Run()
    first_wedge = []  # type: List[Dict[str, Any]]

    def on_wedge(record: Dict[str, Any]) -> None:
        say(
            "wedge: slot %s task %s triple %s n_remain %s, still %.1f s (detected %.1f s into the run)"
            % (
                record["slot"],
                record["task"],
                record["triple"],
                record["n_remain"],
                record["seconds"],
                record["detected_at"],
            )
        )
        first_wedge.append(record)
        if stop_on_wedge:
            run.stop.set()

    monitor = Monitor(address, poll, wedge_after, on_wedge)
    monitor.t0 = t0
    monitor.start()
    lim = lc.Limits(**dict(LIMITS, **(limits or {})))
    shared = lc.Client(address, limits=lim)
    clients = [shared]
    resumable = _Resumable(address, lim, resumable_fraction, cut_at) if resumable_fraction > 0 else None

    def worker(index: int) -> None:
        client = shared
        if client_per_thread:
            client = lc.Client(address, limits=lim)
            with run.lock:
                clients.append(client)
        rng = random.Random(seed * 1000003 + index)
        i = 0
        while not run.stop.is_set() and (loop or i < requests):
            slot = slots[(index + i) % len(slots)]
            mt = rng.choice(list(max_tokens))
            point = rng.choice(list(cancel_at)) if cancel_at and rng.random() < cancel_fraction else None
            how = rng.choice(list(cancel_how))
            cut = resumable if resumable is not None and rng.random() < resumable.fraction else None
            _one(run, client, rng, slot, mt, temperature, point, how, cut)
            i += 1

    workers = [threading.Thread(target=worker, args=(k,), name="soak-%d" % k, daemon=True) for k in range(threads)]
    for w in workers:
        w.start()
    restart = None  # type: Optional[Dict[str, Any]]
    down = False
    deadline = t0 + seconds
    while any(w.is_alive() for w in workers):
        if run.stop.wait(0.1):
            break
        now = time.monotonic()
        if now >= deadline:
            say("time cap %.0f s reached" % seconds)
            run.stop.set()
            break
        if restart_at is not None and restart is None and now - t0 >= restart_at:
            restart = _restart(pidfile, restart_cmd, say)
            restart["at_s"] = round(now - t0, 2)
            monitor.down_since = None  # the down time of the restart itself does not count
        if monitor.down_for() >= down_after:
            say("/slots has failed for %.0f s: the server is down (crashed?); stopping" % down_after)
            down = True
            run.stop.set()
            break
    stopped_at = time.monotonic() - t0
    run.stop.set()
    run.cancel_all()
    hung = []
    for w in workers:
        w.join(max(0.1, 15.0 - (time.monotonic() - t0 - stopped_at)))
        if w.is_alive():
            hung.append(w.name)
    run.cancel_all()  # a stream started between the first cancel_all and its thread seeing `stop`
    for client in clients:
        client.close()
    resumed = None  # type: Optional[Dict[str, Any]]
    if resumable is not None:
        resumable.close()
        resumed = dict(sorted(resumable.tally.items()), cuts=resumable.proxy.cuts)
    busy_at_end = _busy_after(address, idle_wait)
    if busy_at_end:
        say("slots still busy %.0f s after the soak: %s" % (idle_wait, busy_at_end))
    elapsed = time.monotonic() - t0
    if not keep_monitor:
        monitor.stop()
    # the library's /slots pollers are short-lived threads: give them a moment to end before counting
    settle = time.monotonic()
    while threading.active_count() > threads_before + (1 if keep_monitor else 0) and time.monotonic() - settle < 3.0:
        time.sleep(0.05)
    monitor.lock.acquire()  # a kept monitor is still running
    report = {
        "address": address,
        "recipe": {
            "threads": threads,
            "requests": requests,
            "slots": list(slots),
            "max_tokens": list(max_tokens),
            "temperature": temperature,
            "cancel_fraction": cancel_fraction,
            "cancel_at": list(cancel_at),
            "cancel_how": list(cancel_how),
            "seed": seed,
            "client_per_thread": client_per_thread,
            "loop": loop,
            "resumable_fraction": resumable_fraction,
            "cut_at": list(cut_at),
        },
        "outcomes": dict(sorted(run.outcomes.items())),
        "examples": run.examples,
        "requests_started": run.started,
        "cancels_planned": run.cancel_planned,
        "fds": [fds_before, open_fds()],
        "threads": [threads_before, threading.active_count()],
        "hung_workers": hung,
        "stopped_at_s": round(stopped_at, 2),
        "total_s": round(elapsed, 2),
        "first_wedge_s": first_wedge[0]["detected_at"] if first_wedge else None,
        "wedges": [{k: v for k, v in r.items() if k != "raw"} for r in monitor.history],
        "wedged_now": {s: {"task": r["task"], "seconds": r["seconds"]} for s, r in monitor.wedges.items()},
        "wedge_example": trim_slot(monitor.history[0]["raw"]) if monitor.history else None,
        "max_still_s": {s: round(v, 2) for s, v in sorted(monitor.max_still.items())},
        "max_recovered_still_s": round(monitor.max_recovered, 2),
        "still_episodes": monitor.episodes,
        "server_down": down,
        "monitor": {"polls": monitor.polls, "errors": monitor.errors},
        "restart": restart,
        "resumable": resumed,
        "slots_busy_at_end": busy_at_end,
    }
    monitor.lock.release()
    if keep_monitor:
        report["monitor_thread"] = monitor
    return report


def _busy_after(address: str, seconds: float) -> Optional[List[int]]:
    """The slots still processing once ``seconds`` have passed without every slot idle ([] when they all
    came idle; None when /slots did not answer)."""
    client = lc.Client(address, limits=lc.Limits(liveness=5.0))
    deadline = time.monotonic() + seconds
    busy = None  # type: Optional[List[int]]
    try:
        while True:
            try:
                busy = [s.id for s in client.slots() if s.is_processing]
            except lc.LoopError:
                busy = None
            if busy == [] or time.monotonic() >= deadline:
                return busy
            time.sleep(0.2)  # the poll interval of this wait
    finally:
        client.close()


# -----------------------------------------------------------------------------------------------------
# Checks of a wedge: does it persist, what does a pinned request see, does the other slot serve
# -----------------------------------------------------------------------------------------------------


def persists(monitor: Monitor, slot: int, task: Any, seconds: float = 3.0) -> Tuple[bool, Dict[str, Any]]:
    """Watch a running ``monitor`` for ``seconds``: True when ``slot`` stayed processing ``task`` with its
    triple unchanged (the monitor's wedge record for it never released).  Returns (ok, last /slots entry)."""
    record = monitor.wedges.get(slot)
    end = time.monotonic() + seconds
    while True:
        with monitor.lock:
            now_record = monitor.wedges.get(slot)
            raw = dict(monitor.last.get(slot, {}))
        if record is None or now_record is not record or record["task"] != task:
            return False, raw
        if time.monotonic() >= end:
            return True, raw
        time.sleep(0.1)


def probe_pinned(address: str, slot: int, seconds: float = 5.0, max_tokens: int = 4) -> Dict[str, Any]:
    """Send a streamed request pinned to ``slot`` on a raw socket and count the bytes that come within
    ``seconds``: ``{"bytes": n, "first_byte_s": t or None, "head": first line or None}``.  Raw on purpose:
    "zero bytes, not even the status line" is exactly what the client cannot observe through its API."""
    addr = lc.parse_address(address)
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "The sea is"}],
            "id_slot": slot,
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    req = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    if address.startswith("http"):
        sock = socket.create_connection(addr.target, 5.0)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(5.0)
        sock.connect(addr.target)
    got = b""
    first = None
    t0 = time.monotonic()
    try:
        sock.sendall(req)
        while time.monotonic() - t0 < seconds:
            sock.settimeout(max(0.01, seconds - (time.monotonic() - t0)))
            try:
                data = sock.recv(65536)
            except socket.timeout:
                break
            if not data:
                break
            if first is None:
                first = time.monotonic() - t0
            got += data
    finally:
        sock.close()
    return {
        "slot": slot,
        "bytes": len(got),
        "first_byte_s": None if first is None else round(first, 3),
        "head": got.split(b"\r\n", 1)[0].decode("latin-1") if got else None,
        "waited_s": seconds,
    }


def serves(address: str, slot: Optional[int], max_tokens: int = 8) -> Dict[str, Any]:
    """One short chat (pinned to ``slot``) through loopclient: the outcome class and its duration."""
    t0 = time.monotonic()
    with lc.Client(address, limits=lc.Limits(**dict(LIMITS, busy_wait=10.0))) as client:
        try:
            reply = client.chat(
                [{"role": "user", "content": "The three primary colours are"}],
                slot=slot,
                max_tokens=max_tokens,
                temperature=0,
            )
            outcome = "Completion(%s, %r)" % (reply.finish_reason, reply.content[:40])
        except lc.LoopError as exc:
            outcome = "%s: %s" % (type(exc).__name__, exc)
    return {"slot": slot, "outcome": outcome, "seconds": round(time.monotonic() - t0, 2)}


def examine_wedge(
    address: str,
    monitor: Monitor,
    slot: int,
    task: Any,
    probe_seconds: float = 10.0,
    quiet: float = 5.0,
    log: Optional[Callable[[str], None]] = None,
) -> Dict[str, Any]:
    """What a wedge does once the soak's streams are all closed, ``monitor`` (still running, polling /slots
    every 0.5 s) watching it; in this order:

    1. ``persists_polled``: does the slot keep processing ``task``, still, for 10 s?
    2. ``pinned``: a raw request pinned to the wedged slot, read for ``probe_seconds``; meanwhile ``others``
       (one short chat pinned to each other slot) and ``any`` (slot None) through loopclient.
    3. ``persists_after_probe``: still wedged, same task?
    4. ``quiet``: the monitor is stopped and nothing is sent for ``quiet`` seconds, then one /slots: still
       wedged?  (llama-server notices a closed client only after a second without any result for anyone.)
    """
    say = log or (lambda text: None)
    out = {"slot": slot, "task": task}  # type: Dict[str, Any]
    ok, raw = persists(monitor, slot, task, 10.0)
    out["persists_polled"] = ok
    out["slot_after_close"] = trim_slot(raw)
    say("wedge persists 10 s after every soak socket closed (/slots every %.1f s): %s" % (monitor.interval, ok))
    box = {}  # type: Dict[str, Any]
    t = threading.Thread(target=lambda: box.update(probe_pinned(address, slot, probe_seconds)))
    t.start()
    time.sleep(0.5)
    with monitor.lock:
        n_slots = len(monitor.last)
    out["others"] = [serves(address, s) for s in range(n_slots) if s != slot]
    out["any"] = serves(address, None)
    t.join()
    out["pinned"] = box
    ok, raw = persists(monitor, slot, task, 1.0)
    out["persists_after_probe"] = ok
    say("pinned to the wedged slot: %s; others: %s; any: %s; still wedged: %s" % (box, out["others"], out["any"], ok))
    monitor.stop()
    time.sleep(quiet)
    entry = next((s for s in lc.Client(address).slots() if s.id == slot), None)
    out["after_quiet"] = None if entry is None else trim_slot(entry.raw)
    out["persists_after_quiet"] = bool(entry and entry.is_processing and entry.raw.get("id_task") == task)
    say("after %.0f s without any request: still wedged: %s" % (quiet, out["persists_after_quiet"]))
    return out


class Wedge(tuple):
    """``(slot, task)`` of a wedged slot, as ``provoke_wedge`` returns it; unpacks as a pair.

    ``seconds``: how long the slot had not moved when it was returned; ``raw``: its /slots entry (trimmed);
    ``wedged``: every slot that was wedged (and persisted) at that moment, this one first; both slots of a
    two-slot server sometimes wedge together, and then no slot serves.
    While ``keeper`` (a ``Monitor`` polling /slots every 0.5 s) runs, the wedge stays: llama-server cancels
    the orphaned task about a second after its result queue goes quiet, and each /slots answer counts as
    traffic.  ``close()`` (or leaving a ``with`` block) stops the keeper; ``still()`` is how long the slot
    has not moved according to the keeper (None once it moved or went idle, or without a keeper).
    """

    def __new__(
        cls,
        slot: int,
        task: int,
        seconds: float,
        raw: Dict[str, Any],
        keeper: Optional[Monitor],
        wedged: Sequence[int] = (),
    ) -> Wedge:
        self = tuple.__new__(cls, (slot, task))
        self.seconds = seconds
        self.wedged = list(wedged) or [slot]
        self.raw = raw
        self.keeper = keeper
        return self

    @property
    def slot(self) -> int:
        return self[0]

    @property
    def task(self) -> int:
        return self[1]

    def still(self) -> Optional[float]:
        keeper = self.keeper
        if keeper is None or not keeper.is_alive():
            return None
        with keeper.lock:
            prev = keeper.state.get(self[0])
            if prev is None or prev[0][0] != self[1]:
                return None
            return time.monotonic() - prev[1]

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()

    def __enter__(self) -> Wedge:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def provoke_wedge(
    address: str,
    *,
    seconds: float = 90.0,
    wedge_after: float = 5.0,
    persist: float = 3.0,
    keep: bool = True,
    prompt_phase: bool = True,
    restart: Optional[Callable[[], Any]] = None,
    log: Optional[Callable[[str], None]] = None,
    **recipe: Any,
) -> Optional[Wedge]:
    """Run the soak pattern against ``address`` until /slots shows a processing slot whose triple has not
    moved for ``wedge_after`` seconds; close every stream it opened; check that the slot still processes the
    same task, triple unchanged, for ``persist`` more seconds without them; return ``Wedge((slot_id, id_task))``.

    None when no persisting wedge came within ``seconds`` (the call takes at most about ``seconds + persist +
    5``), or when the server went down (this build can also abort, ``GGML_ASSERT(batch.size() > 0)``, under
    this load) and ``restart`` is None; ``restart()``, when given, must bring a fresh server up at ``address``
    (e.g. SIGKILL the dead one's pid, then start it again), and the soak goes on while time is left.
    With ``prompt_phase`` only a slot frozen before its first token (n_decoded 0) counts: every wedge seen on
    a calm machine was so, while a stalled server (load in the hundreds) also froze generating slots for
    longer than ``wedge_after + persist``.
    ``recipe`` overrides keyword arguments of ``soak`` (defaults: ``FAST``).  Every stream
    is closed and every soak thread joined when it returns.

    With ``keep`` (the default) the returned wedge's keeper goes on polling /slots every 0.5 s until
    ``close()``: without that traffic llama-server notices the closed socket about a second later, cancels
    the task and frees the slot.  A wedged server spins its main loop (a core busy): stop it after the test
    (``stop_server``: SIGTERM, SIGKILL after 15 s).
    """
    say = log or (lambda text: None)
    params = dict(FAST, **recipe)
    params.setdefault("loop", True)
    seed = params.pop("seed", 0)
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= wedge_after:
            return None
        report = soak(
            address,
            seconds=left,
            wedge_after=wedge_after,
            stop_on_wedge=True,
            seed=seed,
            log=say,
            keep_monitor=True,
            **params,
        )
        monitor = report["monitor_thread"]
        seed += 1
        say(
            "soak round: %d requests in %.1f s, outcomes %s, longest stillness %s, wedges %s"
            % (
                report["requests_started"],
                report["stopped_at_s"],
                report["outcomes"],
                report["max_still_s"],
                [(w["slot"], w["task"], w["triple"]) for w in report["wedges"]],
            )
        )
        if report["server_down"]:
            monitor.stop()
            if restart is None:
                say("the server went down during the soak: no wedge to return")
                return None
            say("the server went down during the soak: restarting it")
            restart()
            continue
        found = []  # type: List[Tuple[int, Any, Dict[str, Any]]]
        for slot, record in sorted(report["wedged_now"].items()):
            with monitor.lock:
                decoded = _triple(monitor.last.get(slot, {}))[2]
            if prompt_phase and decoded != 0:
                say(
                    "slot %s task %s stands still after %s decoded tokens: a stall, not the prompt-phase wedge"
                    % (slot, record["task"], decoded)
                )
                continue
            ok, raw = persists(monitor, slot, record["task"], persist if not found else 0.0)
            say(
                "wedge on slot %s task %s %s after the streams closed"
                % (slot, record["task"], "persists" if ok else "did NOT persist")
            )
            if ok:
                found.append((slot, record["task"], raw))
        if found:
            slot, task, raw = found[0]
            with monitor.lock:
                seconds_still = monitor.wedges[slot]["seconds"] if slot in monitor.wedges else None
            if not keep:
                monitor.stop()
            return Wedge(slot, task, seconds_still, trim_slot(raw), monitor if keep else None, [f[0] for f in found])
        monitor.stop()
        # no wedge, or one that did not outlive the streams: go again (a new seed) while time is left


#: The fastest reliable recipe measured (2 cores, gemma3-270m, -np 2, --no-repack; see the commit that set it):
#: eight threads on one client cycling slots 0, 1 and any, short answers (4 or 16 tokens) so that prompts
#: start often, and no cancels at all: the wedge does not need them, and heavy cancelling (half or all of
#: the streams at their first token) sometimes made this build abort (GGML_ASSERT(batch.size() > 0))
#: instead of wedging.  provoke_wedge's default.
FAST = dict(REPORTED, max_tokens=(4, 16), cancel_fraction=0.0, loop=True)


# -----------------------------------------------------------------------------------------------------
# Command line
# -----------------------------------------------------------------------------------------------------


def _slots_arg(text: str) -> List[Optional[int]]:
    return [None if part.strip().lower() in ("none", "any", "") else int(part) for part in text.split(",")]


def _limits_arg(text: str) -> Dict[str, float]:
    out = {}
    for part in text.split(","):
        if part.strip():
            name, _, value = part.partition("=")
            out[name.strip()] = float(value) if "." in value or name.strip() not in ("queue_len",) else int(value)
    return out


def _ints(text: str) -> List[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("address", help="socket path, unix:///path or http://host:port")
    p.add_argument(
        "--recipe",
        choices=("reported", "fast"),
        default="reported",
        help="defaults for the pattern options below: the reported pattern (8 threads x 12 requests, "
        "max_tokens 4/16/48, a quarter cancelled after 1/3/8 events) or FAST (--loop, max_tokens "
        "4/16, no cancels), the quickest to wedge",
    )
    p.add_argument("--threads", type=int)
    p.add_argument("--requests", type=int, help="requests per thread (reported: 12)")
    p.add_argument("--loop", action="store_true", default=None, help="keep requesting until --seconds or a stop")
    p.add_argument("--no-loop", dest="loop", action="store_false", help="--requests per thread, then stop")
    p.add_argument("--slots", type=_slots_arg, help="slot cycle, e.g. 0,1,none")
    p.add_argument("--max-tokens", type=_ints)
    p.add_argument("--temperature", type=float)
    p.add_argument("--cancel-fraction", type=float)
    p.add_argument("--cancel-at", type=_ints, help="content events before a cancel, drawn per stream")
    p.add_argument(
        "--cancel-how",
        type=lambda t: [h for h in t.split(",") if h],
        help="cancel (stream.cancel()), exit (leave the with block) or both, drawn: cancel,exit",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--limits",
        type=_limits_arg,
        default={},
        help="lc.Limits overrides for the soak's requests, e.g. poll=20,liveness=30 (defaults: %s)"
        % ",".join("%s=%g" % kv for kv in sorted(LIMITS.items())),
    )
    p.add_argument("--client-per-thread", action="store_true", help="one lc.Client per thread (default: shared)")
    p.add_argument("--seconds", type=float, default=120.0, help="cap on the whole run (default 120)")
    p.add_argument("--wedge-after", type=float, default=5.0, help="seconds without movement = wedged (default 5)")
    p.add_argument("--poll", type=float, default=0.5, help="/slots poll interval (default 0.5)")
    p.add_argument("--stop-on-wedge", action="store_true")
    p.add_argument("--restart-at", type=float, help="SIGKILL the server this many seconds in, then restart it")
    p.add_argument("--pidfile", help="the server's pid file (for --restart-at and --terminate)")
    p.add_argument("--restart-cmd", help="shell command that starts the server again (run from the repo root)")
    p.add_argument(
        "--confirm",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after the soak, check that each wedge outlives the closed streams for SECONDS",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="after a wedge: check it persists, probe a pinned request, check the other slot serves",
    )
    p.add_argument("--probe-seconds", type=float, default=10.0)
    p.add_argument("--terminate", action="store_true", help="at the end: SIGTERM the server of --pidfile, time it")
    p.add_argument(
        "--resumable-fraction",
        type=float,
        default=0.0,
        help="share of the streams sent resumable through a proxy that cuts their connection (default 0)",
    )
    p.add_argument(
        "--cut-at", type=_ints, default=[1500, 4000, 9000], help="raw bytes before a cut, drawn: 1500,4000,9000"
    )
    p.add_argument(
        "--idle-wait", type=float, default=10.0, help="seconds for every slot to be idle after the soak (default 10)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
    t0 = time.monotonic()

    def say(text: str) -> None:
        if not a.quiet:
            sys.stderr.write("[%6.1f] %s\n" % (time.monotonic() - t0, text))
            sys.stderr.flush()

    recipe = dict(REPORTED, loop=False) if a.recipe == "reported" else dict(FAST)
    for name in (
        "threads",
        "requests",
        "loop",
        "slots",
        "max_tokens",
        "temperature",
        "cancel_fraction",
        "cancel_at",
        "cancel_how",
    ):
        if getattr(a, name) is not None:
            recipe[name] = getattr(a, name)
    report = soak(
        a.address,
        seed=a.seed,
        seconds=a.seconds,
        wedge_after=a.wedge_after,
        stop_on_wedge=a.stop_on_wedge,
        poll=a.poll,
        client_per_thread=a.client_per_thread,
        restart_at=a.restart_at,
        pidfile=a.pidfile,
        restart_cmd=a.restart_cmd,
        limits=a.limits,
        log=say,
        resumable_fraction=a.resumable_fraction,
        cut_at=a.cut_at,
        idle_wait=a.idle_wait,
        keep_monitor=a.probe or a.confirm > 0,
        **recipe,
    )
    monitor = report.pop("monitor_thread", None)
    if a.confirm > 0 and monitor is not None:
        report["confirmed"] = {}
        for slot, record in sorted(report["wedged_now"].items()):
            ok, raw = persists(monitor, slot, record["task"], a.confirm)
            report["confirmed"][slot] = ok
            say(
                "wedge on slot %s task %s %s %.1f s after the streams closed"
                % (slot, record["task"], "persists" if ok else "did NOT persist", a.confirm)
            )
    if a.probe and report["wedged_now"]:
        slot, record = sorted(report["wedged_now"].items())[0]
        report["probe"] = examine_wedge(a.address, monitor, slot, record["task"], a.probe_seconds, log=say)
    if monitor is not None:
        monitor.stop()
        settle = time.monotonic()
        while threading.active_count() > report["threads"][0] and time.monotonic() - settle < 3.0:
            time.sleep(0.05)
        report["fds"][1], report["threads"][1] = open_fds(), threading.active_count()
    if a.terminate:
        pid = _read_pid(a.pidfile) if a.pidfile else None
        if pid is None:
            report["terminate"] = "no pid in %r" % a.pidfile
        else:
            report["terminate"] = stop_server(pid)
            say("stop: %s" % report["terminate"])
    if a.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        _print_report(report)
    return 0


def _print_report(r: Dict[str, Any]) -> None:
    out = sys.stdout.write
    out("recipe: %s\n" % json.dumps(r["recipe"]))
    out(
        "requests started: %d (cancels planned %d); stopped at %.1f s; total %.1f s\n"
        % (r["requests_started"], r["cancels_planned"], r["stopped_at_s"], r["total_s"])
    )
    out("outcomes:\n")
    for name, n in r["outcomes"].items():
        out("  %-26s %5d%s\n" % (name, n, ("   e.g. " + r["examples"][name][:90]) if name in r["examples"] else ""))
    out(
        "fds before/after: %d/%d; threads before/after: %d/%d%s\n"
        % (
            r["fds"][0],
            r["fds"][1],
            r["threads"][0],
            r["threads"][1],
            ("; HUNG workers: %s" % r["hung_workers"]) if r["hung_workers"] else "",
        )
    )
    out(
        "/slots polls: %d, errors: %s; longest stillness per slot: %s; longest that then moved: %.1f s\n"
        % (r["monitor"]["polls"], r["monitor"]["errors"], r["max_still_s"], r["max_recovered_still_s"])
    )
    if r["server_down"]:
        out("SERVER DOWN: /slots kept failing; the run stopped early (see the server's log)\n")
    if r["wedges"]:
        for w in r["wedges"]:
            out(
                "WEDGED: slot %s task %s triple %s n_remain %s: still since %.1f s, detected at %.1f s, %.1f s "
                "without movement%s\n"
                % (
                    w["slot"],
                    w["task"],
                    w["triple"],
                    w["n_remain"],
                    w["still_since"],
                    w["detected_at"],
                    w["seconds"],
                    ""
                    if w["released_at"] is None
                    else ", released at %.1f s (%s)" % (w["released_at"], w.get("released_by")),
                )
            )
        out("wedged slot (trimmed): %s\n" % json.dumps(r["wedge_example"]))
    else:
        out("no wedge\n")
    if "confirmed" in r:
        out("persisted after the streams closed: %s\n" % json.dumps(r["confirmed"]))
    if r.get("resumable"):
        out("resumable streams: %s\n" % json.dumps(r["resumable"]))
    out(
        "slots busy at the end: %s\n"
        % (
            "none"
            if r["slots_busy_at_end"] == []
            else "/slots did not answer"
            if r["slots_busy_at_end"] is None
            else r["slots_busy_at_end"]
        )
    )
    if r.get("restart"):
        out("restart: %s\n" % json.dumps(r["restart"]))
    if r.get("probe"):
        out("probe: %s\n" % json.dumps(r["probe"]))
    if r.get("terminate"):
        out("terminate: %s\n" % json.dumps(r["terminate"]))


if __name__ == "__main__":
    sys.exit(main())
