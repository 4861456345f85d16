"""A third-party plugin: registers through the same hooks as hybridrl's own defaults."""

from hybridrl import hookimpl


def length_reward(prompt: str, response: str, **meta) -> float:
    return min(len(response), 4) / 4.0


def digit_share(prompt: str, response: str, **meta) -> float:
    """The share of digits in the response: it differs between the samples of an untrained model, so an
    advantage estimator has something to work with from the first step."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def half_k1(log_probs, ref_log_probs):
    return 0.5 * (log_probs - ref_log_probs)


def batch_mean_advantage(inputs):
    """A third-party advantage estimator: each sequence's score minus the mean score of the whole batch
    (no groups), on every response token. ``inputs`` is a ``hybridrl.algorithms.advantages.AdvantageInputs``."""
    mask = inputs.response_mask.to(inputs.token_rewards.dtype)
    scores = (inputs.token_rewards * mask).sum(-1)
    advantages = (scores - scores.mean()).unsqueeze(-1) * mask
    return advantages, advantages.clone()


@hookimpl
def hybridrl_register_backends(registry):
    # Reuses the embedded transformers rollout under another name, to prove selection from config.
    registry.add_rollout("sample", "hybridrl.rollout.hf:HFRollout")
    registry.add_rollout("sample_missing", "hybridrl_sample.nothing:Engine", requires=["not_a_real_engine>=1.0"],
                         install_hint="pip install not-a-real-engine")


@hookimpl
def hybridrl_register_rewards(registry):
    registry.add_reward("sample_length", length_reward)
    registry.add_reward("sample_digit_share", digit_share)


@hookimpl
def hybridrl_register_algorithms(registry):
    registry.add_kl_estimator("sample_half_k1", half_k1)
    registry.add_advantage("sample_batch_mean", "hybridrl_sample.plugin:batch_mean_advantage")
    registry.add_algorithm("sample_reinforce", {"advantage": "sample_batch_mean", "loss_agg": "seq-mean-token-mean"})
