"""Tables, figures and latency projections of a lambda sweep's output folder (``alspec-report``).

Modules: ``load`` (the folder as dataclasses), ``table`` (Table 1), ``figures``, ``latency`` (the
Appendix F projection), ``presets``, ``html``, ``build`` (``write_report``), ``cli``. Nothing is
imported here, so the CLI can report a missing matplotlib in one line.
"""
