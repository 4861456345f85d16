"""A third-party plugin: registers through the same hooks as hybridrl's own defaults."""

from hybridrl import hookimpl


def length_reward(prompt: str, response: str, **meta) -> float:
    return min(len(response), 4) / 4.0


def half_k1(log_probs, ref_log_probs):
    return 0.5 * (log_probs - ref_log_probs)


@hookimpl
def hybridrl_register_backends(registry):
    # Reuses the embedded transformers rollout under another name, to prove selection from config.
    registry.add_rollout("sample", "hybridrl.rollout.hf:HFRollout")
    registry.add_rollout("sample_missing", "hybridrl_sample.nothing:Engine", requires=["not_a_real_engine>=1.0"],
                         install_hint="pip install not-a-real-engine")


@hookimpl
def hybridrl_register_rewards(registry):
    registry.add_reward("sample_length", length_reward)


@hookimpl
def hybridrl_register_algorithms(registry):
    registry.add_kl_estimator("sample_half_k1", half_k1)
