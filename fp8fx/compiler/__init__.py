"""The `torch.compile` backend (`backend`): runs the passes on each captured graph and hands the
result to the inner compiler; `state` keeps delayed-scaling state in the model, and `prepare`
(above the backend, which imports `state`) gives a model that state, created from a trace
(`trace`: what the analysis's runs share with it)."""
