"""The torch release gate: verified releases import, tried ones only when asked, others never."""

from __future__ import annotations

import re

import pytest
import torch

from autopar import _torch_private as private


@pytest.mark.parametrize("version, opt_in, outcome", [
    ("2.13.0+cpu", None, "ok"),
    ("2.11.0+cu130", None, "refused"),
    ("2.11.0+cu130", "1", "warned"),
    ("2.9.1", "1", "refused"),
])
def test_torch_release_gate(monkeypatch, version, opt_in, outcome):
    monkeypatch.setattr(torch, "__version__", version)
    if opt_in is None:
        monkeypatch.delenv("AUTOPAR_UNVERIFIED_TORCH", raising=False)
    else:
        monkeypatch.setenv("AUTOPAR_UNVERIFIED_TORCH", opt_in)
    if outcome == "refused":
        with pytest.raises(RuntimeError, match=f"found torch {re.escape(version)}"):
            private.check_torch_version()
    elif outcome == "warned":
        with pytest.warns(RuntimeWarning, match="not verified"):
            private.check_torch_version()
    else:
        private.check_torch_version()
