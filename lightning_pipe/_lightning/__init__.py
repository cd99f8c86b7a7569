"""Adapters to Lightning beyond the ``Strategy`` API, used where Lightning calls in: the strategy's validated
options, the samplers its data loaders get, and the processes Lightning launches. ``PipelineStrategy`` calls them from
its hooks; nothing here imports the strategy.
"""
