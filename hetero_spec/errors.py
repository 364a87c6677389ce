"""User-facing errors: the CLI prints these as one line and exits non-zero, no traceback."""


class HeteroSpecError(Exception):
    """Base of every error caused by the user's input rather than by a bug."""


class TargetError(HeteroSpecError, RuntimeError):
    """llama.cpp refused an operation or the GGUF is unusable; the message says which and why."""


class ContextFull(TargetError):
    """The request does not fit in the context window."""


class DraftError(HeteroSpecError):
    """The draft file is unreadable or does not fit the target."""
