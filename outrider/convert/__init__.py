"""`outrider convert`: any drafter outrider reads, written as a plain DeepSpec checkpoint."""
