"""Tables, figures and latency projections of a lambda sweep's output folder (``alspec-report``).

Modules: ``load`` (the folder as dataclasses), ``table`` (Table 1), ``figures``, ``latency`` (the
Appendix F projection), ``html``, ``build`` (``write_report``), ``cli``. Nothing is
imported here: importing a submodule pulls in only what it needs.
"""
