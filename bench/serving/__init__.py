"""`dflash-jax serve` under concurrent clients, and how long the demo and the server take to
start."""
