"""The soak's traffic: what each client sends, how it reads the answer, and how that answer ended.

A `RequestMix` draws every request from a seeded RNG over ShareGPT exchanges: chat or
/v1/completions, streamed or not, greedy or sampled (temperature, sometimes a seed), some with
n=2, some with stop strings, a small `max_tokens` so that requests keep cycling. A share of
requests is cut by the client on purpose (a stream closed after a few events, a whole request
cancelled after a random delay), and a share is bad input from `BAD_INPUTS` (malformed JSON, wrong
types, two ~1 MB stop strings, an unknown model, a prompt over the context, too many logit_bias
entries, a negative max_tokens...), which must be refused with a 4xx in OpenAI's error envelope.

Bodies go out as raw bytes over httpx so that malformed ones can be sent. `send` never raises: it
returns an `Outcome` that says what came back (status, error code, how a stream ended) and, where
the server did something wrong, a `problem`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import httpx

from bench.harness import DONE, events
from bench.sharegpt import Request

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
ERROR_FIELDS = ("message", "type", "param", "code")
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


@dataclass(frozen=True)
class ServedModel:
    """What the bad inputs need to know about the server under test."""

    name: str | None
    max_model_len: int


# -- bad input --------------------------------------------------------------------------------

def _chat(model: str | None, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, **fields}


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
}


def bad_request(name: str, served: ServedModel, rng: random.Random) -> SoakRequest:
    path, build = BAD_INPUTS[name]
    return SoakRequest(f"bad:{name}", path, build(served, rng), stream=False, bad=True)


# -- the mix ----------------------------------------------------------------------------------

@dataclass
class MixShares:
    """Fractions of requests with each trait (each drawn independently per request)."""

    bad: float = 0.05
    cut: float = 0.10
    completions: float = 0.25
    stream: float = 0.5
    sampled: float = 0.5
    n2: float = 0.15
    stop: float = 0.2


class RequestMix:
    """Draws the soak's requests, reproducibly from `seed`, over `exchanges`."""

    def __init__(self, exchanges: Sequence[Request], served: ServedModel, seed: int = 0,
                 shares: MixShares | None = None):
        if not exchanges:
            raise ValueError("the mix needs at least one exchange")
        self.exchanges, self.served = exchanges, served
        self.shares = shares or MixShares()
        self.rng = random.Random(seed)
        self._bad_deck: list[str] = []

    def next(self) -> SoakRequest:
        if self.rng.random() < self.shares.bad:
            return bad_request(self._next_bad_input(), self.served, self.rng)
        return self.good()

    def _next_bad_input(self) -> str:
        # Dealt from a shuffled deck rather than drawn: every kind comes up once in each
        # len(BAD_INPUTS) bad requests, so even a short run sends each of them.
        if not self._bad_deck:
            self._bad_deck = self.rng.sample(sorted(BAD_INPUTS), len(BAD_INPUTS))
        return self._bad_deck.pop()

    def good(self) -> SoakRequest:
        rng, shares = self.rng, self.shares
        ex = rng.choice(self.exchanges)
        completions = rng.random() < shares.completions
        stream = rng.random() < shares.stream
        body: dict = {"model": self.served.name, "max_tokens": ex.max_tokens, "stream": stream}
        if completions:
            body["prompt"] = ex.prompt
        else:
            body["messages"] = ex.messages
        traits = []
        if rng.random() < shares.sampled:
            body["temperature"] = round(rng.uniform(0.5, 1.2), 2)
            if rng.random() < 0.5:
                body["seed"] = rng.randrange(2**31)
            traits.append("sampled")
        else:
            body["temperature"] = 0
        if rng.random() < shares.n2:
            body["n"] = 2
            traits.append("n2")
        if rng.random() < shares.stop:
            body["stop"] = rng.choice([["\n\n"], ["."], [" the ", "\n"], "I"])
            traits.append("stop")
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        kind = "-".join(["completion" if completions else "chat",
                         *(["stream"] if stream else []), *traits])
        cut = rng.random() < shares.cut
        return SoakRequest(kind, COMPLETIONS_PATH if completions else CHAT_PATH, _encode(body),
                           stream, cut_after_events=rng.randint(1, 8) if cut and stream else None,
                           cut_after_s=round(rng.uniform(0.05, 3.0), 3)
                           if cut and not stream else None)


# -- what came back ---------------------------------------------------------------------------

def envelope_problem(body: bytes | str) -> str | None:
    """None if `body` is OpenAI's error envelope with a string code, else what is wrong with it."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
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


def error_code(body: bytes | str) -> str | None:
    try:
        err = json.loads(body).get("error")
        return str(err.get("code")) if isinstance(err, dict) else None
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class StreamEnd:
    """How a stream ended: `done` ([DONE], no error), `error-then-done`, `error-no-done`, or
    `truncated` (neither [DONE] nor an error event); `error_code` from the error event."""

    how: str
    error_code: str | None = None
    events: int = 0


def classify_stream(payloads: Sequence[str]) -> StreamEnd:
    """Classify a stream by its `data:` payloads, in order."""
    code, errored = None, False
    for payload in payloads:
        if payload == DONE:
            return StreamEnd("error-then-done" if errored else "done", code, len(payloads))
        if not errored and payload.startswith("{") and '"error"' in payload:
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            if isinstance(obj, dict) and "error" in obj:
                errored = True
                err = obj["error"]
                code = str(err.get("code")) if isinstance(err, dict) else None
    return StreamEnd("error-no-done" if errored else "truncated", code, len(payloads))


@dataclass
class Outcome:
    """How one request ended. Times are seconds from the start of the traffic."""

    kind: str
    bad: bool
    stream: bool
    started: float
    ended: float = 0.0
    status: int | None = None  # None: no HTTP answer at all
    code: str | None = None  # the error envelope's code (HTTP body or SSE error event)
    stream_end: str | None = None  # StreamEnd.how, for streams answered 200
    cut: bool = False  # the client cut it on purpose before it ended
    probe: bool = False  # sent during the drain, expecting 503
    problem: str | None = None  # what the server did wrong, if anything
    body: str | None = None  # the start of the answer, kept where there is a problem

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}


def _judge_error(o: Outcome, req: SoakRequest, body: bytes) -> None:
    """Fold a non-200 answer into `o`: every one must be an error envelope; bad input must get
    a 4xx; a 5xx other than 503 is always a problem."""
    o.code = error_code(body)
    if (p := envelope_problem(body)) is not None:
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
        try:
            ok = isinstance(resp.json().get("choices"), list)
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            o.problem, o.body = "200 without choices", resp.text[:2000]


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
    end = classify_stream(payloads)
    o.stream_end, o.code = end.how, end.error_code
    if end.how == "truncated":
        o.problem = f"stream ended without [DONE] or an error after {end.events} events"
    elif end.how == "error-no-done":
        o.problem = f"stream error event ({end.error_code}) not followed by [DONE]"
    elif end.error_code not in (None, "service_unavailable"):
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
        outcomes.append(await send(client, mix.next(), t0))
