"""16-bit activation and 8-bit KV encodings for convert/'s graphs, calibrated on the reserved chat prompts with the verifier's greedy answers."""
