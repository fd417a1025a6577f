#!/usr/bin/env python3
"""loopclient: a one-file, standard-library client for llama.cpp's ``llama-server``.

Copy this file into your project; it needs nothing but Python 3.8 or newer.  It speaks raw HTTP/1.1 over
a Unix domain socket, TCP or TLS (``https://``), reads every stream llama-server sends as Server-Sent
Events (chat, native ``/completion`` and ``/infill``, OpenAI Responses, Anthropic Messages), assembles the
deltas (choices, reasoning, tool calls, log probabilities, prompt progress), waits out busy slots and
loading servers by polling ``/slots``, tells a wedged slot from a busy one, queues this client's requests
per slot (and per model, behind a router), and resumes a stream whose connection was lost.  ``fetch()``
gives any route's answer whole (``Response``) and ``stream_route()`` streams a route it does not name.
There is no total deadline: every wait has its own budget (see ``Limits``); a single-shot call may be
given one (``timeout=``).  ``Client`` serves threads, ``AsyncClient`` serves asyncio programs; they are
one behaviour.

Example::

    import loopclient as lc
    with lc.Client("/run/llama.sock") as client:
        reply = client.chat([{"role": "user", "content": "Hi"}], max_tokens=64,
                            on_event=lambda ev: print(ev))
        print(reply.content)

Threading model: a ``Client`` is shared by any number of threads.  Each streamed request runs in the
thread that iterates its ``Stream`` (``chat()`` iterates for you).  ``Stream.cancel()`` may be called from
any thread; it shuts the request's sockets down, which wakes the iterating thread at once.  The only
threads the library starts are short-lived ones for the requests a stream makes in the background: the
``/slots`` poll (at most one per client and model at a time) and a ``slot=None`` pool's ``/props``.
An ``AsyncClient`` starts no threads: its streams are iterated with ``async for`` on one event loop.

Its numbered sections: 1. errors and value objects; the parsers, bytes in and values out: 2. HTTP/1.1,
3. Server-Sent Events, 4. each endpoint's dialect (``Assembler`` for chat), request body and table row,
5. the response pump that runs them on one response; 6. waits, budgets and timing rules; 7. slot gates and
the ``/slots`` poller; 8. the request logic, plans that yield the I/O they need; 9. the drivers that perform
it (threads, asyncio); 10. the command line.
"""

from __future__ import annotations

import functools  # re imports it already: no cost at import
import json
import os
import re  # json imports it already: no cost at import
import socket
import sys
import threading
import time

# typing is only read by type checkers: imported after socket, json and threading, it would add about a fifth
# to a fresh interpreter's start with them (figure 2 of dev/bench.py allows loopclient 15% over them).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Generator, List, NoReturn, Optional, Sequence, Set, Tuple, TypeVar, Union

__version__ = "0.1.0"
__license__ = "MIT"

__all__ = [
    "Client", "Stream", "ChatStream", "AsyncClient", "AsyncStream", "AsyncChatStream",
    "Limits", "Completion", "ToolCallResult", "Choice", "Slot",
    "Queued", "Waiting", "Retrying", "Resumed", "Reasoning", "Content", "ToolCall", "ThinkingCapped", "Progress",
    "Chunk", "ModelEvent", "Response",
    "LoopError", "BusyError", "WaitTimeoutError", "LoadTimeoutError", "StalledError", "WedgedSlotError",
    "DeadlineError", "StreamClosedError", "ThinkingOverrunError", "HTTPStatusError", "ServerError", "ConnectError",
    "ProtocolError", "CancelledError",
    "ResponseReader", "ResponseHead", "ChunkedDecoder", "SSEDecoder", "Assembler", "ResponsePump",
    "encode_request", "parse_address", "main",
]  # fmt: skip

#: Longest response head (status line and headers), in bytes.
MAX_HEAD = 64 * 1024
#: Most header lines in a response head.
MAX_HEADERS = 100
#: Longest chunk-size line (size, extensions), in bytes.
MAX_CHUNK_LINE = 4096
#: Longest Unix socket path the OS accepts (sun_path is 108 bytes with its NUL on Linux).
MAX_UNIX_PATH = 107
#: Bytes asked of the socket per read.
RECV_SIZE = 256 * 1024
#: Backoff between retries: first delay, cap.  Each delay is jittered down by up to a quarter.
BACKOFF_FIRST = 0.25
BACKOFF_MAX = 2.0
#: How often ``/slots`` is asked again once it answered that it is not served (404, 403, 405, 501).
UNSEEN_POLL = 30.0
#: The size of a ``slot=None`` pool when ``/props`` does not say (``Limits.pool`` sets it).
POOL_GUESS = 4
#: How long a kept connection may stay idle when the server's ``Keep-Alive`` does not say (it says
#: ``timeout=5`` on llama-server; a connection is kept one second less than the server's timeout).
KEEP_IDLE = 4.0
#: How long the DELETE of a resumable stream that ends early may take (it is tried once).
FORGET_WAIT = 1.0

_USER_AGENT = "loopclient/" + __version__

#: The clock every rule reads (waits, budgets, gates, polls): the drivers' own timeouts aside, the request
#: logic asks nothing else for the time, so a test can run it on a clock of its own.
_clock = time.monotonic

#: The ``loopclient`` logger, once the program has imported ``logging`` (see ``_logger``).
_LOG = None  # type: Any
_DEBUG, _INFO, _WARNING = 10, 20, 30  # logging's levels, without importing it


def _logger(level: int = _DEBUG) -> Any:
    """The ``loopclient`` logger when it logs at ``level``, else None.  loopclient never imports ``logging``
    (it costs more than the rest of its imports): until the program has, nothing is logged or paid.  The
    logger has a ``NullHandler``, as a library's should: the program's configuration decides what is shown."""
    global _LOG
    log = _LOG
    if log is None:
        logging = sys.modules.get("logging")
        if logging is None:
            return None
        log = logging.getLogger("loopclient")
        if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
            log.addHandler(logging.NullHandler())
        _LOG = log
    return log if log.isEnabledFor(level) else None


# =====================================================================================================
# 1. Errors and value objects
# =====================================================================================================


class LoopError(Exception):
    """Root of every error the server or the connection causes."""

    _hint = ""  # what to do, the message's last clause (``_hinted``)

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _hinted(err: _E, hint: str) -> _E:
    """``err`` with ``hint``, what to do, after its message; the command line says its own instead."""
    err.message = "%s: %s" % (err.message, hint)
    err.args, err._hint = (err.message,), hint
    return err


#: What to do, after an error's message: no server answers at the address; a budget ran out.
_START_IT = "start llama-server, or check the socket path / URL"
_LONGER = "raise Limits(%s=...) to wait longer"


class BusyError(LoopError):
    """The slot's queue already holds ``queue_len`` waiters; nothing was sent."""

    def __init__(self, message: str, slot: Optional[int] = None, queue_len: int = 0, waiting: int = 0) -> None:
        super().__init__(message)
        self.slot = slot
        self.queue_len = queue_len
        #: how many requests of this client were waiting for the slot when this one was refused
        self.waiting = waiting


class _BudgetError(LoopError, TimeoutError):
    def __init__(self, message: str, waited: float = 0.0) -> None:
        LoopError.__init__(self, message)
        self.waited = waited


class WaitTimeoutError(_BudgetError):
    """The slot stayed busy for ``busy_wait`` before the first byte."""


class LoadTimeoutError(_BudgetError):
    """The server stayed unreachable or loading for ``load_wait``; ``__cause__`` is the last failure.  When
    nothing ever answered at the address (only failed connects), it is also a ``ConnectError``."""


class StalledError(_BudgetError):
    """Silence: no head within ``idle_grace`` on an idle slot, or no progress within ``liveness``."""


class DeadlineError(_BudgetError):
    """A single-shot call given ``timeout=`` did not end within it: the whole exchange, connect included.
    The connection was closed.  ``timeout`` is the deadline in seconds, ``phase`` what the call was doing
    when it ran out (``"connect"``, ``"send"``, ``"answer"`` or ``"wait"``).  A ``TimeoutError`` too."""

    def __init__(self, message: str, timeout: float = 0.0, phase: str = "answer") -> None:
        super().__init__(message, timeout)
        self.timeout = timeout
        self.phase = phase


class StreamClosedError(LoopError):
    """The connection closed mid-response, mid-chunk or before a ``finish_reason``."""


class ThinkingOverrunError(LoopError):
    """Reasoning passed the cap and the server refused, failed, or ran past ``thinking_overrun``."""

    def __init__(self, message: str, tokens: int = 0) -> None:
        super().__init__(message)
        self.tokens = tokens


class HTTPStatusError(LoopError):
    """A non-200 status that is not retried; ``status``, ``message`` (from the envelope, or one line of a
    page), ``body`` (all of it), ``server`` (the ``Server`` header, None without one).  ``str()`` names the
    front that answered (``HTTP 504 from nginx/1.22.1: ...``) when the header names something other than
    llama.cpp, or says ``the front`` for a status llama-server never sends (502, 504, 520-524)."""

    def __init__(self, status: int, message: str, body: bytes = b"", server: Optional[str] = None) -> None:
        front = _front_name(status, server)
        super().__init__("HTTP %d%s: %s" % (status, " from " + front if front else "", message))
        self.status = status
        self.message = message
        self.body = body
        self.server = server


#: Statuses llama-server never answers: a front (proxy, balancer, CDN) that could not get an answer.
_FRONT_STATUSES = frozenset((502, 504, 520, 521, 522, 523, 524))


def _front_name(status: int, server: Optional[str]) -> Optional[str]:
    """Who answered ``status``, for a message: the ``Server`` header unless it is llama-server's own,
    ``the front`` for a front's status without one, else None (llama-server itself)."""
    if server and not server.lower().startswith("llama.cpp"):
        return server[:100]
    if not server and status in _FRONT_STATUSES:
        return "the front"
    return None


class ServerError(LoopError):
    """An error event inside the stream; ``code``, ``message``, ``type``, ``error`` (the raw object)."""

    def __init__(self, code: Optional[int], message: str, type: Optional[str] = None, error: Any = None) -> None:
        super().__init__("server error %s: %s" % (code, message))
        self.code = code
        self.message = message
        self.type = type
        self.error = error


class ConnectError(LoopError):
    """A single-shot call could not reach the server (a stream: its ``LoadTimeoutError`` when nothing ever
    answered); ``address`` as given, ``__cause__`` the OS error."""

    def __init__(self, message: str, address: str = "") -> None:
        super().__init__(message)
        self.address = address


class _Unreachable(LoadTimeoutError, ConnectError):
    """A stream's wait ran out (``load_wait``) and nothing ever answered at the address (socket missing,
    connection refused): a ``LoadTimeoutError`` that is the ``ConnectError`` of "no server there" too."""

    def __init__(self, message: str, waited: float = 0.0, address: str = "") -> None:
        LoadTimeoutError.__init__(self, message, waited)
        self.address = address


class ProtocolError(LoopError):
    """Malformed HTTP, chunked framing, SSE or JSON, or a line, head or body over its cap."""


def _over(what: str, cap: str, size: int) -> ProtocolError:
    """``what`` is over its cap, ``cap`` (``max_line``, ``max_body``) of ``size`` bytes."""
    text = "%s longer than %s (%d bytes)" % (what, cap, size)
    return _hinted(ProtocolError(text), "raise Limits(%s=...) for payloads that big" % cap)


class CancelledError(LoopError):
    """``cancel()`` was called; the thread iterating the stream hears it."""


class WedgedSlotError(StalledError):
    """A processing slot stopped moving for ``wedge_wait``: the server is wedged and must be restarted.
    ``slot`` and ``task`` (None when the server does not say) name them, ``seconds`` how long nothing moved."""

    def __init__(self, message: str, slot: Optional[int] = None, task: Optional[int] = None, seconds: float = 0.0):
        super().__init__(message, seconds)
        self.slot = slot
        self.task = task
        self.seconds = seconds


# -- Value objects: the fields are the ``__slots__``, ``__init__`` is written out (``inspect.signature()``
# shows the fields), the base gives the rest; ``dataclasses`` would cost more to import than socket, json
# and threading together.

_set = object.__setattr__


def _fill(obj: _Value, values: Dict[str, Any]) -> None:
    """Set each field of ``obj`` from ``values`` (an ``__init__``'s ``locals()``)."""
    for name in obj.__match_args__:
        _set(obj, name, values[name])


if TYPE_CHECKING:
    _V = TypeVar("_V", bound="_Value")
    _E = TypeVar("_E", bound=LoopError)


class _Value:
    """Base of the immutable value objects: events, ``Completion``, ``Choice``, ``ToolCallResult``,
    ``Slot`` and ``Limits``."""

    __slots__ = ()
    __match_args__ = ()  # type: Tuple[str, ...]  # the fields, in order (subclasses inherit them)
    _hidden = ()  # type: Tuple[str, ...]  # fields left out of repr()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("%s is immutable: use .replace(%s=...)" % (type(self).__name__, name))

    def __delattr__(self, name: str) -> None:
        raise AttributeError("%s is immutable" % type(self).__name__)

    def _values(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__match_args__)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self) or not isinstance(other, _Value):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self).__name__,) + self._values())

    def __repr__(self) -> str:
        fields = ("%s=%r" % (name, getattr(self, name)) for name in self.__match_args__ if name not in self._hidden)
        return "%s(%s)" % (type(self).__name__, ", ".join(fields))

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return type(self), self._values()

    def replace(self: _V, **changes: Any) -> _V:
        """A copy with the given fields changed (``TypeError`` for a name that is not a field)."""
        values = dict(zip(self.__match_args__, self._values()))
        for name in changes:
            if name not in values:
                raise TypeError("%s has no field %r" % (type(self).__name__, name))
        values.update(changes)
        return type(self)(**values)


class Queued(_Value):
    """The request waits in this client's queue: ``ahead`` requests of this client must end before it goes,
    on its slot or its ``slot=None`` pool (the first waiter hears ``Queued(1)``, for a slot as for a full
    pool).  Heard again, at most once per ``Limits.poll``, when ``ahead`` has shrunk; never repeated or
    increased.  A ``slot=None`` request that waits while the pool's size is unknown (its ``/props`` has not
    answered) hears it only once the size is known."""

    __match_args__ = ("ahead",)
    __slots__ = __match_args__
    ahead: int

    def __init__(self, ahead: int) -> None:
        _set(self, "ahead", ahead)


class Waiting(_Value):
    """``/slots`` was asked because the response head had not started to arrive.  ``slot_busy``: the slot
    is processing (with ``slot=None``: every slot that is not wedged is).  ``wedged``: the slot is
    processing yet nothing in it has moved for ``Limits.wedge_wait``.  ``slots_known``: False when the
    server (or a proxy in front of it) does not serve ``/slots``, so that what the slot does is unknown."""

    __match_args__ = ("slot_busy", "wedged", "slots_known")
    __slots__ = __match_args__
    slot_busy: bool
    wedged: bool
    slots_known: bool

    def __init__(self, slot_busy: bool, wedged: bool = False, slots_known: bool = True) -> None:
        _fill(self, locals())


class Retrying(_Value):
    """Nothing was delivered yet; the request is sent again after ``delay`` seconds (``attempt`` counts
    from 1; ``reason`` says what failed)."""

    __match_args__ = ("attempt", "delay", "reason")
    __slots__ = __match_args__
    attempt: int
    delay: float
    reason: str

    def __init__(self, attempt: int, delay: float, reason: str) -> None:
        _fill(self, locals())


class Resumed(_Value):
    """The connection of a resumable stream was lost and the client reattached to the server's buffer of
    it, from ``offset`` body bytes (``attempt`` counts from 1).  Not output: nothing is repeated or lost."""

    __match_args__ = ("offset", "attempt")
    __slots__ = __match_args__
    offset: int
    attempt: int

    def __init__(self, offset: int, attempt: int) -> None:
        _fill(self, locals())


class Reasoning(_Value):
    """A ``reasoning_content`` delta of choice ``choice``."""

    __match_args__ = ("text", "choice")
    __slots__ = __match_args__
    text: str
    choice: int

    def __init__(self, text: str, choice: int = 0) -> None:
        _fill(self, locals())


class Content(_Value):
    """A ``content`` delta of choice ``choice``."""

    __match_args__ = ("text", "choice")
    __slots__ = __match_args__
    text: str
    choice: int

    def __init__(self, text: str, choice: int = 0) -> None:
        _fill(self, locals())


class ToolCall(_Value):
    """A tool-call delta of choice ``choice``: ``index`` keys the call; ``id`` and ``name`` as this delta
    carries them (None when it does not), ``arguments`` its fragment of the JSON arguments."""

    __match_args__ = ("index", "id", "name", "arguments", "choice")
    __slots__ = __match_args__
    index: int
    id: Optional[str]
    name: Optional[str]
    arguments: str
    choice: int

    def __init__(self, index: int, id: Optional[str], name: Optional[str], arguments: str, choice: int = 0) -> None:
        _fill(self, locals())


class ThinkingCapped(_Value):
    """The server accepted the request to end reasoning; ``tokens`` is the count at which the cap fired."""

    __match_args__ = ("tokens",)
    __slots__ = __match_args__
    tokens: int

    def __init__(self, tokens: int) -> None:
        _set(self, "tokens", tokens)


class Progress(_Value):
    """Prompt processing progress (the request asked for ``return_progress``): ``processed`` of ``total``
    prompt tokens, ``cache`` of them from the cache, ``time_ms`` spent.  Not delivered output: an error
    after only ``Progress`` events is still retried."""

    __match_args__ = ("processed", "total", "cache", "time_ms")
    __slots__ = __match_args__
    processed: int
    total: int
    cache: int
    time_ms: float

    def __init__(self, processed: int, total: int, cache: int, time_ms: float) -> None:
        _fill(self, locals())


class Chunk(_Value):
    """The parsed payload of one data event, as the server sent it: with ``raw_chunks=True`` (a JSON object,
    before the events derived from it), and every data event of ``stream_route()`` (the parsed JSON, any
    JSON value, or the event's text when it is not JSON)."""

    __match_args__ = ("data",)
    __slots__ = __match_args__
    data: Any

    def __init__(self, data: Any) -> None:
        _set(self, "data", data)


class ModelEvent(_Value):
    """One event of a router's model stream (``watch_models()``, ``GET /models/sse``): ``model`` is the
    model's name (``"*"`` for all of them), ``event`` what happened (``status_change``, ``model_status``,
    ``download_progress``, ``download_finished``, ``download_failed``, ``model_remove``, ``models_reload``)
    and ``data`` the router's details (``{"status": "loaded", ...}``), None when it sent none."""

    __match_args__ = ("model", "event", "data")
    __slots__ = __match_args__
    model: str
    event: str
    data: Optional[Dict[str, Any]]

    def __init__(self, model: str, event: str, data: Optional[Dict[str, Any]] = None) -> None:
        _fill(self, locals())


class _Headers:
    """``get()`` and ``get_all()`` of ``Response`` and ``ResponseHead``: ``headers`` holds ``(lower-case name,
    value)`` pairs in arrival order."""

    __slots__ = ()
    headers: Sequence[Tuple[str, str]]

    def get(self, name: str) -> Optional[str]:
        """The last value of header ``name`` (case-insensitive), or None."""
        values = self.get_all(name)
        return values[-1] if values else None

    def get_all(self, name: str) -> List[str]:
        """Every value of header ``name`` (case-insensitive), in arrival order."""
        name = name.lower()
        return [value for key, value in self.headers if key == name]


class Response(_Value, _Headers):
    """A whole answer as the server gave it (``fetch()``), whatever its status: ``status`` (int),
    ``reason`` (the status line's phrase), ``headers`` (``(lower-case name, value)`` pairs in arrival
    order, as ``ResponseHead.headers``; a tuple), ``body`` (bytes: empty for ``HEAD``, 204 and 304).
    ``get()`` and ``get_all()`` read a header as ``ResponseHead``'s do; ``text()`` and ``json()`` read
    the body.  ``repr`` shows at most the first 80 bytes of the body."""

    __match_args__ = ("status", "reason", "headers", "body")
    __slots__ = __match_args__
    status: int
    reason: str
    headers: Tuple[Tuple[str, str], ...]
    body: bytes

    def __init__(self, status: int, reason: str, headers: Sequence[Tuple[str, str]], body: bytes) -> None:
        headers = tuple((name.lower(), value) for name, value in headers)
        body = bytes(body)
        _fill(self, locals())

    def text(self) -> str:
        """The body as UTF-8, what does not decode replaced (U+FFFD)."""
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body parsed as JSON; ``ProtocolError`` when it is not JSON."""
        try:
            return json.loads(self.text())
        except ValueError as exc:
            raise ProtocolError("the answer (HTTP %d) is not JSON: %s" % (self.status, exc)) from None
        except RecursionError:
            raise ProtocolError("the answer (HTTP %d) is JSON nested too deeply" % self.status) from None

    def __repr__(self) -> str:
        body = repr(self.body[:80]) + ("... (%d bytes)" % len(self.body) if len(self.body) > 80 else "")
        return "Response(status=%r, reason=%r, headers=%r, body=%s)" % (self.status, self.reason, self.headers, body)


if TYPE_CHECKING:  # pragma: no cover
    Event = Union[Queued, Waiting, Retrying, Reasoning, Content, ToolCall, ThinkingCapped, Progress, Chunk, ModelEvent]


# The assembler builds the two text events per token: object.__new__ and the slot descriptors directly,
# without the call into __init__: 187 ns against 294 ns an event, measured side by side
# (TestAssemblerPaths.test_fast_and_general_paths_agree keeps them equal to Content(...)/Reasoning(...)).
_new_object = object.__new__
_set_content_text = Content.__dict__["text"].__set__
_set_content_choice = Content.__dict__["choice"].__set__
_set_reasoning_text = Reasoning.__dict__["text"].__set__
_set_reasoning_choice = Reasoning.__dict__["choice"].__set__


def _new_content(text: str, choice: int = 0) -> Content:
    event = _new_object(Content)
    _set_content_text(event, text)
    _set_content_choice(event, choice)
    return event


def _new_reasoning(text: str, choice: int = 0) -> Reasoning:
    event = _new_object(Reasoning)
    _set_reasoning_text(event, text)
    _set_reasoning_choice(event, choice)
    return event


class ToolCallResult(_Value):
    """One assembled tool call: ``id`` and ``name`` as first sent, ``arguments`` all fragments joined."""

    __match_args__ = ("id", "name", "arguments")
    __slots__ = __match_args__
    id: Optional[str]
    name: Optional[str]
    arguments: str

    def __init__(self, id: Optional[str], name: Optional[str], arguments: str) -> None:
        _fill(self, locals())

    def to_dict(self) -> Dict[str, Any]:
        """``{"id", "name", "arguments"}``."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


class Choice(_Value):
    """One choice of a completion (``n`` > 1 gives several): its assembled ``content``, ``reasoning``,
    ``tool_calls`` and ``finish_reason``; ``logprobs`` and ``reasoning_logprobs`` are the entries the server
    sent (dicts, in order), or None when it sent none; ``tokens`` the token ids the server sent (``/completion``
    and ``/infill`` with ``return_tokens``), or None when it sent none."""

    __match_args__ = (
        "index", "content", "reasoning", "tool_calls", "finish_reason", "logprobs", "reasoning_logprobs", "tokens",
    )  # fmt: skip
    __slots__ = __match_args__
    index: int
    content: str
    reasoning: str
    tool_calls: List[ToolCallResult]
    finish_reason: Optional[str]
    logprobs: Optional[List[Dict[str, Any]]]
    reasoning_logprobs: Optional[List[Dict[str, Any]]]
    tokens: Optional[List[int]]

    def __init__(
        self, index: int, content: str, reasoning: str, tool_calls: List[ToolCallResult], finish_reason: Optional[str],
        logprobs: Optional[List[Dict[str, Any]]], reasoning_logprobs: Optional[List[Dict[str, Any]]] = None,
        tokens: Optional[List[int]] = None,
    ) -> None:  # fmt: skip
        _fill(self, locals())

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict of the fields."""
        doc = {name: getattr(self, name) for name in self.__match_args__}
        doc["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return doc


class Completion(_Value):
    """The assembled answer of one streamed request.  ``content``, ``reasoning``, ``tool_calls`` (in index
    order) and ``finish_reason`` are those of the first choice; ``choices`` holds every choice (one even for
    a single answer).  ``usage`` and ``timings`` are the server's dicts (None when it sent none),
    ``reasoning_tokens`` counts the chunks that carried reasoning, ``thinking_capped`` says whether the
    thinking cap fired.  ``final`` is the endpoint's own closing object as sent (``/completion`` and
    ``/infill``: the chunk with ``stop: true``; Responses: the last event's ``response``; Messages: the
    ``message_start`` message with ``message_delta``'s ``stop_reason``, ``stop_sequence`` and ``usage``
    merged; chat: None); ``tokens`` the first choice's token ids (None when the server sent none)."""

    __match_args__ = (
        "id", "model", "content", "reasoning", "tool_calls", "finish_reason", "usage", "timings", "reasoning_tokens",
        "thinking_capped", "choices", "final", "tokens",
    )  # fmt: skip
    __slots__ = __match_args__
    id: Optional[str]
    model: Optional[str]
    content: str
    reasoning: str
    tool_calls: List[ToolCallResult]
    finish_reason: Optional[str]
    usage: Optional[Dict[str, Any]]
    timings: Optional[Dict[str, Any]]
    reasoning_tokens: int
    thinking_capped: bool
    choices: Tuple[Choice, ...]
    final: Optional[Dict[str, Any]]
    tokens: Optional[List[int]]

    def __init__(
        self, id: Optional[str], model: Optional[str], content: str, reasoning: str, tool_calls: List[ToolCallResult],
        finish_reason: Optional[str], usage: Optional[Dict[str, Any]], timings: Optional[Dict[str, Any]],
        reasoning_tokens: int = 0, thinking_capped: bool = False, choices: Optional[Sequence[Choice]] = None,
        final: Optional[Dict[str, Any]] = None, tokens: Optional[List[int]] = None,
    ) -> None:  # fmt: skip
        """``choices`` defaults to the one choice that the other fields describe."""
        if choices is None:
            choices = (Choice(0, content, reasoning, tool_calls, finish_reason, None, None, tokens),)
        choices = tuple(choices)
        _fill(self, locals())

    @property
    def logprobs(self) -> Optional[List[Dict[str, Any]]]:
        """The first choice's log probabilities (None when the server sent none)."""
        return self.choices[0].logprobs if self.choices else None

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict of the fields (what ``loopclient chat --json`` prints)."""
        doc = {name: getattr(self, name) for name in self.__match_args__}
        doc["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        doc["choices"] = [choice.to_dict() for choice in self.choices]
        return doc


class Slot(_Value):
    """One entry of ``/slots``: ``id``, ``is_processing``, and the progress fields that tell a working slot
    from a wedged one: ``task`` (``id_task``), ``decoded`` (``next_token[0].n_decoded``) and
    ``prompt_processed`` (``n_prompt_tokens_processed``), each None when the server does not send it.
    ``raw`` is the whole entry as the server sent it."""

    __match_args__ = ("id", "is_processing", "raw", "task", "decoded", "prompt_processed")
    __slots__ = __match_args__
    _hidden = ("raw",)
    id: int
    is_processing: bool
    raw: Dict[str, Any]
    task: Optional[int]
    decoded: Optional[int]
    prompt_processed: Optional[int]

    def __init__(
        self, id: int, is_processing: bool, raw: Dict[str, Any], task: Optional[int] = None,
        decoded: Optional[int] = None, prompt_processed: Optional[int] = None,
    ) -> None:  # fmt: skip
        _fill(self, locals())


_INT_LIMITS = ("queue_len", "thinking_cap", "thinking_overrun", "max_line", "max_body", "pool", "keep_alive", "servers")
_SECONDS_LIMITS = ("poll", "liveness", "busy_wait", "load_wait", "idle_grace", "wedge_wait")


def _check_limit(name: str, value: Any) -> None:
    """``TypeError`` or ``ValueError`` unless ``value`` can be ``Limits.<name>``: a count (an int) or a
    number of seconds, not negative; ``None`` where that limit may be off."""
    if value is None and name in ("thinking_cap", "pool", "wedge_wait"):
        return
    if name in _SECONDS_LIMITS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError("Limits.%s must be a number of seconds, not %r" % (name, value))
    elif isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("Limits.%s must be an int, not %r" % (name, value))
    if not value >= 0:  # also refuses NaN
        raise ValueError("Limits.%s must not be negative, got %r" % (name, value))


class Limits(_Value):
    """How long each wait may last and how much a response may hold.  Immutable; ``replace()`` makes a
    changed copy.  Times are seconds (int or float), sizes bytes, counts plain ints.  A value of the wrong
    type is ``TypeError``, a negative one ``ValueError``; ``poll``, ``liveness``, ``max_line``,
    ``max_body``, ``pool`` and ``servers`` must be greater than zero.

    queue_len        8      requests of this client that may wait behind the one in flight on a slot: ``BusyError``
    poll             1.0    how often ``/slots`` is asked while a response head is awaited
    liveness         30.0   the longest silence once a response has started: ``StalledError``
    busy_wait        600.0  how long a busy slot is waited out before the first byte: ``WaitTimeoutError``
    load_wait        120.0  how long an unreachable or loading server is waited out: ``LoadTimeoutError``
    idle_grace       10.0   how long an idle slot may leave the request unanswered: ``StalledError``
    thinking_cap     None   reasoning tokens (chunks) before the client asks the server to end reasoning
    thinking_overrun 256    reasoning tokens tolerated after that: ``ThinkingOverrunError``
    max_line         1 MiB  longest SSE line and event: ``ProtocolError``
    max_body         16 MiB longest non-streamed body: ``ProtocolError``
    wedge_wait       120.0  a processing slot's longest stillness before it is wedged: ``WedgedSlotError`` (None: never)
    pool             None   requests of a ``slot=None`` pool in flight at once (None: ``/props``'s ``total_slots``)
    keep_alive       2      idle connections kept for single-shot calls and ``/slots`` polls (0: none)
    servers          1      llama-servers behind the address (a balancer): ``/slots`` may describe another one
    session          True   send a session key (``X-Session-Id``) made from the request's stable head
    """

    __match_args__ = (
        "queue_len", "poll", "liveness", "busy_wait", "load_wait", "idle_grace", "thinking_cap", "thinking_overrun",
        "max_line", "max_body", "wedge_wait", "pool", "keep_alive", "servers", "session",
    )  # fmt: skip
    __slots__ = __match_args__
    queue_len: int
    poll: float
    liveness: float
    busy_wait: float
    load_wait: float
    idle_grace: float
    thinking_cap: Optional[int]
    thinking_overrun: int
    max_line: int
    max_body: int
    wedge_wait: Optional[float]
    pool: Optional[int]
    keep_alive: int
    servers: int
    session: bool

    def __init__(
        self, queue_len: int = 8, poll: float = 1.0, liveness: float = 30.0, busy_wait: float = 600.0,
        load_wait: float = 120.0, idle_grace: float = 10.0, thinking_cap: Optional[int] = None,
        thinking_overrun: int = 256, max_line: int = 1024 * 1024, max_body: int = 16 * 1024 * 1024,
        wedge_wait: Optional[float] = 120.0, pool: Optional[int] = None, keep_alive: int = 2, servers: int = 1,
        session: bool = True,
    ) -> None:  # fmt: skip
        values = locals()
        for name in _INT_LIMITS + _SECONDS_LIMITS:
            _check_limit(name, values[name])
        if not isinstance(session, bool):
            raise TypeError("Limits.session must be True or False, not %r" % (session,))
        for name in ("poll", "liveness", "max_line", "max_body", "pool", "servers"):
            if values[name] is not None and not values[name] > 0:
                raise ValueError("Limits.%s must be greater than zero" % name)
        _fill(self, values)


# =====================================================================================================
# 2. HTTP/1.1 without sockets
# =====================================================================================================


def _check_header_text(what: str, text: str) -> None:
    if "\r" in text or "\n" in text or "\0" in text:
        raise ValueError("%s must not contain CR, LF or NUL" % what)


def encode_request(
    method: str, path: str, host: str, headers: Sequence[Tuple[str, str]] = (), body: Optional[bytes] = None
) -> bytes:
    """Encode one HTTP/1.1 request.  A CR, LF or NUL in the path, a header name or value is ``ValueError``."""
    _check_header_text("the request path", path)
    if not path.startswith("/") or " " in path:
        raise ValueError("the request path must start with / and hold no space: %r" % path)
    _check_header_text("the Host header", host)
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: " + host]
    for name, value in headers:
        if not name or ":" in name or " " in name:
            _check_header_text("a header name", name)
            raise ValueError("invalid header name %r" % name)
        lines.append(name + ": " + value)
    if body is not None:
        lines.append("Content-Length: %d" % len(body))
    text = "\r\n".join(lines)
    breaks = len(lines) - 1
    if text.count("\n") != breaks or text.count("\r") != breaks or "\0" in text:
        # a CR, LF or NUL in a header (the path and Host are checked above): say which
        for name, value in headers:
            _check_header_text("a header name", name)
            # The value may hold a secret (Authorization): never echo it in the message.
            _check_header_text("the value of header %s" % name, value)
    head = (text + "\r\n\r\n").encode("latin-1")
    return head + body if body is not None else head


class ResponseHead(_Headers):
    """A parsed status line and header block: ``headers`` holds (lower-case name, value) pairs in arrival
    order."""

    __slots__ = ("version", "status", "reason", "headers")

    def __init__(self, version: str, status: int, reason: str, headers: List[Tuple[str, str]]) -> None:
        self.version, self.status, self.reason, self.headers = version, status, reason, headers

    def __repr__(self) -> str:
        return "ResponseHead(%s %d %s)" % (self.version, self.status, self.reason)


_TOKEN_CHARS = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")


def _parse_status_line(line: bytes) -> List[bytes]:
    """[version, code, reason?] of a status line (its LF gone, a CR before it allowed); ``ProtocolError``
    when it is not HTTP/1.x NNN or holds a NUL, a bare CR, a vertical tab or a form feed."""
    status_line = line[:-1] if line.endswith(b"\r") else line
    if _has_bad_controls(status_line):
        raise ProtocolError("a NUL, bare CR, VT or FF in the status line %r" % status_line[:80])
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise ProtocolError("malformed status line %r" % status_line[:80])
    code = parts[1]
    if len(code) != 3 or not code.isdigit():
        raise ProtocolError("malformed status code in %r" % status_line[:80])
    return parts


def _has_bad_controls(text: bytes) -> bool:
    """A NUL, a CR, a vertical tab or a form feed: what RFC 9112 lets no head line hold (other control bytes
    are tolerated in a reason phrase or a header value, as h11 does: real-world cookies carry them)."""
    return b"\0" in text or b"\r" in text or b"\x0b" in text or b"\x0c" in text


#: ``json.dumps(doc, allow_nan=False)`` without building an encoder per call (0.8 us a request)
_dumps = json.JSONEncoder(allow_nan=False).encode

#: A head block of the usual shape, whole: an HTTP/1.x status line and ``name: value`` lines, every line
#: ending in CRLF (the last one's LF is not in the block), no fold, no NUL, CR, VT or FF in a line.  What it
#: matches ``_parse_head`` splits at once; anything else goes through the line-by-line parser.
_PLAIN_HEAD = re.compile(
    rb"HTTP/1\.[01] [0-9]{3}(?: [^\x00\n\r\x0b\x0c]*)?\r"
    rb"(?:\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\x00\n\r\x0b\x0c]*\r)*\Z"
)


def _parse_head(block: bytes, max_headers: int) -> ResponseHead:
    """Parse a head block: its lines end in CRLF or a bare LF, the last one without its LF.  A folded line
    (SP or HTAB first) goes on with the previous header's value, joined by one space (RFC 9112 5.2), and
    counts for ``max_headers``; a fold right after the status line is ``ProtocolError``."""
    if _PLAIN_HEAD.match(block) is not None and block.count(b"\n") <= max_headers:
        # the usual head, checked whole by the pattern: the same values as _parse_lines gives (11.5 us
        # against 4 us for llama-server's 7 lines; TestParserHeadPaths holds the two to the same answers)
        lines = block[:-1].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        pairs = (line.partition(b":") for line in lines[1:])
        headers = [(name.decode("ascii").lower(), value.strip(b" \t").decode("latin-1")) for name, _, value in pairs]
        reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
        return ResponseHead(parts[0].decode("ascii"), int(parts[1]), reason, headers)
    return _parse_lines(block, max_headers)


def _parse_lines(block: bytes, max_headers: int) -> ResponseHead:
    """``_parse_head`` line by line: every head, every check, and the errors' words."""
    lines = block.split(b"\n")
    if len(lines) - 1 > max_headers:
        raise ProtocolError("response has more than %d header lines" % max_headers)
    parts = _parse_status_line(lines[0])
    code = parts[1]
    reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
    headers = []  # type: List[Tuple[str, str]]
    for raw in lines[1:]:
        line = raw[:-1] if raw.endswith(b"\r") else raw
        if _has_bad_controls(line):
            raise ProtocolError("a NUL, bare CR, VT or FF in the header line %r" % line[:80])
        if line.startswith((b" ", b"\t")):
            if not headers:
                raise ProtocolError("a folded header line right after the status line: %r" % line[:80])
            more = line.strip(b" \t").decode("latin-1")
            if more:
                key, text = headers[-1]
                headers[-1] = (key, text + " " + more if text else more)
            continue
        colon = line.find(b":")
        if colon <= 0:
            raise ProtocolError("malformed header line %r" % line[:80])
        name = line[:colon]
        if not _TOKEN_CHARS.issuperset(name):
            raise ProtocolError("malformed header name %r" % name[:80])
        value = line[colon + 1 :].strip(b" \t")
        headers.append((name.decode("ascii").lower(), value.decode("latin-1")))
    return ResponseHead(parts[0].decode("ascii"), int(code), reason, headers)


# The states of ChunkedDecoder: where the next byte belongs.
_CHUNK_SIZE = 0  # a chunk-size line
_CHUNK_DATA = 1  # a chunk's data, ``_left`` bytes of it to come
_CHUNK_DATA_END = 2  # the CRLF after a chunk's data
_CHUNK_TRAILER = 3  # after the last chunk: trailer lines up to a blank one


class ChunkedDecoder:
    """``Transfer-Encoding: chunked`` framing: ``feed(bytes) -> list[bytes]`` of payload; ``done`` at the end.
    Chunk extensions and trailers are ignored, a bare LF is accepted for CRLF.  Malformed framing is
    ``ProtocolError``, after the payload before it, as ``ResponseReader``'s (``failed``)."""

    __slots__ = ("done", "failed", "surplus", "_state", "_left", "_pending", "_trailers")

    def __init__(self) -> None:
        self.done = False
        self.surplus = False  # bytes came after the last chunk's blank line
        #: the error met in the bytes after the payload the last ``feed`` returned (None: none)
        self.failed = None  # type: Optional[LoopError]
        self._state = _CHUNK_SIZE
        self._left = 0
        self._pending = b""
        self._trailers = 0

    def feed(self, data: bytes) -> List[bytes]:
        if self.failed is not None:
            raise self.failed
        out = []  # type: List[bytes]
        if self.done:
            self.surplus = self.surplus or bool(data)
            return out
        try:
            self._feed(data, out)
        except ProtocolError as exc:
            self.failed = exc
            self._pending = b""
            if not out:
                raise
        return out

    def _feed(self, data: bytes, out: List[bytes]) -> None:
        if self._pending:
            data = self._pending + data
            self._pending = b""
        pos = 0
        end = len(data)
        state = self._state
        find = data.find
        hexes = _HEX_DIGITS.issuperset
        append = out.append
        while pos < end:
            if state == _CHUNK_SIZE:
                # The hot loop: whole chunks, "1a2\r\n" + data + "\r\n", one after another (llama-server
                # sends a chunk per event); anything else leaves it for the general code below.
                while True:
                    nl = find(b"\n", pos, pos + 17)
                    if nl - pos < 2 or data[nl - 1] != 13:
                        break
                    digits = data[pos : nl - 1]
                    if not hexes(digits):
                        break
                    size = int(digits, 16)
                    stop = nl + 1 + size
                    if not size or stop + 2 > end or data[stop] != 13 or data[stop + 1] != 10:
                        break
                    append(data[nl + 1 : stop])
                    pos = stop + 2
                    if pos >= end:
                        break
                if pos >= end:
                    break
            if state == _CHUNK_DATA:
                left = self._left
                if end - pos >= left:
                    out.append(data[pos : pos + left])
                    pos += left
                    self._left = 0
                    state = _CHUNK_DATA_END
                else:
                    out.append(data[pos:] if pos else data)
                    self._left = left - (end - pos)
                    pos = end
            elif state == _CHUNK_DATA_END:  # the CRLF after a chunk's data
                if data.startswith(b"\r\n", pos):
                    pos += 2
                elif data[pos] == 10:
                    pos += 1
                elif data[pos] == 13 and pos + 1 == end:
                    self._pending = b"\r"
                    pos = end
                    break
                else:
                    raise ProtocolError("chunk data is not followed by CRLF")
                state = _CHUNK_SIZE
            else:  # a chunk-size line; after the last chunk, trailer lines (ignored) up to a blank one
                what = "chunk-size" if state == _CHUNK_SIZE else "trailer"
                nl = data.find(b"\n", pos, pos + MAX_CHUNK_LINE + 2)
                if nl < 0:
                    if end - pos > MAX_CHUNK_LINE + (data[end - 1] == 13):
                        raise ProtocolError("%s line longer than %d bytes" % (what, MAX_CHUNK_LINE))
                    self._pending = data[pos:]
                    break
                line = data[pos:nl]
                if len(line) - line.endswith(b"\r") > MAX_CHUNK_LINE:
                    raise ProtocolError("%s line longer than %d bytes" % (what, MAX_CHUNK_LINE))
                pos = nl + 1
                if state == _CHUNK_SIZE:
                    self._left = _parse_chunk_size(line)
                    state = _CHUNK_DATA if self._left else _CHUNK_TRAILER
                elif line in (b"", b"\r"):
                    self.done = True
                    self.surplus = pos < end
                    break
                else:
                    self._trailers += 1
                    if self._trailers > MAX_HEADERS:
                        raise ProtocolError("more than %d trailer lines" % MAX_HEADERS)
        self._state = state

    def feed_eof(self) -> None:
        """The connection closed: ``StreamClosedError`` unless the last chunk was seen (or ``failed``)."""
        if self.failed is not None:
            raise self.failed
        if not self.done:
            if self._state == _CHUNK_TRAILER and not self._pending:
                # The final 0 chunk arrived and only its closing CRLF is missing: the body is whole.
                self.done = True
                return
            raise StreamClosedError("the connection closed in the middle of a chunk")


def _parse_chunk_size(line: bytes) -> int:
    semi = line.find(b";")
    digits = (line if semi < 0 else line[:semi]).strip(b" \t\r")
    if not digits or len(digits) > 16 or not _HEX_DIGITS.issuperset(digits):
        raise ProtocolError("malformed chunk-size line %r" % line[:40])
    size = int(digits, 16)
    if size >= 1 << 63:
        raise ProtocolError("chunk size %r does not fit in 63 bits" % digits)
    return size


class _LengthDecoder:
    """A body framed by its ``Content-Length``, or (``length`` None) by the connection's close."""

    __slots__ = ("done", "surplus", "_left")
    failed = None  # type: Optional[LoopError]  # as ChunkedDecoder's; framing by length cannot fail

    def __init__(self, length: Optional[int]) -> None:
        self._left = length
        self.done = length == 0
        self.surplus = length is None  # bytes came after the body (or will not, the connection ending it)

    def feed(self, data: bytes) -> List[bytes]:
        left = self._left
        if self.done:
            self.surplus = self.surplus or bool(data)
            return []
        if left is not None:
            if len(data) >= left:
                self.surplus = len(data) > left
                data = data[:left]
                self.done = True
            self._left = left - len(data)
        return [data]

    def feed_eof(self) -> None:
        if self._left is None:
            self.done = True
        elif not self.done:
            raise StreamClosedError("the connection closed %d bytes before the end of the body" % self._left)


class ResponseReader:
    """An HTTP/1.1 response parser fed bytes: ``feed(data) -> list[bytes]`` of body payload; ``head`` once the
    status line and headers are in, ``done`` once the body is complete, framed by ``Transfer-Encoding:
    chunked``, ``Content-Length`` or the close.  ``feed_eof()``: the connection closed; a head or body cut
    short is ``StreamClosedError``.  Malformed input, a head over ``max_head`` bytes or ``max_headers``
    lines, or a body over ``max_body`` when given (its first ``max_body`` bytes are delivered) is
    ``ProtocolError``.  The head is read as RFC 9112 asks of a user agent: lines end in CRLF or a bare LF,
    an obsolete folded line is unfolded, a NUL, bare CR, VT or FF in the status line or a header is refused.
    Payload before malformed bytes is delivered first, however the bytes were split between reads: ``feed``
    returns it and keeps the error in ``failed``, raised by the next ``feed`` or ``feed_eof``; a read that
    produced nothing raises at once.
    """

    __slots__ = (
        "head", "failed", "_buf", "_scan", "_lines", "_body", "_max_head", "_max_headers", "_max_body", "_received",
    )  # fmt: skip

    def __init__(self, max_head: int = MAX_HEAD, max_headers: int = MAX_HEADERS, max_body: Optional[int] = None):
        self.head = None  # type: Optional[ResponseHead]
        #: the error met after the payload the last ``feed`` returned (None: none)
        self.failed = None  # type: Optional[LoopError]
        self._buf = bytearray()
        self._scan = self._lines = self._received = 0
        self._body = None  # type: Optional[Union[ChunkedDecoder, _LengthDecoder]]
        self._max_head, self._max_headers, self._max_body = max_head, max_headers, max_body

    @property
    def done(self) -> bool:
        return self._body is not None and self._body.done

    @property
    def reusable(self) -> bool:
        """The body is whole, framed by its length or by chunks, with nothing after it: the connection
        may carry another request."""
        body = self._body
        return body is not None and body.done and not body.surplus

    def feed(self, data: bytes) -> List[bytes]:
        if self.failed is not None:
            raise self.failed
        body = self._body
        if body is None:
            try:
                data = self._feed_head(data)
            except ProtocolError as exc:
                self.failed = exc
                del self._buf[:]
                raise
            body = self._body
            if body is None or not data:
                return []
        try:
            out = body.feed(data)
        except ProtocolError as exc:
            self.failed = exc
            raise
        if body.failed is not None:
            self.failed = body.failed
        if self._max_body is not None:
            out = self._cap_body(out, self._max_body)
        return out

    def _cap_body(self, out: List[bytes], cap: int) -> List[bytes]:
        """``out`` cut at ``cap`` bytes of body in all; passing it is the error, raised after what fits."""
        received = self._received
        for i, piece in enumerate(out):
            received += len(piece)
            if received > cap:
                out = out[:i]
                if received - len(piece) < cap:
                    out.append(piece[: cap - (received - len(piece))])
                self._received = cap
                self.failed = error = _over("response body is", "max_body", cap)
                if not out:
                    raise error
                return out
        self._received = received
        return out

    def _feed_head(self, data: bytes) -> bytes:
        """Add ``data`` to the head; once the head is whole, parse it and return the bytes after it."""
        buf = self._buf
        buf += data
        seen = self._lines
        self._lines += data.count(b"\n")
        if not seen and self._lines:
            # the status line is whole: a reply that is not HTTP fails now, not when a head ends that never will
            _parse_status_line(bytes(buf[: buf.find(b"\n")]))
        while True:
            end = _find_head_end(buf, max(0, self._scan - 3))
            if end is None:
                if len(buf) - _head_end_begun(buf) > self._max_head:
                    raise ProtocolError("response head is longer than %d bytes" % self._max_head)
                if self._lines > self._max_headers + 1:
                    raise ProtocolError("response has more than %d header lines" % self._max_headers)
                self._scan = len(buf)
                return b""
            block_end, body_start = end
            # the cap counts the status line and header lines, not the line ends after the last of them
            if block_end - (buf[block_end - 1] == 13) > self._max_head:
                raise ProtocolError("response head is longer than %d bytes" % self._max_head)
            head = _parse_head(bytes(buf[:block_end]), self._max_headers)
            rest = bytes(buf[body_start:])
            del buf[:]
            self._scan = 0
            if 100 <= head.status < 200:  # an interim response: the real one follows
                buf += rest
                self._lines = rest.count(b"\n")
                continue
            self.head = head
            self._body = self._framing(head)
            return rest

    def _framing(self, head: ResponseHead) -> Union[ChunkedDecoder, _LengthDecoder]:
        if head.status in (204, 304):
            return _LengthDecoder(0)
        codings = head.get_all("transfer-encoding")
        if codings:
            names = [c.strip().lower() for v in codings for c in v.split(",") if c.strip()]
            if names == ["chunked"] or (names and names[-1] == "chunked" and set(names[:-1]) <= {"identity"}):
                return ChunkedDecoder()
            raise ProtocolError("unsupported Transfer-Encoding %r" % ", ".join(codings)[:80])
        lengths = head.get_all("content-length")
        if lengths:
            length = _content_length(lengths)
            if self._max_body is not None and length > self._max_body:
                raise _over("response body of %d bytes is" % length, "max_body", self._max_body)
            return _LengthDecoder(length)
        return _LengthDecoder(None)

    def feed_eof(self) -> None:
        """The connection closed.  ``StreamClosedError`` if the head or the body is incomplete; ``failed``
        if a read met an error."""
        if self.failed is not None:
            raise self.failed
        if self._body is None:
            if self._buf:
                raise StreamClosedError("the connection closed in the middle of the response head")
            raise StreamClosedError("the connection closed before any response")
        self._body.feed_eof()


def _content_length(lengths: List[str]) -> int:
    """The body length the ``Content-Length`` headers ``lengths`` say: the same value repeated is one value
    (RFC 9112 6.3); two values, or one that is not a plain decimal number, is ``ProtocolError``."""
    values = {v.strip() for item in lengths for v in item.split(",")}
    if len(values) != 1:
        raise ProtocolError("conflicting Content-Length headers %r" % sorted(values)[:4])
    value = values.pop()
    if not value.isdigit() or not value.isascii() or len(value) > 18:
        raise ProtocolError("malformed Content-Length %r" % value[:40])
    return int(value)


def _find_head_end(buf: bytearray, start: int) -> Optional[Tuple[int, int]]:
    """(end of the head block, start of the body), or None: the head ends at the first empty line, whatever
    mix of CRLF and bare LF ends it and the line before (``\\r\\n\\r\\n``, ``\\n\\n``, ``\\r\\n\\n``,
    ``\\n\\r\\n``).  The block keeps its last line's CR, if any, and drops its LF."""
    lf = buf.find(b"\n\n", start)
    crlf = buf.find(b"\n\r\n", start, lf + 1 if lf >= 0 else len(buf))
    if crlf >= 0:
        lf, body = crlf, crlf + 3
    elif lf >= 0:
        body = lf + 2
    else:
        return None
    return lf, body


def _head_end_begun(buf: bytearray) -> int:
    """How many bytes at the end of an unfinished head may be the start of the line ends that finish it: its
    last line's CR and LF, the blank line's CR.  They are not counted against ``max_head``."""
    if buf.endswith(b"\r\n\r"):
        return 3
    if buf.endswith((b"\r\n", b"\n\r")):
        return 2
    return 1 if buf.endswith((b"\r", b"\n")) else 0


def parse_error_envelope(body: bytes) -> Tuple[str, Any]:
    """(message, decoded JSON or None) from an error body ``{"error": {"message": ...}}``."""
    try:
        doc = json.loads(body.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        doc = None
    message = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message = err["message"]
        elif isinstance(err, str):
            message = err
        elif isinstance(doc.get("message"), str):
            message = doc["message"]
    if message is None:
        message = _one_line(body)
    return message, doc


_SCRIPT = re.compile(r"<(script|style)\b.*?</\1\s*>", re.I | re.S)
_TITLE = re.compile(r"<title\b[^>]*>(.*?)</title", re.I | re.S)
_TAG = re.compile(r"<[^>]*>?")


def _one_line(body: bytes) -> str:
    """A body that is no error envelope as one line: an HTML page's ``<title>`` (else its first text),
    entities decoded, whitespace collapsed, at most 200 characters; ``(empty body)`` when nothing is left."""
    text = body[:65536].decode("utf-8", "replace")
    if text.lstrip().startswith("<"):  # a page (nginx, HAProxy, a CDN), not text that happens to hold a "<"
        found = _TITLE.search(text)
        if found is not None and found.group(1).strip():
            text = found.group(1)
        else:
            text = next((part for part in _TAG.split(_SCRIPT.sub(" ", text)) if part.strip()), "")
    if "&" in text:
        import html  # only for a page with entities

        text = html.unescape(text)
    text = " ".join(text.split())
    if len(text) > 200:
        text = text[:197].rstrip() + "..."
    return text or "(empty body)"


def parse_retry_after(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds to wait from a ``Retry-After`` value (seconds or an HTTP date); None when no usable hint."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit() and value.isascii():
        return float(int(value)) if len(value) <= 18 else float("inf")  # int() and float() both have limits
    if not value or value[0] in "+-" or value[0].isdigit():
        return None
    import email.utils  # only when a server sends a date

    try:  # a date that does not parse (None on older Pythons), or that the platform's time cannot hold
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError, OSError, AttributeError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


# =====================================================================================================
# 3. Server-Sent Events decoder
# =====================================================================================================

_BOM = b"\xef\xbb\xbf"


class SSEDecoder:
    """The WHATWG event-stream rules, fed bytes: ``feed(data) -> list[(type, data)]``.

    Lines end in CRLF, LF or CR; a CR at the end of a read waits for the next byte.  One leading BOM is
    dropped, ``:`` lines are comments, one space after the colon is stripped, ``data`` lines join with
    ``\\n``, a block without data dispatches nothing.  ``type`` is the ``event`` field, else "message";
    llama-server's legacy ``error: {...}`` line dispatches as type "error".  Text is UTF-8 with invalid
    bytes replaced.  A line or an event longer than ``max_line`` bytes is ``ProtocolError`` as soon as the
    limit is passed, after the events before it, as ``ResponseReader``'s (``failed``).  ``close()`` ends
    the stream: an event not closed by a blank line is discarded.
    """

    __slots__ = ("max_line", "failed", "_buf", "_cr", "_lead", "_data", "_type", "_size")

    def __init__(self, max_line: int = 1024 * 1024) -> None:
        self.max_line = max_line
        #: the error met after the events the last ``feed`` returned (None: none)
        self.failed = None  # type: Optional[LoopError]
        self._buf = bytearray()  # the partial line, never holding a line end
        self._cr = False  # a CR ended the previous read
        self._lead = b""  # type: Optional[bytes]  # the first bytes, until the BOM question is settled
        self._data = None  # type: Optional[List[str]]  # the data lines of the event being read
        self._type = "message"
        self._size = 0

    def feed(self, data: bytes) -> List[Tuple[str, str]]:
        if self.failed is not None:
            raise self.failed
        if self._lead is not None:
            data = self._lead + data
            if len(data) < 3 and _BOM.startswith(data):
                self._lead = data
                return []
            self._lead = None
            if data.startswith(_BOM):
                data = data[3:]
        if self._cr:
            data = b"\r" + data
            self._cr = False
        if data.endswith(b"\r"):
            data = data[:-1]
            self._cr = True
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        out = []  # type: List[Tuple[str, str]]
        try:
            self._lines(data, out)
        except ProtocolError as exc:
            self._fail(exc)
            if not out:
                raise
        return out

    def close(self) -> List[Tuple[str, str]]:
        """End of stream: a held CR still ends its line; an unterminated event is discarded.  Raises
        ``failed``."""
        if self.failed is not None:
            raise self.failed
        out = self.feed(b"\n") if self._cr else []  # ends one line: it dispatches an event or fails, never both
        self._buf.clear()
        self._data = None
        self._type = "message"
        self._size = 0
        return out

    def _fail(self, exc: LoopError) -> None:
        self.failed = exc
        self._buf.clear()
        self._data = None
        self._cr = False

    def _lines(self, data: bytes, out: List[Tuple[str, str]]) -> None:
        """Decode whole lines into ``out``; keep the unfinished last one."""
        buf = self._buf
        max_line = self.max_line
        pos = 0
        end = len(data)
        find = data.find
        while True:
            # The hot path: between events, whole "data: ...\n\n" events with nothing pending; 533 ns an event
            # against 1,943 ns line by line, measured side by side.  The parser tests feed every case split at
            # every offset (TestParserSSE, TestParserRandomSplits), which takes the line-by-line path.
            if not buf and self._data is None and self._type == "message":
                append = out.append
                while data.startswith(b"data: ", pos):
                    nl = find(b"\n", pos)
                    if 0 <= nl < end - 1 and data[nl + 1] == 10 and nl - pos <= max_line:
                        append(("message", data[pos + 6 : nl].decode("utf-8", "replace")))
                        pos = nl + 2
                    else:
                        break
            nl = find(b"\n", pos)
            if nl < 0:
                break
            if buf:
                buf += data[pos:nl]
                line = bytes(buf)
                buf.clear()
            else:
                line = data[pos:nl]
            pos = nl + 1
            if not line:  # a blank line dispatches the event
                if self._data is not None:
                    lines = self._data
                    out.append((self._type, lines[0] if len(lines) == 1 else "\n".join(lines)))
                    self._data = None
                self._type = "message"
                self._size = 0
                continue
            if len(line) > max_line:
                raise _over("SSE line", "max_line", max_line)
            if line[0] == 58:  # ":" a comment, llama-server's ping
                continue
            colon = line.find(b":")
            if colon < 0:
                name, value = line, b""
            else:
                name = line[:colon]
                value = line[colon + 2 :] if line.startswith(b" ", colon + 1) else line[colon + 1 :]
            if name == b"data" or name == b"error":
                self._size += len(value) + 1
                if self._size > max_line + 1:
                    raise _over("SSE event", "max_line", max_line)
                if name == b"error":
                    self._type = "error"
                if self._data is None:
                    self._data = []
                self._data.append(value.decode("utf-8", "replace"))
            elif name == b"event" and self._type != "error":
                self._type = value.decode("utf-8", "replace") or "message"
            # id, retry and unknown fields are ignored
        rest = end - pos
        if rest:
            if len(buf) + rest > max_line:
                raise _over("SSE line", "max_line", max_line)
            buf += data[pos:] if pos else data
            if self._size and buf.startswith(b"data:"):
                # the event's earlier lines plus this unfinished one may pass the cap before its newline
                pending = len(buf) - (6 if buf.startswith(b" ", 5) else 5)
                if self._size + pending > max_line:
                    raise _over("SSE event", "max_line", max_line)


# =====================================================================================================
# 4. Delta assembler, the other endpoints' dialects, the request bodies, the table of streamed endpoints
# =====================================================================================================

# the C scanner that json.loads wraps, called without the wrapper calls and regex matches around it
_scan_json = vars(json.JSONDecoder())["scan_once"]  # type: Callable[[str, int], Tuple[Any, int]]
# and its reader of one string literal: (the text, the index after its closing quote), from after the quote
_scan_string = vars(json.decoder)["scanstring"]  # type: Callable[[str, int], Tuple[str, int]]

# How llama-server begins a chat chunk that carries one token of text (of reasoning): all of the JSON up to
# the text's string literal, whose opening quote ends it.  Its tail after the literal (created, id, model,
# ...) is the same in every token of a stream but for ``created``, the second the chunk was made: see
# Assembler._learn_tail.
_CONTENT_HEAD = '{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"'
_REASONING_HEAD = '{"choices":[{"finish_reason":null,"index":0,"delta":{"reasoning_content":"'
_CONTENT_AT, _REASONING_AT = len(_CONTENT_HEAD), len(_REASONING_HEAD)
_TAIL_KEYS = ("choices", "error", "usage", "timings", "prompt_progress")  # keys the tail must not hold
# Learning a tail costs a parse of it: past this many tails, only while each has read 4 chunks on average
_TAILS_LEARNED = 16


class _Text:
    """Text assembled from many deltas: memory tracks the text, not the number of deltas, in linear time."""

    __slots__ = ("parts", "blocks")

    def __init__(self) -> None:
        self.parts = []  # type: List[str]
        self.blocks = []  # type: List[str]

    def add(self, text: str) -> None:
        parts = self.parts
        parts.append(text)
        if len(parts) >= 2048:
            self.fold()

    def fold(self) -> None:
        """Tiny str objects cost ~50 bytes each: join the recent parts into one block."""
        self.blocks.append("".join(self.parts))
        self.parts.clear()

    def __str__(self) -> str:
        return "".join(self.blocks) + "".join(self.parts)


def _error_from(err: Any) -> ServerError:
    """A ``ServerError`` from an error object (or its ``{"error": ...}`` envelope)."""
    if isinstance(err, dict) and isinstance(err.get("error"), (dict, str)):
        err = err["error"]
    if isinstance(err, dict):
        code = err.get("code")
        if isinstance(code, str) and code.isascii() and code.isdigit() and len(code) < 10:
            code = int(code)
        if not isinstance(code, int) or isinstance(code, bool):
            code = None
        message, etype = err.get("message"), err.get("type")
        message = message if isinstance(message, str) else repr(err)[:200]
        return ServerError(code, message, etype if isinstance(etype, str) else None, err)
    return ServerError(None, str(err)[:200], None, err)


class _ChoiceState:
    """What one choice (one ``index``) has assembled so far; ``final`` is its closing object, if any."""

    __slots__ = ("content", "reasoning", "tools", "finish_reason", "logprobs", "reasoning_logprobs", "tokens", "final")

    def __init__(self) -> None:
        self.content = _Text()
        self.reasoning = _Text()
        self.tools = {}  # type: Dict[int, List[Any]]  # tool index -> [id, name, arguments, ...]
        self.finish_reason = None  # type: Optional[str]
        self.logprobs = None  # type: Optional[List[Dict[str, Any]]]
        self.reasoning_logprobs = None  # type: Optional[List[Dict[str, Any]]]
        self.tokens = None  # type: Optional[List[int]]
        self.final = None  # type: Optional[Dict[str, Any]]

    def result(self, index: int) -> Choice:
        calls = [ToolCallResult(e[0], e[1], str(e[2])) for _, e in sorted(self.tools.items())]
        content, reasoning = str(self.content), str(self.reasoning)
        return Choice(
            index, content, reasoning, calls, self.finish_reason, self.logprobs, self.reasoning_logprobs, self.tokens
        )


def _entries(kept: Optional[List[Dict[str, Any]]], entries: Any, payload: str) -> List[Dict[str, Any]]:
    """``kept`` (a new list when None) with the log-probability ``entries`` of one chunk appended."""
    if type(entries) is not list:
        raise ProtocolError("log probabilities that are not a list: %r" % payload[:80])
    for entry in entries:
        if type(entry) is not dict:
            raise ProtocolError("a log-probability entry is not an object: %r" % payload[:80])
    if kept is None:
        return list(entries)
    kept.extend(entries)
    return kept


def _payload_object(payload: str) -> Dict[str, Any]:
    """One data payload parsed; ``ProtocolError`` when it is not JSON or not an object."""
    try:
        try:
            doc, end = _scan_json(payload, 0)  # json.loads(payload) without its wrappers: this runs per event
        except StopIteration:  # leading whitespace, or no value: json.loads words the error
            end = -1
        if end != len(payload):
            doc = json.loads(payload)
    except ValueError as exc:  # JSONDecodeError
        raise ProtocolError("invalid JSON in the stream: %s (%r)" % (exc, payload[:80])) from None
    except RecursionError:
        raise ProtocolError("JSON nested too deeply in the stream") from None
    if type(doc) is not dict:
        raise ProtocolError("stream data is not a JSON object: %r" % payload[:80])
    return doc


def _field(doc: Dict[str, Any], name: str, kind: Any, payload: str) -> Any:
    """``doc[name]`` when it is a ``kind`` (str, dict or list), None when absent or null, else ``ProtocolError``."""
    value = doc.get(name)
    if value is None or type(value) is kind:
        return value
    raise ProtocolError("%r is not %s: %r" % (name, _KIND_NAMES[kind], payload[:80]))


_KIND_NAMES = {str: "a string", dict: "an object", list: "a list"}


def _carried(doc: Dict[str, Any], name: str, kind: str, payload: str) -> Dict[str, Any]:
    """``doc[name]``, the object an event of type ``kind`` carries: ``ProtocolError`` when it is absent or
    not an object."""
    value = _field(doc, name, dict, payload)  # type: Optional[Dict[str, Any]]
    if value is None:
        raise ProtocolError("%s without a %r object: %r" % (kind, name, payload[:80]))
    return value


def _merge_in(kept: Optional[Dict[str, Any]], doc: Dict[str, Any], name: str, payload: str) -> Optional[Dict[str, Any]]:
    """``kept`` with the object ``doc[name]`` (``usage``, ``timings``) merged over it, the last value of a key
    winning; ``ProtocolError`` when it is not an object."""
    value = _field(doc, name, dict, payload)
    if value is None:
        return kept
    return dict(kept, **value) if kept else value


class _Dialect:
    """What every dialect (the reader of one endpoint's payloads) keeps and the pump reads: ``id``, ``model``,
    ``usage``, ``timings``, what the thinking cap reads, ``raw_chunks``, and its choices (``_ChoiceState`` by
    index), of which ``completion()`` makes the ``Completion``.  ``output``: the event classes that count as
    delivered (after one, nothing is retried)."""

    output = (Reasoning, Content, ToolCall)  # type: Tuple[type, ...]
    #: a 200 answer that is not ``text/event-stream`` is ``ProtocolError`` (a route the client does not know;
    #: the named endpoints are read as llama-server frames them)
    event_stream = False
    #: how ``completion()`` says where a stream ended too soon: before any choice ended, before some did
    _cut = ("without a finish_reason", "before choice %s had a finish_reason")

    __slots__ = (
        "id", "model", "usage", "timings", "reasoning_tokens", "in_reasoning", "thinking_capped", "raw_chunks",
        "done", "_choices",
    )  # fmt: skip

    def __init__(self, raw_chunks: bool = False) -> None:
        #: the stream reached the endpoint's own end (never on chat, which ends with [DONE]); an attribute,
        #: since the pump reads it after every payload
        self.done = False
        self.id = None  # type: Optional[str]
        self.model = None  # type: Optional[str]
        self.usage = None  # type: Optional[Dict[str, Any]]
        self.timings = None  # type: Optional[Dict[str, Any]]
        self.reasoning_tokens = 0
        self.in_reasoning = False
        self.thinking_capped = False
        self.raw_chunks = raw_chunks
        self._choices = {}  # type: Dict[int, _ChoiceState]

    def _start(self, doc: Dict[str, Any], payload: str) -> List[Event]:
        """The events that come before a payload's own: its ``Chunk`` (with ``raw_chunks``), then the
        ``Progress`` of its ``prompt_progress`` (none when that lacks ``processed`` or ``total``)."""
        events = [Chunk(doc)] if self.raw_chunks else []  # type: List[Event]
        progress = doc.get("prompt_progress")
        if progress is None:
            return events
        if type(progress) is not dict:
            raise ProtocolError("'prompt_progress' is not an object: %r" % payload[:80])
        processed, total, cache, time_ms = (progress.get(k) for k in ("processed", "total", "cache", "time_ms"))
        for value in (processed, total, cache):
            if value is not None and type(value) is not int:
                raise ProtocolError("a 'prompt_progress' count is not an integer: %r" % payload[:80])
        if time_ms is not None:
            if type(time_ms) is not float and type(time_ms) is not int:
                raise ProtocolError("'prompt_progress.time_ms' is not a number: %r" % payload[:80])
            try:
                time_ms = float(time_ms)
            except OverflowError:
                raise ProtocolError("'prompt_progress.time_ms' is out of range: %r" % payload[:80]) from None
        if processed is not None and total is not None:
            events.append(Progress(processed, total, cache or 0, time_ms or 0.0))
        return events

    def _out(self, events: List[Event], text: Any, state: _ChoiceState, choice: int, reasoning: bool = False) -> None:
        """A delta of ``text`` (None or empty: none) of ``choice``, of its reasoning when ``reasoning``
        (one reasoning token), else of its content: kept in ``state``, its event added to ``events``."""
        if not text:
            return
        if reasoning:
            self.reasoning_tokens += 1
            self.in_reasoning = True
            state.reasoning.add(text)
            events.append(_new_reasoning(text, choice))
        else:
            self.in_reasoning = False
            state.content.add(text)
            events.append(_new_content(text, choice))

    def completion(self) -> Completion:
        """The ``Completion``: ``choices`` in index order, the lowest index giving ``content``, ``reasoning``,
        ``tool_calls``, ``finish_reason``, ``tokens`` and ``final``.  ``StreamClosedError`` unless every
        choice that appeared has a ``finish_reason`` (and one appeared)."""
        states = sorted(self._choices.items())
        unfinished = [str(index) for index, state in states if state.finish_reason is None]
        if len(unfinished) == len(states):
            raise StreamClosedError("the stream ended %s: the server stopped mid-answer" % self._cut[0])
        if unfinished:
            cut = self._cut[1] % ", ".join(unfinished)
            raise StreamClosedError("the stream ended %s: the server stopped mid-answer" % cut)
        choices = tuple(state.result(index) for index, state in states)
        first = choices[0]
        return Completion(
            self.id, self.model, first.content, first.reasoning, first.tool_calls, first.finish_reason, self.usage,
            self.timings, self.reasoning_tokens, self.thinking_capped, choices, states[0][1].final, first.tokens,
        )  # fmt: skip


class Assembler(_Dialect):
    """Turns chat chunk payloads into events and, at the end, a ``Completion``: ``feed(payload) ->
    list[Event]`` takes the text of one ``data`` event, all of its events or an error.  Choices are keyed by
    their ``index`` (missing or null: 0), each with its content, reasoning, tool calls (by the tool's
    ``index``), ``finish_reason`` and log probabilities (``logprobs.content`` and ``.reasoning_content``
    entries as sent; None while none came); the events carry ``choice=index``.  ``prompt_progress`` gives
    ``Progress`` (none without ``processed`` or ``total``); ``usage`` and ``timings`` are merged, the last
    value of a key winning; with ``raw_chunks=True`` each payload gives ``Chunk(data)`` first.  A payload
    that is not a JSON object, or a known field of the wrong type, is ``ProtocolError`` (unknown fields are
    ignored), an error object ``ServerError``.  ``reasoning_tokens`` and ``in_reasoning`` (what the thinking
    cap reads) count every choice's reasoning.
    """

    __slots__ = ("_content0", "_reasoning0", "_fast", "_tail", "_tails", "_tailed")
    _text = False  # the chunks carry chat deltas (True: OpenAI text completions, see _TextAssembler)

    def __init__(self, raw_chunks: bool = False) -> None:
        _Dialect.__init__(self, raw_chunks)
        self._content0 = _Text()  # choice 0's texts, reached without a lookup by the fast path
        self._reasoning0 = _Text()
        self._fast = False  # the fast path may run: the id is known, choice 0 appeared, no raw chunks
        self._tail = None  # type: Optional[str]  # the token chunks' tail, once learned (_learn_tail)
        self._tails = 0  # the tails learned
        self._tailed = 0  # the payloads read by a learned tail

    def feed(self, payload: str) -> List[Event]:
        text = None  # type: Optional[str]  # the text of a token of choice 0, once one is found
        tail = self._tail
        if tail is not None and payload.endswith(tail):
            # The hottest path: a token chunk as the last one learned from, but for its text, which is then
            # the one string literal between a head and that tail: 0.5 us a payload against 2.3 us through
            # the parse below.  TestAssemblerPaths holds it to the general path.
            content = payload.startswith(_CONTENT_HEAD)
            if content or payload.startswith(_REASONING_HEAD):
                try:
                    piece, end = _scan_string(payload, _CONTENT_AT if content else _REASONING_AT)
                except ValueError:
                    end = -1  # not a string literal: the parse below says what is wrong
                if end + len(tail) == len(payload):
                    self._tailed += 1
                    text = piece
        if text is None:
            try:
                doc, end = _scan_json(payload, 0)  # _payload_object(payload), inlined: this runs per token
                if end != len(payload) or type(doc) is not dict:
                    doc = _payload_object(payload)
            except (StopIteration, ValueError, RecursionError):
                doc = _payload_object(payload)  # which raises, or parses what the scanner alone refuses
            # The hot path once parsed: choice 0 alone, its delta only text; no finish, log probabilities, usage
            # or progress.  2.3 us a payload against 4.0 us through json.loads and _feed, measured side by
            # side.  It must give exactly what _feed gives (TestAssemblerPaths.test_fast_and_general_paths_agree).
            choices = doc.get("choices")
            if self._fast and type(choices) is list and len(choices) == 1:
                choice = choices[0]
                if (
                    type(choice) is dict and choice.get("finish_reason") is None and choice.get("logprobs") is None
                    and "error" not in doc and "usage" not in doc and "timings" not in doc
                    and "prompt_progress" not in doc
                ):  # fmt: skip
                    index, delta = choice.get("index"), choice.get("delta")
                    if (index == 0 and type(index) is int or index is None) and type(delta) is dict and len(delta) == 1:
                        text = delta.get("content")
                        content = type(text) is str
                        if not content:
                            text = delta.get("reasoning_content")
                            if type(text) is not str:
                                text = None
                        if text is not None:
                            self._learn_tail(payload, content)
            if text is None:
                return self._feed(doc, payload)
        # one token of choice 0: its text, read by the learned tail or from the parse
        if not text:
            return []
        if content:
            self.in_reasoning = False
            parts = self._content0.parts
            parts.append(text)
            if len(parts) >= 2048:
                self._content0.fold()
            event = _new_object(Content)  # as _new_content(text), inlined: this runs per token
            _set_content_text(event, text)
            _set_content_choice(event, 0)
            return [event]
        self.reasoning_tokens += 1
        self.in_reasoning = True
        self._reasoning0.add(text)
        return [_new_reasoning(text)]

    def _learn_tail(self, payload: str, content: bool) -> None:
        """Learn what follows the text's literal in ``payload``, a token chunk (of text when ``content``) the
        fast path took that begins with llama-server's head: a later chunk with that head and tail is the same
        JSON but for its text.  The tail must close the delta, the choice and the choices (``}}]``) and hold
        no ``choices`` (a later key would replace the head's).  A stream whose tail changes more often than
        every fifth chunk stops being learned from."""
        if not payload.startswith(_CONTENT_HEAD if content else _REASONING_HEAD):
            return
        if self._tails >= _TAILS_LEARNED and self._tailed < 4 * self._tails:
            return
        self._tails += 1
        try:
            tail = payload[_scan_string(payload, _CONTENT_AT if content else _REASONING_AT)[1] :]
            if tail[:4] == "}}],":
                rest = json.loads("{" + tail[4:])
            elif tail.rstrip() == "}}]}":
                rest = {}
            else:
                return
        except (ValueError, RecursionError):
            return
        if type(rest) is dict and rest.keys().isdisjoint(_TAIL_KEYS):
            self._tail = tail

    def _feed(self, doc: Dict[str, Any], payload: str) -> List[Event]:
        """The general path: any parsed payload."""
        if "error" in doc:
            raise _error_from(doc["error"])
        if self.id is None:
            cid = doc.get("id")
            if isinstance(cid, str):
                self.id = cid
            model = doc.get("model")
            if isinstance(model, str):
                self.model = model
        events = self._start(doc, payload)
        for choice in _field(doc, "choices", list, payload) or ():
            if type(choice) is not dict:
                raise ProtocolError("a choice is not an object: %r" % payload[:80])
            index = choice.get("index")
            if index is None:
                index = 0
            elif type(index) is not int:
                raise ProtocolError("a choice's 'index' is not an integer: %r" % payload[:80])
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _ChoiceState()
                if index == 0:
                    state.content = self._content0
                    state.reasoning = self._reasoning0
            if self._text:  # OpenAI text completions: the choice's own "text" is the delta
                text = choice.get("text")
                if text is not None and type(text) is not str:
                    raise ProtocolError("a choice's 'text' is not a string: %r" % (text,))
                self._out(events, text, state, index)
            else:
                delta = choice.get("delta")
                if delta is not None and type(delta) is not dict:
                    raise ProtocolError("a delta is not an object: %r" % payload[:80])
                if delta:
                    self._delta(delta, state, index, events)
            logprobs = choice.get("logprobs")
            if logprobs is not None:
                if type(logprobs) is not dict:
                    raise ProtocolError("a choice's 'logprobs' is not an object: %r" % payload[:80])
                entries = logprobs.get("content")
                if entries is not None:
                    state.logprobs = _entries(state.logprobs, entries, payload)
                entries = logprobs.get("reasoning_content")
                if entries is not None:
                    state.reasoning_logprobs = _entries(state.reasoning_logprobs, entries, payload)
            reason = _field(choice, "finish_reason", str, payload)
            if reason is not None:
                state.finish_reason = reason
        self.usage = _merge_in(self.usage, doc, "usage", payload)
        self.timings = _merge_in(self.timings, doc, "timings", payload)
        if not self._fast:
            self._fast = self.id is not None and 0 in self._choices and not self.raw_chunks and not self._text
        return events

    def _delta(self, delta: Dict[str, Any], state: _ChoiceState, index: int, events: List[Event]) -> None:
        for name in ("reasoning_content", "content"):
            text = delta.get(name)
            if text is not None and type(text) is not str:
                raise ProtocolError("%r is not a string: %r" % (name, text))
            self._out(events, text, state, index, name == "reasoning_content")
        calls = delta.get("tool_calls")
        if calls is not None and type(calls) is not list:
            raise ProtocolError("'tool_calls' is not a list: %r" % (calls,))
        if calls:
            self.in_reasoning = False
            for call in calls:
                self._tool_call(call, state, index, events)

    @staticmethod
    def _tool_call(call: Any, state: _ChoiceState, choice: int, events: List[Event]) -> None:
        if type(call) is not dict:
            raise ProtocolError("a tool-call delta is not an object: %r" % (call,))
        index = call.get("index")
        if type(index) is not int:
            raise ProtocolError("a tool-call delta has no integer 'index': %r" % (call,))
        func = call.get("function")
        if func is not None and type(func) is not dict:
            raise ProtocolError("a tool call's 'function' is not an object: %r" % (call,))
        func = func or {}
        cid, name, args = call.get("id"), func.get("name"), func.get("arguments")
        for what, value in (("id", cid), ("name", name), ("arguments", args)):
            if value is not None and type(value) is not str:
                raise ProtocolError("a tool call's %r is not a string: %r" % (what, call))
        entry = state.tools.get(index)
        if entry is None:
            entry = state.tools[index] = [None, None, _Text()]
        if cid and entry[0] is None:
            entry[0] = cid
        if name and entry[1] is None:
            entry[1] = name
        if args:
            entry[2].add(args)
        if cid or name or args:
            events.append(ToolCall(index, cid or None, name or None, args or "", choice))

    def _lowest(self) -> _ChoiceState:
        return self._choices[min(self._choices)] if self._choices else _ChoiceState()

    @property
    def finish_reason(self) -> Optional[str]:
        """The lowest-index choice's ``finish_reason`` so far (None: none yet)."""
        return self._lowest().finish_reason

    @property
    def content(self) -> str:
        """The lowest-index choice's content so far."""
        return str(self._lowest().content)

    @property
    def reasoning(self) -> str:
        """The lowest-index choice's reasoning so far."""
        return str(self._lowest().reasoning)


class _TextAssembler(Assembler):
    """The dialect of ``/v1/completions`` (OpenAI text completions): chat's chunks, each choice carrying its
    delta as ``text`` instead of a ``delta`` object, read as chat's otherwise; the ``null`` payload that
    opens a stream of several prompts gives nothing.  It never takes the fast path (which reads deltas)."""

    __slots__ = ()
    _text = True

    def feed(self, payload: str) -> List[Event]:
        if payload == "null":  # a stream of several prompts opens with it, as /completion's does
            return []
        return Assembler.feed(self, payload)


# -- The other streamed endpoints: /completion and /infill, Responses, Messages: dialects as the Assembler
# is; ``done`` says the stream reached its own end (no ``[DONE]`` there).  Responses and Messages repeat the
# SSE event type in the data's ``type``; an ``event: error`` block is raised by the pump.


def _token_count(usage: Dict[str, Any], name: str, payload: str) -> int:
    """A token count of a usage object: 0 when absent or null, ``ProtocolError`` when not an integer."""
    value = usage.get(name)
    if value is None:
        return 0
    if type(value) is not int:
        raise ProtocolError("usage count %r is not an integer: %r" % (name, payload[:80]))
    return value


def _chat_usage(usage: Dict[str, Any], prompt: int, completion: int) -> Dict[str, Any]:
    """``usage`` with chat's ``prompt_tokens``, ``completion_tokens`` and ``total_tokens`` beside its own keys."""
    return dict(usage, prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


#: llama-server's ``stop_type`` in chat's words
_NATIVE_FINISH = {"eos": "stop", "word": "stop", "limit": "length"}


def _native_finish(chunk: Dict[str, Any]) -> str:
    """A native stop chunk's ``stop_type`` in chat's words (none, or one that is not a string: "stop")."""
    how = chunk.get("stop_type")
    return _NATIVE_FINISH.get(how, how) if type(how) is str else "stop"


def _native_usage(finals: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The token counts of native stop chunks (one per choice that ended), summed, with chat's keys beside
    them; None when none of them counts tokens."""
    counted = [f for f in finals if "tokens_evaluated" in f or "tokens_predicted" in f]
    if not counted:
        return None
    own = {}  # type: Dict[str, Any]
    for name in ("tokens_evaluated", "tokens_predicted", "tokens_cached"):
        values = [f[name] for f in counted if type(f.get(name)) is int]
        if values:
            own[name] = sum(values)
    return _chat_usage(own, own.get("tokens_evaluated", 0), own.get("tokens_predicted", 0))


class _NativeAssembler(_Dialect):
    """The stream of ``/completion`` and ``/infill``: one JSON object per token, a choice per prompt (the
    chunk's ``index``), whose ``stop: true`` chunk ends it and is its ``final``; ``done`` once every choice
    that appeared has ended.  A progress chunk's ``tokens`` (a placeholder ``[0]``) are left out, a ``null``
    payload (first in a stream of several prompts) gives nothing; ``id`` only from a string ``id``."""

    __slots__ = ("_open", "_first")
    _cut = ("before its stop chunk", "before choice %s had its stop chunk")

    def __init__(self, raw_chunks: bool = False) -> None:
        _Dialect.__init__(self, raw_chunks)
        self._open = 0  # choices that appeared and have not had their stop chunk
        #: choice 0's state once it has a token list and no Chunk events are due: the fast path may run
        self._first = None  # type: Optional[_ChoiceState]

    def feed(self, payload: str) -> List[Event]:
        if payload == "null":  # a stream of several prompts opens with it
            return []
        try:
            doc, end = _scan_json(payload, 0)  # _payload_object(payload), inlined: this runs per token
            if end != len(payload) or type(doc) is not dict:
                doc = _payload_object(payload)
        except (StopIteration, ValueError, RecursionError):
            doc = _payload_object(payload)  # which raises, or parses what the scanner alone refuses
        # The hot path: a token of choice 0, one id and its text, nothing else that _feed reads but the
        # index.  It must give exactly what _feed gives (TestNativeAssemblerPaths).
        first = self._first
        if (
            first is not None and doc.get("stop") is False and "prompt_progress" not in doc
            and "completion_probabilities" not in doc and "timings" not in doc and "error" not in doc
        ):  # fmt: skip
            index, text, tokens = doc.get("index", 0), doc.get("content"), doc.get("tokens")
            if (
                index == 0 and type(index) is int and type(text) is str
                and type(tokens) is list and len(tokens) == 1 and type(tokens[0]) is int
            ):  # fmt: skip
                first.tokens.append(tokens[0])  # type: ignore[union-attr]  # not None once _first is set
                if not text:
                    return []
                parts = first.content.parts
                parts.append(text)
                if len(parts) >= 2048:
                    first.content.fold()
                event = _new_object(Content)  # as Content(text, 0), without the call into __init__
                _set_content_text(event, text)
                _set_content_choice(event, 0)
                return [event]
        return self._feed(doc, payload)

    def _feed(self, doc: Dict[str, Any], payload: str) -> List[Event]:
        """The general path: any chunk, every field checked."""
        if "error" in doc:
            raise _error_from(doc["error"])
        index = doc.get("index", 0)
        if type(index) is not int:
            if index is not None:
                raise ProtocolError("a chunk's 'index' is not an integer: %r" % payload[:80])
            index = 0
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _ChoiceState()
            self._open += 1
            self.done = False
        events = self._start(doc, payload)
        self._out(events, _field(doc, "content", str, payload), state, index)
        # a progress chunk's tokens are a placeholder ([0] on this build), not generated tokens
        tokens = doc.get("tokens") if doc.get("prompt_progress") is None else None
        if tokens is not None and (type(tokens) is not list or any(type(t) is not int for t in tokens)):
            raise ProtocolError("'tokens' is not a list of integers: %r" % payload[:80])
        if tokens:
            if state.tokens is None:
                state.tokens = list(tokens)
                if index == 0 and not self.raw_chunks:
                    self._first = state
            else:
                state.tokens += tokens
        probs = doc.get("completion_probabilities")
        if probs is not None:
            state.logprobs = _entries(state.logprobs, probs, payload)
        self.timings = _merge_in(self.timings, doc, "timings", payload)
        stop = doc.get("stop")
        if stop is not None and type(stop) is not bool:
            raise ProtocolError("'stop' is not a boolean: %r" % payload[:80])
        if stop:
            self._stop(doc, state, payload)
        return events

    def _stop(self, doc: Dict[str, Any], state: _ChoiceState, payload: str) -> None:
        _field(doc, "stop_type", str, payload)
        for name in ("tokens_evaluated", "tokens_predicted"):
            _token_count(doc, name, payload)
        model = doc.get("model")
        if type(model) is str:
            self.model = model
        cid = doc.get("id")
        if self.id is None and type(cid) is str:
            self.id = cid
        if state.finish_reason is None:
            self._open -= 1
            self.done = self._open == 0
        state.finish_reason = _native_finish(doc)
        state.final = doc
        self.usage = _native_usage([s.final for s in self._choices.values() if s.final is not None])


class _EventAssembler(_Dialect):
    """What the Responses and Messages dialects share: one answer (choice 0) of text, reasoning and tool
    calls, built from typed events (the data's ``type``), ending at the endpoint's closing event."""

    __slots__ = ("_state",)

    def __init__(self, raw_chunks: bool = False) -> None:
        _Dialect.__init__(self, raw_chunks)
        self._state = self._choices[0] = _ChoiceState()

    def _begin(self, payload: str) -> Tuple[Dict[str, Any], Optional[str], List[Event]]:
        """(doc, its type, the events list with its Chunk and Progress) for one payload; an error payload
        raises: ``{"error": ...}``, type "error", or the bare error object this build sends mid-stream on
        Messages (``{"code": 500, "message": ..., "type": "server_error"}``: a type ending in ``_error``)."""
        doc = _payload_object(payload)
        kind = doc.get("type")
        if "error" in doc or kind == "error":
            raise _error_from(doc.get("error", doc))
        if type(kind) is not str:
            if kind is not None:
                raise ProtocolError("an event's 'type' is not a string: %r" % payload[:80])
        elif kind.endswith("_error"):
            raise _error_from(doc)
        self.timings = _merge_in(self.timings, doc, "timings", payload)
        return doc, kind, self._start(doc, payload)

    def _new_call(self, cid: Optional[str], name: Optional[str], events: List[Event]) -> List[Any]:
        """A tool call begins: its entry (``[id, name, arguments, index]``), its index the calls before it."""
        tools = self._state.tools
        index = len(tools)
        entry = tools[index] = [cid or None, name or None, _Text(), index]
        self.in_reasoning = False
        if cid or name:
            events.append(ToolCall(index, cid or None, name or None, ""))
        return entry

    def _arguments(self, entry: List[Any], text: str, events: List[Event]) -> None:
        if text:
            self.in_reasoning = False
            entry[2].add(text)
            events.append(ToolCall(entry[3], None, None, text))

    def _end(self, finish: str, final: Dict[str, Any]) -> None:
        """The closing event: the answer's ``finish_reason`` and ``final``."""
        self._state.finish_reason, self._state.final = finish, final
        self.done = True


#: Responses ``incomplete_details.reason`` in chat's words
_RESPONSES_INCOMPLETE = {"max_output_tokens": "length", "content_filter": "content_filter"}
_RESPONSES_REASONING = ("response.reasoning_text.delta", "response.reasoning_summary_text.delta")
_RESPONSES_REASONING_DONE = ("response.reasoning_text.done", "response.reasoning_summary_text.done")


class _ResponsesAssembler(_EventAssembler):
    """The stream of OpenAI Responses (``POST /v1/responses``): typed events, ``response.completed`` (or
    ``response.incomplete``) last, whose ``response`` is ``final``.  A ``function_call`` output item starts
    a tool call (``id`` its ``call_id``, else its ``id``); ``response.function_call_arguments.delta`` adds to
    the call its ``item_id`` (or ``output_index``) names, else to the latest call.  The ``.done`` events
    hold whole texts and whole arguments: what they hold past the deltas is delivered as a last delta (a
    call first seen in ``response.output_item.done`` gets all its arguments so; an id or name first seen
    late is a ToolCall of its own).  Unknown event types are ignored."""

    __slots__ = ("_keys", "_items")
    _cut = ("before response.completed", "")

    def __init__(self, raw_chunks: bool = False) -> None:
        super().__init__(raw_chunks)
        self._keys = {}  # type: Dict[Any, List[Any]]  # item id, call id or ("output", n) -> call entry
        self._items = {}  # type: Dict[Any, _Text]  # (item id, reasoning?) -> that item's text so far

    def feed(self, payload: str) -> List[Event]:
        doc, kind, events = self._begin(payload)
        if kind == "response.output_text.delta":
            self._item_text(doc, "delta", payload, events, False)
        elif kind in _RESPONSES_REASONING:
            self._item_text(doc, "delta", payload, events, True)
        elif kind == "response.output_text.done":
            self._item_text(doc, "text", payload, events, False, True)
        elif kind in _RESPONSES_REASONING_DONE:
            self._item_text(doc, "text", payload, events, True, True)
        elif kind == "response.function_call_arguments.delta":
            self._call_delta(doc, payload, events)
        elif kind == "response.output_item.added" or kind == "response.output_item.done":
            item = _field(doc, "item", dict, payload)
            if item is not None and item.get("type") == "function_call":
                self._call_item(item, doc, payload, events, kind == "response.output_item.done")
        elif kind == "response.completed" or kind == "response.incomplete":
            self._closing(doc, kind, payload)
        elif kind == "response.failed":
            response = _field(doc, "response", dict, payload) or {}
            error = response.get("error")
            raise _error_from(error if error is not None else {"message": "the response failed: %s" % payload[:200]})
        elif kind == "response.created" or kind == "response.in_progress":
            self._response(_field(doc, "response", dict, payload))
        return events

    def _item_text(
        self, doc: Dict[str, Any], name: str, payload: str, events: List[Event], reasoning: bool, whole: bool = False
    ) -> None:
        """A text delta of an output item; with ``whole``, the item's whole text (a ``.done`` event): what it
        holds past that item's deltas (text the server held back, as a possible stop word, and sent only
        there) is a last delta.  A done event of an item no delta named adds nothing once any text of its
        kind came, since the deltas may have named their item otherwise."""
        text = _field(doc, name, str, payload)
        if not text:
            return
        item = doc.get("item_id")
        key = (item if type(item) is str else None, reasoning)
        kept = self._items.get(key)
        if whole:
            seen = self._state.reasoning if reasoning else self._state.content
            if kept is None and (seen.parts or seen.blocks):
                return
            have = str(kept) if kept is not None else ""
            if len(text) <= len(have) or not text.startswith(have):
                return
            text = text[len(have) :]
        if kept is None:
            kept = self._items[key] = _Text()
        kept.add(text)
        self._out(events, text, self._state, 0, reasoning)

    def _response(self, response: Optional[Dict[str, Any]]) -> None:
        if response is None:
            return
        rid, model = response.get("id"), response.get("model")
        if self.id is None and type(rid) is str:
            self.id = rid
        if type(model) is str:
            self.model = model

    def _lookup(self, doc: Dict[str, Any], keys: Tuple[str, ...]) -> Optional[List[Any]]:
        for name in keys:
            key = doc.get(name)
            if type(key) is str and key in self._keys:
                return self._keys[key]
        out = doc.get("output_index")
        if type(out) is int:
            return self._keys.get(("output", out))
        return None

    def _call_item(
        self, item: Dict[str, Any], doc: Dict[str, Any], payload: str, events: List[Event], finished: bool
    ) -> None:
        cid, iid, name = (_field(item, k, str, payload) for k in ("call_id", "id", "name"))
        args = _field(item, "arguments", str, payload)
        entry = self._lookup(item, ("call_id", "id")) or self._lookup(doc, ())
        if entry is None:
            entry = self._new_call(cid or iid, name, events)
        else:  # an id or name the call did not have yet is delivered too, as a delta of its own
            late_id = cid or iid if entry[0] is None else None
            late_name = name or None if entry[1] is None else None
            if late_id or late_name:
                entry[0] = entry[0] or late_id
                entry[1] = entry[1] or late_name
                events.append(ToolCall(entry[3], late_id, late_name, ""))
        for key in (cid, iid):
            if key:
                self._keys[key] = entry
        out = doc.get("output_index")
        if type(out) is int:
            self._keys[("output", out)] = entry
        if args:
            # the added item may carry a first fragment; the done item carries all of them, of which only
            # what the deltas did not bring is new
            have = str(entry[2])
            if finished and not (len(args) > len(have) and args.startswith(have)):
                return
            self._arguments(entry, args[len(have) :], events)

    def _call_delta(self, doc: Dict[str, Any], payload: str, events: List[Event]) -> None:
        text = _field(doc, "delta", str, payload)
        _field(doc, "item_id", str, payload)
        entry = self._lookup(doc, ("item_id",))
        if entry is None:
            tools = self._state.tools
            if not tools:
                raise ProtocolError("function-call arguments before any function call: %r" % payload[:80])
            entry = tools[len(tools) - 1]
        if text:
            self._arguments(entry, text, events)

    def _closing(self, doc: Dict[str, Any], kind: str, payload: str) -> None:
        response = _carried(doc, "response", kind, payload)
        self._response(response)
        output = _field(response, "output", list, payload)
        if kind == "response.completed":
            if output is None:
                calls = bool(self._state.tools)
            else:
                calls = any(type(item) is dict and item.get("type") == "function_call" for item in output)
            finish = "tool_calls" if calls else "stop"
        else:
            details = _field(response, "incomplete_details", dict, payload) or {}
            reason = _field(details, "reason", str, payload)
            finish = "length" if reason is None else _RESPONSES_INCOMPLETE.get(reason, reason)
        usage = _field(response, "usage", dict, payload)
        if usage is not None:
            prompt = _token_count(usage, "input_tokens", payload)
            self.usage = _chat_usage(usage, prompt, _token_count(usage, "output_tokens", payload))
        self.timings = _merge_in(self.timings, response, "timings", payload)
        self._end(finish, response)


#: Messages ``stop_reason`` in chat's words
_MESSAGES_FINISH = {
    "end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
    "refusal": "content_filter",
}  # fmt: skip


class _MessagesAssembler(_EventAssembler):
    """The stream of Anthropic Messages (``POST /v1/messages``): typed events, ``message_stop`` last.  A
    ``tool_use`` block starts a tool call, its ``input_json_delta`` fragments the arguments; other types are
    ignored.  ``final`` is ``message_start``'s message, ``message_delta``'s stop reason, stop sequence and
    usage merged.  A ``message_stop`` without a stop reason, or a JSON delta off a tool-use block, is
    ``ProtocolError``."""

    __slots__ = ("_message", "_usage", "_stop", "_blocks")
    _cut = ("before message_stop", "")

    def __init__(self, raw_chunks: bool = False) -> None:
        super().__init__(raw_chunks)
        self._message = None  # type: Optional[Dict[str, Any]]
        self._usage = None  # type: Optional[Dict[str, Any]]
        self._stop = {}  # type: Dict[str, Any]  # message_delta's stop_reason and stop_sequence
        self._blocks = {}  # type: Dict[int, List[Any]]  # content block index -> its tool call

    def feed(self, payload: str) -> List[Event]:
        doc, kind, events = self._begin(payload)
        if kind == "content_block_delta":
            index = self._index(doc, payload)
            delta = _carried(doc, "delta", kind, payload)
            dtype = delta.get("type")
            if dtype == "text_delta":
                self._out(events, _field(delta, "text", str, payload), self._state, 0)
            elif dtype == "thinking_delta":
                self._out(events, _field(delta, "thinking", str, payload), self._state, 0, True)
            elif dtype == "input_json_delta":
                text = _field(delta, "partial_json", str, payload)
                entry = self._blocks.get(index)
                if entry is None:
                    raise ProtocolError("input_json_delta for a block that is not a tool_use block: %r" % payload[:80])
                self._arguments(entry, text or "", events)
        elif kind == "content_block_start":
            index = self._index(doc, payload)
            block = _carried(doc, "content_block", kind, payload)
            if block.get("type") == "tool_use":
                cid, name = _field(block, "id", str, payload), _field(block, "name", str, payload)
                self._blocks[index] = self._new_call(cid, name, events)
        elif kind == "message_start":
            message = _carried(doc, "message", kind, payload)
            self._message = message
            mid, model = message.get("id"), message.get("model")
            if type(mid) is str:
                self.id = mid
            if type(model) is str:
                self.model = model
            self._usage = _merge_in(self._usage, message, "usage", payload)
        elif kind == "message_delta":
            delta = _field(doc, "delta", dict, payload) or {}
            for name in ("stop_reason", "stop_sequence"):
                if name in delta:
                    self._stop[name] = _field(delta, name, str, payload)
            self._usage = _merge_in(self._usage, doc, "usage", payload)
        elif kind == "message_stop":
            self._closing(payload)
        return events

    @staticmethod
    def _index(doc: Dict[str, Any], payload: str) -> int:
        index = doc.get("index")
        if type(index) is not int:
            raise ProtocolError("a content block event without an integer 'index': %r" % payload[:80])
        return index

    def _closing(self, payload: str) -> None:
        reason = self._stop.get("stop_reason")
        if reason is None:
            raise ProtocolError("message_stop without a stop_reason: %r" % payload[:80])
        usage = self._usage
        if usage is not None:
            names = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
            prompt = sum(_token_count(usage, name, payload) for name in names)
            self.usage = _chat_usage(usage, prompt, _token_count(usage, "output_tokens", payload))
        final = dict(self._message) if self._message is not None else {}
        final["stop_reason"] = reason
        final["stop_sequence"] = self._stop.get("stop_sequence")
        if usage is not None:
            final["usage"] = usage
        self._end(_MESSAGES_FINISH.get(reason, reason), final)


class _ModelEvents(_Dialect):
    """The dialect of a router's ``GET /models/sse``: each payload ``{"model", "event", "data"}`` is one
    ``ModelEvent``.  The stream has no end of its own: the connection closing is ``StreamClosedError``."""

    __slots__ = ()

    def feed(self, payload: str) -> List[Event]:
        doc = _payload_object(payload)
        model, event = _field(doc, "model", str, payload), _field(doc, "event", str, payload)
        if model is None or event is None:
            raise ProtocolError("a model event without 'model' or 'event': %r" % payload[:80])
        events = [Chunk(doc)] if self.raw_chunks else []  # type: List[Event]
        events.append(ModelEvent(model, event, _field(doc, "data", dict, payload)))
        return events

    def completion(self) -> Completion:
        raise StreamClosedError("the router closed its model event stream (GET /models/sse)")


class _RouteChunks(_Dialect):
    """The dialect of ``stream_route()``, for a route loopclient does not know: each data event is one
    ``Chunk`` (the parsed JSON, any value, else the event's text), delivered output; a JSON object whose
    ``error`` is an object or a string is an error event.  The stream ends at ``[DONE]`` or at the end of the
    body.  Chunks in OpenAI's shape (``choices``, ``usage``) or llama-server's native one (``stop``, per
    ``index``) fill the ``Completion`` as the named calls do, without the text; fields of such a shape that
    hold the wrong type are ignored (the route is not known to be what it looks like)."""

    __slots__ = ("_finish", "_finals")
    output = (Chunk,)  # type: Tuple[type, ...]
    event_stream = True

    def __init__(self, raw_chunks: bool = False) -> None:
        _Dialect.__init__(self, raw_chunks)
        self._finish = {}  # type: Dict[int, Optional[str]]  # OpenAI's shape: choice index -> finish_reason
        self._finals = {}  # type: Dict[int, Optional[Dict[str, Any]]]  # native: index -> its stop chunk

    def feed(self, payload: str) -> List[Event]:
        try:
            doc = json.loads(payload)
        except ValueError:
            return [Chunk(payload)]
        except RecursionError:
            raise ProtocolError("JSON nested too deeply in the stream") from None
        if type(doc) is dict:
            if isinstance(doc.get("error"), (dict, str)):
                raise _error_from(doc["error"])
            self._observe(doc)
        return [Chunk(doc)]

    def _observe(self, doc: Dict[str, Any]) -> None:
        """Note what an object chunk says in OpenAI's or llama-server's shape."""
        choices = doc.get("choices")
        for choice in choices if type(choices) is list else ():
            if type(choice) is dict:
                index = choice.get("index")
                index = 0 if index is None else index  # a missing or null index is 0, as on chat
                reason = choice.get("finish_reason")
                if type(index) is int:
                    self._finish[index] = reason if type(reason) is str else self._finish.get(index)
        stop, index = doc.get("stop"), doc.get("index", 0)
        if type(stop) is bool and type(index) is int:
            self._finals[index] = doc if stop else self._finals.get(index)
        if self._finish or self._finals:
            for name in ("id", "model"):
                if getattr(self, name) is None and type(doc.get(name)) is str:
                    setattr(self, name, doc[name])
            for name in ("usage", "timings"):
                value, kept = doc.get(name), getattr(self, name)
                if type(value) is dict:
                    setattr(self, name, dict(kept, **value) if kept else value)

    def completion(self) -> Completion:
        """The finish and usage of the shape the chunks carried; ``StreamClosedError`` when a choice of it
        has not finished; an empty ``Completion`` for any other shape."""
        ends = self._finish or self._finals  # OpenAI's shape first
        unfinished = sorted(index for index, end in ends.items() if end is None)
        if unfinished:
            raise StreamClosedError(
                "the stream ended before choice %s had finished: the server stopped mid-answer"
                % ", ".join(str(index) for index in unfinished)
            )
        final = None  # type: Optional[Dict[str, Any]]
        if self._finish:
            reasons = sorted(self._finish.items())  # type: List[Tuple[int, Any]]
            usage = self.usage
        elif self._finals:
            finals = sorted((i, f) for i, f in self._finals.items() if f is not None)
            reasons = [(index, _native_finish(chunk)) for index, chunk in finals]
            usage, final = _native_usage([chunk for _, chunk in finals]), finals[0][1]
        else:
            return Completion(None, None, "", "", [], None, None, None)
        choices = tuple(Choice(index, "", "", [], reason, None) for index, reason in reasons)
        return Completion(
            self.id, self.model, "", "", [], reasons[0][1], usage, self.timings, choices=choices, final=final
        )


def _no_body(params: Dict[str, Any]) -> Dict[str, Any]:
    """The body of a request that sends none (``GET``)."""
    return {}


# -- Request bodies: one function per endpoint, (its own arguments..., params) -> the JSON body ----------


def _chat_body(messages: Any, params: Dict[str, Any]) -> Dict[str, Any]:
    """The body of a streamed ``/v1/chat/completions``: ``messages`` and the keywords, ``stream`` on and
    ``stream_options.include_usage`` added to what the caller's ``stream_options`` say."""
    body = _body({"messages": messages}, params)
    options = body.get("stream_options")
    body["stream_options"] = dict(options, include_usage=True) if isinstance(options, dict) else {"include_usage": True}
    return body


def _body(fixed: Dict[str, Any], params: Dict[str, Any], stream: bool = True) -> Dict[str, Any]:
    """``fixed`` (the call's own arguments) with the keywords in ``params`` beside them and ``stream`` on
    (unless ``stream`` is False)."""
    for name in fixed:
        if name in params:
            raise TypeError("%r is given by the call's own argument: do not pass it as a keyword" % name)
    body = dict(fixed)
    body.update(params)
    if stream:
        body["stream"] = True
    return body


def _prompt_ok(prompt: Any) -> bool:
    """A string, a multimodal prompt object (with ``prompt_string``), or a list of token ids and strings
    (llama-server's mixed prompt)."""
    if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_string" in prompt):
        return True
    return isinstance(prompt, list) and all(isinstance(p, str) or type(p) is int for p in prompt)


def _native_body(prompt: Any, params: Dict[str, Any]) -> Dict[str, Any]:
    """The body of a streamed ``/completion``: ``prompt`` is a string, a list of token ids, a mixed list of
    ids and strings, a multimodal prompt object (``{"prompt_string", "multimodal_data"}``), or a list of
    such prompts (one choice each).  ``TypeError`` for anything else, ``ValueError`` for an empty list."""
    if isinstance(prompt, tuple):
        prompt = list(prompt)
    if isinstance(prompt, dict) and not _prompt_ok(prompt):
        raise TypeError("a prompt object needs 'prompt_string': %r" % (prompt,))
    if not isinstance(prompt, (str, list, dict)):
        raise TypeError("prompt must be a string or a list (of token ids, strings, or prompts), not %r" % (prompt,))
    if isinstance(prompt, list):
        if not prompt:
            raise ValueError("prompt must not be an empty list")
        if not _prompt_ok(prompt):
            if not all(_prompt_ok(p) for p in prompt):
                raise TypeError("prompt list items must be token ids, strings, or prompts: %r" % (prompt,))
            if any(isinstance(p, list) and not p for p in prompt):
                raise ValueError("a prompt in the list is empty")
    return _body({"prompt": prompt}, params)


def _extra_file(item: Any) -> Dict[str, str]:
    if isinstance(item, dict):
        if set(item) != {"filename", "text"}:
            raise ValueError("an input_extra dict has exactly 'filename' and 'text', not %r" % sorted(item))
        name, text = item["filename"], item["text"]
    elif isinstance(item, (tuple, list)):
        if len(item) != 2:
            raise ValueError("an input_extra pair is (filename, text), not %d items" % len(item))
        name, text = item
    else:
        raise TypeError("an input_extra item is a (filename, text) pair or a dict, not %r" % (item,))
    if not isinstance(name, str) or not isinstance(text, str):
        raise TypeError("input_extra filename and text must be strings, not %r" % ((name, text),))
    return {"filename": name, "text": text}


def _infill_body(prefix: str, suffix: str, extra: Any, params: Dict[str, Any]) -> Dict[str, Any]:
    """The body of a streamed ``/infill``: ``prefix`` and ``suffix`` (strings) are ``input_prefix`` and
    ``input_suffix``; ``extra`` (None, or an iterable of ``(filename, text)`` pairs or ``{"filename",
    "text"}`` dicts) is ``input_extra``.  ``TypeError``/``ValueError`` for anything else."""
    for name, value in (("prefix", prefix), ("suffix", suffix)):
        if not isinstance(value, str):
            raise TypeError("%s must be a string, not %r" % (name, value))
    fixed = {"input_prefix": prefix, "input_suffix": suffix}  # type: Dict[str, Any]
    if extra is not None:
        if isinstance(extra, (str, bytes, dict)) or not hasattr(extra, "__iter__"):
            raise TypeError("extra must be an iterable of (filename, text) pairs or dicts, not %r" % (extra,))
        fixed["input_extra"] = [_extra_file(item) for item in extra]
    elif "input_extra" in params:
        raise TypeError("'input_extra' is given by the call's own argument: pass extra=")
    return _body(fixed, params)


def _responses_body(input: Any, params: Dict[str, Any]) -> Dict[str, Any]:
    """The body of a streamed ``/v1/responses``: ``input`` is a string or a list of input items (dicts).
    ``TypeError`` for anything else, ``ValueError`` for an empty list."""
    if isinstance(input, tuple):
        input = list(input)
    if isinstance(input, list):
        if not input:
            raise ValueError("input must not be an empty list")
        for item in input:
            if not isinstance(item, dict):
                raise TypeError("input items must be dicts, not %r" % (item,))
    elif not isinstance(input, str):
        raise TypeError("input must be a string or a list of input items, not %r" % (input,))
    return _body({"input": input}, params)


def _messages_body(messages: Any, params: Dict[str, Any]) -> Dict[str, Any]:
    """The body of a streamed ``/v1/messages``: ``messages`` is a non-empty list of message dicts (the
    system prompt is the keyword ``system``).  ``TypeError``/``ValueError`` for anything else."""
    if isinstance(messages, tuple):
        messages = list(messages)
    if not isinstance(messages, list):
        raise TypeError("messages must be a list of message dicts, not %r" % (messages,))
    if not messages:
        raise ValueError("messages must not be empty")
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError("messages must be dicts, not %r" % (message,))
    return _body({"messages": messages}, params)


def _route_target(path: Any, body: Any, method: Any) -> Tuple[str, str]:
    """The method and path of a ``stream_route()`` request (checked: ``TypeError`` when not strings)."""
    if not isinstance(path, str) or not isinstance(method, str):
        raise TypeError("path and method must be str, not %r and %r" % (path, method))
    return method, path


def _route_body(path: str, body: Any, method: str, params: Dict[str, Any]) -> Any:
    """The body of ``stream_route()``: ``body`` as given (any JSON value; None: no body), sent without
    ``stream`` added (the route's own rules decide; llama-server's want ``"stream": true``).  The keywords
    are added to a dict ``body`` (one is made when it is None); beside another value they are
    ``TypeError``, and so is a keyword the body holds already."""
    if params:
        if body is None:
            body = {}
        elif not isinstance(body, dict):
            raise TypeError("keywords go into a JSON object body, not beside %s" % type(body).__name__)
        return _body(body, params, stream=False)
    return dict(body) if isinstance(body, dict) else body  # a copy: id_slot and model go in the copy


# -- Stable heads, what stays the same on every turn of a conversation: a request's session key (X-Session-Id)
# when none is given is a digest of the head its row's function reads in the body (``_session_digest``, section
# 8), a JSON value, or None when the endpoint has no conversation to key.

_HEAD_CHARS = 1024  # the characters of a prompt's text that key it
_HEAD_TOKENS = 256  # the items of a token-list prompt that key it (about _HEAD_CHARS of text)


def _chat_head(body: Dict[str, Any]) -> Any:
    """Chat: the messages up to and including the first user message (all of them when none is a user's)."""
    messages = body.get("messages")
    if not isinstance(messages, (list, tuple)):
        return messages
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return list(messages[: i + 1])
    return list(messages)


def _prompt_head(prompt: Any) -> Any:
    """A ``/completion`` or ``/v1/completions`` prompt's head: a string's first ``_HEAD_CHARS`` characters; a
    list of token ids (and strings) its first ``_HEAD_TOKENS`` items, each string cut the same way; a
    multimodal prompt object its ``prompt_string``'s; a list of prompts (one choice each) the first's."""
    if isinstance(prompt, str):
        return prompt[:_HEAD_CHARS]
    if isinstance(prompt, dict):
        return _prompt_head(prompt.get("prompt_string"))
    if isinstance(prompt, (list, tuple)) and prompt:
        if not _prompt_ok(list(prompt)):
            return _prompt_head(prompt[0])
        return [p[:_HEAD_CHARS] if isinstance(p, str) else p for p in prompt[:_HEAD_TOKENS]]
    return prompt


def _native_head(body: Dict[str, Any]) -> Any:
    return _prompt_head(body.get("prompt"))


def _infill_head(body: Dict[str, Any]) -> Any:
    """``/infill``: the extra files (each file's name and text) followed by the prefix, the first
    ``_HEAD_CHARS`` characters of them: the order in which the server puts them before the cursor."""
    extra = body.get("input_extra") or []
    files = "".join("%s\n%s\n" % (f.get("filename"), f.get("text")) for f in extra if isinstance(f, dict))
    prefix = body.get("input_prefix")
    return (files + (prefix if isinstance(prefix, str) else ""))[:_HEAD_CHARS]


def _responses_head(body: Dict[str, Any]) -> Any:
    """Responses: the ``instructions`` and the first input item (a string input is one user message)."""
    items = body.get("input")
    if isinstance(items, str):
        first = {"role": "user", "content": items}  # type: Any
    else:
        first = items[0] if isinstance(items, (list, tuple)) and items else items
    return [body.get("instructions"), first]


def _messages_head(body: Dict[str, Any]) -> Any:
    """Messages: the ``system`` prompt and the first user message (the first message when none is a user's)."""
    messages = body.get("messages") or []
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    return [body.get("system"), (users or messages or [None])[0]]


def _no_head(body: Dict[str, Any]) -> Any:
    """An endpoint that holds no conversation (``/models/sse``): no key of its own."""
    return None


def _route_head(body: Any) -> Any:
    """``stream_route()``: the stable head of a body shaped as one of the named endpoints' (chat's
    ``messages``, a ``prompt``, Responses' ``input``); None (no key of its own) for any other."""
    if not isinstance(body, dict):
        return None
    if "messages" in body:
        return _chat_head(body)
    if "prompt" in body:
        return _native_head(body)
    if "input" in body:
        return _responses_head(body)
    return None


# -- The streamed endpoints, a row each: all that differs between two of them (the engine, section 8, is one).
# ``_Streams.stream_request`` builds a call's body with its row's function and applies the row's thinking-cap
# rule; ``resume(endpoint=...)`` reads with its row's dialect.  dev/ADDING_AN_ENDPOINT.md says how to add one.

_CAP_CONTROL = "control"  # the cap works: the body asks for reasoning_control, the control endpoint ends it
_CAP_MOOT = "moot"  # the endpoint streams no separate reasoning: a cap has nothing to cap, nothing is sent
_CAP_NEVER = "never"  # reasoning streams but the server cannot end it on request: a cap is ValueError


class _Endpoint:
    """One streamed endpoint: its ``path``; ``body(*args, params)``, its body made of the call's arguments;
    ``head(body)``, the body's stable head (above); the ``dialect`` class that reads its payloads; and what
    the engine may do there: ``cap`` (a ``_CAP_*`` rule), ``resumable`` (the server buffers it for
    ``X-Conversation-Id``), ``routed`` (a router routes it by the body's ``model``), ``watch`` (a ``GET``
    that never ends by itself and is silent when nothing happens: no gate, no retries, no liveness; read by
    ``_StreamLife.watch``).  ``target(*args)``: its method and path, ``POST`` to ``path`` by default."""

    __slots__ = ("name", "path", "body", "head", "dialect", "cap", "resumable", "routed", "watch", "_target")

    def __init__(
        self, name: str, path: str, body: Callable[..., Any], head: Callable[[Any], Any], dialect: Any, cap: str,
        resumable: bool = True, routed: bool = True, watch: bool = False,
        target: Optional[Callable[..., Tuple[str, str]]] = None,
    ) -> None:  # fmt: skip
        self.name, self.path, self.body, self.head, self.dialect = name, path, body, head, dialect
        self.cap, self.resumable, self.routed, self.watch = cap, resumable, routed, watch
        self._target = target

    def target(self, *args: Any) -> Tuple[str, str]:
        """(method, path) of a request of this row made of the call's ``args``."""
        return self._target(*args) if self._target is not None else ("POST", self.path)


#: Every streamed endpoint, by the name ``resume(endpoint=...)`` takes.  On this llama-server the control
#: endpoint ends reasoning only for chat: Responses never shows the completion id it needs, and Messages
#: drops ``reasoning_control``; /completion, /infill and /v1/completions stream no separate reasoning at all.
_ENDPOINTS = {
    e.name: e
    for e in (
        _Endpoint("chat", "/v1/chat/completions", _chat_body, _chat_head, Assembler, _CAP_CONTROL),
        _Endpoint("complete", "/completion", _native_body, _native_head, _NativeAssembler, _CAP_MOOT),
        _Endpoint("infill", "/infill", _infill_body, _infill_head, _NativeAssembler, _CAP_MOOT),
        _Endpoint("complete_openai", "/v1/completions", _native_body, _native_head, _TextAssembler, _CAP_MOOT),
        _Endpoint("respond", "/v1/responses", _responses_body, _responses_head, _ResponsesAssembler, _CAP_NEVER),
        _Endpoint("message", "/v1/messages", _messages_body, _messages_head, _MessagesAssembler, _CAP_NEVER),
        # a router's model events: not resumable, not routed (the router's own), a watch
        _Endpoint("models", "/models/sse", _no_body, _no_head, _ModelEvents, _CAP_MOOT, False, False, True),
        # stream_route(): any route, its method and path the call's; resumable where the server buffers it
        _Endpoint("route", "", _route_body, _route_head, _RouteChunks, _CAP_MOOT, target=_route_target),
    )
}  # type: Dict[str, _Endpoint]


# =====================================================================================================
# 5. The response pump: one streamed response, bytes in, events and decisions out
# =====================================================================================================


# Wait states of a request whose response has not started: what it is waiting on decides which budget runs.
BUSY = "busy"  # the slot is processing another request: busy_wait
UNAVAILABLE = "unavailable"  # the server cannot be reached, is loading, or /slots fails: load_wait
IDLE = "idle"  # the slot is free, yet nothing arrives: idle_grace
WEDGED = "wedged"  # the slot is processing and nothing in it moves: WedgedSlotError at once
CAPACITY = "capacity"  # the server (or a proxy in front of it) answered 429: busy_wait
UNSEEN = "unseen"  # /slots is not served (a proxy, llama-swap, --no-slots): the server is up; busy_wait
FRONT = "front"  # a front (nginx, HAProxy) answered 504 or 524: it stopped waiting for a slot; busy_wait
SEVERAL = "several"  # several servers behind the address: /slots may describe another one; busy_wait
_FOR_A_SLOT = frozenset((BUSY, FRONT, SEVERAL))  # one wait for a slot: its busy_wait goes on across them
_UNSEEN = frozenset((UNSEEN, SEVERAL))  # what a poll says cannot be the request's own slot
_FRONT_WAITED = (504, 524)  # a front's own answer (llama-server never sends these): it stopped waiting
_FRONT_UNREACHED = (502, 520, 521, 522, 523)  # a front's own answer: it could not reach the server


class _Retry:
    """An attempt that failed before anything was delivered and may be sent again: why (``reason``, the
    error ``cause``), the ``Retry-After`` ``hint`` in seconds, and whose budget the wait counts under
    (``state``: ``UNAVAILABLE``, load_wait; ``CAPACITY``, a 429, busy_wait)."""

    __slots__ = ("reason", "hint", "cause", "state")

    def __init__(self, reason: str, hint: Optional[float], cause: BaseException, state: str = UNAVAILABLE) -> None:
        self.reason, self.hint, self.cause, self.state = reason, hint, cause, state


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


_CAP_DUE = object()  # ResponsePump.verdict(): reasoning reached the cap, the rest of the bytes wait

#: Why a resumable request is sent again when its server no longer knows it and nothing of it came: this
#: llama-server cancels a queued request whose connection closed (a front's idle timeout) as soon as a
#: second passes without a token from any slot, which a loaded server lets pass.
_DROPPED = "the server dropped the request before it started (its connection had closed while it was queued)"


#: What to do about a stream cut by its server.
_CUT = (
    "the server closed the connection %s: it stopped or crashed; resumable=True lets a stream survive a dropped "
    "connection"
)


def _unknown_stream(why: str) -> StreamClosedError:
    """The one error of a resumable stream its server no longer knows, whichever answer said so (a replay's
    404, a lookup without it): ``why`` is that answer."""
    return StreamClosedError(
        "the stream could not be resumed: the server no longer knows it (it restarted, or the stream expired; %s)" % why
    )


def _status_retry(head: ResponseHead, error: HTTPStatusError) -> Optional[_Retry]:
    """The retry a status before delivery asks for, or None: 503 (loading) and a front that could not reach
    the server (502, 520-523) under ``load_wait``; 429 (at capacity) and a front that stopped waiting for a
    slot (504, 524) under ``busy_wait``."""
    status = head.status
    hint = parse_retry_after(head.get("retry-after"))
    if status == 503:
        return _Retry("HTTP 503: %s" % error.message, hint, error)
    if status == 429:  # a concurrency limit (llama-swap), or a front whose every server is busy
        front = _front_name(status, head.get("server"))
        return _Retry("HTTP 429%s: %s" % (" from " + front if front else "", error.message), hint, error, CAPACITY)
    if status in _FRONT_WAITED:
        front = _front_name(status, head.get("server")) or "the front"
        return _Retry("HTTP %d from %s: the front stopped waiting for a slot" % (status, front), hint, error, FRONT)
    if status in _FRONT_UNREACHED:
        return _Retry(str(error), hint, error)
    return None


def _retryable(err: ServerError) -> bool:
    return err.code == 503 or err.type in ("unavailable_error", "overloaded_error")


class ResponsePump:
    """The bytes of one streamed response in, events and decisions out; no socket, and the clock only to
    read a ``Retry-After`` date.  ``dialect(raw_chunks)`` reads the payloads (``Assembler``, chat's, by
    default).  ``feed(data)``, and ``feed_eof()`` when the connection closed, return the events those bytes
    completed; then the caller looks at, in this order (``verdict()`` gives them as one value):

    ``failed``   an error found after the returned events (deliver them, then raise it; later calls raise it)
    ``cap_due``  ``(completion id, tokens)``: reasoning reached ``thinking_cap``, the rest of the bytes wait;
                 the caller asks the server to end reasoning and passes the answer to ``capped(ok)``
    ``outcome``  once decided: the ``Completion``, or a ``_Retry`` (a 503 or 429, a front's 502, 504 or
                 520 to 524, or a 503, ``unavailable_error`` or ``overloaded_error`` error event before
                 anything was delivered).  Any other non-200 status raises ``HTTPStatusError`` once its
                 body is in; after ``resume()``, a 404 or 400 raises ``StreamClosedError``.

    ``head`` is the response head once parsed; ``progressed`` says whether the last call dispatched a data
    event (pings prove the connection, not progress); ``delivered`` whether an output event (``Reasoning``,
    ``Content`` or ``ToolCall``; a route's ``Chunk``) has been produced.
    """

    __slots__ = (
        "head", "failed", "cap_due", "outcome", "progressed", "delivered", "received", "boundary", "_limits",
        "_reader", "_sse", "_asm", "_body", "_pending", "_ending", "cut", "_capped_at", "_resuming", "_last",
        "unknown",
    )  # fmt: skip

    def __init__(self, limits: Limits, raw_chunks: bool = False, dialect: Any = None) -> None:
        self.head = None  # type: Optional[ResponseHead]
        self.failed = None  # type: Optional[LoopError]
        self.cap_due = None  # type: Optional[Tuple[Optional[str], int]]
        self.outcome = None  # type: Optional[Union[Completion, _Retry]]
        self.progressed = False
        self.delivered = False
        self.received = 0  # body bytes of a 200 response (de-chunked), resumed parts included
        self.boundary = 0  # of those, the bytes that end where an event block ends (a blank line)
        self._limits = limits
        self._reader = ResponseReader()
        self._sse = SSEDecoder(limits.max_line)
        self._asm = (dialect or Assembler)(raw_chunks)  # type: Any
        self._body = bytearray()  # an error response's body
        self._pending = []  # type: List[Tuple[str, str]]  # SSE events waiting behind the thinking cap
        self._ending = False  # the body is complete: the events in hand are the last
        self.cut = False  # the body ended (cleanly, as a front may end it) before the stream's own end
        self._capped_at = -1
        self._resuming = False  # the response is the replay of a resumed stream
        self._last = b""  # the last two body bytes, for a blank line split between reads
        self.unknown = False  # a resume was answered 404: the server does not know the stream

    @property
    def streaming(self) -> bool:
        """A 200 head came and its body is not complete: a connection lost now lost part of a stream."""
        head = self.head
        return head is not None and head.status == 200 and (self.cut or not self._reader.done) and self.outcome is None

    def resume(self, offset: int) -> None:
        """The next bytes are a new response, the server's replay of this stream from ``offset`` body bytes
        (what ``received`` counted): its head is read afresh, its body goes on where the last one stopped.
        A 404 or 400 answer is ``StreamClosedError``.  ``boundary`` stays the end of the last event block
        read (the replay goes on from the bytes received, inside a block perhaps), unless ``offset`` is
        not what was received: a stream read from another's offset, which ends a block."""
        self._reader = ResponseReader()
        self.head = None
        self.failed = None
        self._resuming = True
        self.unknown = False
        self.outcome = None  # a front's 504 to the request, which a resume from 0 follows
        self._body = bytearray()
        if offset != self.received:
            self.boundary, self._last = offset, b""
        self.received = offset
        self._ending = self.cut = False

    def verdict(self) -> Any:
        """What the caller does next, once it has handed out the events of the last call, as one value:
        ``failed``, ``_CAP_DUE`` for ``cap_due``, else ``outcome`` (None: read on), in that order."""
        if self.failed is not None:
            return self.failed
        if self.cap_due is not None:
            return _CAP_DUE
        return self.outcome

    def feed(self, data: bytes) -> List[Event]:
        """Bytes received (``b""`` is not end of file: use ``feed_eof()``)."""
        return self._guard(self._feed, data, False)

    def feed_eof(self) -> List[Event]:
        """The connection closed."""
        return self._guard(self._feed, b"", True)

    def capped(self, ok: bool) -> List[Event]:
        """The answer of the control endpoint to ``cap_due``: True when the server accepted."""
        return self._guard(self._capped, ok)

    def _guard(self, step: Callable[..., None], *args: Any) -> List[Event]:
        if self.failed is not None:
            raise self.failed
        out = []  # type: List[Event]
        self.progressed = False
        try:
            step(out, *args)
        except LoopError as exc:
            if not out:
                raise
            self.failed = exc  # the events before the error are delivered first
        return out

    def _feed(self, out: List[Event], data: bytes, eof: bool) -> None:
        reader = self._reader
        if self.outcome is not None or self.cap_due is not None:
            return
        if eof:
            reader.feed_eof()  # StreamClosedError when the head or a chunk is cut short
            pieces = []  # type: List[bytes]
        else:
            pieces = reader.feed(data)
        head = reader.head
        if head is None:
            return
        if self.head is None:  # the head came with these bytes
            self.head = head
            kind = head.get("content-type") or "missing"
            if head.status == 200 and self._asm.event_stream and not kind.lower().startswith("text/event-stream"):
                raise ProtocolError(
                    "the answer is not a stream (HTTP 200, Content-Type %s, not text/event-stream): fetch() "
                    'reads it whole, or ask the route to stream ("stream": true)' % kind
                )
        if head.status != 200:
            self._error_body(head, pieces, eof or reader.done)
            return
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if data:
            self._count_body(data)
        sse = self._sse
        batch = sse.feed(data) if data else []
        if (eof or reader.done) and sse.failed is None:
            batch += sse.close()
            self._ending = True
        self._events(out, batch)
        self._decoders_failed()

    def _count_body(self, data: bytes) -> None:
        """Count body bytes, and where the last block ended (LF or CRLF lines, as llama-server sends)."""
        start = self.received
        self.received = start + len(data)
        joined = self._last + data
        lf, crlf = joined.rfind(b"\n\n"), joined.rfind(b"\n\r\n")
        end = max(lf + 2 if lf >= 0 else -1, crlf + 3 if crlf >= 0 else -1)
        if end >= 0:
            self.boundary = start - len(self._last) + end
        self._last = joined[-2:]

    def _decoders_failed(self) -> None:
        """Raise what a decoder kept behind the output it returned (the stream's bytes, in order)."""
        if self.cap_due is None and self.outcome is None:
            failed = self._sse.failed or self._reader.failed
            if failed is not None:
                raise failed

    def _error_body(self, head: ResponseHead, pieces: List[bytes], complete: bool) -> None:
        self._body += b"".join(pieces)
        if len(self._body) > self._limits.max_body:
            raise _over("error body", "max_body", self._limits.max_body)
        if self._reader.failed is not None:
            raise self._reader.failed
        if not complete:
            return
        body = bytes(self._body)
        message, _ = parse_error_envelope(body)
        error = HTTPStatusError(head.status, message, body, head.get("server"))
        if self._resuming and head.status == 404:
            self.unknown = True  # behind a balancer, another server may have answered
            raise _unknown_stream("HTTP 404: %s" % message)
        if self._resuming and head.status == 400:
            raise StreamClosedError(
                "the stream could not be resumed: the server no longer holds its bytes from offset %d "
                "(HTTP 400: %s)" % (self.received, message)
            )
        retry = _status_retry(head, error)
        if retry is None:
            raise error
        self.outcome = retry

    def _capped(self, out: List[Event], ok: bool) -> None:
        assert self.cap_due is not None
        tokens = self.cap_due[1]
        self.cap_due = None
        if not ok:
            text = "reasoning reached the cap (%d tokens) and the server refused to end it" % tokens
            raise _hinted(ThinkingOverrunError(text, tokens), _UNCAP)
        self._capped_at = tokens
        self._asm.thinking_capped = True
        out.append(ThinkingCapped(tokens))
        batch, self._pending = self._pending, []
        self._events(out, batch)
        self._decoders_failed()

    def _events(self, out: List[Event], batch: List[Tuple[str, str]]) -> None:
        asm = self._asm
        feed = asm.feed
        cap = self._limits.thinking_cap
        if batch:
            self.progressed = True
        for i, (kind, payload) in enumerate(batch):
            if payload == "[DONE]" and kind != "error":
                self.outcome = asm.completion()
                return
            try:
                if kind == "error":  # the legacy `error:` line
                    raise _error_from(_json_or_text(payload))
                events = feed(payload)
            except ServerError as err:
                if not self.delivered and _retryable(err):
                    self.outcome = _Retry("server error %s: %s" % (err.code, err.message), None, err)
                    return
                raise
            if events:
                out += events
                if not self.delivered:
                    output = asm.output
                    self.delivered = any(type(e) in output for e in events)
            if cap is not None and asm.in_reasoning:
                tokens = asm.reasoning_tokens
                if self._capped_at < 0:
                    if tokens >= cap:
                        if not asm.id:
                            text = "reasoning reached the cap (%d tokens) but the stream has no completion id" % tokens
                            raise _hinted(ThinkingOverrunError(text, tokens), _UNCAP)
                        self.cap_due = (asm.id, tokens)
                        self._pending = batch[i + 1 :]
                        return
                elif tokens > self._capped_at + self._limits.thinking_overrun:
                    over, at, allowed = tokens - self._capped_at, self._capped_at, self._limits.thinking_overrun
                    text = "reasoning went on for %d tokens after the server accepted to end it at %d " % (over, at)
                    text += "(thinking_overrun %d)" % allowed
                    raise _hinted(ThinkingOverrunError(text, tokens), "raise Limits(thinking_overrun=...)")
            if asm.done:  # the endpoint's own end (no [DONE] but on chat)
                self.outcome = asm.completion()
                return
        if self._ending:
            try:
                self.outcome = asm.completion()
            except StreamClosedError:
                # The body ended before the stream did: a front ending its own chunked body when its
                # server's connection broke (Caddy does).  The bytes after the last whole event were
                # dropped with the decoder's unfinished event: a resume starts at that event.
                self.cut = True
                self.received, self._last = self.boundary, b""
                raise


# =====================================================================================================
# 6. Addresses, waits and their budgets, the timing rules: what a request decides, without I/O
# =====================================================================================================


class _Address:
    """``text`` as given (for messages); ``target`` a socket path or (host, port); ``host`` the Host header; ``seen``: a
    connect reached a socket file there since the client was made; ``warned``: a missing one was logged."""

    __slots__ = ("text", "unix", "target", "host", "tls", "prefix", "seen", "warned")

    def __init__(self, text: str, unix: bool, target: Any, host: str, tls: bool = False, prefix: str = "") -> None:
        self.text, self.unix, self.target, self.host, self.tls, self.prefix = text, unix, target, host, tls, prefix
        self.seen = self.warned = False


def _host_port(address: str) -> bool:
    """``address`` is host:port with no scheme ("localhost:8080", "[::1]:8080"), not a socket file's name."""
    host, colon, port = address.rpartition(":")
    port = port[:-1] if port.endswith("/") else port
    if not colon or not host or not (port.isdigit() and port.isascii() and len(port) <= 5):
        return False
    if host.startswith("[") and host.endswith("]"):
        return len(host) > 2 and all(c in "0123456789abcdefABCDEF:." for c in host[1:-1])
    return host.isascii() and host[0].isalnum() and all(c.isalnum() or c in ".-" for c in host)


def parse_address(address: Any) -> _Address:
    """A path or ``unix:///path`` (AF_UNIX), or ``http[s]://host[:port][/prefix]`` (TCP, TLS for https).

    ``ValueError`` for what cannot be parsed, ``TypeError`` for what is not a string or path."""
    if isinstance(address, os.PathLike):
        address = os.fspath(address)
    if not isinstance(address, str):
        raise TypeError("the address must be a path or a URL string, not %s" % type(address).__name__)
    text = address
    if not address:
        raise ValueError("the address is empty: give a socket path or an http:// URL")
    if address.startswith("unix://"):
        address = address[len("unix://") :]
    elif "://" in address:
        return _parse_url(text)
    if _host_port(address):
        raise ValueError(
            "%r is host:port without a scheme: use http://%s (a socket file of that name: ./%s)"
            % (text, address, address)
        )
    if "\0" in address:
        raise ValueError("a Unix socket path must not contain NUL")
    if not address:
        raise ValueError("no socket path in %r" % text)
    size = len(os.fsencode(address))
    if size > MAX_UNIX_PATH:
        raise ValueError(
            "the Unix socket path is %d bytes; the OS allows at most %d: use a shorter path" % (size, MAX_UNIX_PATH)
        )
    return _Address(text, True, address, "localhost")


def _parse_url(text: str) -> _Address:
    """``http[s]://host[:port][/prefix]`` (``[v6addr]`` for an IPv6 host): a TCP address (TLS for https), its
    Host header (which names the port only when it is not the scheme's) and path prefix."""
    scheme, _, rest = text.partition("://")
    scheme = scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(
            "unsupported address scheme %r: use a socket path, unix:///path or http(s)://host:port" % scheme
        )
    rest, slash, prefix = rest.partition("/")
    prefix = ("/" + prefix.rstrip("/")) if slash and prefix.strip("/") else ""
    if not rest or any(c in rest + prefix for c in "?#@ \t\r\n\0") or "//" in prefix:
        raise ValueError("cannot parse %r: expected %s://host:port[/prefix]" % (text, scheme))
    if rest.startswith("["):
        host, sep, port_text = rest[1:].partition("]")
        if not sep or (port_text and not port_text.startswith(":")):
            raise ValueError("cannot parse %r: expected %s://[v6addr]:port" % (text, scheme))
        port_text = port_text[1:]
        host_header = "[%s]" % host
    else:
        host, _, port_text = rest.partition(":")
        host_header = host
    if not host:
        raise ValueError("no host in %r" % text)
    port = default = 443 if scheme == "https" else 80
    if port_text or rest.endswith(":"):
        if not (port_text.isdigit() and port_text.isascii() and 0 < int(port_text) < 65536):
            raise ValueError("bad port in %r" % text)
        port = int(port_text)
    host_header += ":%d" % port if port != default else ""
    return _Address(text, False, (host, port), host_header, scheme == "https", prefix)


class _Silence(Exception):
    """A read timed out (internal: each caller turns it into the budget error that applies)."""


def _import_ssl() -> Any:
    """The ``ssl`` module, imported only for ``https://``; a Python built without it is ``ValueError``."""
    try:
        import ssl
    except ImportError as exc:
        raise ValueError(
            "https:// needs Python's ssl module, which this Python (%s) lacks: use a Python built with ssl "
            "(OpenSSL), or reach the server over http:// or a Unix socket" % sys.executable
        ) from exc
    return ssl


#: What to do about a wedged slot.
_RESTART = "restart the server (SIGKILL if SIGTERM does not stop it)"


def _tls_failed(addr: _Address, exc: BaseException) -> ConnectError:
    text = "TLS with %s failed: %s" % (addr.text, getattr(exc, "verify_message", None) or exc)
    return _hinted(ConnectError(text, addr.text), "check the URL's host, or pass ssl_context= with your CA")


def _send_stalled(timeout: float) -> StalledError:
    return _hinted(
        StalledError("the server did not take the request for %.1f s" % timeout, timeout), _LONGER % "liveness"
    )


def _connection_failed(exc: BaseException) -> StreamClosedError:
    return StreamClosedError("the connection failed: %s" % exc)


def _connect_error(addr: _Address, exc: OSError) -> ConnectError:
    if isinstance(exc, FileNotFoundError):
        text = "no llama-server at %s: the socket file does not exist" % addr.text
    elif isinstance(exc, ConnectionRefusedError):
        text = "no llama-server listening at %s (connection refused)" % addr.text
    elif isinstance(exc, socket.timeout):
        text = "connecting to %s timed out" % addr.text
    else:
        text = "cannot connect to %s: %s" % (addr.text, exc)
    err = _hinted(ConnectError(text, addr.text), _START_IT)
    err.__cause__ = exc
    return err


def _cap_failed(tokens: int, exc: BaseException) -> ThinkingOverrunError:
    text = "reasoning reached the cap (%d tokens) and ending it failed: %s" % (tokens, exc)
    return _hinted(ThinkingOverrunError(text, tokens), _UNCAP)


#: What to do when the server would not end reasoning at the thinking cap.
_UNCAP = "raise Limits(thinking_cap=...), or leave it None"


def _no_answer(what: str, timeout: float) -> StalledError:
    return _hinted(StalledError("%s: no answer for %.1f s (liveness)" % (what, timeout), timeout), _LONGER % "liveness")


#: The budget of each wait state: the ``Limits`` field, and the error when it runs out.
_BUDGETS: Dict[str, Tuple[str, Any]] = dict.fromkeys(
    (BUSY, CAPACITY, FRONT, SEVERAL, UNSEEN), ("busy_wait", WaitTimeoutError)
)
_BUDGETS.update({UNAVAILABLE: ("load_wait", LoadTimeoutError), IDLE: ("idle_grace", StalledError)})
#: What the error of each says.
_TEXTS = {
    BUSY: "slot {slot} stayed busy for {waited:.1f} s (busy_wait): the server is still serving others",
    UNAVAILABLE: "the server at {address} stayed unreachable or loading for {waited:.1f} s (load_wait)",
    IDLE: "slot {slot} is idle, yet no response came for {waited:.1f} s (idle_grace): the server is stuck",
    CAPACITY: "the server at {address} answered 429 (at capacity) for {waited:.1f} s (busy_wait)",
    FRONT: "no slot took the request for {waited:.1f} s (busy_wait) behind the front at {address}, which "
    "stops waiting for one sooner",
    SEVERAL: "no response for {waited:.1f} s from the servers behind {address} (busy_wait); with several "
    "servers (Limits.servers) /slots may describe another server than the one holding slot {slot}",
    UNSEEN: "no response for {waited:.1f} s from the server at {address}, which does not serve /slots, so "
    "slot {slot} cannot be seen (busy_wait): the request may still be queued upstream",
}
#: What ``_TEXTS`` says of a ``slot=None`` request, which waits for the pool, not for one slot.
_POOL_TEXTS = {
    BUSY: "every slot stayed busy for {waited:.1f} s (busy_wait): the server is still serving others",
    IDLE: "a slot is free, yet no response came for {waited:.1f} s (idle_grace): the server is stuck",
    SEVERAL: "no response for {waited:.1f} s from the servers behind {address} (busy_wait); with several "
    "servers (Limits.servers) /slots may describe another server than the one holding the request",
    UNSEEN: "no response for {waited:.1f} s from the server at {address}, which does not serve /slots, so "
    "its slots cannot be seen (busy_wait): the request may still be queued upstream",
}


class _Waits:
    """What a request waits on before its response starts, and since when (a budget restarts with the state)."""

    __slots__ = ("limits", "state", "since", "sent_at", "slot", "addr", "cause", "answered")

    def __init__(self, limits: Limits, slot: Optional[int], addr: _Address) -> None:
        self.limits = limits
        self.slot = slot  # None: the pool
        self.addr = addr
        self.state = None  # type: Optional[str]
        self.since = _clock()
        self.sent_at = self.since
        self.cause = None  # type: Optional[BaseException]
        self.answered = False  # anything but a failed connect was seen: not "no server there" (_Unreachable)

    def observe(self, state: str, cause: Optional[BaseException] = None) -> None:
        if state != self.state:
            if self.state is None:
                self.since = self.sent_at
            elif not (state in _FOR_A_SLOT and self.state in _FOR_A_SLOT):  # one wait for a slot goes on
                self.since = _clock()
            self.state = state
            self.cause = None
        if cause is not None:  # a poll that sees the same state keeps the last failure as the cause
            self.cause = cause
        if not _no_server(cause):
            self.answered = True

    def remaining(self) -> Optional[float]:
        if self.state is None:
            return None
        budget = getattr(self.limits, _BUDGETS[self.state][0])
        return float(budget - (_clock() - self.since))

    def check(self) -> None:
        """Raise the budget's error when the current state has lasted longer than its budget."""
        left = self.remaining()
        if left is not None and left <= 0:
            raise self.expired()

    def expired(self) -> LoopError:
        """The error of the budget that ran out; a wait where nothing ever answered but failed connects is
        "no server there" (``_Unreachable``), which says the last OS error."""
        assert self.state is not None
        budget, cls = _BUDGETS[self.state]
        text = _TEXTS[self.state] if self.slot is not None else _POOL_TEXTS.get(self.state, _TEXTS[self.state])
        waited, addr, cause, hint = _clock() - self.since, self.addr, self.cause, _LONGER % budget
        text = text.format(slot=self.slot, address=addr.text, waited=waited)
        if isinstance(cause, HTTPStatusError) and cause.status in _FRONT_STATUSES:
            text += ": the front answered %s" % (cause,)
        elif isinstance(cause, HTTPStatusError) and cause.status == 429:
            text += ": %s" % (cause,)  # who said so: a front's every server busy, or a concurrency limit
        elif _no_server(cause):
            assert isinstance(cause, OSError)
            if addr.unix and not addr.seen and isinstance(cause, FileNotFoundError):
                text += ": the socket file %s never existed since the client was made" % addr.target
            text += " (last: %s)" % _os_text(cause)
        if _no_server(cause) and not self.answered:
            err = _hinted(_Unreachable(text, waited, addr.text), _START_IT)  # type: LoopError
        else:
            err = _hinted(cls(text, waited), hint)
        if cause is not None:
            err.__cause__ = cause
        return err


def _no_server(cause: Optional[BaseException]) -> bool:
    """``cause`` is a connect's failure (an ``OSError`` of the socket, not of the library)."""
    return isinstance(cause, OSError) and not isinstance(cause, LoopError)


def _cannot_connect(exc: OSError) -> _Retry:
    return _Retry("cannot connect: %s" % _os_text(exc), None, exc)


def _os_text(exc: OSError) -> str:
    """What failed, in the same words from both drivers (asyncio's own words name the call)."""
    return os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__


class _Backoff:
    """The one retry object of every retry loop (a request's attempts, a stream's reattaches): the retries
    told, and the next delay (``BACKOFF_FIRST`` doubling to ``BACKOFF_MAX``); the budgets are ``_Waits``'."""

    __slots__ = ("attempt", "delay")

    def __init__(self) -> None:
        self.attempt = 0
        self.delay = BACKOFF_FIRST

    def next(self, waits: _Waits, retry: _Retry) -> Retrying:
        """The ``Retrying`` of a failed attempt (its delay jittered down by up to a quarter, ``Retry-After`` a
        floor, never past the state's budget); the budget's error when it is spent or a hint goes past it."""
        waits.observe(retry.state, retry.cause)
        left = waits.remaining()
        assert left is not None
        if left <= 0 or (retry.hint is not None and retry.hint > left):  # a hint past the budget: now
            raise waits.expired()
        import random  # only when a retry happens

        delay = self.delay * (1.0 - 0.25 * random.random())
        if retry.hint is not None:  # honoured as a floor: "Retry-After: 0" must not become a busy loop
            delay = max(delay, retry.hint)
        self.attempt += 1
        self.delay = min(self.delay * 2, BACKOFF_MAX)
        return Retrying(self.attempt, min(delay, left), retry.reason)


def _read_timeout(
    limits: Limits, waits: _Waits, head: Optional[ResponseHead], started: float, heard: float, now: float
) -> float:
    """How long the next read may wait: ``poll`` (within the wait's budget) before the first byte, what is left of
    ``liveness`` after it (at most ``poll`` when slots are watched for a wedge); ``StalledError`` for a head not
    complete within ``liveness`` of its first byte."""
    liveness = limits.liveness
    if not started:
        left = waits.remaining()
        timeout = limits.poll if left is None else max(0.001, min(limits.poll, left))
    elif head is None:
        timeout = started + liveness - now
        if timeout <= 0:
            text = "the response head did not complete within %.1f s (liveness)" % liveness
            raise _hinted(StalledError(text, liveness), _LONGER % "liveness")
    else:
        timeout = liveness - (now - heard)
        if limits.wedge_wait is not None and head.status == 200:
            timeout = min(timeout, limits.poll)  # to look for a wedged slot while the stream is silent
    return max(timeout, 0.001)


def _slots_timeout(limits: Limits) -> float:
    """The shared ``/slots`` request's timeout, and a poll's wait for it: twice ``poll``, 0.5 s to ``liveness``."""
    return min(limits.liveness, max(2 * limits.poll, 0.5))


def _stalled(limits: Limits, head: Optional[ResponseHead], heard: float) -> Optional[StalledError]:
    """A read after the first byte timed out: the error once nothing was heard for ``liveness``, else None."""
    liveness = limits.liveness
    if _clock() - heard < liveness:
        return None
    what = "the response head" if head is None else "the error body" if head.status != 200 else ""
    text = "%s stopped" % what if what else "no data from the server"
    return _hinted(StalledError("%s for %.1f s (liveness)" % (text, liveness), liveness), _LONGER % "liveness")


def _quiet_rule(limits: Limits, slot: Optional[int], quiet: float, pinged: bool) -> Tuple[bool, bool]:
    """(look for a wedge, judge the pings) after ``quiet`` s without data (``_StreamLife._check_quiet``)."""
    wedge = limits.wedge_wait is not None and (slot is not None or quiet >= limits.wedge_wait)
    return wedge, pinged and quiet >= limits.liveness


def _judge_quiet(
    limits: Limits, state: str, wedged: Optional[WedgedSlotError], wedge: bool, pings: bool, quiet: float
) -> None:
    """Raise what the slot's state makes of a quiet stream: a wedged slot, or pings from a slot that no
    longer processes (or still does after ``busy_wait``, counted from the last data event)."""
    if wedged is not None and wedge:
        raise wedged
    if not pings:
        return
    if state not in (BUSY, UNSEEN, SEVERAL):  # a slot that cannot be seen may be processing: waited out as busy
        seen = "idle" if state == IDLE else "unknown"
        text = "only pings for %.1f s and the slot is %s: the stream is stuck" % (quiet, seen)
        raise _hinted(StalledError(text, quiet), _LONGER % "liveness")
    if quiet >= limits.busy_wait:
        why = {BUSY: "stays busy", UNSEEN: "cannot be seen (/slots is not served)"}.get(state)
        why = why or "cannot be told apart from the other servers' (Limits.servers)"
        text = "only pings for %.1f s (busy_wait) while the slot %s" % (quiet, why)
        raise _hinted(StalledError(text, quiet), _LONGER % "busy_wait")


# =====================================================================================================
# 7. Slot gates, the /slots poller and what a client's requests share: under locks, the waking passed in
# =====================================================================================================


class _Lane:
    """One queue (a slot, or a model's ``slot=None`` pool), under the gate's lock.  Queued tickets hold positions in
    entry order (``tail`` the next); ``head`` is the first one's, ``holes`` the sorted cancelled positions between.
    ``pos - head - (holes below pos)`` wait before ``pos``: a bisection, not a walk of thousands of waiters every
    ``poll``.  Invariants, whenever the lock is free:

      1. Nobody waits while a permit is free (``queue`` empty or ``in_flight >= capacity``), and ``in_flight <=
         capacity`` unless ``_Gate.resize`` made the pool smaller than the requests in flight.
      2. ``queue`` and ``holes`` hold exactly ``range(head, tail)``; ``head`` is in ``queue`` (0, 0 when empty).
      3. ``len(holes) <= len(queue)``, else ``_renumber`` (paid for by the cancels): constant memory per waiter."""

    __slots__ = ("capacity", "known", "in_flight", "queue", "head", "tail", "holes")

    def __init__(self, capacity: int, known: bool = True) -> None:
        self.capacity = capacity
        self.known = known  # False: a pool whose /props has not answered yet (nobody is judged against it)
        self.in_flight = 0
        self.queue = {}  # type: Dict[int, _Ticket]  # by position
        self.head = 0
        self.tail = 0
        self.holes = []  # type: List[int]

    def before(self, ticket: _Ticket) -> int:
        """How many tickets are queued before ``ticket``."""
        pos = ticket.pos
        holes = self.holes
        if not holes:
            return pos - self.head
        from bisect import bisect_left  # only once a waiter was cancelled from the middle of a queue

        return pos - self.head - bisect_left(holes, pos)

    def ahead(self, ticket: _Ticket) -> int:
        """``ticket``'s ``Queued(ahead)``: what must end before it goes, the waiters before it and those in
        flight past the last permit (the first waiter hears 1, for a slot as for a pool)."""
        return self.before(ticket) + 1 + max(self.in_flight - self.capacity, 0)

    def push(self, ticket: _Ticket) -> None:
        ticket.pos = pos = self.tail
        self.queue[pos] = ticket
        self.tail = pos + 1

    def admit(self) -> None:
        """Hand the free permits to the first waiters, waking those threads only."""
        queue = self.queue
        while queue and self.in_flight < self.capacity:
            ticket = queue.pop(self.head)
            self._next_head()
            self.in_flight += 1
            ticket.granted = True
            ticket.signal()

    def remove(self, ticket: _Ticket) -> None:
        """Take a waiter out of the queue; nobody else is woken (they learn it on their timer)."""
        pos = ticket.pos
        del self.queue[pos]
        if pos == self.head:
            self._next_head()
            return
        from bisect import insort

        insort(self.holes, pos)
        if len(self.holes) > len(self.queue):
            self._renumber()

    def _next_head(self) -> None:
        """The ticket at ``head`` has left the queue: the head moves to the next queued position."""
        holes = self.holes
        pos = self.head + 1
        skipped = 0
        while skipped < len(holes) and holes[skipped] == pos:
            skipped += 1
            pos += 1
        if skipped:
            del holes[:skipped]
        if not self.queue:  # pos == tail, and no holes are left
            self.head = self.tail = 0
            return
        self.head = pos
        if len(holes) > len(self.queue):  # holes behind the new head outnumber the waiters (invariant 3)
            self._renumber()

    def _renumber(self) -> None:
        order = [self.queue[pos] for pos in range(self.head, self.tail) if pos in self.queue]
        self.queue, self.head, self.tail, self.holes = {}, 0, 0, []
        for ticket in order:
            self.push(ticket)


class _Ticket:
    """One request's claim on a lane, granted by ``enter`` or queued until a release hands it the permit. The gate
    signals its ``waker`` then, or when ``_Gate.resize`` judges it (its ``Queued`` or ``BusyError``), only."""

    __slots__ = ("lane", "seq", "pos", "granted", "left", "ahead", "refused", "waker")

    def __init__(self, lane: _Lane, seq: int, waker: Optional[_Run]) -> None:
        self.lane = lane
        self.seq = seq  # entry order across the gate, for diagnostics
        self.pos = 0  # position in the lane's queue, while queued
        self.granted = False
        self.left = False
        self.ahead = 0  # the ``Queued(ahead)`` to announce, then the last one announced; 0: not judged yet
        self.refused = None  # type: Optional[BusyError]  # judged once the pool's size came: refused
        self.waker = waker

    def signal(self) -> None:
        if self.waker is not None:
            self.waker.signal()


class _Gate:
    """FIFO queues that hand over, per key ``(model, slot)`` (slot None: the pool): ``capacity`` in flight (1 for a
    slot, ``total_slots`` for a pool) and ``queue_len`` waiting; the next is ``BusyError``.  A release grants the first
    waiter and signals it alone; waiters read their place (``position``) on their own ``poll`` timer, so thousands cost
    per request what ten do.  Both drivers use it (uncontended on an event loop)."""

    def __init__(self, lock: threading.Lock, queue_len: int) -> None:
        self._lock = lock
        self._queue_len = queue_len
        self._lanes = {}  # type: Dict[Tuple[Optional[str], Optional[int]], _Lane]
        self._seq = 0

    def enter(
        self, key: Tuple[Optional[str], Optional[int]], capacity: Optional[int], waker: Optional[_Run] = None
    ) -> _Ticket:
        """A granted ticket, or a queued one (``ahead``: its first ``Queued``); ``BusyError`` when ``queue_len`` wait.
        ``capacity`` sizes a new lane or grows one; None (``/props`` has not answered): one request goes, the others
        wait unjudged until ``resize``."""
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(capacity or 1, capacity is not None)
            elif capacity is not None and capacity > lane.capacity:
                lane.capacity = capacity
                lane.admit()
            self._seq += 1
            ticket = _Ticket(lane, self._seq, waker)
            if lane.in_flight < lane.capacity:  # then nobody waits (invariant 1)
                lane.in_flight += 1
                ticket.granted = True
                return ticket
            waiting = len(lane.queue)
            if lane.known and waiting >= self._queue_len:
                raise self._refusal(key, waiting)
            lane.push(ticket)
            if lane.known:
                ticket.ahead = lane.ahead(ticket)
            return ticket

    def resize(self, key: Tuple[Optional[str], Optional[int]], capacity: Optional[int]) -> None:
        """A pool's size from ``/props`` (None: no answer, it stays one): the waiters that fit are admitted (a smaller
        size takes no permit back); those that entered before are judged, in order: past ``queue_len`` refused, the
        others told their place, each woken."""
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:  # nobody entered yet (or the one who asked was cancelled first)
                if capacity is not None:
                    self._lanes[key] = _Lane(capacity)
                return
            if capacity is not None:
                lane.capacity = capacity
            lane.admit()
            if not lane.known:
                lane.known = True
                self._judge(key, lane)

    def _judge(self, key: Tuple[Optional[str], Optional[int]], lane: _Lane) -> None:
        """The waiters of ``lane`` that entered before its size was known, judged against it, in order."""
        kept = []  # type: List[_Ticket]
        for pos in range(lane.head, lane.tail):
            ticket = lane.queue.get(pos)
            if ticket is None:
                continue
            if ticket.ahead or len(kept) < self._queue_len:
                kept.append(ticket)
                if not ticket.ahead:
                    ticket.ahead = len(kept) + max(lane.in_flight - lane.capacity, 0)
                    ticket.signal()
                continue
            ticket.refused = self._refusal(key, len(kept))
            ticket.left = True
            ticket.signal()
        lane.queue, lane.head, lane.tail, lane.holes = {}, 0, 0, []
        for ticket in kept:
            lane.push(ticket)

    def _refusal(self, key: Tuple[Optional[str], Optional[int]], waiting: int) -> BusyError:
        model, slot = key
        where = "any slot" if slot is None else "slot %s" % (slot,)
        if model is not None:
            where += " of model %s" % (model,)
        text = "%d requests already wait for %s (queue_len %d)" % (waiting, where, self._queue_len)
        return _hinted(BusyError(text, slot, self._queue_len, waiting), "try later, or raise Limits(queue_len=...)")

    def position(self, ticket: _Ticket) -> Optional[int]:
        """None once ``ticket`` is granted; else its ``Queued(ahead)`` now (``_Lane.ahead``)."""
        with self._lock:
            return None if ticket.granted else ticket.lane.ahead(ticket)

    def leave(self, ticket: _Ticket) -> None:
        """Release the permit, handing it to the next waiter, or leave the queue; idempotent."""
        with self._lock:
            if ticket.left:
                return
            ticket.left = True
            lane = ticket.lane
            if ticket.granted:
                lane.in_flight -= 1
                lane.admit()
            else:
                lane.remove(ticket)

    def snapshot(self) -> Dict[Tuple[Optional[str], Optional[int]], Tuple[int, int]]:
        """{key: (in flight, waiting)}, for tests and diagnostics."""
        with self._lock:
            return {k: (lane.in_flight, len(lane.queue)) for k, lane in self._lanes.items()}


class _SlotReader:
    """What ``/slots`` answers say (the poller's, the command line's): since when each processing slot's (task, decoded,
    prompt processed) has not changed (``remember``), and what a request's slot is doing (``state``)."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._still = {}  # type: Dict[int, Tuple[Tuple[Optional[int], Optional[int], Optional[int]], float]]

    def remember(self, slots: List[Slot], now: float) -> None:
        still = {}  # type: Dict[int, Tuple[Tuple[Optional[int], Optional[int], Optional[int]], float]]
        for s in slots:
            triple = (s.task, s.decoded, s.prompt_processed)
            if s.is_processing and triple != (None, None, None):
                old = self._still.get(s.id)
                still[s.id] = (triple, old[1] if old is not None and old[0] == triple else now)
        self._still = still  # replaced whole, never changed in place: readers need no lock

    def still(self, slot: Slot) -> float:
        """Seconds the processing ``slot`` has shown no progress (0 when it moves or sends no fields)."""
        entry = self._still.get(slot.id)
        return _clock() - entry[1] if entry is not None else 0.0

    def wedged(self, slot: Slot) -> bool:
        wait = self._limits.wedge_wait
        return wait is not None and slot.is_processing and self.still(slot) >= wait

    def state(
        self, slots: Optional[List[Slot]], slot: Optional[int], every: bool, address: str
    ) -> Tuple[str, Optional[WedgedSlotError]]:
        """``slot``'s state (None: the pool) in an answer (None: no answer; no slot in it: a model still loading), and
        the error when it is wedged.  ``every``: the pool is busy only when every slot is."""
        if not slots:  # no answer; or no slot at all: a router's model that is still loading
            return UNAVAILABLE, None
        # llama-server wraps an id_slot past the last slot
        mine = slots if slot is None else [s for s in slots if s.id == slot % len(slots)]
        wedged = [s for s in mine if self.wedged(s)]
        moving = [s for s in mine if s not in wedged]
        if wedged and (slot is not None or not every or not moving):
            s = wedged[0]
            seconds = self.still(s)
            message = (
                "slot %d of llama-server at %s is wedged: processing task %s with no progress for %.1f s "
                "(wedge_wait)" % (s.id, address, s.task, seconds)
            )
            return WEDGED, _hinted(WedgedSlotError(message, s.id, s.task, seconds), _RESTART)
        flags = [s.is_processing for s in moving]
        busy = all(flags) if every else any(flags)
        return (BUSY if busy and flags else IDLE), None


class _SlotPoller(_SlotReader):
    """``/slots`` of one model, shared by a board's requests: one request in flight (``start()`` says who sends it), an
    answer younger than ``poll`` reused, the waiters signalled when it comes (``answered``)."""

    def __init__(self, limits: Limits, lock: threading.Lock) -> None:
        _SlotReader.__init__(self, limits)
        self._lock = lock
        self.stamp = float("-inf")  # when the last answer arrived
        self.slots = None  # type: Optional[List[Slot]]  # None: /slots failed
        self.unseen = False  # the last answer said /slots is not served (404, 403, 405, 501)
        self.several = False  # the answers proved several servers behind the address (see answered())
        self.waiters: Set[_Run] = set()
        self._asking = False

    def start(self) -> bool:
        """True when the caller is to send the request: none is in flight."""
        with self._lock:
            asking, self._asking = self._asking, True
            return not asking

    def wait(self, waker: _Run, on: bool) -> None:
        with self._lock:
            (self.waiters.add if on else self.waiters.discard)(waker)

    def fresh(self, now: float) -> bool:
        """The last answer may be reused: younger than ``poll`` (30 s when /slots is not served)."""
        return now - self.stamp < (UNSEEN_POLL if self.unseen else self._limits.poll)

    def answered(self, slots: Optional[List[Slot]], unseen: bool = False) -> None:
        now = _clock()
        with self._lock:
            if slots is not None:
                # A number of slots that changed proves several servers (or one restarted with another
                # --parallel: the waits are only more patient); a task id going back proves nothing (a slot
                # may take a task queued for it after a later one that went to it at once).
                if self.slots is not None and len(self.slots) != len(slots):
                    self.several = True
                self.remember(slots, now)
            self.unseen = unseen
            self.slots = slots
            self.stamp = now
            self._asking = False
            waiters = list(self.waiters)
        for waker in waiters:
            waker.signal()


class _Run:
    """What a plan knows of the driver running it (``_SyncRun``, ``_AsyncRun``): cancelled, its last words
    ``shield``-ed, its ticket, its value, its open connections; the driver adds ``signal``, ``cancel`` and the
    operations of section 8, each a method of its name."""

    __slots__ = ("board", "gen", "value", "cancelled", "shield", "ticket", "_conns", "_conns_lock")

    def __init__(self, board: Any) -> None:
        self.board = board
        self.gen = None  # type: Optional[_Plan[Any]]
        self.value = None  # type: Any  # what the plan returned
        self.cancelled = False
        self.shield = False  # the plan's last words (a DELETE) are not cut short by the cancel
        self.ticket = None  # type: Optional[_Ticket]
        self._conns = set()  # type: Set[Any]  # the connections open (a kept one is forgotten)
        self._conns_lock = threading.Lock()

    def child(self, plan: _Plan[Any]) -> Any:
        """A run of this driver for ``plan``, started in the background (``_SPAWN``), among the board's runs."""
        run = type(self)(self.board)
        run.gen = plan
        self.board.add(run)
        return run

    def send(self, conn: Any, data: bytes, timeout: float) -> Any:
        return conn.send(data, timeout)

    def recv(self, conn: Any, timeout: float) -> Any:
        return conn.recv(timeout)

    def keep(self, conn: Any, idle: float) -> None:
        self.forget(conn)
        self.board.keep(conn, idle)

    def forget(self, conn: Any) -> None:
        with self._conns_lock:
            self._conns.discard(conn)

    def _open(self) -> List[Any]:
        with self._conns_lock:
            return list(self._conns)

    def close_all(self) -> None:
        """Close the connections still open (at the plan's end)."""
        for conn in self._open():
            conn.close()

    def _abort(self) -> None:
        """Mark the run cancelled and abort its connections: a read or a connect in progress ends at once."""
        self.cancelled = True
        for conn in self._open():
            conn.abort()

    if TYPE_CHECKING:

        def signal(self) -> None: ...

        def cancel(self) -> None: ...


class _Board:
    """What one client's requests share (one event loop's, for ``AsyncClient``), under one lock: the gate, a ``/slots``
    poller and a pool size per model, the ``/props`` in flight, the runs in flight (``close()`` cancels them) and the
    kept connections."""

    def __init__(self, calls: _Calls, previous: Optional[_Board] = None) -> None:
        self.calls = calls
        self.limits = calls.limits
        self.lock = threading.Lock()
        self.gate = _Gate(self.lock, calls.limits.queue_len)
        self.pollers = {}  # type: Dict[Optional[str], _SlotPoller]
        self.pools = dict(previous.pools) if previous is not None else {}  # type: Dict[Optional[str], int]
        self.asking = set()  # type: Set[Optional[str]]  # the models whose /props is in flight (in the background)
        self.runs: Set[_Run] = set()
        self.idle = []  # type: List[Tuple[Any, float, int]]  # kept connections: (conn, usable until, pid)
        self.closed = False
        #: what drives this board's plans in the calling thread: ``_SyncRun``, or a test's virtual driver
        self.run_class = _SyncRun  # type: Any

    def poller(self, model: Optional[str]) -> _SlotPoller:
        with self.lock:
            poller = self.pollers.get(model)
            if poller is None:
                poller = self.pollers[model] = _SlotPoller(self.limits, threading.Lock())
            return poller

    def add(self, run: _Run) -> None:
        with self.lock:
            if self.closed:
                raise CancelledError("the client was closed before this request started")
            self.runs.add(run)

    def discard(self, run: _Run) -> None:
        with self.lock:
            self.runs.discard(run)

    def checkout(self, run: _Run) -> Any:
        """A kept connection to reuse, now ``run``'s, or None; stale ones (or a parent process's) are closed."""
        now, pid = _clock(), os.getpid()
        found = None
        stale = []
        with self.lock:
            while self.idle:
                conn, until, owner = self.idle.pop()
                if owner == pid and now < until:
                    found = conn
                    break
                stale.append(conn)
        for conn in stale:
            conn.close()
        log = _logger()
        if log and stale:
            log.debug("%s: closed %d kept connection(s) idle past their time", self.calls.address, len(stale))
        if found is not None:
            found.owner = run
            found.reused = True
            if log:
                log.debug("%s: reusing a kept connection", self.calls.address)
        return found

    def keep(self, conn: Any, idle: float) -> None:
        """Keep ``conn`` for ``idle`` seconds, or close it when ``keep_alive`` are kept already."""
        with self.lock:
            kept = not self.closed and len(self.idle) < self.limits.keep_alive
            if kept:
                conn.owner = _NOBODY  # not the run that used it: a client dropped unclosed is freed at once
                self.idle.append((conn, _clock() + idle, os.getpid()))
        if not kept:
            conn.close()
        log = _logger()
        if log and kept:
            log.debug("%s: connection kept for reuse (%.0f s idle at most)", self.calls.address, idle)
        elif log:
            log.debug("%s: connection closed, not kept (keep_alive are kept already)", self.calls.address)

    def close(self) -> None:
        """Cancel every run in flight, streams and polls, and close the kept connections."""
        with self.lock:
            self.closed = True  # nothing is kept from now on
            runs = list(self.runs)
        for run in runs:
            run.cancel()
        self.drop_idle()

    def drop_idle(self) -> None:
        """Close the kept connections (``AsyncClient``: of a loop it no longer uses, which cannot serve another)."""
        with self.lock:
            idle, self.idle = self.idle, []
        for conn, _, _ in idle:
            conn.close()


class _Nobody:
    """The owner of a kept connection between runs."""

    def forget(self, conn: Any) -> None:
        pass


_NOBODY = _Nobody()


def _total_slots(props: Any) -> Optional[int]:
    """``total_slots`` of a ``/props`` answer; None when it has none that makes sense."""
    total = props.get("total_slots") if isinstance(props, dict) else None
    return total if type(total) is int and total >= 1 else None


def _slots_from(doc: Any) -> List[Slot]:
    if type(doc) is not list:
        raise ProtocolError("/slots did not answer a list")
    slots = []
    for item in doc:
        if type(item) is not dict or type(item.get("id")) is not int or type(item.get("is_processing")) is not bool:
            raise ProtocolError("/slots answered an entry without an integer id and a boolean is_processing")
        slots.append(Slot(item["id"], item["is_processing"], item, *_slot_progress(item)))
    return slots


def _slot_progress(item: Dict[str, Any]) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """(task, decoded, prompt_processed) of a ``/slots`` entry; None for what the server does not send."""
    nxt = item.get("next_token")
    if type(nxt) is list and nxt:
        nxt = nxt[0]
    decoded = nxt.get("n_decoded") if type(nxt) is dict else None
    values = (item.get("id_task"), decoded, item.get("n_prompt_tokens_processed"))
    return tuple(v if type(v) is int else None for v in values)  # type: ignore[return-value]


# =====================================================================================================
# 8. The request logic: plans that ask for I/O and never do it
# =====================================================================================================
#
# Every call, streamed or single-shot, is a plan: a generator that yields what it needs done and receives
# the result (or has the error thrown into it).  It yields either a list of events (hand them to the
# caller) or one of these operations, a tuple whose first item says which:
#
#     (_CONNECT, timeout, reuse)    -> a connection (a driver's object with close() and ``reused``), a kept
#                                      one when ``reuse`` and the board has one; OSError when the server
#                                      cannot be reached, ConnectError when TLS fails
#     (_KEEP, conn, idle)           -> None; ``conn`` is kept for reuse ``idle`` seconds, or closed
#     (_SEND, conn, data, timeout)  -> None; StalledError, StreamClosedError
#     (_RECV, conn, timeout)        -> bytes, b"" at the end; _Silence after ``timeout``, StreamClosedError
#     (_PARK, timeout)              -> None, when the plan's waker is signalled or ``timeout`` (None: no
#                                      timer) passes; the plan then looks again at what it waits for
#     (_SLEEP, seconds)             -> None
#     (_SPAWN, plan)                -> None; ``plan`` runs in the background, on a run of its own
#
# A driver performs them (section 9: one with blocking sockets, one with asyncio), each by its method of the
# operation's name, and, after every operation, throws CancelledError into the plan once the run was
# cancelled.  So each rule exists once.

#: Each operation is named by the method that performs it on every driver (``_SyncRun.recv``, ...).
_CONNECT, _SEND, _RECV, _PARK, _SLEEP, _SPAWN, _KEEP = "connect", "send", "recv", "park", "sleep", "spawn", "keep"

if TYPE_CHECKING:
    _T = TypeVar("_T")
    _Plan = Generator[Any, Any, _T]  # a plan that returns a _T

DEFAULT_ADDRESS = "http://127.0.0.1:8080"
_NO_MODEL = object()  # "route to the client's default model"
_METHOD_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _query_string(query: Dict[str, Any]) -> str:
    from urllib.parse import urlencode  # only when a call has a query

    for name, value in query.items():
        for item in (name, value):
            # urlencode sends bytes as they are: check their bytes, not their repr
            text = item.decode("latin-1") if isinstance(item, bytes) else str(item)
            if "\r" in text or "\n" in text or "\0" in text:
                raise ValueError("a query name or value must not contain CR, LF or NUL")
    return urlencode(query)


def _keep_for(head: ResponseHead) -> Optional[float]:
    """How long the connection that answered ``head`` may idle for reuse: a second less than ``Keep-Alive: timeout=N``
    (else ``KEEP_IDLE``); None for ``Connection: close``, HTTP/1.0, or ``max=`` below 2."""
    if head.version != "HTTP/1.1" or "close" in (head.get("connection") or "").lower():
        return None
    idle = KEEP_IDLE
    for item in (head.get("keep-alive") or "").split(","):
        name, _, value = item.strip().partition("=")
        value = value.strip()
        if not (value.isdigit() and value.isascii()):
            continue
        if name.strip().lower() == "timeout":
            idle = int(value) - 1.0
        elif name.strip().lower() == "max" and int(value) < 2:
            return None
    return idle if idle > 0 else None


def _conversation_id(value: Any) -> Optional[str]:
    """``resumable``: True makes an id (``lc-`` and 32 hex digits), a str is one (1 to 128 visible ASCII)."""
    if value is None or value is False:
        return None
    if value is True:
        return "lc-" + os.urandom(16).hex()
    if not isinstance(value, str):
        raise TypeError("resumable must be True, False or a conversation id (str), not %r" % (value,))
    if not 1 <= len(value) <= 128 or not all("!" <= c <= "~" for c in value):
        raise ValueError("a conversation id is 1 to 128 visible ASCII characters, not %r" % (value[:140],))
    return value


def _pin(conversation: Optional[str]) -> List[Tuple[str, str]]:
    """The ``X-Conversation-Id`` of a resumable stream's requests: a front routing by it reaches its server."""
    return [("X-Conversation-Id", conversation)] if conversation is not None else []


_SESSION_HEADER = "X-Session-Id"
_SERVER_HEADER = "X-Llama-Server"  # a front's name of the server that answered: see _StreamLife._answered_by
_canonical = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode


def _session_key(value: Any, what: str = "session") -> Optional[str]:
    """A caller's session key: None, or 1 to 128 visible ASCII characters (``ValueError``, else ``TypeError``)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError("%s must be a str (a session key) or None, not %r" % (what, value))
    if not 1 <= len(value) <= 128 or not all("!" <= c <= "~" for c in value):
        raise ValueError("a session key is 1 to 128 visible ASCII characters, not %r" % (value[:140],))
    return value


def _session_digest(head: Any) -> Optional[str]:
    """A key for a request whose caller gave none: ``s-`` and 32 hex digits of the SHA-256 of its stable head as
    canonical JSON (the same in every process and version; never the text).  None for no head, or one JSON cannot write
    (the body then fails its own encoding)."""
    if head is None:
        return None
    try:
        text = _canonical(head)
    except (TypeError, ValueError, RecursionError):
        return None
    from hashlib import sha256  # only when a key is made (it loads OpenSSL: 3 ms)

    return "s-" + sha256(text.encode("ascii")).hexdigest()[:32]


def _session_header(session: Optional[str]) -> List[Tuple[str, str]]:
    """The ``X-Session-Id`` of a request: a front routing by it keeps a conversation on one server."""
    return [(_SESSION_HEADER, session)] if session is not None else []


def _cancelled() -> CancelledError:
    return CancelledError("the request was cancelled")


_DONE = object()  # a plan returned


def _advance(run: _Run, value: Any, exc: Optional[BaseException]) -> Any:
    """Resume ``run``'s plan with the result of its last operation (``value``) or its error (``exc``): what
    it yields next, or ``_DONE`` once it returned (its value then in ``run.value``).  Both drivers' loop."""
    gen = run.gen
    assert gen is not None
    try:
        return gen.send(value) if exc is None else gen.throw(exc)
    except StopIteration as stop:
        run.value = stop.value
        return _DONE


def _after(run: _Run, exc: Optional[BaseException]) -> Optional[BaseException]:
    """What to throw into the plan after an operation: ``CancelledError`` once the run is cancelled (unless
    it says its last words, ``shield``); a ``BaseException`` (Ctrl-C, a task's cancellation) as it is."""
    stop = run.cancelled and not run.shield and type(exc) is not CancelledError
    if stop and (exc is None or isinstance(exc, Exception)):
        return _cancelled()
    return exc


def _check_timeout(timeout: Any) -> Optional[float]:
    """A single-shot call's ``timeout=``: None or seconds > 0 (``TypeError``, ``ValueError`` for <= 0 or NaN)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError("timeout must be a number of seconds or None, not %r" % (timeout,))
    if not timeout > 0:
        raise ValueError("timeout must be greater than zero, not %r" % (timeout,))
    return float(timeout)


#: the operations a deadline cuts short, and the phase each is of a call
_DEADLINE_PHASES = {_CONNECT: "connect", _SEND: "send", _RECV: "answer", _PARK: "wait", _SLEEP: "wait"}
#: where each of them holds its timeout
_TIMEOUT_AT = {_CONNECT: 1, _SEND: 3, _RECV: 2, _PARK: 1, _SLEEP: 1}
#: what a cut operation raises when its time ran out: a driver's read timeout, a connect's, a send's
_TIMED_OUT = (_Silence, socket.timeout, TimeoutError)


def _within(plan: _Plan[_T], timeout: float, address: str) -> _Plan[_T]:
    """``plan``, a single-shot call, within ``timeout`` seconds from its first step: each operation may take at most
    what is left.  An operation cut short by the deadline, or due after it, is ``DeadlineError``; ``plan`` is closed
    first (its connection with it)."""
    deadline = _clock() + timeout
    value, exc = None, None  # type: Any, Optional[BaseException]
    what, heard = "", False  # the request line once sent; whether any byte of the answer came
    try:
        while True:
            try:
                op = plan.send(value) if exc is None else plan.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            value, exc = None, None
            code = op[0] if type(op) is tuple else None
            if code not in _DEADLINE_PHASES:  # events, a connection kept, a background plan: not timed
                value = yield op
                continue
            left = deadline - _clock()
            if left <= 0:
                raise _deadline_error(timeout, code, what, address, heard)
            if code == _SEND:  # "GET /path?query HTTP/1.1": the method and the target
                what = op[2].split(b"\r\n", 1)[0].rsplit(b" ", 1)[0].decode("latin-1")
            where = _TIMEOUT_AT[code]
            cut = op[where] is None or left < op[where]  # (a park without a timer is cut too)
            try:
                value = yield op[:where] + (left,) + op[where + 1 :] if cut else op
            except GeneratorExit:
                raise
            except BaseException as caught:  # noqa: B036 - a timeout of a cut operation is the deadline's
                if not (cut and isinstance(caught, _TIMED_OUT)):
                    exc = caught
                    continue
                raise _deadline_error(timeout, code, what, address, heard) from None
            heard = heard or bool(code == _RECV and value)
            if cut and code == _SLEEP:
                raise _deadline_error(timeout, code, what, address, heard)
    finally:
        plan.close()


def _deadline_error(timeout: float, code: str, what: str, address: str, heard: bool) -> DeadlineError:
    """The ``DeadlineError`` of a ``timeout`` run out in ``code``; ``what``: the request line; ``heard``: any byte."""
    phase = _DEADLINE_PHASES[code]
    if phase == "connect" or not what:
        what = address
    doing = {
        "connect": "connecting to %s",
        "send": "sending %s",
        "answer": ("reading the answer to %s" if heard else "waiting for the answer to %s"),
        "wait": "waiting to ask again after %s",
    }[phase] % what
    text = "the call's timeout (%g s) ran out while %s: the connection was closed" % (timeout, doing)
    return _hinted(DeadlineError(text, timeout, phase), "raise timeout= to wait longer")


class _StreamRequest:
    """What a streamed request sends and how it is read: made by ``_Streams``, lived by ``_StreamLife``."""

    __slots__ = (
        "calls", "request", "slot", "model", "raw_chunks", "dialect", "conversation", "offset", "watch", "only",
    )  # fmt: skip

    def __init__(
        self,
        calls: _Calls,
        request: bytes,
        slot: Optional[int],
        model: Optional[str],
        raw_chunks: bool,
        dialect: Any,
        conversation: Optional[str] = None,
        offset: Optional[int] = None,
    ) -> None:
        #: the client's calls, with the headers and the session key of the call that made the stream
        #: (``_Calls.at``): the requests made for this stream alone (lookup, replay, DELETE, the control
        #: endpoint) carry them too
        self.calls = calls
        self.request = request  # the bytes of the first send: the request, or resume()'s read of the buffer
        self.slot = slot
        self.model = model  # the model it is routed to (its gate and /slots); None: the server's default
        self.raw_chunks = raw_chunks
        self.dialect = dialect  # the class that reads the endpoint's payloads
        self.conversation = conversation  # the X-Conversation-Id of a resumable stream
        self.offset = offset  # resume(): the body offset its first send reads the buffer from; None: a request
        self.watch = False  # a watch (GET /models/sse): its life's watch() reads it
        self.only = None  # type: Optional[str]  # a watch: the model whose events it yields (None: every one's)


def _with_slot(body: Any, slot: Any) -> Dict[str, Any]:
    """``body`` (a dict; None: a route's empty one) with ``id_slot``; ``TypeError`` for another body."""
    slot = _slot_id(slot, "an int or None")
    if body is not None and not isinstance(body, dict):
        raise TypeError("a slot goes into a JSON object body (id_slot), not beside %s" % type(body).__name__)
    doc = {} if body is None else body  # type: Dict[str, Any]
    doc["id_slot"] = slot
    return doc


def _recv_answer(conn: "_Conn", timeout: float, what: str) -> _Plan[bytes]:
    """The next bytes of the answer to the single-shot call ``what``; ``StalledError`` after ``timeout`` of silence."""
    try:
        data = yield (_RECV, conn, timeout)  # type: bytes
        return data
    except _Silence:
        raise _no_answer(what, timeout) from None


def _extra_headers(addr: _Address, headers: Optional[Dict[str, str]], api_key: Optional[str]) -> List[Tuple[str, str]]:
    """The headers of every request: User-Agent (``headers`` may replace it), ``headers``, ``api_key`` as a bearer."""
    extra = _merged([("User-Agent", _USER_AGENT)], _own_headers(addr, headers))
    if api_key is not None:
        if not isinstance(api_key, str):
            raise TypeError("api_key must be a str")
        extra.append(("Authorization", "Bearer " + api_key))
    encode_request("GET", "/", addr.host, extra)  # ValueError now for a CR, LF or bad name
    return extra


def _own_headers(addr: _Address, headers: Optional[Dict[str, str]]) -> List[Tuple[str, str]]:
    """A caller's ``headers`` as pairs, checked: ``TypeError`` for what is not str, ``ValueError`` for a header
    loopclient sets itself, a CR, LF or NUL, or a bad name.  Names differing only in case are one header, the last value
    winning."""
    own = []  # type: List[Tuple[str, str]]
    for name, value in dict(headers or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError("header names and values must be str")
        if name.lower() in ("host", "content-length", "transfer-encoding", "content-type", "connection"):
            raise ValueError("header %s is set by loopclient itself" % name)
        own = _merged(own, [(name, value)])
    encode_request("GET", "/", addr.host, own)  # ValueError now for a CR, LF or bad name
    return own


def _merged(headers: List[Tuple[str, str]], over: List[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """``headers`` without those ``over`` names (in any case), then ``over``: ``over``'s values win."""
    names = {name.lower() for name, _ in over}
    return [(k, v) for k, v in headers if k.lower() not in names] + over


def _session_from(headers: List[Tuple[str, str]], session: Any) -> Tuple[List[Tuple[str, str]], Optional[str]]:
    """``headers`` (a client's, or one call's) without an ``X-Session-Id``, and the session key: ``session``,
    or that header's (the same thing, set by hand); ``ValueError`` when the two give different keys."""
    key = _session_key(session)
    given = [v for k, v in headers if k.lower() == _SESSION_HEADER.lower()]
    if not given:
        return headers, key
    header = _session_key(given[-1], "the X-Session-Id header")
    if key is not None and key != header:
        raise ValueError("two session keys: %r by session= and %r by an X-Session-Id header" % (key, header))
    return [(k, v) for k, v in headers if k.lower() != _SESSION_HEADER.lower()], header


def _tls_context(addr: _Address, ssl_context: Any) -> Any:
    """The ``ssl.SSLContext`` for ``addr``: the caller's, else a default one for https:// (else None)."""
    if addr.tls or ssl_context is not None:
        ssl = _import_ssl()

        if ssl_context is None:
            return ssl.create_default_context()
        if not isinstance(ssl_context, ssl.SSLContext):
            raise TypeError("ssl_context must be an ssl.SSLContext, not %s" % type(ssl_context).__name__)
    return ssl_context


class _Calls:
    """A client's configuration (checked as ``Client`` documents), how its requests are encoded (``encode``) and routed
    (``route``), and each single-shot call as a plan (``_exchange``); shared by ``Client`` and ``AsyncClient``, and it
    never touches a socket."""

    def __init__(
        self,
        address: Any,
        limits: Optional[Limits],
        api_key: Optional[str],
        headers: Optional[Dict[str, str]],
        model: Optional[str],
        ssl_context: Any,
        session: Optional[str] = None,
    ) -> None:
        if address is None:
            address = os.environ.get("LLAMA_SERVER") or DEFAULT_ADDRESS
        addr = parse_address(address)
        self.address = addr.text
        if limits is None:
            limits = Limits()
        elif not isinstance(limits, Limits):
            raise TypeError("limits must be a loopclient.Limits, not %s" % type(limits).__name__)
        self.limits = limits
        if model is not None and not isinstance(model, str):
            raise TypeError("model must be a str or None")
        self.model = model
        # the client's key goes on every request (unless a call gives its own) as the request's, not a header
        self._headers, self.session = _session_from(_extra_headers(addr, headers, api_key), session)
        self._accept = not any(name.lower() == "accept" for name, _ in self._headers)  # else the caller's
        self.addr = addr
        self.ssl_context = _tls_context(addr, ssl_context)
        self.closed = False
        self.root = self  # the client's own calls: a copy made by at() reads closed there
        #: per model, how many slots the server said it has (0: answers that disagreed); see ``learn_slots``
        self.slot_counts = {}  # type: Dict[Optional[str], int]

    def at(self, headers: Optional[Dict[str, str]], session: Optional[str] = None) -> _Calls:
        """These calls with one call's own ``headers`` (its values win, ``Authorization`` and ``User-Agent`` too; an
        ``X-Session-Id`` is its session key) or ``session``; ``self`` when both are None. ``TypeError``/``ValueError``
        for what ``Client(headers=...)`` refuses, or two different session keys."""
        if headers is None and session is None:
            return self
        calls = object.__new__(_Calls)
        calls.__dict__.update(self.__dict__)
        if headers is not None:
            own, session = _session_from(_own_headers(self.addr, headers), session)
            calls._headers = _merged(self._headers, own)
            calls._accept = not any(name.lower() == "accept" for name, _ in calls._headers)
        if session is not None:
            calls.session = session
        return calls

    def learn_slots(self, model: Optional[str], count: Optional[int]) -> None:
        """Remember the server's slot count for ``model`` from an answer got anyway (``total_slots``, a ``/slots``
        length); two that disagree make it unknown for good; nothing is learnt with ``Limits.servers`` > 1."""
        if count is None or count < 1 or self.limits.servers > 1:
            return
        known = self.slot_counts.get(model, count)
        self.slot_counts[model] = count if known == count else 0

    def check_slot(self, slot: int, model: Optional[str]) -> None:
        """``ValueError`` for a ``slot`` past the server's slots: llama-server would take it modulo their number,
        a slot the caller did not name (and that the gate does not count as the same)."""
        count = self.slot_counts.get(model, 0)
        if count and slot >= count:
            which = "slot 0" if count == 1 else "0 to %d" % (count - 1)
            owner = "it has" if model is None else "model %s has" % model
            raise ValueError(
                "slot %d is past the server's slots: %s %d (%s), and llama-server would take slot %d as slot %d "
                "(modulo %d)" % (slot, owner, count, which, slot, slot % count, count)
            )

    # -- requests ----------------------------------------------------------------------------------------

    def encode(
        self,
        method: str,
        path: str,
        body: Any,
        accept: str,
        query: Optional[Dict[str, Any]] = None,
        keep: bool = False,
        extra: Sequence[Tuple[str, str]] = (),
    ) -> bytes:
        """The request bytes (``Connection: close`` unless ``keep``; ``Accept: accept`` unless the caller's
        headers say otherwise).  ``ValueError``/``TypeError`` for what cannot be sent, before any connection."""
        if self.root.closed:
            raise ValueError("this client is closed")
        if not method or not _METHOD_CHARS.issuperset(method):
            raise ValueError("invalid HTTP method %r" % (method,))
        if not path.startswith("/"):  # checked before the prefix, which would make "/llama" + "x" look valid
            raise ValueError("the request path must start with /: %r" % (path,))
        target = self.addr.prefix + path
        if query:
            target += ("&" if "?" in path else "?") + _query_string(query)
        headers = [("Accept", accept)] if self._accept else []
        payload = None
        if body is not None:
            payload = _dumps(body).encode("utf-8")
            headers.append(("Content-Type", "application/json"))
        if not keep:
            headers.append(("Connection", "close"))
        headers.extend(extra)
        if self.session is not None and not any(name == _SESSION_HEADER for name, _ in extra):
            headers.append((_SESSION_HEADER, self.session))
        return encode_request(method, target, self.addr.host, headers + self._headers, payload)

    def route(
        self, method: str, body: Any, query: Optional[Dict[str, Any]], model: Any, path: str = ""
    ) -> Tuple[Any, Optional[Dict[str, Any]]]:
        """Name the model as a router needs it: ``?model=`` on a GET, ``"model"`` in a JSON object body;
        a call that names its own (in the body, ``query`` or the path's query string) keeps it."""
        name = self.model if model is _NO_MODEL else model
        if name is None:
            return body, query
        if method == "GET":
            if "model" not in (query or {}) and "&model=" not in "&" + path.partition("?")[2]:
                query = dict(query or {}, model=name)
        elif isinstance(body, dict) and "model" not in body:
            body = dict(body, model=name)
        return body, query

    # -- single-shot calls: one exchange, sent again only when a kept connection had been closed ------------

    def _exchange(
        self, request: bytes, timeout: float, what: str, head_only: bool = False
    ) -> _Plan[Tuple[ResponseHead, bytes]]:
        """Send one request and read its answer whole: (head, body); ``ConnectError``, ``StalledError`` (silence over
        ``timeout``), ``ProtocolError`` (over ``max_body``).  ``head_only``: a HEAD's answer ends at its head.  With
        ``keep_alive`` a kept connection is reused; one that fails before any byte of the answer was closed by the
        server while idle: the request goes once more, on a new connection."""
        reuse = self.limits.keep_alive > 0
        while True:
            try:
                conn = yield (_CONNECT, timeout, reuse)
            except OSError as exc:
                raise _connect_error(self.addr, exc) from exc
            answer = yield from self._answer(conn, request, timeout, what, head_only)
            if answer is not None:
                return answer
            reuse = False

    def _answer(
        self, conn: "_Conn", request: bytes, timeout: float, what: str, head_only: bool
    ) -> _Plan[Optional[Tuple[ResponseHead, bytes]]]:
        """``_exchange`` on the connection ``conn``, which it keeps or closes; ``None`` when ``conn`` was a
        kept one that the server had closed while idle (it failed before any byte of the answer)."""
        keep = self.limits.keep_alive > 0
        kept = heard = False
        try:
            yield (_SEND, conn, request, timeout)
            reader = ResponseReader(max_body=self.limits.max_body)
            pieces = []  # type: List[bytes]
            while not reader.done and not (head_only and reader.head is not None):
                data = yield from _recv_answer(conn, timeout, what)
                if not data:
                    reader.feed_eof()
                    break
                heard = True
                pieces.extend(reader.feed(data))
                if reader.failed is not None:  # nobody reads a partial single-shot body: fail at once
                    raise reader.failed
            head = reader.head
            assert head is not None
            if keep and (head_only or reader.reusable):
                idle = _keep_for(head)
                if idle is not None:
                    kept = True
                    yield (_KEEP, conn, idle)
            return head, b"".join(pieces)
        except StreamClosedError:
            if not conn.reused or heard:
                raise
            return None
        finally:
            if not kept:
                conn.close()

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Optional[Dict[str, Any]] = None,
        *,
        model: Any = _NO_MODEL,
        timeout: Optional[float] = None,
        extra: Sequence[Tuple[str, str]] = (),
        accept: str = "application/json",
    ) -> _Plan[Tuple[ResponseHead, bytes]]:
        """One request routed to its model, as ``_exchange`` sends it: (head, body); ``timeout``: ``liveness``."""
        body, query = self.route(method, body, query, model, path)
        request = self.encode(method, path, body, accept, query, self.limits.keep_alive > 0, extra)
        timeout = self.limits.liveness if timeout is None else timeout
        return (yield from self._exchange(request, timeout, "%s %s" % (method, path), method == "HEAD"))

    def call_json(
        self, method: str, path: str, body: Any = None, query: Optional[Dict[str, Any]] = None, **kw: Any
    ) -> _Plan[Any]:
        """``_call``'s answer: the JSON value of a 200 (else ``HTTPStatusError``; not JSON: ``ProtocolError``)."""
        head, data = yield from self._call(method, path, body, query, **kw)
        if head.status != 200:
            raise _status_error(head, data)
        return _decode_json(data, "%s %s" % (method, path))

    def _object(self, method: str, path: str, body: Any = None, query: Any = None, **kw: Any) -> _Plan[Dict[str, Any]]:
        doc = yield from self.call_json(method, path, body, query, **kw)
        if not isinstance(doc, dict):
            raise ProtocolError("%s %s did not answer a JSON object" % (method, path))
        return doc

    def _post_field(self, path: str, body: Any, name: str, kind: Any) -> _Plan[Any]:
        doc = yield from self._object("POST", path, body)
        value = doc.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProtocolError("POST %s answered no %r of the right type" % (path, name))
        return value

    def request(self, method: str, path: str, body: Any, query: Optional[Dict[str, Any]]) -> _Plan[Any]:
        _check_request(method, path, query)
        head, data = yield from self._call(method, path, body, query)
        if not 200 <= head.status < 300:
            raise _status_error(head, data)
        if method == "HEAD" or head.status == 204:  # no body, whatever Content-Type says
            return ""
        if "json" in (head.get("content-type") or "").lower():
            return _decode_json(data, "%s %s" % (method, path))
        return data.decode("utf-8", "replace")

    def fetch(self, method: str, path: str, body: Any, query: Optional[Dict[str, Any]]) -> _Plan[Response]:
        """``request()``'s exchange, whatever the answer's status: the whole of it (``Accept: */*``)."""
        _check_request(method, path, query)
        head, data = yield from self._call(method, path, body, query, accept="*/*")
        return Response(head.status, head.reason, head.headers, data)

    def slots(self, model: Optional[str]) -> _Plan[List[Slot]]:
        name = self.model if model is None else model
        slots = _slots_from((yield from self.call_json("GET", "/slots", model=name)))
        self.learn_slots(name, len(slots))
        return slots

    def health(self) -> _Plan[Dict[str, Any]]:
        head, data = yield from self._call("GET", "/health")
        if head.status != 200:
            raise _status_error(head, data)
        text = data.decode("utf-8", "replace")
        if "json" not in (head.get("content-type") or "").lower() and text.lstrip()[:1] not in ("{", "["):
            return {"status": "ok", "body": text.strip()}  # a front's own check: llama-swap answers "OK"
        doc = _decode_json(data, "GET /health")
        if not isinstance(doc, dict):
            raise ProtocolError("GET /health did not answer a JSON object")
        return doc

    def props(self, model: Optional[str]) -> _Plan[Dict[str, Any]]:
        name = self.model if model is None else model
        doc = yield from self._object("GET", "/props", model=name)
        self.learn_slots(name, _total_slots(doc))
        return doc

    def models(self) -> _Plan[Dict[str, Any]]:
        return (yield from self._object("GET", "/v1/models"))

    def load_model(self, name: str, wait: bool = False) -> _Plan[Dict[str, Any]]:
        answer = yield from self._object("POST", "/models/load", {"model": name})
        if not wait:
            return answer
        # The router marks the model loading before it answers: from here, GET /models says how it goes.
        started = _clock()
        while True:
            status = yield from self._model_status(name)
            value = status.get("value")
            if value in ("loaded", "sleeping"):  # sleeping: loaded, its weights swapped out until a request
                return answer
            if value not in ("loading", "downloading", "downloaded"):
                code = status.get("exit_code")
                failed = ", failed with exit code %s" % code if status.get("failed") else ""
                text = "the router could not load model %r: it is %s%s (GET /models: %s)"
                raise ServerError(code, text % (name, value, failed, _dumps(status)[:300]), "load_failed", status)
            left = self.limits.load_wait - (_clock() - started)
            if left <= 0:
                text = "model %r was still %s after load_wait (%.1f s)" % (name, value, self.limits.load_wait)
                raise _hinted(LoadTimeoutError(text, _clock() - started), _LONGER % "load_wait")
            yield (_SLEEP, min(self.limits.poll, left))

    def _model_status(self, name: str) -> _Plan[Dict[str, Any]]:
        """The router's ``status`` object of one model (``GET /models``)."""
        doc = yield from self.call_json("GET", "/v1/models", model=None)
        entries = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise ProtocolError("GET /v1/models did not answer a list of models: is this a router?")
        for entry in entries:
            if isinstance(entry, dict) and (entry.get("id") == name or name in (entry.get("aliases") or ())):
                status = entry.get("status")
                if not isinstance(status, dict):
                    raise ProtocolError("GET /v1/models shows model %r without a status: is this a router?" % name)
                return status
        raise ServerError(None, "the router no longer lists model %r (GET /v1/models)" % name, "load_failed")

    def unload_model(self, name: str) -> _Plan[Dict[str, Any]]:
        return (yield from self._object("POST", "/models/unload", {"model": name}))

    def control(self, model: Optional[str], completion_id: str, session: Optional[str] = None) -> _Plan[bool]:
        """Ask the server to end the reasoning of a completion in flight; True when it accepted."""
        if not isinstance(completion_id, str):
            raise TypeError("completion_id must be a str")
        body = {"id": completion_id, "action": "reasoning_end"}
        extra = _session_header(session)
        doc = yield from self.call_json("POST", "/v1/chat/completions/control", body, model=model, extra=extra)
        if not isinstance(doc, dict):
            raise ProtocolError("the control endpoint did not answer a JSON object")
        return doc.get("success") is True

    def tokenize(self, text: str, add_special: bool, parse_special: bool, with_pieces: bool) -> _Plan[List[Any]]:
        body = {"content": text, "add_special": add_special, "parse_special": parse_special, "with_pieces": with_pieces}
        return (yield from self._post_field("/tokenize", body, "tokens", list))  # type: ignore[no-any-return]

    def detokenize(self, tokens: Sequence[int]) -> _Plan[str]:
        return (yield from self._post_field("/detokenize", {"tokens": list(tokens)}, "content", str))  # type: ignore[no-any-return]

    def apply_template(self, messages: Sequence[Dict[str, Any]], params: Dict[str, Any]) -> _Plan[str]:
        return (yield from self._post_field("/apply-template", dict(params, messages=messages), "prompt", str))  # type: ignore[no-any-return]

    def count_tokens(self, messages: Sequence[Dict[str, Any]], params: Dict[str, Any]) -> _Plan[int]:
        body = dict(params, messages=messages)
        return (yield from self._post_field("/v1/chat/completions/input_tokens", body, "input_tokens", int))  # type: ignore[no-any-return]

    def embed(self, input: Union[str, Sequence[str]], params: Dict[str, Any]) -> _Plan[List[List[float]]]:
        data = yield from self._post_field("/v1/embeddings", dict(params, input=input), "data", list)
        if not all(
            isinstance(d, dict) and isinstance(d.get("embedding"), list) and type(d.get("index", 0)) is int
            for d in data
        ):
            raise ProtocolError("POST /v1/embeddings answered an entry without an embedding or an integer index")
        return [d["embedding"] for d in sorted(data, key=lambda d: d.get("index", 0))]

    def rerank(self, query: str, documents: Sequence[str], params: Dict[str, Any]) -> _Plan[List[Dict[str, Any]]]:
        body = dict(params, query=query, documents=list(documents))
        return (yield from self._post_field("/v1/rerank", body, "results", list))  # type: ignore[no-any-return]

    def slot_action(self, slot: int, action: str, body: Dict[str, Any]) -> _Plan[Dict[str, Any]]:
        return (yield from self._object("POST", "/slots/%d" % _slot_id(slot), body, {"action": action}))

    def metrics(self) -> _Plan[str]:
        head, data = yield from self._call("GET", "/metrics")
        if head.status != 200:
            raise _status_error(head, data)
        return data.decode("utf-8", "replace")

    def count_message_tokens(self, messages: Sequence[Dict[str, Any]], params: Dict[str, Any]) -> _Plan[int]:
        body = _messages_body(messages, params)
        del body["stream"]
        return (yield from self._post_field("/v1/messages/count_tokens", body, "input_tokens", int))  # type: ignore[no-any-return]

    def count_response_tokens(self, input: Any, params: Dict[str, Any]) -> _Plan[int]:
        body = _responses_body(input, params)
        del body["stream"]
        return (yield from self._post_field("/v1/responses/input_tokens", body, "input_tokens", int))  # type: ignore[no-any-return]

    def replay_request(self, conversation: str, offset: int) -> bytes:
        """The read of a resumable stream's buffer from ``offset`` (``GET /v1/stream``), with its id and the
        session key as headers too, so that a front that routes by either reaches the server holding it."""
        query = {"conv_id": conversation, "from": offset}
        return self.encode("GET", "/v1/stream", None, "text/event-stream", query, extra=_pin(conversation))

    def lookup_streams(self, conversation_ids: Sequence[str], session: Optional[str] = None) -> _Plan[List[Any]]:
        if isinstance(conversation_ids, str) or not all(isinstance(c, str) for c in conversation_ids):
            raise TypeError("conversation_ids must be a list of str")
        body = {"conversation_ids": list(conversation_ids)}
        pin = _pin(body["conversation_ids"][0]) if len(body["conversation_ids"]) == 1 else []
        extra = pin + _session_header(_session_key(session))
        doc = yield from self.call_json("POST", "/v1/streams/lookup", body, model=None, extra=extra)
        if not isinstance(doc, list):
            raise ProtocolError("POST /v1/streams/lookup did not answer a JSON list")
        return doc

    def delete_stream(
        self, conversation_id: str, timeout: Optional[float] = None, session: Optional[str] = None
    ) -> _Plan[bool]:
        if not isinstance(conversation_id, str):
            raise TypeError("conversation_id must be a str")
        extra = _pin(conversation_id) + _session_header(_session_key(session))
        head, data = yield from self._call(
            "DELETE", "/v1/stream", None, {"conv_id": conversation_id}, model=None, timeout=timeout, extra=extra
        )
        if head.status == 404:
            return False
        if not 200 <= head.status < 300:
            raise _status_error(head, data)
        return True

    def lora_adapters(self) -> _Plan[List[Any]]:
        doc = yield from self.call_json("GET", "/lora-adapters")
        if not isinstance(doc, list):
            raise ProtocolError("GET /lora-adapters did not answer a JSON list")
        return doc

    def set_lora_adapters(self, adapters: Sequence[Dict[str, Any]]) -> _Plan[Any]:
        if not isinstance(adapters, (str, bytes, dict)):
            adapters = list(adapters)  # once: an iterator checked first would then send []
        if not isinstance(adapters, list) or not all(isinstance(a, dict) for a in adapters):
            raise TypeError('adapters must be a list of {"id": int, "scale": float} dicts')
        return (yield from self.call_json("POST", "/lora-adapters", adapters))


class _Streams:
    """The streamed requests, built and checked when their streams are made (``stream*``, ``resume()``,
    ``watch_models()``): each a ``_StreamRequest`` that its ``_StreamLife`` sends and reads."""

    def __init__(self, calls: _Calls) -> None:
        self.calls = calls

    def stream_request(
        self, endpoint: str, args: Tuple[Any, ...], params: Dict[str, Any], slot: Optional[int]
    ) -> _StreamRequest:
        """A streamed request of ``endpoint`` (a row of ``_ENDPOINTS``), built and checked as the public calls document:
        the row's body of ``args`` and ``params``, then ``id_slot``, the thinking cap, the session key, the model and
        the slot check."""
        row = _ENDPOINTS[endpoint]
        if "timeout" in params:
            raise TypeError(
                "timeout= is for single-shot calls: a stream has no total deadline, only Limits.liveness "
                "(a body field named timeout goes in stream_route()'s body)"
            )
        raw_chunks = bool(params.pop("raw_chunks", False))
        conversation = _conversation_id(params.pop("resumable", None))
        headers = params.pop("headers", None)
        given = _session_key(params.pop("session", None))
        method, path = row.target(*args)
        body = row.body(*args, params)
        if slot is not None:
            body = _with_slot(body, slot)
        if self.calls.limits.thinking_cap is not None:
            _cap_rule(row, body)
        query = None  # type: Optional[Dict[str, Any]]
        calls = self.calls.at(headers, given)  # the call's own key: session=, else an X-Session-Id header
        if calls.session is None and calls.limits.session:  # neither the call nor the client gave one
            calls = calls.at(None, _session_digest(row.head(body)))
        if row.routed:
            body, query = calls.route(method, body, None, _NO_MODEL, path)
        model = body.get("model") if isinstance(body, dict) else (query or {}).get("model")
        model = model if isinstance(model, str) else None
        if slot is not None:
            calls.check_slot(slot, model)
        request = calls.encode(method, path, body, "text/event-stream", query, extra=_pin(conversation))
        return _StreamRequest(calls, request, slot, model, raw_chunks, row.dialect, conversation)

    def watch_request(self, model: Optional[str], headers: Optional[Dict[str, str]] = None) -> _StreamRequest:
        """``Client.watch_models()``: the router's model events, those of ``model`` only when given."""
        if model is not None and not isinstance(model, str):
            raise TypeError("model must be a str or None, not %r" % (model,))
        row = _ENDPOINTS["models"]
        calls = self.calls.at(headers)
        request = calls.encode("GET", row.path, None, "text/event-stream")
        req = _StreamRequest(calls, request, None, None, False, row.dialect)
        req.watch, req.only = True, model
        return req

    def resume_request(
        self,
        conversation_id: str,
        endpoint: str,
        offset: int,
        model: Optional[str],
        raw_chunks: bool,
        headers: Optional[Dict[str, str]] = None,
        session: Optional[str] = None,
    ) -> _StreamRequest:
        """``Client.resume()``: read the server's buffer of a resumable stream from ``offset``, with the
        session key ``session`` (else the client's): the one the stream was started with reaches its server."""
        session = _session_key(session)
        if not isinstance(conversation_id, str):
            raise TypeError("conversation_id must be the id of a resumable stream (a str)")
        conversation = _conversation_id(conversation_id)
        assert conversation is not None
        if endpoint not in _ENDPOINTS or not _ENDPOINTS[endpoint].resumable:
            others = sorted(n for n, row in _ENDPOINTS.items() if n != "chat" and row.resumable)
            raise ValueError("endpoint must be 'chat' or one of %s, not %r" % (", ".join(others), endpoint))
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError("offset must be an int >= 0 (0, or a value of stream.offset), not %r" % (offset,))
        name = self.calls.model if model is None else model
        calls = self.calls.at(headers, session)
        request = calls.replay_request(conversation, offset)
        dialect = _ENDPOINTS[endpoint].dialect
        return _StreamRequest(calls, request, None, name, raw_chunks, dialect, conversation, offset)


def _cap_rule(row: _Endpoint, body: Any) -> None:
    """Apply ``Limits.thinking_cap`` to a request of ``row``: ``reasoning_control`` in the body where the
    server ends reasoning on request; ``ValueError`` where it cannot, or with ``n`` > 1."""
    if row.cap == _CAP_NEVER:
        raise ValueError(
            "Limits.thinking_cap cannot work on %s: the server does not end reasoning there on request "
            "(use the server's own budget, thinking_budget_tokens)" % row.path
        )
    if row.cap == _CAP_CONTROL:
        n = body.get("n", 1)
        if isinstance(n, int) and n > 1:
            raise ValueError("a thinking cap ends reasoning per completion: it cannot be used with n > 1")
        body["reasoning_control"] = True


def _queued(gate: _Gate, ticket: _Ticket, poll: float) -> _Plan[None]:
    """Wait in the queue until ``ticket`` is granted (a hand-over signals the waker); every ``poll``, on its own timer,
    announce a smaller place (``Queued``: coalesced, never repeated or raised).  A ticket that entered before its pool's
    size was known is silent until ``_Gate.resize`` judges it."""
    told = 0
    due = _clock()
    while True:
        if ticket.refused is not None:
            raise ticket.refused
        if ticket.ahead and not told:
            told = ticket.ahead
            yield [Queued(told)]
            due = _clock() + poll
        yield (_PARK, max(due - _clock(), 0.0) if told else poll)
        if ticket.granted:  # set once, under the gate's lock, before the waker is signalled
            return
        if told and _clock() >= due:
            ahead = gate.position(ticket)
            if ahead is None:
                return
            if ahead < ticket.ahead:
                ticket.ahead = ahead
                yield [Queued(ahead)]
            # counted from now, after the caller took the announcement: from before it, a caller slower than
            # poll (thousands of threads on two cores) would find its timer run out and spin on Queued
            due = _clock() + poll


class _StreamLife:
    """The life of one streamed request, all of it, on the ``_Run`` that drives its ``Stream``: ``plan()``
    takes its place in the gate, then runs the named states of dev/DESIGN.md's table (``_send``, ``_read``,
    ``_on_retry``, ``_back_off``, ``_on_silence``, ``_on_lost``, ``_reattach``), each a plan that returns
    the next one (``None``: the ``Completion`` is in ``result``); ``watch()`` is a watch's plan.  What the
    states share is on the object, not in locals.  The requests it makes for itself alone (the lookup, the
    replay, the ``DELETE``, the control endpoint) carry the call's headers and session key (``req.calls``);
    those its client's requests share (``/props``, the ``/slots`` poll) the client's (``board.calls``)."""

    __slots__ = (
        "board", "limits", "run", "req", "pump", "conn", "waits", "sending", "reattaching", "retry", "loss",
        "started", "queued", "heard", "progress", "reattaches", "moving", "silence_tried", "misses", "result",
    )  # fmt: skip

    def __init__(self, board: _Board, run: _Run, req: _StreamRequest) -> None:
        self.board, self.limits, self.run, self.req = board, board.limits, run, req
        self.conn = None  # type: Any  # the connection being read: the request's, or a reattached one
        self.retry = None  # type: Optional[_Retry]  # why the last attempt or reattach failed
        self.loss = None  # type: Optional[StreamClosedError]  # how the connection was lost
        self.started = 0.0  # when the first byte came (0: none yet, the head is awaited)
        self.queued = False  # a reattach of a stream of which nothing came: the first body byte is awaited
        self.heard = self.progress = 0.0  # the last byte; the last data event
        self.reattaches = 0  # reattaches begun: each is a Resumed(..., attempt)
        self.moving = True  # data came since the last reattach: a new loss starts without backoff
        self.silence_tried = False  # a silence of liveness was already tried as a lost connection
        self.misses = 0  # servers > 1: resumes answered 404 in a row (another server may have answered)
        self.result = None  # type: Optional[Completion]

    def _ready(self) -> None:
        """What the request's attempts need, made once it may send (past the gate): a request waiting in a
        queue keeps only its place (thousands may wait), not a pump, budgets and backoffs it cannot use yet."""
        req = self.req
        self.pump = self._new_pump()
        self.waits = _Waits(self.limits, req.slot, self.board.calls.addr)  # the budgets of the wait for data
        self.sending = _Backoff()  # the attempts' backoff (Retrying.attempt counts them)
        self.reattaching = _Backoff()  # the reattaches' backoff, numbered on its own

    @property
    def offset(self) -> int:
        """The stream's body bytes whose events the plan has yielded, all of them (``Stream.offset``): where
        the last event block the pump read ended (before the gate let it send: where it starts)."""
        pump = getattr(self, "pump", None)  # (a slot that is not set yet)
        return (self.req.offset or 0) if pump is None else pump.boundary

    def _new_pump(self) -> ResponsePump:
        """The pump of an attempt; ``resume()``'s reads the body on from its offset."""
        req = self.req
        pump = ResponsePump(self.limits, req.raw_chunks, req.dialect)
        if req.offset is not None:
            pump.resume(req.offset)
        return pump

    def plan(self) -> _Plan[Completion]:
        """The request's place in the gate (``resume()`` takes none), then its states: the ``Completion``.  Whatever
        ends it, it closes its connection, deletes a resumable stream that ended early and releases its permit before
        the result or the error leaves."""
        board, run, req = self.board, self.run, self.req
        try:
            board.add(run)
            if req.offset is None:  # the gate (a plain call, not a plan: a waiter keeps one frame less)
                capacity = 1 if req.slot is not None else (yield from self._capacity())
                ticket = self._enter(capacity)
                if not ticket.granted:
                    yield from _queued(board.gate, ticket, self.limits.poll)
            self._ready()
            step = self._send  # type: Optional[Callable[[], _Plan[Any]]]
            while step is not None:
                step = yield from step()
            assert self.result is not None
            return self.result
        except GeneratorExit:
            raise
        except BaseException as exc:
            self._use(None)
            if req.conversation is not None:
                yield from self._forget()
            if isinstance(exc, LoopError) and run.cancelled and type(exc) is not BusyError:
                raise _cancelled() from None  # what the cancel caused (a refusal is the gate's own answer)
            raise
        finally:
            run.close_all()
            if run.ticket is not None:
                board.gate.leave(run.ticket)
            board.discard(run)

    def watch(self) -> _Plan[None]:
        """A watch (``GET /models/sse``): one connection, read until cancelled or closed by the server
        (``StreamClosedError``); no permit, never sent again, no liveness (silence is its normal state)."""
        self._ready()
        board, run, req, pump, only = self.board, self.run, self.req, self.pump, self.req.only
        board.add(run)
        try:
            if (yield from self._open(req.request)) is None:
                assert self.retry is not None
                cause = self.retry.cause
                raise _connect_error(req.calls.addr, cause) from cause  # type: ignore[arg-type]
            while True:
                try:
                    data = yield (_RECV, self.conn, max(self.limits.liveness, 0.1))
                except _Silence:
                    continue  # nothing happened: the route's normal state
                events = pump.feed(data) if data else pump.feed_eof()
                if only is not None:
                    events = [e for e in events if type(e) is not ModelEvent or e.model in (only, "*")]
                if events:
                    yield events
                verdict = pump.verdict()
                if isinstance(verdict, LoopError):
                    raise verdict
                if isinstance(verdict, _Retry):  # a 503 or 429: the watch is not sent again
                    raise verdict.cause
                assert verdict is None  # no thinking cap, and the dialect never completes (its end is an error)
        finally:
            run.close_all()
            board.discard(run)

    def _use(self, conn: Any) -> None:
        """Read ``conn`` from now on; the connection read so far is closed."""
        if self.conn is not None:
            self.conn.close()
        self.conn = conn

    def _open(self, request: bytes) -> _Plan[Optional[float]]:
        """Connect (a connection of the request's own: closing it cancels the request) and send ``request``: when it was
        sent, or None when the server could not be reached (``retry`` says why)."""
        try:
            conn = yield (_CONNECT, max(self.limits.poll, 0.2), False)
        except OSError as exc:
            self.retry = _cannot_connect(exc)
            return None
        self._use(conn)
        sent = _clock()
        yield (_SEND, conn, request, self.limits.liveness)
        return sent

    # -- its place in the gate ---------------------------------------------------------------------------

    def _enter(self, capacity: Optional[int]) -> _Ticket:
        """The request's place in the gate: a permit at once, or a place in the queue (which ``_queued``
        waits out).  A pinned slot holds one request; a ``slot=None`` pool ``capacity`` (``_capacity``)."""
        run, req = self.run, self.req
        if run.cancelled:  # cancelled on its way to the gate: it does not enter it
            raise _cancelled()
        ticket = run.ticket = self.board.gate.enter((req.model, req.slot), capacity, run)
        return ticket

    def _capacity(self) -> _Plan[Optional[int]]:
        """The ``slot=None`` pool's size as known now: ``Limits.pool``, else what ``/props`` said (``total_slots`` times
        ``Limits.servers``; ``POOL_GUESS`` without it), else None, after starting the one ``/props`` in the background
        (``_ask_pool``) when nobody asks: a router answers it only once the model loaded, and the request must not wait
        for it to reach the server."""
        board, model = self.board, self.req.model
        if self.limits.pool is not None:
            return self.limits.pool
        with board.lock:
            known = board.pools.get(model)
            if known is not None:
                return known
            asking = model not in board.asking
            board.asking.add(model)
        if asking:
            yield (_SPAWN, self._ask_pool())
        return None

    def _ask_pool(self) -> _Plan[None]:
        """``_capacity``'s ``/props``, in the background: it resizes the gate (no answer: a pool of one)."""
        board, model = self.board, self.req.model
        total = None
        try:
            total = _total_slots((yield from board.calls.call_json("GET", "/props", model=model)))
            board.calls.learn_slots(model, total)
            total = POOL_GUESS if total is None else total * self.limits.servers
        except Exception:  # no answer, whatever the failure: nobody waits for it, as for the /slots poll
            pass
        finally:
            with board.lock:
                board.asking.discard(model)
                if total is not None:
                    board.pools[model] = total
            board.gate.resize((model, None), total)

    # -- the states ----------------------------------------------------------------------------------------

    def _send(self) -> _Plan[Any]:
        sent = yield from self._open(self.req.request)
        if sent is None:
            return self._back_off
        self.waits.sent_at = sent
        self.started = 0.0
        self.queued = False
        self.heard = self.progress = _clock()
        return self._read

    def _back_off(self) -> _Plan[Any]:
        self._use(None)
        assert self.retry is not None
        event = self.sending.next(self.waits, self.retry)
        yield [event]
        yield (_SLEEP, event.delay)
        self.pump = self._new_pump()
        return self._send

    def _read(self) -> _Plan[Any]:
        """Read until the pump decides (``_decide``), handing out each read's events; the first byte starts the clocks
        (``started``; a replay's, the first body byte), a data event is ``progress``.  After a 200 head, ``poll``
        without a data event is the quiet rule's (``_check_quiet``)."""
        limits, pump = self.limits, self.pump
        while True:
            now = _clock()
            head = pump.head
            if self.started and head is not None and head.status == 200 and now - self.progress >= limits.poll:
                yield from self._check_quiet(now - self.progress, self.heard > self.progress)
            try:
                timeout = _read_timeout(limits, self.waits, head, self.started, self.heard, now)
                data = yield (_RECV, self.conn, timeout)
                heard = self.heard = _clock()
                if not self.started and data and not self.queued:  # an end of file at once is no byte
                    self.started = self.progress = heard
                events = pump.feed(data) if data else pump.feed_eof()
            except _Silence:
                step = yield from self._on_silence()
                if step is None:
                    continue
                return step
            except StreamClosedError as exc:
                self.loss = exc
                return self._on_lost
            self._took(heard, head)
            if events:
                yield events
            verdict = pump.verdict()
            if verdict is not None:
                return (yield from self._decide(verdict))

    def _took(self, heard: float, head: Optional[ResponseHead]) -> None:
        """The clocks after a read of bytes at ``heard``; a new head may name its server (``_answered_by``)."""
        pump = self.pump
        if head is None and pump.head is not None:
            self._answered_by(pump.head)
        if self.queued and pump.received:  # the replay's head came at once; now the slot took it
            self.queued = False
            self.started = self.progress = heard
        if pump.progressed:
            self.progress = heard
            if not self.moving:  # data came after a reattach: a later loss is a new one
                self.moving, self.silence_tried, self.misses = True, False, 0

    def _answered_by(self, head: ResponseHead) -> None:
        """A front that names the server that answered (``X-Llama-Server``) gets the stream's own requests (lookup,
        replay, ``DELETE``, control) with that name from now on, so they reach that server.  (A head with NUL, CR or LF
        is refused whole: the value can be sent back as it is.)"""
        name = head.get(_SERVER_HEADER)
        if name:
            self.req.calls = self.req.calls.at({_SERVER_HEADER: name})

    def _decide(self, verdict: Any) -> _Plan[Any]:
        """What the pump decided, after the events before it were handed out: the next state."""
        if verdict is _CAP_DUE:
            verdict = yield from self._at_the_cap()
        if verdict is None:
            return self._read
        if isinstance(verdict, Completion):
            self.result = verdict
            return None
        if isinstance(verdict, StreamClosedError):
            self.loss = verdict
            return self._on_lost
        if isinstance(verdict, LoopError):
            raise verdict
        self.retry = verdict
        return self._on_retry

    def _at_the_cap(self) -> _Plan[Any]:
        """Reasoning reached the thinking cap: ask the server to end it, hand out the events the answer
        releases; the pump's next verdict (a ``StreamClosedError`` for a connection lost meanwhile)."""
        pump = self.pump
        verdict = _CAP_DUE  # type: Any
        while verdict is _CAP_DUE:
            assert pump.cap_due is not None
            ok = yield from self._end_reasoning(*pump.cap_due)
            try:
                events = pump.capped(ok)
            except StreamClosedError as exc:
                return exc
            if events:
                yield events
            verdict = pump.verdict()
        return verdict

    def _on_retry(self) -> _Plan[Any]:
        """The answer says "try again" (``retry``: a 503, a 429, a front's 502 or 504...): back off and send
        again, or, for a resumable stream, read the server's buffer instead where the server holds it."""
        verdict, req = self.retry, self.req
        assert verdict is not None
        if verdict.state == FRONT and req.conversation is not None:
            # a front gave up on a request queued for a slot (or on its silent replay): the server keeps a
            # resumable one queued, so it is read from the server's buffer instead of being sent again; a
            # lookup that got no answer (a front's 504 to it, on a slow server) is no "unknown": the buffer
            # is asked, after a backoff
            known = yield from self._known()
            if known is False:
                return self._not_known(_unknown_stream("the lookup after: %s" % verdict.reason), verdict)
            if not self.pump.received:
                self.started = 0.0  # the front's answer was no byte of the stream
            self.moving = bool(known)  # the front waited its own timeout: no backoff before asking again
            return self._reattach
        if req.conversation is not None and self.reattaches:
            self.moving = False  # a replay answered 503, 502...: its buffer is asked again, after a backoff
            return self._reattach
        return self._back_off

    def _on_silence(self) -> _Plan[Any]:
        """A read timed out: poll for the head (None: read on), or judge the silence of a started stream
        (liveness: ``StalledError``, or for a resumable stream, once, a lost connection)."""
        if not self.started:
            yield from self._poll_for_head()
            return None
        stalled = _stalled(self.limits, self.pump.head, self.heard)
        if stalled is None:
            return None
        if self.req.conversation is None or self.silence_tried:
            raise stalled from None
        self.silence_tried = True  # tried once as a lost connection
        self.loss = StreamClosedError(str(stalled))
        self.loss._hint = stalled._hint  # (its message ends with it)
        return self._on_lost

    def _not_known(self, loss: StreamClosedError, retry: Optional[_Retry] = None) -> Callable[[], _Plan[Any]]:
        """A resumable stream its server no longer knows (a replay's 404, a lookup without it): when nothing of it came,
        dropped before it started, so sent again (``Retrying`` says ``retry``'s reason); else lost: ``loss``."""
        if self.pump.received or self.req.offset is not None:
            raise loss
        self.retry = retry or _Retry(_DROPPED, None, loss, FRONT)
        return self._back_off

    def _on_unknown(self, loss: StreamClosedError) -> Callable[[], _Plan[Any]]:
        """A replay answered "not known": another server at once (``Limits.servers``), else ``_not_known``."""
        if self.misses + 1 < self.limits.servers:
            self.misses += 1
            self.retry = _Retry(str(loss), None, loss)
            self.moving = True
            return self._reattach
        return self._not_known(loss)

    def _on_lost(self) -> _Plan[Any]:
        req, pump, loss = self.req, self.pump, self.loss
        assert loss is not None
        if req.conversation is None:
            raise _hinted(loss, _CUT % ("in the middle of the answer" if pump.head else "before answering"))
        if pump.unknown:
            return self._on_unknown(loss)
        if not (pump.streaming or pump.head is None):
            raise loss
        self._use(None)
        if self.queued:  # a front that closes a silent stream (the request still waits for a slot)
            self.retry = _Retry("the front closed the stream while it waited for a slot: %s" % loss, None, loss, FRONT)
        before_head = pump.head is None and pump.received == 0 and req.offset is None and not self.started
        # lost before any byte of the head: does the server know the stream? (no answer: its buffer is asked)
        if before_head and not self.reattaches and (yield from self._known()) is False:
            self.retry = _Retry("the connection closed before the head", None, StreamClosedError("lost"))
            return self._back_off
        if self.moving and (self.started or pump.received):  # a loss after data: budgets afresh
            self.waits = _Waits(self.limits, req.slot, self.board.calls.addr)
            self.reattaching.delay = BACKOFF_FIRST
        return self._reattach

    def _reattach(self) -> _Plan[Any]:
        pump, req = self.pump, self.req
        self._use(None)
        if not self.moving:  # the last reattach failed before any data came: back off first
            assert self.retry is not None
            event = self.reattaching.next(self.waits, self.retry)
            yield [event]
            yield (_SLEEP, event.delay)
        self.reattaches += 1
        self.moving = False
        offset = pump.received
        assert req.conversation is not None
        try:
            sent = yield from self._open(req.calls.replay_request(req.conversation, offset))
        except StreamClosedError as exc:
            self.retry = _Retry("the server closed the connection: %s" % exc, None, exc)
            return self._reattach
        if sent is None:
            return self._reattach
        pump.resume(offset)
        self.retry = _Retry("the resumed stream was lost again", None, StreamClosedError("lost"))
        yield [Resumed(offset, self.reattaches)]
        now = _clock()
        self.heard = self.progress = now
        # a stream of which nothing came yet is still queued for a slot: its silence is a wait for the head
        self.queued = not offset and not self.started
        self.started = 0.0 if self.queued else now
        return self._read

    # -- what the states ask of the server -----------------------------------------------------------------

    def _known(self) -> _Plan[Optional[bool]]:
        """Whether the server knows this resumable stream (``/v1/streams/lookup``): True, False, or None when no lookup
        got the server's own answer (a front's 504, a timeout: a slow server has not forgotten it).  Asked up to
        ``Limits.servers`` times (another server may have answered)."""
        conversation = self.req.conversation
        assert conversation is not None
        answered = False
        for _ in range(self.limits.servers):
            try:
                found = yield from self.req.calls.lookup_streams([conversation])
            except CancelledError:
                raise
            except HTTPStatusError as exc:
                answered = answered or exc.status == 404
                continue
            except LoopError:
                continue
            answered = True
            if any(isinstance(e, dict) and e.get("conversation_id") == conversation for e in found):
                return True
        return False if answered else None

    def _forget(self) -> _Plan[None]:
        """``DELETE`` a resumable stream that ends early (with an id the server does not stop when the connection
        closes): one attempt of at most ``FORGET_WAIT``, ``shield``-ed from the cancel; failures ignored."""
        run, req = self.run, self.req
        assert req.conversation is not None
        run.shield = True
        try:
            yield from req.calls.delete_stream(req.conversation, FORGET_WAIT)
        except LoopError:
            pass
        finally:
            run.shield = False

    def _end_reasoning(self, completion_id: Optional[str], tokens: int) -> _Plan[bool]:
        """Ask the server to end the stream's reasoning (a front routing by its headers or session key
        reaches the server running it); a failure is ``ThinkingOverrunError`` (unless cancelled)."""
        assert completion_id is not None
        try:
            return (yield from self.req.calls.control(self.req.model, completion_id))
        except LoopError as exc:
            if self.run.cancelled:
                raise
            raise _cap_failed(tokens, exc) from exc

    def _poll_for_head(self) -> _Plan[None]:
        """Nothing has arrived for ``poll``: ask ``/slots`` what the slot is doing, and tell the caller."""
        waits = self.waits
        waits.check()
        left = waits.remaining()
        state, wedged = yield from self._slot_state(True, None if left is None else _clock() + left)
        if state is None:  # its budget ran out while the answer was awaited: the state it had lasted it
            raise waits.expired()
        if wedged is not None:
            yield [Waiting(True, wedged=True)]
            raise wedged
        waits.observe(state)
        yield [Waiting(state == BUSY, slots_known=state not in _UNSEEN)]
        waits.check()

    def _check_quiet(self, quiet: float, pinged: bool) -> _Plan[None]:
        """No data event for ``quiet`` seconds: a wedged slot is an error at once (with ``slot=None``, once ``quiet``
        reaches ``wedge_wait``); after ``liveness`` of pings only, only a slot still processing is waited out, up to
        ``busy_wait`` from the last data event."""
        wedge, pings = _quiet_rule(self.limits, self.req.slot, quiet, pinged)
        if wedge or pings:
            state, wedged = yield from self._slot_state(False)
            assert state is not None  # (no until: never cut short)
            _judge_quiet(self.limits, state, wedged, wedge, pings, quiet)

    def _slot_state(
        self, every: bool, until: Optional[float] = None
    ) -> _Plan[Tuple[Optional[str], Optional[WedgedSlotError]]]:
        """The request's slot's state (None: the pool) from the board's poller, and the error when it is wedged
        (``every``: as ``_SlotReader.state``).  An answer younger than ``poll`` is reused; else the first asker sends
        one (``_poll_slots``) and all wait for it up to ``_slots_timeout`` (llama-server answers between batches of its
        work: late is not unavailable).  ``until``: the caller's budget; no answer by then is ``(None, None)``."""
        run, req, limits = self.run, self.req, self.limits
        poller = self.board.poller(req.model)
        asked = _clock()
        late = False  # no answer came within the /slots request's timeout of asking
        if not poller.fresh(asked):
            if poller.start():
                yield (_SPAWN, self._poll_slots(poller))
            deadline = asked + _slots_timeout(limits)
            if until is not None:
                deadline = min(deadline, until)
            poller.wait(run, True)
            try:
                while poller.stamp < asked:
                    left = deadline - _clock()
                    if left <= 0:
                        break
                    yield (_PARK, left)
            finally:
                poller.wait(run, False)
            late = poller.stamp < asked
            if late and until is not None and _clock() >= until:
                return None, None
        if poller.unseen and not late:
            return UNSEEN, None
        if limits.servers > 1 or poller.several:
            # The answer may be another server's, and a failed (or late) /slots only that the front could not
            # reach the one it chose, while the request itself is in flight: nothing to judge the slot by.
            return SEVERAL, None
        return poller.state(None if late else poller.slots, req.slot, every, self.board.calls.address)

    def _poll_slots(self, poller: _SlotPoller) -> _Plan[None]:
        """The shared ``/slots`` request, in the background: 404, 403, 405 and 501 say it is not served (a
        proxy in front, llama-swap, ``--no-slots``); any other failure means "unavailable"."""
        calls, model, limits = self.board.calls, self.req.model, self.limits
        slots = None  # type: Optional[List[Slot]]
        unseen = False
        try:
            timeout = _slots_timeout(limits)
            slots = _slots_from((yield from calls.call_json("GET", "/slots", model=model, timeout=timeout)))
            calls.learn_slots(model, len(slots))
        except HTTPStatusError as exc:
            unseen = exc.status in (403, 404, 405, 501)
        except Exception:
            pass
        finally:
            poller.answered(slots, unseen)


def _check_request(method: Any, path: Any, query: Any) -> None:
    """``request()``'s and ``fetch()``'s arguments: ``TypeError`` for a method or path that is not a str, or
    a query that is not a dict (what they hold is checked as the request is encoded)."""
    if not isinstance(method, str) or not isinstance(path, str):
        raise TypeError("method and path must be str")
    if query is not None and not isinstance(query, dict):
        raise TypeError("query must be a dict, not %s" % type(query).__name__)


def _slot_id(slot: Any, what: str = "an int") -> int:
    """``slot``, checked: ``TypeError`` for what is not an int (or is a bool), ``ValueError`` when negative."""
    if isinstance(slot, bool) or not isinstance(slot, int):
        raise TypeError("slot must be %s, not %r" % (what, slot))
    if slot < 0:
        raise ValueError("slot must not be negative")
    return int(slot)


def _status_error(head: ResponseHead, data: bytes) -> HTTPStatusError:
    """The error for an answer of a status the call does not take, with its body and ``Server`` header."""
    return HTTPStatusError(head.status, parse_error_envelope(data)[0], data, head.get("server"))


def _decode_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8", "replace"))
    except ValueError as exc:
        raise ProtocolError("%s answered invalid JSON: %s" % (what, exc)) from None
    except RecursionError:
        raise ProtocolError("%s answered JSON nested too deeply" % what) from None


# =====================================================================================================
# 9. The drivers: blocking sockets and threads, then asyncio
# =====================================================================================================
#
# A driver performs the operations a plan yields, and nothing else.  Socket errors become the library's
# errors in each driver's connection class, narrowest first.


def _unix_failed(addr: _Address, exc: OSError) -> BaseException:
    """What a failed connect to a socket path is.  A path there that is not a socket, or (while no socket file was
    reached there since the client was made) one whose directory does not exist: ``ConnectError`` at once, never
    retried.  A socket file missing from a directory that is there: ``exc`` (a stream retries it), logged as a WARNING
    the first time when none has been there."""
    import stat

    path = addr.target
    try:
        found = os.stat(path).st_mode
        mode = found  # type: Optional[int]
        what = "a directory" if stat.S_ISDIR(found) else "a regular file" if stat.S_ISREG(found) else "not a socket"
    except NotADirectoryError:
        mode, what = 0, "below a regular file"
    except OSError:
        mode = None
    folder = os.path.dirname(path) or "."
    if mode is not None and not stat.S_ISSOCK(mode):
        text = "%s is %s, not a socket: no llama-server can listen there" % (addr.text, what)
    elif mode is None and not addr.seen and isinstance(exc, FileNotFoundError) and not os.path.isdir(folder):
        text = (
            "no llama-server at %s: its directory %s does not exist, so no server can listen there until "
            "someone makes it" % (addr.text, folder)
        )
    else:
        if mode is not None:
            addr.seen = True  # a socket file: the server is there or was
        elif isinstance(exc, FileNotFoundError) and not addr.seen and not addr.warned:
            addr.warned = True
            log = _logger(_WARNING)
            if log is not None:
                log.warning(
                    "%s: no socket file there (none since the client was made): is llama-server started with "
                    "--host %s? waiting for it",
                    addr.text,
                    path,
                )
        return exc
    err = _hinted(ConnectError(text, addr.text), _START_IT)
    err.__cause__ = exc
    return err


def _final_error(addr: _Address, exc: BaseException) -> None:
    """The error that ends a stream, as the stream raises it: logged (INFO; a cancel at DEBUG)."""
    if not isinstance(exc, LoopError):
        return
    log = _logger(_DEBUG if isinstance(exc, CancelledError) else _INFO)
    if log is not None:
        name = next(c.__name__ for c in type(exc).__mro__ if c.__name__[0] != "_")  # (_Unreachable's public)
        log.log(_DEBUG if isinstance(exc, CancelledError) else _INFO, "%s: %s: %s", addr.text, name, exc)


def _cancel_told(addr: _Address, how: str) -> None:
    """Log (DEBUG) how a stream was cancelled (what the iterating code then hears, ``_final_error`` logs)."""
    log = _logger(_DEBUG)
    if log is not None:
        log.debug("%s: cancelled: %s", addr.text, how)


def _tell(log: Any, addr: _Address, events: List[Any], pool: bool = False) -> None:
    """Log the events that say what a request waits for: a retry, a wait, a resume at INFO, a place in the queue at
    DEBUG (called only while INFO is logged).  ``pool``: a ``slot=None`` request's."""
    for event in events:
        kind = type(event)
        if kind is Retrying:
            log.info("%s: retry %d in %.2f s: %s", addr.text, event.attempt, event.delay, event.reason)
        elif kind is Waiting:
            log.info("%s: waiting for the response: %s", addr.text, _waiting_text(event, pool))
        elif kind is Resumed:
            log.info("%s: connection lost: resumed at byte %d (attempt %d)", addr.text, event.offset, event.attempt)
        elif kind is Queued:
            log.debug("%s: queued: %d ahead in this client", addr.text, event.ahead)


def _waiting_text(event: Waiting, pool: bool) -> str:
    """What a ``Waiting`` says, for a request pinned to a slot or (``pool``) for a ``slot=None`` one."""
    if not event.slots_known:
        return "the %s unknown (the server does not serve /slots)" % ("slots are" if pool else "slot is")
    if event.wedged:
        return "a slot is wedged" if pool else "the slot is wedged"
    if event.slot_busy:
        return "every slot is busy" if pool else "the slot is busy"
    return "a slot is free, no answer yet" if pool else "the slot is not busy, no answer yet"


def _unix_connect(sock: socket.socket, addr: _Address) -> None:
    """Connect ``sock`` to ``addr``'s Unix socket (both drivers: it completes or fails at once, a full listen
    queue with EAGAIN): ``ConnectError`` where no server can listen (``_unix_failed``), else the ``OSError``."""
    try:
        sock.connect(addr.target)
    except OSError as exc:
        told = _unix_failed(addr, exc)
        if told is exc:
            raise
        raise told from exc
    addr.seen = True


class _Conn:
    """One connection with a blocking socket; ``socket.timeout`` (on 3.8 no ``TimeoutError``) caught first."""

    __slots__ = ("sock", "owner", "reused", "_timeout", "_lock", "_closed")

    def __init__(self, owner: _SyncRun) -> None:
        self.sock = None  # type: socket.socket # type: ignore[assignment]  # being connected, then the connection's
        self.owner = owner
        self.reused = False  # handed out again by the board after an answer
        self._timeout = 0.0
        self._lock = threading.Lock()
        self._closed = False

    def open(self, addr: _Address, timeout: float, ssl_context: Any) -> None:
        """Connect: ``OSError`` when the server cannot be reached, ``ConnectError`` when TLS fails.  Each socket is the
        connection's before it connects, so that ``cancel()`` shuts it down; the caller closes the connection when this
        fails."""
        self._timeout = timeout
        if addr.unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._adopt(sock, timeout)
            _unix_connect(sock, addr)
            return
        host, port = addr.target
        failed = OSError("getaddrinfo returns an empty list")  # as socket.create_connection says it
        for family, kind, proto, _, target in self._resolve(host, port, timeout):
            try:  # each address in turn, as socket.create_connection tries them
                self._dial(socket.socket(family, kind, proto), target, timeout)
                break
            except OSError as exc:
                failed = exc
                if self._stopped():
                    raise
        else:
            raise failed
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # pragma: no cover - not every TCP stack has it
            pass
        if addr.tls:
            self._handshake(addr, ssl_context)

    def _resolve(self, host: str, port: int, timeout: float) -> List[Any]:
        """``getaddrinfo`` within the connect's ``timeout``: a host name in a thread of its own, since the
        system's resolver cannot be interrupted (the thread ends when the resolver answers, keeping nothing)."""
        try:
            return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
        except socket.gaierror:
            pass  # a name: look it up
        answer = []  # type: List[Any]
        done = threading.Event()

        def look_up() -> None:
            try:
                answer.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
            except OSError as exc:
                answer.append(exc)
            finally:
                done.set()

        threading.Thread(target=look_up, name="loopclient-resolver", daemon=True).start()
        self._until(done.wait, timeout, "timed out looking up %s" % host)
        if isinstance(answer[0], OSError):
            raise answer[0]
        return answer[0]  # type: ignore[no-any-return]

    def _stopped(self) -> bool:
        """The run was cancelled, and this is not the connection of its shielded last words."""
        owner = self.owner
        return bool(owner.cancelled and not owner.shield)

    def _until(self, ready: Callable[[float], Any], timeout: float, what: str) -> None:
        """Until ``ready(seconds)`` (every 0.1 s): ``CancelledError`` if cancelled, ``socket.timeout(what)`` late."""
        deadline = time.monotonic() + timeout
        while not ready(max(0.0, min(deadline - time.monotonic(), 0.1))):
            if self._stopped():
                raise _cancelled()
            if time.monotonic() >= deadline:
                raise socket.timeout(what)

    def _adopt(self, sock: socket.socket, timeout: float) -> None:
        """Make ``sock`` this connection's before it connects (``cancel()`` shuts it down); or ``CancelledError``."""
        with self._lock:
            old, self.sock = self.sock, sock
        if old is not None:
            old.close()
        sock.settimeout(timeout)
        if self._stopped():  # cancel() before the socket was there to shut down
            raise _cancelled()

    def _dial(self, sock: socket.socket, target: Any, timeout: float) -> None:
        """Connect ``sock`` over TCP (``_adopt``ed first), a cancel seen within 0.1 s."""
        import errno
        import select  # both imported by socket already: no cost

        self._adopt(sock, timeout)
        sock.setblocking(False)
        failed = sock.connect_ex(target)
        if failed == errno.EINPROGRESS:
            waiter = select.poll()
            waiter.register(sock, select.POLLOUT)  # POLLERR and POLLHUP come without asking
            self._until(lambda seconds: waiter.poll(seconds * 1000), timeout, "timed out")
            failed = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        sock.settimeout(timeout)
        if failed:
            raise OSError(failed, os.strerror(failed))

    def _handshake(self, addr: _Address, context: Any) -> None:
        ssl = _import_ssl()
        try:  # the handshake after the wrapped socket is the one cancel() shuts down
            tls = context.wrap_socket(self.sock, server_hostname=addr.target[0], do_handshake_on_connect=False)
            with self._lock:
                self.sock = tls
            tls.do_handshake()
        except ssl.SSLError as exc:  # before OSError: a certificate or handshake failure is not a server down
            raise _tls_failed(addr, exc) from exc

    def _timed(self, timeout: float) -> socket.socket:
        if timeout != self._timeout:
            self.sock.settimeout(timeout)
            self._timeout = timeout
        return self.sock

    def send(self, data: bytes, timeout: float) -> None:
        """Write the request; ``StalledError`` when the server takes none of it for ``timeout``."""
        try:
            self._timed(timeout).sendall(data)
        except socket.timeout:
            raise _send_stalled(timeout) from None
        except OSError as exc:
            raise StreamClosedError("the connection closed while sending the request: %s" % exc) from exc

    def recv(self, timeout: float) -> bytes:
        """The next bytes, ``b""`` at the end; ``_Silence`` after ``timeout``; ``StreamClosedError``."""
        try:
            return self._timed(timeout).recv(RECV_SIZE)
        except socket.timeout:
            raise _Silence() from None
        except OSError as exc:
            raise _connection_failed(exc) from exc

    def abort(self) -> None:
        """From any thread: wake a blocked reader, and the server sees us gone.  Never closes the fd (on
        Linux, closing a socket another thread reads does not wake that thread)."""
        with self._lock:
            if not self._closed and self.sock is not None:
                try:
                    # the plain socket's shutdown: an SSLSocket's own would drop its TLS state under the reader
                    socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """In the thread that uses it; idempotent."""
        self.owner.forget(self)
        with self._lock:
            if not self._closed:
                self._closed = True
                if self.sock is not None:
                    self.sock.close()


def _connected(board: _Board) -> None:
    log = _logger()
    if log:
        log.debug("%s: connected", board.calls.address)


class _SyncRun(_Run):
    """A plan driven in the calling thread with blocking sockets.  ``cancel()``, from any thread, shuts the sockets down
    and signals the run; when no thread drives it, ``cancel()`` ends it itself (sockets, permit)."""

    __slots__ = ("lock", "_bell", "_rung")
    board: _Board

    def __init__(self, board: _Board) -> None:
        _Run.__init__(self, board)
        self.lock = threading.Lock()  # held while a thread drives the plan
        # The waker: a lock held until signal() releases it once, as threading.Condition wakes each of its
        # waiters (a threading.Event would cost a Condition, its lock and a new lock per wait: measured,
        # 4,000 parked streams then spent ten times the CPU of this one lock each).
        self._bell = threading.Lock()
        self._bell.acquire()
        self._rung = False  # signal() released the bell and no park has taken it back yet

    def signal(self) -> None:
        self._ring()

    def _ring(self) -> None:
        """Wake the park in progress, or the next one: the bell, released once (``cancel()`` rings it too)."""
        with self._conns_lock:
            if not self._rung:
                self._rung = True
                self._bell.release()

    def step(self) -> Optional[List[Event]]:
        """Drive the plan to the next events it yields (None: it returned, its value in ``value``), each
        operation performed by this run's method of its name, its result or error sent back into the plan."""
        value = None  # type: Any
        exc = _cancelled() if self.cancelled else None  # type: Optional[BaseException]
        while True:
            op = _advance(self, value, exc)
            if op is _DONE:
                return None
            if type(op) is list:
                return op
            value = exc = None
            try:
                value = getattr(self, op[0])(*op[1:])
            except BaseException as caught:  # noqa: B036 - thrown into the plan, which decides
                exc = caught
            exc = _after(self, exc)

    def connect(self, timeout: float, reuse: bool) -> _Conn:
        """A kept connection (``reuse``), else a new one, registered with the run before it connects."""
        board = self.board
        kept = board.checkout(self) if reuse else None  # type: Optional[_Conn]
        conn = kept or _Conn(self)
        with self._conns_lock:  # before the connect: cancel() wakes it
            self._conns.add(conn)
        if kept is None:
            try:
                conn.open(board.calls.addr, timeout, board.calls.ssl_context)
            except BaseException:
                conn.close()
                raise
            _connected(board)
        return conn

    def park(self, timeout: Optional[float]) -> None:
        """Until signal() (or an earlier one not yet taken), or ``timeout`` (None: no timer)."""
        got = self._bell.acquire(True, -1 if timeout is None else min(timeout, threading.TIMEOUT_MAX))
        with self._conns_lock:
            if self._rung:  # (only signal() releases the bell, and it sets _rung first)
                if not got:  # released just after the timer ran out: take it back now
                    self._bell.acquire(False)
                self._rung = False

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.cancelled and time.monotonic() < deadline:
            self.park(max(deadline - time.monotonic(), 0.0))

    def spawn(self, plan: _Plan[Any]) -> None:
        run = self.child(plan)
        threading.Thread(target=run.background, name="loopclient-background", daemon=True).start()

    def unwind(self) -> None:
        """End a cancelled plan in this thread (last words said, finally run); its ``CancelledError`` stays here."""
        self.cancelled = True
        try:
            while self.step() is not None:
                pass
        except CancelledError:
            pass

    def finish(self) -> Any:
        """Drive a plan that yields no events to its end: its value."""
        with self.lock:
            try:
                while self.step() is not None:
                    pass
            finally:
                self.close_all()
        return self.value

    def background(self) -> None:
        """Drive a background plan (``spawn``) to its end, whatever it raises (nobody hears it)."""
        try:
            self.finish()
        except BaseException:  # noqa: B036 - a background plan has no caller to tell
            pass
        finally:
            self.board.discard(self)

    def cancel(self) -> None:
        self._abort()
        self._ring()
        if self.gen is not None and self.lock.acquire(False):  # nobody drives it: end it here
            try:
                self.unwind()  # sockets closed, a resumable stream deleted, permit released
            finally:
                self.lock.release()


class _Events:
    """What ``Stream`` and ``AsyncStream`` share: the request, its ``_StreamLife``, the batch being handed out."""

    _run: Any

    def _setup(self, req: _StreamRequest) -> None:
        self._req = req
        self._life = None  # type: Optional[_StreamLife]  # made with the run, when the plan is
        self._batch = []  # type: List[Event]  # events produced and not yet handed out, last first
        self._done = False
        self._log = _logger(_INFO)  # the events that say what the request waits for are logged with it
        #: the assembled answer, once iteration ended without an error
        self.completion = None  # type: Optional[Completion]
        #: a resumable stream's id (its ``X-Conversation-Id``), else None
        self.conversation_id = req.conversation
        #: the session key the request carried (its ``X-Session-Id``), else None
        self.session = req.calls.session
        #: the stream's body bytes whose events have all been yielded: ``resume(conversation_id, offset=...)``
        #: from here repeats none of them
        self.offset = req.offset or 0

    def _plan(self, run: _Run) -> None:
        """Give ``run`` the plan of this stream: its request's life (a watch's, for ``watch_models()``)."""
        life = self._life = _StreamLife(run.board, run, self._req)
        run.gen = life.watch() if self._req.watch else life.plan()

    def _hand_out(self, got: Optional[List[Event]], stop: type) -> Event:
        """The batch's first event (the rest handed out next); ``stop`` once the plan ended (``Completion`` kept)."""
        life = self._life
        assert life is not None
        if got is None:
            self._done = True
            self.completion = self._run.value
            self.offset = life.offset
            raise stop
        if self._log is not None:
            _tell(self._log, self._req.calls.addr, got, self._req.slot is None)
        got.reverse()  # a fresh list, never empty: popped from its end
        self._batch = got
        event = got.pop()
        if not got:
            self.offset = life.offset
        return event

    def _ended(self, exc: BaseException) -> None:
        """The stream ends with ``exc``, as it raises it (``_final_error``)."""
        self._done = True
        _final_error(self._req.calls.addr, exc)


class Stream(_Events):
    """One streamed request (``Client.stream()`` and the other ``stream_*`` calls), sent when iteration
    starts: iterate it for events (one thread at a time); ``completion`` is there once iteration ended
    without an error.  Iteration raises the ``LoopError`` subclasses (``CancelledError`` after
    ``cancel()``, which works from any thread); leaving the ``with`` block early cancels quietly."""

    def __init__(self, board: _Board, req: _StreamRequest) -> None:
        self._setup(req)
        self._run = board.run_class(board)
        self._plan(self._run)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Event:
        batch = self._batch
        run = self._run
        if batch and not run.cancelled:  # a read yields all the events it completed
            # without the lock: only the iterating thread touches the batch, and popping drives nothing
            event = batch.pop()
            if not batch:
                self.offset = self._life.offset  # type: ignore[union-attr]
            return event
        with run.lock:
            if self._done:
                raise StopIteration
            try:
                if run.cancelled:
                    run.unwind()
                    raise _cancelled()
                got = run.step()
            except BaseException as exc:
                self._ended(exc)
                raise
            return self._hand_out(got, StopIteration)

    def cancel(self) -> None:
        """Cancel the request from any thread: its sockets close, its permit is released, and the iterating
        thread gets ``CancelledError`` within 0.2 s; a resumable stream is deleted on the server first (one
        attempt of at most a second), so that the server stops generating."""
        if not self._done:
            if not self._run.cancelled:
                _cancel_told(self._req.calls.addr, "cancel() was called")
            self._run.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self._done:
            run = self._run
            if not run.cancelled:
                _cancel_told(self._req.calls.addr, "the stream was left before its end")
            run.cancel()
            with run.lock:
                self._done = True
                run.unwind()


#: The name of ``Stream`` from the time when chat was the only streamed endpoint.
ChatStream = Stream


class _Configured:
    """What both clients are made of: the configuration (``_Calls``, which makes the single-shot calls), ``_Streams``
    (the streamed requests), and from ``_start`` a ``_Board`` (one per event loop)."""

    def __init__(
        self,
        address: Any = None,
        *,
        limits: Optional[Limits] = None,
        api_key: Optional[str] = None,
        headers: Optional[Dict[str, str]] = None,
        model: Optional[str] = None,
        ssl_context: Any = None,
        session: Optional[str] = None,
    ) -> None:
        calls = self._calls = _Calls(address, limits, api_key, headers, model, ssl_context, session)
        self.address = calls.address  # type: str
        self.limits = calls.limits  # type: Limits
        self.model = calls.model  # type: Optional[str]
        self._streams = _Streams(calls)
        self._start()

    if TYPE_CHECKING:

        def _start(self) -> None: ...


class Client(_Configured):
    """A client of one llama-server, shared by any number of threads.

    ``address``: a socket path, ``unix:///path`` or ``http[s]://host[:port][/prefix]`` (default:
    ``$LLAMA_SERVER``, else ``http://127.0.0.1:8080``); ``limits``: the budgets and caps; ``api_key`` is
    sent as ``Authorization: Bearer``, ``headers`` with every request; ``model``: a router's default model;
    ``ssl_context`` replaces the default verifying one; ``session``: the client's session key (1 to 128
    visible ASCII characters), sent as ``X-Session-Id`` unless a streamed call gives its own (an
    ``X-Session-Id`` in ``headers`` is one too).  What is malformed is ``ValueError``/``TypeError`` here.

    Single-shot calls (all but the streams) are sent once (again on a new connection only when a kept one
    fails before any byte of the answer) and raise ``ConnectError``, ``StalledError`` (silence for
    ``liveness``), ``HTTPStatusError`` (not 200; never for ``fetch()``), ``ProtocolError`` (a malformed
    answer, or over ``max_body``) and ``DeadlineError`` (past ``timeout=``, seconds for the whole call).
    Every call takes ``headers=``, a dict for that call alone (never put in a body), its values winning.
    """

    def _start(self) -> None:
        self._board = _Board(self._calls)

    def __repr__(self) -> str:
        return "<loopclient.Client %s>" % self.address

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Cancel this client's streams in flight and stop its poller.  Any later call is ``ValueError``."""
        self._calls.closed = True
        self._board.close()

    def _run(self, plan: _Plan[_T], timeout: Optional[float] = None) -> _T:
        """Drive a single-shot call's plan to its value, within ``timeout`` seconds when given."""
        seconds = _check_timeout(timeout)
        run = self._board.run_class(self._board)
        run.gen = plan if seconds is None else _within(plan, seconds, self.address)
        return run.finish()  # type: ignore[no-any-return]

    def stream(self, messages: Sequence[Dict[str, Any]], slot: Optional[int] = None, **params: Any) -> Stream:
        """A ``Stream`` of the chat ``messages``; the keywords go into the JSON body as they are, beside ``stream``,
        ``id_slot`` (``slot``), ``reasoning_control`` (``Limits.thinking_cap``) and ``model``.  Every streamed call also
        takes ``raw_chunks=True`` (a ``Chunk`` per data event too), ``resumable=True`` or an id, and ``session`` (else
        the client's, else a digest of the messages: ``stream.session``); what is malformed is
        ``TypeError``/``ValueError`` here."""
        return Stream(self._board, self._streams.stream_request("chat", (messages,), params, slot))

    def chat(
        self,
        messages: Sequence[Dict[str, Any]],
        slot: Optional[int] = None,
        on_event: Optional[Callable[[Event], Any]] = None,
        **params: Any,
    ) -> Completion:
        """``stream()`` iterated to its ``Completion``, calling ``on_event`` in this thread for each event; an exception
        from ``on_event`` (or Ctrl-C) closes the request and propagates unchanged."""
        return _consume(self.stream(messages, slot=slot, **params), on_event)

    def stream_complete(self, prompt: Any, slot: Optional[int] = None, **params: Any) -> Stream:
        """A ``Stream`` of ``POST /completion``: ``prompt`` a string, token ids, a mixed list, or a list of
        prompts (one choice each); keywords go into the body (``n_predict``, ``n_probs``, ``lora``, ...).
        ``content`` is ``Content(text, choice=index)``, ``completion_probabilities`` the choice's
        ``logprobs``, ``tokens`` its ``tokens``; every choice's ``stop: true`` chunk ends it (``final``)."""
        return Stream(self._board, self._streams.stream_request("complete", (prompt,), params, slot))

    def complete(
        self, prompt: Any, slot: Optional[int] = None, on_event: Optional[Callable[[Event], Any]] = None, **params: Any
    ) -> Completion:
        """``stream_complete()`` iterated to its ``Completion``, calling ``on_event`` for each event."""
        return _consume(self.stream_complete(prompt, slot=slot, **params), on_event)

    def stream_complete_openai(self, prompt: Any, slot: Optional[int] = None, **params: Any) -> Stream:
        """A ``Stream`` of ``POST /v1/completions`` (OpenAI text completions): ``prompt`` as ``stream_complete()`` takes
        it, keywords into the body; a choice's ``text`` is ``Content(text, choice=index)``; ``[DONE]`` ends it.  The
        server ignores ``echo`` and ``suffix``."""
        return Stream(self._board, self._streams.stream_request("complete_openai", (prompt,), params, slot))

    def complete_openai(
        self, prompt: Any, slot: Optional[int] = None, on_event: Optional[Callable[[Event], Any]] = None, **params: Any
    ) -> Completion:
        """``stream_complete_openai()`` iterated to its ``Completion``, calling ``on_event`` for each event."""
        return _consume(self.stream_complete_openai(prompt, slot=slot, **params), on_event)

    def stream_infill(
        self, prefix: str, suffix: str = "", *, extra: Any = None, slot: Optional[int] = None, **params: Any
    ) -> Stream:
        """A ``Stream`` of ``POST /infill`` (fill in the middle), read as ``stream_complete()``: ``prefix`` and
        ``suffix`` go in ``input_prefix`` and ``input_suffix``, ``extra`` (``(filename, text)`` pairs or
        ``{"filename", "text"}`` dicts) in ``input_extra``.  A model without FIM tokens: ``HTTPStatusError`` (501)."""
        return Stream(self._board, self._streams.stream_request("infill", (prefix, suffix, extra), params, slot))

    def infill(
        self,
        prefix: str,
        suffix: str = "",
        *,
        extra: Any = None,
        slot: Optional[int] = None,
        on_event: Optional[Callable[[Event], Any]] = None,
        **params: Any,
    ) -> Completion:
        """``stream_infill()`` iterated to its ``Completion``, calling ``on_event`` for each event."""
        return _consume(self.stream_infill(prefix, suffix, extra=extra, slot=slot, **params), on_event)

    def stream_respond(self, input: Any, slot: Optional[int] = None, **params: Any) -> Stream:
        """A ``Stream`` of ``POST /v1/responses`` (OpenAI Responses) of ``input`` (a string or input items):
        ``Content``, ``Reasoning`` and ``ToolCall`` events, the closing ``response`` as ``Completion.final``.
        A thinking cap cannot work here: ``ValueError``."""
        return Stream(self._board, self._streams.stream_request("respond", (input,), params, slot))

    def respond(
        self, input: Any, slot: Optional[int] = None, on_event: Optional[Callable[[Event], Any]] = None, **params: Any
    ) -> Completion:
        """``stream_respond()`` iterated to its ``Completion``, calling ``on_event`` for each event."""
        return _consume(self.stream_respond(input, slot=slot, **params), on_event)

    def stream_message(self, messages: Sequence[Dict[str, Any]], slot: Optional[int] = None, **params: Any) -> Stream:
        """A ``Stream`` of ``POST /v1/messages`` (Anthropic Messages): ``Content``, ``Reasoning`` and
        ``ToolCall`` (a ``tool_use`` block) events; ``Completion.final`` is the ``message_start`` message
        with the closing stop reason and usage.  A thinking cap cannot work here: ``ValueError``."""
        return Stream(self._board, self._streams.stream_request("message", (messages,), params, slot))

    def message(
        self,
        messages: Sequence[Dict[str, Any]],
        slot: Optional[int] = None,
        on_event: Optional[Callable[[Event], Any]] = None,
        **params: Any,
    ) -> Completion:
        """``stream_message()`` iterated to its ``Completion``, calling ``on_event`` for each event."""
        return _consume(self.stream_message(messages, slot=slot, **params), on_event)

    def stream_route(
        self,
        path: str,
        body: Any = None,
        *,
        method: str = "POST",
        slot: Optional[int] = None,
        headers: Optional[Dict[str, str]] = None,
        **params: Any,
    ) -> Stream:
        """A ``Stream`` of any route that answers ``text/event-stream``: ``method`` to ``path`` with ``body`` (any JSON
        value; None: none), the keywords and ``slot`` put in a dict body; each data event a ``Chunk``.  A 200 that is
        not ``text/event-stream`` is ``ProtocolError``."""
        params["headers"] = headers
        return Stream(self._board, self._streams.stream_request("route", (path, body, method), params, slot))

    def resume(
        self,
        conversation_id: str,
        *,
        endpoint: str = "chat",
        offset: int = 0,
        model: Optional[str] = None,
        raw_chunks: bool = False,
        headers: Optional[Dict[str, str]] = None,
        session: Optional[str] = None,
    ) -> Stream:
        """A ``Stream`` of a resumable stream's buffer on the server from ``offset`` (0, or a ``stream.offset``)
        to its end, read as ``endpoint``'s call (``"chat"``, ``"complete"``, ..., ``"route"``) reads it; no
        slot permit.  An unknown id is ``StreamClosedError``; ``session``: the stream's (``stream.session``)."""
        req = self._streams.resume_request(conversation_id, endpoint, offset, model, raw_chunks, headers, session)
        return Stream(self._board, req)

    def lookup_streams(
        self,
        conversation_ids: Sequence[str],
        *,
        session: Optional[str] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> List[Any]:
        """``POST /v1/streams/lookup``: what the server knows of the resumable streams it knows of these
        (``conversation_id``, ``is_done``, ``total_bytes``, ...); ``session`` as ``resume()`` takes it."""
        return self._run(self._calls.at(headers).lookup_streams(conversation_ids, session), timeout)

    def delete_stream(
        self,
        conversation_id: str,
        *,
        session: Optional[str] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> bool:
        """``DELETE /v1/stream?conv_id=...``: stop a resumable stream and drop its buffer; False when the
        server says it is unknown (this build answers 204, True, for any id); ``session`` as ``resume()``."""
        return self._run(self._calls.at(headers).delete_stream(conversation_id, session=session), timeout)

    # -- single-shot calls (the class's docstring says what each raises, and its headers= and timeout=) ------

    def fetch(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Response:
        """Any route, the answer whole: a ``Response`` (status, reason, headers, body) for any status (1xx
        skipped, 3xx not followed, no ``HTTPStatusError``); ``body`` and ``query`` as ``request()`` sends
        them.  An answer cut short is ``StreamClosedError``; a bad argument ``TypeError``/``ValueError``."""
        return self._run(self._calls.at(headers).fetch(method, path, body, query), timeout)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        """Any endpoint: ``body`` (not None) sent as JSON, ``query`` URL-encoded, routed to the default model; the
        decoded JSON when the answer is JSON, else its text.  Any 2xx is success (others ``HTTPStatusError``)."""
        return self._run(self._calls.at(headers).request(method, path, body, query), timeout)

    def slots(
        self, model: Optional[str] = None, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> List[Slot]:
        """``GET /slots`` (``?model=`` with ``model`` or the client's default)."""
        return self._run(self._calls.at(headers).slots(model), timeout)

    def health(self, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None) -> Dict[str, Any]:
        """``GET /health``: ``{"status": "ok"}``; ``HTTPStatusError`` (503) while the model loads."""
        return self._run(self._calls.at(headers).health(), timeout)

    def props(
        self, model: Optional[str] = None, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        """``GET /props`` (``?model=`` with ``model`` or the client's default)."""
        return self._run(self._calls.at(headers).props(model), timeout)

    def models(self, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None) -> Dict[str, Any]:
        """``GET /v1/models``: the models the server (or router) serves, with their status on a router."""
        return self._run(self._calls.at(headers).models(), timeout)

    def load_model(
        self,
        name: str,
        *,
        wait: bool = False,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Dict[str, Any]:
        """Router mode: ``POST /models/load`` for ``name``; the server's answer.  ``wait=True`` returns once
        ``GET /models`` (every ``poll``, under ``load_wait``: ``LoadTimeoutError``) says it is loaded, within
        ``timeout`` too; a load that fails is ``ServerError`` (its exit code), a refused one ``HTTPStatusError``."""
        return self._run(self._calls.at(headers).load_model(name, wait), timeout)

    def watch_models(self, model: Optional[str] = None, *, headers: Optional[Dict[str, str]] = None) -> Stream:
        """Router mode: a ``Stream`` of ``ModelEvent`` (``GET /models/sse``; only ``model``'s and the ``"*"``
        ones, such as ``models_reload``, when given) until cancelled.  Silence is its normal state: no
        liveness; the router closing it is ``StreamClosedError``.  No slot permit; never sent again."""
        return Stream(self._board, self._streams.watch_request(model, headers))

    def unload_model(
        self, name: str, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        """Router mode: ``POST /models/unload`` for ``name``; the server's answer."""
        return self._run(self._calls.at(headers).unload_model(name), timeout)

    def end_reasoning(
        self, completion_id: str, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> bool:
        """Ask the server to end the reasoning of a completion in flight; True when it accepted."""
        return self._run(self._calls.at(headers).control(self.model, completion_id), timeout)

    def tokenize(
        self,
        text: str,
        *,
        add_special: bool = False,
        parse_special: bool = True,
        with_pieces: bool = False,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> List[Any]:
        """``POST /tokenize``: the token ids (with ``with_pieces``: ``{"id", "piece"}`` dicts)."""
        return self._run(self._calls.at(headers).tokenize(text, add_special, parse_special, with_pieces), timeout)

    def detokenize(
        self, tokens: Sequence[int], *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> str:
        """``POST /detokenize``: the text of ``tokens``."""
        return self._run(self._calls.at(headers).detokenize(tokens), timeout)

    def apply_template(
        self,
        messages: Sequence[Dict[str, Any]],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        **params: Any,
    ) -> str:
        """``POST /apply-template``: the prompt the server's chat template makes of ``messages``."""
        return self._run(self._calls.at(headers).apply_template(messages, params), timeout)

    def count_tokens(
        self,
        messages: Sequence[Dict[str, Any]],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        **params: Any,
    ) -> int:
        """``POST /v1/chat/completions/input_tokens``: how many prompt tokens ``messages`` make."""
        return self._run(self._calls.at(headers).count_tokens(messages, params), timeout)

    def embed(
        self,
        input: Union[str, Sequence[str]],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        **params: Any,
    ) -> List[List[float]]:
        """``POST /v1/embeddings`` (a server with ``--embeddings``): one vector per input, in order."""
        return self._run(self._calls.at(headers).embed(input, params), timeout)

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        **params: Any,
    ) -> List[Dict[str, Any]]:
        """``POST /v1/rerank`` (a reranking model): the results, as the server orders them."""
        return self._run(self._calls.at(headers).rerank(query, documents, params), timeout)

    def save_slot(
        self, slot: int, filename: str, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        """``POST /slots/{slot}?action=save`` (a server started with ``--slot-save-path``)."""
        return self._run(self._calls.at(headers).slot_action(slot, "save", {"filename": filename}), timeout)

    def restore_slot(
        self, slot: int, filename: str, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        """``POST /slots/{slot}?action=restore``: load a saved prompt cache into the slot."""
        return self._run(self._calls.at(headers).slot_action(slot, "restore", {"filename": filename}), timeout)

    def erase_slot(
        self, slot: int, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        """``POST /slots/{slot}?action=erase``: drop the slot's prompt cache."""
        return self._run(self._calls.at(headers).slot_action(slot, "erase", {}), timeout)

    def metrics(self, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None) -> str:
        """``GET /metrics`` (a server started with ``--metrics``): Prometheus text."""
        return self._run(self._calls.at(headers).metrics(), timeout)

    def count_message_tokens(
        self,
        messages: Sequence[Dict[str, Any]],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        **params: Any,
    ) -> int:
        """``POST /v1/messages/count_tokens``: a Messages request's prompt tokens, cached ones included."""
        return self._run(self._calls.at(headers).count_message_tokens(messages, params), timeout)

    def count_response_tokens(
        self, input: Any, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None, **params: Any
    ) -> int:
        """``POST /v1/responses/input_tokens``: the prompt tokens of a Responses request (keywords counted)."""
        return self._run(self._calls.at(headers).count_response_tokens(input, params), timeout)

    def lora_adapters(self, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None) -> List[Any]:
        """``GET /lora-adapters``: the server's LoRA adapters (``[]`` without ``--lora``)."""
        return self._run(self._calls.at(headers).lora_adapters(), timeout)

    def set_lora_adapters(
        self,
        adapters: Sequence[Dict[str, Any]],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        """``POST /lora-adapters`` ``[{"id": int, "scale": float}, ...]``: the scales of every request that
        sends no ``lora``; the server's answer."""
        return self._run(self._calls.at(headers).set_lora_adapters(adapters), timeout)


def _consume(stream: Stream, on_event: Optional[Callable[[Event], Any]]) -> Completion:
    """Iterate ``stream`` to its end, calling ``on_event``; an exception from it closes the request."""
    try:
        for event in stream:
            if on_event is not None:
                on_event(event)
    except BaseException:
        stream.__exit__(None, None, None)
        raise
    assert stream.completion is not None
    return stream.completion


# -- asyncio: the same plans on an event loop, with no threads ------------------------------------------
#
# asyncio is imported by the first AsyncClient, never by ``import loopclient``.

if TYPE_CHECKING:
    import asyncio


class _Alarm:
    """What a run or a connection waits on, on the event loop: a future per wait and a timer handle."""

    __slots__ = ("loop", "_future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._future = None  # type: Optional[asyncio.Future[None]]

    def ring(self) -> bool:
        """End the wait in progress; False when there is none."""
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)
        return future is not None

    async def wait(self, timeout: Optional[float]) -> None:
        """Until rung, or ``timeout`` passes (None: no timer)."""
        future = self._future = self.loop.create_future()
        timer = self.loop.call_later(timeout, self.ring) if timeout is not None else None
        try:
            await future
        finally:
            self._future = None
            if timer is not None:
                timer.cancel()


class _AsyncRun(_Run):
    """A plan driven on an event loop.  ``cancel()`` (in the loop's thread) aborts its connections, signals it and
    releases its permit at once; the plan then has ``CancelledError`` thrown into it."""

    __slots__ = ("resumable", "running", "unwinding", "_alarm", "_rung")
    board: _AsyncBoard

    def __init__(self, board: _AsyncBoard, resumable: bool = False) -> None:
        _Run.__init__(self, board)
        self.resumable = resumable  # its end says something to the server: it cannot be ended at once
        self.unwinding = None  # type: Optional[asyncio.Task[None]]  # the task ending it after a cancel()
        self.running = False  # a task is driving the plan
        self._alarm = _Alarm(board.loop)  # what a park or a sleep awaits
        self._rung = False  # signalled while not parked: the next park returns at once

    def signal(self) -> None:
        self._rung = not self._alarm.ring()

    async def step(self) -> Optional[List[Event]]:
        """``_SyncRun.step`` on an event loop: each operation is this run's coroutine of its name."""
        value = None  # type: Any
        exc = _cancelled() if self.cancelled else None  # type: Optional[BaseException]
        while True:
            op = _advance(self, value, exc)
            if op is _DONE:
                return None
            if type(op) is list:
                return op
            value = exc = None
            try:
                value = await getattr(self, op[0])(*op[1:])
            except BaseException as caught:  # noqa: B036 - thrown into the plan, which decides
                exc = caught
            exc = _after(self, exc)

    async def connect(self, timeout: float, reuse: bool) -> _AsyncConn:
        """A kept connection (``reuse``), else a new one (``_AsyncConn.open``)."""
        board = self.board
        conn = board.checkout(self) if reuse else None  # type: Optional[_AsyncConn]
        if conn is None:
            conn = _AsyncConn(board.loop, self)
            await conn.open(board.calls.addr, timeout, board.calls.ssl_context)
            _connected(board)
        with self._conns_lock:
            self._conns.add(conn)
        return conn

    async def park(self, timeout: Optional[float]) -> None:
        if self._rung or (self.cancelled and not self.shield):
            self._rung = False
        else:
            await self._alarm.wait(timeout)

    async def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.cancelled and time.monotonic() < deadline:
            await self.park(deadline - time.monotonic())

    async def spawn(self, plan: _Plan[Any]) -> None:
        self.board.spawn(self.child(plan).background())

    async def keep(self, conn: _AsyncConn, idle: float) -> None:  # type: ignore[override]
        _Run.keep(self, conn, idle)

    async def unwind(self) -> None:
        """``_SyncRun.unwind`` on an event loop."""
        self.cancelled = True
        try:
            await self.finish()
        except CancelledError:
            pass

    async def finish(self) -> Any:
        """Drive a plan that yields no events to its end: its value."""
        self.running = True
        try:
            while (await self.step()) is not None:
                pass
        finally:
            self.running = False
            self.close_all()
        return self.value

    async def background(self) -> None:
        try:
            await self.finish()
        finally:
            self.board.discard(self)

    def cancel(self) -> None:
        self._abort()
        self.signal()
        if self.gen is not None and not self.running:  # nobody drives it
            if self.resumable:  # its DELETE is I/O: a task of the board ends it, then frees the permit
                self.running = True
                self.unwinding = self.board.spawn(self.unwind())
            else:
                self.gen.close()  # its finally runs now: socket closed, permit released
        elif self.ticket is not None and not self.resumable:
            self.board.gate.leave(self.ticket)  # the permit now; the plan ends when its task wakes


class _AsyncConn:
    """One connection on an event loop: ``_Conn``'s ``recv`` and ``send`` over an asyncio transport, whose protocol it
    is (duck-typed: ``asyncio.Protocol`` would import asyncio).  Reading pauses once ``RECV_SIZE`` bytes wait unread."""

    __slots__ = ("owner", "reused", "_alarm", "_transport", "_chunks", "_size", "_eof", "_error", "_paused", "_blocked")

    def __init__(self, loop: asyncio.AbstractEventLoop, owner: _AsyncRun) -> None:
        self.owner = owner
        self.reused = False
        self._alarm = _Alarm(loop)  # rung by the transport's calls
        self._transport = None  # type: Optional[asyncio.Transport]
        self._chunks = []  # type: List[bytes]
        self._size = 0
        self._eof = False
        self._error = None  # type: Optional[BaseException]
        self._paused = False  # reading paused: RECV_SIZE bytes or more wait
        self._blocked = False  # writing paused: the server does not take the request

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size >= RECV_SIZE and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._alarm.ring()

    def eof_received(self) -> bool:
        self._eof = True
        self._alarm.ring()
        return False  # the transport closes itself

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._eof = True
        if exc is not None and self._error is None:
            self._error = exc
        self._blocked = False
        self._alarm.ring()

    def pause_writing(self) -> None:
        self._blocked = True

    def resume_writing(self) -> None:
        self._blocked = False
        self._alarm.ring()

    async def open(self, addr: _Address, timeout: float, ssl_context: Any) -> None:
        """``_Conn.open`` on the loop.  A Unix socket connects at once (``_unix_connect``: asyncio would take a full
        listen queue's EAGAIN for "in progress"); TCP (lookup and TLS included) is a task the run parks on until it is
        done, the run is cancelled or ``timeout`` passes."""
        run = self.owner
        board = run.board
        protocol = self  # type: Any  # duck-typed: see the class
        if addr.unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                _unix_connect(sock, addr)
                await board.loop.create_unix_connection(lambda: protocol, sock=sock)
            except BaseException:
                sock.close()
                raise
            return
        host, port = addr.target
        tls, name = (ssl_context, host) if addr.tls else (None, None)
        task = board.spawn(board.loop.create_connection(lambda: protocol, host, port, ssl=tls, server_hostname=name))
        task.add_done_callback(lambda _: run.signal())
        try:
            deadline = time.monotonic() + timeout
            while not task.done() and not (run.cancelled and not run.shield) and time.monotonic() < deadline:
                await run.park(deadline - time.monotonic())
        finally:
            if not task.done():
                task.cancel()
        if not task.done() or task.cancelled():
            raise socket.timeout("timed out")
        exc = task.exception()
        if exc is not None:
            if addr.tls and isinstance(exc, _import_ssl().SSLError):  # before OSError: not a server down
                raise _tls_failed(addr, exc) from exc
            raise exc

    async def send(self, data: bytes, timeout: float) -> None:
        """Write the request; ``StalledError`` when the server takes none of it for ``timeout``."""
        assert self._transport is not None
        self._transport.write(data)  # a failure shows at the next read, as the connection's loss
        deadline = time.monotonic() + timeout
        while self._blocked:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _send_stalled(timeout)
            await self._alarm.wait(left)

    async def recv(self, timeout: float) -> bytes:
        """The bytes received (all), ``b""`` at the end; ``_Silence`` after ``timeout``; ``StreamClosedError``."""
        deadline = 0.0
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self._chunks = []
                self._size = 0
                if self._paused and self._transport is not None:
                    self._paused = False
                    self._transport.resume_reading()
                return data
            if self._eof:
                if self._error is not None:
                    raise _connection_failed(self._error) from self._error
                return b""
            now = time.monotonic()
            if not deadline:
                deadline = now + timeout
            elif now >= deadline:
                raise _Silence()
            await self._alarm.wait(deadline - now)

    def abort(self) -> None:
        """Close now, whatever is buffered: the server sees the client go away; a waiting read wakes."""
        self._eof = True
        if self._transport is not None:
            if self._alarm.loop.is_closed():  # a connection kept for a loop that has ended
                _drop(self._transport)
            else:
                self._transport.abort()
        self._alarm.ring()

    def close(self) -> None:
        self.owner.forget(self)
        self.abort()


def _drop(transport: Any) -> None:
    """Close the socket of a transport whose loop is closed (its ``abort()`` would leave it to the garbage collector):
    the transport's own last step (asyncio's selector transports, TLS too)."""
    while hasattr(transport, "_ssl_protocol"):  # TLS: the application transport over the socket's own
        transport._closed = True
        transport = getattr(transport._ssl_protocol, "_transport", None)
    lost = getattr(transport, "_call_connection_lost", None)
    if lost is not None and getattr(transport, "_sock", None) is not None:
        try:
            lost(None)  # closes the socket whatever the protocol does
        except RuntimeError:  # a protocol that schedules on the closed loop (TLS's)
            pass


class _AsyncBoard(_Board):
    """The board of one event loop, with the tasks it started (background polls, connects)."""

    def __init__(self, calls: _Calls, loop: asyncio.AbstractEventLoop, previous: Optional[_Board]) -> None:
        _Board.__init__(self, calls, previous)
        self.loop = loop
        self.tasks: Set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def aclose(self) -> None:
        import asyncio

        self.close()
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


class AsyncStream(_Events):
    """``Stream`` on an event loop (``AsyncClient.stream()`` and the other ``stream_*`` calls), iterated with
    ``async for``.  Cancelling the task that iterates cancels the request too (the task sees
    ``asyncio.CancelledError``); leaving ``async with`` early cancels quietly."""

    def __init__(self, client: AsyncClient, req: _StreamRequest) -> None:
        self._setup(req)
        self._client = client
        self._run = None  # type: Optional[_AsyncRun]  # made when iteration starts, on the loop that iterates
        self._cancelled = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Event:
        batch = self._batch
        if batch and not self._cancelled:  # a read yields all the events it completed
            event = batch.pop()
            if not batch:
                self.offset = self._life.offset  # type: ignore[union-attr]
            return event
        if self._done:
            raise StopAsyncIteration
        run = self._run
        if run is not None and run.running and run.unwinding is None:  # (a cancelled one's DELETE: below)
            raise RuntimeError("another task is iterating this stream")
        if self._cancelled:
            self._done = True
            await self._end()
            exc = _cancelled()
            self._ended(exc)
            raise exc
        if run is None:
            run = self._run = _AsyncRun(self._client._board_here(), self._req.conversation is not None)
            self._plan(run)
        run.running = True
        try:
            got = await run.step()
        except BaseException as caught:
            import asyncio

            if isinstance(caught, asyncio.CancelledError):
                _cancel_told(self._req.calls.addr, "the task iterating the stream was cancelled")
            self._ended(caught)
            raise
        finally:
            run.running = False
        return self._hand_out(got, StopAsyncIteration)

    def cancel(self) -> None:
        """Cancel the request (in the loop's thread; from another, ``loop.call_soon_threadsafe(stream.cancel)``):
        its connections close and its permit is released now; the iterating code gets ``CancelledError``."""
        if not self._done:
            if not self._cancelled:
                _cancel_told(self._req.calls.addr, "cancel() was called")
            self._cancelled = True
            if self._run is not None:
                self._run.cancel()

    async def _end(self) -> None:
        """End the plan of a cancelled stream: at once, or (a resumable one) once its DELETE is said."""
        run = self._run
        if run is None:
            return
        if run.unwinding is not None:
            await run.unwinding
        elif not run.running:
            await run.unwind()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if not self._done:
            if not self._cancelled:
                _cancel_told(self._req.calls.addr, "the stream was left before its end")
                self._cancelled = True
            self.cancel()
            self._done = True
            await self._end()


#: The name of ``AsyncStream`` from the time when chat was the only streamed endpoint.
AsyncChatStream = AsyncStream


class AsyncClient(_Configured):
    """``Client`` for asyncio programs: the same constructor, calls (coroutines, but those that return an
    ``AsyncStream``), events, errors and rules, on an event loop; no threads.

        async with lc.AsyncClient("/run/llama.sock") as client:
            reply = await client.chat(messages, on_event=print, max_tokens=64)

    Its gates and poller belong to the loop that uses it: one loop after another, never two running at once
    (``RuntimeError``).  ``await client.close()`` (or leaving ``async with``) cancels its streams and ends its tasks."""

    def _start(self) -> None:
        self._board = None  # type: Optional[_AsyncBoard]  # of the loop that uses this client
        self._lock = threading.Lock()  # two threads may race to bind the client to their loops

    def __repr__(self) -> str:
        return "<loopclient.AsyncClient %s>" % self.address

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel this client's streams in flight and end its tasks.  Any later call is ``ValueError``."""
        import asyncio

        self._calls.closed = True
        with self._lock:
            board, self._board = self._board, None
        if board is None:
            return
        if board.loop is asyncio.get_running_loop():
            await board.aclose()
        elif board.loop.is_running():
            raise RuntimeError("this AsyncClient is in use by another running event loop: close it there")
        else:  # a loop that no longer runs: nothing of it can be awaited
            board.close()

    def _board_here(self) -> _AsyncBoard:
        """The board of the running loop, made when a loop first uses the client."""
        import asyncio

        loop = asyncio.get_running_loop()
        board = self._board
        if board is not None and board.loop is loop:
            return board
        with self._lock:
            if self._calls.closed:  # a board that refuses what starts on it, as a closed Client's does
                board = _AsyncBoard(self._calls, loop, None)
                board.closed = True
                return board
            board = self._board
            if board is None or board.loop is not loop:
                busy = board is not None and (board.runs or board.tasks) and not board.loop.is_closed()
                if board is not None and (board.loop.is_running() or busy):
                    raise RuntimeError(
                        "this AsyncClient is in use by another event loop: use one client per loop at a time"
                    )
                previous, board = board, _AsyncBoard(self._calls, loop, board)
                self._board = board
                if previous is not None:
                    previous.drop_idle()
        return board

    async def _run(self, plan: _Plan[_T], timeout: Optional[float] = None) -> _T:
        """``Client._run`` on the running loop."""
        seconds = _check_timeout(timeout)
        run = _AsyncRun(self._board_here())
        run.gen = plan if seconds is None else _within(plan, seconds, self.address)
        return await run.finish()  # type: ignore[no-any-return]

    def stream(self, messages: Sequence[Dict[str, Any]], slot: Optional[int] = None, **params: Any) -> AsyncStream:
        return AsyncStream(self, self._streams.stream_request("chat", (messages,), params, slot))

    async def chat(
        self,
        messages: Sequence[Dict[str, Any]],
        slot: Optional[int] = None,
        on_event: Optional[Callable[[Event], Any]] = None,
        **params: Any,
    ) -> Completion:
        return await _aconsume(self.stream(messages, slot=slot, **params), on_event)

    def stream_complete(self, prompt: Any, slot: Optional[int] = None, **params: Any) -> AsyncStream:
        return AsyncStream(self, self._streams.stream_request("complete", (prompt,), params, slot))

    async def complete(
        self, prompt: Any, slot: Optional[int] = None, on_event: Optional[Callable[[Event], Any]] = None, **params: Any
    ) -> Completion:
        return await _aconsume(self.stream_complete(prompt, slot=slot, **params), on_event)

    def stream_complete_openai(self, prompt: Any, slot: Optional[int] = None, **params: Any) -> AsyncStream:
        return AsyncStream(self, self._streams.stream_request("complete_openai", (prompt,), params, slot))

    async def complete_openai(
        self, prompt: Any, slot: Optional[int] = None, on_event: Optional[Callable[[Event], Any]] = None, **params: Any
    ) -> Completion:
        return await _aconsume(self.stream_complete_openai(prompt, slot=slot, **params), on_event)

    def stream_infill(
        self, prefix: str, suffix: str = "", *, extra: Any = None, slot: Optional[int] = None, **params: Any
    ) -> AsyncStream:
        return AsyncStream(self, self._streams.stream_request("infill", (prefix, suffix, extra), params, slot))

    async def infill(
        self,
        prefix: str,
        suffix: str = "",
        *,
        extra: Any = None,
        slot: Optional[int] = None,
        on_event: Optional[Callable[[Event], Any]] = None,
        **params: Any,
    ) -> Completion:
        return await _aconsume(self.stream_infill(prefix, suffix, extra=extra, slot=slot, **params), on_event)

    def stream_respond(self, input: Any, slot: Optional[int] = None, **params: Any) -> AsyncStream:
        return AsyncStream(self, self._streams.stream_request("respond", (input,), params, slot))

    async def respond(
        self, input: Any, slot: Optional[int] = None, on_event: Optional[Callable[[Event], Any]] = None, **params: Any
    ) -> Completion:
        return await _aconsume(self.stream_respond(input, slot=slot, **params), on_event)

    def stream_message(
        self, messages: Sequence[Dict[str, Any]], slot: Optional[int] = None, **params: Any
    ) -> AsyncStream:
        return AsyncStream(self, self._streams.stream_request("message", (messages,), params, slot))

    async def message(
        self,
        messages: Sequence[Dict[str, Any]],
        slot: Optional[int] = None,
        on_event: Optional[Callable[[Event], Any]] = None,
        **params: Any,
    ) -> Completion:
        return await _aconsume(self.stream_message(messages, slot=slot, **params), on_event)

    def stream_route(
        self,
        path: str,
        body: Any = None,
        *,
        method: str = "POST",
        slot: Optional[int] = None,
        headers: Optional[Dict[str, str]] = None,
        **params: Any,
    ) -> AsyncStream:
        params["headers"] = headers
        return AsyncStream(self, self._streams.stream_request("route", (path, body, method), params, slot))

    def resume(
        self,
        conversation_id: str,
        *,
        endpoint: str = "chat",
        offset: int = 0,
        model: Optional[str] = None,
        raw_chunks: bool = False,
        headers: Optional[Dict[str, str]] = None,
        session: Optional[str] = None,
    ) -> AsyncStream:
        req = self._streams.resume_request(conversation_id, endpoint, offset, model, raw_chunks, headers, session)
        return AsyncStream(self, req)

    async def lookup_streams(
        self,
        conversation_ids: Sequence[str],
        *,
        session: Optional[str] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> List[Any]:
        return await self._run(self._calls.at(headers).lookup_streams(conversation_ids, session), timeout)

    async def delete_stream(
        self,
        conversation_id: str,
        *,
        session: Optional[str] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> bool:
        return await self._run(self._calls.at(headers).delete_stream(conversation_id, session=session), timeout)

    async def fetch(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Response:
        return await self._run(self._calls.at(headers).fetch(method, path, body, query), timeout)

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        return await self._run(self._calls.at(headers).request(method, path, body, query), timeout)

    async def slots(
        self, model: Optional[str] = None, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> List[Slot]:
        return await self._run(self._calls.at(headers).slots(model), timeout)

    async def health(
        self, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        return await self._run(self._calls.at(headers).health(), timeout)

    async def props(
        self, model: Optional[str] = None, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        return await self._run(self._calls.at(headers).props(model), timeout)

    async def models(
        self, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        return await self._run(self._calls.at(headers).models(), timeout)

    async def load_model(
        self,
        name: str,
        *,
        wait: bool = False,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Dict[str, Any]:
        return await self._run(self._calls.at(headers).load_model(name, wait), timeout)

    def watch_models(self, model: Optional[str] = None, *, headers: Optional[Dict[str, str]] = None) -> AsyncStream:
        return AsyncStream(self, self._streams.watch_request(model, headers))

    async def unload_model(
        self, name: str, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        return await self._run(self._calls.at(headers).unload_model(name), timeout)

    async def end_reasoning(
        self, completion_id: str, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> bool:
        return await self._run(self._calls.at(headers).control(self.model, completion_id), timeout)

    async def tokenize(
        self,
        text: str,
        *,
        add_special: bool = False,
        parse_special: bool = True,
        with_pieces: bool = False,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> List[Any]:
        plan = self._calls.at(headers).tokenize(text, add_special, parse_special, with_pieces)
        return await self._run(plan, timeout)

    async def detokenize(
        self, tokens: Sequence[int], *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> str:
        return await self._run(self._calls.at(headers).detokenize(tokens), timeout)

    async def apply_template(
        self,
        messages: Sequence[Dict[str, Any]],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        **params: Any,
    ) -> str:
        return await self._run(self._calls.at(headers).apply_template(messages, params), timeout)

    async def count_tokens(
        self,
        messages: Sequence[Dict[str, Any]],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        **params: Any,
    ) -> int:
        return await self._run(self._calls.at(headers).count_tokens(messages, params), timeout)

    async def embed(
        self,
        input: Union[str, Sequence[str]],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        **params: Any,
    ) -> List[List[float]]:
        return await self._run(self._calls.at(headers).embed(input, params), timeout)

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        **params: Any,
    ) -> List[Dict[str, Any]]:
        return await self._run(self._calls.at(headers).rerank(query, documents, params), timeout)

    async def save_slot(
        self, slot: int, filename: str, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        return await self._run(self._calls.at(headers).slot_action(slot, "save", {"filename": filename}), timeout)

    async def restore_slot(
        self, slot: int, filename: str, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        plan = self._calls.at(headers).slot_action(slot, "restore", {"filename": filename})
        return await self._run(plan, timeout)

    async def erase_slot(
        self, slot: int, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> Dict[str, Any]:
        return await self._run(self._calls.at(headers).slot_action(slot, "erase", {}), timeout)

    async def metrics(self, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None) -> str:
        return await self._run(self._calls.at(headers).metrics(), timeout)

    async def count_message_tokens(
        self,
        messages: Sequence[Dict[str, Any]],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        **params: Any,
    ) -> int:
        return await self._run(self._calls.at(headers).count_message_tokens(messages, params), timeout)

    async def count_response_tokens(
        self, input: Any, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None, **params: Any
    ) -> int:
        return await self._run(self._calls.at(headers).count_response_tokens(input, params), timeout)

    async def lora_adapters(
        self, *, headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None
    ) -> List[Any]:
        return await self._run(self._calls.at(headers).lora_adapters(), timeout)

    async def set_lora_adapters(
        self,
        adapters: Sequence[Dict[str, Any]],
        *,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        return await self._run(self._calls.at(headers).set_lora_adapters(adapters), timeout)


async def _aconsume(stream: AsyncStream, on_event: Optional[Callable[[Event], Any]]) -> Completion:
    """``_consume`` on an event loop."""
    try:
        async for event in stream:
            if on_event is not None:
                on_event(event)
    except BaseException:
        await stream.__aexit__(None, None, None)
        raise
    assert stream.completion is not None
    return stream.completion


def _as_client(cls: Any) -> None:
    """Give each public call of ``cls`` without a docstring one saying it is ``Client``'s on an event loop."""
    for name, call in vars(cls).items():
        if not name.startswith("_") and call.__doc__ is None:
            plain = call.__annotations__.get("return") == "AsyncStream"
            how = "for asyncio (a plain call): an ``AsyncStream``" if plain else "as a coroutine"
            call.__doc__ = "``Client.%s()``, %s." % (name, how)


_as_client(AsyncClient)


# =====================================================================================================
# 10. Command line
# =====================================================================================================

_HINTS = (
    (BusyError, "the queue for this slot is full: try again later, or another --slot"),
    (WaitTimeoutError, "the slot stayed busy: try another --slot, or later"),
    (LoadTimeoutError, "start llama-server, or pass --socket PATH / --url URL (--wait SECONDS waits longer)"),
    (ConnectError, "start llama-server, or pass --socket PATH / --url URL"),
    (WedgedSlotError, "restart llama-server (SIGKILL if SIGTERM does not stop it)"),
    (StalledError, "the server stopped answering: check its log"),
    (StreamClosedError, "the server closed the connection mid-answer: check its log, then retry"),
    (ThinkingOverrunError, "raise --thinking-cap, or drop it"),
    (HTTPStatusError, "the server refused the request"),
    (ServerError, "the server failed while answering: check its log"),
    (ProtocolError, "is this a llama-server? check the address"),
    (CancelledError, "the request was cancelled"),
)


def _describe(exc: LoopError, pool: bool = False) -> str:
    """The one line of an error: its message and what to do, the command line's words in place of the
    library's (``pool``: the request was ``slot=None``'s, so no slot of its own stayed busy)."""
    hint = next((text for cls, text in _HINTS if isinstance(exc, cls)), "")
    if isinstance(exc, WaitTimeoutError) and pool:
        hint = "every slot stayed busy: try later, or wait longer with --wait SECONDS"
    elif isinstance(exc, BusyError) and pool:
        hint = "the queue for the slots is full: try again later"
    elif isinstance(exc, LoadTimeoutError) and _loading(exc.__cause__):
        hint = "the server is still loading: try again, or wait longer with --wait SECONDS"
    text = str(exc)[: -len(exc._hint) - 2] if hint and exc._hint else str(exc)
    return "loopclient: %s%s" % (text, ": " + hint if hint else "")


def _loading(cause: Optional[BaseException]) -> bool:
    """The last failure of a wait was a server that answered "still loading" (503)."""
    return (isinstance(cause, HTTPStatusError) and cause.status == 503) or (
        isinstance(cause, ServerError) and cause.code == 503
    )


def _isatty(stream: Any) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


class _Console:
    """Status lines on stderr: overwritten in place on a terminal, plain lines otherwise.  The prompt's
    progress shows on a terminal only (off one, a log or a pipe, it would be lines of noise for each
    answer); off a terminal a wait (retries, a busy slot) is a line when it starts or its reason changes,
    every ``_WAIT_LINE`` seconds while it lasts, and one when it ends, with its length."""

    def __init__(self, out: Any, err: Any, client: Optional[Client] = None, pool: bool = False) -> None:
        self.out = out
        self.err = err
        self.tty = _isatty(err)
        self.client = client
        self.pool = pool  # the request is slot=None's: its waits are told of the slots, not of one
        self._status = False
        self._in_reasoning = False
        self.started = self._moved = _clock()  # the start; the last event that was no wait
        self._wait = None  # type: Optional[List[Any]]  # the wait going on: [since, last line at, its reason]
        self.first_token = None  # type: Optional[float]
        self._prompt = None  # type: Optional[Tuple[int, int]]  # (processed, total) last shown

    def status(self, text: str) -> None:
        if self.tty:
            self.err.write("\r\x1b[K" + text)
            self._status = True
        else:
            self.err.write(text + "\n")
        self.err.flush()

    def clear(self) -> None:
        if self._status:
            self.err.write("\r\x1b[K")
            self._status = False

    def event(self, event: Event, show_text: bool = True) -> None:
        """Show ``event``: the answer's text on ``out`` (reasoning on ``err``), the rest on the status line."""
        if isinstance(event, (Waiting, Retrying)):
            self._waiting(event)
            return
        self._waited()
        if isinstance(event, (Content, Reasoning, ToolCall)):
            self._token(event, show_text)
        elif isinstance(event, ThinkingCapped):
            if self._in_reasoning:
                self._leave_reasoning()
            self.status("thinking capped at %d tokens" % event.tokens)
            if self.tty:
                self.err.write("\n")
                self._status = False
        elif isinstance(event, Queued):
            self.status("queued: %d ahead of this request" % event.ahead)
        elif isinstance(event, Resumed):
            self.status("connection lost: resumed from byte %d (attempt %d)" % (event.offset, event.attempt))
        elif isinstance(event, Progress) and event.total > 0 and self.first_token is None:
            self._progress(min(event.processed, event.total), event.total)

    def _token(self, event: Union[Content, Reasoning, ToolCall], show_text: bool) -> None:
        """A piece of the answer: the first ends the status line (and the prompt's progress, at 100 %)."""
        if self.first_token is None:
            self.first_token = _clock() - self.started
            if self._prompt is not None and self._prompt[0] < self._prompt[1]:
                # the server's last progress chunk may stop short (47 of 51): a token means all of it
                self._progress(self._prompt[1], self._prompt[1])
        self.clear()
        if isinstance(event, Reasoning):
            if show_text:
                self._in_reasoning = True
                self.err.write("\x1b[2m" + event.text + "\x1b[0m" if self.tty else event.text)
                self.err.flush()
            return
        if self._in_reasoning:
            self._leave_reasoning()
        if not show_text:
            return
        if isinstance(event, Content):
            self.out.write(event.text)
        else:
            if event.name:
                self.out.write("\n[tool call %s] %s " % (event.index, event.name))
            self.out.write(event.arguments)
        self.out.flush()

    def _reason(self, event: Union[Waiting, Retrying]) -> str:
        """What a wait is for: the slot's state, or why the last attempt failed (while no socket file has
        been seen since the start, a hint about ``--host``)."""
        addr = self.client._calls.addr if self.client is not None else None
        if isinstance(event, Retrying):
            if addr is not None and addr.warned and not addr.seen:  # no socket file since the start
                return "no socket file %s yet: is llama-server started with --host %s?" % (addr.target, addr.target)
            return event.reason
        if not event.slots_known:
            return "no answer yet (the server does not show its slots)"
        if event.wedged or event.slot_busy:
            slot = "every slot is busy" if self.pool else "the slot is busy"
            return ("a slot is wedged" if self.pool else "the slot is wedged") if event.wedged else slot
        return "no answer yet"

    def _waiting(self, event: Union[Waiting, Retrying]) -> None:
        """A wait's status line: in place on a terminal; off one, when the wait starts or its reason
        changes, and each ``_WAIT_LINE`` seconds (``_waited`` says its end).  A retry says how many so far."""
        now, reason = _clock(), self._reason(event)
        wait = self._wait = self._wait or [self._moved, None, None]
        text = "waiting %.0f s: %s" % (now - wait[0], reason)
        if isinstance(event, Retrying):
            text += " (%d %s)" % (event.attempt, "retry" if event.attempt == 1 else "retries")
        if self.tty or reason != wait[2] or now - wait[1] >= _WAIT_LINE:
            wait[1:] = now, reason
            self.status(text)

    def _waited(self) -> None:
        """An event that is no wait: off a terminal, the wait going on ends with a line of its length."""
        now, wait, self._wait = _clock(), self._wait, None
        self._moved = now
        if wait is not None and not self.tty:
            self.status("waited %.1f s: %s" % (now - wait[0], wait[2]))

    def _progress(self, processed: int, total: int) -> None:
        self._prompt = (processed, total)
        if self.tty:
            self.status("prompt {:,}/{:,} tokens, {}%".format(processed, total, 100 * processed // total))

    def _leave_reasoning(self) -> None:
        self._in_reasoning = False
        self.err.write("\n")
        self.err.flush()

    def figures(self, completion: Completion, cap: Any = None) -> str:
        """The answer's figures; an answer ``length`` ended short of its ``cap`` (or that the server says it
        cut, native ``truncated``) was ended by the slot's context."""
        timings = completion.timings or {}
        usage = completion.usage or {}
        tokens = usage.get("completion_tokens", timings.get("predicted_n"))
        parts = []
        if isinstance(tokens, int):
            parts.append("%d tokens" % tokens)
        if self.first_token is not None:
            parts.append("first token %.2f s" % self.first_token)
        rate = timings.get("predicted_per_second")
        if isinstance(rate, (int, float)):
            parts.append("%.1f tokens/s" % rate)
        if completion.reasoning_tokens:
            capped = " (capped)" if completion.thinking_capped else ""
            parts.append("%d reasoning%s" % (completion.reasoning_tokens, capped))
        parts.append("finish: %s" % completion.finish_reason)
        short = isinstance(tokens, int) and isinstance(cap, int) and tokens < cap
        if completion.finish_reason == "length" and (short or (completion.final or {}).get("truncated") is True):
            parts[-1] += " (the slot's context is full)"
        return "[" + ", ".join(parts) + "]"


#: Off a terminal, how often a wait that goes on is told again (seconds).
_WAIT_LINE = 10.0


def _completion_json(completion: Completion) -> str:
    return json.dumps(completion.to_dict(), ensure_ascii=False, indent=2)


def _slot_label(s: Slot, reader: _SlotReader) -> str:
    return "wedged" if reader.wedged(s) else "busy" if s.is_processing else "idle"


def _slots_table(slots: List[Slot], reader: _SlotReader, limits: Limits) -> str:
    """The table of ``loopclient slots``: a processing slot whose progress ``reader`` has seen not move for
    longer than ``poll`` shows for how long, and ``wedged`` past ``wedge_wait``."""
    rows = [["slot", "state", "task", "decoded", "n_ctx", "still"]]
    for s in slots:
        quiet, task = reader.still(s), s.task if s.is_processing else None
        cells = (s.id, _slot_label(s, reader), task, s.decoded, s.raw.get("n_ctx"))
        still = "%.1f s" % quiet if s.is_processing and quiet > limits.poll else ""
        rows.append(["" if v is None else str(v) for v in cells] + [still])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _slot_line(s: Slot, reader: _SlotReader) -> str:
    """One slot as a line of the watch's log, after the time of day."""
    state = _slot_label(s, reader)
    line = "slot %d %s" % (s.id, state)
    if s.is_processing:
        line += " task %s decoded %s" % (s.task, s.decoded)
        if state == "wedged":
            line += " still %.1f s" % reader.still(s)
    return line


def _log_slot_changes(
    out: Any, clock: str, slots: List[Slot], reader: _SlotReader, problem: Optional[str], seen: Dict[int, Any]
) -> Dict[int, Tuple[str, Optional[int]]]:
    """A look at the slots off a terminal: a line per slot whose state or task changed since ``seen``
    (what the lines so far showed, returned updated), or one line for a look that got no answer."""
    if problem is not None:
        if seen.get(-1) != (problem, None):
            out.write("%s no answer: %s\n" % (clock, problem))
        return {-1: (problem, None)}  # every slot is logged again once an answer comes
    seen.pop(-1, None)  # and a look that gets no answer after it is logged again
    for s in slots:
        key = (_slot_label(s, reader), s.task if s.is_processing else None)
        if seen.get(s.id) != key:
            seen[s.id] = key
            out.write("%s %s\n" % (clock, _slot_line(s, reader)))
    return seen


def _slots(client: Client, out: Any, seconds: Optional[float]) -> None:
    """``loopclient slots``.  Without ``seconds``: one table, from two looks ``poll`` apart when a slot is
    processing (so that ``still`` means something).  With them: a look every ``poll`` for ``seconds`` (inf:
    until Ctrl-C), redrawn on a terminal, else a line per slot whose state or task changed.  A look without
    an answer after the first is shown as such and watching goes on; the first look's error ends it."""
    limits = client.limits
    reader = _SlotReader(limits)
    slots = client.slots()
    reader.remember(slots, time.monotonic())
    if seconds is None:
        if any(s.is_processing for s in slots):
            time.sleep(limits.poll)
            slots = client.slots()
            reader.remember(slots, time.monotonic())
        out.write(_slots_table(slots, reader, limits) + "\n")
    else:
        _watch_slots(client, out, seconds, reader, slots)


def _watch_slots(client: Client, out: Any, seconds: float, reader: _SlotReader, slots: List[Slot]) -> None:
    """``loopclient slots --watch SECONDS``, from the first look's ``slots`` on (see ``_slots``)."""
    limits = client.limits
    tty = _isatty(out)
    end = time.monotonic() + seconds
    until = "until Ctrl-C" if seconds == float("inf") else "for %g s" % seconds
    drawn = 0  # lines of the last drawing, to go back over
    seen = {}  # type: Dict[int, Tuple[str, Optional[int]]]
    problem = None  # type: Optional[str]  # why the last look got no answer
    while True:
        clock = time.strftime("%H:%M:%S")
        if tty:
            table = _slots_table(slots, reader, limits) if problem is None else "no answer: " + problem
            text = "slots of %s, every %g s %s  %s\n%s\n" % (client.address, limits.poll, until, clock, table)
            out.write(("\x1b[%dA\r\x1b[J" % drawn if drawn else "") + text)
            drawn = text.count("\n")
        else:
            seen = _log_slot_changes(out, clock, slots, reader, problem, seen)
        out.flush()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(limits.poll, left))
        try:
            slots = client.slots()
        except LoopError as exc:
            problem = str(exc)
        else:
            problem = None
            reader.remember(slots, time.monotonic())


def _models_table(doc: Dict[str, Any]) -> str:
    rows = [("model", "status")]
    for item in doc.get("data") or []:
        if isinstance(item, dict):
            status = item.get("status")
            value = status.get("value") if isinstance(status, dict) else status
            rows.append((str(item.get("id", "")), str(value) if value is not None else "loaded"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(("%s  %s" % (r[0].ljust(width), r[1])).rstrip() for r in rows)


def _watch_models(client: Client, out: Any, model: Optional[str]) -> None:
    """``models --watch``: one line per event of the router's model stream (``--model``'s only), as it
    comes: the model, the event, and its data as JSON."""
    with client.watch_models(model) as stream:
        for event in stream:
            if isinstance(event, ModelEvent):
                data = "" if event.data is None else " " + json.dumps(event.data, ensure_ascii=False)
                out.write("%s %s%s\n" % (event.model, event.event, data))
                out.flush()


def _unescape(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r`` and ``\\\\`` in a command-line TEXT as the characters they name (as
    llama-server's own flags read them), so that ``--stop '\\n'`` works in any shell."""
    return re.sub(r"\\[ntr\\]", lambda m: {"n": "\n", "t": "\t", "r": "\r"}.get(m.group()[1], "\\"), text)


def _body_param(text: str) -> Tuple[str, Any]:
    """``--param KEY=VALUE``: VALUE as JSON when it parses (``8``, ``true``, ``["a"]``, ``{"k": 1}``,
    ``"8"``), else as the string it is."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        import argparse

        raise argparse.ArgumentTypeError("expected KEY=VALUE, got %r" % text)
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def _answer_params(args: Any, taken: Sequence[str] = ()) -> Dict[str, Any]:
    """The body fields of the answer options (``_OPTIONS``) in ``args``, and ``return_progress`` (shown on a
    terminal); ``taken`` are fields the command sets itself (``stream`` and ``id_slot`` always), which
    ``--param`` may not: ``ValueError``."""
    params = {"return_progress": True}  # type: Dict[str, Any]
    if args.slot is not None and args.slot < 0:
        raise ValueError("--slot must not be negative, got %d" % args.slot)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(
            "--max-tokens must be at least 1, got %d: llama-server looks at the cap only after a first token, so "
            "%d would give one (no cap at all: --param max_tokens=-1)" % (args.max_tokens, args.max_tokens)
        )
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature, "stop": args.stop or None}
    given["ignore_eos"] = args.ignore_eos or None
    params.update((key, value) for key, value in given.items() if value is not None)
    for key, value in args.param or ():
        if key in ("stream", "id_slot", *taken):
            hint = ": use --slot" if key == "id_slot" else ""
            raise ValueError("--param %s: loopclient sets %s itself%s" % (key, key, hint))
        params[key] = value
    return params


#: How long the command line waits for an absent or loading server (``load_wait``) unless ``--wait`` says:
#: a person at a terminal, not a script's two minutes.  A busy slot is waited out for ``busy_wait``.
CLI_LOAD_WAIT = 15.0

#: How long the command line waits out a busy slot unless ``--wait`` says: the library's ``busy_wait``.
_CLI_BUSY_WAIT = Limits().busy_wait

#: ``loopclient chat``'s ``--max-tokens`` when none is given (nor ``--param max_tokens``).
CHAT_MAX_TOKENS = 2048

#: The help of ``complete``'s and ``infill``'s ``--max-tokens``, which have no default of their own.
_SERVER_CAP = "cap the answer's tokens, sent as %s (default: the server's own -n; llama-server's: none)"
_ANSWERS = "chat complete infill"  # the commands that stream an answer: they share the answer options

#: Every option of the command line: the commands that take it ("": every command, the global options, which
#: go before or after the command and are shown on ``loopclient --help`` only), its names and METAVAR, the
#: other keywords of ``add_argument``, and its help.  ``_answer_params`` reads the answer options back.
_OPTIONS = (
    ("", "--socket PATH", {}, "llama-server's Unix socket"),
    ("", "--url URL", {}, "llama-server's http(s)://host:port[/prefix]"),
    ("", "--model NAME", {}, "route to this model of a router ($LLAMA_MODEL)"),
    ("", "--api-key KEY", {}, "bearer token to send ($LLAMA_API_KEY)"),
    ("", "--wait SECONDS", {"type": float}, "how long to wait for an absent or loading server (load_wait, default "
     "%g) and for a busy slot (busy_wait, default %g)" % (CLI_LOAD_WAIT, _CLI_BUSY_WAIT)),
    ("", "-v --verbose", {"action": "count"}, "log what the client does on stderr: -v retries, waits, resumes "
     "(INFO); -vv connections too (DEBUG)"),
    ("chat", "prompt", {"nargs": "?"}, "the prompt; without it, read stdin or hold a conversation"),
    ("chat", "--system TEXT", {}, "a system message"),
    ("chat", "--thinking-cap N", {"type": int}, "ask the server to end reasoning after N tokens"),
    ("chat", "--resumable", {"action": "store_true"}, "resume the answer from the server's buffer if the "
     "connection drops"),
    ("complete", "prompt", {"nargs": "?"}, "the raw prompt; without it, read stdin (on a terminal: until Ctrl-D)"),
    ("complete", "--openai", {"action": "store_true"}, "through OpenAI's text completions (/v1/completions) instead"),
    ("infill", "--prefix TEXT", {"required": True}, "the text before the gap; @FILE reads a file, - reads stdin"),
    ("infill", "--suffix TEXT", {}, "the text after the gap; @FILE reads a file, - reads stdin"),
    (_ANSWERS, "--session KEY", {"exclusive": True}, "the conversation's session key (X-Session-Id): a front "
     "takes every run with it to the same server (default: a key made from the prompt's start)"),
    (_ANSWERS, "--no-session", {"action": "store_true", "exclusive": True}, "send no session key"),
    (_ANSWERS, "--slot N", {"type": int}, "pin the request to this slot"),
    ("chat", "--max-tokens N", {"type": int}, "cap the answer's tokens (default %d: a model that repeats itself "
     "ends)" % CHAT_MAX_TOKENS),
    ("complete", "--max-tokens N", {"type": int}, _SERVER_CAP % "n_predict (with --openai: max_tokens)"),
    ("infill", "--max-tokens N", {"type": int}, _SERVER_CAP % "n_predict"),
    (_ANSWERS, "--temperature T", {"type": float}, "sampling temperature"),
    (_ANSWERS, "--stop TEXT", {"action": "append", "type": _unescape}, "end the answer where TEXT would appear "
     "(repeatable; \\n is a newline, \\t a tab, \\\\ a backslash)"),
    (_ANSWERS, "--ignore-eos", {"action": "store_true"}, "go on past the model's end of text (up to --max-tokens)"),
    (_ANSWERS, "--param KEY=VALUE", {"action": "append", "type": _body_param}, "put KEY in the request body: "
     "VALUE as JSON when it parses, else as a string (repeatable; applied last, so it wins over the options above)"),
    (_ANSWERS, "--json", {"action": "store_true"}, "print the whole completion as JSON"),
    ("slots", "--json", {"action": "store_true"}, "print the slots as the server gives them (JSON)"),
    ("slots", "--watch SECONDS", {"type": float, "nargs": "?", "const": float("inf")}, "look every poll for "
     "SECONDS (without: until Ctrl-C): redrawn on a terminal, else a line per change"),
    ("models", "--watch", {"action": "store_true"}, "print the router's model events as they come (until Ctrl-C)"),
    ("tokens", "text", {"nargs": "?"}, "the text; without it, read stdin (on a terminal: until Ctrl-D)"),
)  # type: Tuple[Tuple[str, str, Dict[str, Any], str], ...]  # fmt: skip


_CLI_EPILOG = """\
Each command has its own options and examples: loopclient COMMAND --help.
The options above go before or after the command.

address: --socket PATH or --url URL, else $LLAMA_SERVER (a path or a URL), else %s.
waits: chat, complete and infill wait up to %g s for an absent or loading server, and up to %g s for a busy
  slot (--wait SECONDS sets both); the other commands ask once.
exit status: 0 done; 1 an error, one line on stderr saying what happened and what to do; 2 bad usage (an
  option, address, prompt or limit); 130 interrupted (Ctrl-C, which closes the connection first).

examples:
  loopclient --socket /tmp/loopclient-llama-$(id -u)/demo.sock chat "Name three colours." --stop '\\n'
  loopclient --url http://127.0.0.1:8080 slots --watch
  LLAMA_SERVER=/run/llama.sock loopclient health
"""

#: The end of each command's --help.
_CLI_EXAMPLES = """\
examples:
%s

The global options (--socket, --url, --model, --api-key, --wait, -v) go
before or after the command: loopclient --help."""

#: Each command, ``name: its one-line help``, and the examples its --help ends with (see ``_commands``).
_CLI_COMMANDS = """\
chat: stream an answer (PROMPT, stdin, or a conversation)
  loopclient chat "Name three colours." --stop '\\n'
  git diff | loopclient chat --system "Review this diff." --max-tokens 400
  loopclient chat --session my-talk   (a conversation; behind a front, each run with the key on one server)
complete: stream the text that follows PROMPT (/completion)
  loopclient complete "The sky is" --max-tokens 8
  loopclient complete --openai "Once upon a time" --max-tokens 40 --stop '\\n'
  loopclient complete --json --param n_probs=3 "The sky is" --max-tokens 4
infill: stream the middle between --prefix and --suffix (/infill)
  loopclient infill --prefix 'def add(a, b):' --suffix '    return c' --max-tokens 16
  loopclient infill --prefix @before.py --suffix @after.py
  head -n 40 app.py | loopclient infill --prefix - --suffix @rest.py
slots: show the server's slots
  loopclient slots
  loopclient slots --watch 60 > slots.log
  loopclient slots --json
health: print /health as JSON
  loopclient health
  loopclient --url http://127.0.0.1:8080 health
props: print /props as JSON
  loopclient props
  loopclient --model alpha props
models: show the models (a router's, with their status)
  loopclient models
  loopclient --model alpha models --watch
tokens: count the tokens of TEXT (or stdin)
  loopclient tokens "Name three colours."
  loopclient tokens < prompt.txt
"""


def _commands() -> List[Tuple[str, str, str]]:
    """(name, one-line help, examples) of each command in ``_CLI_COMMANDS``."""
    return re.findall(r"^(\w+): (.+)\n((?:  .+\n)+)", _CLI_COMMANDS, re.M)


def _parser(prog: str = "loopclient") -> Any:
    """The command line's parser, its help in the words of ``prog`` (the name it was run by): each command
    with its options (``_OPTIONS``), the global ones hidden from each command's own help.  A usage error
    is one line that says where the help is (exit 2)."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            self.exit(2, "loopclient: error: %s; see %s --help\n" % (message, self.prog))

    def words(text: str) -> str:
        return text.replace("loopclient ", prog + " ")

    def add(command: Any, name: str) -> Any:  # the options of command ``name`` ("": the parser's)
        group = None  # the options marked "exclusive": one of them at most
        for where, spec, keywords, told in _OPTIONS:
            if where and name not in where.split():
                continue
            flags, target = spec.split(), command
            if keywords.get("exclusive"):
                keywords = {k: v for k, v in keywords.items() if k != "exclusive"}
                target = group = group or command.add_mutually_exclusive_group()
            if flags[-1].isupper():
                keywords = dict(keywords, metavar=flags.pop())
            if not where:  # (no default: a command's would undo the value given before it)
                keywords = dict(keywords, default=argparse.SUPPRESS)
                told = argparse.SUPPRESS if name else told
            target.add_argument(*flags, help=told, **keywords)
        return command

    raw = argparse.RawDescriptionHelpFormatter
    epilog = words(_CLI_EPILOG % (DEFAULT_ADDRESS, CLI_LOAD_WAIT, _CLI_BUSY_WAIT))
    about = "Talk to llama.cpp's llama-server over a Unix socket or TCP."
    parser = add(Parser(prog=prog, description=about, epilog=epilog, formatter_class=raw), "")
    parser.add_argument("--version", action="version", version="loopclient " + __version__)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary, examples in _commands():
        about, epilog = summary[0].upper() + summary[1:] + ".", words(_CLI_EXAMPLES % examples.rstrip())
        add(commands.add_parser(name, help=summary, description=about, epilog=epilog, formatter_class=raw), name)
    return parser


def _log_to(err: Any, verbose: int) -> Callable[[], None]:
    """``-v``: the ``loopclient`` logger's records on ``err`` (INFO; ``-vv`` DEBUG), each on a line of its
    own (on a terminal, over the status line, which the next status redraws).  Returns what undoes it."""
    import logging

    class Handler(logging.StreamHandler):  # type: ignore[type-arg]
        def emit(self, record: Any) -> None:
            if _isatty(self.stream):
                self.stream.write("\r\x1b[K")
            logging.StreamHandler.emit(self, record)

    handler = Handler(err)
    handler.setFormatter(logging.Formatter("loopclient: %(levelname)s: %(message)s"))
    log = logging.getLogger("loopclient")
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO if verbose == 1 else logging.DEBUG)
    log.propagate = False

    def undo() -> None:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate

    return undo


def _cli_limits(limits: Limits, option: str, **changes: Any) -> Limits:
    """``limits`` with ``changes``; what ``Limits`` refuses is a usage error that names the ``option``."""
    try:
        return limits.replace(**changes)
    except (TypeError, ValueError) as exc:
        text = str(exc)
        if text.startswith("Limits."):
            text = text.partition(" ")[2]
        raise ValueError("%s: %s" % (option, text)) from None


def _read_stdin(what: str) -> str:
    """Standard input, to its end; on a terminal, say so first (on stderr) rather than wait in silence."""
    if _isatty(sys.stdin):
        sys.stderr.write("loopclient: reading %s from the terminal: end it with Ctrl-D (Ctrl-C to quit)\n" % what)
        sys.stderr.flush()
    return str(sys.stdin.read())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    name = sys.argv[0] if argv is None and sys.argv else ""  # the name it was run by, for its help
    parser = _parser("python3 " + name if name.endswith(".py") else "loopclient")
    try:
        args = parser.parse_args(argv)
        if not args.command:
            parser.error("a COMMAND is required (%s)" % ", ".join(c[0] for c in _commands()))
    except SystemExit as exc:  # usage errors (2), --help and --version (0)
        return exc.code if isinstance(exc.code, int) else 2
    model = getattr(args, "model", None) or os.environ.get("LLAMA_MODEL") or None
    try:
        taken = {"chat": ("messages",), "complete": ("prompt",), "infill": ("input_prefix", "input_suffix")}
        params = _answer_params(args, taken[args.command]) if args.command in taken else {}
        client = _cli_client(args, model)
    except (ValueError, TypeError) as exc:
        return _refused(exc)
    undo = _log_to(sys.stderr, args.verbose) if getattr(args, "verbose", 0) else None
    try:
        with client:
            return _command(client, args, params, model)
    except LoopError as exc:
        sys.stderr.write(_describe(exc, getattr(args, "slot", 0) is None) + "\n")
        return 1
    except (ValueError, TypeError) as exc:  # a call refused what the options made of it (--slot -1, --param)
        return _refused(exc)
    except KeyboardInterrupt:
        sys.stderr.write("\nloopclient: interrupted\n")
        return 130
    finally:
        if undo is not None:
            undo()


def _refused(exc: Exception) -> int:
    """Say why the options were refused; the exit status: 2 (usage), or 1 when this Python is at fault
    (no ``ssl`` module for an https:// address)."""
    if isinstance(exc.__cause__, ImportError):
        sys.stderr.write("loopclient: %s\n" % exc)
        return 1
    sys.stderr.write("loopclient: error: %s\n" % exc)
    return 2


def _cli_client(args: Any, model: Optional[str]) -> Client:
    """The client the options describe: the address, the key, --thinking-cap and --wait in its limits
    (without --wait, ``load_wait`` is at most ``CLI_LOAD_WAIT``)."""
    address = _cli_address(getattr(args, "socket", None), getattr(args, "url", None))
    api_key = getattr(args, "api_key", None) or os.environ.get("LLAMA_API_KEY") or None
    limits = Limits()
    if getattr(args, "thinking_cap", None) is not None:
        limits = _cli_limits(limits, "--thinking-cap", thinking_cap=args.thinking_cap)
    if getattr(args, "wait", None) is not None:
        limits = _cli_limits(limits, "--wait", load_wait=args.wait, busy_wait=args.wait)
    else:
        limits = limits.replace(load_wait=min(limits.load_wait, CLI_LOAD_WAIT))
    session = getattr(args, "session", None)
    try:
        _session_key(session)
    except ValueError as exc:
        raise ValueError("--session: %s" % exc) from None
    if getattr(args, "no_session", False):
        limits = limits.replace(session=False)
    return Client(address, limits=limits, api_key=api_key, model=model, session=session)


def _cli_address(path: Optional[str], url: Optional[str]) -> Optional[str]:
    """``--socket PATH`` or ``--url URL``; a URL given to ``--socket`` or a value without a scheme given to
    ``--url`` is ``ValueError`` saying what was meant."""
    if path is not None and url is not None:
        raise ValueError("--socket and --url name the server twice: give one of them")
    if path is not None and "://" in path and not path.startswith("unix://"):
        raise ValueError("--socket takes a socket path, and %s is a URL: use --url %s" % (path, path))
    if url and "://" not in url:
        if url.startswith(("/", ".")) or url.endswith(".sock"):
            raise ValueError("--url takes http(s)://host:port, and %s is a path: use --socket %s" % (url, url))
        raise ValueError("--url %s has no scheme: use --url http://%s (a socket path goes to --socket)" % (url, url))
    return path if path is not None else url


def _command(client: Client, args: Any, params: Dict[str, Any], model: Optional[str]) -> int:
    """Run the command ``args`` names with ``client``; returns the exit status."""
    if args.command == "chat":
        return _chat(client, args, params)
    if args.command in ("complete", "infill"):
        return _complete(client, args, params)
    if args.command == "slots" and args.json:
        if args.watch is not None:
            raise ValueError("--json shows the slots once: without --watch")
        print(json.dumps([s.raw for s in client.slots()], indent=2, ensure_ascii=False))
    elif args.command == "slots":
        _slots(client, sys.stdout, args.watch)
    elif args.command == "health":
        print(json.dumps(client.health()))
    elif args.command == "props":
        print(json.dumps(client.props(), indent=2, ensure_ascii=False))
    elif args.command == "models" and args.watch:
        _watch_models(client, sys.stdout, model)
    elif args.command == "models":
        print(_models_table(client.models()))
    else:
        text = args.text if args.text is not None else _read_stdin("the text")
        print(len(client.tokenize(text)))
    return 0


def _know_slots(client: Client, slot: Optional[int]) -> None:
    """``--slot N``: ask ``/props`` first, so that the library refuses a slot past the server's before
    anything is sent (llama-server would take it modulo its slots).  A ``/props`` that fails or says no
    ``total_slots`` (a router's own) changes nothing: the request itself then says what is wrong."""
    if slot is None:
        return
    try:
        client.props(timeout=min(client.limits.liveness, 5.0))
    except LoopError:
        pass


def _chat(client: Client, args: Any, params: Dict[str, Any]) -> int:
    if not {"max_tokens", "max_completion_tokens", "n_predict"} & set(params):  # no cap given: the default
        params["max_tokens"] = CHAT_MAX_TOKENS
    if args.resumable:
        params["resumable"] = True
    _know_slots(client, args.slot)
    history = [{"role": "system", "content": args.system}] if args.system else []  # type: List[Dict[str, Any]]
    prompt = args.prompt
    interactive = prompt is None and sys.stdin.isatty()
    if not interactive:
        prompt = _prompt(prompt, sys.stdin.read if prompt is None else None)
    while True:
        if interactive:
            prompt = _read_turn()
            if prompt is None:
                return 0
            if not prompt.strip():
                continue
        history.append({"role": "user", "content": prompt})
        completion = _answer(client, args, functools.partial(client.stream, history), params)
        if not interactive:
            return 0
        history.append(_assistant_turn(completion))


def _prompt(given: Optional[str], read: Optional[Callable[[], str]]) -> str:
    """The prompt: ``given``, or what ``read`` returns (stdin); an empty one (or only white space) is a
    ``ValueError``: the server would generate from nothing, for as long as the cap allows."""
    prompt = given if read is None else read()
    assert prompt is not None
    if not prompt.strip():
        if read is None:
            raise ValueError("PROMPT is empty: give some text, or leave it out to read stdin")
        raise ValueError("the prompt read from stdin is empty: give PROMPT, or pipe some text")
    return prompt


def _read_turn() -> Optional[str]:
    """The user's next line at the ``> `` prompt; ``None`` at the end of input (Ctrl-D)."""
    sys.stderr.write("> ")
    sys.stderr.flush()
    line = sys.stdin.readline()
    if not line:
        sys.stderr.write("\n")
        return None
    return line.rstrip("\n")


def _assistant_turn(completion: Completion) -> Dict[str, Any]:
    """The answer as the conversation's next message: its text, reasoning and tool calls."""
    turn = {"role": "assistant", "content": completion.content}  # type: Dict[str, Any]
    if completion.reasoning:
        turn["reasoning_content"] = completion.reasoning
    if completion.tool_calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in completion.tool_calls
        ]
    return turn


def _answer(client: Client, args: Any, stream: Callable[..., Stream], params: Dict[str, Any]) -> Completion:
    """One answer, ``stream(slot=..., **params)``: its text on stdout as it comes, the waits on stderr, then
    a newline and the figures on stderr (``--json``: the completion as JSON instead)."""
    console = _Console(sys.stdout, sys.stderr, client, args.slot is None)
    show = functools.partial(console.event, show_text=not args.json)
    completion = _consume(stream(slot=args.slot, **params), show)
    console.clear()
    if args.json:
        sys.stdout.write(_completion_json(completion) + "\n")
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        cap = next((params[k] for k in ("max_tokens", "max_completion_tokens", "n_predict") if k in params), None)
        sys.stderr.write(console.figures(completion, cap) + "\n")
    sys.stderr.flush()
    return completion


def _text_arg(value: Optional[str], option: str) -> str:
    """``infill``'s ``--prefix`` and ``--suffix``: the TEXT as given, ``@FILE`` a file's text, ``-`` stdin's,
    ``@@...`` the text ``@...``; None: nothing.  A value that names an existing file (what the options took
    before they took text) is read as that file, with a line on stderr that says to write ``@FILE``."""
    if value is None:
        return ""
    if value == "-":
        return sys.stdin.read()
    if value.startswith("@@"):
        return value[1:]
    if value.startswith("@"):
        return _read_file(value[1:])
    if os.path.isfile(value):
        sys.stderr.write(
            "loopclient: %s %s names a file, read as before: write %s @%s for a file (a TEXT is sent as it is)\n"
            % (option, value, option, value)
        )
        return _read_file(value)
    return value


def _read_file(name: str) -> str:
    try:
        with open(name, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as exc:
        raise ValueError("cannot read %s: %s" % (name, exc.strerror or exc)) from None


def _complete(client: Client, args: Any, params: Dict[str, Any]) -> int:
    """``complete`` and ``infill``: llama-server's own endpoints, whose token cap is ``n_predict``.  What the
    texts or the body functions refuse (an empty prompt, --param input_extra) is a usage error (``main``)."""
    openai = args.command == "complete" and args.openai  # /v1/completions: its token cap is max_tokens
    if "max_tokens" in params and not openai:  # --param n_predict, applied last, wins over --max-tokens
        params.setdefault("n_predict", params.pop("max_tokens"))
    if args.command == "complete":
        read = (lambda: _read_stdin("the prompt")) if args.prompt is None else None
        call = client.stream_complete_openai if openai else client.stream_complete
        stream = functools.partial(call, _prompt(args.prompt, read))  # type: Callable[..., Stream]
    else:
        texts = _text_arg(args.prefix, "--prefix"), _text_arg(args.suffix, "--suffix")
        stream = functools.partial(client.stream_infill, *texts, extra=params.pop("input_extra", None))
    _know_slots(client, args.slot)
    _answer(client, args, stream, params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
