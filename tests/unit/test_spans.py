from kvctl.engines.spans import spans


def test_adjacent_positions_join_and_gaps_split() -> None:
    assert spans([]) == []
    assert spans([4]) == [(4, 5)]
    assert spans([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 7), (9, 10)]
    assert spans(iter([3, 4])) == [(3, 5)]  # any iterable, read once
