"""KL coefficient controllers for a KL penalty folded into the reward (Ziegler et al. 2019, verl, TRL).

``fixed`` keeps ``kl.coef``; ``adaptive`` moves it so that the policy's KL to the reference tracks
``kl.target``: after each step, ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon`` where ``kl``
is the step's mean KL *per sequence* (summed over its tokens, in nats) and ``n`` the number of sequences.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedKLController:
    coef: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed coefficient ignores the measured KL."""


@dataclass
class AdaptiveKLController:
    coef: float
    target: float
    horizon: float

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(kl_cfg) -> FixedKLController | AdaptiveKLController:
    """From ``algorithm.kl`` (a ``KLConfig``)."""
    if kl_cfg.controller == "adaptive":
        return AdaptiveKLController(kl_cfg.coef, float(kl_cfg.target), float(kl_cfg.horizon))
    return FixedKLController(kl_cfg.coef)
