"""Equality of two runs' logged rows when a vLLM engine sampled them (the stop / resume twins)."""


def assert_same_rows(got, want):
    """Every metric equal but the distance of the engine's own log-probs to the trainer's: an
    engine refitted from a checkpoint (a resumed run's new engine) samples the same tokens as
    the one refitted after the update, with log-probs that differ in float32 rounding (about
    1e-7 on a mean of 1e-7 to 2e-6, measured on the one-process and PP 2 twins)."""
    from nemo_d3s.trainer.metrics import is_timing_key

    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for k in set(g) | set(w):
            if is_timing_key(k):
                continue
            if k.startswith("rollout_logprob_mismatch"):
                assert abs(g[k] - w[k]) <= 1e-6, (g["step"], k, g[k], w[k])
            else:
                assert g.get(k) == w.get(k), (g["step"], k, g.get(k), w.get(k))
