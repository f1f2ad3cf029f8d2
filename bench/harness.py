"""What every scenario shares: reading a server's event streams, the scenario's flags, where its
results go, and the markdown it writes.

The streaming client. Responses streamed as server-sent events are read by `events()` alone:
`data: ...` lines, each taken with its arrival time (perf_counter), ended by `data: [DONE]` (the
last payload it yields) or by the end of the body (transformers serve sends no [DONE]). Blank
separators, SSE comments (keep-alive pings) and event names are passed over. What a payload means
(content, usage, an error event) is the caller's: bench/loadgen.py folds chat and completions
chunks into a RequestResult, bench/soak_traffic.py judges how a stream ended. `sse()` opens a
stream and raises on a status other than 200; `trace()` records when a stream's token events came.

The scenario skeleton. `parse_args()` builds a scenario's argparse from keyword defaults (the
flag name and type follow from the keyword and its default) and adds `--out` (the results JSON,
bench/results/<name>.json) and `--doc` (the report also written as a markdown section);
`provenance.meta()` is the block that says where and how the results were measured; `publish()`
writes the JSON, prints the report and writes the section.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DOCS_DIR = Path(__file__).resolve().parent.parent / "docs"
DONE = "[DONE]"


# -- the streaming client ---------------------------------------------------------------------
async def events(resp: httpx.Response) -> AsyncIterator[tuple[str, float]]:
    """The `data:` payloads of a server-sent-event response with their arrival times; the last
    one is `[DONE]` when the server sent it, else the body's end ends the iteration."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, SSE comments (keep-alive pings), event names
        payload = line[5:].strip()
        yield payload, time.perf_counter()
        if payload == DONE:
            return


@asynccontextmanager
async def sse(client: httpx.AsyncClient, path: str, body: dict
              ) -> AsyncIterator[AsyncIterator[tuple[str, float]]]:
    """`async with sse(client, path, body) as stream: async for payload, at in stream: ...`; an
    HTTP status other than 2xx raises (httpx.HTTPStatusError). Leaving the block closes the
    connection, whether the stream has ended or not."""
    async with client.stream("POST", path, json=body) as resp:
        resp.raise_for_status()
        yield events(resp)


@dataclass
class StreamTrace:
    """Arrival times of one stream's token events."""

    times: list[float] = field(default_factory=list)

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Gaps whose later token arrived within [start, end]."""
        return [b - a for a, b in zip(self.times, self.times[1:]) if start <= b <= end]


async def trace(client: httpx.AsyncClient, path: str, body: dict, into: StreamTrace,
                is_token: Callable[[str], bool]) -> None:
    """Stream `body` to its end, recording in `into` when each payload for which `is_token` is
    true arrived."""
    async with sse(client, path, body) as stream:
        async for payload, at in stream:
            if is_token(payload):
                into.times.append(at)


async def until_streaming(traces: Sequence[StreamTrace], tasks: Sequence[asyncio.Task],
                          tokens: int, check: bool = True) -> None:
    """Wait until every trace holds `tokens` token times; with `check`, a stream that ends first
    raises what ended it."""
    while min(len(t.times) for t in traces) < tokens:
        if check and any(t.done() for t in tasks):
            await asyncio.gather(*tasks)  # raises what ended a stream early
        await asyncio.sleep(0.02 if check else 0.05)


# -- the scenario skeleton --------------------------------------------------------------------
@dataclass(frozen=True)
class Opt:
    """A flag whose type, action or help cannot be read off its default."""

    default: object = None
    type: Callable | None = None
    help: str | None = None
    action: str | None = None


CHECKOUT = Opt(None, Path, "also (or instead) run the server of this other checkout "
                           "(`python -m app serve` with it as working directory)")
SERVER_ARG = Opt([], action="append", help="extra flag for the server (repeatable)")


def parse_args(doc: str, name: str, argv: list[str] | None, **options) -> argparse.Namespace:
    """A scenario's flags: one per keyword (`stream_tokens=320` is `--stream-tokens`, an int
    defaulting to 320; an `Opt` says more), then `--out` (default bench/results/<name>.json) and
    `--doc`. The description is the first line of `doc`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    for key, value in options.items():
        opt = value if isinstance(value, Opt) else Opt(value)
        kwargs: dict = {"default": opt.default, "help": opt.help}
        if opt.action:
            kwargs["action"] = opt.action
        else:
            kwargs["type"] = opt.type or type(opt.default)
        ap.add_argument("--" + key.replace("_", "-"), **kwargs)
    ap.add_argument("--out", type=Path, default=Path(f"bench/results/{name}.json"))
    ap.add_argument("--doc", type=Path, default=None, help="also write the report (markdown)")
    return ap.parse_args(argv)


def server_log(out: Path, label: str) -> Path:
    """Where a scenario's server writes its log: beside `out`, named after the server."""
    return out.with_suffix(f".{label.replace(' ', '-')}.log")


def write_json(path: Path, data: dict, indent: int = 1) -> Path:
    """Write `data` to `path` (folders made as needed); returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str) + "\n")
    return path


def publish(data: dict, out: Path, report: str, doc: Path | None, heading: str,
            workload: str = "", intro: str | None = None) -> None:
    """Write the results to `out` (JSON) and print the report; with `doc`, also write it as a
    markdown section: `heading`, then `intro` (by default the command that measured it,
    `workload` and the machine)."""
    write_json(out, data)
    print(report)
    if doc is not None:
        meta = data["meta"]
        if intro is None:
            intro = f"`{doc_command(meta)}`: {workload} {machine_line(meta)}."
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(section(heading, intro, report))
    print(f"wrote {out}")


# -- markdown ---------------------------------------------------------------------------------
def doc_command(meta: dict) -> str:
    """The command of `meta` without local paths (another checkout's becomes DIR)."""
    checkout = (meta.get("args") or {}).get("checkout")
    return meta["command"].replace(checkout, "DIR") if checkout else meta["command"]


def machine_line(meta: dict) -> str:
    """`CPU, N cores, <finished>` for a report's intro."""
    m = meta["machine"]
    return f"{m.get('cpu')}, {m.get('cores_available')} cores, {meta['finished']}"


def section(heading: str, intro: str, body: str) -> str:
    """A report section: a level-3 heading, a paragraph, the body."""
    return f"### {heading}\n\n{intro}\n\n{body}\n"


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A GitHub markdown table, columns padded; floats with two decimals, ints with thousands
    separators, numbers right-aligned."""
    rows_list = [list(row) for row in rows]
    cells = [[str(h) for h in headers]] + [[fmt(v) for v in row] for row in rows_list]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for raw, r in zip(rows_list, cells[1:]):  # text left, numbers right
        lines.append("| " + " | ".join(c.rjust(w) if isinstance(v, (int, float)) else c.ljust(w)
                                       for v, c, w in zip(raw, r, widths)) + " |")
    return "\n".join(lines)


def pipe_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A compact markdown table's lines, cells as given (already formatted), no padding."""
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]
