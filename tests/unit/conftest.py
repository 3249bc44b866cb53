"""Single-process tests: make ``tests/models.py`` importable; share the Megatron plan."""

import atexit
import os
import shutil
import sys
import tempfile

import pytest

# plans cached by parallelize go to a directory of this test run, not the user's cache
os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-test-cache-")
atexit.register(shutil.rmtree, os.environ["AUTOPAR_CACHE_DIR"], ignore_errors=True)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# GPT with dim=512, batch=2, seq=64, heads=8 (2 layers) on 2 A100s with tp=2: large enough that
# the solver picks Megatron-LM's layout (column-parallel qkv/fc1, row-parallel proj/fc2).
MEGATRON_KW = dict(dim=512, batch=2, seq=64, heads=8)


@pytest.fixture(scope="session")
def megatron_kw():
    """The Megatron GPT's build arguments."""
    return dict(MEGATRON_KW)


@pytest.fixture(scope="session")
def megatron():
    """``(model, inputs, mesh, plan)`` of the Megatron GPT; planned once (a few seconds)."""
    import autopar
    from models import build

    model, inputs = build("gpt", **MEGATRON_KW)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)
    return model, inputs, mesh, autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2))


@pytest.fixture
def model_module(tmp_path, monkeypatch):
    """A ``mymodel.py`` in a fresh working directory whose ``make(batch, seq)`` builds the test
    GPT: the command line's ``mymodel:make`` (its loader adds the working directory to
    ``sys.path``, restored after the test)."""
    (tmp_path / "mymodel.py").write_text(
        "from models import build\n"
        "def make(batch, seq):\n"
        "    return build('gpt', batch=batch, seq=seq)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return "mymodel:make"
