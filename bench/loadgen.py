"""A closed-loop load generator for OpenAI-compatible servers (httpx, asyncio).

`concurrency` workers share one queue of request bodies: each sends one, reads its response to
the end, then takes the next, so exactly `concurrency` requests are in flight until the queue
runs dry. Streamed responses are read by bench/harness.py's `events()`: `data: {...}` chunks,
ended by `data: [DONE]` or (transformers serve, which sends no [DONE]) by the end of the body.
Timings are taken on arrival of each chunk; the token count comes from the `usage` the server
reports (asked for with stream_options.include_usage), else from the number of content chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import httpx

from bench.figures import RequestResult
from bench.harness import DONE, events


def _content(choice: dict) -> str:
    """The text a streamed or whole choice carries: chat delta / message content, or completions
    text."""
    for key in ("delta", "message"):
        if isinstance(choice.get(key), dict):
            return choice[key].get("content") or ""
    return choice.get("text") or ""


def _error_text(obj) -> str:
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _take_usage(res: RequestResult, usage: dict | None) -> None:
    if not usage:
        return
    if usage.get("completion_tokens") is not None:
        res.output_tokens = int(usage["completion_tokens"])
    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        res.cached_tokens = int(details["cached_tokens"])


def apply_chunk(res: RequestResult, payload: str, now: float, keep_text: bool) -> bool:
    """Fold one SSE data payload into `res`; True once the stream is over ([DONE] or an error)."""
    if payload == DONE:
        return True
    obj = json.loads(payload)
    if "error" in obj:
        res.error = f"stream error: {_error_text(obj)}"
        return True
    for choice in obj.get("choices") or []:
        text = _content(choice)
        if text:
            if res.first_token is None:
                res.first_token = now
            res.content_chunks += 1
            if keep_text:
                res.text += text
        res.finish_reason = choice.get("finish_reason") or res.finish_reason
    _take_usage(res, obj.get("usage"))
    return False


async def _send_streaming(client: httpx.AsyncClient, path: str, body: dict,
                          res: RequestResult, keep_text: bool) -> None:
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:300]
            res.error = f"HTTP {resp.status_code}: {text}"
            return
        async for payload, at in events(resp):
            if apply_chunk(res, payload, at, keep_text):
                break
    res.end = time.perf_counter()
    if res.output_tokens == 0:  # no usage reported
        res.output_tokens = res.content_chunks


async def _send_whole(client: httpx.AsyncClient, path: str, body: dict,
                      res: RequestResult) -> None:
    resp = await client.post(path, json=body)
    res.end = time.perf_counter()
    if resp.status_code != 200:
        res.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
        return
    obj = resp.json()
    choices = obj.get("choices") or []
    res.text = "".join(_content(c) for c in choices)
    res.finish_reason = choices[0].get("finish_reason") if choices else None
    res.first_token = res.end  # a whole response has no earlier first token
    res.margins = _margins(choices[0]) if choices else None
    _take_usage(res, obj.get("usage"))


def _margins(choice: dict) -> list[tuple[str, str, float]] | None:
    """(token, runner-up, logprob gap) per token of a chat choice that carries top_logprobs."""
    content = (choice.get("logprobs") or {}).get("content")
    if not content:
        return None
    out = []
    for item in content:
        key = item.get("bytes") or item["token"]
        alts = [t for t in item.get("top_logprobs") or [] if (t.get("bytes") or t["token"]) != key]
        if not alts:
            return None
        best = max(alts, key=lambda t: t["logprob"])
        out.append((item["token"], best["token"], item["logprob"] - best["logprob"]))
    return out


async def send(client: httpx.AsyncClient, path: str, body: dict, index: int,
               keep_text: bool = False) -> RequestResult:
    """Send one request (streamed if body["stream"]); failures become `error`, never raise."""
    res = RequestResult(index=index, sent=time.perf_counter())
    try:
        if body.get("stream"):
            await _send_streaming(client, path, body, res, keep_text)
        else:
            await _send_whole(client, path, body, res)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        res.end = None
    return res


async def closed_loop(base_url: str, path: str, bodies: Sequence[dict], concurrency: int,
                      timeout: float = 3600.0, keep_text: bool = False
                      ) -> tuple[list[RequestResult], float]:
    """Run `bodies` with `concurrency` in flight; the results in workload order (times relative
    to the first send) and the wall time from the first send to the last response's end."""
    results: list[RequestResult | None] = [None] * len(bodies)
    queue = iter(range(len(bodies)))  # shared by the workers; asyncio runs one at a time
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=30.0)) as client:

        async def worker() -> None:
            for i in queue:
                results[i] = await send(client, path, bodies[i], i, keep_text)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(bodies))))))
        wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    for r in done:
        r.sent -= t0
        r.first_token = None if r.first_token is None else r.first_token - t0
        r.end = None if r.end is None else r.end - t0
    return done, wall


def run_closed_loop(base_url: str, path: str, bodies: Sequence[dict], concurrency: int,
                    timeout: float = 3600.0, keep_text: bool = False
                    ) -> tuple[list[RequestResult], float]:
    """closed_loop() from synchronous code."""
    return asyncio.run(closed_loop(base_url, path, bodies, concurrency, timeout, keep_text))
