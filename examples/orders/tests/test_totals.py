from orders.totals import largest_order, total_quantity


def test_total_quantity():
    assert total_quantity([1, 2, 3]) == 6
    assert total_quantity([]) == 0


def test_largest_order():
    assert largest_order([4, 9, 2]) == 9
    assert largest_order([]) is None
