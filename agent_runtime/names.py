"""Names for the words the runtime, the learner and the front ends pass around.

Message kinds (a message's `kind`), session statuses, finish reasons of a model call, feedback
sources (the `feedback.source` column), session origins (the `sessions.origin` column) and the
outcomes of a learning cycle are named here once and used by name everywhere.
This module imports nothing of the project, so the store, the agent loop, the TUI and the
learner can all import it.
"""

from __future__ import annotations

# -- message kinds: why a message is in the conversation (`kind`; none for model turns) -------
KIND_TASK = "task"                         # the session's task, first user message
KIND_USER = "user"                         # a later message the user wrote
KIND_NUDGE = "nudge"                       # the loop's reminder after a turn without a tool call
KIND_SUMMARY = "summary"                   # a segment's summary, opening the next segment
KIND_SUMMARY_REQUEST = "summary_request"   # the loop asking the model for that summary

# -- session statuses --------------------------------------------------------------------------
RUNNING = "running"                        # in progress (or its process died: "interrupted")
FINISHED = "finished"                      # the model called `finish`
FAILED = "failed"                          # an error stopped it
CANCELLED = "cancelled"                    # the user stopped it
BUDGET_EXHAUSTED = "budget_exhausted"      # it ran out of model calls
STATUSES = (RUNNING, FINISHED, FAILED, CANCELLED, BUDGET_EXHAUSTED)

# -- finish reasons of one model call ---------------------------------------------------------
FINISH_STOP = "stop"                       # a stop string ended it
FINISH_EOS = "eos"                         # an end-of-turn token ended it
FINISH_LENGTH = "length"                   # it hit max_new_tokens (or the window)
FINISH_CANCELLED = "cancelled"             # the caller stopped it mid-way
FINISH_LOOP = "loop"                       # it was repeating itself (a degenerate loop)
FINISH_REASONS = (FINISH_STOP, FINISH_EOS, FINISH_LENGTH, FINISH_CANCELLED, FINISH_LOOP)
FINISH_PAUSED = "paused"                     # its batch gave way to waiting calls: it goes on
                                             # in a later batch (never final, never recorded)

# -- feedback sources: who said it ------------------------------------------------------------
EXPLICIT = "explicit"                      # the user's thumbs (command line, TUI)
EDIT_KEPT = "edit_kept"                    # the agent's edits are still in the workspace
EDIT_REVERTED = "edit_reverted"            # the user put the edited files back as they were
FOLLOWUP_DISSATISFIED = "followup_dissatisfied"  # "that's wrong", "undo that" (rules)
RUN_CANCELLED = "run_cancelled"            # the user stopped the run mid-way
PERMISSION_REJECTED = "permission_rejected"  # the user declined a tool call
TESTS_GREEN = "tests_green"                # the session's own last test run passed
RAN_OUT = "ran_out"                        # the agent used every model call, never finished
REPEATED_CALL = "repeated_call"            # a model call repeated an earlier one, same result
FINISHED_FAILING = "finished_failing"      # `finish` while a check it ran still failed
CHECK_FIXED = "check_fixed"                # a check failing before its edits passed after
IMPLICIT_SOURCES = (EDIT_KEPT, EDIT_REVERTED, FOLLOWUP_DISSATISFIED, RUN_CANCELLED,
                    PERMISSION_REJECTED, TESTS_GREEN, RAN_OUT, REPEATED_CALL, FINISHED_FAILING,
                    CHECK_FIXED)
FEEDBACK_SOURCES = (EXPLICIT, *IMPLICIT_SOURCES)   # plugins may declare more (hooks.py)
SOURCE_DESCRIPTIONS = {
    EXPLICIT: "a rating the user gave (command line, TUI, editor)",
    EDIT_KEPT: "the agent's edits were still in the workspace at the next session",
    EDIT_REVERTED: "the user put the files the agent changed back as they were",
    FOLLOWUP_DISSATISFIED: "the user's next message said the agent got it wrong",
    RUN_CANCELLED: "the user stopped the run",
    PERMISSION_REJECTED: "the user declined a tool call the agent proposed",
    TESTS_GREEN: "the session's last test command passed",
    RAN_OUT: "the agent used its whole step budget without finishing",
    REPEATED_CALL: "the agent repeated a tool call it had made, and got the same result",
    FINISHED_FAILING: "the agent said it was done while a check it ran (code or tests) still failed",
    CHECK_FIXED: "a check that failed before the agent's edits passed after them (the same command)",
}

# -- session origins: who made the session -----------------------------------------------------
ORIGIN_USER = "user"                       # a person's run, TUI or editor session
ORIGIN_EVAL = "eval"                       # `apprentice eval` and the learner's gate
ORIGIN_ROLLOUT = "rollout"                 # the learner's own GRPO rollouts
ORIGINS = (ORIGIN_USER, ORIGIN_EVAL, ORIGIN_ROLLOUT)

# -- what a tool result says when the user declined the call (the TUI writes it) --------------
DECLINED_PREFIX = "Not run: the user declined"

# -- learning cycles ----------------------------------------------------------------------------
CYCLE_RUNNING = "running"                  # gathering, training or gating
CYCLE_PUBLISHING = "publishing"            # accepted; the version is being published
CYCLE_PUBLISHED = "published"              # a new version serves
CYCLE_REJECTED = "rejected"                # the gate said no; the serving version stays
CYCLE_EMPTY = "empty"                      # nothing rated to learn from
CYCLE_INTERRUPTED = "interrupted"          # the process died mid-cycle (found on restart)
CYCLE_FAILED = "failed"                    # an error; the serving version stays
CYCLE_STATUSES = (CYCLE_RUNNING, CYCLE_PUBLISHING, CYCLE_PUBLISHED, CYCLE_REJECTED,
                  CYCLE_EMPTY, CYCLE_INTERRUPTED, CYCLE_FAILED)
