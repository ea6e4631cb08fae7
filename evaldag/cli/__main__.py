"""`python -m evaldag.cli`: the `evaldag` command."""

from evaldag.cli import app

app()
