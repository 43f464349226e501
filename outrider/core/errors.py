"""Errors that reach the user as one clear sentence."""


class OutriderError(Exception):
    """A problem the user can act on; the CLI prints its message and exits non-zero."""


class CheckpointError(OutriderError):
    """A drafter or target checkpoint is damaged, incomplete or of an unknown kind."""


class ModelNotFoundError(OutriderError):
    """A model path or repository id could not be resolved to local files."""


class UnsupportedTargetError(OutriderError):
    """No target-family plugin can run this model with taps."""


class FamilyDeclined(UnsupportedTargetError):
    """A family claimed the config's model_type but cannot run the model it built (caches it
    cannot roll back, say): the next family that supports the config is tried."""


class PromptError(OutriderError):
    """Messages that cannot become a prompt (content of an unknown shape, a chat template that
    fails or renders nothing). The server answers it as a 400 naming `param` where given."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class Interrupted(OutriderError):
    """The user pressed Ctrl-C; what could be kept was (the message says what). Exit 130."""


class Cancelled(Exception):
    """The caller asked to stop (a client went away) between two pieces of work."""
