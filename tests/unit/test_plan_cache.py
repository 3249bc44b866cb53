"""The plan cache: a second launch reads the plan instead of searching, and anything a plan
depends on changes the key."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar import plan_cache
from autopar.api import _cached_plan
from autopar.capture import capture
from models import build

MESH = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2)


def _key(kind: str = "mlp", mesh=MESH, config=None, passes=(), dtype=None, **kw) -> str:
    model, inputs = build(kind, **kw)
    if dtype is not None:
        model = model.to(dtype)
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    return plan_cache.plan_key(capture(model, inputs, None), mesh, config or autopar.Config(), passes)


def test_the_key_changes_with_anything_a_plan_depends_on():
    base = _key()
    assert _key() == base  # deterministic
    def unchanged(costs, space, topology):  # a cost pass
        return costs

    others = {
        "model": _key(d_hidden=128), "dtype": _key(dtype=torch.float64),
        "mesh": _key(mesh=autopar.Mesh.virtual("cpu-gloo", gpus_per_node=4)),
        "topology": _key(mesh=autopar.Mesh.virtual("a100-dgx", gpus_per_node=2)),
        "config": _key(config=autopar.Config(tp=2)),
        "bucket cap": _key(config=autopar.Config(bucket_bytes=0)),
        "cost pass": _key(passes=[unchanged]),
    }
    assert base not in others.values() and len(set(others.values())) == len(others), others
    assert _key("gpt", batch=16) != _key("gpt", batch=8)  # the input shapes


def test_second_launch_reads_the_plan_and_skips_the_search(tmp_path, monkeypatch):
    import autopar.api as api

    model, inputs = build("gpt")
    traced = capture(model, inputs, None)
    calls = []
    real = api.plan_model
    monkeypatch.setattr(api, "plan_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    first, how = _cached_plan(traced, MESH, autopar.Config(), (), model, inputs, tmp_path)
    assert how == "miss" and len(calls) == 1
    again, how = _cached_plan(traced, MESH, autopar.Config(), (), model, inputs, tmp_path)
    assert how == "hit" and len(calls) == 1  # no search the second time
    assert again.digest() == first.digest() and again.predicted == first.predicted
    # another config is another entry; no cache at all plans every time
    _, how = _cached_plan(traced, MESH, autopar.Config(tp=2), (), model, inputs, tmp_path)
    assert how == "miss" and len(calls) == 2
    _, how = _cached_plan(traced, MESH, autopar.Config(), (), model, inputs, False)
    assert how == "off" and len(calls) == 3


def test_a_corrupt_entry_is_planned_again_with_a_warning(tmp_path):
    model, inputs = build("mlp")
    traced = capture(model, inputs, None)
    key = plan_cache.plan_key(traced, MESH, autopar.Config())
    (tmp_path / f"{key}.json").write_text("{ not json")
    with pytest.warns(UserWarning, match="ignoring the cached plan"):
        plan, how = _cached_plan(traced, MESH, autopar.Config(), (), model, inputs, tmp_path)
    assert how == "miss"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rewritten: read back without a warning
        assert plan_cache.load_cached(tmp_path, key).digest() == plan.digest()


def test_where_the_cache_lives(tmp_path, monkeypatch):
    assert plan_cache.cache_dir(False) is None
    assert plan_cache.cache_dir(tmp_path) == tmp_path
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    assert plan_cache.cache_dir() == tmp_path / "plans" == plan_cache.cache_dir(True)
    monkeypatch.setenv("AUTOPAR_PLAN_CACHE", "0")
    assert plan_cache.cache_dir() is None
    monkeypatch.delenv("AUTOPAR_PLAN_CACHE")
    monkeypatch.delenv("AUTOPAR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert plan_cache.cache_dir() == tmp_path / "xdg" / "autopar" / "plans"
