"""Report lines."""

from inventory.stock import get_stock_total


def report_line(levels):
    """One line of the report: the stock total."""
    value = get_stock_total(levels)
    return f"stock total: {value}"
