"""Errors of the weight transfer: every failure is one of these, never a hang."""


class WeightSyncError(RuntimeError):
    """A version could not be transferred (peer died, group broken, bad metadata)."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A transfer or a wait for a version took longer than `weight_sync.timeout_s`."""
