"""How well a drafter accepts: per block size, against the greedy-continuation ceiling, in
bfloat16 against float32, and the prompt sets measured on."""
