"""The engine core: hook specifications, plugin manager, the one decode loop, acceptance."""
