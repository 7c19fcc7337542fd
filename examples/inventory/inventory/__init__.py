"""inventory: stock levels (bundled example: a function to rename across files)."""
