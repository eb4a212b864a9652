"""Real models in: every attention call of a PyTorch or Hugging Face model recorded,
for ``sdpa check --manifest`` to judge them all.

    from sdpa_cli.capture import capture

    with capture("runs/llama", max_bytes=2 << 30) as cap:
        model(**batch)
    # runs/llama/manifest.yaml, runs/llama/calls.yaml, runs/llama/tensors/*.safetensors

    with capture("runs/llama-train", backward=True):
        model(**batch).loss.backward()  # each call's dO, dQ, dK, dV too

Modules: :mod:`~sdpa_cli.capture.hooks` (what is patched and hooked, for the capture's
duration), :mod:`~sdpa_cli.capture.calls` (a call → its tensors and sdpa's options),
:mod:`~sdpa_cli.capture.writer` (safetensors files, the manifest and ``calls.yaml``),
:mod:`~sdpa_cli.capture.backward` (a backward pass's dO, dQ, dK, dV, with ``backward=True``),
:mod:`~sdpa_cli.capture.session` (the bounds, the naming, :func:`capture`),
:mod:`~sdpa_cli.capture.script` (a program run in this process, for ``sdpa capture``).
PyTorch is imported when a capture starts (``pip install torch``).
"""

from sdpa_cli.capture.session import INSTALL_TORCH, Capture, Summary, capture

__all__ = ["INSTALL_TORCH", "Capture", "Summary", "capture"]
