"""Training DFlash drafters in JAX (spec section 7): masks, loss, the jitted step, data, CLI."""
