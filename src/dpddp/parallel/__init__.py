"""The parallel plumbing: strategies, launcher, launched-rank entry; it imports nothing of the run or entry layers."""
