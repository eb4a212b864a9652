"""A recorded call's gradients, for ``capture(backward=True)``: tensor hooks on what the
kernel got and returned, which a backward pass fires.

A hook (``Tensor.register_hook``) on the output as the kernel returned it sees dO, the
gradient flowing into the call's output; one on each input the kernel got (Q, K, V,
and a mask that requires grad) sees that input's gradient: for a tensor autograd made
(a projection's output, after the rotary embedding), the gradient with respect to that
tensor, which is the call's dQ, dK, dV when the tensor is used by this call alone (one
two recorded calls share is awaited by neither). The
hooks return None: the gradients the program computes, and its graph, are unchanged.

Each gradient is copied to the host when it arrives (autograd may reuse its buffer);
when all of a call's have arrived, its hooks are removed and the call is handed on (a
second backward pass through a retained graph records nothing more). The end of each
backward pass that brought gradients is told too, through autograd's queued callbacks,
so the documents are rewritten once per pass, not once per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sdpa_cli.capture.calls import Call

Arrived = Callable[[int, dict[str, Any]], None]
"""Told a call's gradients (its number, the gradients by name, on the host)."""


@dataclass
class _Awaited:
    """One call's hooks (by gradient name) and what they have seen."""

    transposed: bool
    handles: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)
    got: dict[str, Any] = field(default_factory=dict)

    def drop(self, name: str) -> None:
        """Stop awaiting gradient ``name``: its hook removed."""
        self.handles.pop(name).remove()
        del self.tensors[name]


class Gradients:
    """The backward hooks of one capture: :meth:`watch` each recorded call, then
    :meth:`release` at the capture's end.

    Args:
        torch: the ``torch`` module.
        arrived: told each call whose gradients have all arrived (on the thread that
            runs the backward pass).
        pass_ended: told at the end of a backward pass that brought gradients.
    """

    def __init__(self, torch: Any, arrived: Arrived, pass_ended: Callable[[], None]) -> None:
        self.torch = torch
        self.arrived = arrived
        self.pass_ended = pass_ended
        self.lock = threading.Lock()
        self.awaited: dict[int, _Awaited] = {}
        self.queued = False
        self.closed = False

    def watch(self, number: int, call: Call) -> bool:
        """Hook the tensors of call ``number`` whose gradients a backward pass gives;
        whether there were any. A tensor another call awaiting its gradients has hooked
        too (K and V shared by two calls) is dropped from both: its gradient will be the
        sum of theirs, neither call's own."""
        if not call.differentiable:
            return False
        awaited = _Awaited(call.dout_transposed)
        with self.lock:
            for name, tensor in call.differentiable.items():
                shared = [
                    (other, theirs)
                    for other in self.awaited.values()
                    for theirs, hooked in other.tensors.items()
                    if hooked is tensor
                ]
                for other, theirs in shared:
                    other.drop(theirs)
                if not shared:
                    awaited.tensors[name] = tensor
                    awaited.handles[name] = tensor.register_hook(self._hook(number, name))
            self.awaited[number] = awaited
        return True

    def release(self) -> dict[int, dict[str, Any]]:
        """Remove every hook left; the gradients of the calls that got some but not all
        (by call number)."""
        with self.lock:
            self.closed = True
            partial = {}
            for number, awaited in self.awaited.items():
                for handle in awaited.handles.values():
                    handle.remove()
                if awaited.got:
                    partial[number] = awaited.got
            self.awaited.clear()
        return partial

    def _hook(self, number: int, name: str) -> Callable[[Any], None]:
        def hook(grad: Any) -> None:
            self._arrive(number, name, grad)

        return hook

    def _arrive(self, number: int, name: str, grad: Any) -> None:
        with self.lock:
            awaited = self.awaited.get(number)
            if self.closed or awaited is None or name in awaited.got:
                return
            # a copy: autograd may accumulate into the buffer it hands a hook
            host = grad.detach().to("cpu", copy=True)
            if name == "dout" and awaited.transposed:
                host = host.transpose(1, 2)  # as the output is recorded: (B, H, L, Ev)
            awaited.got[name] = host
            done = awaited.got.keys() == awaited.tensors.keys()
            if done:
                for handle in awaited.handles.values():
                    handle.remove()
                del self.awaited[number]
            queue = not self.queued
            self.queued = True
        queued = queue and self._queue_end()
        if done:
            self.arrived(number, awaited.got)
        if queue and not queued:  # no queued callbacks here: the end is told at once
            self._ended()

    def _queue_end(self) -> bool:
        """Ask autograd to call :meth:`_ended` when this backward pass ends; whether it
        took the call."""
        engine = getattr(getattr(self.torch.autograd, "Variable", None), "_execution_engine", None)
        try:
            engine.queue_callback(self._ended)  # type: ignore[union-attr]
        except (AttributeError, RuntimeError):
            return False
        return True

    def _ended(self) -> None:
        with self.lock:
            self.queued = False
            if self.closed:
                return
        self.pass_ended()
