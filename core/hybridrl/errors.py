"""The one base of the errors hybridrl raises *to the user*: bad input, a refused run, a named fault.

Why one base: the CLI prints any ``HybridRLError`` as its message (one or a few sentences, no traceback) and
treats every other exception as a bug in hybridrl or a plugin, which it reports with its traceback. A plugin
raises a subclass (or ``HybridRLError`` itself) for a problem the user can fix. Subclasses keep their other
bases (``ValueError``, ``RuntimeError``) so ``except ValueError`` in existing code still catches them.
"""

from __future__ import annotations


class HybridRLError(Exception):
    """A problem the user can act on; ``str(exc)`` says what and where. ``exit_status``: the CLI's exit code
    for it (1: the run failed; 2: the input was refused before any work, e.g. a config or command-line
    error)."""

    exit_status: int = 1
