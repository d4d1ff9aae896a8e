"""Algorithm 1 of the paper (seeds/004): the tree, node state, NODEOPT, residuals, weighted sums, the pure node step and the round loop."""
