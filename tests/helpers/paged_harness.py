"""A hand-run paged batch for a model alone: plays the scheduler and the model runner
(block allocation, attention metadata, one forward per step) so a model's paged logits can
be checked against transformers at every position, at TP 1 and across ranks."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from tests.helpers.hf_checkpoints import VOCAB
from worker.attention import AttentionMetadata
from worker.model_config import ModelConfig
from worker.models.llama import LlamaForCausalLM

BLOCK_SIZE = 4
NUM_BLOCKS = 96
GEN_TOKENS = 8


@dataclass
class PagedRequest:
    token_ids: list[int]
    num_computed: int = 0
    blocks: list[list[int]] = field(default_factory=list)  # per group
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> logits
    generated: list[int] = field(default_factory=list)


class PagedHarness:
    """Plays the scheduler and model runner: block allocation, metadata, one forward."""

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, num_groups: int) -> None:
        self.model = model
        self.num_groups = num_groups
        # Alternate layers between groups, as the runner would from a KVCacheConfig with
        # several groups; each group allocates from its own disjoint set of block ids.
        for i, layer in enumerate(model.attention_layers().values()):
            layer.kv_group = i % num_groups
        shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        # NaN everywhere not written this run: reading a stale slot poisons the logits.
        self.kv_caches = [
            (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
            for _ in range(config.num_hidden_layers)
        ]
        rng = random.Random(99)
        self.free = []
        for g in range(num_groups):
            # Block 0 is the null block; shuffled so tables are not contiguous.
            ids = [i for i in range(1, NUM_BLOCKS) if i % num_groups == g]
            rng.shuffle(ids)
            self.free.append(ids)

    def check_layers_wrote_only_their_group_blocks(self) -> None:
        for i, (key_cache, value_cache) in enumerate(self.kv_caches):
            written = torch.nonzero(~key_cache.isnan().all(dim=(1, 2, 3))).flatten()
            assert all(int(b) % self.num_groups == i % self.num_groups for b in written), i
            assert torch.equal(key_cache.isnan(), value_cache.isnan()), i

    def step(self, scheduled: list[tuple[PagedRequest, int]]) -> None:
        """Compute `n` new tokens of each (request, n); record logits; sample greedily."""
        input_ids, positions, qsl, seq_lens = [], [], [0], []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]
        for req, n in scheduled:
            start, end = req.num_computed, req.num_computed + n
            if not req.blocks:
                req.blocks = [[] for _ in range(self.num_groups)]
            for g in range(self.num_groups):
                while len(req.blocks[g]) < math.ceil(end / BLOCK_SIZE):
                    req.blocks[g].append(self.free[g].pop())
                for p in range(start, end):
                    block = req.blocks[g][p // BLOCK_SIZE]
                    slots[g].append(block * BLOCK_SIZE + p % BLOCK_SIZE)
            input_ids += req.token_ids[start:end]
            positions += list(range(start, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
        # Two padding tokens at the end, as a runner padding to a graph size would add.
        input_ids += [0, 0]
        positions += [0, 0]
        for g in range(self.num_groups):
            slots[g] += [-1, -1]

        max_blocks = max(len(req.blocks[0]) for req, _ in scheduled) + 2
        tables = []
        for g in range(self.num_groups):
            table = torch.zeros(len(scheduled), max_blocks, dtype=torch.int32)
            for b, (req, _) in enumerate(scheduled):
                table[b, : len(req.blocks[g])] = torch.tensor(req.blocks[g], dtype=torch.int32)
            tables.append(table)
        attn = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mappings=[torch.tensor(s, dtype=torch.int64) for s in slots],
        )
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(input_ids), torch.tensor(positions), attn, self.kv_caches
            )
            logits = self.model.compute_logits(hidden[: qsl[-1]])
        assert logits.dtype == torch.float32 and logits.shape == (qsl[-1], VOCAB)
        for b, (req, n) in enumerate(scheduled):
            for i in range(n):
                req.logits[req.num_computed + i] = logits[qsl[b] + i]
            req.num_computed += n
            if req.num_computed == len(req.token_ids):  # prompt done or decode: sample
                token = int(logits[qsl[b + 1] - 1].argmax())
                req.generated.append(token)
                req.token_ids.append(token)


PROMPT_LENS = {"a": 11, "b": 5, "c": 17, "d": 14}


def paged_prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    return {
        k: torch.randint(3, VOCAB, (n,), generator=gen).tolist() for k, n in PROMPT_LENS.items()
    }


def run_paged_batches(
    harness: PagedHarness, prompts: dict[str, list[int]]
) -> dict[str, PagedRequest]:
    """Step 1: three whole prompts and the first chunk of d; later steps decode a, b, c
    while d's prefill continues in chunks, then d decodes alongside them."""
    reqs = {k: PagedRequest(list(p)) for k, p in prompts.items()}
    a, b, c, d = reqs["a"], reqs["b"], reqs["c"], reqs["d"]
    harness.step([(a, 11), (b, 5), (d, 6), (c, 17)])
    harness.step([(d, 5), (a, 1), (b, 1), (c, 1)])
    harness.step([(a, 1), (d, 3), (b, 1), (c, 1)])
    while len(d.generated) < GEN_TOKENS:
        batch = [(r, 1) for r in (a, b, c) if len(r.generated) < GEN_TOKENS]
        harness.step([*batch, (d, 1)])
    harness.check_layers_wrote_only_their_group_blocks()
    return reqs
