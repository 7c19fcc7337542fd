"""shop: a tiny shopping cart (bundled example: `cart.py` imports a helper from the wrong module)."""
