"""The DFlash drafter: architecture, training sample, loss and metrics."""
