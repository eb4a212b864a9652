"""The numerical core: options and the validated spec, masks, precision, the block
computation, the one block driver, statistics and the backward pass. Pure numpy."""
