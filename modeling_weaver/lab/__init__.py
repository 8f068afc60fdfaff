"""The lab: replay, benchmark, training, training data and the SmolLM2 fetch.

It imports the core (:mod:`modeling_weaver`) and the core never imports it, except the ``weaver`` CLI's lab
subcommands, which import their module only when selected (``tests/test_layout.py`` checks both).
"""
