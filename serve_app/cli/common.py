"""What every `headroom` command shares: its consoles and how a bad input ends it."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

err = Console(stderr=True)
out = Console()


def fail(error: Exception) -> NoReturn:
    """Prints `error: ...` and exits 2: bad input, nothing was changed."""
    err.print(f"[red]error:[/red] {error}", highlight=False)
    raise typer.Exit(2)
