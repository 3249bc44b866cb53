"""Capture: an ``nn.Module`` and example inputs to a joint forward+backward graph.

- :mod:`autopar.capture.joint`: the whole model's joint graph (:func:`capture`), inputs made
  fake from their shapes and dtypes, the model fingerprint;
- :mod:`autopar.capture.stages`: the forward graph with its layer units, its cut into pipeline
  stages and each stage's joint graph;
- :mod:`autopar.capture.layers`: module paths, the repeated blocks, layer units and node phases
  (the one copy of each, read by the planner, the passes and the runtime);
- :mod:`autopar.capture.remat`: which nodes each recomputation policy re-runs.
"""

from autopar.capture.joint import (
    capture, capture_with_export, extract_loss, model_device, model_fingerprint, model_is_fake,
    normalize_inputs, prepare_inputs, to_fake,
)

__all__ = ["capture", "capture_with_export", "extract_loss", "model_device", "model_fingerprint",
           "model_is_fake", "normalize_inputs", "prepare_inputs", "to_fake"]
