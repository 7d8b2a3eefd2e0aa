"""User-facing build errors: the CLI prints the message alone, never a traceback."""


class BuildError(Exception):
    """A build step failed for a reason the user can act on (message names the problem)."""


class ModelSourceError(BuildError):
    """The model could not be resolved or loaded (unknown architecture, missing files, ...)."""
