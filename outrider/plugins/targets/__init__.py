"""Built-in target families."""
