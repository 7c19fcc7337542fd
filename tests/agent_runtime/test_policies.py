"""The policies package: imports run one way, and one following-policy catches up before
every model call (`complete`, and `complete_many` where the wrapped policy batches)."""

import ast
from pathlib import Path

from agent_runtime.policies.base import batches, has_weights
from agent_runtime.policies.following import FollowingPolicy

ROOT = Path(__file__).resolve().parents[2] / "agent_runtime"
MODULES = {f"agent_runtime.policies.{p.stem}": p for p in (ROOT / "policies").glob("*.py")
           if p.stem != "__init__"} | {"agent_runtime.context": ROOT / "context.py"}


def imports(path: Path) -> set[str]:
    """Every module `path` imports from the project, function-local imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith(("agent_runtime", "learner", "tui", "plugins"))}


def test_the_policies_and_the_context_import_each_other_one_way():
    graph = {m: {d for d in imports(p) if d in MODULES and d != m} for m, p in MODULES.items()}
    done, path = set(), []

    def visit(module: str) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + [module])}"
        if module in done:
            return
        path.append(module)
        for dep in graph[module]:
            visit(dep)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)
    assert graph["agent_runtime.context"] == {"agent_runtime.policies.base"}


def test_base_imports_nothing_of_the_project():
    assert imports(MODULES["agent_runtime.policies.base"]) == set()


class Counting:
    name, version, context_window = "counting", 1, 4096

    def __init__(self):
        self.calls = []

    def complete(self, messages, tools=None, **kw):
        self.calls.append("complete")
        return "one"


class CountingBatches(Counting):
    def complete_many(self, batch, **kw):
        self.calls.append("complete_many")
        return ["many"] * len(batch)


def test_catch_up_runs_before_every_model_call():
    policy = CountingBatches()
    following = FollowingPolicy(policy, lambda p: p.calls.append("catch_up"))
    assert following.complete([]) == "one"
    assert following.complete_many([[], []]) == ["many", "many"]
    assert policy.calls == ["catch_up", "complete", "catch_up", "complete_many"]
    assert batches(following) and following.name == "counting"


def test_a_policy_that_does_not_batch_is_not_made_to_look_like_one():
    following = FollowingPolicy(Counting(), lambda p: None)
    assert not batches(following) and not hasattr(following, "complete_many")


def test_only_a_policy_with_weights_is_made_to_follow_a_version_server():
    from agent_runtime.policies.replay import ReplayPolicy
    from agent_runtime.subscriber import follow

    class Swappable(Counting):
        model = object()

        def swap_state(self, update, version):
            self.version = version

    replay = ReplayPolicy(["x"])
    assert has_weights(Swappable()) and not has_weights(Counting()) and not has_weights(replay)
    assert follow(replay, "http://127.0.0.1:9", "t") == (replay, None)
