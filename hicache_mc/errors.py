"""Error hierarchy. A cache miss is never an exception: these are for misuse and broken peers."""


class HicacheError(Exception):
    """Base of every error hicache-mc raises on purpose."""


class ConfigError(HicacheError, ValueError):
    """A setting is unknown or has a bad value; the message names the setting."""


class ProtocolError(HicacheError):
    """A frame could not be decoded, or names an unknown message or version.

    ``code`` is what the server puts in its ErrorReply: ``bad_request``, ``bad_version`` or
    ``unknown_type``; ``req_id`` is the request id the frame carried, where it could be read
    (0 otherwise), for addressing that reply.
    """

    def __init__(self, message: str, code: str = "bad_request", req_id: int = 0):
        super().__init__(message)
        self.code = code
        self.req_id = req_id


class RemoteError(HicacheError):
    """A server answered a request with an error reply."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class StoreUnavailable(HicacheError):
    """A server did not answer within the deadline (or the client's circuit is open); ``down``
    (a ``link.Down``), where known, says why its connection is down."""

    def __init__(self, message: str, down=None):
        super().__init__(message)
        self.down = down


class Misconfigured(StoreUnavailable):
    """A server refused this process's connection for a reason no retry mends (a token missing
    on one side, or one of another cluster); ``down`` (a ``link.Down``) names it."""
