"""What the driver logs of a batch of episodes (the rows ``run_episodes`` returned)."""

from __future__ import annotations

from collections import defaultdict

from hybridrl.engines.batch import RESPONSE_MASK, Batch, response_attention_mask
from hybridrl.environments.trajectory import ENV_METRICS, ENV_SECONDS, NUM_TURNS, REWARD_PARTS, TRUNCATED


def episode_metrics(batch: Batch, rollout_ranks: int = 1) -> dict[str, float]:
    """``env/turns_mean`` and ``_max``, ``env/truncated_rate``, ``env/<metric>_mean`` of every metric the
    environment reported (``tool_calls``, ``tool_errors``, ``tool_timeouts`` ...), ``env/tool_use_rate`` (share
    of episodes with a tool call), ``env/model_tokens_mean`` and ``env/observation_tokens_mean``,
    ``reward/env_<part>_mean`` of each reward part, and ``timing/env``: the seconds environments took, per
    rollout rank (they step concurrently with generation in the per-request mode, so this is work done, not
    wall time added). Empty for a batch that did not come from episodes."""
    if NUM_TURNS not in batch:
        return {}
    n = max(len(batch), 1)
    turns = batch[NUM_TURNS].float()
    model_tokens = batch[RESPONSE_MASK].sum(-1).float()
    all_tokens = response_attention_mask(batch).sum(-1).float()
    out = {"env/turns_mean": float(turns.mean()), "env/turns_max": float(turns.max()),
           "env/truncated_rate": float(batch[TRUNCATED].float().mean()),
           "env/model_tokens_mean": float(model_tokens.mean()),
           "env/observation_tokens_mean": float((all_tokens - model_tokens).mean()),
           "timing/env": float(batch[ENV_SECONDS].sum()) / max(rollout_ranks, 1)}
    sums: dict[str, float] = defaultdict(float)
    used_tools = 0
    for row in batch[ENV_METRICS]:
        for key, value in row.items():
            sums[key] += float(value)
        used_tools += int(row.get("tool_calls", 0) > 0)
    out.update({f"env/{key}_mean": value / n for key, value in sums.items()})
    if "tool_calls" in sums:
        out["env/tool_use_rate"] = used_tools / n
    parts: dict[str, float] = defaultdict(float)
    for row in batch[REWARD_PARTS]:
        for key, value in row.items():
            parts[key] += float(value)
    out.update({f"reward/env_{key}_mean": value / n for key, value in parts.items()})
    return out
