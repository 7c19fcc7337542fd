"""Totals: small, pure functions."""


def total_quantity(quantities):
    """Return the sum of the quantities."""
    return sum(quantities)


def largest_order(quantities):
    """Return the largest of the quantities (None when empty)."""
    return max(quantities) if quantities else None
