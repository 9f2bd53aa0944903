"""Block plan builder and masked-affinity builder (bwd spec §3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mxcli.errors import InputError
from mxcli.kernels import build_block_plan, build_expert_affinities_masked
from mxcli.kernels.blockwise_moe import BwdValidationError, build_dense_block_plan, num_blocks
from mxcli.kernels.blockwise_moe.upstream_cases import upstream_router_choices, upstream_seed

# bwd spec §3.3, verbatim: (T, E, K, B, choices, block_to_expert, tpi per block)
SPEC_EXAMPLES = [
    (4, 2, 1, 2, [[1], [0], [0], [1]], [0, 1, 1], [[1, 2], [0, 3], [-1, -1]]),
    (
        4, 2, 2, 2,
        [[1, 0], [0, 1], [0, 1], [1, 0]],
        [0, 0, 1, 1, 1],
        [[0, 1], [2, 3], [0, 1], [2, 3], [-1, -1]],
    ),
    (
        6, 3, 2, 2,
        [[2, 1], [2, 0], [0, 2], [2, 0], [2, 1], [1, 0]],
        [0, 0, 1, 1, 2, 2, 2],
        [[1, 2], [3, 5], [0, 4], [5, -1], [0, 1], [2, 3], [4, -1]],
    ),
    (
        8, 4, 2, 4,
        [[2, 3], [0, 2], [3, 0], [1, 0], [1, 2], [0, 3], [1, 0], [0, 2]],
        [0, 0, 1, 2, 3, 3, 3],
        [[1, 2, 3, 5], [6, 7, -1, -1], [3, 4, 6, -1], [0, 1, 4, 7], [0, 2, 5, -1],
         [-1] * 4, [-1] * 4],
    ),
]  # fmt: skip


@pytest.mark.parametrize("T,E,K,B,choices,b2e,tpi", SPEC_EXAMPLES)
def test_spec_plan_examples(T, E, K, B, choices, b2e, tpi):
    got_tpi, got_b2e = build_block_plan(torch.tensor(choices), E, B)
    assert got_tpi.dtype == torch.int32 and got_b2e.dtype == torch.int32
    assert got_b2e.shape == (len(b2e), 1)
    assert got_b2e.view(-1).tolist() == b2e
    assert got_tpi.view(-1, B).tolist() == tpi
    assert len(b2e) == math.ceil((T * K - (E - 1)) / B) + E - 1


@pytest.mark.parametrize("T,E,K,B,choices,b2e,tpi", SPEC_EXAMPLES)
def test_upstream_router_reproduces_spec_choices(T, E, K, B, choices, b2e, tpi):
    # the spec's choices came from the seeded upstream router (legacy numpy RNG, seed 0)
    got = upstream_router_choices(T, E, K)
    assert got.tolist() == choices


@pytest.mark.parametrize("T,E,K,B,choices,b2e,tpi", SPEC_EXAMPLES)
def test_dense_affinities_give_the_same_plan(T, E, K, B, choices, b2e, tpi):
    dense = torch.zeros(T, E)
    for t, row in enumerate(choices):
        for e in row:
            dense[t, e] = 0.25 + 0.5 * ((t + e) % 2)
    got_tpi, got_b2e = build_block_plan(dense, E, B)
    assert got_tpi.view(-1, B).tolist() == tpi
    assert got_b2e.view(-1).tolist() == b2e
    # bool masks and numpy arrays are accepted too
    got2, _ = build_block_plan((dense != 0).numpy(), E, B)
    assert got2.view(-1, B).tolist() == tpi


def test_plan_invariants_random_routing():
    T, E, K, B = 300, 5, 3, 16
    choices = upstream_router_choices(T, E, K)
    tpi, b2e = build_block_plan(choices, E, B, pad=-7)
    N = b2e.shape[0]
    assert N == num_blocks(T * K, E, B)
    blocks = tpi.view(N, B)
    # every token appears exactly K times, at most once per expert, under the right expert
    pos_tokens = blocks[blocks != -7]
    assert torch.bincount(pos_tokens.long(), minlength=T).tolist() == [K] * T
    for e in range(E):
        rows = blocks[b2e.view(-1) == e].reshape(-1)
        toks = rows[rows != -7]
        want = (choices == e).any(1).nonzero().view(-1)
        assert toks.tolist() == want.tolist()  # ascending token order, contiguous from start
        assert (rows[: toks.numel()] == toks).all()
    # experts in non-decreasing order, surplus on the last expert
    assert (b2e.view(-1)[1:] >= b2e.view(-1)[:-1]).all()


def test_expert_without_tokens_owns_no_blocks():
    choices = torch.tensor([[0], [0], [2], [0]])  # expert 1 unused
    tpi, b2e = build_block_plan(choices, 3, 2)
    # N = ceil((4 - 2) / 2) + 2 = 3 = 2 (expert 0) + 0 (expert 1) + 1 (expert 2), no surplus
    assert b2e.view(-1).tolist() == [0, 0, 2]
    assert tpi.view(-1, 2).tolist() == [[0, 1], [3, -1], [2, -1]]


def test_num_blocks_is_the_worst_case():
    # E-1 experts with one token each, the rest on one expert
    T, E, B = 50, 4, 8
    choices = torch.tensor([[1], [2], [3]] + [[0]] * (T - 3))
    _, b2e = build_block_plan(choices, E, B)
    assert b2e.shape[0] == num_blocks(T, E, B) == math.ceil((T - 3) / B) + 3
    assert torch.bincount(b2e.view(-1).long()).tolist() == [math.ceil((T - 3) / B), 1, 1, 1]


def test_plan_validation_errors():
    with pytest.raises(BwdValidationError, match="expert_index: expected expert ids in"):
        build_block_plan(torch.tensor([[0], [3]]), 3, 2)
    with pytest.raises(BwdValidationError, match="distinct experts"):
        build_block_plan(torch.tensor([[0, 0], [1, 2]]), 3, 2)
    with pytest.raises(BwdValidationError, match=r"dense affinities need shape \(T, 4\)"):
        build_block_plan(torch.ones(3, 2), 4, 2)
    with pytest.raises(BwdValidationError, match="block_size"):
        build_block_plan(torch.tensor([[0]]), 1, 0)
    with pytest.raises(InputError):  # the common base class of user errors
        build_block_plan(torch.tensor([0, 1]), 2, 2)


def test_dense_block_plan():
    tpi, b2e = build_dense_block_plan(8, 4)
    assert tpi.tolist() == list(range(8)) and b2e.view(-1).tolist() == [0, 0]
    with pytest.raises(BwdValidationError, match="multiple of block_size"):
        build_dense_block_plan(6, 4)


def test_affinities_masked_three_forms():
    T, E = 4, 3
    probs = torch.arange(T * E, dtype=torch.float32).view(T, E) / 16 + 0.5
    idx = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1]])
    want = torch.zeros(T, E)
    for t in range(T):
        for e in idx[t].tolist():
            want[t, e] = probs[t, e]
    got = build_expert_affinities_masked(probs, idx)  # router probabilities + choices
    assert got.shape == (T * E, 1) and torch.equal(got.view(T, E), want)
    topk = torch.gather(probs, 1, idx)  # top-k weights aligned with the choices
    assert torch.equal(build_expert_affinities_masked(topk, idx, num_experts=E), got)
    assert torch.equal(build_expert_affinities_masked(want), got)  # already masked
    # token-major flattening: entry t*E + e (spec §3.3 affinity example)
    assert got[2 * E + 0, 0] == probs[2, 0]
    bf = build_expert_affinities_masked(probs.bfloat16(), idx)
    assert bf.dtype == torch.bfloat16


def test_affinities_masked_errors():
    with pytest.raises(BwdValidationError, match="weights: expected shape"):
        build_expert_affinities_masked(torch.ones(4, 3), torch.zeros(4, 2, dtype=torch.long), 3)
    with pytest.raises(BwdValidationError, match="expert_index"):
        build_expert_affinities_masked(torch.ones(4, 3), torch.zeros(5, 2, dtype=torch.long))


def test_upstream_seed_is_sha256_of_the_shape_string():
    import hashlib

    s = "1024_2_256_4_384_2048_mxfp8"
    want = int(hashlib.sha256(s.encode()).hexdigest(), 16) % 2**32
    assert upstream_seed(1024, 2, 256, 4, 384, 2048) == want
    assert isinstance(np.random.RandomState(want).rand(), float)
