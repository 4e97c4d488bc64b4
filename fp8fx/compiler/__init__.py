"""The `torch.compile` backend (`backend`): runs the passes on each captured graph and hands the
result to the inner compiler; `state` keeps delayed-scaling state in the model."""
