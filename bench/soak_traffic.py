"""The soak's traffic: what each client sends, how it reads the answer, and how that answer ended.

A `RequestMix` draws every request from a seeded RNG over ShareGPT exchanges: chat,
/v1/completions, /v1/responses (stored, sometimes continuing an earlier stored response by
`previous_response_id`, sometimes `store: false`) or Anthropic's /v1/messages; streamed or not,
greedy or sampled (temperature, sometimes a seed), some with n=2, some with stop strings, a small
`max_tokens` so that requests keep cycling. A share of requests is cut by the client on purpose (a
stream closed after a few events, a whole request cancelled after a random delay), and a share is
bad input from `BAD_INPUTS` (malformed JSON, wrong types, two ~1 MB stop strings, an unknown
model, a prompt over the context, too many logit_bias entries, a negative max_tokens, malformed
Responses items and Anthropic blocks...), which must be refused with a 4xx in the route's own
error shape.

Each route's answers are judged by its `Wire`: OpenAI's error envelope or Anthropic's, `[DONE]`
or the protocol's last event (`response.completed`, `message_stop`) as a stream's proper end.

Bodies go out as raw bytes over httpx so that malformed ones can be sent. `send` never raises: it
returns an `Outcome` that says what came back (status, error code, how a stream ended) and, where
the server did something wrong, a `problem`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import httpx

from bench.harness import DONE, events
from bench.sharegpt import Request

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
ERROR_FIELDS = ("message", "type", "param", "code")
# "The server is draining": OpenAI's error code and Anthropic's error type for it.
UNAVAILABLE = ("service_unavailable", "overloaded_error")
JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True)
class SoakRequest:
    """One request as a client sends it: raw body bytes, so malformed JSON is possible."""

    kind: str  # "chat", "chat-stream", "completion", ..., or "bad:<name>"
    path: str
    body: bytes
    stream: bool
    bad: bool = False  # bad input: must be refused with a 4xx error envelope
    cut_after_events: int | None = None  # stream: the client closes it after this many events
    cut_after_s: float | None = None  # whole response: the client gives up after this long
    stored: bool = False  # /v1/responses with store on: its answer can be continued


@dataclass(frozen=True)
class ServedModel:
    """What the bad inputs need to know about the server under test."""

    name: str | None
    max_model_len: int


# -- bad input --------------------------------------------------------------------------------

HELLO = [{"role": "user", "content": "Say hello."}]


def _chat(model: str | None, **fields) -> dict:
    return {"model": model, "messages": HELLO, "max_tokens": 8, **fields}


def _anthropic(model: str | None, **fields) -> dict:
    return {"model": model or "", "messages": HELLO, "max_tokens": 8, **fields}


def _encode(body: dict) -> bytes:
    return json.dumps(body).encode()


def _huge_stop(served: ServedModel, rng: random.Random) -> bytes:
    # Two ~1 MB stop strings: a limit must refuse them before any per-string work is done.
    stops = ["".join(rng.choices("abcdefgh", k=1_000_000)) for _ in range(2)]
    return _encode(_chat(served.name, stop=stops))


def _over_long_prompt(served: ServedModel, rng: random.Random) -> bytes:
    ids = [rng.randrange(100, 10_000) for _ in range(served.max_model_len + 16)]
    return _encode({"model": served.name, "prompt": ids, "max_tokens": 4})


def _too_many_logit_bias(served: ServedModel, rng: random.Random) -> bytes:
    # OpenAI allows 300 entries, seqgate 1024: 4096 is over any limit a server should have.
    bias = {str(tok): 1.0 for tok in rng.sample(range(10_000), 4096)}
    return _encode(_chat(served.name, logit_bias=bias))


BadInput = Callable[[ServedModel, random.Random], bytes]

# name -> (path, body builder). Every one must come back as a 4xx error envelope.
BAD_INPUTS: dict[str, tuple[str, BadInput]] = {
    "malformed-json": (CHAT_PATH, lambda s, r: b'{"messages": [{"role": "user", "content": "hi"'),
    "not-utf8": (CHAT_PATH, lambda s, r: b'{"messages": "\xff\xfe"}'),
    "json-array": (CHAT_PATH, lambda s, r: b"[1, 2, 3]"),
    "messages-wrong-type": (CHAT_PATH, lambda s, r: _encode(_chat(s.name, messages="hello"))),
    "temperature-wrong-type": (CHAT_PATH, lambda s, r: _encode(_chat(s.name, temperature="hot"))),
    "missing-messages": (CHAT_PATH, lambda s, r: _encode({"model": s.name, "max_tokens": 4})),
    "empty-messages": (CHAT_PATH, lambda s, r: _encode(_chat(s.name, messages=[]))),
    "unknown-role": (CHAT_PATH, lambda s, r: _encode(
        _chat(s.name, messages=[{"role": "wizard", "content": "hi"}]))),
    "huge-stop-strings": (CHAT_PATH, _huge_stop),
    "unknown-model": (CHAT_PATH, lambda s, r: _encode(_chat("no-such-model-" + str(r.random())))),
    "over-long-prompt": (COMPLETIONS_PATH, _over_long_prompt),
    "max-tokens-over-context": (CHAT_PATH, lambda s, r: _encode(
        _chat(s.name, max_tokens=s.max_model_len * 4))),
    "too-many-logit-bias": (CHAT_PATH, _too_many_logit_bias),
    "logit-bias-not-a-token": (CHAT_PATH, lambda s, r: _encode(
        _chat(s.name, logit_bias={"hello": 5}))),
    "negative-max-tokens": (CHAT_PATH, lambda s, r: _encode(_chat(s.name, max_tokens=-5))),
    "temperature-out-of-range": (CHAT_PATH, lambda s, r: _encode(_chat(s.name, temperature=9.5))),
    "n-too-large": (CHAT_PATH, lambda s, r: _encode(_chat(s.name, n=10_000))),
    # function tools are served; other tool types are refused by name
    "unsupported-tool-type": (CHAT_PATH, lambda s, r: _encode(
        _chat(s.name, tools=[{"type": "code_interpreter"}]))),
    "empty-prompt": (COMPLETIONS_PATH, lambda s, r: _encode(
        {"model": s.name, "prompt": "", "max_tokens": 4})),
    # the Responses API: items it does not take, a call output answering no call, an id it
    # does not hold (a 404)
    "responses-unknown-item": (RESPONSES_PATH, lambda s, r: _encode(
        {"model": s.name, "input": [{"type": "reasoning", "summary": []}]})),
    "responses-output-of-no-call": (RESPONSES_PATH, lambda s, r: _encode(
        {"model": s.name, "input": [{"type": "function_call_output", "call_id": "call_none",
                                     "output": "x"}]})),
    "responses-unknown-previous-id": (RESPONSES_PATH, lambda s, r: _encode(
        {"model": s.name, "input": "hi", "previous_response_id": f"resp_{r.random()}"})),
    "responses-built-in-tool": (RESPONSES_PATH, lambda s, r: _encode(
        {"model": s.name, "input": "hi", "tools": [{"type": "web_search"}]})),
    "responses-output-over-context": (RESPONSES_PATH, lambda s, r: _encode(
        {"model": s.name, "input": "hi", "max_output_tokens": s.max_model_len * 4})),
    # Anthropic's Messages API: refused in Anthropic's error shape
    "anthropic-malformed-json": (MESSAGES_PATH, lambda s, r: b'{"messages": [{"role": "user"'),
    "anthropic-missing-max-tokens": (MESSAGES_PATH, lambda s, r: _encode(
        {"model": s.name or "", "messages": HELLO})),
    "anthropic-unknown-block": (MESSAGES_PATH, lambda s, r: _encode(_anthropic(
        s.name, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]))),
    "anthropic-tool-result-of-no-call": (MESSAGES_PATH, lambda s, r: _encode(_anthropic(
        s.name, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_none", "content": "x"}]}]))),
    "anthropic-tool-choice-of-no-tool": (MESSAGES_PATH, lambda s, r: _encode(_anthropic(
        s.name, tool_choice={"type": "tool", "name": "nowhere"}))),
    "anthropic-count-tokens-without-messages": (COUNT_TOKENS_PATH, lambda s, r: _encode(
        {"model": s.name or ""})),
}


def bad_request(name: str, served: ServedModel, rng: random.Random) -> SoakRequest:
    path, build = BAD_INPUTS[name]
    return SoakRequest(f"bad:{name}", path, build(served, rng), stream=False, bad=True)


# -- the mix ----------------------------------------------------------------------------------

@dataclass
class MixShares:
    """Fractions of requests with each trait (each drawn independently per request; the routes
    other than chat share one draw)."""

    bad: float = 0.05
    cut: float = 0.10
    completions: float = 0.25
    responses: float = 0.15
    messages: float = 0.10
    stream: float = 0.5
    sampled: float = 0.5
    n2: float = 0.15  # chat and completions
    stop: float = 0.2  # all but the Responses API, which has no stop parameter
    continued: float = 0.3  # responses that continue an earlier stored one
    unstored: float = 0.2  # responses with store: false


# The stored responses a continuation draws from: the latest ones, as a client would continue.
REMEMBERED_RESPONSES = 64


class RequestMix:
    """Draws the soak's requests, reproducibly from `seed`, over `exchanges` (a continued
    response also depends on which stored responses were `remember`ed by then)."""

    def __init__(self, exchanges: Sequence[Request], served: ServedModel, seed: int = 0,
                 shares: MixShares | None = None):
        if not exchanges:
            raise ValueError("the mix needs at least one exchange")
        self.exchanges, self.served = exchanges, served
        self.shares = shares or MixShares()
        self.rng = random.Random(seed)
        self._bad_deck: list[str] = []
        self.stored: deque[str] = deque(maxlen=REMEMBERED_RESPONSES)

    def next(self) -> SoakRequest:
        if self.rng.random() < self.shares.bad:
            return bad_request(self._next_bad_input(), self.served, self.rng)
        return self.good()

    def remember(self, outcome: Outcome) -> None:
        """Keep the id of a response the server stored, for later requests to continue."""
        if outcome.response_id:
            self.stored.append(outcome.response_id)

    def _next_bad_input(self) -> str:
        # Dealt from a shuffled deck rather than drawn: every kind comes up once in each
        # len(BAD_INPUTS) bad requests, so even a short run sends each of them.
        if not self._bad_deck:
            self._bad_deck = self.rng.sample(sorted(BAD_INPUTS), len(BAD_INPUTS))
        return self._bad_deck.pop()

    def _route(self) -> str:
        shares, draw = self.shares, self.rng.random()
        for route, share in (("completion", shares.completions),
                             ("responses", shares.responses), ("messages", shares.messages)):
            if draw < share:
                return route
            draw -= share
        return "chat"

    def good(self) -> SoakRequest:
        rng, shares = self.rng, self.shares
        ex = rng.choice(self.exchanges)
        route = self._route()
        stream = rng.random() < shares.stream
        body: dict = {"model": self.served.name, "stream": stream}
        traits = []
        if route == "completion":
            body.update(prompt=ex.prompt, max_tokens=ex.max_tokens)
        elif route == "chat":
            body.update(messages=ex.messages, max_tokens=ex.max_tokens)
        elif route == "messages":
            body.update(model=self.served.name or "", messages=ex.messages,
                        max_tokens=ex.max_tokens)
        else:
            body.update(input=ex.messages, max_output_tokens=ex.max_tokens)
            if self.stored and rng.random() < shares.continued:
                body["previous_response_id"] = rng.choice(self.stored)
                traits.append("continued")
            if rng.random() < shares.unstored:
                body["store"] = False
                traits.append("unstored")
        if rng.random() < shares.sampled:
            body["temperature"] = round(rng.uniform(0.5, 1.0 if route == "messages" else 1.2), 2)
            if route != "messages" and rng.random() < 0.5:
                body["seed"] = rng.randrange(2**31)
            traits.append("sampled")
        else:
            body["temperature"] = 0
        if route in ("chat", "completion") and rng.random() < shares.n2:
            body["n"] = 2
            traits.append("n2")
        if route != "responses" and rng.random() < shares.stop:
            stop = rng.choice([["\n\n"], ["."], [" the ", "\n"], "I"])
            if route == "messages":
                body["stop_sequences"] = [stop] if isinstance(stop, str) else stop
            else:
                body["stop"] = stop
            traits.append("stop")
        if route in ("chat", "completion") and stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        kind = "-".join([route, *(["stream"] if stream else []), *traits])
        cut = rng.random() < shares.cut
        return SoakRequest(kind, ROUTES[route], _encode(body), stream,
                           cut_after_events=rng.randint(1, 8) if cut and stream else None,
                           cut_after_s=round(rng.uniform(0.05, 3.0), 3)
                           if cut and not stream else None,
                           stored=route == "responses" and body.get("store") is not False)


ROUTES = {"chat": CHAT_PATH, "completion": COMPLETIONS_PATH, "responses": RESPONSES_PATH,
          "messages": MESSAGES_PATH}


# -- what came back ---------------------------------------------------------------------------

def _json(body: bytes | str) -> object:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def envelope_problem(body: bytes | str) -> str | None:
    """None if `body` is OpenAI's error envelope with a string code, else what is wrong with it."""
    obj = _json(body)
    if obj is None:
        return "error body is not JSON"
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return "error body has no `error` object"
    missing = [k for k in ERROR_FIELDS if k not in err]
    if missing:
        return f"error envelope lacks {', '.join(missing)}"
    if not isinstance(err["code"], str) or not isinstance(err["message"], str):
        return "error envelope's code or message is not a string"
    return None


def anthropic_error_problem(body: bytes | str) -> str | None:
    """None if `body` is Anthropic's error shape (`{"type": "error", "error": {"type",
    "message"}}`), else what is wrong with it."""
    obj = _json(body)
    if obj is None:
        return "error body is not JSON"
    err = obj.get("error") if isinstance(obj, dict) else None
    if obj.get("type") != "error" or not isinstance(err, dict):
        return "not Anthropic's error shape (type 'error' with an `error` object)"
    if not isinstance(err.get("type"), str) or not isinstance(err.get("message"), str):
        return "Anthropic error's type or message is not a string"
    return None


def error_code(body: bytes | str) -> str | None:
    """OpenAI's error code, or Anthropic's error type (its only code)."""
    obj = _json(body)
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return None
    code = err.get("code") if "code" in err else err.get("type")
    return None if code is None else str(code)


@dataclass(frozen=True)
class StreamEnd:
    """How a stream ended: `done` (its proper end, no error), `error-then-done` (an error event,
    then the proper end: `[DONE]` on OpenAI's routes, the body's end after the error event on
    the routes with named events), `error-no-done`, or `truncated` (no proper end and no error
    event); `error_code` from the error event; `response_id` from the response's last event."""

    how: str
    error_code: str | None = None
    events: int = 0
    response_id: str | None = None


def classify_stream(payloads: Sequence[str]) -> StreamEnd:
    """Classify an OpenAI stream (chat, completions) by its `data:` payloads, in order."""
    code, errored = None, False
    for payload in payloads:
        if payload == DONE:
            return StreamEnd("error-then-done" if errored else "done", code, len(payloads))
        if not errored and payload.startswith("{") and '"error"' in payload:
            obj = _json(payload)
            if isinstance(obj, dict) and "error" in obj:
                errored = True
                err = obj["error"]
                code = str(err.get("code")) if isinstance(err, dict) else None
    return StreamEnd("error-no-done" if errored else "truncated", code, len(payloads))


# The events that end a stream of named events properly: the Responses API's and Anthropic's.
_LAST_EVENTS = ("response.completed", "response.incomplete", "response.failed", "message_stop")


def classify_named_stream(payloads: Sequence[str]) -> StreamEnd:
    """Classify a stream of typed events (/v1/responses, /v1/messages) by its `data:` payloads:
    each a JSON object with a `type`; the last one ends it, or an `error` event does."""
    for payload in payloads:
        obj = _json(payload)
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "error":
            err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
            code = err.get("code") or err.get("type")
            return StreamEnd("error-then-done", None if code is None else str(code),
                             len(payloads))
        if kind in _LAST_EVENTS:
            response = obj.get("response") if isinstance(obj.get("response"), dict) else {}
            return StreamEnd("done", None, len(payloads), response.get("id"))
    return StreamEnd("truncated", None, len(payloads))


def _is_completion(obj: dict) -> bool:
    return isinstance(obj.get("choices"), list)


def _is_response(obj: dict) -> bool:
    return obj.get("object") == "response" and isinstance(obj.get("output"), list)


def _is_message(obj: dict) -> bool:
    return obj.get("type") == "message" and isinstance(obj.get("content"), list)


@dataclass(frozen=True)
class Wire:
    """How a route's answers look: its error body, a whole answer, the stream's events."""

    error_problem: Callable[[bytes | str], str | None]
    answered: Callable[[dict], bool]
    classify: Callable[[Sequence[str]], StreamEnd]


OPENAI_WIRE = Wire(envelope_problem, _is_completion, classify_stream)
WIRES = {
    RESPONSES_PATH: Wire(envelope_problem, _is_response, classify_named_stream),
    MESSAGES_PATH: Wire(anthropic_error_problem, _is_message, classify_named_stream),
    COUNT_TOKENS_PATH: Wire(anthropic_error_problem,
                            lambda obj: isinstance(obj.get("input_tokens"), int),
                            classify_named_stream),
}


def wire(path: str) -> Wire:
    return WIRES.get(path, OPENAI_WIRE)


@dataclass
class Outcome:
    """How one request ended. Times are seconds from the start of the traffic."""

    kind: str
    bad: bool
    stream: bool
    started: float
    ended: float = 0.0
    status: int | None = None  # None: no HTTP answer at all
    code: str | None = None  # the error's code (HTTP body or SSE error event)
    stream_end: str | None = None  # StreamEnd.how, for streams answered 200
    cut: bool = False  # the client cut it on purpose before it ended
    probe: bool = False  # sent during the drain, expecting 503
    problem: str | None = None  # what the server did wrong, if anything
    body: str | None = None  # the start of the answer, kept where there is a problem
    response_id: str | None = None  # a response the server stored (/v1/responses)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}

    @property
    def unavailable(self) -> bool:
        """Refused because the server is draining (HTTP 503, or an error event saying so)."""
        return self.code in UNAVAILABLE


def _judge_error(o: Outcome, req: SoakRequest, body: bytes) -> None:
    """Fold a non-200 answer into `o`: every one must be in the route's error shape; bad input
    must get a 4xx; a 5xx other than 503 is always a problem."""
    o.code = error_code(body)
    if (p := wire(req.path).error_problem(body)) is not None:
        o.problem = f"HTTP {o.status}: {p}"
    elif o.status is not None and o.status >= 500 and o.status != 503:
        o.problem = f"HTTP {o.status}"
    elif req.bad and not (o.status and 400 <= o.status < 500) and o.status != 503:
        o.problem = f"bad input answered {o.status}"
    if o.problem:
        o.body = body[:2000].decode(errors="replace")


async def _send_whole(client: httpx.AsyncClient, req: SoakRequest, o: Outcome) -> None:
    try:
        resp = await asyncio.wait_for(
            client.post(req.path, content=req.body, headers=JSON_HEADERS), req.cut_after_s)
    except TimeoutError:
        o.cut = True  # wait_for's deadline: the client gave up on purpose
        return
    o.status = resp.status_code
    if resp.status_code != 200:
        _judge_error(o, req, resp.content)
    elif req.bad:
        o.problem, o.body = "bad input accepted (200)", resp.text[:2000]
    else:
        obj = _json(resp.content)
        if not (isinstance(obj, dict) and wire(req.path).answered(obj)):
            o.problem, o.body = f"200 that is no answer of {req.path}", resp.text[:2000]
        elif req.stored:
            o.response_id = obj.get("id")


async def _send_stream(client: httpx.AsyncClient, req: SoakRequest, o: Outcome) -> None:
    payloads: list[str] = []
    async with client.stream("POST", req.path, content=req.body, headers=JSON_HEADERS) as resp:
        o.status = resp.status_code
        if resp.status_code != 200:
            _judge_error(o, req, await resp.aread())
            return
        async for payload, _ in events(resp):
            payloads.append(payload)
            if payload == DONE:
                break
            if req.cut_after_events is not None and len(payloads) >= req.cut_after_events:
                o.cut = True  # leaving the block closes the connection mid-stream
                return
    end = wire(req.path).classify(payloads)
    o.stream_end, o.code = end.how, end.error_code
    o.response_id = end.response_id if req.stored else None
    if end.how == "truncated":
        o.problem = f"stream ended without its last event or an error after {end.events} events"
    elif end.how == "error-no-done":
        o.problem = f"stream error event ({end.error_code}) not followed by [DONE]"
    elif end.error_code is not None and not o.unavailable:
        o.problem = f"stream error event {end.error_code}"
    if o.problem:
        o.body = "\n".join(payloads[-3:])[:2000]


async def send(client: httpx.AsyncClient, req: SoakRequest, t0: float,
               probe: bool = False) -> Outcome:
    """Send `req` and read its answer; never raises. Times relative to `t0` (perf_counter)."""
    o = Outcome(req.kind, req.bad, req.stream, time.perf_counter() - t0, probe=probe)
    try:
        if req.stream:
            await _send_stream(client, req, o)
        else:
            await _send_whole(client, req, o)
    except httpx.TimeoutException as exc:
        o.problem = f"timed out ({type(exc).__name__}) after status {o.status}"
    except (httpx.HTTPError, OSError) as exc:
        o.problem = f"no answer: {type(exc).__name__}: {exc}"[:300]
        if o.status is not None:  # the connection broke after the headers
            o.problem = f"connection broke after HTTP {o.status}: {type(exc).__name__}"
            o.stream_end = "truncated" if o.stream and o.status == 200 else None
    o.ended = time.perf_counter() - t0
    return o


async def client_loop(client: httpx.AsyncClient, mix: RequestMix, stop: asyncio.Event,
                      outcomes: list[Outcome], t0: float) -> None:
    """One closed-loop client: send, wait for the answer, send the next, until `stop`."""
    while not stop.is_set():
        outcome = await send(client, mix.next(), t0)
        mix.remember(outcome)
        outcomes.append(outcome)
