"""The transcript's pure helpers: hiding tool-call blocks while streaming, labels, clipping."""

from tui.widgets import call_label, clip, outcome_status, visible_text


def test_visible_text_drops_complete_and_open_tool_call_blocks():
    raw = 'Fixing it.\n<tool_call>\n{"name": "x"}\n</tool_call>\nthen <tool_call>\n{"na'
    assert visible_text(raw) == "Fixing it.\n\nthen"


def test_visible_text_holds_back_a_tag_still_arriving():
    assert visible_text("Reading the file <tool_") == "Reading the file"
    assert visible_text("a < b") == "a < b"


def test_clip_keeps_head_and_tail():
    text = "\n".join(str(i) for i in range(100))
    lines = clip(text, 10).splitlines()
    assert lines[:5] == ["0", "1", "2", "3", "4"] and lines[-5:] == ["95", "96", "97", "98", "99"]
    assert lines[5] == "… (90 more lines)"


def test_call_labels_name_the_call():
    assert call_label("run_command", {"command": "pytest -q"}) == "$ pytest -q"
    assert call_label("edit_file", {"path": "calc.py", "old": "a", "new": "b"}) == "edit_file calc.py"
    assert call_label(None, "garbage") == "invalid tool call"


def test_outcome_status_tells_declined_from_failed():
    assert outcome_status(True, "ok") == "ok"
    assert outcome_status(False, "Not run: the user declined this edit_file call.") == "declined"
    assert outcome_status(False, "Not run: the user cancelled the session") == "cancelled"
    assert outcome_status(False, "edit_file: no match") == "failed"
    assert outcome_status(None, "") == "unknown"


def test_text_batcher_sends_in_order_and_flushes_the_rest():
    from tui.app import TextBatcher
    sent = []
    batcher = TextBatcher(sent.append, interval=3600)
    for chunk in ("a", "b", "c"):
        batcher.add(chunk)
    assert sent == ["a"]                       # the first goes at once, the rest wait
    batcher.flush()
    batcher.flush()
    assert sent == ["a", "bc"]
