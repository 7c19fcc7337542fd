"""Command line for orders: print the total quantity in a CSV file.

Usage: python -m orders.cli FILE
"""

import csv
import sys

from orders.totals import total_quantity


def read_values(path):
    """The `quantity` column (the second) of the CSV file at `path`, as numbers."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return [int(row[1]) for row in rows]


def main(argv):
    if len(argv) != 1:
        print("usage: python -m orders.cli FILE", file=sys.stderr)
        return 2
    values = read_values(argv[0])
    print(f"total quantity: {total_quantity(values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
