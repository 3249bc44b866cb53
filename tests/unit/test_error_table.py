"""docs/errors.md lists bad input and the error each gets; every row names a test. Here: the
table stays true (each named test exists and expects that error), and the rows no other test
covers."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

import autopar
from models import build

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| (\d+) \| (.+?) \| `(\w+)` \| (.+?) \| `(tests/[\w/]+\.py)::(\w+)` \|$")


def _rows() -> list[tuple[str, str, str, str]]:
    rows = [ROW.match(line) for line in (ROOT / "docs" / "errors.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| #") and not line.startswith("| ---")]
    assert all(rows), "a row of docs/errors.md does not parse as | n | input | `Error` | says | `test` |"
    return [(m.group(1), m.group(3), m.group(5), m.group(6)) for m in rows]


def test_every_row_names_a_test_that_expects_its_error():
    rows = _rows()
    assert len(rows) >= 15 and [int(n) for n, *_ in rows] == list(range(1, len(rows) + 1))
    for n, error, path, name in rows:
        tree = ast.parse((ROOT / path).read_text())
        fn = next((f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name),
                  None)
        assert fn is not None, f"row {n}: {path} has no test {name}"
        source = ast.get_source_segment((ROOT / path).read_text(), fn)
        # the test asserts on that error type (by name, or on its message in a job's record)
        assert error in source or (path.startswith("tests/distributed") and "_ok(" in source), \
            f"row {n}: {name} never mentions {error}"
        if error != "SystemExit":
            assert hasattr(autopar, error) or hasattr(builtins, error), (n, error)


def test_batch_not_divisible_by_the_data_parallel_degree():
    model, inputs = build("gpt", batch=3)
    mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2)
    with pytest.raises(autopar.PlanError) as err:
        autopar.plan(model, mesh, inputs, config=autopar.Config(dp=2))
    msg = str(err.value)
    assert "(3, 16)" in msg and "'dp': 2" in msg  # what was given
    assert "divisible by the data-parallel degree" in msg  # and how to fix it


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_mesh_timeout_must_be_positive(bad):
    from autopar.cost_models.topology import get_preset

    with pytest.raises(autopar.MeshError) as err:
        autopar.Mesh(1, 2, get_preset("cpu-gloo"), timeout_s=bad)
    assert f"timeout_s={bad!r}" in str(err.value) and "positive" in str(err.value)
