"""The demo pair's recipe, one stage per module; `scripts/make_demo_pair.py` runs it."""
