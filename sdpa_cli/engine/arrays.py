"""The array library the lean pass computes with: numpy, or PyTorch on a device.

The lean pass (:mod:`sdpa_cli.engine.online`) and its row statistics
(:mod:`sdpa_cli.engine.row_stats`) are written once, against numpy's API, with the
namespace ``xp`` of the arrays they are given (:func:`namespace_of`): numpy itself,
or :class:`TorchNamespace`, which gives the few numpy functions they call, with
numpy's names and signatures (``out=``, ``where=``, ``initial=``), on the tensors of
one torch device. Nothing is written twice: the numpy path calls numpy as it always
did, and a torch run calls the same code on tensors.

Why not the array API standard (``array-api-compat``): it has no ``out=``, no
``where=`` in reductions and no masked fill in place, which the numpy path relies on
for its speed (two score-sized buffers a thread, reused block after block); keeping
them would need a layer of our own on top of it anyway. This adapter is that layer
alone, about 150 lines, with no dependency.

torch is imported only when a run asks for it (``--backend torch``, or tensors given
to :func:`~sdpa_cli.testing.assert_attention_close`): ``sdpa --help`` and every
numpy run never import it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sdpa_cli.errors import SpecError
from sdpa_cli.names import BACKENDS

CHOICES = ("auto", *BACKENDS)
"""``--backend``: ``auto`` is torch where the tensors given are on a device other than
the CPU (the Python API) or such a device is named, numpy otherwise: on a CPU numpy
computes the lean pass faster than torch's unfused operations (docs/performance.md)."""


@dataclass(frozen=True)
class Backend:
    """Which library computes the lean pass, and on which device."""

    name: str = "numpy"
    """``numpy`` or ``torch``."""
    device: str = "cpu"
    """``cpu``, ``cuda``, ``cuda:N`` (torch only)."""
    float64: bool = field(default=True, compare=False)
    """Whether the device computes in float64 (Apple's MPS does not: a run that needs
    float64 is then computed by numpy, and its report says so)."""

    @property
    def threads_own(self) -> bool:
        """Whether the library runs its own threads (the driver then runs one block at
        a time: torch spreads each operation over the cores, or the device does)."""
        return self.name != "numpy"


NUMPY = Backend()

DEVICE_MEMORY_UNKNOWN = 1 << 30
"""What a device whose free memory torch cannot tell is taken to have free."""

_current: ContextVar[Backend] = ContextVar("sdpa_backend", default=NUMPY)


def current() -> Backend:
    """The backend the block driver computes with in this context (numpy unless
    :func:`using` or :func:`use` said otherwise)."""
    return _current.get()


def use(backend: Backend) -> None:
    """Compute with ``backend`` from now on, in this context (a command's run)."""
    _current.set(backend)


@contextlib.contextmanager
def using(backend: Backend) -> Iterator[Backend]:
    """Compute with ``backend`` inside the ``with`` block (as ``torch.device`` or
    ``jax.default_device`` do): what a case, a test or a library call runs under."""
    token = _current.set(backend)
    try:
        yield backend
    finally:
        _current.reset(token)


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def resolve(name: str = "auto", device: str | None = None, given: Iterable[Any] = ()) -> Backend:
    """The backend a run uses: ``name`` on ``device`` (default: the device of the
    first torch tensor among ``given``, else ``cpu``). ``auto`` is torch when that
    device is not the CPU, numpy otherwise (the faster on a CPU).

    Raises:
        SpecError: an unknown backend, torch asked for and not installed, a device
            other than ``cpu`` for numpy, or a device torch does not have.
    """
    if name not in CHOICES:
        raise SpecError("--backend", f"expected one of {', '.join(CHOICES)}, got {name!r}")
    tensor = next((x for x in given if is_tensor(x)), None)
    if name == "auto":
        place = device or (str(tensor.device) if tensor is not None else "cpu")
        name = "numpy" if place == "cpu" else "torch"
    if name == "numpy":
        if device not in (None, "cpu"):
            raise SpecError(
                "--device", f"{device!r} needs --backend torch: numpy computes on the CPU only"
            )
        return NUMPY
    try:
        import torch
    except ImportError:
        raise SpecError("--backend", "torch is not installed: pip install torch") from None
    if device is None:
        device = str(tensor.device) if tensor is not None else "cpu"
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError):
        raise SpecError("--device", f"expected cpu, cuda or cuda:N, got {device!r}") from None
    if where.type != "cpu":
        module = getattr(torch, where.type, None)
        if module is None or not module.is_available():
            raise SpecError("--device", f"{device!r}: torch sees no {where.type} device here")
        count = module.device_count()
        if where.index is not None and where.index >= count:
            raise SpecError("--device", f"{device!r}: torch sees {count} {where.type} device(s)")
        if where.index is None and hasattr(module, "current_device"):  # as reports name it
            where = torch.device(where.type, module.current_device())
    return Backend("torch", str(where), _has_float64(torch, where))


def _has_float64(torch: Any, device: Any) -> bool:
    """Whether torch computes in float64 on ``device``."""
    try:
        torch.zeros(1, dtype=torch.float64, device=device).sum()
    except (RuntimeError, TypeError):
        return False
    return True


def namespace(backend: Backend) -> Any:
    """numpy, or the torch adapter for the backend's device."""
    return np if backend.name == "numpy" else _torch_namespace(backend.device)


def namespace_of(x: Any) -> Any:
    """The namespace of an array: numpy for a numpy array, the adapter of its device
    for a tensor."""
    return _torch_namespace(str(x.device)) if is_tensor(x) else np


def astype(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype`` (a numpy dtype), whichever namespace holds it."""
    if is_tensor(x):
        return x.to(_torch_namespace(str(x.device)).dtype(dtype))
    return x.astype(dtype)


def numpy_dtype(x: Any) -> np.dtype[Any]:
    """An array's dtype as numpy names it (a tensor's ``torch.float32``: float32)."""
    name = str(x.dtype).removeprefix("torch.") if is_tensor(x) else x.dtype
    dt: np.dtype[Any] = np.dtype(name)
    return dt


def to_host(x: Any) -> Any:
    """A numpy array of ``x`` (itself when it already is one)."""
    if is_tensor(x):
        return x.detach().cpu().numpy()
    return x


def _shape(shape: int | tuple[int, ...]) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


@cache
def _torch_namespace(device: str) -> TorchNamespace:
    return TorchNamespace(device)


class TorchNamespace:
    """numpy's functions the lean pass calls, on the tensors of one torch device, with
    numpy's signatures. Dtypes are numpy's (``np.dtype(np.float64)``), mapped here."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self._dtypes = {
            np.dtype(np.float64): torch.float64,
            np.dtype(np.float32): torch.float32,
            np.dtype(np.float16): torch.float16,
            np.dtype(np.int64): torch.int64,
            np.dtype(np.int32): torch.int32,
            np.dtype(np.intp): torch.int64,
            np.dtype(np.bool_): torch.bool,
        }

    def __repr__(self) -> str:
        return f"TorchNamespace({str(self.device)!r})"

    def free_bytes(self) -> int:
        """The device's free memory, with what torch's allocator holds for reuse."""
        t = self.torch
        if self.device.type == "cuda":
            free, _ = t.cuda.mem_get_info(self.device)
            return (
                int(free)
                + int(t.cuda.memory_reserved(self.device))
                - int(t.cuda.memory_allocated(self.device))
            )
        return DEVICE_MEMORY_UNKNOWN

    # --- dtypes and creation ---

    def dtype(self, dt: Any) -> Any:
        """The torch dtype of a numpy dtype (or type; a torch dtype as it is)."""
        if isinstance(dt, self.torch.dtype):
            return dt
        return self._dtypes[np.dtype(dt)]

    def asarray(self, x: Any, dtype: Any = None) -> Any:
        """A tensor on this device: from a numpy array (copied once) or a tensor."""
        t = self.torch
        target = None if dtype is None else self.dtype(dtype)
        if isinstance(x, t.Tensor):
            return x.to(device=self.device, dtype=target)
        host = np.asarray(x)
        if host.dtype not in self._dtypes:  # ml_dtypes' bfloat16 and float8: none of torch's
            host = host.astype(np.float32 if dtype is None else dtype)
        elif not host.flags.writeable:  # torch has no read-only tensor: a copy, not a view
            host = host.copy()
        return t.from_numpy(host).to(device=self.device, dtype=target)

    def zeros(self, shape: Any, dtype: Any = np.float64) -> Any:
        return self.torch.zeros(_shape(shape), dtype=self.dtype(dtype), device=self.device)

    def empty(self, shape: Any, dtype: Any = np.float64) -> Any:
        return self.torch.empty(_shape(shape), dtype=self.dtype(dtype), device=self.device)

    def full(self, shape: Any, value: Any, dtype: Any = np.float64) -> Any:
        return self.torch.full(
            _shape(shape), float(value), dtype=self.dtype(dtype), device=self.device
        )

    def zeros_like(self, x: Any) -> Any:
        return self.torch.zeros_like(x)

    def arange(self, start: int, stop: int | None = None, dtype: Any = np.int64) -> Any:
        if stop is None:
            start, stop = 0, start
        return self.torch.arange(start, stop, dtype=self.dtype(dtype), device=self.device)

    def broadcast_to(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x.expand(shape)

    def mean(self, x: Any, axis: int, dtype: Any = None) -> Any:
        return self.torch.mean(x, dim=axis, dtype=None if dtype is None else self.dtype(dtype))

    # --- elementwise ---

    def _tensor(self, x: Any, like: Any) -> Any:
        return (
            x
            if isinstance(x, self.torch.Tensor)
            else self.torch.tensor(float(x), dtype=like.dtype, device=self.device)
        )

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        t = self.torch
        if not isinstance(a, t.Tensor) and not isinstance(b, t.Tensor):  # float64, as numpy's
            one = t.tensor(float(a), dtype=t.float64, device=self.device)
            return t.where(cond, one, float(b))
        like = a if isinstance(a, t.Tensor) else b
        return t.where(cond, self._tensor(a, like), self._tensor(b, like))

    def maximum(self, a: Any, b: Any, out: Any = None) -> Any:
        return self.torch.maximum(a, self._tensor(b, a), out=out)

    def minimum(self, a: Any, b: Any, out: Any = None) -> Any:
        return self.torch.minimum(a, self._tensor(b, a), out=out)

    def exp(self, x: Any, out: Any = None) -> Any:
        return self.torch.exp(x, out=out)

    def log(self, x: Any) -> Any:
        return self.torch.log(x)

    def abs(self, x: Any) -> Any:
        return self.torch.abs(x)

    def isfinite(self, x: Any) -> Any:
        return self.torch.isfinite(x)

    def subtract(self, a: Any, b: Any, out: Any = None) -> Any:
        return self.torch.sub(a, b, out=out)

    def divide(self, a: Any, b: Any, out: Any = None) -> Any:
        return self.torch.div(a, b, out=out)

    def matmul(self, a: Any, b: Any, out: Any = None) -> Any:
        return self.torch.matmul(a, b, out=out)

    def einsum(self, subscripts: str, *operands: Any) -> Any:
        if subscripts == "ij,ij->i":  # a row dot: vecdot is 10× torch's einsum on a CPU
            return self.torch.linalg.vecdot(*operands, dim=1)
        return self.torch.einsum(subscripts, *operands)

    def copyto(self, dst: Any, src: Any, where: Any) -> None:
        """``dst[where] = src``, in place (``src`` a scalar or a tensor like ``dst``)."""
        if isinstance(src, self.torch.Tensor) and src.ndim:
            dst.copy_(self.torch.where(where, src, dst))
        else:
            dst.masked_fill_(where, float(src))

    # --- reductions ---

    def argmax(self, x: Any, axis: int) -> Any:
        # the first of tied maxima, as argmax; max's indices: 3× torch's argmax on a CPU
        return self.torch.max(x, dim=axis).indices

    def argmin(self, x: Any, axis: int) -> Any:
        return self.torch.min(x, dim=axis).indices

    def _reduce(self, x: Any, axis: int | None, where: Any, initial: float | None, op: str) -> Any:
        t = self.torch
        if where is not None:
            if initial is None:
                raise ValueError("where= needs initial=")
            x = t.where(where, x, t.tensor(float(initial), dtype=x.dtype, device=x.device))
        if axis is None:
            if not x.numel():
                return t.tensor(float(initial), dtype=x.dtype, device=x.device)  # type: ignore[arg-type]
            return getattr(t, op)(x)
        if not x.shape[axis]:
            shape = [n for i, n in enumerate(x.shape) if i != axis]
            return t.full(shape, float(initial), dtype=x.dtype, device=x.device)  # type: ignore[arg-type]
        return getattr(t, op)(x, dim=axis)

    def max(
        self, x: Any, axis: int | None = None, *, where: Any = None, initial: Any = None
    ) -> Any:
        return self._reduce(x, axis, where, initial, "amax")

    def min(
        self, x: Any, axis: int | None = None, *, where: Any = None, initial: Any = None
    ) -> Any:
        return self._reduce(x, axis, where, initial, "amin")

    def flatnonzero(self, x: Any) -> Any:
        return self.torch.nonzero(x.reshape(-1)).reshape(-1)

    def errstate(self, **kwargs: str) -> contextlib.AbstractContextManager[None]:
        """torch neither warns nor raises on floating-point events."""
        return contextlib.nullcontext()


_buffers = threading.local()


def scratch(name: str, dtype: np.dtype[Any], n: int, xp: Any = np) -> NDArray[Any]:
    """A flat scratch array of at least ``n`` elements, this thread's own, reused: a
    block's arrays are not allocated afresh (an engine thread's arena would hand them
    back to the system, and every block would fault them in again). On a torch
    device, one per device (its allocator keeps the memory for reuse as well)."""
    if not hasattr(_buffers, "pool"):
        _buffers.pool = {}
    pool: dict[tuple[str, np.dtype[Any], Any], NDArray[Any]] = _buffers.pool
    buf = pool.get((name, dtype, xp))
    if buf is None or buf.shape[0] < n:
        pool.pop((name, dtype, xp), None)  # the old one freed before the larger is made
        buf = pool[(name, dtype, xp)] = xp.empty(n, dtype=dtype)
    return buf[:n]


def release_scratch() -> None:
    """This thread's scratch arrays on torch devices dropped: their memory handed back to its
    allocator when a sweep on it ends (a test suite's GPU keeps no block-sized
    buffer of sdpa's between calls)."""
    if hasattr(_buffers, "pool"):
        for key in [k for k in _buffers.pool if k[2] is not np]:
            del _buffers.pool[key]


def contiguous(x: Any) -> bool:
    """Whether an array is C-contiguous (numpy's flag, torch's method)."""
    return bool(x.is_contiguous()) if is_tensor(x) else bool(x.flags.c_contiguous)
