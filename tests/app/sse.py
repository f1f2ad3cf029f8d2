"""Read a raw text/event-stream the way a strict client would."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx


@dataclass
class RawStream:
    """A stream's data events (parsed JSON), whether it ended with [DONE], and its comments."""

    events: list[dict] = field(default_factory=list)
    done: bool = False
    comments: int = 0
    after_done: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c["delta"].get("content", "") for e in self.events
                       for c in e.get("choices", []) if "delta" in c)


def read_stream(response: httpx.Response) -> RawStream:
    assert response.status_code == 200, response.read()
    assert response.headers["content-type"].startswith("text/event-stream")
    out = RawStream()
    for line in response.iter_lines():
        if not line:
            continue
        if line.startswith(":"):
            out.comments += 1
        elif out.done:
            out.after_done.append(line)
        elif line == "data: [DONE]":
            out.done = True
        else:
            assert line.startswith("data: "), line
            out.events.append(json.loads(line[len("data: "):]))
    return out
