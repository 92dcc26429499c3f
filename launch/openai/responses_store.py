"""Stored responses (`store`: previous_response_id, GET/DELETE /v1/responses/{id}): the
last ones kept in memory, within a count and a byte budget, the oldest dropped first, and
their input items paged."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from launch.openai.protocol import APIError

# Kept responses (for previous_response_id and GET): bounded, the oldest dropped first.
DEFAULT_MAX_STORED_RESPONSES = 1024
# And their estimated size in all: one response can hold megabytes of input.
DEFAULT_RESPONSES_STORE_BYTES = 256 * 2**20
# Added per message and input item to its JSON length: a small item costs Python several
# times its JSON (its dict, its id, its parts), and the estimate must not undercount.
ITEM_OVERHEAD_BYTES = 512


class StoredResponse(msgspec.Struct):
    response: dict[str, Any]
    # The conversation so far, input and output, without instructions.
    messages: list[dict[str, Any]]
    # This response's own input, as items with ids (GET .../input_items).
    input_items: list[dict[str, Any]] = []


def list_page(
    items: list[dict[str, Any]], limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """One page of a list endpoint (OpenAI's cursor pagination by item id)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise APIError(f"no item has the id {after!r}", param="after", code="invalid_value")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }


_encode = msgspec.json.Encoder().encode


def stored_size(stored: StoredResponse) -> int:
    """A stored response's estimated memory: its JSON length (text shared between its
    conversation and its input items counts twice, so it errs high) plus a fixed cost
    per message and input item."""
    items = len(stored.messages) + len(stored.input_items)
    return len(_encode(stored)) + ITEM_OVERHEAD_BYTES * items


class ResponseStore:
    """The last stored responses by id: at most `capacity` of them (0: none are kept)
    and at most `max_bytes` by stored_size, the oldest dropped first."""

    def __init__(
        self,
        capacity: int = DEFAULT_MAX_STORED_RESPONSES,
        max_bytes: int = DEFAULT_RESPONSES_STORE_BYTES,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"the response store's capacity must be >= 0, got {capacity}")
        if max_bytes < 1:
            raise ValueError(f"the response store's byte budget must be >= 1, got {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0  # stored_size of all kept
        # id -> (response, its stored_size), oldest first
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep it as the newest (False, and nothing kept, when none are kept or it alone
        is over the byte budget), then drop the oldest until both bounds hold."""
        if self.capacity == 0:
            return False
        size = stored_size(stored)
        self.delete(response_id)
        if size > self.max_bytes:
            return False
        self._items[response_id] = (stored, size)
        self.num_bytes += size
        while len(self._items) > self.capacity or self.num_bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self.num_bytes -= dropped
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        kept = self._items.get(response_id)
        return None if kept is None else kept[0]

    def delete(self, response_id: str) -> bool:
        kept = self._items.pop(response_id, None)
        if kept is None:
            return False
        self.num_bytes -= kept[1]
        return True


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        f"no stored response has the id {response_id!r} (responses are kept in memory, "
        "the most recent first, while the server runs)",
        400 if param else 404,
        param=param,
        code="response_not_found" if param is None else "previous_response_not_found",
    )
