"""The control plane: requests, the scheduler, the block pool and block manager. No torch."""
