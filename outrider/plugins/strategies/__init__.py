"""Built-in drafting strategies: dspark, dflash, lookup, baseline."""
