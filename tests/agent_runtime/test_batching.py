"""Batched completions: `EnginePolicy.complete_many` and `BatchingPolicy` (threads share one
policy; their concurrent calls decode as one batch)."""

import threading

import pytest
import torch

from agent_runtime.agent import Agent, AgentConfig
from agent_runtime.policies.batching import BatchingPolicy
from agent_runtime.policies import Completion, load_policy
from agent_runtime.store import SessionStore
from tiny_checkpoints import save_tiny_agent_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

CONVERSATIONS = [
    [{"role": "user", "content": "Fix calc.py so that add() adds."}],
    [{"role": "system", "content": "You are a test."},
     {"role": "user", "content": "Rename total to amount everywhere, then run the tests."}],
    [{"role": "user", "content": "Hi."}],
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def greedy(ckpt):
    return load_policy(str(ckpt), temperature=0.0, max_new_tokens=12)


def same_completion(a: Completion, b: Completion) -> None:
    assert a.prompt_ids == b.prompt_ids
    assert a.completion_ids == b.completion_ids
    assert a.text == b.text and a.finish_reason == b.finish_reason
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert (a.routes == b.routes).all()


def test_complete_many_gives_each_conversation_what_complete_gives_it(greedy):
    alone = [greedy.complete(m) for m in CONVERSATIONS]
    together = greedy.complete_many(CONVERSATIONS)
    assert len(together) == 3
    for a, b in zip(alone, together):
        same_completion(a, b)


def test_complete_many_streams_each_row_to_its_own_sink(greedy):
    sinks = [[], [], []]
    out = greedy.complete_many(CONVERSATIONS, on_text=[s.append for s in sinks])
    for chunks, c in zip(sinks, out):
        assert "".join(chunks) == c.text


def test_one_rows_should_stop_cancels_that_row_only(greedy):
    out = greedy.complete_many(CONVERSATIONS, should_stop=[None, lambda: True, None])
    assert out[1].finish_reason == "cancelled" and out[1].completion_ids == []
    assert [c.finish_reason for c in (out[0], out[2])] != ["cancelled", "cancelled"]
    same_completion(out[0], greedy.complete(CONVERSATIONS[0]))


def test_complete_many_checks_its_per_row_arguments(greedy):
    with pytest.raises(ValueError, match="3 conversations but 2 tools"):
        greedy.complete_many(CONVERSATIONS, tools=[None, None])
    assert greedy.complete_many([]) == []


def run_threads(policy, calls):
    """Call `policy.complete(*args, **kw)` for every (args, kw) from its own thread, all at once."""
    results: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def one(i):
        args, kw = calls[i]
        barrier.wait()
        try:
            results[i] = policy.complete(*args, **kw)
        except Exception as exc:                     # noqa: BLE001 - checked by the test
            results[i] = exc
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return results


def test_concurrent_calls_run_as_batches_and_each_gets_its_own_answer(greedy):
    shared = BatchingPolicy(greedy, max_batch=8, gather_s=0.05, max_wait_s=1.0)
    calls = [((CONVERSATIONS[i % 3],), {}) for i in range(6)]
    results = run_threads(shared, calls)
    for (args, _), got in zip(calls, results):
        same_completion(got, greedy.complete(*args))
    assert shared.stats.calls == 6
    assert shared.stats.batches < 6                  # some calls shared a batch
    assert max(shared.stats.sizes) > 1


def test_calls_with_different_budgets_go_in_different_batches(greedy):
    shared = BatchingPolicy(greedy, max_batch=8, gather_s=0.05, max_wait_s=1.0)
    calls = [((CONVERSATIONS[0],), {"max_new_tokens": n}) for n in (3, 3, 5, 5)]
    results = run_threads(shared, calls)
    assert [len(c.completion_ids) <= n for c, n in zip(results, (3, 3, 5, 5))] == [True] * 4
    assert shared.stats.batches >= 2 and shared.stats.calls == 4


def test_max_batch_bounds_every_batch(greedy):
    shared = BatchingPolicy(greedy, max_batch=2, gather_s=0.05, max_wait_s=1.0)
    results = run_threads(shared, [((CONVERSATIONS[i % 3],), {}) for i in range(5)])
    assert all(isinstance(r, Completion) for r in results)
    assert max(shared.stats.sizes) <= 2 and shared.stats.calls == 5


class Failing:
    """A policy whose batched call raises: every caller in the batch must see the error."""
    name, version, context_window = "failing", 0, 4096

    def __init__(self):
        self.batches = 0

    def complete_many(self, conversations, tools=None, **kw):
        self.batches += 1
        raise RuntimeError("engine fell over")

    def complete(self, messages, tools=None, **kw):    # a batch of one
        return self.complete_many([messages])[0]


def test_an_error_reaches_every_caller_of_the_batch_and_the_next_batch_still_runs():
    policy = Failing()
    shared = BatchingPolicy(policy, max_batch=8, gather_s=0.05, max_wait_s=1.0)
    results = run_threads(shared, [((CONVERSATIONS[0],), {}) for _ in range(4)])
    assert all(isinstance(r, RuntimeError) and "fell over" in str(r) for r in results)
    before = policy.batches
    with pytest.raises(RuntimeError, match="fell over"):
        shared.complete(CONVERSATIONS[0])            # the wrapper is not wedged
    assert policy.batches == before + 1


class OneAtATime:
    """A policy without complete_many (like the replay policy): called once per call."""
    name, version, context_window = "one", 0, 4096

    def __init__(self):
        self.calls = 0
        self.lock = threading.Lock()

    def complete(self, messages, tools=None, **kw):
        with self.lock:
            self.calls += 1
        return Completion(text=messages[-1]["content"], prompt_ids=[1], completion_ids=[2],
                          logprobs=[0.0])


def test_a_policy_without_complete_many_is_called_once_per_call():
    policy = OneAtATime()
    shared = BatchingPolicy(policy, gather_s=0.05, max_wait_s=1.0)
    results = run_threads(shared, [(([{"role": "user", "content": str(i)}],), {})
                                   for i in range(4)])
    assert sorted(r.text for r in results) == ["0", "1", "2", "3"]
    assert policy.calls == 4


def test_agents_on_threads_share_one_batching_policy(ckpt, tmp_path):
    policy = load_policy(str(ckpt), temperature=1.0, seed=0, max_new_tokens=16)
    shared = BatchingPolicy(policy, max_batch=4, gather_s=0.05, max_wait_s=1.0)
    store = SessionStore(tmp_path / "home")
    results = [None] * 4

    def one(i):
        ws = tmp_path / f"ws{i}"
        ws.mkdir()
        results[i] = Agent(shared, store=store, workspace=ws,
                           config=AgentConfig(max_steps=2)).run(f"Say hello {i}.")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None for r in results)
    assert shared.stats.calls >= 4 and shared.stats.batches < shared.stats.calls
    for r in results:                                # every sample replays to its logprobs
        for s in store.samples(r.session_id):
            ids = torch.tensor([list(s["prompt_ids"]) + list(s["completion_ids"][:-1])])
            with torch.no_grad():
                out = policy.model(ids, routes=torch.as_tensor(s["routes"]).long()[None])
            P = len(s["prompt_ids"])
            lp = out.logits[0, P - 1:].log_softmax(-1)
            lp = lp.gather(-1, torch.tensor(s["completion_ids"])[:, None])[:, 0]
            assert (lp - torch.tensor(s["logprobs"])).abs().max().item() < 1e-4


class Early:
    """Hands every row over at once, then holds the batch until told to end it."""
    name, version, context_window = "early", 0, 4096
    delivers_early = True

    def __init__(self):
        self.release = threading.Event()

    def complete_many(self, conversations, tools=None, *, on_complete=None, **kw):
        out = [Completion(text=c[0]["content"], prompt_ids=[1], completion_ids=[2],
                          logprobs=[0.0]) for c in conversations]
        for i, c in enumerate(out):
            on_complete(i, c)
        assert self.release.wait(30)
        return out

    def complete(self, messages, tools=None, **kw):
        raise AssertionError("the two calls were meant to form one batch")


def test_every_row_handed_over_early_returns_to_its_caller_while_the_batch_runs():
    policy = Early()
    # the batch waits (up to 30 s) until both calls are queued: one batch of two
    shared = BatchingPolicy(policy, max_batch=2, gather_s=30, max_wait_s=30)
    got = {}

    def call(i):
        got[i] = shared.complete([{"role": "user", "content": f"call {i}"}])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for _ in range(600):                # both callers return; none of them decodes the batch
        if len(got) == 2:
            break
        threading.Event().wait(0.05)
    assert {i: c.text for i, c in got.items()} == {0: "call 0", 1: "call 1"}
    assert not policy.release.is_set() and shared._decoder.is_alive()   # the batch still runs
    policy.release.set()
    for t in threads:
        t.join(30)
    assert shared.stats.batches == 1 and shared.stats.calls == 2


def test_the_decoding_thread_ends_when_idle_and_the_next_call_starts_another():
    policy = OneAtATime()
    shared = BatchingPolicy(policy, idle_s=1.0)
    assert shared.complete([{"role": "user", "content": "a"}]).text == "a"
    first = shared._decoder
    assert first is not None and first.is_alive()
    for _ in range(300):
        if shared._decoder is None:
            break
        threading.Event().wait(0.01)
    assert shared._decoder is None and not first.is_alive()
    assert shared.complete([{"role": "user", "content": "b"}]).text == "b"
    assert policy.calls == 2


@pytest.fixture(scope="module")
def long_calls(ckpt):
    """Greedy calls that run to their budget (no loop guard), so a batch is still decoding
    when another call arrives."""
    return load_policy(str(ckpt), temperature=0.0, max_new_tokens=120, loop_span=0)


def test_paused_rows_resumed_in_a_new_batch_give_what_one_call_gives(long_calls):
    alone = [long_calls.complete(m) for m in CONVERSATIONS]
    steps = {"n": 0}

    def after_6_steps(rows):
        steps["n"] += 1
        return steps["n"] > 6

    sinks = [[], [], []]
    first = long_calls.complete_many(CONVERSATIONS[:2], on_text=[s.append for s in sinks[:2]],
                                     should_yield=after_6_steps)
    assert [c.finish_reason for c in first] == ["paused", "paused"]
    states = [c.meta["paused"] for c in first]
    assert all(len(s.generation.tokens) == 7 for s in states)
    again = long_calls.complete_many(CONVERSATIONS, on_text=[s.append for s in sinks],
                                     resume=states + [None])
    for a, b, chunks in zip(alone, again, sinks):
        same_completion(a, b)
        assert "".join(chunks) == b.text


def test_a_batch_gives_way_to_a_call_that_arrives_while_it_decodes(long_calls):
    alone = [long_calls.complete(m) for m in CONVERSATIONS[:2]]
    shared = BatchingPolicy(long_calls, max_batch=8, gather_s=0.001, max_wait_s=0.001,
                            yield_after_s=0.0)
    got, streamed = {}, []
    started = threading.Event()

    def first():
        def sink(text):
            streamed.append(text)
            started.set()
        got[0] = shared.complete(CONVERSATIONS[0], on_text=sink)

    a = threading.Thread(target=first)
    a.start()
    assert started.wait(60)                        # the first call's batch is decoding
    got[1] = shared.complete(CONVERSATIONS[1])     # it pauses; both go on in one batch
    a.join(60)
    same_completion(got[0], alone[0])
    same_completion(got[1], alone[1])
    assert "".join(streamed) == got[0].text
    assert shared.stats.pauses >= 1 and shared.stats.calls == 2
    assert max(shared.stats.sizes) == 2
