"""The control plane: what runs in the driver process (``ModelGroup``, staged updates, fleets,
the move protocol, worlds, checkpoints). It reaches the workers only through Ray handles."""
