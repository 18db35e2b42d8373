"""One way every `lms-launch` command reports bad usage: a `UsageError` with the command's own
`--help` named, printed as `lms-launch ...: error: ...` with exit status 2 and nothing started."""
from __future__ import annotations

import argparse

USAGE_STATUS = 2


class UsageError(Exception):
    """Bad command-line use; the message is meant for the user as it is."""


# What the arguments every recipe command takes mean, said once for all of them (an argument added
# without its own help text gets this one).
SHARED_HELP = {
    "recipe": "the YAML recipe, e.g. recipes/unet3d-cpu.yaml (recipes/ holds the shipped ones; every key: "
              "launcher/config.py and lms_core/config.py)",
    "overrides": "set a recipe key, e.g. --set train.batch_size=64 or --set lms.enabled=true; the value is YAML; "
                 "repeatable, and it wins over the recipe file",
}


class UsageParser(argparse.ArgumentParser):
    """An argument parser that raises `UsageError` instead of exiting, so each command keeps one
    error format and can clean up before it returns its status. A description (a module's
    docstring) that opens with the command's own synopsis in backticks loses that paragraph here:
    argparse prints the usage itself, so it is printed once."""

    def __init__(self, prog: str, description: str | None = None, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(prog=prog, description=without_synopsis(prog, description), **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.help is None:
            action.help = SHARED_HELP.get(action.dest)
        return action

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def without_synopsis(prog: str, description: str | None) -> str | None:
    """`description` without a first paragraph that is only "`PROG ...`" (a synopsis)."""
    if not description:
        return description
    first, _, rest = description.strip().partition("\n\n")
    if first.startswith(f"`{prog}") and first.endswith("`"):
        return rest
    return description
