from shop.cart import cart_total


def test_cart_total():
    assert cart_total([(2.5, 2), (1.0, 3)]) == 8.0


def test_cart_total_with_discount():
    assert cart_total([(10.0, 1)], discount=10) == 9.0
