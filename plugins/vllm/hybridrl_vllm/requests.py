"""Single requests on the in-process vLLM engine, awaitable: what ``VLLMRollout.generate_request`` runs on.

The engine is vLLM's own ``LLMEngine`` inside ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), driven request by
request: a coroutine adds its request and awaits a future; one pump task calls ``engine.step()`` while any
request is pending, resolving each request's future as its final output arrives, and yields to the event loop
between steps so that a trajectory whose turn has finished can step its environment and add its next turn
while the others keep decoding (continuous batching keeps them all in one forward per step).

A cancelled request (the episode runner cancels the others when one environment fails) is aborted in the
engine, so nothing keeps decoding for nobody.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any


class RequestPump:
    """``await pump.generate(prompt, sampling)`` -> vLLM's final ``RequestOutput`` for that request.

    ``add(request_id, prompt, sampling)``, ``step() -> outputs`` and ``abort(request_ids)`` are the engine's
    (``hybridrl_vllm.compat``); outputs carry ``request_id`` and ``finished``. One pump per event loop run."""

    def __init__(self, add: Callable[[str, Any, Any], None], step: Callable[[], list[Any]],
                 abort: Callable[[list[str]], None], prefix: str = "hybridrl") -> None:
        self._add, self._step, self._abort = add, step, abort
        self._ids = (f"{prefix}-{i}" for i in itertools.count())
        self._pending: dict[str, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self.steps = 0

    async def generate(self, prompt: Any, sampling: Any) -> Any:
        loop = asyncio.get_running_loop()
        request_id = next(self._ids)
        future: asyncio.Future = loop.create_future()
        self._add(request_id, prompt, sampling)
        self._pending[request_id] = future
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        try:
            return await future
        except asyncio.CancelledError:
            if self._pending.pop(request_id, None) is not None:
                self._abort([request_id])
            raise

    async def _run(self) -> None:
        while self._pending:
            try:
                outputs = self._step()
            except Exception as exc:  # the engine failed: every waiting request fails with it (and raises it)
                for future in self._pending.values():
                    if not future.done():
                        future.set_exception(exc)
                self._pending.clear()
                return
            self.steps += 1
            for out in outputs:
                if getattr(out, "finished", False):
                    future = self._pending.pop(out.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(out)
            await asyncio.sleep(0)  # let finished trajectories step their environments and add their next turns
