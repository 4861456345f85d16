"""One request through SGLang's async API, with the same phases as a batched ``generate`` (engine-free logic).

``SGLangRollout.generate_request`` awaits ``Engine.async_generate`` once per phase (``min_new_tokens`` bans the
EOS in a first phase, ``hybridrl_sglang.sampling``), continuing from the prompt plus what the previous phase
sampled, and gives back the tokens and their log-probs under the distribution they were drawn from. The
calls are awaited on the engine's own event loop (``Engine.loop``: its tokenizer manager lives there), so many
requests are in flight at once and SGLang's scheduler decodes them together.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from hybridrl.engines import GeneratedTokens, SamplingParams
from hybridrl_sglang.packing import Completion, ended, parse_output
from hybridrl_sglang.sampling import per_request, phases

#: ``generate_one(input_ids, sampling_params) -> SGLang's output dict`` (awaitable).
GenerateOne = Callable[[list[int], dict[str, Any]], Awaitable[dict[str, Any]]]


async def generate_one_request(generate_one: GenerateOne, prompt_ids: Sequence[int], params: SamplingParams,
                               eos_ids: Sequence[int], replica: int, seed_mode: str,
                               sampling_logprobs: Callable[[Completion], list[float]]) -> GeneratedTokens:
    """The phases of one request (see the module docstring); ``sampling_logprobs`` turns a phase's completion
    into the log-probs of the truncated distribution (``SGLangRollout._sampling_logprobs``)."""
    want = bool(params.logprobs)
    tokens: list[int] = []
    logps: list[float] = []
    for phase in phases(params):
        if ended(tokens, eos_ids) and not params.ignore_eos:
            break
        sampling = per_request(params, phase, eos_ids, 1, replica, seed_mode)[0]
        done = parse_output(await generate_one(list(prompt_ids) + tokens, sampling), 0, logprobs=want)
        tokens.extend(done.token_ids)
        if want:
            logps.extend(sampling_logprobs(done))
    return GeneratedTokens(tokens, logps if want else None)
