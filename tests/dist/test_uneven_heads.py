

def _even_split_takes_the_equal_all_to_all(cases: list[dict]) -> None:
    from lightning_fpdt.sequence import all_to_all

    def refuse(*args, **kwargs):
        raise AssertionError("an even head split went through the all-to-all of unequal blocks")

    saved = all_to_all._exchange_uneven
    all_to_all._exchange_uneven = refuse
    try:
        run_attention_cases(cases)
    finally:
        all_to_all._exchange_uneven = saved


def test_even_split_keeps_the_equal_all_to_all(dist_pool):
    """When P divides the heads (kv heads scattered or replicated) the attention never takes the unequal all-to-all."""
    cases = [dict(seq_len=4 * 2 * 3, num_chunks=2, heads=heads, dtype=torch.float64, backend="math", seed=n)
             for n, heads in enumerate([(8, 8), (8, 4), (8, 2)])]
    dist_pool(4).run(_even_split_takes_the_equal_all_to_all, cases=cases)
