"""The footer shows the local learner's state live: samples waiting for it, its last cycle
and whether the daemon runs (read from the store and the home, as `learn status` does)."""

import fcntl
import json

from tui_support import make_app, plain, wait_for

SIZE = (140, 40)


def rated_session(store) -> str:
    sid = store.create_session("fix it", "ws", "replay", 0)
    mid = store.add_message(sid, 0, "assistant", "done")
    store.add_sample(sid, 0, mid, [1, 2, 3], [4, 5], [-0.5, -0.25], None, 0)
    store.set_status(sid, "finished")
    store.add_feedback(1, session_id=sid)
    return sid


async def test_footer_follows_waiting_samples_and_the_last_cycle(workspace):
    app = make_app(workspace, [])
    async with app.run_test(size=SIZE) as pilot:
        status = app.query_one("#status-model")
        await wait_for(pilot, lambda: app.store is not None and "learner off" in plain(status))
        rated_session(app.store)
        await wait_for(pilot, lambda: "learner off · 1 waiting" in plain(status),
                       what="1 waiting")
        with app.store.transaction():
            app.store.db.execute(
                "INSERT INTO learner_cycles (status, reason, started_at) VALUES "
                "('rejected', 'regressed: invalid tool calls 0.0 -> 0.5', '2026-01-01')")
        await wait_for(pilot, lambda: "last cycle rejected (regressed: invalid tool calls"
                       in plain(status), what="the rejected cycle")


async def test_footer_says_on_while_a_daemon_holds_the_home(workspace, home):
    app = make_app(workspace, [])
    async with app.run_test(size=SIZE) as pilot:
        status = app.query_one("#status-model")
        await wait_for(pilot, lambda: app.store is not None and "learner off" in plain(status))
        (home / "learner").mkdir(parents=True, exist_ok=True)
        (home / "learner" / "daemon.json").write_text(json.dumps({"pid": 1, "url": None}))
        with open(home / "learner" / "daemon.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            await wait_for(pilot, lambda: "learner on · 0 waiting" in plain(status),
                           what="learner on")
        await wait_for(pilot, lambda: "learner off" in plain(status), what="learner off again")
