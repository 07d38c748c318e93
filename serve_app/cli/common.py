"""What every `headroom` command shares: its consoles and how a bad input ends it."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.text import Text

err = Console(stderr=True)
out = Console()


def fail(error: Exception) -> NoReturn:
    """Prints `error: ...` and exits 2: bad input, nothing was changed. The message is printed as it is: not
    read as Rich markup (a `[...]` in it stays), and not wrapped at the terminal's width (logs and scripts
    get it on one line)."""
    err.print(Text.assemble(("error:", "red"), f" {error}"), soft_wrap=True, highlight=False)
    raise typer.Exit(2)
