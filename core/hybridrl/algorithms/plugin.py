"""The core's algorithm components and presets, registered through the same hook as any third-party plugin."""

from hybridrl import hookimpl

ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax")

#: ``algorithm.name`` -> defaults for every ``algorithm.*`` key the user leaves unset.
PRESETS = {
    # critic_warmup: the first 5 steps train the critic alone, so the actor's first advantages come from a value
    # function that has seen some returns (on the quick start it learned past 0.8 on 5 of 8 seeds, 3 of 6 without).
    "ppo": {"advantage": "gae", "policy_loss": "ppo_clip", "loss_agg": "token-mean", "uses_critic": True,
            "critic_warmup": 5,
            "description": "PPO: GAE advantages from a critic (value model), clipped surrogate"},
    "grpo": {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg": "token-mean",
             "description": "GRPO: group-normalised scores (mean and std over the samples of a prompt)"},
    "dr_grpo": {"advantage": "grpo", "norm_adv_by_std": False, "policy_loss": "ppo_clip",
                "loss_agg": "seq-mean-token-sum",
                "description": "Dr.GRPO: GRPO without the std division and without per-sequence length "
                               "normalisation (token sums; Dr.GRPO's constant 1/max_len is left to the lr)"},
    "rloo": {"advantage": "rloo", "policy_loss": "ppo_clip", "loss_agg": "token-mean",
             "description": "RLOO: score minus the mean of the other samples of the same prompt"},
    "reinforce_pp": {"advantage": "reinforce_pp", "policy_loss": "ppo_clip", "loss_agg": "token-mean",
                     "description": "REINFORCE++: discounted token returns whitened over the batch"},
    "reinforce_pp_baseline": {"advantage": "reinforce_pp_baseline", "policy_loss": "ppo_clip",
                              "loss_agg": "token-mean",
                              "description": "REINFORCE++-baseline: group-mean baseline, then batch whitening"},
    "remax": {"advantage": "remax", "policy_loss": "ppo_clip", "loss_agg": "token-mean",
              "description": "ReMax: the reward of a greedy response to the same prompt is the baseline"},
    "gspo": {"advantage": "grpo", "policy_loss": "gspo", "loss_agg": "seq-mean-token-mean",
             "clip_low": 3e-4, "clip_high": 4e-4,
             "description": "GSPO: GRPO advantages, clipped sequence-level (length-normalised) ratio"},
}


@hookimpl
def hybridrl_register_algorithms(registry):
    for name in ADVANTAGES:
        registry.add_advantage(name, f"hybridrl.algorithms.advantages:{name}")
    registry.add_policy_loss("ppo_clip", "hybridrl.algorithms.losses:ppo_clip")
    registry.add_policy_loss("gspo", "hybridrl.algorithms.losses:gspo")
    registry.add_loss_aggregation("token-mean", "hybridrl.algorithms.losses:token_mean")
    registry.add_loss_aggregation("seq-mean-token-sum", "hybridrl.algorithms.losses:seq_mean_token_sum")
    registry.add_loss_aggregation("seq-mean-token-mean", "hybridrl.algorithms.losses:seq_mean_token_mean")
    for name in ("k1", "k2", "k3"):
        registry.add_kl_estimator(name, f"hybridrl.algorithms.kl:{name}")
    for name, defaults in PRESETS.items():
        registry.add_algorithm(name, defaults)
