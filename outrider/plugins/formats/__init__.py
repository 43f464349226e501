"""Built-in drafter checkpoint formats (packagings)."""
