"""orders: small helpers for a bakery's daily orders."""
