"""Network, whereabouts, the all-reduce timer, costs; imports nothing (``network`` needs no torch)."""
