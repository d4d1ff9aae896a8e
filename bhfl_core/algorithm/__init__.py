"""Algorithm 1 of the paper (seeds/004).

The tree, node state, NODEOPT, residuals, weighted sums, the pure node step and the round loop.
"""
