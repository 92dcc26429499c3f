"""The core's view of one request: its tokens, progress and prefix-cache identity."""

from __future__ import annotations

import enum
from typing import NamedTuple

from protocol.block_hash import BlockHasher, ExtraKeys, pack_token_ids, salt_digest
from protocol.engine import Logprobs, SamplingParams

_NEVER = 1 << 62


class MultiModalPlaceholder(NamedTuple):
    """A multimodal input occupying prompt positions offset .. offset + length - 1."""

    identifier: str  # content hash of the input, computed by the client
    offset: int
    length: int


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again; its blocks were freed and it will be recomputed
    FINISHED = 3


_DEFAULT_PARAMS = SamplingParams()


def _digest(salt: str, hasher: BlockHasher | None) -> str:
    return salt_digest(salt, b"" if hasher is None else hasher.root)


class Request:
    """Token ids (prompt then output), num_computed_tokens, and the block-hash chain.

    Hashes grow as blocks fill (prompt at creation, outputs on append); a token that
    fills no block costs one comparison.
    """

    __slots__ = (
        "_extra_keys_of",
        "_hasher",
        "all_token_ids",
        "arrival",
        "arrived_at",
        "block_hash_inputs",
        "block_hashes",
        "finish_reason",
        "has_extra_keys",
        "hash_at",
        "holds_kv_blocks",
        "known_to_worker",
        "lora_id",
        "max_num_tokens",
        "mm_placeholders",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_pending_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "prompt_embeds_hash",
        "prompt_logprobs",
        "request_id",
        "salt_digest",
        "sampling_params",
        "skip_reading_prefix_cache",
        "status",
        "stop_token_set",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        block_hasher: BlockHasher | None = None,
        *,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        mm_placeholders: list[MultiModalPlaceholder] | None = None,
        prompt_embeds_hash: str | None = None,
        wants_prompt_logprobs: bool = False,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"request {request_id}: cache_salt must be a string")
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens a step in flight will sample that the core has not seen yet (at most one
        # per step in flight): counted in its length when scheduling, not yet in its ids.
        self.num_pending_tokens = 0
        self.num_preemptions = 0
        # Lower runs first under the priority policy; arrival (set by the scheduler that
        # takes it) breaks ties, oldest first.
        self.priority = priority
        self.arrival = 0
        # time.monotonic() when the scheduler took it (its queue time starts there).
        self.arrived_at = 0.0
        self.sampling_params = sampling_params or _DEFAULT_PARAMS
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        # Prefix-cache hit at first admission (-1: not admitted yet), reported to clients.
        self.num_cached_tokens = -1
        # Where it stops by length; Scheduler.add_request caps it at max_model_len.
        self.max_num_tokens = self.num_prompt_tokens + self.sampling_params.max_tokens
        # Token ids that may end it (stop_conditions.stop_token_set), set by the scheduler.
        self.stop_token_set: frozenset[int] = frozenset()
        # Once a worker holds its state, finishing it must be announced to the worker.
        self.known_to_worker = False
        # While a KVCacheManager holds blocks for it: tells this request apart from
        # another that reuses its id.
        self.holds_kv_blocks = False
        # Only a fixed-size digest of the salt is kept: the salt may be megabytes, and the
        # first block's hash input (which outlives the request) holds this.
        self.salt_digest = None if cache_salt is None else _digest(cache_salt, block_hasher)
        self.lora_id = lora_id
        self.mm_placeholders = sorted(mm_placeholders or (), key=lambda p: p.offset)
        self.prompt_embeds_hash = prompt_embeds_hash
        # Prompt logprobs need every prompt position's logits: the cache cannot give them.
        self.skip_reading_prefix_cache = wants_prompt_logprobs
        # Those received so far (prompt tokens 1, 2, ...), until sent with the first token;
        # None when not asked for, or once sent.
        self.prompt_logprobs: list[Logprobs] | None = [] if wants_prompt_logprobs else None
        self.block_hashes: list[bytes] = []
        # What each block hash was computed from (see BlockHasher.extend).
        self.block_hash_inputs: list[bytes] = []
        self._hasher = block_hasher
        # Extra keys are fixed at creation; most requests have none and skip that work.
        self.has_extra_keys = (
            lora_id is not None
            or bool(self.mm_placeholders)
            or prompt_embeds_hash is not None
            or cache_salt is not None
        )
        self._extra_keys_of = self.extra_keys if self.has_extra_keys else None
        if block_hasher is None:
            pack_token_ids(self.all_token_ids)  # same validation either way
            self.hash_at = _NEVER
        else:
            try:
                self.extend_hashes()
            except ValueError as e:
                raise ValueError(f"request {request_id}: {e}") from None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    def append_output_token_ids(self, token_id: int) -> None:
        ids = self.all_token_ids
        ids.append(token_id)
        if len(ids) >= self.hash_at:
            self.extend_hashes()

    def extra_keys(self, start: int, end: int) -> ExtraKeys:
        """Everything besides token ids that shapes the K/V of positions start .. end - 1."""
        keys: list[tuple] = []
        if self.lora_id is not None:
            keys.append(("lora", self.lora_id))
        for mm in self.mm_placeholders:
            if mm.offset >= end:
                break
            if mm.offset + mm.length > start:
                keys.append(("mm", mm.identifier, mm.offset))
        if self.prompt_embeds_hash is not None and start < self.num_prompt_tokens:
            keys.append(("embeds", self.prompt_embeds_hash))
        if start == 0 and self.salt_digest is not None:
            # Salting the first block is enough: the chain carries it to every later one.
            keys.append(("salt", self.salt_digest))
        return tuple(keys) or None

    def extend_hashes(self) -> None:
        """Hash the blocks that filled (due once the request holds hash_at tokens)."""
        hasher = self._hasher
        hasher.extend(
            self.block_hashes, self.all_token_ids, self._extra_keys_of, self.block_hash_inputs
        )
        self.hash_at = (len(self.block_hashes) + 1) * hasher.block_size

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
