"""Exception types that flexpage users catch."""


class FlexpageError(Exception):
    """Base class of every error raised by flexpage itself."""


class OutOfPagesError(FlexpageError, RuntimeError):
    """The page pool cannot hold the requested tokens.

    Raised before anything is written: the cache and its page table are exactly as they
    were before the call.
    """


class UnsupportedModelError(FlexpageError, NotImplementedError):
    """A model or attention variant that flexpage cannot serve exactly."""


class InvalidRequestError(FlexpageError, ValueError):
    """A request the Engine cannot serve (empty prompt, unknown token ids, too long, bad
    sampling options). Raised when the request is submitted; nothing else is disturbed."""


class StepFailedError(FlexpageError, RuntimeError):
    """An Engine step's forward failed. ``requests`` are the output indices of the requests in
    that step; their uncomputed slots were given back, so they can be retried or aborted
    (``Engine.abort``) while the others go on. The original error is the ``__cause__``."""

    def __init__(self, requests: list[int], cause: BaseException) -> None:
        super().__init__(f"step failed for requests {requests}: {type(cause).__name__}: {cause}")
        self.requests = requests


class RequestFailedError(FlexpageError, RuntimeError):
    """One request failed after its step's forward (nothing could be sampled from its logits, or
    its penalties, sampling or logprobs raised). It was aborted and its pages freed; the step's
    other requests got their tokens. ``Engine.stream`` / ``generate`` raise it for their requests;
    a server answers that request alone with an error."""
