"""The torch release gate: verified releases (2.11-2.13) import, tried ones only when asked,
others never; the release comparison the older-release rules are gated by."""

from __future__ import annotations

import re

import pytest
import torch

from autopar import _torch_private as private


@pytest.mark.parametrize("version, opt_in, outcome", [
    ("2.13.0+cpu", None, "ok"),
    ("2.12.1", None, "ok"),
    ("2.11.0+cu130", None, "ok"),
    ("2.14.0", None, "refused"),
    ("2.14.0", "1", "warned"),  # as if 2.14 were tried (TRIED is empty today)
    ("2.10.0", "1", "refused"),
])
def test_torch_release_gate(monkeypatch, version, opt_in, outcome):
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(private, "TRIED", ("2.14",))
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


@pytest.mark.parametrize("running, release, older", [
    ("2.11", "2.12", True), ("2.11", "2.13", True), ("2.12", "2.12", False), ("2.13", "2.12", False),
    ("2.13", "2.13", False), ("2.9", "2.13", True), ("2.10", "2.9", False),
])
def test_older_than_compares_releases_as_numbers(monkeypatch, running, release, older):
    monkeypatch.setattr(private, "RELEASE", running)
    assert private.older_than(release) is older


def test_compiled_programs_on_2_11_gather_with_the_functional_collective(monkeypatch):
    """2.11's compiler cannot functionalise a gather into a buffer: ``compilable`` gives a copy
    with the functional gather back (the buffer gone) there, and the program as it is on the
    releases that compile it."""
    import torch.fx as fx

    from autopar.passes.gather_buffers import compilable, gather_into_buffers

    ops = torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    gather = g.call_function(ops.all_gather_into_tensor.default, (x, 2, "0"))
    gather.meta["val"] = torch.empty(4, 3)
    g.output(gather)
    buffered = gather_into_buffers(fx.GraphModule(torch.nn.Module(), g))

    def calls(gm: fx.GraphModule) -> list:
        return [n.target for n in gm.graph.nodes if n.op == "call_function"]

    assert calls(buffered) == [torch.ops.aten.empty.memory_format,
                               ops.all_gather_into_tensor_out.default]
    monkeypatch.setattr(private, "RELEASE", "2.13")
    assert compilable(buffered) is buffered
    monkeypatch.setattr(private, "RELEASE", "2.11")
    assert calls(compilable(buffered)) == [ops.all_gather_into_tensor.default]
    assert ops.all_gather_into_tensor_out.default in calls(buffered)  # (a copy was changed)
