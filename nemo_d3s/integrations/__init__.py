"""Integrations: D3S inside other projects' trainers. Beside ``backends/``: imports a third-party
trainer and ``core`` / ``distributed`` / ``errors``, never the run layers. Each is an optional extra
imported by name only (``nemo_d3s.integrations.trl``)."""
