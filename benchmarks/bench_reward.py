"""Rule reward of the step benchmark (``bench_reward:digit_share``): the share of digits in the response.

Any cheap deterministic function of the text would do; the benchmark measures compute, not learning."""


def digit_share(prompt: str, response: str, **_: object) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)
