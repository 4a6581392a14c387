"""Typed failures of a transfer. Callers catch TransferError; subclasses say why."""


class TransferError(Exception):
    """A transfer did not complete; none of its tensors was returned (a receiver's
    `on_tensor` may have been handed some of them before the failure)."""


class PeerError(TransferError):
    """The peer went away (process died, connection reset or closed) mid-transfer."""


class TransferTimeout(TransferError, TimeoutError):
    """No progress within the configured deadline."""


class ChecksumError(TransferError):
    """A chunk failed its checksum or did not decode: the data was corrupted."""


class ProtocolError(TransferError):
    """The peer sent something this protocol version does not allow."""
