"""Known target/drafter pairs (targets.toml) and the resolver that matches a model id to one."""

from .resolver import Pair, find_pair, load_pairs

__all__ = ["Pair", "find_pair", "load_pairs"]
