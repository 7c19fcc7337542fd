"""Tax helpers."""


def add_tax(price, rate):
    """Return `price` with `rate` percent tax added, rounded to 2 decimals."""
    return round(price * (100 + rate) / 100, 2)
