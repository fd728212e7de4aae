"""Equality of two runs' logged rows when a vLLM engine sampled them (the stop / resume twins)."""


def assert_same_rows(got, want):
    """Every metric equal but those of the engine's own log-probs against the trainer's (their
    distance, ``rollout_logprob_mismatch_*``, and the importance ratio's quantiles,
    ``is_ratio_*`` = exp of their difference): an engine refitted from a checkpoint (a resumed
    run's new engine) samples the same tokens as the one refitted after the update, with
    log-probs that differ in float32 rounding (about 1e-7 on a mean of 1e-7 to 2e-6, measured on
    the one-process and PP 2 twins; a ratio of 1.0 against 0.99999976 at PP 2)."""
    from nemo_d3s.trainer.metrics import is_timing_key

    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for k in set(g) | set(w):
            if is_timing_key(k):
                continue
            if k.startswith(("rollout_logprob_mismatch", "is_ratio_")):
                assert abs(g[k] - w[k]) <= 1e-6, (g["step"], k, g[k], w[k])
            else:
                assert g.get(k) == w.get(k), (g["step"], k, g.get(k), w.get(k))
