"""A strict checkpoint loader: every checkpoint tensor and every element of every parameter is
accounted for, and all problems are reported together. Imports nothing else of the zoo.

    from loader import open_source, plan, load, Rules
    with torch.device("meta"):
        model = MyModel(config)
    report = load(model, "path/or/org-name", rules, dtype=torch.bfloat16, device="cuda")
"""
from loader.load import LoadReport, load, materialize, on_meta
from loader.mapping import Region
from loader.plan import Entry, Plan, RankPlans, TieDecision, lossy, plan, plan_ranks
from loader.problems import LoadError, Problem, SourceError
from loader.rules import Fuse, Ignore, Rename, Rules, Shard, Stack, Tie, Transform
from loader.shard import Parallel
from loader.sources import Source, TensorInfo, open_source

__all__ = ["Entry", "Fuse", "Ignore", "LoadError", "LoadReport", "Parallel", "Plan", "Problem", "RankPlans", "Region",
           "Rename", "Rules", "Shard", "Source", "SourceError", "Stack", "Tie", "TieDecision", "TensorInfo", "Transform",
           "load", "lossy", "materialize", "on_meta", "open_source", "plan", "plan_ranks"]
