"""The cart: totals of (price, quantity) lines."""

from shop.taxes import apply_discount


def cart_total(lines, discount=0):
    """Return the sum of price * quantity over `lines`, with `discount` percent off."""
    total = sum(price * quantity for price, quantity in lines)
    return apply_discount(total, discount)
