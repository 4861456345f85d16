"""Stopping a run whose rule reward fails the same way on response after response.

A reward that starts hanging mid-run costs ``roles.reward.timeout_s`` per response (a pool call is killed at its
deadline, and the next one hangs again): at the defaults, tens of minutes a step before the batch's failed
share stops the run. ``FailureStreak`` sees every outcome in the order the runner gets them and raises
``ConsecutiveFailures`` once ``roles.reward.max_consecutive_failures`` calls in a row failed the same way (timed
out, raised or returned no number, or ended their process), naming the key, the function and the last failure.
A success, or a failure of another kind, starts the count again; the count runs on from batch to batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.rewards.calling import RewardError

if TYPE_CHECKING:
    from hybridrl.rewards.runner import Outcome


class ConsecutiveFailures(RewardError):
    """The rule reward failed the same way too many times in a row: the run stops (exit status 1)."""


class FailureStreak:
    """``limit`` failures of one kind in a row raise ``ConsecutiveFailures`` (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kind: str | None = None
        self.count = 0

    def observe(self, outcome: Outcome, who: str) -> None:
        """One call's outcome; ``who`` names the reward that made it (``roles.reward.fn 'name'``)."""
        kind = outcome.kind
        if kind is None:
            self.kind, self.count = None, 0
            return
        if kind != self.kind:
            self.kind, self.count = kind, 0
        self.count += 1
        if self.limit and self.count >= self.limit:
            error = outcome.error or ""
            how = error[len(who) + 1:] if error.startswith(who + " ") else error
            raise ConsecutiveFailures(
                f"{who} failed {self.count} times in a row the same way (the last: {how}); the run stops here "
                f"(roles.reward.max_consecutive_failures={self.limit}) instead of scoring every response 0 at that "
                "cost")
