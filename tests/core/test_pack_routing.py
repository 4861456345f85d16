"""``hybridrl.engines.rollout_kit.pack_routing``: per-request routing arrays (what an engine records for every token it
fed) placed into ``routed_experts`` / ``prompt_routed_experts``. Every array holds distinct values, so a row or a
column put one place off shows."""

from __future__ import annotations

import pytest
import torch

from hybridrl.engines.batch import PROMPT_ROUTED_EXPERTS, ROUTED_EXPERTS
from hybridrl.engines.rollout_kit import pack_routing

LAYERS, TOP_K = 2, 3


def fed(row: int, tokens: int) -> torch.Tensor:
    """``(tokens, LAYERS, TOP_K)`` values unique across rows and tokens: ``row * 1000 + token * 10 + slot``."""
    slots = torch.arange(LAYERS * TOP_K).reshape(LAYERS, TOP_K)
    return torch.stack([row * 1000 + t * 10 + slots for t in range(tokens)]) if tokens else \
        torch.zeros((0, LAYERS, TOP_K), dtype=torch.long)


def mask_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def check_row(out: dict[str, torch.Tensor], row: int, mask: torch.Tensor, prompt: int, response: int,
              width: int) -> None:
    """Row ``row``'s prompt routing where its mask is 1 (in order), -1 at its pads; response token t's at column t
    for t < response - 1; -1 at the last response token and past it."""
    arr = fed(row, prompt + max(response - 1, 0))
    got_prompt = out[PROMPT_ROUTED_EXPERTS][row]
    real = mask[row].bool()
    assert torch.equal(got_prompt[real], arr[:prompt])
    assert bool((got_prompt[~real] == -1).all())
    got = out[ROUTED_EXPERTS][row]
    for t in range(width):
        if t < response - 1:
            assert torch.equal(got[t], arr[prompt + t]), f"row {row} column {t}"
        else:
            assert bool((got[t] == -1).all()), f"row {row} column {t} should be -1, is {got[t].tolist()}"


def test_left_padded_prompts_and_responses_land_in_place():
    mask = mask_of([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    prompts, responses, width = [2, 4, 1], [3, 5, 1], 6
    routes = [fed(i, p + r - 1) for i, (p, r) in enumerate(zip(prompts, responses))]
    out = pack_routing(routes, mask, responses, width)
    assert out[ROUTED_EXPERTS].shape == (3, width, LAYERS, TOP_K)
    assert out[PROMPT_ROUTED_EXPERTS].shape == (3, 4, LAYERS, TOP_K)
    assert out[ROUTED_EXPERTS].dtype == torch.long and out[PROMPT_ROUTED_EXPERTS].dtype == torch.long
    for i, (p, r) in enumerate(zip(prompts, responses)):
        check_row(out, i, mask, p, r, width)
    # spelled out for row 0: its two prompt tokens sit in columns 2 and 3, its two fed response tokens at 0 and 1
    assert out[PROMPT_ROUTED_EXPERTS][0, 2, 0, 0] == 0 and out[PROMPT_ROUTED_EXPERTS][0, 3, 0, 0] == 10
    assert out[ROUTED_EXPERTS][0, 0, 0, 0] == 20 and out[ROUTED_EXPERTS][0, 1, 1, 2] == 35
    # a one-token response is never fed: nothing of it is routed
    assert bool((out[ROUTED_EXPERTS][2] == -1).all())


def test_right_padded_prompt_masks_are_followed_too():
    mask = mask_of([[1, 1, 0, 0], [1, 1, 1, 0]])
    prompts, responses, width = [2, 3], [4, 2], 5
    routes = [fed(i, p + r - 1) for i, (p, r) in enumerate(zip(prompts, responses))]
    out = pack_routing(routes, mask, responses, width)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        check_row(out, i, mask, p, r, width)
    assert out[PROMPT_ROUTED_EXPERTS][1, 2, 0, 0] == 1020 and bool((out[PROMPT_ROUTED_EXPERTS][1, 3] == -1).all())


def test_the_last_response_token_stays_unrouted_even_when_the_engine_sent_more():
    """An array longer than prompt + response - 1 (an engine that also routed the last token): the extra rows are
    not placed, the last response token's column stays -1."""
    mask = mask_of([[0, 1, 1]])
    out = pack_routing([fed(0, 2 + 3)], mask, [3], 4)  # one row more than the 2 + 3 - 1 fed
    check_row(out, 0, mask, 2, 3, 4)
    assert bool((out[ROUTED_EXPERTS][0, 2:] == -1).all())


def test_a_row_given_no_budget_stays_unrouted():
    mask = mask_of([[0, 1, 1], [1, 1, 1]])
    out = pack_routing([fed(0, 2 + 2 - 1), torch.zeros((0,), dtype=torch.long)], mask, [2, 0], 3)
    check_row(out, 0, mask, 2, 2, 3)
    assert bool((out[ROUTED_EXPERTS][1] == -1).all())
    assert bool((out[PROMPT_ROUTED_EXPERTS][1] == -1).all())


def test_a_prompt_only_row_routes_its_prompt():
    """Response length 0 with the prompt's routing (a request that stopped before any token): the prompt lands."""
    mask = mask_of([[0, 1, 1]])
    out = pack_routing([fed(0, 2)], mask, [0], 3)
    check_row(out, 0, mask, 2, 0, 3)


@pytest.mark.parametrize("tokens", [0, 3, 4])
def test_routing_shorter_than_what_was_fed_names_the_row(tokens):
    """Row 1 fed 3 prompt tokens and 3 of its 4 response tokens (6): fewer arrays rows mean routing was lost."""
    mask = mask_of([[0, 1, 1], [1, 1, 1]])
    routes = [fed(0, 2 + 1 - 1), fed(1, tokens)]
    with pytest.raises(ValueError, match=r"row 1: routing of .* prompt of 3 and a response of 4 tokens \(6 fed"):
        pack_routing(routes, mask, [1, 4], 5)


def test_routing_of_another_shape_names_the_row():
    mask = mask_of([[1, 1], [1, 1]])
    wrong = torch.zeros((3, LAYERS, TOP_K + 1), dtype=torch.long)
    with pytest.raises(ValueError, match="row 1: routing of"):
        pack_routing([fed(0, 3), wrong], mask, [2, 2], 2)


@pytest.mark.parametrize("routes, lengths", [(1, 2), (3, 2), (2, 1), (2, 3)])
def test_counts_that_do_not_match_the_prompts_raise(routes, lengths):
    mask = mask_of([[1, 1], [1, 1]])
    with pytest.raises(ValueError, match=r"2 prompts but \d routing arrays and \d responses"):
        pack_routing([fed(i, 2) for i in range(routes)], mask, [1] * lengths, 2)


def test_attach_routing_reads_each_rows_length_from_the_packed_mask():
    """The engines' shared step: a packed batch gains both routing keys, each row cut at its own response."""
    from hybridrl.engines.rollout_kit import attach_routing, pack_responses

    packed = pack_responses([[5, 6, 7], [8]], None, 4, pad_id=0)
    prompt_mask = torch.tensor([[0, 1], [1, 1]])
    routes = [torch.arange(1 + 2).reshape(3, 1, 1), torch.arange(2).reshape(2, 1, 1)]  # fed: prompt + response - 1
    out = attach_routing(packed, prompt_mask, routes)
    assert out[ROUTED_EXPERTS][:, :, 0, 0].tolist() == [[1, 2, -1, -1], [-1, -1, -1, -1]]
    assert out[PROMPT_ROUTED_EXPERTS][:, :, 0, 0].tolist() == [[-1, 0], [0, 1]]
