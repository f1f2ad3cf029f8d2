"""The Responses API's store: responses kept in memory so a later request can read them
(GET /v1/responses/{id}, its input items), delete them, cancel a running one, or continue the
conversation (`previous_response_id`).

Bounded twice, by entries and by bytes (--response-store-entries, --response-store-bytes): a
new or finished response that takes the store over either bound evicts the oldest first, and
one larger than the byte bound alone is not kept. Bytes are those of the stored JSON (the
response, its input items and the conversation it continues), counted in /metrics as
`seqgate_response_store_bytes`. With API keys set, a response belongs to the key that created
it; another key gets the same 404 as for an id that does not exist.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from adapters.errors import ApiError
from adapters.responses_types import ResponseItemList, ResponseObject

MAX_PAGE = 100  # input items per page, as OpenAI allows


def response_not_found(response_id: str, param: str = "response_id") -> ApiError:
    return ApiError(404, f"No response with id '{response_id}' found: it does not exist, was "
                    "deleted, was created with store=false, or was evicted from this server's "
                    "response store.", "response_not_found", param)


@dataclass
class StoredResponse:
    """One response: its latest state, its input, and (once finished) its conversation."""

    response: ResponseObject
    input_items: list[dict[str, Any]]
    owner: str | None  # the API key that created it; None without keys
    history: list[dict[str, Any]] | None = None  # chat messages, set once it has finished
    cancel: Callable[[], None] | None = None  # aborts it while it runs
    nbytes: int = 0

    def measure(self) -> int:
        parts = (self.response, self.input_items, self.history or [])
        self.nbytes = sum(len(msgspec.json.encode(p)) for p in parts)
        return self.nbytes

    @property
    def running(self) -> bool:
        return self.response.status == "in_progress"


class ResponseStore:
    """Owns the stored responses, oldest first. Thread-safe: requests read it while they are
    prepared off the event loop. (A plain class: Litestar's dependency injection inspects the
    fields of dataclasses it is handed, and a lock is no type it knows.)"""

    def __init__(self, max_entries: int, max_bytes: int,
                 report: Callable[[int, int], None] | None = None):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.report = report or (lambda entries, nbytes: None)  # the metrics gauges
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def put(self, record: StoredResponse) -> None:
        """Keep (or re-measure) a record, then evict the oldest until both bounds hold."""
        with self._lock:
            old = self._items.get(record.response.id)
            if old is not None:  # replaced where it stands: age counts from creation
                self._bytes -= old.nbytes
            self._items[record.response.id] = record
            self._bytes += record.measure()
            while self._items and (len(self._items) > self.max_entries
                                   or self._bytes > self.max_bytes):
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.nbytes
            self.report(len(self._items), self._bytes)

    def update(self, record: StoredResponse) -> None:
        """Re-store a record that changed, unless it was deleted or evicted meanwhile."""
        with self._lock:
            if self._items.get(record.response.id) is not record:
                return
        self.put(record)

    def get(self, response_id: str, owner: str | None,
            param: str = "response_id") -> StoredResponse:
        with self._lock:
            record = self._items.get(response_id)
        if record is None or record.owner != owner:
            raise response_not_found(response_id, param)
        return record

    def delete(self, response_id: str, owner: str | None) -> None:
        record = self.get(response_id, owner)
        with self._lock:
            if self._items.pop(response_id, None) is record:
                self._bytes -= record.nbytes
            self.report(len(self._items), self._bytes)

    def history(self, response_id: str, owner: str | None) -> list[dict[str, Any]]:
        """The conversation a `previous_response_id` continues: 404 when unknown, 400 while
        that response has not finished (there is no answer to continue from yet)."""
        record = self.get(response_id, owner, "previous_response_id")
        if record.history is None:
            raise ApiError.bad_request(f"previous_response_id '{response_id}' is "
                                       f"{record.response.status}: only a completed or "
                                       "incomplete response can be continued",
                                       param="previous_response_id")
        return record.history


def page_items(items: list[dict[str, Any]], limit: int, order: str,
               after: str | None) -> ResponseItemList:
    """One page of a response's input items: `order` asc (as sent) or desc, starting after the
    item whose id is `after`."""
    if not 1 <= limit <= MAX_PAGE:
        raise ApiError.bad_request(f"limit must be between 1 and {MAX_PAGE}, got {limit}",
                                   param="limit")
    if order not in ("asc", "desc"):
        raise ApiError.bad_request(f"order must be asc or desc, got {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ApiError.bad_request(f"after names no input item of this response: {after!r}",
                                       param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return ResponseItemList(data=page, has_more=len(ordered) > limit,
                            first_id=page[0]["id"] if page else None,
                            last_id=page[-1]["id"] if page else None)
