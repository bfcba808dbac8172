"""Errors raised by the inference package, each with a message fit for a user."""


class CheckpointError(ValueError):
    """A checkpoint path or file cannot be fingerprinted (missing, outside the
    model roots, truncated, rewritten while hashed...). The message names the
    path and the problem."""


class CheckpointOutsideRoots(CheckpointError):
    """The path does not exist, is not a directory, or resolves outside the
    model roots (a message for an operator; an API answer says less)."""


class EngineError(RuntimeError):
    """An engine did not start, did not answer, or answered with an error."""


class AdapterOutsideRoots(CheckpointOutsideRoots):
    """A LoRA adapter path that does not exist, is not a directory, or resolves
    outside the model roots."""
