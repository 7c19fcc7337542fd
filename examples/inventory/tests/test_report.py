from inventory.report import report_line


def test_report_line():
    assert report_line([3, 4]) == "stock total: 7"
