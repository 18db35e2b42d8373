"""One way every `lms-launch` command reports bad usage: a `UsageError` with the command's own
`--help` named, printed as `lms-launch ...: error: ...` with exit status 2 and nothing started."""
from __future__ import annotations

import argparse

USAGE_STATUS = 2


class UsageError(Exception):
    """Bad command-line use; the message is meant for the user as it is."""


class UsageParser(argparse.ArgumentParser):
    """An argument parser that raises `UsageError` instead of exiting, so each command keeps one
    error format and can clean up before it returns its status."""

    def __init__(self, prog: str, description: str | None = None, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(prog=prog, description=description, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")
