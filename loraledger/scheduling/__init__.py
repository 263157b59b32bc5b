"""The scheduling policy: which sequences run in the next step, on which KV blocks and adapter slots, and what a step's output ends."""
