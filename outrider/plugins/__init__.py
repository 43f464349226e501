"""Built-in plugins, registered explicitly so a source checkout works without installation."""

from .formats import deepspec, zlab
from .strategies import baseline, dflash, dspark, lookup
from .targets import dense, fallback, hybrid, sliding

BUILTIN = [dense, hybrid, sliding, fallback, deepspec, zlab, dspark, dflash, lookup, baseline]
