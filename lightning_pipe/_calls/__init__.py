r"""How a step calls the backbone's blocks: the machinery that both the setup and every batch run.

What the setup learns about a step's block calls is a :class:`~lightning_pipe._calls.records.Structure`
(:mod:`lightning_pipe._model.structure` learns it). While a step runs under the pipeline, the backbone's containers
hold :class:`~lightning_pipe._calls.runners.Runner`\ s instead of the blocks
(:class:`~lightning_pipe._calls.runners.BlockRunners`): each block call goes to the run in progress, a
:class:`~lightning_pipe._calls.runners.BlockCalls` whose mode decides what the call does. The setup's analysis and the
``balance="time"`` profile are modes of their own; the per-batch modes (a stage, the last stage's answer) are
:class:`~lightning_pipe._step.program.StepProgram`'s.

- :mod:`~lightning_pipe._calls.records`: what the setup learns (``Structure``, ``BlockIO``, ``HiddenAt``), and the
  hidden state read from and put into a block call where ``HiddenAt`` says;
- :mod:`~lightning_pipe._calls.runners`: the runners, the run modes' base, and the capture mode;
- :mod:`~lightning_pipe._calls.skipped`: what a block that a run skips returns;
- :mod:`~lightning_pipe._calls.stops`: how a run ends early (``Stop``), and the errors of a step that calls the
  backbone other than once;
- :mod:`~lightning_pipe._calls.batch`: the batch's rows, the loss, and the user's step called with logging muted;
- :mod:`~lightning_pipe._calls.blocks`: the backbone's blocks and containers (``Backbone``), whose module tables a run
  swaps for its runners;
- :mod:`~lightning_pipe._calls.flow`: what crosses each stage boundary ([Note: stage boundaries]);
- :mod:`~lightning_pipe._calls.inner`: values that leave a block through a hook inside it ([Note: values from inside
  blocks]);
- :mod:`~lightning_pipe._calls.emptied`: modules the cut left without a parameter, answering ``dtype`` and, while a
  run is in progress, ``parameters()`` ([Note: emptied models]).

Nothing here imports :mod:`lightning_pipe._model`, which uses this package at setup.
"""
