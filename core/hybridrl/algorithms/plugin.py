"""The core's algorithm components, registered through the same hook as any third-party plugin."""

from hybridrl import hookimpl


@hookimpl
def hybridrl_register_algorithms(registry):
    registry.add_advantage("grpo", "hybridrl.algorithms.advantages:grpo")
    registry.add_policy_loss("ppo_clip", "hybridrl.algorithms.losses:ppo_clip")
    registry.add_loss_aggregation("token-mean", "hybridrl.algorithms.losses:token_mean")
    registry.add_loss_aggregation("seq-mean-token-sum", "hybridrl.algorithms.losses:seq_mean_token_sum")
    registry.add_loss_aggregation("seq-mean-token-mean", "hybridrl.algorithms.losses:seq_mean_token_mean")
    for name in ("k1", "k2", "k3"):
        registry.add_kl_estimator(name, f"hybridrl.algorithms.kl:{name}")
    registry.add_algorithm("grpo", {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg": "token-mean",
                                    "uses_ref": True, "uses_critic": False})
