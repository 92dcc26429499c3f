"""Stored responses (`store`: previous_response_id, GET/DELETE /v1/responses/{id}): the
last ones kept in memory, the oldest dropped first, and their input items paged."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from launch.openai.protocol import APIError

# Kept responses (for previous_response_id and GET): bounded, the oldest dropped first.
DEFAULT_MAX_STORED_RESPONSES = 1024


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


class ResponseStore:
    """The last `capacity` stored responses by id (0: none are kept)."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if capacity < 0:
            raise ValueError(f"the response store's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        f"no stored response has the id {response_id!r} (responses are kept in memory, "
        "the most recent first, while the server runs)",
        400 if param else 404,
        param=param,
        code="response_not_found" if param is None else "previous_response_not_found",
    )
