"""What runs once, at setup: the model as the pipeline sees it.

Finding the backbone (``backbone``), learning how the step calls its blocks (``calls``, ``structure``), splitting
the module into stages (``split``, ``cut``) under the model's own names (``names``), materialising this rank's share
(``materialize``, with activation checkpointing) and profiling it (``profile``, ``untouched``). What every batch runs
too (the backbone's ``Backbone``, the boundaries' ``Flow``, values from inside blocks, emptied modules) is in
:mod:`lightning_pipe._calls`, below this package. Nothing here imports ``_step``, ``checkpoint`` or the strategy.
"""
