"""The base of every error qir raises for bad user input (the CLI prints these as one line)."""


class QirError(Exception):
    pass


class FormatError(QirError, ValueError):
    """Bad checkpoint or weight data; the message names the tensor and what is wrong."""


class UsageError(QirError, ValueError):
    """An option or argument that names something that does not exist or is out of range."""


class Unsupported(QirError, NotImplementedError):
    """Valid input qir has no kernel for (a head_dim the attention kernels do not take, an op or
    weight format with no device code): the reference backend may still run it."""
