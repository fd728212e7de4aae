"""vLLM's layer-wise reload warns "<layer>: Failed to load weights" for a layer that got no
tensor in a refit. With tied embeddings the refit sends the embedding alone, so the LM head's
warning came on every refit: it is dropped there (``worker_ext.quiet_tied_head``, around
``finalize_layerwise_reload``), and nowhere else."""

from __future__ import annotations

import logging

import pytest

from nemo_d3s.backends.vllm.worker_ext import RELOAD_LOGGER, quiet_tied_head


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def reload_log():
    log = logging.getLogger(RELOAD_LOGGER)  # the logger vLLM's init_logger(__name__) returns
    handler, level = _Collect(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield log, handler.lines
    log.removeHandler(handler)
    log.setLevel(level)


def _finalize(log):
    """What reload/layerwise.py logs for a tied head and an untouched MLP (its format)."""
    for layer in ("ParallelLMHead", "MergedColumnParallelLinear"):
        log.warning("%s: Failed to load weights", layer)


def test_the_tied_heads_warning_is_dropped_and_only_it(reload_log):
    log, lines = reload_log
    with quiet_tied_head(True):
        _finalize(log)
    assert lines == ["MergedColumnParallelLinear: Failed to load weights"]
    _finalize(log)  # after the refit the filter is gone
    assert lines[1:] == [
        "ParallelLMHead: Failed to load weights",
        "MergedColumnParallelLinear: Failed to load weights",
    ]


def test_an_untied_heads_warning_is_kept(reload_log):
    """Untied, a head that got nothing is a refit that missed a tensor: reported."""
    log, lines = reload_log
    with quiet_tied_head(False):
        _finalize(log)
    assert lines == [
        "ParallelLMHead: Failed to load weights",
        "MergedColumnParallelLinear: Failed to load weights",
    ]
