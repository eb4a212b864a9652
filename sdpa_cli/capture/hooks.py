"""Where attention calls are caught, for a capture's duration only.

- ``torch.nn.functional.scaled_dot_product_attention`` is replaced by a wrapper on the
  ``torch.nn.functional`` module: every caller that looks it up there when it calls
  (``F.scaled_dot_product_attention(...)``, transformers' ``sdpa`` implementation,
  ``nn.MultiheadAttention``'s slow path) reaches it. A name imported earlier with
  ``from torch.nn.functional import scaled_dot_product_attention`` is not.
- transformers' eager attention: every imported ``transformers.models.*.modeling_*``
  module's ``eager_attention_forward`` is replaced by a wrapper in that module (the
  attention modules look it up in their module's globals at each call, through
  ``ALL_ATTENTION_FUNCTIONS.get_interface(..., eager_attention_forward)``). Modules
  imported after the capture starts (a script that imports transformers) are patched
  as they appear: ``sys.modules`` is scanned again whenever it grew.
- A global forward pre-hook and forward hook on every ``nn.Module`` keep, per thread,
  the stack of modules running, so a call is named by the module it came from
  (``model.layers.3.self_attn``: the innermost module's path in the outermost one).

One call is never recorded twice: a call made while another is being recorded on the
same thread (an eager function that calls torch's SDPA, a wrapper of a wrapper) passes
straight through. Calls under ``torch.compile`` tracing pass through too. Every wrapper
calls the original with the arguments exactly as given, so outputs do not change, and
everything is put back on :meth:`Interceptor.remove`, exception or not.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from sdpa_cli.capture.calls import Call, from_eager, from_torch

EAGER_NAME = "eager_attention_forward"
HF_PREFIX = "transformers.models."

OnCall = Callable[[Any, Callable[[], Call]], None]
"""What a caught call is handed to: ``on_call(module, build)``; ``build()`` makes the
:class:`~sdpa_cli.capture.calls.Call` (only when it is recorded)."""


class Interceptor:
    """The patches and hooks of one capture; :meth:`install`, then :meth:`remove`.

    Args:
        torch: the ``torch`` module.
        on_call: called after each caught call returned, with the module the call
            came from (None outside any module) and a builder of its record.
    """

    def __init__(self, torch: Any, on_call: OnCall) -> None:
        self.torch = torch
        self.on_call = on_call
        self.local = threading.local()
        self.active = False
        self.patched: list[tuple[Any, str, Any, Any]] = []  # (module, attribute, original, wrapper)
        self.handles: list[Any] = []
        self.modules_seen = 0
        self.names: dict[int, tuple[Any, dict[int, str]]] = {}  # id(root) → (root, id → path)

    # --- install and remove ---------------------------------------------------------------

    def install(self) -> None:
        functional = self.torch.nn.functional
        self._patch(functional, "scaled_dot_product_attention", self._torch_wrapper)
        hooks = self.torch.nn.modules.module
        self.handles.append(hooks.register_module_forward_pre_hook(self._enter))
        self.handles.append(hooks.register_module_forward_hook(self._leave, always_call=True))
        self.active = True
        self.scan()

    def remove(self) -> None:
        """Put every original back (the ones still ours) and drop the hooks."""
        self.active = False
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for module, attribute, original, wrapper in reversed(self.patched):
            if vars(module).get(attribute) is wrapper:
                setattr(module, attribute, original)
        self.patched.clear()
        self.names.clear()

    def scan(self) -> None:
        """Patch the eager attention of every transformers modeling module imported
        since the last scan."""
        self.modules_seen = len(sys.modules)
        done = {id(m) for m, *_ in self.patched}
        for name, module in list(sys.modules.items()):
            if not name.startswith(HF_PREFIX) or ".modeling_" not in name or id(module) in done:
                continue
            function = vars(module).get(EAGER_NAME) if hasattr(module, "__dict__") else None
            if callable(function):
                self._patch(module, EAGER_NAME, self._eager_wrapper)

    def _patch(self, module: Any, attribute: str, make: Callable[[Any], Any]) -> None:
        found = getattr(module, attribute)
        # A module imported during the capture may have imported another's patched
        # function (``from ..llama.modeling_llama import eager_attention_forward``):
        # wrap the original, and put the original back.
        original = next((o for *_, o, w in self.patched if w is found), found)
        wrapper = make(original)
        setattr(module, attribute, wrapper)
        self.patched.append((module, attribute, original, wrapper))

    # --- the wrappers ---------------------------------------------------------------------

    def _torch_wrapper(self, original: Any) -> Any:
        @functools.wraps(original)
        def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
            if not self._catching():
                return original(*args, **kwargs)
            self.local.busy = True
            try:
                output = original(*args, **kwargs)
            finally:
                self.local.busy = False
            stack = self._stack()
            module = stack[-1] if stack else None
            self.on_call(module, lambda: from_torch(args, kwargs, output))
            return output

        return scaled_dot_product_attention

    def _eager_wrapper(self, original: Any) -> Any:
        @functools.wraps(original)
        def eager_attention_forward(*args: Any, **kwargs: Any) -> Any:
            if not self._catching():
                return original(*args, **kwargs)
            self.local.busy = True
            try:
                result = original(*args, **kwargs)
            finally:
                self.local.busy = False
            module = args[0] if args else kwargs.get("module")
            self.on_call(module, lambda: from_eager(original, args, kwargs, result))
            return result

        return eager_attention_forward

    def _catching(self) -> bool:
        """Whether a call now is one to record: the capture is on, no recorded call is
        running on this thread, and torch.compile is not tracing."""
        if not self.active or getattr(self.local, "busy", False):
            return False
        compiler = getattr(self.torch, "compiler", None)
        return not (compiler is not None and compiler.is_compiling())

    # --- the module stack -----------------------------------------------------------------

    def _stack(self) -> list[Any]:
        stack: list[Any] | None = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def _enter(self, module: Any, args: Any) -> None:
        self._stack().append(module)
        if len(sys.modules) != self.modules_seen:
            self.scan()

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        stack = self._stack()
        while stack:  # pops to the module, should a forward have skipped its hook
            if stack.pop() is module:
                break

    def path_of(self, module: Any) -> str | None:
        """``module``'s dotted path in the outermost module running on this thread, or
        None when it is not one of its submodules (or nothing runs)."""
        stack = self._stack()
        if module is None or not stack:
            return None
        root = stack[0]
        for attempt in range(2):
            cached = self.names.get(id(root))
            if cached is None or cached[0] is not root or attempt:
                names = {id(m): n for n, m in root.named_modules()}
                cached = self.names[id(root)] = (root, names)
            if id(module) in cached[1]:
                return cached[1][id(module)]
        return None
