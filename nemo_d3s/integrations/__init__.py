"""Integrations: D3S inside other projects' trainers.

This layer sits beside ``backends/``: it may import a third-party trainer (TRL) and the math
below it (``core``, ``distributed``, ``errors``), never the run layers above (``config``,
``trainer``, ``train``). Each integration is an optional extra (``pip install -e ".[trl]"``)
and is imported by name only (``nemo_d3s.integrations.trl``), so the package imports without
it.
"""
