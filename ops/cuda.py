"""What posenc's CUDA ops do with bad index data, and the switch that makes them raise at the call.

The CPU ops read index tensors (positions, token ids, ``cu_seqlens``, ``pair_axis``, cache slots) before any
kernel runs and raise at the call. The CUDA ops never read them on the host, which would make every call wait for
the GPU: they check them on the GPU. A bad index reads and writes nothing out of bounds (its rows come out NaN, or
are not stored), and the first failure is kept on the device. It is raised, with the CPU op's message word for word,
by :func:`check_errors`, or by the next posenc CUDA op called after the failing kernel has run.

:func:`set_sync_checks` (or the environment variable ``POSENC_CUDA_SYNC_CHECKS=1`` when posenc loads) makes each
op wait for its own checks and raise at the call, as on the CPU: one wait per op that is given index data.
"""
import torch

__all__ = ["check_errors", "set_sync_checks", "sync_checks"]


def check_errors() -> None:
    """Waits for the GPUs' queued work and raises the first bad index found since the last one raised
    (``RuntimeError``, the CPU's message). Returns at once on a build or machine without CUDA."""
    torch.ops.posenc_cuda.check_errors()


def set_sync_checks(enabled: bool) -> None:
    """Raise at the call (True) or when checked (False, the default)."""
    torch.ops.posenc_cuda.set_sync_checks(enabled)


def sync_checks() -> bool:
    """Whether the CUDA ops raise bad indices at the call."""
    return torch.ops.posenc_cuda.sync_checks()
