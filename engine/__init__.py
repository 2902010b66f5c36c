"""loadplan's torch MoE engine.

`loadplan.engine.loader.load_model` is the single instantiation point: it asks the
registry for this runner's plan, builds the model from it and loads the weights.
Model-file conventions: `loadplan.engine.models`; the entry-class table:
`loadplan.engine.registry`; greedy decoding: `loadplan.engine.generate`.
"""
