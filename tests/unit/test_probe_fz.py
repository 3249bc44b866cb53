import sys, os
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
import autopar
from models import build


def test_probe():
    from worker import topology
    model, inputs = build("gpt", dim=48, heads=4, layers=4, tied=0, batch=8, seq=8)
    mesh = autopar.Mesh.virtual(topology("slow-compute"), gpus_per_node=4)
    plan = autopar.plan(model, mesh, inputs)
    print(plan.degrees, plan.axis_names, plan.techniques)
    for k, v in plan.params.items():
        if "blocks.3" in k or "blocks.0" in k:
            print("P", k, v)
    for n, np_ in plan.nodes.items():
        if np_.layer in ("blocks.3",) and ("proj" in np_.module or "view" in np_.op or "transpose" in np_.op or "sdpa" in np_.op.lower() or "attention" in np_.op):
            print("N", n, np_.op, np_.module, np_.phase, np_.outputs, np_.inputs)
