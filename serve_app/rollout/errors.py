"""How a rollout's problems reach the user: the one error every step raises for a problem the user must fix
(not a bug), and progress or warning lines on stderr."""

from __future__ import annotations

import sys


class RolloutError(RuntimeError):
    """A rollout that cannot start or go on: a bad address, an unreachable cluster, a missing or rejected Ray
    token, a rejected deploy. The message says what to change; it never holds a token."""


def to_stderr(line: str) -> None:
    """Prints a progress or warning line on stderr (stdout is left for what a command outputs)."""
    print(line, file=sys.stderr, flush=True)
