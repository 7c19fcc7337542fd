"""Pricing helpers."""


def apply_discount(price, percent):
    """Return `price` reduced by `percent` percent, rounded to 2 decimals."""
    return round(price * (100 - percent) / 100, 2)
