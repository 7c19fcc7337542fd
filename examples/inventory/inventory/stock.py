"""Stock levels."""


def get_stock_total(levels):
    """Return the sum of the stock levels (0 for an empty list)."""
    total = 0
    for level in levels:
        total += level
    return total
