"""enginecore/request.py: a request's token ids, its length limit, and its block-hash
chain, grown as outputs fill blocks and keyed by everything besides tokens that shapes
its K/V (salt, LoRA, multimodal inputs, prompt embeddings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from enginecore.request import MultiModalPlaceholder, Request, RequestStatus
from launch import LLM
from launch.client.inputs import Prompt
from protocol.block_hash import BlockHasher, salt_digest
from protocol.engine import SamplingParams
from tests.helpers.cli_helpers import CPU
from tests.helpers.proc_memory import rss_bytes

BS = 4


def _chain(token_ids: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    BlockHasher(BS).extend(hashes, token_ids)
    return hashes


def test_a_new_request_hashes_its_full_prompt_blocks_and_waits() -> None:
    r = Request("r", list(range(10)), BlockHasher(BS), sampling_params=SamplingParams(max_tokens=5))
    assert r.status is RequestStatus.WAITING
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (10, 10, 0)
    assert r.max_num_tokens == 15
    assert r.block_hashes == _chain(list(range(10)))  # two full blocks of four
    assert len(r.block_hashes) == 2


def test_outputs_extend_the_chain_when_they_fill_a_block() -> None:
    r = Request("r", list(range(6)), BlockHasher(BS))
    r.append_output_token_ids(50)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(51)  # token 8: the second block is full
    assert r.block_hashes == _chain([*range(6), 50, 51])
    assert r.prompt_token_ids == list(range(6)) and r.num_output_tokens == 2


def test_extra_keys_name_what_shapes_each_block_besides_its_tokens() -> None:
    image = MultiModalPlaceholder("img", offset=5, length=4)  # positions 5..8
    r = Request("r", list(range(12)), cache_salt="s", lora_id=3, mm_placeholders=[image])
    assert r.extra_keys(0, 4) == (("lora", 3), ("salt", salt_digest("s")))
    assert r.extra_keys(4, 8) == (("lora", 3), ("mm", "img", 5))
    assert r.extra_keys(8, 12) == (("lora", 3), ("mm", "img", 5))
    plain = Request("p", list(range(12)), prompt_embeds_hash="e")
    assert plain.extra_keys(8, 12) == (("embeds", "e"),)
    assert plain.extra_keys(12, 16) is None  # past the prompt


def test_a_salt_changes_every_block_hash_through_the_chain() -> None:
    salted = Request("a", list(range(8)), BlockHasher(BS), cache_salt="tenant")
    plain = Request("b", list(range(8)), BlockHasher(BS))
    assert all(x != y for x, y in zip(salted.block_hashes, plain.block_hashes, strict=True))


def test_a_request_keeps_a_fixed_size_digest_of_its_salt_never_the_salt() -> None:
    hasher = BlockHasher(BS)
    huge = "t" * 1_000_000
    r = Request("r", list(range(8)), hasher, cache_salt=huge)
    assert r.salt_digest == hasher.salt_digest(huge) and len(r.salt_digest) == 64
    assert not hasattr(r, "cache_salt")
    # What outlives the request (the first block's hash input) is small too.
    assert max(len(x) for x in r.block_hash_inputs) < 200
    same = Request("s", list(range(8)), hasher, cache_salt=huge)
    other = Request("o", list(range(8)), hasher, cache_salt=huge[:-1] + "u")
    assert same.block_hashes == r.block_hashes and same.block_hash_inputs == r.block_hash_inputs
    assert all(x != y for x, y in zip(other.block_hashes, r.block_hashes, strict=True))


def test_huge_salts_leave_the_core_process_small_and_still_isolate_tenants(
    llama_dir: Path,
) -> None:
    """60 requests with 5 MB salts each: their blocks stay cached (and published, with a
    replay buffer) after they finish, yet the core grows by less than 100 MB (it grew by
    over 500 MB when blocks kept the salt itself). Equal salts still share blocks."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with LLM(
        str(llama_dir),
        device=CPU,
        kv_events_endpoint="tcp://127.0.0.1:0",
        kv_events_replay_endpoint="tcp://127.0.0.1:0",
    ) as llm:
        core = llm.engine.procs["engine core"].pid
        llm.generate([[1] * 40], params, use_tqdm=False)
        before = rss_bytes(core)
        for i in range(60):
            salt = f"{i:03d}" + "s" * 5_000_000
            prompt = Prompt(prompt_token_ids=[i % 50 + 3] * 40, cache_salt=salt)
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            assert out.error is None
        grown = rss_bytes(core) - before
        assert grown < 100 * 2**20, f"the core grew by {grown / 2**20:.0f} MB"
        tenant = "t" * 5_000_000
        ids = list(range(3, 43))
        first, again, other = (
            llm.generate([Prompt(prompt_token_ids=ids, cache_salt=s)], params, use_tqdm=False)[0]
            for s in (tenant, tenant, tenant[:-1] + "u")
        )
        assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
        assert other.num_cached_tokens == 0


def test_prompt_logprobs_skip_reading_the_prefix_cache() -> None:
    r = Request("r", [1, 2], wants_prompt_logprobs=True)
    assert r.skip_reading_prefix_cache and r.prompt_logprobs == []
    assert Request("q", [1, 2]).prompt_logprobs is None


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("", [1]), {}, "request id must be a non-empty string"),
        (("r", []), {}, "request r: empty prompt"),
        (("r", [1]), {"cache_salt": 5}, "cache_salt must be a string"),
        (("r", [1, 2, 3, -1], BlockHasher(BS)), {}, r"request r: token ids must be integers"),
        (("r", [2**32]), {}, r"token ids must be integers"),
    ],
)
def test_a_bad_request_is_refused_at_creation(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Request(*args, **kwargs)
