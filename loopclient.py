#!/usr/bin/env python3
"""loopclient: a one-file, standard-library client for llama.cpp's ``llama-server``.

Copy this file into your project; it needs nothing but Python 3.8 or newer.  It speaks raw HTTP/1.1 over
a Unix domain socket (or plain TCP), reads streamed chat completions as Server-Sent Events, assembles the
deltas, waits out busy slots and loading servers by polling ``/slots``, and queues this client's requests
per slot.  There is no total deadline: every wait has its own budget (see ``Limits``).

Example::

    import loopclient as lc
    with lc.Client("/run/llama.sock") as client:
        reply = client.chat([{"role": "user", "content": "Hi"}], max_tokens=64,
                            on_event=lambda ev: print(ev))
        print(reply.content)

Threading model: a ``Client`` is shared by any number of threads.  Each streamed request runs in the
thread that iterates its ``ChatStream`` (``chat()`` iterates for you).  ``ChatStream.cancel()`` may be
called from any thread; it shuts the request's sockets down, which wakes the iterating thread at once.
The only threads the library starts are short-lived ``/slots`` pollers, at most one per client at a time.

Sections:
    1. Errors and events
    2. HTTP/1.1 without sockets: request encoding, response head, body framing
    3. Server-Sent Events decoder
    4. Delta assembler
    5. Transport: the only code that touches ``socket``
    6. Slot gates and the shared /slots poller
    7. The client and its streams
    8. Command line
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

# typing is only read by type checkers: importing it would cost more than socket, json and threading.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Set, Tuple, TypeVar, Union

__version__ = "0.1.0"
__license__ = "MIT"

__all__ = [
    "Client",
    "ChatStream",
    "Limits",
    "Completion",
    "ToolCallResult",
    "Choice",
    "Slot",
    "Queued",
    "Waiting",
    "Retrying",
    "Reasoning",
    "Content",
    "ToolCall",
    "ThinkingCapped",
    "Progress",
    "Chunk",
    "LoopError",
    "BusyError",
    "WaitTimeoutError",
    "LoadTimeoutError",
    "StalledError",
    "WedgedSlotError",
    "StreamClosedError",
    "ThinkingOverrunError",
    "HTTPStatusError",
    "ServerError",
    "ConnectError",
    "ProtocolError",
    "CancelledError",
    "ResponseReader",
    "ResponseHead",
    "ChunkedDecoder",
    "SSEDecoder",
    "Assembler",
    "encode_request",
    "parse_address",
    "main",
]

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

_USER_AGENT = "loopclient/" + __version__


# =====================================================================================================
# 1. Errors and events
# =====================================================================================================


class LoopError(Exception):
    """Root of every error the server or the connection causes."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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
    """The server stayed unreachable or loading for ``load_wait``; ``__cause__`` is the last failure."""


class StalledError(_BudgetError):
    """Silence: no head within ``idle_grace`` on an idle slot, or no progress within ``liveness``."""


class StreamClosedError(LoopError):
    """The connection closed mid-response, mid-chunk or before a ``finish_reason``."""


class ThinkingOverrunError(LoopError):
    """Reasoning passed the cap and the server refused, failed, or ran past ``thinking_overrun``."""

    def __init__(self, message: str, tokens: int = 0) -> None:
        super().__init__(message)
        self.tokens = tokens


class HTTPStatusError(LoopError):
    """A non-200 status that is not retried; ``status``, ``message`` (from the envelope), ``body``."""

    def __init__(self, status: int, message: str, body: bytes = b"") -> None:
        super().__init__("HTTP %d: %s" % (status, message))
        self.status = status
        self.message = message
        self.body = body


class ServerError(LoopError):
    """An error event inside the stream; ``code``, ``message``, ``type``, ``error`` (the raw object)."""

    def __init__(self, code: Optional[int], message: str, type: Optional[str] = None, error: Any = None) -> None:
        super().__init__("server error %s: %s" % (code, message))
        self.code = code
        self.message = message
        self.type = type
        self.error = error


class ConnectError(LoopError):
    """A single-shot call could not reach the server; ``address`` as given, ``__cause__`` the OS error."""

    def __init__(self, message: str, address: str = "") -> None:
        super().__init__(message)
        self.address = address


class ProtocolError(LoopError):
    """Malformed HTTP, chunked framing, SSE or JSON, or a line, head or body over its cap."""


class CancelledError(LoopError):
    """``cancel()`` was called; the thread iterating the stream hears it."""


class WedgedSlotError(StalledError):
    """A processing slot stopped moving for ``wedge_wait``: the server is wedged and must be restarted.

    ``slot`` and ``task`` name the slot and its task (``task`` is None when the server does not say),
    ``seconds`` how long nothing moved.  A subclass of ``StalledError`` (and so of ``TimeoutError``).
    """

    def __init__(self, message: str, slot: Optional[int] = None, task: Optional[int] = None, seconds: float = 0.0):
        super().__init__(message, seconds)
        self.slot = slot
        self.task = task
        self.seconds = seconds


# -- Value objects -------------------------------------------------------------------------------------
#
# Plain classes on one small base, as h11's events are: the fields are the ``__slots__``, ``__init__`` is
# written out (so ``help()`` and ``inspect.signature()`` show the real fields), and the base gives
# immutability, ``==``, ``hash``, ``repr``, ``replace()`` and a ``__reduce__`` that rebuilds through
# ``__init__`` (so ``copy``, ``deepcopy`` and ``pickle`` work).  ``dataclasses`` would cost more to import
# than ``socket``, ``json`` and ``threading`` together.

_set = object.__setattr__
if TYPE_CHECKING:
    _V = TypeVar("_V", bound="_Value")


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
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined, no-any-return]

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
    """The request waits in this client's queue: ``ahead`` requests of this client come before it on its
    slot, the one in flight included (the first waiter hears ``Queued(1)``).  Heard again, at most once per
    ``Limits.poll``, when ``ahead`` has shrunk; never repeated or increased."""

    __slots__ = ("ahead",)
    __match_args__ = __slots__
    ahead: int

    def __init__(self, ahead: int) -> None:
        _set(self, "ahead", ahead)


class Waiting(_Value):
    """``/slots`` was asked because the response head had not started to arrive.  ``slot_busy``: the slot
    is processing (with ``slot=None``: every slot that is not wedged is).  ``wedged``: the slot is
    processing yet nothing in it has moved for ``Limits.wedge_wait``."""

    __slots__ = ("slot_busy", "wedged")
    __match_args__ = __slots__
    slot_busy: bool
    wedged: bool

    def __init__(self, slot_busy: bool, wedged: bool = False) -> None:
        _set(self, "slot_busy", slot_busy)
        _set(self, "wedged", wedged)


class Retrying(_Value):
    """Nothing was delivered yet; the request is sent again after ``delay`` seconds (``attempt`` counts
    from 1; ``reason`` says what failed)."""

    __slots__ = ("attempt", "delay", "reason")
    __match_args__ = __slots__
    attempt: int
    delay: float
    reason: str

    def __init__(self, attempt: int, delay: float, reason: str) -> None:
        _set(self, "attempt", attempt)
        _set(self, "delay", delay)
        _set(self, "reason", reason)


class Reasoning(_Value):
    """A ``reasoning_content`` delta of choice ``choice``."""

    __slots__ = ("text", "choice")
    __match_args__ = __slots__
    text: str
    choice: int

    def __init__(self, text: str, choice: int = 0) -> None:
        _set(self, "text", text)
        _set(self, "choice", choice)


class Content(_Value):
    """A ``content`` delta of choice ``choice``."""

    __slots__ = ("text", "choice")
    __match_args__ = __slots__
    text: str
    choice: int

    def __init__(self, text: str, choice: int = 0) -> None:
        _set(self, "text", text)
        _set(self, "choice", choice)


class ToolCall(_Value):
    """A tool-call delta of choice ``choice``: ``index`` keys the call; ``id`` and ``name`` as this delta
    carries them (None when it does not), ``arguments`` its fragment of the JSON arguments."""

    __slots__ = ("index", "id", "name", "arguments", "choice")
    __match_args__ = __slots__
    index: int
    id: Optional[str]
    name: Optional[str]
    arguments: str
    choice: int

    def __init__(self, index: int, id: Optional[str], name: Optional[str], arguments: str, choice: int = 0) -> None:
        _set(self, "index", index)
        _set(self, "id", id)
        _set(self, "name", name)
        _set(self, "arguments", arguments)
        _set(self, "choice", choice)


class ThinkingCapped(_Value):
    """The server accepted the request to end reasoning; ``tokens`` is the count at which the cap fired."""

    __slots__ = ("tokens",)
    __match_args__ = __slots__
    tokens: int

    def __init__(self, tokens: int) -> None:
        _set(self, "tokens", tokens)


class Progress(_Value):
    """Prompt processing progress (the request asked for ``return_progress``): ``processed`` of ``total``
    prompt tokens, ``cache`` of them from the cache, ``time_ms`` spent.  Not delivered output: an error
    after only ``Progress`` events is still retried."""

    __slots__ = ("processed", "total", "cache", "time_ms")
    __match_args__ = __slots__
    processed: int
    total: int
    cache: int
    time_ms: float

    def __init__(self, processed: int, total: int, cache: int, time_ms: float) -> None:
        _set(self, "processed", processed)
        _set(self, "total", total)
        _set(self, "cache", cache)
        _set(self, "time_ms", time_ms)


class Chunk(_Value):
    """The parsed payload of one data event, as the server sent it (only with ``raw_chunks=True``); it
    comes before the events derived from it."""

    __slots__ = ("data",)
    __match_args__ = __slots__
    data: Dict[str, Any]

    def __init__(self, data: Dict[str, Any]) -> None:
        _set(self, "data", data)


if TYPE_CHECKING:  # pragma: no cover
    Event = Union[Queued, Waiting, Retrying, Reasoning, Content, ToolCall, ThinkingCapped, Progress, Chunk]


# The assembler builds the two text events per token: object.__new__ and the slot descriptors directly,
# without the call into __init__ (TestAssemblerPaths.test_fast_and_general_paths_agree keeps them equal).
_new_object = object.__new__
_set_content_text = Content.__dict__["text"].__set__
_set_content_choice = Content.__dict__["choice"].__set__
_set_reasoning_text = Reasoning.__dict__["text"].__set__
_set_reasoning_choice = Reasoning.__dict__["choice"].__set__


def _new_content(text: str) -> Content:
    event = _new_object(Content)
    _set_content_text(event, text)
    _set_content_choice(event, 0)
    return event


def _new_reasoning(text: str) -> Reasoning:
    event = _new_object(Reasoning)
    _set_reasoning_text(event, text)
    _set_reasoning_choice(event, 0)
    return event


class ToolCallResult(_Value):
    """One assembled tool call: ``id`` and ``name`` as first sent, ``arguments`` all fragments joined."""

    __slots__ = ("id", "name", "arguments")
    __match_args__ = __slots__
    id: Optional[str]
    name: Optional[str]
    arguments: str

    def __init__(self, id: Optional[str], name: Optional[str], arguments: str) -> None:
        _set(self, "id", id)
        _set(self, "name", name)
        _set(self, "arguments", arguments)

    def to_dict(self) -> Dict[str, Any]:
        """``{"id", "name", "arguments"}``."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


class Choice(_Value):
    """One choice of a completion (``n`` > 1 gives several): its assembled ``content``, ``reasoning``,
    ``tool_calls`` and ``finish_reason``; ``logprobs`` and ``reasoning_logprobs`` are the entries the server
    sent (dicts, in order), or None when it sent none."""

    __slots__ = ("index", "content", "reasoning", "tool_calls", "finish_reason", "logprobs", "reasoning_logprobs")
    __match_args__ = __slots__
    index: int
    content: str
    reasoning: str
    tool_calls: List[ToolCallResult]
    finish_reason: Optional[str]
    logprobs: Optional[List[Dict[str, Any]]]
    reasoning_logprobs: Optional[List[Dict[str, Any]]]

    def __init__(
        self,
        index: int,
        content: str,
        reasoning: str,
        tool_calls: List[ToolCallResult],
        finish_reason: Optional[str],
        logprobs: Optional[List[Dict[str, Any]]],
        reasoning_logprobs: Optional[List[Dict[str, Any]]] = None,
    ) -> None:
        _set(self, "index", index)
        _set(self, "content", content)
        _set(self, "reasoning", reasoning)
        _set(self, "tool_calls", tool_calls)
        _set(self, "finish_reason", finish_reason)
        _set(self, "logprobs", logprobs)
        _set(self, "reasoning_logprobs", reasoning_logprobs)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict of the fields."""
        doc = {name: getattr(self, name) for name in self.__match_args__}
        doc["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return doc


class Completion(_Value):
    """The assembled answer of one streamed request.

    ``content``, ``reasoning``, ``tool_calls`` (in index order) and ``finish_reason`` are those of the
    first choice; ``choices`` holds every choice (one even for a single answer).  ``usage`` and ``timings``
    are the server's dicts (None when it sent none), ``reasoning_tokens`` counts the chunks that carried
    reasoning, ``thinking_capped`` says whether the thinking cap fired.
    """

    __slots__ = (
        "id",
        "model",
        "content",
        "reasoning",
        "tool_calls",
        "finish_reason",
        "usage",
        "timings",
        "reasoning_tokens",
        "thinking_capped",
        "choices",
    )
    __match_args__ = __slots__
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

    def __init__(
        self,
        id: Optional[str],
        model: Optional[str],
        content: str,
        reasoning: str,
        tool_calls: List[ToolCallResult],
        finish_reason: Optional[str],
        usage: Optional[Dict[str, Any]],
        timings: Optional[Dict[str, Any]],
        reasoning_tokens: int = 0,
        thinking_capped: bool = False,
        choices: Optional[Sequence[Choice]] = None,
    ) -> None:
        """``choices`` defaults to the one choice that the other fields describe."""
        _set(self, "id", id)
        _set(self, "model", model)
        _set(self, "content", content)
        _set(self, "reasoning", reasoning)
        _set(self, "tool_calls", tool_calls)
        _set(self, "finish_reason", finish_reason)
        _set(self, "usage", usage)
        _set(self, "timings", timings)
        _set(self, "reasoning_tokens", reasoning_tokens)
        _set(self, "thinking_capped", thinking_capped)
        if choices is None:
            choices = (Choice(0, content, reasoning, tool_calls, finish_reason, None),)
        _set(self, "choices", tuple(choices))

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

    __slots__ = ("id", "is_processing", "raw", "task", "decoded", "prompt_processed")
    __match_args__ = __slots__
    _hidden = ("raw",)
    id: int
    is_processing: bool
    raw: Dict[str, Any]
    task: Optional[int]
    decoded: Optional[int]
    prompt_processed: Optional[int]

    def __init__(
        self,
        id: int,
        is_processing: bool,
        raw: Dict[str, Any],
        task: Optional[int] = None,
        decoded: Optional[int] = None,
        prompt_processed: Optional[int] = None,
    ) -> None:
        _set(self, "id", id)
        _set(self, "is_processing", is_processing)
        _set(self, "raw", raw)
        _set(self, "task", task)
        _set(self, "decoded", decoded)
        _set(self, "prompt_processed", prompt_processed)


_INT_LIMITS = ("queue_len", "thinking_cap", "thinking_overrun", "max_line", "max_body")
_SECONDS_LIMITS = ("poll", "liveness", "busy_wait", "load_wait", "idle_grace", "wedge_wait")


class Limits(_Value):
    """How long each wait may last and how much a response may hold.  Immutable; ``replace()`` makes a
    changed copy.  Times are seconds (int or float), sizes bytes, counts plain ints.  A value of the wrong
    type is ``TypeError``, a negative one ``ValueError``; ``poll``, ``liveness``, ``max_line`` and
    ``max_body`` must be greater than zero.

    queue_len        8      requests of this client that may wait behind the one in flight on a slot;
                            the next is refused with ``BusyError``
    poll             1.0    how often ``/slots`` is asked while a response head is awaited
    liveness         30.0   the longest silence once a response has started: ``StalledError``
    busy_wait        600.0  how long a busy slot is waited out before the first byte: ``WaitTimeoutError``
    load_wait        120.0  how long an unreachable or loading server is waited out: ``LoadTimeoutError``
    idle_grace       10.0   how long an idle slot may leave the request unanswered: ``StalledError``
    thinking_cap     None   reasoning tokens (chunks) before the client asks the server to end reasoning
    thinking_overrun 256    reasoning tokens tolerated after that: ``ThinkingOverrunError``
    max_line         1 MiB  longest SSE line and event: ``ProtocolError``
    max_body         16 MiB longest non-streamed body: ``ProtocolError``
    wedge_wait       120.0  how long a processing slot may show no progress before it counts as wedged:
                            ``WedgedSlotError`` (None: never)
    """

    __slots__ = (
        "queue_len",
        "poll",
        "liveness",
        "busy_wait",
        "load_wait",
        "idle_grace",
        "thinking_cap",
        "thinking_overrun",
        "max_line",
        "max_body",
        "wedge_wait",
    )
    __match_args__ = __slots__
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

    def __init__(
        self,
        queue_len: int = 8,
        poll: float = 1.0,
        liveness: float = 30.0,
        busy_wait: float = 600.0,
        load_wait: float = 120.0,
        idle_grace: float = 10.0,
        thinking_cap: Optional[int] = None,
        thinking_overrun: int = 256,
        max_line: int = 1024 * 1024,
        max_body: int = 16 * 1024 * 1024,
        wedge_wait: Optional[float] = 120.0,
    ) -> None:
        values = locals()
        for name in _INT_LIMITS:
            value = values[name]
            if value is None and name == "thinking_cap":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError("Limits.%s must be an int, not %r" % (name, value))
            if value < 0:
                raise ValueError("Limits.%s must not be negative, got %r" % (name, value))
        for name in _SECONDS_LIMITS:
            value = values[name]
            if value is None and name == "wedge_wait":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError("Limits.%s must be a number of seconds, not %r" % (name, value))
            if not value >= 0:  # also refuses NaN
                raise ValueError("Limits.%s must not be negative, got %r" % (name, value))
        for name in ("poll", "liveness", "max_line", "max_body"):
            if not values[name] > 0:
                raise ValueError("Limits.%s must be greater than zero" % name)
        for name in self.__match_args__:
            _set(self, name, values[name])


# =====================================================================================================
# 2. HTTP/1.1 without sockets
# =====================================================================================================


def _check_header_text(what: str, text: str) -> None:
    if "\r" in text or "\n" in text or "\0" in text:
        raise ValueError("%s must not contain CR, LF or NUL" % what)


def encode_request(
    method: str,
    path: str,
    host: str,
    headers: Sequence[Tuple[str, str]] = (),
    body: Optional[bytes] = None,
) -> bytes:
    """Encode one HTTP/1.1 request.  A CR, LF or NUL in the path, a header name or value is ``ValueError``."""
    _check_header_text("the request path", path)
    if not path.startswith("/") or " " in path:
        raise ValueError("the request path must start with / and hold no space: %r" % path)
    _check_header_text("the Host header", host)
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: " + host]
    for name, value in headers:
        _check_header_text("a header name", name)
        if not name or ":" in name or " " in name:
            raise ValueError("invalid header name %r" % name)
        # The value may hold a secret (Authorization): never echo it in the message.
        _check_header_text("the value of header %s" % name, value)
        lines.append("%s: %s" % (name, value))
    if body is not None:
        lines.append("Content-Length: %d" % len(body))
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + body if body is not None else head


class ResponseHead:
    """A parsed status line and header block."""

    __slots__ = ("version", "status", "reason", "headers")

    def __init__(self, version: str, status: int, reason: str, headers: List[Tuple[str, str]]) -> None:
        self.version = version
        self.status = status
        self.reason = reason
        #: (lower-case name, value) pairs in arrival order
        self.headers = headers

    def get(self, name: str) -> Optional[str]:
        """The last value of header ``name`` (case-insensitive), or None."""
        name = name.lower()
        found = None
        for key, value in self.headers:
            if key == name:
                found = value
        return found

    def get_all(self, name: str) -> List[str]:
        name = name.lower()
        return [value for key, value in self.headers if key == name]

    def __repr__(self) -> str:
        return "ResponseHead(%s %d %s)" % (self.version, self.status, self.reason)


_TOKEN_CHARS = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")


def _parse_status_line(line: bytes) -> List[bytes]:
    """[version, code, reason?] of a status line; ``ProtocolError`` when it is not HTTP/1.x NNN."""
    status_line = line.rstrip(b"\r")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise ProtocolError("malformed status line %r" % status_line[:80])
    code = parts[1]
    if len(code) != 3 or not code.isdigit():
        raise ProtocolError("malformed status code in %r" % status_line[:80])
    return parts


def _parse_head(block: bytes, max_headers: int) -> ResponseHead:
    """Parse a head block (without its blank line).  Bare LF line ends are accepted."""
    lines = block.split(b"\n")
    if len(lines) - 1 > max_headers:
        raise ProtocolError("response has more than %d header lines" % max_headers)
    parts = _parse_status_line(lines[0])
    code = parts[1]
    reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
    headers = []
    for raw in lines[1:]:
        line = raw[:-1] if raw.endswith(b"\r") else raw
        colon = line.find(b":")
        if colon <= 0:
            raise ProtocolError("malformed header line %r" % line[:80])
        name = line[:colon]
        if not _TOKEN_CHARS.issuperset(name):
            raise ProtocolError("malformed header name %r" % name[:80])
        value = line[colon + 1 :].strip(b" \t")
        if b"\r" in value or b"\0" in value:
            raise ProtocolError("header %r holds a CR or NUL" % name[:80])
        headers.append((name.decode("ascii").lower(), value.decode("latin-1")))
    return ResponseHead(parts[0].decode("ascii"), int(code), reason, headers)


class ChunkedDecoder:
    """``Transfer-Encoding: chunked`` framing: ``feed(bytes) -> list[bytes]`` of payload; ``done`` at the end.

    Chunk extensions and trailers are ignored.  A bare LF is accepted where CRLF is due.
    """

    __slots__ = ("done", "_state", "_left", "_pending", "_trailers")

    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)

    def __init__(self) -> None:
        self.done = False
        self._state = self._SIZE
        self._left = 0
        self._pending = b""
        self._trailers = 0

    def feed(self, data: bytes) -> List[bytes]:
        out = []  # type: List[bytes]
        if self.done:
            return out
        if self._pending:
            data = self._pending + data
            self._pending = b""
        pos = 0
        end = len(data)
        state = self._state
        while pos < end:
            if state == 1:  # _DATA
                left = self._left
                if end - pos >= left:
                    out.append(data[pos : pos + left])
                    pos += left
                    self._left = 0
                    state = 2
                else:
                    out.append(data[pos:] if pos else data)
                    self._left = left - (end - pos)
                    pos = end
            elif state == 2:  # _DATA_END: the CRLF after a chunk's data
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
                state = 0
            elif state == 0:  # _SIZE
                nl = data.find(b"\n", pos, pos + MAX_CHUNK_LINE + 2)
                if nl < 0:
                    if end - pos > MAX_CHUNK_LINE + (data[end - 1] == 13):
                        raise ProtocolError("chunk-size line longer than %d bytes" % MAX_CHUNK_LINE)
                    self._pending = data[pos:]
                    pos = end
                    break
                if nl - pos > MAX_CHUNK_LINE and nl - pos - (data[nl - 1] == 13) > MAX_CHUNK_LINE:
                    raise ProtocolError("chunk-size line longer than %d bytes" % MAX_CHUNK_LINE)
                if 1 < nl - pos <= 16 and data[nl - 1] == 13 and _HEX_DIGITS.issuperset(data[pos : nl - 1]):
                    size = int(data[pos : nl - 1], 16)  # the usual "1a2\r\n"
                else:
                    size = _parse_chunk_size(data[pos:nl])
                pos = nl + 1
                if size:
                    stop = pos + size
                    if stop + 2 <= end and data[stop] == 13 and data[stop + 1] == 10:
                        out.append(data[pos:stop])  # the whole chunk and its CRLF are here
                        pos = stop + 2
                        continue
                    self._left = size
                    state = 1
                else:
                    state = 3
            else:  # _TRAILER: ignored lines up to a blank one
                nl = data.find(b"\n", pos, pos + MAX_CHUNK_LINE + 2)
                if nl < 0:
                    if end - pos > MAX_CHUNK_LINE + (data[end - 1] == 13):
                        raise ProtocolError("trailer line longer than %d bytes" % MAX_CHUNK_LINE)
                    self._pending = data[pos:]
                    break
                line = data[pos:nl]
                if len(line) > MAX_CHUNK_LINE and line[-1] != 13 or len(line) > MAX_CHUNK_LINE + 1:
                    raise ProtocolError("trailer line longer than %d bytes" % MAX_CHUNK_LINE)
                pos = nl + 1
                if line in (b"", b"\r"):
                    self.done = True
                    break
                self._trailers += 1
                if self._trailers > MAX_HEADERS:
                    raise ProtocolError("more than %d trailer lines" % MAX_HEADERS)
        self._state = state
        return out

    def feed_eof(self) -> None:
        """The connection closed: ``StreamClosedError`` unless the last chunk was seen."""
        if not self.done:
            if self._state == 3 and not self._pending:
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
    __slots__ = ("done", "_left")

    def __init__(self, length: int) -> None:
        self._left = length
        self.done = length == 0

    def feed(self, data: bytes) -> List[bytes]:
        if self.done:
            return []
        if len(data) >= self._left:
            data = data[: self._left]
            self.done = True
        self._left -= len(data)
        return [data]

    def feed_eof(self) -> None:
        if not self.done:
            raise StreamClosedError("the connection closed %d bytes before the end of the body" % self._left)


class _CloseDecoder:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def feed(self, data: bytes) -> List[bytes]:
        return [data]

    def feed_eof(self) -> None:
        self.done = True


class ResponseReader:
    """An HTTP/1.1 response parser fed bytes: ``feed(data) -> list[bytes]`` of body payload.

    ``head`` is set once the status line and headers are in; ``done`` once the body is complete.  Framing
    is ``Transfer-Encoding: chunked``, ``Content-Length`` or read-until-close, picked from the head.
    ``feed_eof()`` tells the reader the connection closed: a head or body cut short is
    ``StreamClosedError``.  Malformed input, or a head over ``max_head`` bytes or ``max_headers`` lines,
    is ``ProtocolError``; so is a body over ``max_body`` when a cap is given.
    """

    __slots__ = ("head", "_buf", "_scan", "_lines", "_body", "_max_head", "_max_headers", "_max_body", "_received")

    def __init__(self, max_head: int = MAX_HEAD, max_headers: int = MAX_HEADERS, max_body: Optional[int] = None):
        self.head = None  # type: Optional[ResponseHead]
        self._buf = bytearray()
        self._scan = 0
        self._lines = 0
        self._body = None  # type: Optional[Union[ChunkedDecoder, _LengthDecoder, _CloseDecoder]]
        self._max_head = max_head
        self._max_headers = max_headers
        self._max_body = max_body
        self._received = 0

    @property
    def done(self) -> bool:
        return self._body is not None and self._body.done

    def feed(self, data: bytes) -> List[bytes]:
        body = self._body
        if body is None:
            self._buf += data
            seen = self._lines
            self._lines += data.count(b"\n")
            if not seen and self._lines:
                # the status line is whole: a reply that is not HTTP fails now, not when a head ends that never will
                _parse_status_line(bytes(self._buf[: self._buf.find(b"\n")]))
            pieces = self._feed_head()
            body = self._body
            if body is None:
                return []
            data = pieces
            if not data:
                return []
        out = body.feed(data)
        if self._max_body is not None:
            for piece in out:
                self._received += len(piece)
            if self._received > self._max_body:
                raise ProtocolError("response body is longer than max_body (%d bytes)" % self._max_body)
        return out

    def _feed_head(self) -> bytes:
        """Find the end of the head; returns the bytes after it once the head is parsed."""
        buf = self._buf
        while True:
            start = max(0, self._scan - 3)
            end = _find_head_end(buf, start)
            if end is None:
                over = len(buf) - self._max_head
                # up to 3 bytes past the cap may be the start of the blank line that ends the head
                if over > 0 and (over > 3 or buf[self._max_head :].strip(b"\r\n")):
                    raise ProtocolError("response head is longer than %d bytes" % self._max_head)
                if self._lines > self._max_headers + 1:
                    raise ProtocolError("response has more than %d header lines" % self._max_headers)
                self._scan = len(buf)
                return b""
            block_end, body_start = end
            if block_end > self._max_head:
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

    def _framing(self, head: ResponseHead) -> Union[ChunkedDecoder, _LengthDecoder, _CloseDecoder]:
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
            values = {v.strip() for item in lengths for v in item.split(",")}
            if len(values) != 1:
                raise ProtocolError("conflicting Content-Length headers %r" % sorted(values)[:4])
            value = values.pop()
            if not value.isdigit() or not value.isascii() or len(value) > 18:
                raise ProtocolError("malformed Content-Length %r" % value[:40])
            length = int(value)
            if self._max_body is not None and length > self._max_body:
                raise ProtocolError("response body of %d bytes is longer than max_body (%d)" % (length, self._max_body))
            return _LengthDecoder(length)
        return _CloseDecoder()

    def feed_eof(self) -> None:
        """The connection closed.  ``StreamClosedError`` if the head or the body is incomplete."""
        if self._body is None:
            if self._buf:
                raise StreamClosedError("the connection closed in the middle of the response head")
            raise StreamClosedError("the connection closed before any response")
        self._body.feed_eof()


def _find_head_end(buf: bytearray, start: int) -> Optional[Tuple[int, int]]:
    """(end of head block, start of body) or None.  CRLF CRLF or, leniently, LF LF."""
    crlf = buf.find(b"\r\n\r\n", start)
    lf = buf.find(b"\n\n", start)
    if crlf < 0 and lf < 0:
        return None
    if lf < 0 or (0 <= crlf < lf):
        return crlf, crlf + 4
    # "\r\n\n" is also an end: the block is everything before the first of the two newlines
    return lf, lf + 2


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
        text = body[:200].decode("utf-8", "replace").strip()
        message = text or "(empty body)"
    return message, doc


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

    try:
        stamp = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if stamp is None:
        return None
    try:
        when = stamp.timestamp()
    except (OverflowError, ValueError, OSError):
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
    limit is passed.  ``close()`` ends the stream: an event not closed by a blank line is discarded.
    """

    __slots__ = ("max_line", "_buf", "_cr", "_lead", "_data", "_type", "_size")

    def __init__(self, max_line: int = 1024 * 1024) -> None:
        self.max_line = max_line
        self._buf = bytearray()  # the partial line, never holding a line end
        self._cr = False  # a CR ended the previous read
        self._lead = b""  # type: Optional[bytes]  # the first bytes, until the BOM question is settled
        self._data = None  # type: Optional[List[str]]  # the data lines of the event being read
        self._type = "message"
        self._size = 0

    def feed(self, data: bytes) -> List[Tuple[str, str]]:
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
        return self._lines(data)

    def close(self) -> List[Tuple[str, str]]:
        """End of stream: a held CR still ends its line; an unterminated event is discarded."""
        out = []  # type: List[Tuple[str, str]]
        if self._cr:
            self._cr = False
            out = self._lines(b"\n")
        self._buf.clear()
        self._data = None
        self._type = "message"
        self._size = 0
        return out

    def _lines(self, data: bytes) -> List[Tuple[str, str]]:
        out = []  # type: List[Tuple[str, str]]
        buf = self._buf
        max_line = self.max_line
        pos = 0
        end = len(data)
        find = data.find
        while True:
            # The hot path: between events, a whole "data: ...\n\n" event with nothing pending
            if not buf and self._data is None and data.startswith(b"data: ", pos) and self._type == "message":
                nl = find(b"\n", pos)
                if 0 <= nl < end - 1 and data[nl + 1] == 10 and nl - pos <= max_line:
                    out.append(("message", data[pos + 6 : nl].decode("utf-8", "replace")))
                    pos = nl + 2
                    continue
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
                raise ProtocolError("SSE line longer than max_line (%d bytes)" % max_line)
            if line.startswith(b"data:"):
                value = line[6:] if line.startswith(b" ", 5) else line[5:]
                name = b"data"
            elif line[0] == 58:  # ":" a comment, llama-server's ping
                continue
            else:
                colon = line.find(b":")
                if colon < 0:
                    name, value = line, b""
                else:
                    name = line[:colon]
                    value = line[colon + 2 :] if line.startswith(b" ", colon + 1) else line[colon + 1 :]
            if name == b"data" or name == b"error":
                self._size += len(value) + 1
                if self._size > max_line + 1:
                    raise ProtocolError("SSE event longer than max_line (%d bytes)" % max_line)
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
                raise ProtocolError("SSE line longer than max_line (%d bytes)" % max_line)
            buf += data[pos:] if pos else data
            if self._size and buf.startswith(b"data:"):
                # the event's earlier lines plus this unfinished one may pass the cap before its newline
                pending = len(buf) - (6 if buf.startswith(b" ", 5) else 5)
                if self._size + pending > max_line:
                    raise ProtocolError("SSE event longer than max_line (%d bytes)" % max_line)
        return out


# =====================================================================================================
# 4. Delta assembler
# =====================================================================================================

# the C scanner that json.loads wraps, called without the wrapper calls and regex matches around it
_scan_json = vars(json.JSONDecoder())["scan_once"]  # type: Callable[[str, int], Tuple[Any, int]]


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
        message = err.get("message")
        etype = err.get("type")
        return ServerError(
            code,
            message if isinstance(message, str) else repr(err)[:200],
            etype if isinstance(etype, str) else None,
            err,
        )
    return ServerError(None, str(err)[:200], None, err)


class Assembler:
    """Turns chunk payloads into events and, at the end, a ``Completion``.

    ``feed(payload) -> list[Event]`` takes the text of one ``data`` event.  A JSON error, a payload that is
    not an object, ``choices`` that is not a list or a delta that is not an object is ``ProtocolError``;
    an error object is raised as ``ServerError``.  ``completion()`` raises ``StreamClosedError`` when no
    ``finish_reason`` arrived.
    """

    __slots__ = (
        "id",
        "model",
        "finish_reason",
        "usage",
        "timings",
        "reasoning_tokens",
        "in_reasoning",
        "thinking_capped",
        "_content",
        "_reasoning",
        "_tools",
    )

    def __init__(self) -> None:
        self.id = None  # type: Optional[str]
        self.model = None  # type: Optional[str]
        self.finish_reason = None  # type: Optional[str]
        self.usage = None  # type: Optional[Dict[str, Any]]
        self.timings = None  # type: Optional[Dict[str, Any]]
        self.reasoning_tokens = 0
        self.in_reasoning = False
        self.thinking_capped = False
        self._content = _Text()
        self._reasoning = _Text()
        self._tools = {}  # type: Dict[int, List[Any]]

    def feed(self, payload: str) -> List[Event]:
        try:
            doc, end = _scan_json(payload, 0)  # _loads(payload), inlined: this runs per token
            if end != len(payload):
                doc = json.loads(payload)
        except StopIteration:
            doc = self._loads_slow(payload)
        except ValueError as exc:  # JSONDecodeError
            raise ProtocolError("invalid JSON in the stream: %s (%r)" % (exc, payload[:80])) from None
        except RecursionError:
            raise ProtocolError("JSON nested too deeply in the stream") from None
        if type(doc) is not dict:
            raise ProtocolError("stream data is not a JSON object: %r" % payload[:80])
        # The hot path: one choice whose delta is only text, no finish, no usage, not the first chunk.
        choices = doc.get("choices")
        if type(choices) is list and len(choices) == 1 and self.id is not None:
            choice = choices[0]
            if (
                type(choice) is dict
                and choice.get("finish_reason") is None
                and "error" not in doc
                and "usage" not in doc
                and "timings" not in doc
            ):
                delta = choice.get("delta")
                if type(delta) is dict and len(delta) == 1:
                    text = delta.get("content")
                    if type(text) is str:
                        if not text:
                            return []
                        self.in_reasoning = False
                        parts = self._content.parts
                        parts.append(text)
                        if len(parts) >= 2048:
                            self._content.fold()
                        event = _new_object(Content)  # as _new_content(text), inlined: this runs per token
                        _set_content_text(event, text)
                        _set_content_choice(event, 0)
                        return [event]
                    text = delta.get("reasoning_content")
                    if type(text) is str:
                        if not text:
                            return []
                        self.reasoning_tokens += 1
                        self.in_reasoning = True
                        self._reasoning.add(text)
                        return [_new_reasoning(text)]
        return self._feed(doc, payload)

    @staticmethod
    def _loads_slow(payload: str) -> Any:
        """json.loads, for what the scanner alone refuses: leading whitespace, or an error worded by json."""
        try:
            return json.loads(payload)
        except ValueError as exc:
            raise ProtocolError("invalid JSON in the stream: %s (%r)" % (exc, payload[:80])) from None
        except RecursionError:
            raise ProtocolError("JSON nested too deeply in the stream") from None

    def _feed(self, doc: Dict[str, Any], payload: str) -> List[Event]:
        if "error" in doc:
            raise _error_from(doc["error"])
        if self.id is None:
            cid = doc.get("id")
            if isinstance(cid, str):
                self.id = cid
            model = doc.get("model")
            if isinstance(model, str):
                self.model = model
        events = []  # type: List[Event]
        choices = doc.get("choices")
        if choices:
            if type(choices) is not list:
                raise ProtocolError("'choices' is not a list: %r" % payload[:80])
            for choice in choices:
                if type(choice) is not dict:
                    raise ProtocolError("a choice is not an object: %r" % payload[:80])
                delta = choice.get("delta")
                if delta:
                    if type(delta) is not dict:
                        raise ProtocolError("a delta is not an object: %r" % payload[:80])
                    self._delta(delta, events)
                elif delta is not None and type(delta) is not dict:
                    raise ProtocolError("a delta is not an object: %r" % payload[:80])
                reason = choice.get("finish_reason")
                if reason is not None:
                    if type(reason) is not str:
                        raise ProtocolError("'finish_reason' is not a string: %r" % payload[:80])
                    self.finish_reason = reason
        elif choices is not None and type(choices) is not list:
            raise ProtocolError("'choices' is not a list: %r" % payload[:80])
        usage = doc.get("usage")
        if usage is not None:
            if type(usage) is not dict:
                raise ProtocolError("'usage' is not an object: %r" % payload[:80])
            self.usage = dict(self.usage, **usage) if self.usage else usage
        timings = doc.get("timings")
        if timings is not None:
            if type(timings) is not dict:
                raise ProtocolError("'timings' is not an object: %r" % payload[:80])
            self.timings = dict(self.timings, **timings) if self.timings else timings
        return events

    def _delta(self, delta: Dict[str, Any], events: List[Event]) -> None:
        text = delta.get("reasoning_content")
        if text:
            if type(text) is not str:
                raise ProtocolError("'reasoning_content' is not a string: %r" % (text,))
            self.reasoning_tokens += 1
            self.in_reasoning = True
            self._reasoning.add(text)
            events.append(_new_reasoning(text))
        elif text is not None and type(text) is not str:
            raise ProtocolError("'reasoning_content' is not a string: %r" % (text,))
        text = delta.get("content")
        if text:
            if type(text) is not str:
                raise ProtocolError("'content' is not a string: %r" % (text,))
            self.in_reasoning = False
            self._content.add(text)
            events.append(_new_content(text))
        elif text is not None and type(text) is not str:
            raise ProtocolError("'content' is not a string: %r" % (text,))
        calls = delta.get("tool_calls")
        if calls:
            if type(calls) is not list:
                raise ProtocolError("'tool_calls' is not a list: %r" % (calls,))
            self.in_reasoning = False
            for call in calls:
                self._tool_call(call, events)
        elif calls is not None and type(calls) is not list:
            raise ProtocolError("'tool_calls' is not a list: %r" % (calls,))

    def _tool_call(self, call: Any, events: List[Event]) -> None:
        if type(call) is not dict:
            raise ProtocolError("a tool-call delta is not an object: %r" % (call,))
        index = call.get("index")
        if type(index) is not int:
            raise ProtocolError("a tool-call delta has no integer 'index': %r" % (call,))
        func = call.get("function")
        if func is None:
            func = {}
        elif type(func) is not dict:
            raise ProtocolError("a tool call's 'function' is not an object: %r" % (call,))
        cid, name, args = call.get("id"), func.get("name"), func.get("arguments")
        for what, value in (("id", cid), ("name", name), ("arguments", args)):
            if value is not None and type(value) is not str:
                raise ProtocolError("a tool call's %r is not a string: %r" % (what, call))
        entry = self._tools.get(index)
        if entry is None:
            entry = self._tools[index] = [None, None, _Text()]
        if cid and entry[0] is None:
            entry[0] = cid
        if name and entry[1] is None:
            entry[1] = name
        if args:
            entry[2].add(args)
        if cid or name or args:
            events.append(ToolCall(index, cid or None, name or None, args or ""))

    @property
    def content(self) -> str:
        return str(self._content)

    @property
    def reasoning(self) -> str:
        return str(self._reasoning)

    def completion(self) -> Completion:
        """The assembled ``Completion``; ``StreamClosedError`` when no ``finish_reason`` arrived."""
        if self.finish_reason is None:
            raise StreamClosedError("the stream ended without a finish_reason: the server stopped mid-answer")
        calls = [ToolCallResult(e[0], e[1], str(e[2])) for _, e in sorted(self._tools.items())]
        return Completion(
            id=self.id,
            model=self.model,
            content=self.content,
            reasoning=self.reasoning,
            tool_calls=calls,
            finish_reason=self.finish_reason,
            usage=self.usage,
            timings=self.timings,
            reasoning_tokens=self.reasoning_tokens,
            thinking_capped=self.thinking_capped,
        )


# =====================================================================================================
# 5. Transport: the only code that touches socket
# =====================================================================================================


class _Address:
    __slots__ = ("text", "unix", "target", "host")

    def __init__(self, text: str, unix: bool, target: Any, host: str) -> None:
        self.text = text  # as the caller gave it, for messages
        self.unix = unix
        self.target = target  # a path, or (host, port)
        self.host = host  # the Host header

    def __repr__(self) -> str:
        return "_Address(%r)" % self.text


def parse_address(address: Any) -> _Address:
    """A path or ``unix:///path`` (AF_UNIX), or ``http://host[:port]`` (TCP).  ``ValueError``/``TypeError``."""
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
        scheme, _, rest = address.partition("://")
        if scheme.lower() != "http":
            raise ValueError(
                "unsupported address scheme %r: use a socket path, unix:///path or http://host:port" % scheme
            )
        if rest.endswith("/"):
            rest = rest[:-1]
        if not rest or any(c in rest for c in "/?#@ \t\r\n\0"):
            raise ValueError("cannot parse %r: expected http://host:port" % text)
        if rest.startswith("["):
            host, sep, port_text = rest[1:].partition("]")
            if not sep or (port_text and not port_text.startswith(":")):
                raise ValueError("cannot parse %r: expected http://[v6addr]:port" % text)
            port_text = port_text[1:]
            host_header = "[%s]" % host
        else:
            host, _, port_text = rest.partition(":")
            host_header = host
        if not host:
            raise ValueError("no host in %r" % text)
        port = 80
        if port_text or rest.endswith(":"):
            if not (port_text.isdigit() and port_text.isascii() and 0 < int(port_text) < 65536):
                raise ValueError("bad port in %r" % text)
            port = int(port_text)
        if port != 80:
            host_header += ":%d" % port
        return _Address(text, False, (host, port), host_header)
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


class _Silence(Exception):
    """A read timed out (internal: each caller turns it into the budget error that applies)."""


class _Conn:
    """One connection.  Socket errors are translated here and nowhere else, narrowest first."""

    __slots__ = ("sock", "_timeout", "_lock", "_closed")

    def __init__(self, addr: _Address, timeout: float) -> None:
        # OSError (missing socket file, refused, unreachable, connect timeout) goes to the caller
        if addr.unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(addr.target)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection(addr.target, timeout)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - not every TCP stack has it
                pass
        self.sock = sock
        self._timeout = timeout
        self._lock = threading.Lock()
        self._closed = False

    def sendall(self, data: bytes, timeout: float) -> None:
        try:
            if timeout != self._timeout:
                self.sock.settimeout(timeout)
                self._timeout = timeout
            self.sock.sendall(data)
        except socket.timeout:
            raise StalledError("the server did not take the request for %.1f s" % timeout, timeout) from None
        except OSError as exc:
            raise StreamClosedError("the connection closed while sending the request: %s" % exc) from exc

    def recv(self, timeout: float) -> bytes:
        try:
            if timeout != self._timeout:
                self.sock.settimeout(timeout)
                self._timeout = timeout
            return self.sock.recv(RECV_SIZE)
        except socket.timeout:
            raise _Silence() from None
        except OSError as exc:
            raise StreamClosedError("the connection failed: %s" % exc) from exc

    def abort(self) -> None:
        """From any thread: wake a blocked reader and tell the server we are gone.  Never closes the fd."""
        with self._lock:
            if not self._closed:
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.sock.close()


def _connect_error(addr: _Address, exc: OSError) -> ConnectError:
    if isinstance(exc, FileNotFoundError):
        text = "no llama-server at %s: the socket file does not exist" % addr.text
    elif isinstance(exc, ConnectionRefusedError):
        text = "no llama-server listening at %s (connection refused)" % addr.text
    elif isinstance(exc, socket.timeout):
        text = "connecting to %s timed out" % addr.text
    else:
        text = "cannot connect to %s: %s" % (addr.text, exc)
    err = ConnectError(text, addr.text)
    err.__cause__ = exc
    return err


# =====================================================================================================
# 6. Slot gates and the shared /slots poller
# =====================================================================================================


class _Lane:
    """One queue: a slot, or the ``slot=None`` pool, of one model.  Read and written under the gate's lock.

    Queued tickets hold positions handed out in entry order (``tail`` is the next one).  ``head`` is the
    first queued ticket's position, and ``holes`` the sorted positions between it and ``tail`` whose
    ticket was cancelled out of the queue.  The tickets queued before the one at ``pos`` then number
    ``pos - head - (holes below pos)``: a bisection, where walking the queue would make thousands of
    waiters, each asking every ``poll``, cost the square of their number.

    Invariants, whenever the lock is free:
      1. ``in_flight <= capacity``, and nobody waits while a permit is free: ``queue`` is empty or
         ``in_flight == capacity``.
      2. The positions of ``queue`` and the ``holes`` together are exactly ``range(head, tail)``, without
         overlap; ``holes`` is sorted and ``head`` is in ``queue`` (``head == tail == 0`` when it is empty).
      3. ``len(holes) <= len(queue)``: whenever a cancel or a grant would break it, the positions are
         renumbered (O(queued), paid for by the cancels that made the holes), so memory stays constant per
         waiter however many come and go.
    """

    __slots__ = ("capacity", "in_flight", "queue", "head", "tail", "holes")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
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

    def push(self, ticket: _Ticket) -> None:
        ticket.pos = pos = self.tail
        self.queue[pos] = ticket
        self.tail = pos + 1

    def admit(self) -> None:
        """Hand the free permits to the first waiters, waking those threads only."""
        queue = self.queue
        while queue and self.in_flight < self.capacity:
            ticket = queue.pop(self.head)
            self._advance()
            self.in_flight += 1
            ticket.granted = True
            ticket.signal()

    def remove(self, ticket: _Ticket) -> None:
        """Take a waiter out of the queue; nobody else is woken (they learn it on their timer)."""
        pos = ticket.pos
        del self.queue[pos]
        if pos == self.head:
            self._advance()
            return
        from bisect import insort

        insort(self.holes, pos)
        if len(self.holes) > len(self.queue):
            self._renumber()

    def _advance(self) -> None:
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
        queue = self.queue
        order = [queue[pos] for pos in range(self.head, self.tail) if pos in queue]
        self.queue = {}
        for pos, ticket in enumerate(order):
            ticket.pos = pos
            self.queue[pos] = ticket
        self.head = 0
        self.tail = len(order)
        self.holes = []


class _Ticket:
    """One request's claim on a lane: granted at once by ``enter``, or queued until a release hands it the
    permit.  A queued ticket's thread sleeps on its own ``waker``, a lock the gate acquires when the ticket
    is queued and releases once to wake it (as ``threading.Condition`` does for each of its waiters);
    ``woken`` says that release has not been taken back yet, so it is never released twice."""

    __slots__ = ("lane", "seq", "pos", "granted", "left", "ahead", "waker", "woken")

    def __init__(self, lane: _Lane, seq: int) -> None:
        self.lane = lane
        self.seq = seq  # entry order across the gate, for diagnostics
        self.pos = 0  # position in the lane's queue, while queued
        self.granted = False
        self.left = False
        self.ahead = 0  # the last ``Queued(ahead)`` announced
        self.waker = None  # type: Optional[threading.Lock]  # only queued tickets need one
        self.woken = False

    def signal(self) -> None:
        """Wake the thread waiting on this ticket, if it has not been woken since it last looked."""
        waker = self.waker
        if waker is not None and not self.woken:
            self.woken = True
            waker.release()


if TYPE_CHECKING:
    from typing import Protocol

    class _Cancelled(Protocol):
        """What ``_Gate.wait`` reads of a request's cancel flag (a ``_Flag`` or a ``threading.Event``)."""

        def is_set(self) -> bool: ...


class _Gate:
    """FIFO queues that hand over: per key, ``capacity`` requests in flight (1 for a slot, ``total_slots``
    for a pool) and ``queue_len`` more waiting; the next is refused with ``BusyError``.

    A key is a hashable pair ``(model, slot)``: model None is the server's default, slot None the pool;
    the gate reads them only to word ``BusyError``.  A release grants the permit to the first waiter and
    wakes that thread only; a waiter that leaves wakes nobody.  Waiters wake every ``poll`` seconds on their
    own timer to learn how far they have moved up, which is why ``Queued`` announcements are coalesced.
    A slot with thousands of waiters costs the same per request as a slot with ten."""

    def __init__(self, lock: threading.Lock, queue_len: int) -> None:
        self._lock = lock
        self._queue_len = queue_len
        self._lanes = {}  # type: Dict[Tuple[Optional[str], Optional[int]], _Lane]
        self._seq = 0

    def enter(self, key: Tuple[Optional[str], Optional[int]], capacity: int) -> _Ticket:
        """A granted ticket, or a queued one whose ``ahead`` is the first ``Queued`` to announce; ``BusyError``
        when ``queue_len`` already wait.  A ``capacity`` above the lane's grows it (a pool sized late by
        ``/props``) and admits the waiters that now fit; a smaller one (a caller that had not heard
        ``/props`` yet) changes nothing."""
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(capacity)
            elif capacity > lane.capacity:
                lane.capacity = capacity
                lane.admit()
            self._seq += 1
            ticket = _Ticket(lane, self._seq)
            if lane.in_flight < lane.capacity:  # then nobody waits (invariant 1)
                lane.in_flight += 1
                ticket.granted = True
                return ticket
            waiting = len(lane.queue)
            if waiting >= self._queue_len:
                raise self._refusal(key, waiting)
            ticket.ahead = lane.in_flight + waiting
            ticket.waker = waker = threading.Lock()
            waker.acquire()
            lane.push(ticket)
            return ticket

    def _refusal(self, key: Tuple[Optional[str], Optional[int]], waiting: int) -> BusyError:
        model, slot = key
        where = "any slot" if slot is None else "slot %s" % (slot,)
        if model is not None:
            where += " of model %s" % (model,)
        return BusyError(
            "%d requests already wait for %s (queue_len %d): try later" % (waiting, where, self._queue_len),
            slot,
            self._queue_len,
            waiting,
        )

    def wait(self, ticket: _Ticket, cancelled: _Cancelled, poll: float) -> Optional[int]:
        """Sleep until ``ticket`` is granted (None), or until a wake on its own timer, every ``poll``
        seconds, finds its ``ahead`` smaller than last announced (the new value: at least ``poll`` after
        the call, so announcements are at most one per ``poll``).  ``CancelledError`` once
        ``cancelled.is_set()``; ``wake(ticket)`` cuts the sleep short for that."""
        lane = ticket.lane
        waker = ticket.waker
        assert waker is not None, "wait() on a ticket that was granted at once"
        lock = self._lock
        due = time.monotonic() + poll
        got = False
        while True:
            with lock:
                if ticket.woken:  # take the release back: a blocking acquire did, or timed out just before
                    if not got:
                        waker.acquire(False)
                    ticket.woken = False
                if cancelled.is_set():
                    raise CancelledError("the request was cancelled while queued")
                if ticket.granted:
                    return None
                now = time.monotonic()
                if now >= due:
                    ahead = lane.in_flight + lane.before(ticket)
                    if ahead < ticket.ahead:
                        ticket.ahead = ahead
                        return ahead
                    due = now + poll
                left = due - now
            got = waker.acquire(True, min(left, threading.TIMEOUT_MAX))

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

    def wake(self, ticket: Optional[_Ticket]) -> None:
        """Wake the thread waiting on ``ticket`` (its request was cancelled), and no other; None, or a
        ticket that is not queued, is nothing to wake."""
        if ticket is None:
            return
        with self._lock:
            if not ticket.granted and not ticket.left:
                ticket.signal()

    def snapshot(self) -> Dict[Tuple[Optional[str], Optional[int]], Tuple[int, int]]:
        """{key: (in flight, waiting)}, for tests and diagnostics."""
        with self._lock:
            return {k: (lane.in_flight, len(lane.queue)) for k, lane in self._lanes.items()}


class _SlotPoller:
    """One ``/slots`` request in flight per client, however many wait; an answer younger than ``poll`` is
    reused.  The request runs in a short-lived thread so that a waiter can always be cancelled."""

    def __init__(self, client: Client, lock: threading.Lock) -> None:
        self._client = client
        self._cond = threading.Condition(lock)
        self._busy = False
        self._stamp = float("-inf")  # when the last answer arrived
        self._slots = None  # type: Optional[List[Slot]]
        self._owner = _Owner()

    def get(self, interval: float, cancelled: _Flag) -> Optional[List[Slot]]:
        """The slots, or None when ``/slots`` failed or did not answer within ``interval``."""
        with self._cond:
            asked = time.monotonic()
            if asked - self._stamp < interval:
                return self._slots
            if not self._busy:
                self._busy = True
                worker = threading.Thread(target=self._work, name="loopclient-slots", daemon=True)
                worker.start()
            deadline = asked + interval
            while self._stamp < asked:
                if cancelled.is_set():
                    raise CancelledError("the request was cancelled while polling /slots")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.5))
            return self._slots

    def _work(self) -> None:
        slots = None  # type: Optional[List[Slot]]
        limits = self._client.limits
        try:
            slots = self._client._fetch_slots(
                timeout=min(limits.liveness, max(2 * limits.poll, 0.5)), owner=self._owner
            )
        except Exception:  # any failure means "unavailable"; the worker must never die loudly
            slots = None
        with self._cond:
            self._slots = slots
            self._stamp = time.monotonic()
            self._busy = False
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def abort(self) -> None:
        self._owner.abort()


class _Flag:
    """A cancel flag: ``is_set()`` costs an attribute read; the Event behind ``wait()`` exists only when
    someone sleeps on it (most requests never back off)."""

    __slots__ = ("value", "_event")

    def __init__(self) -> None:
        self.value = False  # read directly on the per-event path
        self._event = None  # type: Optional[threading.Event]

    def is_set(self) -> bool:
        return self.value

    def set(self) -> None:
        self.value = True
        event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout``; True at once (or as soon as) the flag is set."""
        event = self._event
        if event is None:
            event = self._event = threading.Event()
        if self.value:  # read after publishing the event: set() either sees it or was seen here
            return True
        return event.wait(timeout)


class _Owner:
    """The connections a request has open, so that ``cancel()`` can shut them all down."""

    __slots__ = ("conns", "_lock")

    def __init__(self) -> None:
        self.conns: Set[_Conn] = set()
        self._lock = threading.Lock()

    def add(self, conn: _Conn) -> None:
        with self._lock:
            self.conns.add(conn)

    def discard(self, conn: _Conn) -> None:
        with self._lock:
            self.conns.discard(conn)

    def abort(self) -> None:
        with self._lock:
            conns = list(self.conns)
        for conn in conns:
            conn.abort()


# =====================================================================================================
# 7. The client and its streams
# =====================================================================================================

DEFAULT_ADDRESS = "http://127.0.0.1:8080"


class _Retry:
    """An attempt that failed before anything was delivered and may be sent again."""

    __slots__ = ("reason", "hint", "cause")

    def __init__(self, reason: str, hint: Optional[float], cause: BaseException) -> None:
        self.reason = reason
        self.hint = hint
        self.cause = cause


_BUDGETS = {
    "busy": (
        "busy_wait",
        WaitTimeoutError,
        "slot {slot} stayed busy for {waited:.1f} s (busy_wait): the server is still serving others",
    ),
    "unavailable": (
        "load_wait",
        LoadTimeoutError,
        "the server at {address} stayed unreachable or loading for {waited:.1f} s (load_wait)",
    ),
    "idle": (
        "idle_grace",
        StalledError,
        "slot {slot} is idle, yet no response came for {waited:.1f} s (idle_grace): the server is stuck",
    ),
}


class _Situation:
    """What the request is waiting on, and since when.  A budget restarts when the situation changes."""

    __slots__ = ("limits", "state", "since", "sent_at", "slot", "address", "cause")

    def __init__(self, limits: Limits, slot: Optional[int], address: str) -> None:
        self.limits = limits
        self.slot = "any" if slot is None else str(slot)
        self.address = address
        self.state = None  # type: Optional[str]
        self.since = time.monotonic()
        self.sent_at = self.since
        self.cause = None  # type: Optional[BaseException]

    def observe(self, state: str, cause: Optional[BaseException] = None) -> None:
        if state != self.state:
            self.since = self.sent_at if self.state is None else time.monotonic()
            self.state = state
            self.cause = None
        if cause is not None:  # a poll that sees the same state keeps the last failure as the cause
            self.cause = cause

    def remaining(self) -> Optional[float]:
        if self.state is None:
            return None
        budget = getattr(self.limits, _BUDGETS[self.state][0])
        return float(budget - (time.monotonic() - self.since))

    def expired(self) -> LoopError:
        assert self.state is not None
        name, cls, text = _BUDGETS[self.state]
        waited = time.monotonic() - self.since
        err = cls(text.format(slot=self.slot, address=self.address, waited=waited), waited)
        if self.cause is not None:
            err.__cause__ = self.cause
        return err


class ChatStream:
    """One streamed chat request: iterate it for events; ``completion`` is there once iteration has ended
    without an error.  ``cancel()`` works from any thread; leaving the ``with`` block early cancels quietly.
    The request starts when iteration starts.  Iteration raises the ``LoopError`` subclasses of the SPEC.
    """

    def __init__(self, client: Client, request: bytes, slot: Optional[int]) -> None:
        self._client = client
        self._request = request
        self._slot = slot
        self._gen = None  # type: Optional[Generator[List[Event], None, None]]
        self._batch = []  # type: List[Event]  # events produced and not yet handed out, last first
        self._lock = threading.Lock()  # held while the request's generator runs (in _advance)
        self._cancel = _Flag()
        self._owner = _Owner()
        self._ticket = None  # type: Optional[_Ticket]
        self._done = False
        #: the assembled answer, once iteration ended without an error
        self.completion = None  # type: Optional[Completion]

    def __iter__(self) -> ChatStream:
        return self

    def __next__(self) -> Event:
        # The request yields events in batches (all that one read produced): most calls pop one here.
        batch = self._batch
        if batch and not self._cancel.value:
            try:
                return batch.pop()
            except IndexError:  # another thread iterating the same stream took the last one
                pass
        return self._advance()

    def _advance(self) -> Event:
        lock = self._lock
        lock.acquire()
        try:
            if self._done:
                raise StopIteration
            if self._cancel.value:
                self._finish()
                raise CancelledError("the request was cancelled")
            batch = self._batch
            if not batch:
                gen = self._gen
                if gen is None:
                    gen = self._gen = self._run()
                try:
                    batch = next(gen)
                except BaseException:
                    self._done = True
                    raise
                batch.reverse()  # a fresh list, never empty: popped from its end
                self._batch = batch
            return batch.pop()
        finally:
            lock.release()

    def cancel(self) -> None:
        """Cancel the request from any thread: its sockets close, its permit is released, and the thread
        iterating the stream gets ``CancelledError`` within 0.2 s."""
        if self._done:
            return
        self._stop()
        # The generator is not running: clean up here, so the socket and permit are freed now, not at the
        # next call.  Otherwise the iterating thread wakes from the aborted socket and cleans up itself.
        if self._lock.acquire(blocking=False):
            try:
                self._finish()
            finally:
                self._lock.release()

    def _stop(self) -> None:
        """Mark the request cancelled and wake whatever it waits on: its sockets, its queue, the poller."""
        self._cancel.set()
        self._owner.abort()
        self._client._wake(self._ticket)

    def _finish(self) -> None:
        gen = self._gen
        if gen is not None:
            gen.close()  # runs the request's finally: socket closed, permit released
        self._release()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self._done:
            self._stop()
            with self._lock:
                self._finish()
                self._done = True

    def _release(self) -> None:
        ticket = self._ticket
        if ticket is not None:
            self._client._gate.leave(ticket)
        self._client._forget(self)

    def _check(self) -> None:
        if self._cancel.value:
            raise CancelledError("the request was cancelled")

    # -- the life of one request -------------------------------------------------------------------

    def _run(self) -> Generator[List[Event], None, None]:
        client = self._client
        try:
            client._remember(self)
            slot = self._slot
            capacity = 1 if slot is not None else client._pool_capacity(self._owner, self._cancel)
            self._check()
            ticket = self._ticket = client._gate.enter((None, slot), capacity)
            if not ticket.granted:
                yield [Queued(ticket.ahead)]
                while True:
                    ahead = client._gate.wait(ticket, self._cancel, client.limits.poll)
                    if ahead is None:
                        break
                    yield [Queued(ahead)]
            completion = yield from self._attempts()
        except LoopError:
            if self._cancel.is_set():
                raise CancelledError("the request was cancelled") from None
            raise
        finally:
            self._owner.abort()
            self._release()
        self.completion = completion

    def _attempts(self) -> Generator[List[Event], None, Completion]:
        client = self._client
        limits = client.limits
        situation = _Situation(limits, self._slot, client._addr.text)
        attempt = 0
        backoff = BACKOFF_FIRST
        while True:
            self._check()
            try:
                conn = _Conn(client._addr, max(limits.poll, 0.2))
            except OSError as exc:
                retry = _Retry("cannot connect: %s" % (exc.strerror or exc), None, exc)
            else:
                self._owner.add(conn)
                try:
                    situation.sent_at = time.monotonic()
                    outcome = yield from self._exchange(conn, situation)
                finally:
                    conn.close()
                    self._owner.discard(conn)
                if not isinstance(outcome, _Retry):
                    return outcome
                retry = outcome
            self._check()
            situation.observe("unavailable", retry.cause)
            left = situation.remaining()
            assert left is not None
            if left <= 0 or (retry.hint is not None and retry.hint > left):
                raise situation.expired()
            import random  # only when a retry happens

            delay = backoff * (1.0 - 0.25 * random.random())
            backoff = min(backoff * 2, BACKOFF_MAX)
            if retry.hint is not None:  # honoured as a floor: "Retry-After: 0" must not become a busy loop
                delay = max(delay, retry.hint)
            delay = min(delay, left)
            attempt += 1
            yield [Retrying(attempt, delay, retry.reason)]
            if self._cancel.wait(delay):
                raise CancelledError("the request was cancelled while backing off")

    def _exchange(self, conn: _Conn, situation: _Situation) -> Generator[List[Event], None, Union[Completion, _Retry]]:
        client = self._client
        limits = client.limits
        conn.sendall(self._request, limits.liveness)
        reader = ResponseReader()
        pieces = []  # type: List[bytes]
        started = 0.0  # when the first byte of the head came
        slot = self._slot
        while reader.head is None:
            if started:
                timeout = started + limits.liveness - time.monotonic()
                if timeout <= 0:
                    raise StalledError(
                        "the response head did not complete within %.1f s (liveness)" % limits.liveness, limits.liveness
                    )
            else:
                left = situation.remaining()
                timeout = limits.poll if left is None else max(0.001, min(limits.poll, left))
            try:
                data = conn.recv(timeout)
            except _Silence:
                self._check()
                if started:
                    raise StalledError(
                        "the response head stopped for %.1f s (liveness)" % limits.liveness, limits.liveness
                    ) from None
                left = situation.remaining()
                if left is not None and left <= 0:
                    raise situation.expired() from None
                state = client._slot_state(slot, self._cancel, all_busy=True)
                situation.observe(state)
                yield [Waiting(state == "busy")]
                left = situation.remaining()
                if left is not None and left <= 0:
                    raise situation.expired() from None
                continue
            self._check()
            if not data:
                reader.feed_eof()
            started = started or time.monotonic()
            pieces = reader.feed(data)
        head = reader.head
        if head.status != 200:
            body = self._read_body(conn, reader, pieces)
            message, _ = parse_error_envelope(body)
            error = HTTPStatusError(head.status, message, body)
            if head.status == 503:
                return _Retry("HTTP 503: %s" % message, parse_retry_after(head.get("retry-after")), error)
            raise error
        return (yield from self._events(conn, reader, pieces))

    def _read_body(self, conn: _Conn, reader: ResponseReader, pieces: List[bytes]) -> bytes:
        limits = self._client.limits
        size = sum(len(p) for p in pieces)
        while size <= limits.max_body and not reader.done:
            try:
                data = conn.recv(limits.liveness)
            except _Silence:
                self._check()
                raise StalledError(
                    "the error body stopped for %.1f s (liveness)" % limits.liveness, limits.liveness
                ) from None
            if not data:
                reader.feed_eof()
                break
            for piece in reader.feed(data):
                pieces.append(piece)
                size += len(piece)
        if size > limits.max_body:
            raise ProtocolError("error body longer than max_body (%d bytes)" % limits.max_body)
        return b"".join(pieces)

    def _events(
        self, conn: _Conn, reader: ResponseReader, pieces: List[bytes]
    ) -> Generator[List[Event], None, Union[Completion, _Retry]]:
        client = self._client
        limits = client.limits
        liveness = limits.liveness
        asm = Assembler()
        sse = SSEDecoder(limits.max_line)
        cap = limits.thinking_cap
        capped_at = -1
        delivered = False
        progress = time.monotonic()
        eof = False
        feed = asm.feed
        data = b"".join(pieces) if len(pieces) != 1 else pieces[0]
        while True:
            batch = sse.feed(data) if data else []
            if eof or reader.done:
                batch += sse.close()
            out = []  # type: List[Event]  # what this read produced, handed to the caller as one batch
            done = None  # type: Optional[Completion]
            try:
                for kind, payload in batch:
                    if payload == "[DONE]" and kind != "error":
                        done = asm.completion()
                        break
                    try:
                        if kind != "message" and kind == "error":  # the legacy `error:` line
                            raise _error_from(_json_or_text(payload))
                        events = feed(payload)
                    except ServerError as err:
                        if not delivered and _retryable(err):
                            return _Retry("server error %s: %s" % (err.code, err.message), None, err)
                        raise
                    if events:
                        delivered = True
                        out += events
                    if cap is not None and asm.in_reasoning:
                        tokens = asm.reasoning_tokens
                        if capped_at < 0:
                            if tokens >= cap:
                                capped_at = tokens
                                self._end_reasoning(asm.id, tokens)
                                asm.thinking_capped = True
                                out.append(ThinkingCapped(tokens))
                        elif tokens > capped_at + limits.thinking_overrun:
                            raise ThinkingOverrunError(
                                "reasoning went on for %d tokens after the server accepted to end it at %d "
                                "(thinking_overrun %d)" % (tokens - capped_at, capped_at, limits.thinking_overrun),
                                tokens,
                            )
                if done is None and (eof or reader.done):
                    done = asm.completion()
            except LoopError:
                if out:
                    yield out  # the caller gets what came before the error, then the error
                raise
            if out:
                yield out
            if done is not None:
                return done
            if batch:
                progress = time.monotonic()
            elif time.monotonic() - progress >= liveness:
                self._check_pings(progress)
            try:
                data = conn.recv(liveness)
            except _Silence:
                self._check()
                raise StalledError("no data from the server for %.1f s (liveness)" % liveness, liveness) from None
            self._check()
            if data:
                received = reader.feed(data)
                data = received[0] if len(received) == 1 else b"".join(received)
            else:
                reader.feed_eof()  # StreamClosedError when cut mid-chunk or short of its length
                eof = True

    def _check_pings(self, progress: float) -> None:
        """Bytes arrive (pings) but no data event for ``liveness``: is the slot still working on it?"""
        client = self._client
        limits = client.limits
        state = client._slot_state(self._slot, self._cancel, all_busy=False)
        quiet = time.monotonic() - progress
        if state != "busy":
            raise StalledError(
                "only pings for %.1f s and the slot is %s: the stream is stuck"
                % (quiet, "idle" if state == "idle" else "unknown"),
                quiet,
            )
        if quiet >= limits.busy_wait:
            raise StalledError("only pings for %.1f s (busy_wait) while the slot stays busy" % quiet, quiet)

    def _end_reasoning(self, completion_id: Optional[str], tokens: int) -> None:
        if not completion_id:
            raise ThinkingOverrunError(
                "reasoning reached the cap (%d tokens) but the stream has no completion id" % tokens, tokens
            )
        try:
            ok = self._client._control(completion_id, self._owner)
        except LoopError as exc:
            if self._cancel.is_set():
                raise
            raise ThinkingOverrunError(
                "reasoning reached the cap (%d tokens) and ending it failed: %s" % (tokens, exc), tokens
            ) from exc
        if not ok:
            raise ThinkingOverrunError(
                "reasoning reached the cap (%d tokens) and the server refused to end it" % tokens, tokens
            )


def _progress(item: Dict[str, Any]) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """(task, decoded, prompt_processed) of a ``/slots`` entry; None for what the server does not send."""
    nxt = item.get("next_token")
    if type(nxt) is list and nxt:
        nxt = nxt[0]
    decoded = nxt.get("n_decoded") if type(nxt) is dict else None
    values = (item.get("id_task"), decoded, item.get("n_prompt_tokens_processed"))
    return tuple(v if type(v) is int else None for v in values)  # type: ignore[return-value]


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _retryable(err: ServerError) -> bool:
    return err.code == 503 or err.type == "unavailable_error"


class Client:
    """A client of one llama-server, shared by any number of threads.

    ``address`` is a socket path, ``unix:///path`` or ``http://host:port``.  A malformed address, a CR or
    LF in ``api_key`` or a header, or limits of the wrong type raise ``ValueError``/``TypeError`` here.
    """

    def __init__(
        self,
        address: Any = None,
        *,
        limits: Optional[Limits] = None,
        api_key: Optional[str] = None,
        headers: Optional[Dict[str, str]] = None,
    ) -> None:
        if address is None:
            address = os.environ.get("LLAMA_SERVER") or DEFAULT_ADDRESS
        self._addr = parse_address(address)
        self.address = self._addr.text
        if limits is None:
            limits = Limits()
        elif not isinstance(limits, Limits):
            raise TypeError("limits must be a loopclient.Limits, not %s" % type(limits).__name__)
        self.limits = limits
        extra = [("User-Agent", _USER_AGENT)]  # type: List[Tuple[str, str]]
        if headers:
            for name, value in dict(headers).items():
                if not isinstance(name, str) or not isinstance(value, str):
                    raise TypeError("header names and values must be str")
                if name.lower() in ("host", "content-length", "transfer-encoding", "content-type", "connection"):
                    raise ValueError("header %s is set by loopclient itself" % name)
                extra = [(k, v) for k, v in extra if k.lower() != name.lower()]
                extra.append((name, value))
        if api_key is not None:
            if not isinstance(api_key, str):
                raise TypeError("api_key must be a str")
            extra.append(("Authorization", "Bearer " + api_key))
        encode_request("GET", "/", self._addr.host, extra)  # ValueError now for a CR, LF or bad name
        self._headers = extra
        self._prefixes = {}  # type: Dict[Tuple[str, str, str, bool], bytes]
        self._lock = threading.Lock()
        self._gate = _Gate(self._lock, limits.queue_len)
        self._poller = _SlotPoller(self, self._lock)
        self._pool_size = None  # type: Optional[int]
        self._props_lock = threading.Lock()
        self._streams: Set[ChatStream] = set()
        self._closed = False

    def __repr__(self) -> str:
        return "<loopclient.Client %s>" % self.address

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Cancel this client's streams in flight and stop its poller.  Further calls are ``ValueError``."""
        self._closed = True
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()
        self._poller.abort()

    # -- requests ------------------------------------------------------------------------------------

    def _encode(self, method: str, path: str, payload: Any, accept: str) -> bytes:
        """The request bytes; the head up to Content-Length is built (and checked) once per kind."""
        key = (method, path, accept, payload is not None)
        prefix = self._prefixes.get(key)
        if prefix is None:
            headers = [("Accept", accept)]
            if payload is not None:
                headers.append(("Content-Type", "application/json"))
            headers.append(("Connection", "close"))
            headers.extend(self._headers)
            prefix = self._prefixes[key] = encode_request(method, path, self._addr.host, headers)[:-2]
        if payload is None:
            return prefix + b"\r\n"
        body = json.dumps(payload, allow_nan=False).encode("utf-8")
        return b"%sContent-Length: %d\r\n\r\n%s" % (prefix, len(body), body)

    def stream(self, messages: Sequence[Dict[str, Any]], slot: Optional[int] = None, **params: Any) -> ChatStream:
        """A ``ChatStream`` for ``messages``; every keyword goes into the JSON body unchanged.

        The client sets ``stream``, ``stream_options.include_usage``, ``id_slot`` (when ``slot`` is given) and
        ``reasoning_control`` (when ``Limits.thinking_cap`` is set).  A body that is not JSON-serialisable is
        ``TypeError``/``ValueError`` here, before any connection.
        """
        if self._closed:
            raise ValueError("this client is closed")
        if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int)):
            raise TypeError("slot must be an int or None, not %r" % (slot,))
        if slot is not None and slot < 0:
            raise ValueError("slot must not be negative")
        body = {"messages": messages}  # type: Dict[str, Any]
        body.update(params)
        body["stream"] = True
        options = body.get("stream_options")
        body["stream_options"] = (
            dict(options, include_usage=True) if isinstance(options, dict) else {"include_usage": True}
        )
        if slot is not None:
            body["id_slot"] = slot
        if self.limits.thinking_cap is not None:
            body["reasoning_control"] = True
        request = self._encode("POST", "/v1/chat/completions", body, "text/event-stream")
        return ChatStream(self, request, slot)

    def chat(
        self,
        messages: Sequence[Dict[str, Any]],
        slot: Optional[int] = None,
        on_event: Optional[Callable[[Event], Any]] = None,
        **params: Any,
    ) -> Completion:
        """Stream a chat and return its ``Completion``, calling ``on_event`` in this thread for each event.

        Raises the ``LoopError`` subclasses of the SPEC.  An exception from ``on_event`` (or a
        KeyboardInterrupt) closes the request and propagates unchanged.
        """
        stream = self.stream(messages, slot=slot, **params)
        try:
            for event in stream:
                if on_event is not None:
                    on_event(event)
        except BaseException:
            stream.__exit__(None, None, None)
            raise
        assert stream.completion is not None
        return stream.completion

    def _call(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        timeout: Optional[float] = None,
        owner: Optional[_Owner] = None,
    ) -> Tuple[ResponseHead, bytes]:
        """One request on a new connection: (head, body).  Never retried."""
        request = self._encode(method, path, payload, "application/json")
        limits = self.limits
        timeout = limits.liveness if timeout is None else timeout
        try:
            conn = _Conn(self._addr, timeout)
        except OSError as exc:
            raise _connect_error(self._addr, exc) from exc
        if owner is not None:
            owner.add(conn)
        try:
            conn.sendall(request, timeout)
            reader = ResponseReader(max_body=limits.max_body)
            pieces = []  # type: List[bytes]
            while not reader.done:
                try:
                    data = conn.recv(timeout)
                except _Silence:
                    raise StalledError(
                        "%s %s: no answer for %.1f s (liveness)" % (method, path, timeout), timeout
                    ) from None
                if not data:
                    reader.feed_eof()
                    break
                pieces.extend(reader.feed(data))
            assert reader.head is not None
            return reader.head, b"".join(pieces)
        finally:
            conn.close()
            if owner is not None:
                owner.discard(conn)

    def _json(self, method: str, path: str, payload: Any = None, **kwargs: Any) -> Any:
        head, body = self._call(method, path, payload, **kwargs)
        if head.status != 200:
            raise HTTPStatusError(head.status, parse_error_envelope(body)[0], body)
        try:
            return json.loads(body.decode("utf-8", "replace"))
        except ValueError as exc:
            raise ProtocolError("%s %s answered invalid JSON: %s" % (method, path, exc)) from None
        except RecursionError:
            raise ProtocolError("%s %s answered JSON nested too deeply" % (method, path)) from None

    def _fetch_slots(self, timeout: Optional[float] = None, owner: Optional[_Owner] = None) -> List[Slot]:
        doc = self._json("GET", "/slots", timeout=timeout, owner=owner)
        if type(doc) is not list:
            raise ProtocolError("/slots did not answer a list")
        slots = []
        for item in doc:
            if type(item) is not dict or type(item.get("id")) is not int or type(item.get("is_processing")) is not bool:
                raise ProtocolError("/slots answered an entry without an integer id and a boolean is_processing")
            slots.append(Slot(item["id"], item["is_processing"], item, *_progress(item)))
        return slots

    def slots(self) -> List[Slot]:
        """``GET /slots``.  ``ConnectError``, ``StalledError``, ``HTTPStatusError``, ``ProtocolError``."""
        return self._fetch_slots()

    def health(self) -> Dict[str, Any]:
        """``GET /health``: ``{"status": "ok"}``; ``HTTPStatusError`` (503) while the model loads."""
        return self._object("GET", "/health")

    def props(self) -> Dict[str, Any]:
        """``GET /props``."""
        return self._object("GET", "/props")

    def models(self) -> Dict[str, Any]:
        """``GET /v1/models``."""
        return self._object("GET", "/v1/models")

    def end_reasoning(self, completion_id: str) -> bool:
        """Ask the server to end the reasoning of a completion in flight; True when it accepted."""
        return self._control(completion_id, None)

    def _object(self, method: str, path: str, payload: Any = None, **kwargs: Any) -> Dict[str, Any]:
        doc = self._json(method, path, payload, **kwargs)
        if not isinstance(doc, dict):
            raise ProtocolError("%s %s did not answer a JSON object" % (method, path))
        return doc

    def _control(self, completion_id: str, owner: Optional[_Owner]) -> bool:
        if not isinstance(completion_id, str):
            raise TypeError("completion_id must be a str")
        doc = self._object(
            "POST", "/v1/chat/completions/control", {"id": completion_id, "action": "reasoning_end"}, owner=owner
        )
        return doc.get("success") is True

    # -- shared state for streams --------------------------------------------------------------------

    def _pool_capacity(self, owner: _Owner, cancelled: _Flag) -> int:
        """``total_slots`` from ``/props``, read once; 1 until the server has answered."""
        while self._pool_size is None:
            if not self._props_lock.acquire(timeout=0.05):
                if cancelled.is_set():
                    raise CancelledError("the request was cancelled")
                continue
            try:
                if self._pool_size is None:
                    try:
                        total = self._object("GET", "/props", owner=owner).get("total_slots")
                    except LoopError:
                        return 1
                    if type(total) is not int or total < 1:
                        return 1
                    self._pool_size = total
            finally:
                self._props_lock.release()
        return self._pool_size

    def _slot_state(self, slot: Optional[int], cancelled: _Flag, all_busy: bool) -> str:
        slots = self._poller.get(self.limits.poll, cancelled)
        if slots is None:
            return "unavailable"
        if not slots:
            return "idle"
        if slot is None:
            flags = [s.is_processing for s in slots]
            busy = all(flags) if all_busy else any(flags)
        else:
            target = slot % len(slots)  # llama-server wraps an id_slot past the last slot
            busy = any(s.is_processing for s in slots if s.id == target)
        return "busy" if busy else "idle"

    def _wake(self, ticket: Optional[_Ticket]) -> None:
        self._gate.wake(ticket)
        self._poller.wake()

    def _remember(self, stream: ChatStream) -> None:
        with self._lock:
            self._streams.add(stream)

    def _forget(self, stream: ChatStream) -> None:
        with self._lock:
            self._streams.discard(stream)


# =====================================================================================================
# 8. Command line
# =====================================================================================================

_HINTS = (
    (BusyError, "the queue for this slot is full: try again later, or another --slot"),
    (WaitTimeoutError, "the slot stayed busy: try another --slot, or later"),
    (LoadTimeoutError, "start llama-server, or pass --socket PATH / --url URL"),
    (ConnectError, "start llama-server, or pass --socket PATH / --url URL"),
    (StalledError, "the server stopped answering: check its log"),
    (StreamClosedError, "the server closed the connection mid-answer: check its log, then retry"),
    (ThinkingOverrunError, "raise --thinking-cap, or drop it"),
    (HTTPStatusError, "the server refused the request"),
    (ServerError, "the server failed while answering: check its log"),
    (ProtocolError, "is this a llama-server? check the address"),
    (CancelledError, "the request was cancelled"),
)


def _describe(exc: LoopError) -> str:
    hint = next((text for cls, text in _HINTS if isinstance(exc, cls)), "")
    if isinstance(exc, LoadTimeoutError) and isinstance(exc.__cause__, OSError):
        exc_text = "%s (last: %s)" % (exc, exc.__cause__.strerror or exc.__cause__)
    else:
        exc_text = str(exc)
    return "loopclient: %s%s" % (exc_text, ": " + hint if hint else "")


class _Console:
    """Status lines on stderr: overwritten in place on a terminal, plain lines otherwise."""

    def __init__(self, out: Any, err: Any) -> None:
        self.out = out
        self.err = err
        self.tty = bool(getattr(err, "isatty", lambda: False)())
        self._status = False
        self._in_reasoning = False
        self.started = time.monotonic()
        self.first_token = None  # type: Optional[float]

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
        if isinstance(event, (Content, Reasoning, ToolCall)):
            if self.first_token is None:
                self.first_token = time.monotonic() - self.started
            self.clear()
        if isinstance(event, Content):
            if self._in_reasoning:
                self._end_reasoning()
            if show_text:
                self.out.write(event.text)
                self.out.flush()
        elif isinstance(event, Reasoning):
            if show_text:
                self._in_reasoning = True
                self.err.write("\x1b[2m" + event.text + "\x1b[0m" if self.tty else event.text)
                self.err.flush()
        elif isinstance(event, ToolCall):
            if self._in_reasoning:
                self._end_reasoning()
            if show_text:
                if event.name:
                    self.out.write("\n[tool call %s] %s " % (event.index, event.name))
                self.out.write(event.arguments)
                self.out.flush()
        elif isinstance(event, Queued):
            self.status("queued: %d ahead of this request" % event.ahead)
        elif isinstance(event, Waiting):
            waited = time.monotonic() - self.started
            self.status("waiting %.0f s: %s" % (waited, "the slot is busy" if event.slot_busy else "no answer yet"))
        elif isinstance(event, Retrying):
            self.status("retry %d in %.1f s: %s" % (event.attempt, event.delay, event.reason))
        elif isinstance(event, ThinkingCapped):
            if self._in_reasoning:
                self._end_reasoning()
            self.status("thinking capped at %d tokens" % event.tokens)
            if self.tty:
                self.err.write("\n")
                self._status = False

    def _end_reasoning(self) -> None:
        self._in_reasoning = False
        self.err.write("\n")
        self.err.flush()

    def figures(self, completion: Completion) -> str:
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
            parts.append(
                "%d reasoning%s" % (completion.reasoning_tokens, " (capped)" if completion.thinking_capped else "")
            )
        parts.append("finish: %s" % completion.finish_reason)
        return "[" + ", ".join(parts) + "]"


def _completion_json(completion: Completion) -> str:
    return json.dumps(completion.to_dict(), ensure_ascii=False, indent=2)


def _slots_table(slots: List[Slot]) -> str:
    rows = [("slot", "state", "decoded", "n_ctx")]
    for s in slots:
        decoded = ""
        nxt = s.raw.get("next_token")
        if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict):
            nxt = nxt[0]
        if isinstance(nxt, dict) and isinstance(nxt.get("n_decoded"), int):
            decoded = str(nxt["n_decoded"])
        n_ctx = s.raw.get("n_ctx")
        rows.append(
            (str(s.id), "busy" if s.is_processing else "idle", decoded, str(n_ctx) if n_ctx is not None else "")
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _parser() -> Any:
    import argparse

    common = argparse.ArgumentParser(add_help=False)
    where = common.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", default=argparse.SUPPRESS, help="llama-server's Unix socket")
    where.add_argument("--url", metavar="URL", default=argparse.SUPPRESS, help="llama-server's http://host:port")
    parser = argparse.ArgumentParser(
        prog="loopclient",
        parents=[common],
        description="Talk to llama.cpp's llama-server over a Unix socket or TCP.",
        epilog="The address defaults to $LLAMA_SERVER (a path or URL), else %s." % DEFAULT_ADDRESS,
    )
    parser.add_argument("--version", action="version", version="loopclient " + __version__)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    chat = commands.add_parser("chat", parents=[common], help="stream an answer (PROMPT, stdin, or a conversation)")
    chat.add_argument("prompt", nargs="?", help="the prompt; without it, read stdin or hold a conversation")
    chat.add_argument("--slot", type=int, help="pin the request to this slot")
    chat.add_argument("--system", help="a system message")
    chat.add_argument("--max-tokens", type=int, help="cap the answer's tokens")
    chat.add_argument("--temperature", type=float, help="sampling temperature")
    chat.add_argument("--thinking-cap", type=int, metavar="N", help="ask the server to end reasoning after N tokens")
    chat.add_argument("--json", action="store_true", help="print the whole completion as JSON")
    commands.add_parser("slots", parents=[common], help="show the server's slots")
    commands.add_parser("health", parents=[common], help="print /health as JSON")
    commands.add_parser("props", parents=[common], help="print /props as JSON")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (2), --help and --version (0)
        return exc.code if isinstance(exc.code, int) else 2
    if not args.command:
        parser.print_usage(sys.stderr)
        sys.stderr.write("loopclient: error: a COMMAND is required (chat, slots, health, props)\n")
        return 2
    address = getattr(args, "socket", None) or getattr(args, "url", None)
    try:
        limits = Limits(thinking_cap=args.thinking_cap) if getattr(args, "thinking_cap", None) is not None else None
        client = Client(address, limits=limits)
    except (ValueError, TypeError) as exc:
        sys.stderr.write("loopclient: error: %s\n" % exc)
        return 2
    try:
        with client:
            if args.command == "chat":
                return _chat(client, args)
            if args.command == "slots":
                print(_slots_table(client.slots()))
            elif args.command == "health":
                print(json.dumps(client.health()))
            else:
                print(json.dumps(client.props(), indent=2, ensure_ascii=False))
            return 0
    except LoopError as exc:
        sys.stderr.write(_describe(exc) + "\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\nloopclient: interrupted\n")
        return 130


def _chat(client: Client, args: Any) -> int:
    import functools

    params = {}  # type: Dict[str, Any]
    if args.max_tokens is not None:
        params["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        params["temperature"] = args.temperature
    history = []  # type: List[Dict[str, Any]]
    if args.system:
        history.append({"role": "system", "content": args.system})
    prompt = args.prompt
    interactive = False
    if prompt is None:
        if sys.stdin.isatty():
            interactive = True
        else:
            prompt = sys.stdin.read()
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:
                sys.stderr.write("\n")
                return 0
            prompt = line.rstrip("\n")
            if not prompt.strip():
                continue
        assert prompt is not None
        history.append({"role": "user", "content": prompt})
        console = _Console(sys.stdout, sys.stderr)
        show = functools.partial(console.event, show_text=not args.json)
        completion = client.chat(history, slot=args.slot, on_event=show, **params)
        console.clear()
        if args.json:
            sys.stdout.write(_completion_json(completion) + "\n")
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
            sys.stderr.write(console.figures(completion) + "\n")
        sys.stderr.flush()
        if not interactive:
            return 0
        turn = {"role": "assistant", "content": completion.content}  # type: Dict[str, Any]
        if completion.reasoning:
            turn["reasoning_content"] = completion.reasoning
        if completion.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in completion.tool_calls
            ]
        history.append(turn)


if __name__ == "__main__":
    sys.exit(main())
