"""Token-budget micro-batching (``max_tokens_per_micro_batch``): the packing itself, and log-probs, values and
updates equal to plain row micro-batching, in the original row order, on one rank and on two ranks whose
local batches pack into different numbers of bins.

Run as a script (``python test_token_budget.py RANK WORLD PORT MODEL OUT``) it is one rank of the two-rank
check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _fsdp_helpers import PolicyGradient, context, make_batch  # noqa: E402

from hybridrl.engines.batch import LOG_PROBS, PROMPT_MASK, RESPONSE_MASK, Batch  # noqa: E402

BUDGET = 40


def ragged_batch(size: int = 10, seed: int = 21) -> Batch:
    """Long and short rows mixed: every other row is cut to one prompt and one response token."""
    batch = make_batch(size, seed=seed, max_prompt=8, max_response=7)
    for i in range(1, size, 2):
        batch[PROMPT_MASK][i, :-1] = 0
        batch[RESPONSE_MASK][i, 1:] = 0
    return batch


def long_first(batch: Batch) -> Batch:
    """Rows sorted longest first, so that the first half of a 2-way split holds the long rows."""
    lengths = batch[PROMPT_MASK].sum(-1) + batch[RESPONSE_MASK].sum(-1)
    return batch.index(torch.argsort(lengths, descending=True, stable=True))


# --- the packing ----------------------------------------------------------------------------------------
def test_packing_covers_every_row_once_within_budget() -> None:
    from hybridrl_fsdp.micro_batching import pack_by_tokens, split_to_count

    prompt = [8, 1, 5, 1, 3, 8, 2, 1]
    response = [7, 1, 2, 1, 6, 1, 1, 0]
    bins = pack_by_tokens(prompt, response, budget=20)
    assert sorted(i for b in bins for i in b) == list(range(8))
    for b in bins:
        cost = len(b) * (max(prompt[i] for i in b) + max(max(response[i] for i in b), 1))
        assert cost <= 20 or len(b) == 1
    # longest first: the first bin holds the longest row, the shortest rows share the last bin
    assert 0 in bins[0] and {1, 3, 7} <= set(bins[-1])
    assert len(bins[-1]) > len(bins[0])
    split = split_to_count(bins, len(bins) + 2, prompt, response)
    assert len(split) == len(bins) + 2 and sorted(i for b in split for i in b) == list(range(8))


def test_trim_cuts_padding_columns_of_prompt_and_response_aligned_tensors() -> None:
    from hybridrl_fsdp.micro_batching import trim

    batch = ragged_batch(4).index([1, 3])  # two short rows: 1 prompt token, 1 response token each
    batch.set("advantages", torch.ones(2, 7))
    trimmed, width = trim(batch)
    assert width == 1 and trimmed[PROMPT_MASK].shape == (2, 1) and trimmed["advantages"].shape == (2, 1)
    assert trimmed[PROMPT_MASK].all() and trimmed[RESPONSE_MASK].all()


# --- the engine -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("packing", [False, True])
def test_log_probs_and_values_equal_plain_batching(process_group, tiny_model: Path, packing: bool) -> None:
    from hybridrl.engines.batch import VALUES
    from hybridrl_fsdp.engine import FSDPEngine

    batch = ragged_batch()
    plain = FSDPEngine(context(tiny_model, trainable=False, micro_batch=3, packing=False))
    binned = FSDPEngine(context(tiny_model, trainable=False, micro_batch=3, max_tokens_per_micro_batch=BUDGET,
                                packing=packing))
    plan = binned._plan(batch)
    if packing:  # bins hold up to BUDGET real tokens
        assert all(m.packed.tokens <= BUDGET or len(m.index) == 1 for m in plan)
        assert len(plan) < len(FSDPEngine(context(tiny_model, trainable=False, max_tokens_per_micro_batch=BUDGET,
                                                  packing=False))._plan(batch)), "packed bins hold more rows"
    else:
        assert len({len(m.index) for m in plan}) > 1, "short rows should share bins, long ones not"
    assert sorted(torch.cat([m.index for m in plan]).tolist()) == list(range(len(batch)))
    a, b = plain.compute_log_probs(batch, with_entropy=True), binned.compute_log_probs(batch, with_entropy=True)
    mask = batch[RESPONSE_MASK].bool()
    assert float(a[LOG_PROBS][mask].abs().min()) > 0
    for key in (LOG_PROBS, "entropy"):
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0)

    def critic(**options):
        ctx = context(tiny_model, **options)
        return FSDPEngine(type(ctx)(**{**ctx.__dict__, "role": "critic"}))

    torch.testing.assert_close(critic(max_tokens_per_micro_batch=BUDGET, packing=packing).compute_values(batch)[VALUES],
                               critic(micro_batch=4, packing=False).compute_values(batch)[VALUES], atol=1e-5, rtol=0)


@pytest.mark.parametrize("packing", [False, True])
def test_update_with_token_budget_equals_plain_update(process_group, tiny_model: Path, packing: bool) -> None:
    from hybridrl_fsdp.engine import FSDPEngine

    batch = ragged_batch(seed=22)
    plain = FSDPEngine(context(tiny_model, lr=1e-2, micro_batch=2, packing=False))
    binned = FSDPEngine(context(tiny_model, lr=1e-2, micro_batch=2, max_tokens_per_micro_batch=BUDGET,
                                packing=packing))
    m1, m2 = plain.update(batch, PolicyGradient()), binned.update(batch, PolicyGradient())
    assert abs(m1["loss"] - m2["loss"]) < 1e-6 and abs(m1["grad_norm"] - m2["grad_norm"]) < 1e-5 * m1["grad_norm"]
    a, b = plain.full_state_dict(), binned.full_state_dict()
    assert any(not torch.equal(a[n], t) for n, t in FSDPEngine(context(tiny_model)).full_state_dict().items())
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)


def test_two_ranks_with_different_bin_counts_match_one_rank(tiny_model: Path, tmp_path: Path) -> None:
    """Rank 0 gets the long rows (many bins), rank 1 the short ones (few): they must agree on a count
    (no hang) and give the single process's log-probs and step."""
    from hybridrl.runtime.distributed import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for world in (1, 2):
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), str(port), str(tiny_model),
                                   str(tmp_path / f"w{world}")], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(world)]
        runs[world] = procs
    for world, procs in runs.items():
        for rank, p in enumerate(procs):
            out = p.communicate(timeout=240)[0]
            assert p.returncode == 0, f"world {world} rank {rank}:\n{out}"
    one = torch.load(tmp_path / "w1.rank0")
    two = [torch.load(tmp_path / f"w2.rank{r}") for r in range(2)]
    assert two[0]["bins"] == two[1]["bins"] and two[0]["natural_bins"] != two[1]["natural_bins"]
    torch.testing.assert_close(torch.cat([t["log_probs"] for t in two]), one["log_probs"], atol=1e-5, rtol=0)
    for name, tensor in one["state"].items():
        torch.testing.assert_close(two[0]["state"][name], tensor, atol=1e-5, rtol=0, msg=name)


def _rank_main(rank: int, world: int, port: int, model: str, out: str) -> None:
    torch.set_num_threads(1)
    from hybridrl.runtime.distributed import init_process_group
    from hybridrl_fsdp.engine import FSDPEngine
    from hybridrl_fsdp.micro_batching import pack_first_fit, real_lengths

    init_process_group(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    engine = FSDPEngine(context(Path(model), rank=rank, world_size=world, lr=1e-2, max_tokens_per_micro_batch=BUDGET))
    local = long_first(ragged_batch(seed=23)).chunk(world)[rank]
    natural = len(pack_first_fit(*real_lengths(local), BUDGET))  # packed: the engine's default
    bins = len(engine._plan(local))
    engine.update(local, PolicyGradient())
    log_probs = engine.compute_log_probs(local)[LOG_PROBS]
    torch.save({"log_probs": log_probs, "state": engine.full_state_dict(), "bins": bins, "natural_bins": natural},
               f"{out}.rank{rank}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
