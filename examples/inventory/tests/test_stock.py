from inventory.stock import total_stock


def test_stock_total():
    assert total_stock([1, 2, 3]) == 6
